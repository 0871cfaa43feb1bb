"""Host-side storage of the offloaded KV cache (design §6): a pool of KV pages per layer.

Per offloaded layer, K and V are each a pool of ``P`` pages, a page being one KV block
(``block_size`` tokens) of every KV head, head-major: ``[H_kv, P, block_size, d]``. So one
head's block is one contiguous run (16 KiB for ``64 x 128`` bf16), and one head's run of
consecutive pages is one contiguous DMA (a prefill chunk of a row whose pages are
consecutive, as under the identity table, is one copy per head). A
:class:`~sparda.cache.paged.BlockTable` maps (row, logical block) to a page; without
``host_blocks`` it is the identity over ``P = B * N`` pages. The store is pinned when the
cache serves a CUDA device (the GPU reads it through UVA or DMAs it asynchronously).

Pinned memory is ordinary page-aligned memory registered with the CUDA driver
(:func:`sparda.cache.pinned.pinned_zeros`, which reuses what a freed cache registered), not
PyTorch's caching host allocator, which rounds every request up to a power of two (a 1.04 GB
layer would take 2 GiB). So a layer's K (or V) is one allocation of exactly its size (one
transfer launch per layer and step); its pages are split into chunks only past
``chunk_bytes`` or :data:`MAX_CHUNK_ELEMENTS`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparda.cache import pinned
from sparda.cache.paged import BlockTable
from sparda.errors import SpardaError
from sparda.kernels import quant

#: Default upper bound of one allocation (bytes).
DEFAULT_CHUNK_BYTES = 4 << 30
#: Largest chunk in elements (one plane of K or V).
MAX_CHUNK_ELEMENTS = 2**31 - 1
#: a prefill write of more runs of consecutive pages than this goes through one kernel launch
#: per chunk and plane instead of one DMA per head and run (CUDA)
MAX_DMA_RUNS = 8


def _has_triton() -> bool:
    from sparda import kernels

    return kernels.HAS_TRITON


@dataclass
class HostChunk:
    """One allocation: pages ``[page0, page1)`` of one layer's pool.

    Attributes:
        page0, page1: the pages it holds.
        k, v: ``[H_kv, page1 - page0, block_size, d]`` host tensors, or
            :class:`~sparda.kernels.quant.QuantizedKV` of that logical shape (quantised cache).
        table: ``[B, N]`` int32 block table (on the cache's device): the page of each
            (row, logical block), ``-1`` unassigned.
    """

    page0: int
    page1: int
    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor

    def planes(self) -> list["HostChunk"]:
        """The chunk as plain-tensor chunks, one per stored plane: itself (unquantised), or
        the quantised data ``[H, P', bs, d']`` uint8 then the scales ``[H, P', bs, 2]`` fp32
        (what the transfer engines move, one plane at a time)."""
        if isinstance(self.k, quant.QuantizedKV):
            return [HostChunk(self.page0, self.page1, self.k.data, self.v.data, self.table),
                    HostChunk(self.page0, self.page1, self.k.scale, self.v.scale, self.table)]
        return [self]


def available_host_bytes() -> int | None:
    """Host memory a new KV cache can take, in bytes: free physical memory plus the
    page-locked buffers :data:`sparda.cache.pinned.POOL` keeps (reused, or given back before
    new memory is registered; ``None`` if the OS does not say)."""
    free = pinned.os_free_bytes()
    return None if free is None else free + pinned.POOL.reclaimable_bytes()


def chunk_spans(count: int, unit_bytes: int, chunk_bytes: int, unit_elements: int | None = None) -> list[tuple[int, int]]:
    """Spans ``[(first, end), ...]`` of the host chunks of ``count`` pages of one layer's K (or V).

    Even spans of at most ``chunk_bytes`` and :data:`MAX_CHUNK_ELEMENTS` (``unit_elements``
    per page; at least one page each): the fewest chunks, so the fewest transfer launches
    per layer -- one for every layer that fits.
    """
    unit_bytes = max(unit_bytes, 1)
    per = chunk_bytes // unit_bytes
    if unit_elements:
        per = min(per, MAX_CHUNK_ELEMENTS // unit_elements)
    per = max(1, min(count, per))
    num = -(-count // per)
    sizes = [count // num + (i < count % num) for i in range(num)]  # even: differ by <= 1 page
    bounds = np.cumsum([0, *sizes]).tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def page_runs(pages: np.ndarray, spans: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """``pages [n]`` split into runs of consecutive pages within one chunk: ``(i, j, chunk)``
    for ``pages[i:j]``, ``chunk`` the index into ``spans``."""
    ends = np.asarray([e for _, e in spans])
    which = np.searchsorted(ends, pages, side="right")
    cut = np.flatnonzero((np.diff(pages) != 1) | (np.diff(which) != 0)) + 1
    bounds = [0, *cut.tolist(), len(pages)]
    return [(i, j, int(which[i])) for i, j in zip(bounds[:-1], bounds[1:]) if j > i]


class HostKVStore:
    """K/V pages of the offloaded layers in (pinned) host memory, with their block table.

    Args:
        layers: the layer indices stored here (resident layers are left out).
        batch: rows. num_kv_heads, head_dim: ``H_kv``, ``d``.
        num_blocks: logical blocks per row (``ceil(capacity / block_size)``). block_size: tokens.
        dtype: element type. pin: page-lock the memory (for a CUDA device).
        device: the CUDA device the cache serves (synchronized before its page-locked
            buffers are reused by a later cache, :mod:`sparda.cache.pinned`; the block
            tables live there; ``None``: on the CPU).
        chunk_bytes: largest single allocation; a page larger than this gets its own chunk.
        kv_dtype: ``bf16`` (``dtype`` elements) or ``int8``/``int4``: pages stored quantised
            with their scales (:mod:`sparda.kernels.quant`; every size counts those bytes);
            ``mixed``: every page in int4 plus the hot pool (``hot_blocks``).
        hot_blocks: ``mixed`` only: ``P_hot``, blocks per row of the bf16 hot pool :attr:`pool`
            (fixed per row: pages ``row * P_hot + n mod P_hot`` of ``[H_kv, B * P_hot,
            block_size, d]``, :attr:`pool_table` the identity; :mod:`sparda.cache.hot`).
        host_blocks: ``P``, pages per layer (``None``: ``batch * num_blocks`` and the
            identity table; otherwise every row starts unassigned, :attr:`table`).
    Raises:
        SpardaError: if the memory is not available (the message names the bytes needed
            and available and suggests a smaller batch or context), or ``host_blocks < 1``.
    """

    def __init__(self, layers, batch: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype, pin: bool,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, kv_dtype: str = "bf16", hot_blocks: int = 0,
                 device: torch.device | str | None = None, host_blocks: int | None = None) -> None:
        self.layers = tuple(layers)
        self.mixed = kv_dtype == "mixed"
        #: the type every block is stored in (``mixed``: int4; the hot pool holds ``dtype`` copies)
        self.kv_dtype = kv_dtype = quant.store_dtype(kv_dtype)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.pinned = pin
        table_device = device if device is not None else "cpu"
        #: which page holds each (row, logical block)
        self.table = BlockTable(batch, num_blocks, host_blocks, table_device)
        #: ``P``: pages per layer
        self.pages = self.table.pages
        #: bytes of one block of one head (K or V alone; data and scales if quantised)
        self.block_bytes = block_size * quant.token_bytes(head_dim, kv_dtype, dtype)
        #: ``mixed``: ``P_hot`` pool blocks per row, and the bytes of one of one head (K or V alone)
        self.hot_blocks = hot_blocks if self.mixed else 0
        self.hot_block_bytes = block_size * head_dim * torch.empty((), dtype=dtype).element_size()
        self.pool_table = BlockTable.identity(batch, self.hot_blocks, table_device)
        #: ``mixed``: the hot pool's bytes (K and V of every stored layer)
        self.pool_bytes = 2 * len(self.layers) * batch * self.hot_blocks * num_kv_heads * self.hot_block_bytes
        need = 2 * len(self.layers) * self.pages * num_kv_heads * self.block_bytes + self.pool_bytes
        free = available_host_bytes()
        if free is not None and need > (0.95 * free if pin else free):  # refuse rather than be killed by the OS
            raise SpardaError(self._message(need, free))
        data_dim = quant.packed_dim(head_dim, kv_dtype)  # elements per token: the largest plane's
        self.spans = chunk_spans(self.pages, num_kv_heads * self.block_bytes, chunk_bytes,
                                 num_kv_heads * block_size * data_dim)
        self.pool_spans = chunk_spans(batch * self.hot_blocks, num_kv_heads * self.hot_block_bytes, chunk_bytes,
                                      num_kv_heads * block_size * head_dim) if self.hot_blocks else []

        def plane(shape, dtype) -> torch.Tensor:
            return pinned.pinned_zeros(shape, dtype, device) if pin else torch.zeros(shape, dtype=dtype)

        def zeros(pages: int):  # quantised: a data plane and a scale plane (sparda.kernels.quant)
            shape = (num_kv_heads, pages, block_size, head_dim)
            if not quant.is_quantized(kv_dtype):
                return plane(shape, dtype)
            return quant.QuantizedKV(plane((*shape[:-1], data_dim), torch.uint8),
                                     plane((*shape[:-1], quant.SCALE_DIM), quant.SCALE_DTYPE), kv_dtype)

        def hot(pages: int):
            return plane((num_kv_heads, pages, block_size, head_dim), dtype)

        self.chunks: dict[int, list[HostChunk]] = {}
        #: ``mixed``: per layer, the bf16 hot pool as chunks of pages
        self.pool: dict[int, list[HostChunk]] = {}
        try:
            for layer in self.layers:
                self.chunks[layer] = [HostChunk(p0, p1, zeros(p1 - p0), zeros(p1 - p0), self.table.table)
                                      for p0, p1 in self.spans]
                if self.mixed:
                    self.pool[layer] = [HostChunk(p0, p1, hot(p1 - p0), hot(p1 - p0), self.pool_table.table)
                                        for p0, p1 in self.pool_spans]
        except (RuntimeError, MemoryError) as exc:
            self.chunks, self.pool = {}, {}
            raise SpardaError(self._message(need, free)) from exc
        except SpardaError:
            self.chunks, self.pool = {}, {}
            raise
        #: bytes held (K and V of every stored layer; ``mixed``: the int4 store plus the hot pool)
        self.nbytes = need

    @staticmethod
    def _message(need: int, free: int | None) -> str:
        have = "unknown" if free is None else f"{free / 2**30:.2f} GiB"
        return (f"offloaded KV cache needs {need / 2**30:.2f} GiB of host memory but {have} is available; "
                "use a smaller batch or context (fewer --max-new-tokens or a shorter prompt), "
                "or --no-offload (offload=False) to keep the KV cache on the GPU")

    def token_runs(self, layer: int, row: int, start: int, end: int) -> list[tuple[int, int, object, object]]:
        """Host views of ``row``'s tokens ``start .. end - 1`` of ``layer``, through the table:
        ``[(a, b, k, v), ...]`` covering ``[start, end)`` in order, ``k, v [H_kv, b - a, d]``
        views of one run of consecutive pages (each head's tokens contiguous: one DMA each).

        Raises:
            SpardaError: a block in the range has no page, or ``row`` is outside the cache
                (internal errors).
        """
        if end <= start:
            return []
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        pages = self.table.lookup(row, first, last)
        out = []
        for i, j, c in page_runs(pages, self.spans):
            chunk = self.chunks[layer][c]
            p = int(pages[i]) - chunk.page0
            a, b = max(start, (first + i) * bs), min(end, (first + j) * bs)
            off = (first + i) * bs
            k = chunk.k[:, p:p + j - i].flatten(1, 2)[:, a - off:b - off]
            v = chunk.v[:, p:p + j - i].flatten(1, 2)[:, a - off:b - off]
            out.append((a, b, k, v))
        return out

    def put_tokens(self, layer: int, row: int, k, v, start: int = 0, kernel: bool | None = None) -> None:
        """Enqueue the copy of ``k, v [H_kv, T, d]`` (as stored: quantised already for a quantised
        store) to tokens ``start .. start+T-1`` of ``row`` on the current stream: one copy per
        head and run of consecutive pages, or, for a CUDA source and more than
        :data:`MAX_DMA_RUNS` runs, one :func:`~sparda.kernels.host_pages.write_pages` launch per
        chunk and plane (``kernel`` True/False forces either; True needs Triton).

        Raises:
            SpardaError: a block of those tokens has no page, or ``row`` is outside the cache
                (internal errors; nothing is written then).
        """
        runs = self.token_runs(layer, row, start, start + k.shape[-2])  # checks every page first
        if self._use_kernel(runs, k, kernel):
            self._launch(layer, row, k, v, start, read=False)
            return
        non_blocking = k.device.type == "cuda" and self.pinned
        for a, b, dk, dv in runs:
            for dst, src in ((dk, k), (dv, v)):
                for head in range(dst.shape[0]):  # contiguous per head: one direct DMA each
                    dst[head].copy_(src[head, a - start:b - start], non_blocking=non_blocking)

    def get_tokens(self, layer: int, row: int, end: int, k, v, non_blocking: bool = True,
                   kernel: bool | None = None) -> None:
        """Copy ``row``'s tokens ``< end`` into ``k, v [H_kv, >= end, d]`` (as stored; a device
        buffer) on the current stream, as :meth:`put_tokens` writes them (per head and run of
        consecutive pages, ``non_blocking`` DMAs, or one kernel launch per chunk and plane).

        Raises:
            SpardaError: a block of those tokens has no page (internal error).
        """
        runs = self.token_runs(layer, row, 0, end)
        if self._use_kernel(runs, k, kernel):
            self._launch(layer, row, k[:, :end], v[:, :end], 0, read=True)
            return
        non_blocking = non_blocking and k.device.type == "cuda" and self.pinned
        for a, b, sk, sv in runs:
            for dst, src in ((k, sk), (v, sv)):
                for head in range(src.shape[0]):
                    dst[head, a:b].copy_(src[head], non_blocking=non_blocking)

    def _use_kernel(self, runs: list, like, kernel: bool | None) -> bool:
        """Whether a copy of ``runs`` goes through :mod:`sparda.kernels.host_pages` (``kernel``
        forces it): a CUDA tensor, a pinned store, more than :data:`MAX_DMA_RUNS` runs."""
        if kernel is not None:
            return kernel
        return like.device.type == "cuda" and self.pinned and len(runs) > MAX_DMA_RUNS and _has_triton()

    def _launch(self, layer: int, row: int, k, v, start: int, read: bool) -> None:
        """:func:`~sparda.kernels.host_pages.write_pages` for every chunk and plane of ``layer``."""
        from sparda.kernels.host_pages import write_pages

        table = self.table.table.to(k.device)
        planes = [(k.data, v.data), (k.scale, v.scale)] if isinstance(k, quant.QuantizedKV) else [(k, v)]
        if not read:
            planes = [(pk.contiguous(), pv.contiguous()) for pk, pv in planes]
        for chunk in self.chunks[layer]:
            for part, (pk, pv) in zip(chunk.planes(), planes):
                write_pages(part.k, part.v, chunk.page0, table, row, pk, pv, start, read=read)

    def write_tokens(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """Write ``k, v [H_kv, T, d]`` (any device; quantised here if the store is) as tokens
        ``start .. start+T-1`` of ``row`` (prefill, synchronously; a chunked prefill passes the
        chunk's ``start``), by :meth:`put_tokens`.

        Raises:
            SpardaError: a block of those tokens has no page, or ``row`` is outside the cache
                (internal errors).
        """
        if quant.is_quantized(self.kv_dtype) and not isinstance(k, quant.QuantizedKV):  # on the source device
            k, v = quant.QuantizedKV.quantize(k, self.kv_dtype), quant.QuantizedKV.quantize(v, self.kv_dtype)
        self.put_tokens(layer, row, k, v, start)
        if k.device.type == "cuda":
            torch.cuda.current_stream(k.device).synchronize()  # the source may be freed next

    def read_tokens(self, layer: int, row: int, end: int) -> tuple:
        """Copies of ``row``'s tokens ``< end`` of ``layer`` as ``k, v [H_kv, end, d]`` on the host
        (tests and checks).

        Raises:
            SpardaError: a block of those tokens has no page (internal error).
        """
        runs = self.token_runs(layer, row, 0, end)
        return tuple(quant.cat([r[i] for r in runs], 1) if runs else None for i in (2, 3))

    def _pool_page(self, layer: int, row: int, block: int) -> tuple[HostChunk, int]:
        """``(chunk, index)`` of the hot-pool page of ``row``'s block ``block`` (slot ``block mod P_hot``)."""
        page = int(self.pool_table.host[self.table._row(row), block % self.hot_blocks])
        chunk = next(c for c in self.pool[layer] if c.page0 <= page < c.page1)
        return chunk, page - chunk.page0

    def write_pool_tokens(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int = 0) -> None:
        """``mixed``: write exact ``k, v [H_kv, T, d]`` (tokens ``start .. start+T-1`` of ``row``)
        into the hot pool, block ``n`` at pool slot ``n mod P_hot`` (prefill, synchronously). Only
        the chunk's last ``P_hot`` blocks are written: an earlier one's pool slot is the later one's.

        Raises:
            SpardaError: ``row`` is outside the cache (internal error).
        """
        bs, t = self.block_size, k.shape[-2]
        end = start + t
        last = (end - 1) // bs
        for n in range(max(start // bs, last - self.hot_blocks + 1), last + 1):
            chunk, i = self._pool_page(layer, row, n)
            a, b = max(start, n * bs), min(end, (n + 1) * bs)
            for dst, src in ((chunk.k, k), (chunk.v, v)):
                dst[:, i, a - n * bs:b - n * bs].copy_(src[:, a - start:b - start])

    def pool_block(self, layer: int, row: int, head, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``mixed``: the pool's K, V ``[block_size, d]`` (``head`` a slice: ``[H, block_size, d]``)
        at block ``block``'s slot, as views."""
        chunk, i = self._pool_page(layer, row, block)
        return chunk.k[head, i], chunk.v[head, i]

    def block(self, layer: int, row: int, head: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one block ``[block_size, d]`` through the table (views into host memory; for tests).

        Raises:
            SpardaError: the block has no page, or ``row`` is outside the cache.
        """
        page = int(self.table.lookup(row, block, block)[0])
        chunk = next(c for c in self.chunks[layer] if c.page0 <= page < c.page1)
        return chunk.k[head, page - chunk.page0], chunk.v[head, page - chunk.page0]
