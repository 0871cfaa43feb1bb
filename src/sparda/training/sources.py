"""Where Forecast training text comes from: the documents of a user's files and datasets.

Accepted ``--data`` inputs (repeatable, mixed freely):

* a UTF-8 text file (``.txt``, ``.md`` or any other suffix): one document;
* a jsonl file: one document per line, from the ``--text-column`` field (default ``text``);
* a parquet file: one document per row of the ``--text-column`` column (needs ``pyarrow``,
  the ``sparda[parquet]`` extra);
* a directory saved by Hugging Face ``datasets`` (``Dataset.save_to_disk``, recognised by
  its ``dataset_info.json``/``state.json`` or ``dataset_dict.json``): one document per row
  of ``--text-column``, from the ``train`` split of a ``DatasetDict`` (needs ``datasets``,
  the ``sparda[datasets]`` extra);
* any other directory: every ``*.txt``, ``*.md``, ``*.jsonl`` and ``*.parquet`` below it,
  in sorted path order.

Documents come back in input order; empty documents are dropped. Every problem (a missing
path, a missing column, a missing optional library) is one :class:`SpardaError` raised
before any model loads.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from sparda.errors import SpardaError
from sparda.io import read_text

#: file suffixes read from a plain directory
DIRECTORY_SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


def _need(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise SpardaError(f"reading {what} needs the '{module}' package; install it with "
                          f"pip install 'sparda[{extra}]' (or pip install {module})")


def is_hf_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``datasets``' ``save_to_disk``."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()))


def read_jsonl(path: Path, column: str) -> list[str]:
    """Documents of a jsonl file: the string field ``column`` of each non-empty line.

    Raises SpardaError naming ``path:line`` for a line that is not a JSON object with a
    string ``column`` field.
    """
    texts = []
    for number, line in enumerate(read_text(path, "--data").splitlines(), 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)[column]
        except (ValueError, KeyError, TypeError) as exc:
            raise SpardaError(f"{path}:{number} is not a JSON object with a {column!r} field; "
                              "fix the line or pass the field name with --text-column") from exc
        if not isinstance(value, str):
            raise SpardaError(f"{path}:{number}: field {column!r} is {type(value).__name__}, not text; "
                              "pass a text field with --text-column")
        texts.append(value)
    return texts


def _column(names: list[str], column: str, where: Path) -> None:
    if column not in names:
        raise SpardaError(f"{where} has no column {column!r} (columns: {', '.join(names) or 'none'}); "
                          "pass the text column with --text-column")


def _strings(values, column: str, where: Path) -> list[str]:
    texts = [v for v in values if v is not None]
    if any(not isinstance(v, str) for v in texts):
        raise SpardaError(f"{where}: column {column!r} does not hold text; pass a text column with --text-column")
    return texts


def read_parquet(path: Path, column: str) -> list[str]:
    """Documents of a parquet file: the rows of its string column ``column`` (nulls skipped).

    Raises SpardaError: ``pyarrow`` missing (names the ``sparda[parquet]`` extra), an
    unreadable file, or no such column.
    """
    _need("pyarrow", "parquet", f"parquet ({path})")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise SpardaError(f"cannot read --data {path} as parquet: {str(exc).splitlines()[0]}") from exc
    _column(parquet.schema_arrow.names, column, path)
    return _strings(parquet.read(columns=[column]).column(column).to_pylist(), column, path)


def read_hf_dataset(path: Path, column: str) -> list[str]:
    """Documents of a ``datasets.load_from_disk`` directory: the rows of ``column``; of a
    ``DatasetDict``, its ``train`` split (or its only split).

    Raises SpardaError: ``datasets`` missing (names the ``sparda[datasets]`` extra), a
    ``DatasetDict`` with several splits but no ``train``, or no such column.
    """
    _need("datasets", "datasets", f"the Hugging Face datasets directory {path}")
    import datasets

    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError / its own errors
        raise SpardaError(f"cannot load --data {path} with datasets.load_from_disk: "
                          f"{str(exc).splitlines()[0]}") from exc
    if isinstance(data, datasets.DatasetDict):
        splits = list(data)
        if "train" not in data and len(splits) != 1:
            raise SpardaError(f"{path} holds the splits {', '.join(splits)} but no 'train'; "
                              "pass the split's own directory (e.g. DIR/" + splits[0] + ")")
        data = data["train" if "train" in data else splits[0]]
    _column(list(data.column_names), column, path)
    return _strings(data[column], column, path)


def read_file(path: Path, column: str) -> list[str]:
    """Documents of one file, by suffix: jsonl, parquet, else the whole file as text."""
    if path.suffix == ".jsonl":
        return read_jsonl(path, column)
    if path.suffix == ".parquet":
        return read_parquet(path, column)
    return [read_text(path, "--data")]


def read_documents(paths, column: str = "text") -> list[str]:
    """Documents of every input in ``paths`` (see the module docstring), in order.

    Args:
        paths: files and directories (``str`` or ``Path``). column: the text field of
            jsonl, parquet and ``datasets`` inputs.
    Returns: the non-empty documents (``str``).
    Raises:
        SpardaError: a missing path, a directory without text files, an unreadable file,
            a missing column, a missing optional library, or no text at all.
    """
    texts: list[str] = []
    for item in paths:
        path = Path(item).expanduser()
        if not path.exists():
            raise SpardaError(f"training data not found: {path}; pass text/jsonl/parquet files, "
                              "directories or a datasets directory")
        if is_hf_dataset_dir(path):
            texts.extend(read_hf_dataset(path, column))
            continue
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in DIRECTORY_SUFFIXES)
            if not files:
                raise SpardaError(f"--data {path} holds no {', '.join(DIRECTORY_SUFFIXES)} files")
        else:
            files = [path]
        for file in files:
            texts.extend(read_file(file, column))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise SpardaError(f"no text found in {', '.join(map(str, paths))}")
    return texts
