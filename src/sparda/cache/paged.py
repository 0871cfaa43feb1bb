"""The block table of the offloaded cache's host store (design §6).

The host store is a pool of ``P`` pages per offloaded layer (a page is one KV block of
``block_size`` tokens, for every KV head). :class:`BlockTable` maps a row's logical block
``n`` to its page; ``-1`` is unassigned. The default (no page count) is the identity: row
``b``'s block ``n`` is page ``b * N + n``, so every row owns a whole ``capacity`` of pages.
The engine's allocator assigns pages (:meth:`BlockTable.assign`); the table lives on the
device the cache serves (the kernels read it; updated in place, so a captured CUDA graph sees
it) with a host mirror for the Python paths (prefill writes and read-backs).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sparda.errors import SpardaError


class BlockTable:
    """Page of each (row, logical block) of a host pool.

    Args:
        batch, num_blocks: ``B`` rows of ``N`` logical blocks.
        pages: ``P`` pages in the pool; ``None``: ``B * N`` and the identity table.
        device: where :attr:`table` lives (the device the cache serves).
    Attributes:
        pages: ``P``. table: ``[B, N]`` int32 on ``device``. host: ``[B, N]`` int32 numpy mirror.
    Raises:
        SpardaError: ``pages < 1``.
    """

    def __init__(self, batch: int, num_blocks: int, pages: int | None, device: torch.device | str) -> None:
        self.batch, self.num_blocks = batch, num_blocks
        if pages is None:
            self.pages = batch * num_blocks
            self.host = np.arange(self.pages, dtype=np.int32).reshape(batch, num_blocks)
        else:
            if int(pages) < 1:
                raise SpardaError(f"host_blocks must be at least 1, got {pages}")
            self.pages = int(pages)
            self.host = np.full((batch, num_blocks), -1, dtype=np.int32)
        self.table = torch.from_numpy(self.host.copy()).to(device)

    @classmethod
    def identity(cls, batch: int, num_blocks: int, device: torch.device | str) -> "BlockTable":
        """The identity table of ``batch`` rows x ``num_blocks`` blocks."""
        return cls(batch, num_blocks, None, device)

    def _row(self, row: int) -> int:
        if not 0 <= int(row) < self.batch:
            raise SpardaError(f"row {row} is outside the cache's {self.batch} rows")
        return int(row)

    def assign(self, row: int, pages: Sequence[int]) -> None:
        """Row ``row``'s logical blocks ``0 .. len(pages) - 1`` map to ``pages``, the rest to ``-1``.

        Raises:
            SpardaError: ``row`` outside the cache, more pages than ``N``, a page outside
                ``[0, P)`` or the same page twice.
        """
        row = self._row(row)
        ids = np.asarray(list(pages), dtype=np.int64).reshape(-1)
        if ids.size > self.num_blocks:
            raise SpardaError(f"assign_blocks: {ids.size} pages for row {row} exceed its {self.num_blocks} blocks")
        bad = ids[(ids < 0) | (ids >= self.pages)]
        if bad.size:
            raise SpardaError(f"assign_blocks: page {int(bad[0])} is outside the host pool's {self.pages} pages")
        if np.unique(ids).size != ids.size:
            raise SpardaError(f"assign_blocks: row {row} was given a page twice")
        self.host[row] = -1
        self.host[row, :ids.size] = ids
        self._upload(row)

    def release(self, row: int) -> None:
        """Every block of ``row`` unassigned (``-1``).

        Raises:
            SpardaError: ``row`` outside the cache.
        """
        row = self._row(row)
        self.host[row] = -1
        self._upload(row)

    def _upload(self, row: int) -> None:
        self.table[row].copy_(torch.from_numpy(self.host[row].copy()))

    def lookup(self, row: int, first: int, last: int) -> np.ndarray:
        """Pages ``[last - first + 1]`` int64 of ``row``'s blocks ``first .. last`` (host mirror).

        Raises:
            SpardaError: one of them is unassigned (internal: the allocator assigns a row's
                pages before its prefill writes them).
        """
        pages = self.host[self._row(row), first:last + 1].astype(np.int64)
        missing = np.flatnonzero(pages < 0)
        if missing.size:
            raise SpardaError(f"row {row} block {first + int(missing[0])} has no host page "
                              "(internal: assign_blocks before the row's prefill)")
        return pages

    def check_disjoint(self) -> None:
        """Debug helper: no page is held by two (row, block) entries.

        Raises:
            SpardaError: a page held twice (named).
        """
        held = self.host[self.host >= 0]
        pages, counts = np.unique(held, return_counts=True)
        if (counts > 1).any():
            raise SpardaError(f"host page {int(pages[counts > 1][0])} is held by more than one block")
