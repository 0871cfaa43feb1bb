"""Offloaded block-sparse methods (design §6): ``sparse-offload``, ``sparda-no-prefetch``, ``sparda``.

All three run on :class:`~sparda.cache.offload.OffloadKVCache` with the same storage,
slot diff and transfer engine, so they differ only in *when* blocks are chosen and
copied:

* ``sparse-offload``: layer ``l`` selects with its own query (design §3), then fetches
  its misses synchronously (on the compute stream) and attends;
* ``sparda-no-prefetch``: layer ``l``'s blocks were chosen in layer ``l-1`` by the
  Forecast (design §4); layer ``l`` fetches them synchronously before its attention;
* ``sparda`` (offloaded): in layer ``l`` the Forecast scores layer ``l+1``'s
  compressed keys as they stood before this step's token, selects, diffs against
  layer ``l+1``'s slots and enqueues the copy of the misses -- all of it on side
  streams (:meth:`~sparda.cache.prefetch.Prefetcher.ahead`), so none of it sits on the
  compute stream; layer ``l`` then waits for its own prefetch and attends (lookahead
  prefetch). With ``lookahead=2`` layer ``l`` also starts the early copy of layer ``l+2``'s
  two-ahead prediction (design §6.2), after layer ``l+1``'s copy.

Layer 0 has no predecessor: its blocks come from ``W^C_0`` (sparda) or its query
(sparse) and are fetched synchronously unless layer 0 is resident
(``resident_layers``, default ``(0,)``). Prefill runs the on-device method over the
prompt (the prompt's K/V are on the device while the layer runs) and writes the
K/V to the host. Decode indices never leave the device (no ``.item()``); the transfer
engine decides whether a fetch synchronises (``uva``: no; ``copy``, ``sync``: yes).
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.attention.blocksparse import SparseAttention
from sparda.attention.forecast import Forecast, ForecastAttention, on_model, weights_for
from sparda.attention.baselines.shallow import ShallowAttention


class OffloadDecodeMixin:
    """Shared decode path: fetch (or use prefetched) blocks, attend over the slots."""

    #: the engine builds an OffloadKVCache for this method
    offloaded = True
    #: layers whose K/V stay whole on the device
    resident_layers: tuple[int, ...] = (0,)
    #: dense heads (design §3.7): their layers stay resident (:meth:`cache_resident_layers`)
    #: and read every visible block there (:meth:`_resident_ids`); the slot buffer is untouched
    supports_dense_heads = True

    def _select(self, query: torch.Tensor, ck: torch.Tensor, pos: torch.Tensor, cache,
                ck_len: torch.Tensor | None = None) -> torch.Tensor:
        """Decode selection: block ids ``[b, H, W]`` int32, ascending, ``-1`` padded (``W`` =
        the cache's ``select_width``), from ``query`` ([b,H,G,d] or Forecast [b,H,d]) and the
        compressed keys ``ck [b, H, C_cap, d]`` of the step's rows (``cache.compressed``).

        On CUDA ``N = N_cap`` and the whole compressed-key buffer is scored (static shapes,
        no host sync). On the CPU, where reading the length costs nothing, ``N`` and the
        compressed keys are cut to the live length exactly as the on-device methods cut
        them, so that both break score ties identically.
        """
        num_blocks = cache.num_blocks
        if not ck.is_cuda:
            live = int(pos.max()) + 1
            num_blocks = -(-live // self.selection.block_size)
            ck = ck[:, :, :cache.num_compressed(live if ck_len is None else live - 1)]
        return kernels.select_decode_blocks(query, ck, pos, num_blocks, self.selection, ck_len=ck_len,
                                            width=cache.select_width)

    def _fetch_or_count(self, layer: int, ids: torch.Tensor, cache, step, prefetch: bool = False) -> torch.Tensor:
        """Fetch ``ids`` into an offloaded layer's slots (counting in the slot diff), or only
        count them for a resident layer; returns the ids :meth:`_attend_decode` reads
        (``ids``, widened for a resident layer's dense heads by :meth:`_resident_ids`)."""
        if cache.is_offloaded(layer):
            cache.fetch(layer, ids, step.q_pos[:, 0], prefetch=prefetch, counters=self._counters(cache, step))
            return ids
        ids = self._resident_ids(layer, ids, cache, step)
        self._count_ids(cache, step, ids)
        return ids

    def _resident_ids(self, layer: int, ids: torch.Tensor, cache, step) -> torch.Tensor:
        """A resident layer's decode block ids: ``ids [B, H, W]`` (``-1`` padded), with the
        KV heads of ``config.dense_heads`` in ``layer`` reading every visible block instead
        (design §3.7): ``[B, H, W']``, ``W' = max(W, N)`` with ``N`` the cache's blocks on CUDA
        (static shape) or the live blocks on the CPU. ``ids`` itself if the layer has none."""
        dense = self._dense_heads(layer, step, ids.device)
        if dense is None:
            return ids
        bs = self.selection.block_size
        pos = step.q_pos[:, 0]
        blocks = cache.num_blocks if ids.is_cuda else int(pos.max()) // bs + 1
        width = max(blocks, ids.shape[-1])
        every = torch.arange(width, device=ids.device, dtype=ids.dtype).view(1, 1, -1)
        every = torch.where(every <= (pos // bs).view(-1, 1, 1).to(ids.dtype), every, -1)
        wide = torch.nn.functional.pad(ids, (0, width - ids.shape[-1]), value=-1)
        return torch.where(dense.view(1, -1, 1), every, wide)

    def _attend_decode(self, layer: int, q: torch.Tensor, ids: torch.Tensor, cache, step) -> torch.Tensor:
        """Attention ``[B, H, G, 1, d]``: over the slots of an offloaded layer (its fetch
        already ran), over ``ids [B, H, W]`` of the full buffer of a resident one (as
        :meth:`_fetch_or_count` returned them)."""
        pos = step.q_pos[:, 0]
        q0 = q[:, :, :, 0]
        if cache.is_offloaded(layer):
            out = cache.attend(layer, q0, step.kv_len, pos)
        else:  # the step's rows: the cache's first b (design §3.13)
            b = step.batch
            out = kernels.decode_attention(q0, cache.k_full[layer][:b], cache.v_full[layer][:b], ids,
                                           step.kv_len, self.selection.block_size)
        return out.unsqueeze(3)

    def cache_resident_layers(self) -> tuple[int, ...]:
        """Layers whose K/V stay whole on the device: :attr:`resident_layers` plus every
        layer with a dense head (``config.dense_heads``, design §3.7)."""
        return tuple(sorted(set(self.resident_layers) | {lay for lay, _ in self.config.dense_heads}))


class SparseOffloadAttention(OffloadDecodeMixin, SparseAttention):
    """``sparse-offload``: own-query selection, synchronous fetch (design §6 baseline)."""

    name = "sparse-offload"

    def attend(self, layer, q, h, cache, step):
        """``q [B, H, G, Tq, d]`` -> same shape, ``q``'s dtype. Prefill: the on-device
        method. Decode (``Tq = 1``): select with the layer's own query, fetch the misses
        synchronously, attend over the slots. Raises SpardaError (Triton path) on a
        shape/dtype mismatch."""
        if step.phase != "decode":
            return super().attend(layer, q, h, cache, step)
        ids = self._select(q[:, :, :, 0], cache.compressed(layer, step.batch), step.q_pos[:, 0], cache)
        ids = self._fetch_or_count(layer, ids, cache, step)
        return self._attend_decode(layer, q, ids, cache, step)


class OffloadedForecastAttention(OffloadDecodeMixin, ForecastAttention):
    """``sparda`` offloaded: Forecast selection of layer ``l+1`` in layer ``l`` with
    lookahead prefetch on a side stream (design §4, §6)."""

    name = "sparda"
    #: copy layer l+1's misses during layer l (False: synchronous fetch in layer l+1)
    prefetch = True

    def __init__(self, config, shape, model=None, model_dir=None, forecast: Forecast | None = None,
                 forecast2: Forecast | None = None) -> None:
        """As :class:`ForecastAttention`; with ``config.lookahead == 2`` also the two-ahead heads
        (``forecast2``, else ``config.forecast2_path``, else the shipped ones; design §6.2).

        Raises:
            SpardaError: as :class:`ForecastAttention`, for either set of weights.
        """
        self._next: dict[int, torch.Tensor] = {}  # layer -> block ids chosen in the layer before
        super().__init__(config, shape, model=model, model_dir=model_dir, forecast=forecast)
        self.meta2: dict[str, str] = {}  # the two-ahead weight file's metadata
        if config.lookahead == 2:
            if forecast2 is None:
                forecast2, self.meta2 = weights_for(config.forecast2_path, model, shape, model_dir, ahead=2)
            self.forecast2 = on_model(forecast2, model)

    def reset(self) -> None:
        """Clear stored Forecast queries/masks and pending next-layer masks."""
        super().reset()
        self._next = {}

    def attend(self, layer, q, h, cache, step):
        """``q [B, H, G, Tq, d]`` -> same shape, ``q``'s dtype (design §4, §6 step order).

        Prefill: :meth:`ForecastAttention.attend`. Decode: take the mask chosen in layer
        ``l-1`` (``W^C_0`` at layer 0, fetched synchronously), Forecast-select layer
        ``l+1`` from ``h [B, 1, d_model]`` over its compressed keys before this token and
        enqueue its prefetch (or fetch synchronously without ``prefetch``), then attend.
        Raises KeyError if layer ``l-1`` stored no mask (layers run out of order).
        """
        if step.phase != "decode":
            return super().attend(layer, q, h, cache, step)
        pos = step.q_pos[:, 0]
        if layer == 0:  # W^C_0 scores layer 0's own compressed keys
            ids = self._select(self.forecast_query(0, h, step), cache.compressed(0, step.batch), pos, cache)
            ids = self._fetch_or_count(0, ids, cache, step)
        else:
            ids = self._next.pop(layer)
            if not self.prefetch:
                ids = self._fetch_or_count(layer, ids, cache, step)
        if layer + 1 < self.shape.num_layers:
            # layer l+1's compressed keys before this step's token: the windows in [0, pos)
            query, ck_len = self.forecast_query(layer + 1, h, step), self._ck_len_before(step)
            if self.prefetch and cache.is_offloaded(layer + 1):
                self._counters(cache, step)  # allocated (first step) on the compute stream
                with cache.prefetcher.ahead(layer + 1, query, ck_len, pos):  # off the compute stream
                    nxt = self._select(query, cache.compressed(layer + 1, step.batch), pos, cache, ck_len=ck_len)
                    nxt = self._fetch_or_count(layer + 1, nxt, cache, step, prefetch=True)
            else:
                nxt = self._select(query, cache.compressed(layer + 1, step.batch), pos, cache, ck_len=ck_len)
                if self.prefetch:
                    nxt = self._fetch_or_count(layer + 1, nxt, cache, step, prefetch=True)
            self._next[layer + 1] = nxt
        if (self.forecast2 is not None and self.prefetch and layer + 2 < self.shape.num_layers
                and cache.is_offloaded(layer + 2)):
            self._warm(layer, h, cache, step)
        return self._attend_decode(layer, q, ids, cache, step)

    def _warm(self, layer: int, h: torch.Tensor, cache, step) -> None:
        """Design §6.2 step 5b: ``F2_layer`` scores layer ``layer+2``'s compressed keys before this
        step's token, selects, and starts the early copy of the misses (:meth:`OffloadKVCache.warm`)
        on the side streams, behind layer ``layer+1``'s copy."""
        pos = step.q_pos[:, 0]
        query, ck_len = self.forecast_query(layer + 2, h, step, ahead=2), self._ck_len_before(step)
        with cache.prefetcher.ahead(layer + 2, query, ck_len, pos):
            early = self._select(query, cache.compressed(layer + 2, step.batch), pos, cache, ck_len=ck_len)
            cache.warm(layer + 2, early, pos)

    def _ck_len_before(self, step) -> torch.Tensor:
        """``[B]`` compressed keys complete before this step's token (design §4), once per step."""
        cached = getattr(step, "_ck_len_before", None)
        if cached is None:
            cfg, pos = self.selection, step.q_pos[:, 0]
            cached = torch.where(pos >= cfg.kernel_size, (pos - cfg.kernel_size) // cfg.kernel_stride + 1, 0)
            step._ck_len_before = cached
        return cached


class SpardaNoPrefetchAttention(OffloadedForecastAttention):
    """``sparda-no-prefetch``: Forecast selection, synchronous fetch before each attention."""

    name = "sparda-no-prefetch"
    prefetch = False


class OffloadedShallowAttention(OffloadDecodeMixin, ShallowAttention):
    """``shallow --offload``: the shallow-layer shared mask (design §7) on the offloaded cache.

    Layers ``0..N-1`` stay whole on the device (they attend densely and measure the block
    mass); the deep layers ``N..L-1`` live in host memory. The mask is known once layer
    ``N-1`` has run, and it is the same for every deep layer, so in layer ``N-1`` the
    fetches of *all* deep layers are enqueued at once: on CUDA each on the selection and
    copy streams (:meth:`~sparda.cache.prefetch.Prefetcher.ahead`), every deep layer waiting
    for its own copy just before its attention (:meth:`OffloadKVCache.attend`), so the copy
    of layer ``l`` overlaps the compute of layers ``N-1 .. l-1``; off CUDA the same calls
    copy synchronously. Same mask, same tokens as on-device ``shallow`` (tests: fp32 logits).
    """

    name = "shallow"
    #: decode reads the shared mask, not BlockSparseMethod.attend's: no dense heads (design §3.7)
    supports_dense_heads = False

    def cache_resident_layers(self) -> tuple[int, ...]:
        """The shallow layers ``0..N-1``: they read every block of their K/V each step."""
        return tuple(range(self.num_shallow))

    def attend(self, layer, q, h, cache, step):
        """``q [B, H, G, Tq, d]`` -> same shape, ``q``'s dtype. Prefill and the shallow layers:
        :meth:`ShallowAttention.attend` (dense; the last shallow layer makes the mask, then
        the deep layers' fetches are enqueued). Deep layers in decode: attention over their
        slots (the fetch of layer ``N-1`` filled them). Raises SpardaError (Triton path) on a
        shape/dtype mismatch."""
        if step.phase != "decode" or layer < self.num_shallow:
            out = super().attend(layer, q, h, cache, step)
            if step.phase == "decode" and layer == self.num_shallow - 1:
                self._fetch_deep(cache, step)
            return out
        return self._attend_decode(layer, q, None, cache, step)

    def _fetch_deep(self, cache, step) -> None:
        """Make this step's shared mask resident in every deep layer's slots (design §7)."""
        mask, pos = self._mask[:, :, -1, :], step.q_pos[:, 0]  # [B, H, N] bool, [B]
        ids = cache.selection_ids(mask)  # once for every deep layer
        counters = self._counters(cache, step)  # allocated on the compute stream
        for deep in range(self.num_shallow, self.shape.num_layers):
            with cache.prefetcher.ahead(deep, ids, pos):
                cache.fetch(deep, ids, pos, prefetch=True, counters=counters)


#: on-device method name -> its offloaded variant (``--offload``)
OFFLOADED = {"sparse": SparseOffloadAttention, "sparda": OffloadedForecastAttention,
             "shallow": OffloadedShallowAttention}
