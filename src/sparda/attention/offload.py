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
  layer ``l+1``'s slots and enqueues the copy of the misses on the side stream; layer
  ``l`` then waits for its own prefetch event and attends (lookahead prefetch).

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
from sparda.attention.forecast import ForecastAttention


class OffloadDecodeMixin:
    """Shared decode path: fetch (or use prefetched) blocks, attend over the slots."""

    #: the engine builds an OffloadKVCache for this method
    offloaded = True
    #: layers whose K/V stay whole on the device
    resident_layers: tuple[int, ...] = (0,)

    def _select(self, query: torch.Tensor, ck: torch.Tensor, pos: torch.Tensor, cache,
                ck_len: torch.Tensor | None = None) -> torch.Tensor:
        """Decode selection ``[B, H, N]`` bool from ``query`` ([B,H,G,d] or [B,H,d]).

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
        _, mask = kernels.select_decode_blocks(query, ck, pos, num_blocks, self.selection,
                                               ck_len=ck_len, width=cache.slots, return_mask=True)
        return mask

    def _attend_decode(self, layer: int, q: torch.Tensor, mask: torch.Tensor | None, cache, step,
                       ) -> torch.Tensor:
        """Attention ``[B, H, G, 1, d]``; ``mask`` given: fetch it now (synchronously)."""
        pos = step.q_pos[:, 0]
        q0 = q[:, :, :, 0]
        if cache.is_offloaded(layer):
            if mask is not None:
                cache.fetch(layer, mask, pos, prefetch=False)
            out = cache.attend(layer, q0, step.kv_len, pos)
        else:
            ids = kernels.reference.block_mask_to_indices(mask, cache.slots)
            out = kernels.decode_attention(q0, cache.k_full[layer], cache.v_full[layer], ids,
                                           step.kv_len, self.selection.block_size)
        return out.unsqueeze(3)


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
        mask = self._select(q[:, :, :, 0], cache.compressed(layer), step.q_pos[:, 0], cache)
        self._count(step, mask)  # base: device tensors, no sync
        return self._attend_decode(layer, q, mask, cache, step)


class OffloadedForecastAttention(OffloadDecodeMixin, ForecastAttention):
    """``sparda`` offloaded: Forecast selection of layer ``l+1`` in layer ``l`` with
    lookahead prefetch on a side stream (design §4, §6)."""

    name = "sparda"
    #: copy layer l+1's misses during layer l (False: synchronous fetch in layer l+1)
    prefetch = True

    def reset(self) -> None:
        """Clear counters, stored Forecast queries/masks and pending next-layer masks."""
        super().reset()
        self._next: dict[int, torch.Tensor] = {}

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
        if not hasattr(self, "_next"):
            self._next = {}
        cfg = self.selection
        pos = step.q_pos[:, 0]
        if layer == 0:  # W^C_0 scores layer 0's own compressed keys
            f0 = self.forecast.project(0, h, step.cos, step.sin)[:, :, 0]
            mask = self._select(f0, cache.compressed(0), pos, cache)
            sync_mask = mask
        else:
            mask = self._next.pop(layer)
            sync_mask = None if self.prefetch else mask
        if sync_mask is not None and cache.is_offloaded(layer):
            cache.fetch(layer, sync_mask, pos, prefetch=False)
        if layer + 1 < self.shape.num_layers:
            f = self.forecast.project(layer + 1, h, step.cos, step.sin)[:, :, 0]
            # layer l+1's compressed keys before this step's token: the windows in [0, pos)
            ck_len = torch.where(pos >= cfg.kernel_size, (pos - cfg.kernel_size) // cfg.kernel_stride + 1, 0)
            nxt = self._select(f, cache.compressed(layer + 1), pos, cache, ck_len=ck_len)
            if self.prefetch:
                cache.fetch(layer + 1, nxt, pos, prefetch=True)
            self._next[layer + 1] = nxt
        self._count(step, mask)  # base: device tensors, no sync
        return self._attend_decode(layer, q, mask if not cache.is_offloaded(layer) else None, cache, step)


class SpardaNoPrefetchAttention(OffloadedForecastAttention):
    """``sparda-no-prefetch``: Forecast selection, synchronous fetch before each attention."""

    name = "sparda-no-prefetch"
    prefetch = False


#: on-device method name -> its offloaded variant (``--offload``)
OFFLOADED = {"sparse": SparseOffloadAttention, "sparda": OffloadedForecastAttention}
