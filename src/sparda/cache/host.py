"""Host-side storage of the offloaded KV cache (design §6).

The full K and V of every offloaded layer live in host memory, pinned when the cache
serves a CUDA device (so the GPU can read them directly through UVA or DMA them
asynchronously). The layout is block-major: ``[rows, H_kv, num_blocks, block_size, d]``,
so one KV block of one head (``block_size * d`` elements, 16 KiB for ``64 x 128`` bf16)
is one contiguous run.

Pinned memory is ordinary page-aligned memory registered with the CUDA driver
(:func:`sparda.cache.pinned.pinned_zeros`, which reuses what a freed cache registered), not
PyTorch's caching host allocator, which rounds every request up to a power of two (a 1.04 GB
layer would take 2 GiB). So a layer's K (or V) is one allocation of exactly its size
for every batch that fits (one transfer launch per layer and step); rows are split into
chunks only past ``chunk_bytes`` or the transfer kernels' 32-bit element offsets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparda.cache import pinned
from sparda.errors import SpardaError
from sparda.kernels import quant

#: Default upper bound of one allocation (bytes).
DEFAULT_CHUNK_BYTES = 4 << 30
#: Largest chunk in elements: the UVA kernels index a chunk with 32-bit offsets.
MAX_CHUNK_ELEMENTS = 2**31 - 1


@dataclass
class HostChunk:
    """One allocation: rows ``[row0, row1)`` of one layer.

    Attributes:
        row0, row1: the rows it holds (cache row indices).
        k, v: ``[row1 - row0, H_kv, num_blocks, block_size, d]`` host tensors, or
            :class:`~sparda.kernels.quant.QuantizedKV` of that logical shape (quantised cache).
    """

    row0: int
    row1: int
    k: torch.Tensor
    v: torch.Tensor

    def planes(self) -> list["HostChunk"]:
        """The chunk as plain-tensor chunks, one per stored plane: itself (unquantised), or
        the quantised data ``[R, H, N, bs, d']`` uint8 then the scales ``[R, H, N, bs, 2]``
        fp32 (what the transfer engines move, one plane at a time)."""
        if isinstance(self.k, quant.QuantizedKV):
            return [HostChunk(self.row0, self.row1, self.k.data, self.v.data),
                    HostChunk(self.row0, self.row1, self.k.scale, self.v.scale)]
        return [self]


def available_host_bytes() -> int | None:
    """Host memory a new KV cache can take, in bytes: free physical memory plus the
    page-locked buffers :data:`sparda.cache.pinned.POOL` keeps (reused, or given back before
    new memory is registered; ``None`` if the OS does not say)."""
    free = pinned.os_free_bytes()
    return None if free is None else free + pinned.POOL.reclaimable_bytes()


def chunk_rows(batch: int, row_bytes: int, chunk_bytes: int, row_elements: int | None = None) -> list[tuple[int, int]]:
    """Row spans ``[(row0, row1), ...]`` of the host chunks of one layer's K (or V).

    Even spans of at most ``chunk_bytes`` and :data:`MAX_CHUNK_ELEMENTS` (``row_elements``
    per row; at least one row each): the fewest chunks, so the fewest transfer launches
    per layer -- one for every batch whose layer fits.
    """
    row_bytes = max(row_bytes, 1)
    per = chunk_bytes // row_bytes
    if row_elements:
        per = min(per, MAX_CHUNK_ELEMENTS // row_elements)
    per = max(1, min(batch, per))
    count = -(-batch // per)
    sizes = [batch // count + (i < batch % count) for i in range(count)]  # even: differ by <= 1 row
    bounds = np.cumsum([0, *sizes]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


class HostKVStore:
    """Full K/V of the offloaded layers in (pinned) host memory, block-major, chunked.

    Args:
        layers: the layer indices stored here (resident layers are left out).
        batch: rows. num_kv_heads, head_dim: ``H_kv``, ``d``.
        num_blocks: blocks per row (``ceil(capacity / block_size)``). block_size: tokens.
        dtype: element type. pin: page-lock the memory (for a CUDA device).
        device: the CUDA device the cache serves (synchronized before its page-locked
            buffers are reused by a later cache, :mod:`sparda.cache.pinned`).
        chunk_bytes: largest single allocation; a row larger than this gets its own chunk.
        kv_dtype: ``bf16`` (``dtype`` elements) or ``int8``/``int4``: blocks stored quantised
            with their scales (:mod:`sparda.kernels.quant`; every size counts those bytes);
            ``mixed``: every block in int4 plus the hot pool (``hot_blocks``).
        hot_blocks: ``mixed`` only: ``P``, blocks per (row, KV head) of the bf16 hot pool
            :attr:`pool` (``[R, H_kv, P, block_size, d]`` in ``dtype`` per chunk, the store's
            row spans; block ``n`` lives in pool slot ``n mod P``, :mod:`sparda.cache.hot`).
    Raises:
        SpardaError: if the memory is not available; the message names the bytes needed
            and available and suggests a smaller batch or context.
    """

    def __init__(self, layers, batch: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, pin: bool,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, kv_dtype: str = "bf16", hot_blocks: int = 0,
                 device: torch.device | str | None = None) -> None:
        self.layers = tuple(layers)
        self.mixed = kv_dtype == "mixed"
        #: the type every block is stored in (``mixed``: int4; the hot pool holds ``dtype`` copies)
        self.kv_dtype = kv_dtype = quant.store_dtype(kv_dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.pinned = pin
        #: bytes of one block of one head (K or V alone; data and scales if quantised)
        self.block_bytes = block_size * quant.token_bytes(head_dim, kv_dtype, dtype)
        #: ``mixed``: ``P`` pool blocks per row and head, and the bytes of one (K or V alone)
        self.hot_blocks = hot_blocks if self.mixed else 0
        self.hot_block_bytes = block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        row_bytes = num_kv_heads * (num_blocks * self.block_bytes + self.hot_blocks * self.hot_block_bytes)
        need = 2 * len(self.layers) * batch * row_bytes
        free = available_host_bytes()
        if free is not None and need > (0.95 * free if pin else free):  # refuse rather than be killed by the OS
            raise SpardaError(self._message(need, free))
        data_dim = quant.packed_dim(head_dim, kv_dtype)  # elements per token: the largest plane's
        spans = chunk_rows(batch, row_bytes, chunk_bytes, num_kv_heads * num_blocks * block_size * data_dim)
        shape = (num_kv_heads, num_blocks, block_size, head_dim)
        self.chunks: dict[int, list[HostChunk]] = {}

        def plane(shape, dtype) -> torch.Tensor:
            return pinned.pinned_zeros(shape, dtype, device) if pin else torch.zeros(shape, dtype=dtype)

        def zeros(rows: int):  # quantised: a data plane and a scale plane (sparda.kernels.quant)
            if not quant.is_quantized(kv_dtype):
                return plane((rows, *shape), dtype)
            return quant.QuantizedKV(plane((rows, *shape[:-1], data_dim), torch.uint8),
                                     plane((rows, *shape[:-1], quant.SCALE_DIM), quant.SCALE_DTYPE), kv_dtype)

        pool = (num_kv_heads, self.hot_blocks, block_size, head_dim)
        #: ``mixed``: per layer, the bf16 hot pool as chunks of the store's row spans
        self.pool: dict[int, list[HostChunk]] = {}
        try:
            for layer in self.layers:
                self.chunks[layer] = [HostChunk(r0, r1, zeros(r1 - r0), zeros(r1 - r0)) for r0, r1 in spans]
                if self.mixed:
                    self.pool[layer] = [HostChunk(r0, r1, plane((r1 - r0, *pool), dtype), plane((r1 - r0, *pool), dtype))
                                        for r0, r1 in spans]
        except (RuntimeError, MemoryError) as exc:
            self.chunks, self.pool = {}, {}
            raise SpardaError(self._message(need, free)) from exc
        except SpardaError:
            self.chunks, self.pool = {}, {}
            raise
        #: bytes held (K and V of every stored layer; ``mixed``: the int4 store plus the hot pool)
        self.nbytes = need
        #: ``mixed``: the hot pool's share of :attr:`nbytes`
        self.pool_bytes = 2 * len(self.layers) * batch * num_kv_heads * self.hot_blocks * self.hot_block_bytes

    @staticmethod
    def _message(need: int, free: int | None) -> str:
        have = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        return (f"offloaded KV cache needs {need / 2**30:.2f} GiB of host memory but {have} is available; "
                "use a smaller batch or context (fewer --max-new-tokens or a shorter prompt), "
                "or --no-offload (offload=False) to keep the KV cache on the GPU")

    def write_tokens(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Write ``k, v [H_kv, T, d]`` (any device; quantised here if the store is) as tokens ``start .. start+T-1`` of ``row``
        (prefill, synchronously; a chunked prefill passes the chunk's ``start``).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        t = k.shape[-2]
        if quant.is_quantized(self.kv_dtype) and not isinstance(k, quant.QuantizedKV):  # on the source device
            k, v = quant.QuantizedKV.quantize(k, self.kv_dtype), quant.QuantizedKV.quantize(v, self.kv_dtype)
        for dst, src in zip(self.token_views(layer, row), (k, v)):
            for head in range(dst.shape[0]):  # contiguous per head: one direct DMA each
                dst[head, start:start + t].copy_(src[head], non_blocking=src.device.type == "cuda" and self.pinned)
        if k.device.type == "cuda":
            torch.cuda.current_stream(k.device).synchronize()  # the source may be freed next

    @staticmethod
    def _locate(chunks: list, row: int) -> tuple:
        """``(chunk, r)``: the chunk of ``chunks`` holding cache row ``row`` and its index there.

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        for chunk in chunks:
            if chunk.row0 <= row < chunk.row1:
                return chunk, row - chunk.row0
        raise SpardaError(f"row {row} is outside the cache")  # pragma: no cover - internal

    def write_pool_tokens(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """``mixed``: write exact ``k, v [H_kv, T, d]`` (tokens ``start .. start+T-1`` of ``row``)
        into the hot pool, block ``n`` at pool slot ``n mod P`` (prefill, synchronously). Only
        the chunk's last ``P`` blocks are written: an earlier one's pool slot is the later one's.

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        bs, t = self.block_size, k.shape[-2]
        end = start + t
        chunk, r = self._locate(self.pool[layer], row)
        last = (end - 1) // bs
        for n in range(max(start // bs, last - self.hot_blocks + 1), last + 1):
            a, b = max(start, n * bs), min(end, (n + 1) * bs)
            for dst, src in ((chunk.k, k), (chunk.v, v)):
                dst[r, :, n % self.hot_blocks, a - n * bs:b - n * bs].copy_(src[:, a - start:b - start])

    def pool_block(self, layer: int, row: int, head: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``mixed``: the pool's K, V ``[block_size, d]`` at block ``block``'s slot (a view; for tests)."""
        chunk, r = self._locate(self.pool[layer], row)
        return chunk.k[r, head, block % self.hot_blocks], chunk.v[r, head, block % self.hot_blocks]

    def token_views(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one row as ``[H_kv, num_blocks * block_size, d]`` views into host memory
        (token-major per head: each head's tokens are one contiguous run).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        chunk, r = self._locate(self.chunks[layer], row)
        return chunk.k[r].flatten(1, 2), chunk.v[r].flatten(1, 2)

    def block(self, layer: int, row: int, head: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one block ``[block_size, d]`` (a view into host memory; for tests).

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        chunk, r = self._locate(self.chunks[layer], row)
        return chunk.k[r, head, block], chunk.v[r, head, block]
