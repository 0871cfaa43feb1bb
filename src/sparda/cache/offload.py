"""The offloaded KV cache (design §6): full K/V in host memory, selected blocks in GPU slots.

What lives where:

* host (pinned on CUDA), :class:`~sparda.cache.host.HostKVStore`: per offloaded layer a
  pool of ``P`` pages (one KV block of every head each) and a block table ``[B, N_cap]``
  mapping each row's logical block to a page (the identity over ``B * N_cap`` pages unless
  ``host_blocks`` is given; then the engine's allocator assigns each row's pages with
  :meth:`OffloadKVCache.assign_blocks`); decoded tokens are written back as they arrive,
  so every block is complete on the host once its last token is decoded;
* device: the compressed keys of every layer ``[B, H, C_cap, d]``; the last
  ``kernel_size`` keys per row (a ring, to compute new compressed keys); per offloaded
  layer a slot buffer ``[B, H, S + 1, block_size, d]`` for K and V, whose first ``S``
  slots hold fetched blocks (block map ``slot_map [B, H, S]``) and whose last slot is
  the current (partial) block, written in place as tokens are decoded; resident layers
  (e.g. layer 0) keep their full K/V on the device.

``W = min(N_cap, max(budget_blocks, ceil(dense_len / block_size)))`` blocks hold any
selection, the dense fallback included; the slot buffer has ``S = min(N_cap,
ceil(slot_factor * W))`` slots, so that with ``slot_factor > 1`` the spare ones keep blocks
that left the selection and a block that returns is a hit, not a copy (design §6). The
cache moves blocks; the attention method chooses them (:meth:`OffloadKVCache.fetch` takes
a block mask).
"""

from __future__ import annotations

import contextlib
import math

import torch

from sparda.cache.device import fill_ring, window_keys
from sparda.cache.host import DEFAULT_CHUNK_BYTES, HostKVStore
from sparda.cache.base import KVCache
from sparda.cache.prefetch import Prefetcher
from sparda.cache.transfer import make_engine
from sparda.config import DEFAULT_SLOT_FACTOR, SelectionConfig
from sparda.errors import SpardaError
from sparda import kernels
from sparda.kernels import quant
from sparda.kernels import reference as ref


def num_slots(capacity: int, cfg: SelectionConfig) -> int:
    """Blocks of the widest selection per offloaded layer and KV head (design §3.4, §3.6):
    the budget, or the dense-fallback prefix, at most the blocks of ``capacity`` tokens."""
    blocks = -(-capacity // cfg.block_size)
    return max(1, min(blocks, max(cfg.budget_blocks, -(-cfg.dense_len // cfg.block_size))))



def spare_slot_count(capacity: int, cfg: SelectionConfig, slot_factor: float) -> int:
    """``S``: GPU slots per offloaded layer and KV head, ``ceil(slot_factor * W)`` for the
    selection width ``W`` of :func:`num_slots`, at most the blocks of ``capacity`` tokens."""
    width = num_slots(capacity, cfg)
    blocks = -(-capacity // cfg.block_size)
    return max(width, min(blocks, math.ceil(slot_factor * width - 1e-9)))


class OffloadKVCache(KVCache):
    """KV cache with host-resident K/V and a per-layer GPU block cache.

    Same ``append``/``view`` interface as :class:`~sparda.cache.device.DeviceKVCache`,
    but ``view`` exposes an offloaded layer's K/V only during its prefill; in decode the
    offload-aware methods call :meth:`fetch` (diff + copy of the misses), :meth:`wait`
    and :meth:`attend`.

    Args:
        num_layers, batch, num_kv_heads, head_dim, capacity, selection, dtype, device:
            as DeviceKVCache.
        engine: transfer engine name (``auto``, ``uva``, ``copy``, ``sync``).
        resident_layers: layers kept whole on the device (not offloaded).
        chunk_bytes: largest host allocation.
        engine_options: passed to the engine (``num_ctas``, ``num_warps``, ``tile``; the
            ``uva`` grid defaults to :func:`~sparda.cache.transfer.gather_ctas` of ``batch``).
        timing: measure copy and exposed-wait time (:class:`~sparda.cache.prefetch.Prefetcher`).
        kv_dtype: ``bf16`` or ``int8``/``int4``: the host store, the slot buffers and the
            resident layers hold quantised K/V plus scales (docs/kv_quant.md); the gather
            moves those bytes; compressed keys and the ring stay in ``dtype``. ``mixed`` is
            :class:`~sparda.cache.mixed.MixedOffloadKVCache`'s (design §6.1;
            :func:`~sparda.cache.mixed.new_offload_cache` picks the class).
        host_blocks: ``P``, host pages per offloaded layer (``None``: ``batch * N_cap``
            with the identity block table, every row a whole capacity; otherwise every row
            starts without pages: :meth:`assign_blocks` before its prefill).
        slot_factor: GPU slots per offloaded layer and KV head as a multiple of the
            selection width (>= 1; :func:`spare_slot_count`). Spare slots hold blocks that
            left the selection until a miss needs the slot (the slot diff's rule: empty
            slots first, then stale ones in slot order); attention reads only the selected
            ones (the slot diff's compact list).
    Raises:
        SpardaError: host or device memory does not suffice (bytes named), bad engine.
    """

    offload = True
    #: ``P``, ``R`` of a hot pool (design §6.1): none here
    hot_blocks = hot_steps = 0
    #: the hot-block state (:class:`~sparda.cache.hot.HotBlocks`): none here
    hot = None

    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, head_dim: int,
                 capacity: int, selection: SelectionConfig, dtype: torch.dtype,
                 device: torch.device | str, engine: str = "auto", resident_layers=(),
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, engine_options: dict | None = None,
                 timing: bool = False, kv_dtype: str = "bf16",
                 slot_factor: float = DEFAULT_SLOT_FACTOR, host_blocks: int | None = None) -> None:
        if kv_dtype == "mixed" and type(self) is OffloadKVCache:  # a caller's mistake, not a user's option
            raise TypeError("kv_dtype mixed is MixedOffloadKVCache (sparda.cache.mixed.new_offload_cache)")
        self.device = torch.device(device)
        super().__init__(batch, capacity, self.device)
        self.kv_dtype = kv_dtype  # the options are checked by the config, once
        buf_dtype = quant.slot_dtype(kv_dtype)  # slots and resident layers
        self.dtype = dtype
        self.selection = cfg = selection
        self.num_layers = num_layers
        self.batch = batch
        self.num_kv_heads = num_kv_heads
        self.block_size = cfg.block_size
        self.num_blocks = -(-capacity // cfg.block_size)
        self.num_ck_capacity = ref.num_compressed(capacity, cfg.kernel_size, cfg.kernel_stride)
        self.resident = frozenset(l for l in resident_layers if 0 <= l < num_layers)
        self.offloaded = tuple(l for l in range(num_layers) if l not in self.resident)
        #: ``W``: blocks of the widest selection (the ids :meth:`fetch` takes).
        self.select_width = num_slots(capacity, cfg)
        self.slot_factor = float(slot_factor)
        #: ``S``: slots per offloaded layer and KV head (slot ``S`` is the partial block).
        self.slots = spare_slot_count(capacity, cfg, self.slot_factor)
        self.engine = make_engine(engine, self.device, batch=batch, **(engine_options or {}))
        self.hot_blocks = self._pool_blocks()
        self.host = HostKVStore(self.offloaded, batch, num_kv_heads, head_dim, self.num_blocks,
                                cfg.block_size, dtype, pin=self.device.type == "cuda",
                                chunk_bytes=chunk_bytes, kv_dtype=kv_dtype, hot_blocks=self.hot_blocks,
                                device=self.device if self.device.type == "cuda" else None,
                                host_blocks=host_blocks)
        shape = (batch, num_kv_heads, self.slots + 1, cfg.block_size, head_dim)
        ck_shape = (batch, num_kv_heads, max(self.num_ck_capacity, 1), head_dim)
        full = (batch, num_kv_heads, capacity, head_dim)
        try:
            self.ck = [torch.zeros(ck_shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
            self.ring = [torch.zeros(batch, num_kv_heads, cfg.kernel_size, head_dim, dtype=dtype,
                                     device=self.device) for _ in range(num_layers)]
            self.k_slots, self.v_slots, self.slot_map, self.k_full, self.v_full = {}, {}, {}, {}, {}
            # per layer: the slot diff's outputs (static buffers); attn_blocks/attn_slots: the
            # selected slots as a compact [B, H, W + 1] list, what attention reads
            self.load, self.attn_ids, self.attn_blocks, self.attn_slots = {}, {}, {}, {}
            #: per layer, the early diff's copy list (design §6.2; apart from ``load``, which the
            #: layer's next diff rewrites while the early copy may still read this one)
            self.early_load = {}
            #: per layer, device staging of the blocks a fetch copies before they reach their
            #: slots (:meth:`_alloc_fetch_staging`; empty here)
            self.cold_k, self.cold_v = {}, {}
            for layer in self.offloaded:
                self.k_slots[layer] = quant.kv_zeros(shape, buf_dtype, dtype, self.device)
                self.v_slots[layer] = quant.kv_zeros(shape, buf_dtype, dtype, self.device)
                self._alloc_fetch_staging(layer)
                self.slot_map[layer] = torch.full((batch, num_kv_heads, self.slots), -1, dtype=torch.long,
                                                  device=self.device)
                self.load[layer] = torch.full_like(self.slot_map[layer], -1)
                self.early_load[layer] = torch.full_like(self.slot_map[layer], -1)
                self.attn_ids[layer] = torch.full((batch, num_kv_heads, self.slots + 1), -1, dtype=torch.int32,
                                                  device=self.device)
                self.attn_blocks[layer] = torch.full((batch, num_kv_heads, self.select_width + 1), -1,
                                                     dtype=torch.int32, device=self.device)
                self.attn_slots[layer] = torch.zeros_like(self.attn_blocks[layer])
            for layer in self.resident:
                self.k_full[layer] = quant.kv_zeros(full, buf_dtype, dtype, self.device)
                self.v_full[layer] = quant.kv_zeros(full, buf_dtype, dtype, self.device)
        except (RuntimeError, MemoryError) as exc:
            tok = quant.token_bytes(head_dim, buf_dtype, dtype)
            need = tok * (2 * len(self.offloaded) * batch * num_kv_heads * (self.slots + 1) * cfg.block_size
                          + 2 * len(self.resident) * batch * num_kv_heads * capacity)
            raise SpardaError(f"offload slot buffers of {need / 2**30:.2f} GiB do not fit on {self.device}; "
                              "use a smaller batch, context or budget, or --no-offload") from exc
        self.prefetcher = Prefetcher(self.engine, self.device, num_layers, self.host.block_bytes,
                                     batch=batch, timing=timing,
                                     pool_block_bytes=self._pool_block_bytes())
        self._stash: tuple | None = None  # prefill: (layer, k, v) of the prompt being run
        self._slot_ids = torch.arange(self.slots + 1, device=self.device).view(1, 1, -1)
        self._scratch_count = torch.zeros(batch, dtype=torch.long, device=self.device)  # uncounted fetches
        # the early diff's attention list, read by nobody (the layer's next diff writes the real one)
        self._early_attn = torch.full((batch, num_kv_heads, self.slots + 1), -1, dtype=torch.int32,
                                      device=self.device)
        self._staging = None  # chunked prefill: sparda.cache.chunked_prefill.PrefillStaging
        #: ``[B]`` bool or ``None``: rows that are decode padding (free or half-prefilled, design
        #: §3.13), whose selection :meth:`fetch` and :meth:`warm` drop (ids ``-1``: nothing copied,
        #: no hit or miss counted; resident layers still count their blocks read). The engine sets
        #: it once, before its first decode step, and updates it in place: a captured CUDA graph
        #: keeps reading the tensor it was captured with
        self.padding_rows: torch.Tensor | None = None

    # ------------------------------------------------------- host pages
    @property
    def host_blocks(self) -> int:
        """``P``: host pages per offloaded layer (one KV block of every KV head each)."""
        return self.host.pages

    @property
    def block_table(self) -> torch.Tensor:
        """``[B, N_cap]`` int32 on the device: the host page of each row's logical block, ``-1`` none."""
        return self.host.table.table

    def assign_blocks(self, row: int, pages) -> None:
        """Row ``row``'s logical blocks ``0 .. len(pages) - 1`` live in host ``pages``, the rest
        in none (before the row's prefill; again with a longer list to extend the row). The
        caller keeps pages of different rows apart.

        Raises:
            SpardaError: ``row`` outside the cache, more pages than ``N_cap``, a page outside
                ``[0, host_blocks)`` or one given twice.
        """
        self.host.table.assign(row, pages)

    def release_blocks(self, row: int) -> None:
        """Row ``row`` holds no host pages (its decode-padding steps write nothing to the host).

        Raises:
            SpardaError: ``row`` outside the cache.
        """
        self.host.table.release(row)

    # ----------------------------------------------------- subclass hooks
    def _pool_blocks(self) -> int:
        """``P``: blocks per (row, KV head) of the host store's hot pool; 0, none here."""
        return 0

    def _pool_block_bytes(self) -> int | None:
        """Bytes of one hot-pool block of one head (the prefetcher's pool counter); ``None``: no pool."""
        return None

    def _alloc_fetch_staging(self, layer: int) -> None:
        """Allocate ``layer``'s device staging of fetched blocks (:attr:`cold_k`); none here."""

    def _slot_form(self, x, stored=None):
        """``x [..., d]`` as the slots and resident layers hold it: as the host store holds
        it (``stored`` where already made, else :meth:`_quantized`)."""
        return self._quantized(x) if stored is None else stored

    def _prefill_stored(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int,
                        end: int) -> None:
        """Called once an offloaded layer's prefill chunk ``k, v [H_kv, end - start, d]`` (as
        appended) went to the host store: nothing more here."""

    def _partial_block(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor, first: int,
                       end: int) -> tuple:
        """K, V ``[H_kv, end - first, d]`` of the partial slot after a prefill to ``end``, whose
        block starts at token ``first``: from the row's tokens as stored (``keys, values``)."""
        return keys[:, first:end], values[:, first:end]

    def _fused_host(self, layer: int) -> dict | None:
        """The host destinations that :meth:`rope_append`'s kernel writes the token to directly
        (one chunk, an asynchronous engine), as its keyword arguments (``host``: the store's K,
        V and block table), or ``None``: :meth:`_store_tokens` writes it after."""
        chunks = self.host.chunks[layer]
        if len(chunks) == 1 and self.engine.name != "sync":
            return dict(host=(chunks[0].k, chunks[0].v, chunks[0].table))
        return None

    def _hot_operands(self, layer: int, load: torch.Tensor, update: bool):
        """The ``hot`` operands of ``layer``'s slot diff of the first ``b`` rows of ``load [b, H,
        S]`` (:func:`sparda.kernels.slot_diff`: a hot pool's rule and split, ``update`` for a
        fetch, not for an early diff; cut to ``[:b]``); none here."""
        return None

    def _copy_misses(self, layer: int, load: torch.Tensor, prefetch: bool, early: bool = False,
                     hot=None) -> None:
        """Copy the slot diff's misses ``load [b, H, S]`` (block per slot, ``-1`` none) from
        the host store into the slots of ``layer``'s first ``b`` rows (:meth:`fetch`'s ``prefetch``);
        ``early``: an early copy (:meth:`warm`); ``hot``: the diff's :meth:`_hot_operands`."""
        planes = self._slot_planes(layer, load.shape[0])
        chunks = self.host.chunks[layer]

        def copy() -> None:  # quantised: the data and the scales (the bytes actually stored)
            for chunk in chunks:
                self.engine.gather_planes(chunk, planes, load)

        self.prefetcher.fetch(layer, copy, None, None, keep=(), prefetch=prefetch, early=early)

    # ---------------------------------------------------------------- sizes
    @property
    def nbytes(self) -> int:
        """Bytes of K and V for the full capacity (host plus resident layers)."""
        res = sum(t.nbytes for t in list(self.k_full.values()) + list(self.v_full.values()))
        return self.host.nbytes + res

    @property
    def device_bytes(self) -> int:
        """Bytes of the GPU side: slot buffers, resident layers, compressed keys, rings."""
        tensors = (list(self.k_slots.values()) + list(self.v_slots.values()) + list(self.k_full.values())
                   + list(self.v_full.values()) + self.ck + self.ring + list(self.cold_k.values())
                   + list(self.cold_v.values()))
        return sum(t.nbytes for t in tensors)

    def is_offloaded(self, layer: int) -> bool:
        """True if ``layer``'s K/V live on the host."""
        return layer not in self.resident

    def num_compressed(self, num_tokens: int) -> int:
        """Compressed keys complete after ``num_tokens`` tokens."""
        return ref.num_compressed(num_tokens, self.selection.kernel_size, self.selection.kernel_stride)

    # --------------------------------------------------------------- append
    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, step) -> None:
        """Write this step's keys/values (``[B, H, Tq, d]``) and update compressed keys.

        Prefill writes one row, one chunk of positions ``step.max_kv_len - Tq ..`` (from 0
        unless chunked; :meth:`_append_prefill`: host, ring, compressed keys; the layer's
        K/V so far stay reachable through :meth:`view` while the layer runs); a batched
        prefill (``step.row_lengths``) each row's real tokens from 0, as its prefill alone,
        and :meth:`view` exposes the whole padded batch's K/V while the layer runs. Decode writes one
        token per row (the cache's first ``b`` rows, design §3.13) into the partial slot, without
        waiting for the layer's prefetch (the gather writes only the other slots; :meth:`attend`
        waits). ``step`` is the :class:`~sparda.model.llama.StepInfo` (``rows [b]``,
        ``q_pos [b, Tq]`` int64); ``k, v`` post-RoPE, cast to the cache dtype on write.

        Raises:
            SpardaError: a decode step of more rows than the cache.
        """
        cfg = self.selection
        if step.phase == "prefill":  # a batched prefill: each row's real tokens only
            for i, row, start, end in step.prefill_spans(k.shape[-2]):
                stored = self._append_prefill(layer, row, k[i, :, :end - start], v[i, :, :end - start], start, end)
            if layer in self.resident:
                return
            if step.row_lengths is None:  # view() exposes the layer's K/V as stored while it runs: the row's so far
                keys, values = (quant.as_float(t[:, :step.max_kv_len], self.dtype)[None] for t in stored)
            else:  # ... or the padded batch's
                keys, values = (quant.as_float(self._quantized(t), self.dtype) for t in (k, v))
            self._stash = (layer, keys, values)
            return
        self._check_rows(step.batch)
        self._stash = None
        rows = step.rows
        pos = step.q_pos[:, 0]
        if layer in self.resident:
            self.k_full[layer][rows, :, pos] = k[:, :, 0]
            self.v_full[layer][rows, :, pos] = v[:, :, 0]
        else:  # no prefetch wait: the gather writes slots < S only (wait in attend, design §6)
            off = pos % cfg.block_size
            k_tok, v_tok = self._slot_form(k[:, :, 0]), self._slot_form(v[:, :, 0])  # once, for slot and host
            self.k_slots[layer][rows, :, self.slots, off] = k_tok
            self.v_slots[layer][rows, :, self.slots, off] = v_tok
            self._store_tokens(layer, k_tok, v_tok, pos)
        ring = self.ring[layer]
        ring[rows, :, pos % cfg.kernel_size] = k[:, :, 0]
        ref.update_compressed_keys(self.ck[layer], ring, rows, pos, cfg.kernel_size, cfg.kernel_stride, ring=True)
        if layer == self.num_layers - 1:
            self.lengths[rows] = pos + 1

    def rope_append(self, layer: int, qkv: torch.Tensor, step, group: int, num_f: int):
        """Fused decode append (design §6): RoPE of this step's queries, keys and ``num_f``
        Forecast heads from the stacked projection ``qkv [B, (H_q + (2 + num_f) H_kv) d]``,
        the K/V write (resident layer: full buffer; offloaded layer: the partial slot and
        the host store, ``mixed``'s hot pool too), the ring and the compressed-key update, in one kernel
        (:func:`sparda.kernels.rope_append`; a host store of several chunks takes one UVA
        store per chunk and stored plane after it). A quantised cache (``kv_dtype``
        int8/int4) stores each token's codes and ``(step, lo)``, quantised once in the
        kernel; the ring and compressed keys keep the full-precision key. Does not wait for the layer's prefetch: the gather
        writes only slots ``< S`` and this only slot ``S`` (the wait is just before
        attention, design §6 step order). The cache's first ``b`` rows, in order (design §3.13).

        Returns ``(q [b, H_q, d], f [b, num_f, H_kv, d] or None)`` in the cache dtype.
        Raises:
            SpardaError: a step of more rows than the cache.
        """
        b = qkv.shape[0]
        self._check_rows(b)
        self._stash = None
        cfg = self.selection
        heads, d = self.ring[layer].shape[1], self.ring[layer].shape[3]
        pos = step.q_pos[:, 0]
        q = qkv.new_empty(b, heads * group, d)
        f = qkv.new_empty(b, num_f, heads, d) if num_f else None
        common = dict(num_kv_heads=heads, group=group, num_f=num_f, block_size=cfg.block_size,
                      kernel=cfg.kernel_size, stride=cfg.kernel_stride, ring=self.ring[layer][:b],
                      lengths=self.lengths[:b] if layer == self.num_layers - 1 else None)
        if layer in self.resident:
            kernels.rope_append(qkv, step.cos, step.sin, pos, q, f, self.k_full[layer][:b], self.v_full[layer][:b],
                                self.ck[layer][:b], **common)
            return q, f
        host = self._fused_host(layer)  # its block tables [B, N] (and [B, P]): the kernel reads rows < b
        k_slots, v_slots = self.k_slots[layer][:b], self.v_slots[layer][:b]
        kernels.rope_append(qkv, step.cos, step.sin, pos, q, f, k_slots, v_slots, self.ck[layer][:b],
                            slot=self.slots, **(host or {}), **common)
        if host is None:
            rows = torch.arange(b, device=pos.device)
            off = pos % cfg.block_size
            self._store_tokens(layer, k_slots[rows, :, self.slots, off], v_slots[rows, :, self.slots, off], pos)
        return q, f

    def _quantized(self, x: torch.Tensor):
        """``x`` as the host store holds it: quantised once (:class:`~sparda.kernels.quant.QuantizedKV`)
        for a quantised store, else itself."""
        store = self.host.kv_dtype
        return quant.QuantizedKV.quantize(x, store) if quant.is_quantized(store) else x

    def _check_rows(self, rows: int) -> None:
        """Refuse a decode step of more than the cache's rows (it runs rows ``0 .. rows - 1``)."""
        if rows > self.batch:
            raise SpardaError(f"a decode step of {rows} rows exceeds the offloaded cache's {self.batch} rows")

    def _store_tokens(self, layer: int, k_tok, v_tok, pos: torch.Tensor) -> None:
        """Write one decoded token per row (``[b, H, d]``, as stored, rows ``0 .. b - 1``) to the host store:
        one engine call per chunk and stored plane (data, then scales if quantised).
        ``k_tok, v_tok``: as :meth:`_slot_form` made them; ``pos [B]`` int64."""
        planes = [(k_tok, v_tok)] if not isinstance(k_tok, quant.QuantizedKV) else [
            (k_tok.data, v_tok.data), (k_tok.scale, v_tok.scale)]
        for chunk in self.host.chunks[layer]:
            for part, (kt, vt) in zip(chunk.planes(), planes):
                self.engine.store_tokens(part, kt, vt, pos)

    def _slot_planes(self, layer: int, rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``layer``'s K/V slot buffers (of the first ``rows`` rows; ``None``: all) as plain
        tensors, one pair per stored plane (as :meth:`~sparda.cache.host.HostChunk.planes`)."""
        k, v = self.k_slots[layer][:rows], self.v_slots[layer][:rows]
        if isinstance(k, quant.QuantizedKV):
            return [(k.data, v.data), (k.scale, v.scale)]
        return [(k, v)]

    def _append_prefill(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int,
                        end: int) -> None:
        """Prefill append of one row: ``k, v [H_kv, end - start, d]`` at tokens ``start ..
        end - 1`` (a chunk, :mod:`sparda.cache.chunked_prefill`; ``start = 0`` unless chunked).

        Offloaded layers: the chunk's K/V go to the host store; the layer's tokens ``< end``
        are the chunk itself, or after ``start > 0`` a device buffer holding the earlier
        chunks read back from the host.
        Then the compressed keys the chunk completes, the ring of the last ``kernel_size``
        keys and the partial block slot. Returns an offloaded layer's tokens ``< end`` of
        the row as stored (``keys, values [H_kv, >= end, d]``, for :meth:`view` while the
        layer runs), ``None`` for a resident layer."""
        cfg = self.selection
        staging = self._staging
        if staging is None and start > 0:  # chunks outside chunked_prefill(): synchronous copies
            staging = self._staging = self._new_staging(asynchronous=False)
        kq, vq = self._quantized(k), self._quantized(v)  # as stored (quantised once)
        if layer in self.resident:
            self.k_full[layer][row, :, start:end] = self._slot_form(k, kq)
            self.v_full[layer][row, :, start:end] = self._slot_form(v, vq)
            keys = self.k_full[layer][row]
        else:
            if staging is None:
                self.host.write_tokens(layer, row, kq, vq, start)
            else:
                staging.write(layer, row, kq, vq, start)
            self._prefill_stored(layer, row, k, v, start, end)
            self.slot_map[layer][row] = -1
            if start == 0:
                keys, values = kq, vq
            else:
                keys, values = staging.history(layer, row, start)
                keys[:, start:end] = kq
                values[:, start:end] = vq
            first = (end - 1) // cfg.block_size * cfg.block_size
            pk, pv = self._partial_block(layer, row, keys, values, first, end)
            self.k_slots[layer][row, :, self.slots, :end - first] = pk
            self.v_slots[layer][row, :, self.slots, :end - first] = pv
        if staging is not None and layer + 1 < self.num_layers:
            staging.prefetch(layer + 1, row, start)  # the next layer's earlier chunks, while this one runs
        if isinstance(kq, quant.QuantizedKV):  # compressed keys and ring from the unquantised keys
            j0, ck = window_keys(self.ring[layer][row], k, start, end, cfg.kernel_size, cfg.kernel_stride)
            self.ck[layer][row, :, j0:j0 + ck.shape[-2]] = ck
            fill_ring(self.ring[layer][row], k, start, end, cfg.kernel_size)
        else:
            j0, ck = kernels.completed_compressed_keys(keys, start, end, cfg.kernel_size, cfg.kernel_stride)
            self.ck[layer][row, :, j0:j0 + ck.shape[-2]] = ck
            pos = torch.arange(max(0, end - cfg.kernel_size), end, device=k.device)
            self.ring[layer][row, :, pos % cfg.kernel_size] = keys[:, pos]
        if layer == self.num_layers - 1:
            self.lengths[row] = end
        return None if layer in self.resident else (keys, values)

    def _new_staging(self, asynchronous: bool):
        from sparda.cache.chunked_prefill import PrefillStaging

        _, heads, _, dim = self.ck[0].shape
        return PrefillStaging(self.host, self.offloaded, heads, dim, self.capacity, self.ck[0].dtype,
                              self.device, asynchronous, kv_dtype=self.host.kv_dtype)

    @contextlib.contextmanager
    def chunked_prefill(self):
        """Context of one prompt's prefill (:meth:`sparda.LLM.prefill`): on CUDA its host
        writes and read-backs run on a side stream (:mod:`sparda.cache.chunked_prefill`);
        on exit the compute stream waits for them and the staging buffers are freed."""
        self._staging = self._new_staging(asynchronous=True)
        try:
            yield self
        finally:
            self._staging.finish()
            self._staging = None

    def end_prefill(self) -> None:
        self._stash = None

    # ----------------------------------------------------------------- view
    def compressed(self, layer: int, rows: int | None = None) -> torch.Tensor:
        """The compressed-key buffer ``[b, H, C_cap, d]`` of ``layer``'s first ``rows`` rows
        (``None``: all ``B``; a view, on the device)."""
        return self.ck[layer][:rows]

    def compressed_keys(self, layer: int, rows, num_tokens: int) -> torch.Tensor:
        """Gathered from the whole buffer: a resident layer's K/V (``k_full``/``v_full``,
        ``4 * H_kv * T * d`` bytes of bf16 read and written at ``T`` tokens by :meth:`view`)
        are not copied for a selection that never reads them."""
        return self.ck[layer][rows, :, :self.num_compressed(num_tokens)]

    def view(self, layer: int, rows: torch.Tensor, num_tokens: int):
        """K, V ``[b, H, num_tokens, d]`` and compressed keys ``[b, H, C, d]`` of ``rows``.

        Offloaded layers: only while their prefill chunk runs (the layer's K/V so far, from
        :meth:`append`); in decode their K/V are read through :meth:`fetch` / :meth:`attend`
        (the offload-aware methods of :mod:`sparda.attention.offload`), never whole.
        ``rows``: ``[b]`` int64 or a slice (:attr:`StepInfo.cache_rows`); ``num_tokens`` in
        tokens; ``C = num_compressed(num_tokens)``.

        Raises:
            SpardaError: ``num_tokens`` exceeds the capacity, or the K/V of an offloaded layer
                outside its prefill.
        """
        if num_tokens > self.capacity:
            raise SpardaError(f"{num_tokens} tokens exceed the cache capacity {self.capacity}")
        ck = self.ck[layer][rows, :, :self.num_compressed(num_tokens)]
        if layer in self.resident:
            return (quant.as_float(self.k_full[layer][rows, :, :num_tokens], self.dtype),
                    quant.as_float(self.v_full[layer][rows, :, :num_tokens], self.dtype), ck)
        if self._stash is not None and self._stash[0] == layer and self._stash[1].shape[-2] >= num_tokens:
            return self._stash[1][..., :num_tokens, :], self._stash[2][..., :num_tokens, :], ck
        if num_tokens == 0:
            empty = self.ck[layer].new_zeros(ck.shape[0], self.ck[layer].shape[1], 0, self.ck[layer].shape[-1])
            return empty, empty, ck
        raise SpardaError(f"layer {layer} is offloaded: its K/V are read through fetch/attend (an "
                          "offload-aware method such as sparse-offload or sparda --offload), not view")

    # ---------------------------------------------------------- fetch/attend
    def selection_ids(self, selection: torch.Tensor) -> torch.Tensor:
        """:meth:`fetch`'s block ids: a ``[B, H, N']`` bool block mask as ascending int64 ids
        ``[B, H, min(select_width, N')]`` (``-1`` padded, no host sync); ids pass unchanged."""
        if selection.dtype != torch.bool:
            return selection
        return ref.block_mask_to_indices(selection, min(self.select_width, selection.shape[-1]))

    def _diff_ids(self, selection: torch.Tensor, caller: str) -> torch.Tensor:
        """:meth:`selection_ids`, contiguous, ``-1`` in the :attr:`padding_rows`; SpardaError
        naming ``caller`` if wider than :attr:`select_width`, or if it has more rows than the
        cache (:meth:`_check_rows`)."""
        ids = self.selection_ids(selection)
        if ids.shape[-1] > self.select_width:
            raise SpardaError(f"{caller}: {ids.shape[-1]} block ids per row exceed the selection width "
                              f"{self.select_width} of this cache; select with width=cache.select_width")
        self._check_rows(ids.shape[0])
        if self.padding_rows is not None:  # a padding row's selection would only cost copies
            return ids.masked_fill(self.padding_rows[:ids.shape[0]].view(-1, 1, 1), -1)
        return ids if ids.is_contiguous() else ids.contiguous()

    def _slot_diff(self, layer: int, ids: torch.Tensor, pos: torch.Tensor, load: torch.Tensor,
                   attn_ids: torch.Tensor, counters: tuple, compact: tuple | None = None,
                   protect: torch.Tensor | None = None, hot_rule: bool = False) -> tuple:
        """:func:`sparda.kernels.slot_diff` of ``ids [b, H, W]`` against ``layer``'s block map,
        every per-row operand (``load``, ``attn_ids``, ``counters``, ``compact``, ``protect``:
        ``[B, ...]`` buffers, and a hot pool's :meth:`_hot_operands`) cut to the cache's first
        ``b`` rows (views; design §3.13): the kernel's grid is ``b * H`` programs. ``hot_rule``:
        a fetch (a hot pool's rule runs in the diff), not an early diff. Returns the rows'
        ``load [b, H, S]`` and their hot operands (``None`` without a hot pool)."""
        b = ids.shape[0]
        load = load[:b]
        hot = self._hot_operands(layer, load, update=hot_rule)
        kernels.slot_diff(ids, self.slot_map[layer][:b], pos, self.block_size, self.num_blocks, load,
                          attn_ids[:b], tuple(c[:b] for c in counters),
                          None if compact is None else tuple(c[:b] for c in compact),
                          protect=None if protect is None else protect[:b], hot=hot)
        return load, hot

    def fetch(self, layer: int, selection: torch.Tensor, pos: torch.Tensor, prefetch: bool = False,
              counters: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Make ``layer``'s selected blocks resident in its slots (decode).

        Diffs the selection (minus the current block, which lives in the partial slot)
        against the block map in one kernel (:func:`sparda.kernels.slot_diff`: no sort, no
        host read), which also writes the ids :meth:`attend` reads and the hit/miss
        counters (``mixed``: and runs the hot rule, design §6.1), then copies only the
        misses: on a side stream with an event if
        ``prefetch`` (:meth:`attend` waits on it), else on the compute stream.

        Args:
            selection: ``[b, H, W]`` int32/int64 selected block ids of the cache's first ``b``
                rows (design §3.13), ascending, ``-1`` padded (``W <= select_width``; as from
                :func:`sparda.kernels.select_decode_blocks` with ``width = select_width``), or a
                ``[b, H, N']`` bool block mask (converted). Rows ``b ..`` are not touched.
            pos: ``[b]`` int64 position of this step's token (its block is the current one).
            counters: optional ``(blocks_read, blocks_valid)`` ``[b]`` int64 device counters
                of the method, incremented by the same kernel.
        Raises:
            SpardaError: ids wider than :attr:`select_width`, or more rows than the cache.
        """
        if layer in self.resident:
            return
        ids = self._diff_ids(selection, "fetch")
        pref, scratch = self.prefetcher, self._scratch_count
        read, valid = counters if counters is not None else (scratch, scratch)
        load, hot = self._slot_diff(layer, ids, pos, self.load[layer], self.attn_ids[layer],
                                    (pref.hits, pref.misses, read, valid),
                                    compact=(self.attn_blocks[layer], self.attn_slots[layer]), hot_rule=True)
        self._copy_misses(layer, load, prefetch, hot=hot)

    def warm(self, layer: int, selection: torch.Tensor, pos: torch.Tensor) -> None:
        """Early copy of a two-ahead prediction into ``layer``'s slots (design §6.2; decode).

        The early diff (:func:`sparda.kernels.slot_diff` with ``protect``): the prediction's
        misses go to empty slots, then to slots holding a block in neither the prediction nor
        the layer's last selection (``attn_ids``), the rest are not copied; the copy is
        enqueued on the side stream like a prefetch. Writes :attr:`early_load` and the block
        map only; counts the copied blocks into the prefetcher's ``early``. The layer's next
        :meth:`fetch` decides what it attends. Resident layers: nothing.

        Args:
            selection: ``[b, H, W]`` ids or ``[b, H, N']`` bool mask of the cache's first ``b``
                rows (design §3.13), as :meth:`fetch`; rows ``b ..`` are not touched.
            pos: ``[b]`` int64 position of this step's token.
        Raises:
            SpardaError: ids wider than :attr:`select_width`, or more rows than the cache.
        """
        if layer in self.resident:
            return
        ids = self._diff_ids(selection, "warm")
        scratch = self._scratch_count
        load, hot = self._slot_diff(layer, ids, pos, self.early_load[layer], self._early_attn,
                                    (scratch, self.prefetcher.early, scratch, scratch), protect=self.attn_ids[layer])
        self._copy_misses(layer, load, prefetch=True, early=True, hot=hot)

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s pending prefetch (no host sync)."""
        self.prefetcher.wait(layer)

    def attend(self, layer: int, q: torch.Tensor, kv_len: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Decode attention of ``q [b, H, G, d]`` (the first ``b`` rows) over the fetched blocks
        plus the current one.

        Waits for the layer's prefetch, then reads the slots the last :meth:`fetch` of
        ``layer`` selected (its ids, written by the slot diff) plus the partial slot; exact
        softmax over those tokens with ``key < kv_len``. ``kv_len, pos``: ``[b]`` int64
        (tokens). Returns ``[b, H, G, d]`` in ``q``'s dtype.

        Raises:
            SpardaError: shape/dtype mismatch (Triton path of
                :func:`sparda.kernels.decode_attention_slots`).
        """
        self.wait(layer)
        b = q.shape[0]
        return kernels.decode_attention_slots(q, self.k_slots[layer][:b], self.v_slots[layer][:b],
                                              self.attn_blocks[layer][:b], self.attn_slots[layer][:b], kv_len)

    def offload_stats(self, tokens: int, row: int | None = None, saved: list | None = None) -> dict[str, float]:
        """Prefetch counters of cache row ``row``, of the whole batch or ``saved`` (a preempted
        row's) over ``tokens`` decoded tokens (:meth:`~sparda.cache.prefetch.Prefetcher.stats`)
        plus the memory split."""
        stats = self.prefetcher.stats(tokens, row, saved)
        stats.update(engine=self.engine.name, host_bytes=self.host.nbytes, device_bytes=self.device_bytes)
        return stats
