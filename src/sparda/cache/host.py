"""Host-side storage of the offloaded KV cache (design §6).

The full K and V of every offloaded layer live in host memory, pinned when the cache
serves a CUDA device (so the GPU can read them directly through UVA or DMA them
asynchronously). The layout is block-major: ``[rows, H_kv, num_blocks, block_size, d]``,
so one KV block of one head (``block_size * d`` elements, 16 KiB for ``64 x 128`` bf16)
is one contiguous run. Memory is allocated in chunks of whole rows per layer and per
K/V (one huge pinned allocation fails on many systems).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sparda.errors import SpardaError

#: Default upper bound of one allocation (bytes).
DEFAULT_CHUNK_BYTES = 1 << 30


@dataclass
class HostChunk:
    """One allocation: rows ``[row0, row1)`` of one layer.

    Attributes:
        row0, row1: the rows it holds (cache row indices).
        k, v: ``[row1 - row0, H_kv, num_blocks, block_size, d]`` host tensors.
    """

    row0: int
    row1: int
    k: torch.Tensor
    v: torch.Tensor


def available_host_bytes() -> int | None:
    """Free physical memory in bytes (``None`` if the OS does not say)."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platform dependent
        return None


def pinned_bytes(nbytes: int) -> int:
    """Bytes PyTorch's caching host allocator takes for a pinned request of ``nbytes``: it
    rounds every request up to a power of two (``PowerOf2Ceil`` in ATen's
    CachingHostAllocator, at its default round threshold)."""
    return 1 << max(0, int(nbytes) - 1).bit_length()


def chunk_rows(batch: int, row_bytes: int, chunk_bytes: int, pinned: bool,
               budget_bytes: float | None = None, copies: int = 1) -> list[tuple[int, int]]:
    """Row spans ``[(row0, row1), ...]`` of the host chunks of one layer's K (or V).

    Even spans of at most ``chunk_bytes`` (at least one row each) -- the fewest chunks,
    so the fewest transfer launches per layer. Pinned chunks are rounded up to a power of
    two by the caching host allocator (:func:`pinned_bytes`: 9 rows of 67 MB take 1 GiB),
    so when ``copies`` such layers of even spans would take more than ``budget_bytes``,
    the spans are cut greedily instead: each the number of rows whose size fills its
    rounded allocation best (15 rows of 67 MB fill 1 GiB to 98 %).
    """
    row_bytes = max(row_bytes, 1)
    per = max(1, min(batch, chunk_bytes // row_bytes))
    even = [(r, min(batch, r + per)) for r in range(0, batch, per)]
    if not pinned or budget_bytes is None:
        return even
    if copies * sum(pinned_bytes((r1 - r0) * row_bytes) for r0, r1 in even) <= budget_bytes:
        return even
    spans, row0 = [], 0
    while row0 < batch:  # the chunk that wastes the least of its rounded size; ties: more rows
        left = min(batch - row0, per)
        n = max(range(1, left + 1), key=lambda m: (round(m * row_bytes / pinned_bytes(m * row_bytes), 3), m))
        spans.append((row0, row0 + n))
        row0 += n
    return spans


class HostKVStore:
    """Full K/V of the offloaded layers in (pinned) host memory, block-major, chunked.

    Args:
        layers: the layer indices stored here (resident layers are left out).
        batch: rows. num_kv_heads, head_dim: ``H_kv``, ``d``.
        num_blocks: blocks per row (``ceil(capacity / block_size)``). block_size: tokens.
        dtype: element type. pin: page-lock the memory (for a CUDA device).
        chunk_bytes: largest single allocation; a row larger than this gets its own chunk.
    Raises:
        SpardaError: if the memory is not available; the message names the bytes needed
            and available and suggests a smaller batch or context.
    """

    def __init__(self, layers, batch: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, pin: bool,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.layers = tuple(layers)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pinned = pin
        elem = torch.empty((), dtype=dtype).element_size()
        #: bytes of one block of one head (K or V alone)
        self.block_bytes = block_size * head_dim * elem
        row_bytes = num_kv_heads * num_blocks * self.block_bytes
        need = 2 * len(self.layers) * batch * row_bytes
        free = available_host_bytes()
        if free is not None and need > free:
            raise SpardaError(self._message(need, free))
        spans = chunk_rows(batch, row_bytes, chunk_bytes, pin, None if free is None else 0.95 * free,
                           copies=2 * len(self.layers))
        taken = 2 * len(self.layers) * sum(pinned_bytes((r1 - r0) * row_bytes) if pin else (r1 - r0) * row_bytes
                                           for r0, r1 in spans)
        if free is not None and taken > 0.95 * free:  # refuse rather than be killed by the OS
            raise SpardaError(self._message(taken, free) + " (pinned chunks are rounded up to powers of two)")
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.chunks: dict[int, list[HostChunk]] = {}
        try:
            for layer in self.layers:
                chunks = []
                for row0, row1 in spans:
                    k = torch.zeros((row1 - row0, *shape), dtype=dtype, pin_memory=pin)
                    v = torch.zeros((row1 - row0, *shape), dtype=dtype, pin_memory=pin)
                    chunks.append(HostChunk(row0, row1, k, v))
                self.chunks[layer] = chunks
        except (RuntimeError, MemoryError) as exc:
            self.chunks = {}
            raise SpardaError(self._message(need, free)) from exc
        #: bytes held (K and V of every stored layer)
        self.nbytes = need

    @staticmethod
    def _message(need: int, free: int | None) -> str:
        have = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        return (f"offloaded KV cache needs {need / 2**30:.2f} GiB of host memory but {have} is available; "
                "use a smaller batch or context (fewer --max-new-tokens or a shorter prompt), "
                "or --no-offload (offload=False) to keep the KV cache on the GPU")

    def write_tokens(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Write ``k, v [H_kv, T, d]`` (any device) as tokens ``start .. start+T-1`` of ``row``
        (prefill, synchronously; a chunked prefill passes the chunk's ``start``).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        t = k.shape[-2]
        for dst, src in zip(self.token_views(layer, row), (k, v)):
            for head in range(dst.shape[0]):  # contiguous per head: one direct DMA each
                dst[head, start:start + t].copy_(src[head], non_blocking=src.is_cuda and dst.is_pinned())
        if k.is_cuda:
            torch.cuda.current_stream(k.device).synchronize()  # the source may be freed next

    def token_views(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one row as ``[H_kv, num_blocks * block_size, d]`` views into host memory
        (token-major per head: each head's tokens are one contiguous run).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        for chunk in self.chunks[layer]:
            if chunk.row0 <= row < chunk.row1:
                r = row - chunk.row0
                return chunk.k[r].flatten(1, 2), chunk.v[r].flatten(1, 2)
        raise SpardaError(f"row {row} is outside the cache")  # pragma: no cover - internal

    def block(self, layer: int, row: int, head: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one block ``[block_size, d]`` (a view into host memory; for tests).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        for chunk in self.chunks[layer]:
            if chunk.row0 <= row < chunk.row1:
                r = row - chunk.row0
                return chunk.k[r, head, block], chunk.v[r, head, block]
        raise SpardaError(f"row {row} is outside the cache")  # pragma: no cover - internal
