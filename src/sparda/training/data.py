"""Training sequences for the Forecast: documents tokenised, packed with EOS and cut to
``seq_len`` tokens, then drawn in a seeded, resumable order.

Default data: the bundled training split (:func:`sparda.data.train_texts`, five Austen
novels); the held-out Emma is never read here. Other inputs: :mod:`sparda.training.sources`.
"""

from __future__ import annotations

import numpy as np
import torch

from sparda.errors import SpardaError
from sparda.training.sources import read_documents


def load_texts(paths, text_column: str = "text") -> tuple[list[str], str]:
    """Documents of ``paths`` (:func:`sparda.training.sources.read_documents`); ``None`` or
    empty -> the bundled training split.

    Returns ``(documents, description)``. Raises SpardaError for a missing path, a missing
    column or optional library, or no text.
    """
    if not paths:
        from sparda.data import TRAIN_TEXTS, train_texts

        return train_texts(), "bundled Austen training split: " + ", ".join(TRAIN_TEXTS)
    return read_documents(paths, text_column), "files: " + ", ".join(map(str, paths))


def pack(texts: list[str], tokenizer, seq_len: int) -> torch.Tensor:
    """Tokenise documents, join them with EOS and cut into ``[num_seq, seq_len]`` int64.

    A document shorter than ``seq_len`` shares its sequence with the next ones (EOS
    between them); a longer one is split across consecutive sequences. The tail that does
    not fill a whole sequence is dropped. Token ids are held as int32 while packing (a
    100M-token corpus takes 400 MB, not Python lists' ~3.6 GB).

    Raises SpardaError if there are fewer than ``seq_len`` tokens in total.
    """
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
    """Endless seeded shuffled batches of sequence indices; resumable bit for bit.

    Each pass over the ``num_sequences`` packed sequences is a fresh ``torch.randperm``
    from one seeded generator; a batch takes the next ``batch_size`` indices (crossing
    into the next pass when one ends). :meth:`state_dict` / :meth:`load_state_dict` carry
    the generator and the rest of the current pass, so a resumed run draws the same
    batches as an uninterrupted one. Data-parallel ranks all draw the same global batch
    and each takes its own disjoint slice of it.
    """

    def __init__(self, num_sequences: int, batch_size: int, seed: int) -> None:
        if num_sequences < 1:
            raise SpardaError("no training sequences")
        self.num_sequences, self.batch_size = num_sequences, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def next(self) -> list[int]:
        """The next global batch: ``batch_size`` sequence indices (host ints)."""
        picked = []
        while len(picked) < self.batch_size:
            if not self.order:
                self.order = torch.randperm(self.num_sequences, generator=self.gen).tolist()
            picked.append(self.order.pop())
        return picked

    def state_dict(self) -> dict:
        """``{"gen": ByteTensor, "order": list[int]}``: everything the next draw depends on."""
        return {"gen": self.gen.get_state(), "order": list(self.order)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.gen.set_state(state["gen"].cpu())  # a state loaded onto CUDA: set_state needs a CPU ByteTensor
        self.order = list(state["order"])
