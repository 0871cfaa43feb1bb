"""The free list of a paged KV cache's blocks (design §3.11).

A paged cache (the offloaded host store) holds ``num_blocks`` KV blocks of ``block_size``
tokens; a request gets the blocks of its prompt plus ``max_tokens`` when it is admitted
and gives them back when it finishes, so memory follows what requests need, not rows of
``max_model_len``. :class:`BlockPool` hands out the lowest free block ids first, so a
request admitted into a pool with no holes gets one run of consecutive blocks (its
prefill writes are then a few long copies, not one per block).
"""

from __future__ import annotations

import heapq

from sparda.errors import SpardaError


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold ``tokens`` tokens: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


class BlockPool:
    """``num_blocks`` KV block ids ``0 .. num_blocks - 1``, each free or held by one request.

    Not thread-safe on its own (the scheduler calls it under the engine's lock).

    Raises:
        SpardaError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise SpardaError(f"a KV block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: the lowest id first

    @property
    def num_free(self) -> int:
        """Blocks not held by any request."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by requests."""
        return self.num_blocks - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take the ``count`` lowest free block ids, ascending.

        Raises:
            SpardaError: fewer than ``count`` blocks are free (callers check :attr:`num_free`).
        """
        if count > len(self._free):
            raise SpardaError(f"{count} KV blocks asked for, {len(self._free)} free")  # internal
        return [heapq.heappop(self._free) for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        """Give ``blocks`` back (each must be held: ids in range, none already free)."""
        for block in blocks:
            heapq.heappush(self._free, block)
