"""Forecast training sequences: documents tokenised, packed with EOS, cut to ``seq_len`` and
drawn in a seeded, resumable order (docs/forecast.md). Default: the bundled training split.
"""

from __future__ import annotations

import numpy as np
import torch

from sparda.errors import SpardaError
from sparda.training.sources import read_documents


def load_texts(paths, text_column: str = "text") -> tuple[list[str], str]:
    """``(documents, description)`` of ``paths``, or of the bundled training split if empty
    (SpardaError: :func:`~sparda.training.sources.read_documents`)."""
    if not paths:
        from sparda.data import TRAIN_TEXTS, train_texts

        return train_texts(), "bundled Austen training split: " + ", ".join(TRAIN_TEXTS)
    return read_documents(paths, text_column), "files: " + ", ".join(map(str, paths))


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Documents joined with EOS, cut into ``[num_seq, seq_len]`` int64, tail dropped (SpardaError:
    fewer than ``seq_len`` tokens)."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    pieces, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces.append(np.asarray(ids + [eos], dtype=np.int32))
        total += len(ids) + 1
    num = total // seq_len
    if num == 0:
        raise SpardaError(f"the training data has {total} tokens, fewer than --seq-len {seq_len}; "
                          "add data or lower --seq-len")
    flat = np.concatenate(pieces)[:num * seq_len]
    return torch.from_numpy(flat.astype(np.int64)).view(num, seq_len)


class Batches:
    """Endless seeded shuffled batches of sequence indices, resumable bit for bit (docs/forecast.md)."""

    def __init__(self, num_sequences: int, batch_size: int, seed: int) -> None:
        if num_sequences < 1:
            raise SpardaError("no training sequences")
        self.num_sequences, self.batch_size = num_sequences, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        """The next global batch: ``batch_size`` sequence indices."""
        picked = []
        while len(picked) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(self.num_sequences, generator=self.gen).tolist()
            picked.append(self.order.pop())
        return picked

    def state_dict(self) -> dict:
        """``{"gen": ByteTensor, "order": list[int]}``."""
        return {"gen": self.gen.get_state(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.gen.set_state(state["gen"].cpu())  # a state loaded onto CUDA: set_state needs a CPU ByteTensor
        self.order = list(state["order"])
