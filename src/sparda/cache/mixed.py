"""The offloaded KV cache of ``kv_dtype`` ``mixed`` (design §6.1): an int4 host store plus a
bf16 hot pool.

:class:`MixedOffloadKVCache` is an :class:`~sparda.cache.offload.OffloadKVCache` whose host
store (:class:`~sparda.cache.host.HostKVStore`, ``kv_dtype="mixed"``) holds every block in
int4 in its pages (through the block table, as ``int4``) and, per offloaded layer and row,
``P`` blocks in ``dtype`` in its hot pool, a fixed number per row
(:attr:`~sparda.cache.host.HostKVStore.pool`, block ``n`` in pool slot ``n mod P``); the
rule of which blocks are hot is :class:`~sparda.cache.hot.HotBlocks`. The slots and resident
layers hold ``dtype``, so attention reads a hot block exact and a cold one int4-dequantised.
:func:`new_offload_cache` picks the class for a ``kv_dtype``.
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.cache.hot import HotBlocks, default_hot_blocks
from sparda.cache.offload import OffloadKVCache
from sparda.config import DEFAULT_HOT_STEPS
from sparda.kernels import quant


class MixedOffloadKVCache(OffloadKVCache):
    """:class:`~sparda.cache.offload.OffloadKVCache` with ``kv_dtype="mixed"`` (module doc).

    Decoded tokens go exact to the partial slot and the hot pool, int4 to the store (in the
    fused append's kernel, :meth:`_fused_host`); a prefill chunk goes int4 to the store and
    exact to the pool, and the local window at its end is hot. A fetch's slot diff first
    applies the hot rule (a demoted block's ``dtype`` copy leaves its GPU slot too) and
    splits its loads (:meth:`_hot_operands`, one kernel), then the copy takes a hot miss's
    ``dtype`` copy from the pool and a cold miss's int4 codes and scales into :attr:`cold_k`
    / :attr:`cold_v` (``[B, H, S, bs, d]`` logical, int4), dequantised from there into its slot.

    Args:
        args, kwargs: as :class:`~sparda.cache.offload.OffloadKVCache` (``kv_dtype`` is
            ``mixed``, not passed).
        hot_blocks: ``P``, pool blocks per (row, KV head), at most the blocks of
            ``capacity`` (``None``: the budget, :func:`~sparda.cache.hot.default_hot_blocks`).
        hot_steps: ``R``, decode steps a block stays hot unselected (``None``: 4). Both are
            checked by the config.
    Raises:
        SpardaError: as :class:`~sparda.cache.offload.OffloadKVCache`.
    """

    def __init__(self, *args, hot_blocks: int | None = None, hot_steps: int | None = None, **kwargs) -> None:
        self._hot_request = hot_blocks  # read by _pool_blocks, in the base constructor
        #: ``R``
        self.hot_steps = DEFAULT_HOT_STEPS if hot_steps is None else hot_steps
        super().__init__(*args, kv_dtype="mixed", **kwargs)
        #: the hot-block state (:mod:`sparda.cache.hot`)
        self.hot = HotBlocks(self.offloaded, self.batch, self.num_kv_heads, self.num_blocks, self.selection,
                             self.hot_blocks, self.hot_steps, self.device)

    # ---------------------------------------------------------------- hooks
    def _row_history(self) -> list[torch.Tensor]:
        """Plus the hot-block state (a recompute's prefill would leave only its local window
        hot; its pool then holds the exact copies of the saved hot blocks, the last ``P``)."""
        return super()._row_history() + [t for layer in self.offloaded for t in (self.hot.hot[layer],
                                                                                 self.hot.last[layer])]

    def _pool_blocks(self) -> int:
        want = default_hot_blocks(self.selection) if self._hot_request is None else self._hot_request
        return min(want, self.num_blocks)

    def _pool_block_bytes(self) -> int:
        return self.host.hot_block_bytes

    def _alloc_fetch_staging(self, layer: int) -> None:
        """The int4 staging of ``S`` slots per (row, KV head) that cold misses land in."""
        b, h, _, bs, d = self.k_slots[layer].shape
        cold = (b, h, self.slots, bs, d)
        self.cold_k[layer] = quant.QuantizedKV.zeros(cold, quant.MIXED_STORE, self.device)
        self.cold_v[layer] = quant.QuantizedKV.zeros(cold, quant.MIXED_STORE, self.device)

    def _slot_form(self, x, stored=None):
        """Exact: ``x`` in ``dtype`` (the store's int4 form is not what slots hold)."""
        return x.to(self.dtype)

    def _prefill_stored(self, layer: int, row: int, k: torch.Tensor, v: torch.Tensor, start: int,
                        end: int) -> None:
        """Exact copies in the hot pool; the local window at ``end`` is hot."""
        self.host.write_pool_tokens(layer, row, k.to(self.dtype), v.to(self.dtype), start)
        self.hot.prefill(layer, row, end)

    def _partial_block(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor, first: int,
                       end: int) -> tuple:
        """The current block is hot: its exact tokens from the pool (``keys, values`` are int4)."""
        pk, pv = self.host.pool_block(layer, row, slice(None), first // self.block_size)
        return pk[:, :end - first].to(self.device), pv[:, :end - first].to(self.device)

    def _fused_host(self, layer: int) -> dict | None:
        """The int4 store (``host``, quantised in the kernel) and the hot pool (``pool``, the
        exact token at pool slot ``block mod P``) when each is one chunk and the engine is
        asynchronous; else ``None``: :meth:`_store_tokens` writes both after."""
        store, pool = self.host.chunks[layer], self.host.pool[layer]
        if len(store) == 1 and len(pool) == 1 and self.engine.name != "sync":
            return dict(host=(store[0].k, store[0].v, store[0].table),
                        pool=(pool[0].k, pool[0].v, pool[0].table, self.hot_blocks))
        return None

    def _store_tokens(self, layer: int, k_tok, v_tok, pos: torch.Tensor) -> None:
        """``k_tok, v_tok [b, H, d]`` exact (rows ``0 .. b - 1``): to the hot pool at pool slot
        ``block mod P``, then int4 to the store."""
        bs, pool = self.block_size, self.hot_blocks
        ring_pos = (pos // bs) % pool * bs + pos % bs
        for chunk in self.host.pool[layer]:
            self.engine.store_tokens(chunk, k_tok, v_tok, ring_pos)
        super()._store_tokens(layer, self._quantized(k_tok), self._quantized(v_tok), pos)

    def _hot_operands(self, layer: int, load: torch.Tensor, update: bool):
        """The hot pool's part of the slot diff of the first ``b`` rows of ``load [b, H, S]``
        (:meth:`~sparda.cache.hot.HotBlocks.split_operands`, cut to ``[:b]``, design §3.13):
        a fetch (``update``) runs the hot rule in the same kernel, whose demoted blocks'
        ``dtype`` copies leave their GPU slots before the diff; either way the loads are split
        into pool and cold lists and the pool misses counted
        (:attr:`~sparda.cache.prefetch.Prefetcher.pool_misses`). An early diff (design §6.2)
        runs before its step's hot rule: a block is copied from the pool only if its pool slot
        is not the current block's."""
        return self.hot.split_operands(layer, load, self.prefetcher.pool_misses, update)

    def _copy_misses(self, layer: int, load: torch.Tensor, prefetch: bool, early: bool = False,
                     hot=None) -> None:
        """A hot block's ``dtype`` copy from the pool (``hot.pool_load``), a cold block's int4
        codes and scales (``hot.cold_load``) into :attr:`cold_k` / :attr:`cold_v`, dequantised
        from there into its slot (:func:`sparda.kernels.dequantize_cold_slots`: on CUDA only
        the slots that received a cold block are read and written). ``load [b, H, S]``: the
        cache's first ``b`` rows (design §3.13), whose slots and staging alone are written."""
        from_pool, cold = hot.pool_load, hot.cold_load
        b = load.shape[0]
        k_slots, v_slots = self.k_slots[layer][:b], self.v_slots[layer][:b]
        ck, cv = self.cold_k[layer][:b], self.cold_v[layer][:b]
        planes = [(ck.data, cv.data), (ck.scale, cv.scale)]
        s = self.slots

        def copy() -> None:
            for chunk in self.host.pool[layer]:
                self.engine.gather(chunk, k_slots, v_slots, from_pool)
            for chunk in self.host.chunks[layer]:
                self.engine.gather_planes(chunk, planes, cold)
            kernels.dequantize_cold_slots(ck, cv, k_slots[:, :, :s], v_slots[:, :, :s], cold)

        self.prefetcher.fetch(layer, copy, None, None, keep=(from_pool, cold), prefetch=prefetch, early=early)

    # ---------------------------------------------------------------- stats
    def offload_stats(self, tokens: int, row: int | None = None, saved: list | None = None) -> dict[str, float]:
        """:meth:`~sparda.cache.offload.OffloadKVCache.offload_stats` plus ``kv_hot_blocks``
        (``P``), ``kv_hot_steps`` (``R``) and ``pool_bytes`` (the hot pool's host bytes)."""
        stats = super().offload_stats(tokens, row, saved)
        stats.update(kv_hot_blocks=self.hot_blocks, kv_hot_steps=self.hot_steps, pool_bytes=self.host.pool_bytes)
        return stats


def new_offload_cache(*args, kv_dtype: str = "bf16", **kwargs) -> OffloadKVCache:
    """An offloaded KV cache of ``kv_dtype``: :class:`MixedOffloadKVCache` for ``mixed`` (whose
    ``kwargs`` may hold ``hot_blocks``, ``hot_steps``), else
    :class:`~sparda.cache.offload.OffloadKVCache`; ``args``, ``kwargs`` as those take them
    (``host_blocks``: host pages per offloaded layer, ``None`` the identity block table)."""
    if kv_dtype == "mixed":
        return MixedOffloadKVCache(*args, **kwargs)
    return OffloadKVCache(*args, kv_dtype=kv_dtype, **kwargs)
