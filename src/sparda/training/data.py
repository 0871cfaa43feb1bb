"""Training text for the Forecast: files, directories or jsonl, packed into fixed-length sequences.

Default: the bundled training split (:func:`sparda.data.train_texts`, five Austen
novels); the held-out Emma is never read here.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparda.errors import SpardaError
from sparda.io import read_text



def _read_file(path: Path) -> list[str]:
    raw = read_text(path, "--data")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                texts.append(json.loads(line)["text"])
            except (ValueError, KeyError, TypeError) as exc:
                raise SpardaError(f"{path}:{number} is not a JSON object with a 'text' field") from exc
        return texts
    return [raw]


def load_texts(paths: list[str] | tuple[str, ...] | None) -> tuple[list[str], str]:
    """Documents from text files, directories of them (recursively ``*.txt``, ``*.md``,
    ``*.jsonl``) or jsonl files with a ``text`` field; ``None``/empty -> the bundled split.

    Returns ``(documents, description)``. Raises SpardaError for a missing path or no text.
    """
    if not paths:
        from sparda.data import TRAIN_TEXTS, train_texts

        return train_texts(), "bundled Austen training split: " + ", ".join(TRAIN_TEXTS)
    texts: list[str] = []
    for item in paths:
        path = Path(item).expanduser()
        if not path.exists():
            raise SpardaError(f"training data not found: {path}; pass text files, directories or jsonl")
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in {".txt", ".md", ".jsonl"}) \
            if path.is_dir() else [path]
        for file in files:
            texts.extend(_read_file(file))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise SpardaError(f"no text found in {', '.join(map(str, paths))}")
    return texts, "files: " + ", ".join(map(str, paths))


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise documents, join them with EOS and cut into ``[num_seq, seq_len]`` int64.

    Raises SpardaError if there are fewer than ``seq_len`` tokens in total.
    """
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(eos)
    num = len(ids) // seq_len
    if num == 0:
        raise SpardaError(f"the training data has {len(ids)} tokens, fewer than --seq-len {seq_len}")
    return torch.tensor(ids[:num * seq_len], dtype=torch.long).view(num, seq_len)


class Batches:
    """Endless seeded shuffled batches ``[batch, seq_len]`` over packed sequences."""

    def __init__(self, sequences: torch.Tensor, batch_size: int, seed: int) -> None:
        self.sequences, self.batch_size = sequences, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> torch.Tensor:
        """The next batch ``[batch, seq_len]`` (dtype of ``sequences``, int64 token ids from
        :func:`pack`); reshuffles after each pass, seeded."""
        picked = []
        while len(picked) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(len(self.sequences), generator=self.gen).tolist()
            picked.append(self.order.pop())
        return self.sequences[picked]
