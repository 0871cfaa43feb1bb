"""The fused decode step's append (design §6) into either cache, quantised ones included.

:class:`~sparda.model.fused.FusedDecoder` calls :func:`rope_append` once per layer. For
:class:`~sparda.cache.device.DeviceKVCache` (every ``kv_dtype``) and an unquantised
:class:`~sparda.cache.offload.OffloadKVCache` it is the cache's own ``rope_append``. A
quantised offloaded cache (``kv_dtype`` int8/int4, docs/kv_quant.md) goes through
:func:`offload_rope_append`, which is ``OffloadKVCache.rope_append`` written for every
``kv_dtype``: the method still refuses a quantised cache and is to take this body (its
two differences: no refusal, and the write-back of a multi-chunk or ``sync`` host store
goes through ``OffloadKVCache._store_tokens``, one engine call per stored plane), after
which this module reduces to the method call.
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.errors import SpardaError
from sparda.kernels import quant


def rope_append(cache, layer: int, qkv: torch.Tensor, step, group: int, num_f: int):
    """RoPE + KV append + compressed-key update of one decode token per cache row.

    Args:
        cache: a :class:`~sparda.cache.device.DeviceKVCache` or
            :class:`~sparda.cache.offload.OffloadKVCache`.
        layer: layer index. qkv: ``[B, (H_q + (2 + num_f) H_kv) d]`` the layer's stacked
            projection output. step: the decode :class:`~sparda.model.llama.StepInfo`
            (``q_pos [B, 1]`` int64, ``cos``/``sin``). group: ``G``. num_f: Forecast heads.
    Returns:
        ``(q [B, H_q, d], f [B, num_f, H_kv, d] or None)`` in ``qkv``'s dtype.
    """
    if hasattr(cache, "host") and quant.is_quantized(cache.kv_dtype):
        return offload_rope_append(cache, layer, qkv, step, group, num_f)
    return cache.rope_append(layer, qkv, step, group, num_f)


def offload_rope_append(cache, layer: int, qkv: torch.Tensor, step, group: int, num_f: int):
    """``OffloadKVCache.rope_append`` for every ``kv_dtype`` (module doc).

    One kernel (:func:`sparda.kernels.rope_append`): RoPE of the queries, the key and the
    Forecast heads; the K/V write -- resident layer: its full buffer; offloaded layer: the
    partial slot and, for a single-chunk store and a device engine, the host store through
    UVA (a quantised cache: the codes and ``(step, lo)`` of each token, quantised once);
    the ring of full-precision keys and the compressed-key update. Otherwise the token is
    read back from the partial slot and written to each host chunk by the transfer engine,
    plane by plane. Does not wait for the layer's prefetch (the gather writes only slots
    ``< S``, this only slot ``S``). Every cache row, in order.

    Returns ``(q [B, H_q, d], f [B, num_f, H_kv, d] or None)`` in ``qkv``'s dtype.
    Raises:
        SpardaError: a step that does not cover every cache row.
    """
    if step.rows.numel() != cache.batch:
        raise SpardaError("offloaded decode steps must cover every cache row")
    cache._stash = None
    cfg = cache.selection
    heads, d = cache.ring[layer].shape[1], cache.ring[layer].shape[3]
    pos = step.q_pos[:, 0]
    q = qkv.new_empty(cache.batch, heads * group, d)
    f = qkv.new_empty(cache.batch, num_f, heads, d) if num_f else None
    common = dict(num_kv_heads=heads, group=group, num_f=num_f, block_size=cfg.block_size,
                  kernel=cfg.kernel_size, stride=cfg.kernel_stride, ring=cache.ring[layer],
                  lengths=cache.lengths if layer == cache.num_layers - 1 else None)
    if layer in cache.resident:
        kernels.rope_append(qkv, step.cos, step.sin, pos, q, f, cache.k_full[layer], cache.v_full[layer],
                            cache.ck[layer], **common)
        return q, f
    chunks = cache.host.chunks[layer]
    host = (chunks[0].k, chunks[0].v) if len(chunks) == 1 and cache.engine.name != "sync" else None
    k_slots, v_slots = cache.k_slots[layer], cache.v_slots[layer]
    kernels.rope_append(qkv, step.cos, step.sin, pos, q, f, k_slots, v_slots, cache.ck[layer],
                        slot=cache.slots, host=host, **common)
    if host is None:
        rows = torch.arange(cache.batch, device=pos.device)
        off = pos % cfg.block_size
        cache._store_tokens(layer, k_slots[rows, :, cache.slots, off], v_slots[rows, :, cache.slots, off], pos)
    return q, f
