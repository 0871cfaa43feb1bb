"""Documents of ``--data`` inputs: text, jsonl, parquet, ``datasets`` directories, or
directories of those (docs/forecast.md, Data).
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
    """Whether ``path`` is a ``datasets`` ``save_to_disk`` directory."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or ((path / "dataset_info.json").is_file() and (path / "state.json").is_file()))


def read_jsonl(path: Path, column: str) -> list[str]:
    """The string field ``column`` of each non-empty line (SpardaError names ``path:line`` otherwise)."""
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
    """The non-null rows of string column ``column`` (SpardaError: no ``pyarrow``, unreadable, no column)."""
    _need("pyarrow", "parquet", f"parquet ({path})")
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses
        raise SpardaError(f"cannot read --data {path} as parquet: {str(exc).splitlines()[0]}") from exc
    _column(parquet.schema_arrow.names, column, path)
    return _strings(parquet.read(columns=[column]).column(column).to_pylist(), column, path)


def read_hf_dataset(path: Path, column: str) -> list[str]:
    """The rows of ``column`` of a ``load_from_disk`` directory (a ``DatasetDict``: ``train`` or its
    only split). SpardaError: no ``datasets``, several splits but no ``train``, or no column."""
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
    """Documents of one file by suffix: jsonl, parquet, else the whole text."""
    if path.suffix == ".jsonl":
        return read_jsonl(path, column)
    if path.suffix == ".parquet":
        return read_parquet(path, column)
    return [read_text(path, "--data")]


def read_documents(paths, column: str = "text") -> list[str]:
    """The non-empty documents of ``paths`` (files and directories), in order.

    Raises:
        SpardaError: a missing path or column, an empty directory, an unreadable file, a
            missing optional library, or no text.
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
