"""Output files: checked before any work, written through a temporary file and an atomic rename.

Every file sparda writes (Forecast weights and checkpoints, eval and bench reports,
selection traces) goes through :func:`atomic_output`: the data land in a hidden
temporary file beside the target, which replaces the target with ``os.replace`` only
once it is complete. A reader never sees a half-written file, and a failure (an
exception, a full disk) removes the temporary file. :func:`check_output_file` and
:func:`check_output_dir` let a command refuse a bad output path before it loads a
model or trains, with one line that names the option and the fix.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from sparda.errors import SpardaError

_REASONS = {
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.ENOTDIR: "a parent path is a file, not a directory",
    errno.ENAMETOOLONG: "the name is too long",
}


def os_reason(exc: OSError) -> str:
    """A short lower-case reason for an :class:`OSError`, without the ``[Errno N]`` prefix."""
    reason = _REASONS.get(exc.errno or -1)
    if reason:
        return reason
    return (exc.strerror or type(exc).__name__).lower()


@contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it onto ``path`` when the block succeeds.

    The temporary file is hidden (``.NAME.tmpPID``) and in the same directory, so the
    rename is atomic. On any exception it is removed and the exception propagates;
    ``path`` then keeps its old content (or stays absent).

    Raises:
        SpardaError: the directory cannot hold a new file (names the path and the reason).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        raise SpardaError(f"cannot write {path}: {os_reason(exc)}") from exc
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically, fsynced before the rename.

    Raises:
        SpardaError: the file cannot be written (see :func:`atomic_output`).
    """
    with atomic_output(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data.encode("utf-8") if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if parent.exists():
            return parent
    return Path(".")  # pragma: no cover - the root always exists


def _probe(directory: Path, what: str) -> None:
    """Create and delete a temporary file in ``directory``: the only test a read-only
    mount, a permission or a full quota cannot fool."""
    try:
        fd, name = tempfile.mkstemp(dir=directory, prefix=".sparda-probe-")
    except OSError as exc:
        raise SpardaError(f"cannot write {what}: no file can be created in {directory} ({os_reason(exc)}); "
                          "choose a writable location") from exc
    os.close(fd)
    os.unlink(name)


def check_output_file(path: str | os.PathLike, option: str = "--out", example: str = "out") -> Path:
    """Check, without writing anything, that ``path`` can become a file.

    ``path`` must not be a directory, and its nearest existing parent must be a
    writable directory (missing parents are created later by the writer).

    Args:
        path: the output file. option: the CLI option named in messages; example: a file
            name suggested inside ``path`` when it is a directory.
    Returns:
        ``path`` as a :class:`Path` (``~`` expanded).
    Raises:
        SpardaError: ``path`` is empty or a directory, a parent is a file, or the
            location is read-only or not writable.
    """
    if not str(path).strip():
        raise SpardaError(f"empty {option}; pass a file path")
    path = Path(path).expanduser()
    if path.is_dir():
        raise SpardaError(f"{option} {path} is a directory; pass a file path such as {path / example}")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise SpardaError(f"{option} {path}: {parent} is a file, not a directory; choose another path")
    _probe(parent, f"{option} {path}")
    return path


def check_output_dir(path: str | os.PathLike, option: str = "--out") -> Path:
    """Check, without creating anything, that ``path`` is (or can become) a writable directory.

    Returns:
        ``path`` as a :class:`Path` (``~`` expanded).
    Raises:
        SpardaError: ``path`` is empty or an existing file, a parent is a file, or the
            location is read-only or not writable.
    """
    if not str(path).strip():
        raise SpardaError(f"empty {option}; pass a directory path")
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise SpardaError(f"{option} {path} is a file, not a directory; pass a directory path")
    parent = _nearest_existing(path)
    if not parent.is_dir():
        raise SpardaError(f"{option} {path}: {parent} is a file, not a directory; choose another path")
    _probe(parent, f"{option} {path}")
    return path


def read_text(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of a user's input file.

    Args:
        path: the file. option: the CLI option (or role) named in messages, e.g. ``--text``.
    Raises:
        SpardaError: the file cannot be read, or is not UTF-8 text; the message names the
            option and the file, never a raw ``[Errno N]``.
    """
    try:
        with open(Path(path).expanduser(), encoding="utf-8") as handle:
            return handle.read()
    except UnicodeDecodeError as exc:
        raise SpardaError(f"{option} {path} is not UTF-8 text (byte {exc.start} is not valid); "
                          "convert it, e.g. with iconv -t UTF-8") from exc
    except OSError as exc:
        raise SpardaError(f"cannot read {option} {path}: {os_reason(exc)}") from exc
