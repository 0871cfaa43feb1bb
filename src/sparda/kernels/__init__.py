"""Kernels for block-sparse attention, dispatched by tensor device (design §3, §4, §6).

Each function runs its Triton kernel when its tensors are on CUDA, Triton imports and (where
a head dim is tiled) it is a power of two >= 16; otherwise the PyTorch twin
(:mod:`~sparda.kernels.reference`, :mod:`~sparda.kernels.twins`), same result. No
environment variable or global switch.

Shapes: ``B`` batch, ``H`` KV heads, ``G`` query heads per KV head, ``T`` key tokens, ``Tq``
query tokens, ``C`` compressed keys, ``N`` KV blocks, ``W`` id-list width, ``S`` slots,
``d`` head dim. Positions and lengths in tokens; block ids in blocks of ``block_size`` tokens.
"""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import quant, reference, twins
from sparda.kernels._common import supported_head_dim

try:  # Triton is optional: without it every call takes the PyTorch twin.
    from sparda.kernels import attention_mass as _attention_mass
    from sparda.kernels import cold_slots as _cold_slots
    from sparda.kernels import compress as _compress
    from sparda.kernels import decode_attention as _decode
    from sparda.kernels import prefill_attention as _prefill
    from sparda.kernels import norm as _norm
    from sparda.kernels import prefill_selection as _prefill_selection
    from sparda.kernels import rope_append as _rope_append
    from sparda.kernels import selection as _selection
    from sparda.kernels import slot_diff as _slot_diff
    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the install
    HAS_TRITON = False

__all__ = [
    "HAS_TRITON",
    "add_rmsnorm",
    "completed_compressed_keys",
    "compress_keys",
    "decode_attention",
    "decode_attention_slots",
    "dequantize_cold_slots",
    "prefill_attention",
    "prefill_block_mass",
    "rope_append",
    "select_decode_blocks",
    "select_prefill_blocks",
    "silu_mul",
    "slot_diff",
    "token_attention_mass",
]


def _on_triton(*tensors: torch.Tensor | None) -> bool:
    return HAS_TRITON and all(t is None or t.is_cuda for t in tensors)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
                     kv_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention of one decode token per row over its selected KV blocks (design §3.5).

    Args:
        q: ``[B, H, G, d]`` fp16/bf16/fp32, the token at position ``kv_len[b] - 1``.
        k, v: ``[B, H, T, d]`` same dtype, or :class:`~sparda.kernels.quant.QuantizedKV` of that shape.
        block_ids: ``[B, H, W]`` int32/int64, ``-1`` padded, each id at most once per row, any order.
        kv_len: ``[B]`` integer valid keys (``<= T``). block_size: tokens per block.
    Returns:
        ``[B, H, G, d]`` in ``q``'s dtype, fp32 accumulation; a row that sees no key is 0. Equals
        ``reference.block_sparse_attention`` at ``Tq = 1``, ``q_pos = kv_len - 1``.
    Raises:
        SpardaError: mismatched shapes or dtypes (Triton path).
    """
    if isinstance(k, quant.QuantizedKV):
        if _on_triton(q, k.data, v.data, block_ids, kv_len) and supported_head_dim(q.shape[-1]):
            return _decode.decode_attention_quantized_triton(q, k, v, block_ids, kv_len, block_size)
        return twins.decode_attention_reference(q, k.dequantize(q.dtype), v.dequantize(q.dtype), block_ids,
                                                kv_len, block_size)
    if _on_triton(q, k, v, block_ids, kv_len) and supported_head_dim(q.shape[-1]):
        return _decode.decode_attention_triton(q, k, v, block_ids, kv_len, block_size)
    return twins.decode_attention_reference(q, k, v, block_ids, kv_len, block_size)


def decode_attention_slots(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                           block_ids: torch.Tensor, slot_ids: torch.Tensor, kv_len: torch.Tensor) -> torch.Tensor:
    """:func:`decode_attention` over the offload slot buffer (design §6): logical block
    ``block_ids[b, h, w]`` is held in slot ``slot_ids[b, h, w]``.

    Args:
        q: ``[B, H, G, d]``.
        k_slots, v_slots: ``[B, H, S, block_size, d]``, or :class:`~sparda.kernels.quant.QuantizedKV`.
        block_ids: ``[B, H, W]`` logical block ids (``-1`` skip); positions come from them.
            A slot map ``[B, H, S]`` works as ``block_ids`` with ``slot_ids = torch.arange(S)``.
        slot_ids: ``[B, H, W]`` (or broadcastable) slot of each entry.
        kv_len: ``[B]`` valid keys.
    Returns:
        ``[B, H, G, d]`` in ``q``'s dtype.
    Raises:
        SpardaError: mismatched shapes or dtypes (Triton path).
    """
    quantized = isinstance(k_slots, quant.QuantizedKV)
    data = (k_slots.data, v_slots.data) if quantized else (k_slots, v_slots)
    if _on_triton(q, *data, block_ids, slot_ids, kv_len) and supported_head_dim(q.shape[-1]):
        fn = (_decode.decode_attention_slots_quantized_triton if quantized
              else _decode.decode_attention_slots_triton)
        return fn(q, k_slots, v_slots, block_ids, slot_ids, kv_len)
    if quantized:
        k_slots, v_slots = k_slots.dequantize(), v_slots.dequantize()
    return twins.slots_attention_reference(q, k_slots, v_slots, block_ids, slot_ids, kv_len)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      block_mask: torch.Tensor | None, q_pos: torch.Tensor, kv_len: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """Block-sparse (or dense) causal prefill attention (design §3.5).

    Args:
        q: ``[B, H, G, Tq, d]`` fp16/bf16/fp32. k, v: ``[B, H, T, d]``, same dtype.
        block_mask: ``[B, H, Tq, N]`` bool, ``N >= ceil(T / block_size)``, or ``None`` (dense causal).
        q_pos: ``[B, Tq]`` positions; key ``i`` visible iff ``i <= q_pos``, ``i < kv_len`` and its
            block is selected. kv_len: ``[B]``. block_size: tokens per block.
    Returns:
        ``[B, H, G, Tq, d]`` in ``q``'s dtype, equal to ``reference.block_sparse_attention``;
        rows that see no key are 0.
    Raises:
        SpardaError: mismatched shapes or dtypes (Triton path).
    """
    if _on_triton(q, k, v, block_mask, q_pos, kv_len) and supported_head_dim(q.shape[-1]):
        return _prefill.prefill_attention_triton(q, k, v, block_mask, q_pos, kv_len, block_size)
    return reference.block_sparse_attention(q, k, v, block_mask, q_pos, kv_len, block_size)


def select_decode_blocks(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                         num_blocks: int, cfg: SelectionConfig, *,
                         ck_len: torch.Tensor | None = None, width: int | None = None,
                         return_mask: bool = False):
    """Decode block selection: score, pool, forced blocks + top-k (design §3.2-3.4, §4), or
    the mass-adaptive count of ``cfg.topp_mass`` (design §3.12; Forecast scores as logits at
    ``1 / sqrt(d)``, query scores as mass).

    Args:
        query: ``[B, H, G, d]`` queries (softmax scores summed over the group) or ``[B, H, d]``
            Forecast queries (raw dot products).
        ck: ``[B, H, C, d]`` compressed keys. q_pos: ``[B]`` position of the decoded token.
        num_blocks: ``N`` (covers ``q_pos // block_size``). cfg: the selection config.
        ck_len: optional ``[B]``: row ``b`` sees only its first ``ck_len[b]`` keys (lookahead, design §4).
        width: id-list length; default ``twins.default_width`` (holds every selection, no host
            sync). Longer selections are cut.
        return_mask: also return the ``[B, H, N]`` bool mask.
    Returns:
        ``block_ids [B, H, width]`` int32, ascending, ``-1`` padded; or ``(block_ids, mask)``.
    Raises:
        SpardaError: mismatched shapes or dtypes.
    """
    if _on_triton(query, ck, q_pos, ck_len) and supported_head_dim(query.shape[-1]):
        return _selection.select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg, ck_len=ck_len,
                                                      width=width, return_mask=return_mask)
    return twins.select_decode_reference(query, ck, q_pos, num_blocks, cfg, ck_len=ck_len,
                                         width=width, return_mask=return_mask)


def select_prefill_blocks(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, num_blocks: int,
                          cfg: SelectionConfig, *, lookahead: bool = False) -> torch.Tensor:
    """Prefill block selection per query token, strictly causal (design §3.2-3.4, §3.6, §4).

    Args:
        query: ``[B, H, G, Tq, d]`` queries (softmax scores summed over the group) or
            ``[B, H, Tq, d]`` Forecast queries, RoPE applied (raw dot products).
        ck: ``[B, H, C, d]`` compressed keys of the scored layer (a view is fine).
        q_pos: ``[B, Tq]`` integer positions. num_blocks: ``N`` (covers ``max(q_pos) // block_size``).
        cfg: the selection config.
        lookahead: score the keys complete at ``q_pos - 1`` (``reference.lookahead_pos``).
    Returns:
        ``[B, H, Tq, N]`` bool block mask, as ``twins.select_prefill_reference``.
    Raises:
        SpardaError: mismatched shapes or dtypes.
    """
    if _on_triton(query, ck, q_pos) and supported_head_dim(query.shape[-1]):
        return _prefill_selection.select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg,
                                                                lookahead=lookahead)
    return twins.select_prefill_reference(query, ck, q_pos, num_blocks, cfg, lookahead=lookahead)


def token_attention_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention mass each key gets from a chunk of causal queries, summed over the group
    (``h2o``/``snapkv``, design §7).

    ``mass[b, h, i] = sum_g sum_t softmax_i(q_{g,t} . k_i / sqrt(d))``; query ``t`` sits at key
    position ``T - Tq + t``. Triton for fp16/bf16 ``q``, ``k`` of one dtype; else the SDPA
    backward of :func:`~sparda.kernels.twins.token_attention_mass_reference` (design §7).

    Args:
        q: ``[B, H, G, Tq, d]``; k: ``[B, H, T, d]``, ``T >= Tq``, every key valid (fp16/bf16/fp32).
    Returns:
        ``[B, H, T]`` fp32; sums to ``G * Tq`` per ``(b, h)``.
    Raises:
        SpardaError: mismatched shapes (Triton path).
    """
    if (_on_triton(q, k) and supported_head_dim(q.shape[-1]) and q.dtype == k.dtype
            and q.dtype in (torch.float16, torch.bfloat16)):
        return _attention_mass.token_attention_mass_triton(q, k)
    return twins.token_attention_mass_reference(q, k)


def prefill_block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """:func:`token_attention_mass` summed onto blocks: ``[B, H, ceil(T / block_size)]`` fp32."""
    return reference.sum_onto_blocks(token_attention_mass(q, k), block_size)


def compress_keys(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Compressed keys, the fp32 mean of each complete window (design §3.1).

    Args:
        k: ``[B, H, T, d]`` or ``[H, T, d]`` post-RoPE keys, fp16/bf16/fp32 (the twin: any ``[..., T, d]``).
        kernel, stride: window length and step, tokens.
    Returns:
        ``[..., C, d]`` in ``k``'s dtype, ``C = reference.num_compressed(T, kernel, stride)``.
    Raises:
        SpardaError: an unsupported dtype (Triton path).
    """
    if _on_triton(k) and k.dim() in (3, 4) and supported_head_dim(k.shape[-1]):
        if k.dim() == 3:
            return _compress.compress_keys_triton(k[None], kernel, stride)[0]
        return _compress.compress_keys_triton(k, kernel, stride)
    return reference.compress_keys(k, kernel, stride)


def completed_compressed_keys(keys: torch.Tensor, start: int, end: int, kernel: int,
                              stride: int) -> tuple[int, torch.Tensor]:
    """The compressed keys that tokens ``start .. end - 1`` complete (design §3.1).

    Args:
        keys: ``[H, T, d]`` or ``[B, H, T, d]`` post-RoPE keys, ``T >= end``.
        kernel, stride: window length and step, tokens.
    Returns:
        ``(j0, ck)``: ``j0 = num_compressed(start)``, ``ck [..., j1 - j0, d]`` in ``keys``' dtype.
    """
    j0 = reference.num_compressed(start, kernel, stride)
    return j0, compress_keys(keys[..., j0 * stride:end, :], kernel, stride)


def slot_diff(ids: torch.Tensor, slot_map: torch.Tensor, pos: torch.Tensor, block_size: int,
              num_blocks: int, load: torch.Tensor, attn_ids: torch.Tensor, counters=None,
              compact=None, protect: torch.Tensor | None = None, hot: twins.HotSplit | None = None) -> None:
    """Diff one layer's selection against its GPU slots, in place, no host sync (design §6, step 4;
    with ``protect``, the early diff of design §6.2; with ``hot``, ``kv_dtype`` ``mixed``'s hot
    pool, design §6.1).

    Args:
        ids: ``[B, H, W]`` int32/int64 selected block ids, ``-1`` padded, unique per row (``W <= S + 1``).
        slot_map: ``[B, H, S]`` int64 block per slot (``-1`` empty); updated.
        pos: ``[B]`` int64 token position. block_size: tokens. num_blocks: bound of the ids.
        load: ``[B, H, S]`` int64 out: block to copy into each slot, ``-1`` none.
        attn_ids: ``[B, H, S + 1]`` int32/int64 out: block of each slot for attention (``-1``
            not selected), the current block last.
        counters: optional ``(hits, misses, blocks_read, blocks_valid)``, each ``[B]`` int64, added to.
        compact: optional ``(attn_blocks, attn_slots)``, each ``[B, H, C]`` int32/int64,
            ``C >= min(W, S) + 1``: selected (block, slot) pairs in slot order, ``(-1, 0)``
            padded, the current block with slot ``S`` last.
        protect: optional ``[B, H, S + 1]`` int32/int64 (a layer's ``attn_ids`` from its last
            diff): slots ``s < S`` with ``protect >= 0`` are not replaced (only empty slots and
            stale unprotected ones take misses; misses beyond them are not loaded), and
            ``misses`` counts the blocks loaded.
        hot: optional :class:`~sparda.kernels.twins.HotSplit`: with ``update``, first the hot
            rule's step (:func:`~sparda.kernels.twins.hot_rule_update`: ``ids``, ``pos``) on its
            state, whose demoted blocks leave their slots (``slot_map`` entries ``-1``) before
            the diff; then, either way, the loads split into ``pool_load`` / ``cold_load``
            (:func:`~sparda.kernels.twins.hot_split`; without ``update`` as an early copy at
            ``pos``) and the hot ones counted into ``pool_misses``. Same kernel.
    Raises:
        SpardaError: mismatched shapes or dtypes (Triton path).
    """
    if _on_triton(ids, slot_map, pos, load, attn_ids):
        _slot_diff.slot_diff_triton(ids, slot_map, pos, block_size, num_blocks, load, attn_ids, counters, compact,
                                    protect, hot)
    else:
        twins.slot_diff_reference(ids, slot_map, pos, block_size, num_blocks, load, attn_ids, counters, compact,
                                  protect, hot)


def dequantize_cold_slots(staged_k: quant.QuantizedKV, staged_v: quant.QuantizedKV, k_dst: torch.Tensor,
                          v_dst: torch.Tensor, cold: torch.Tensor) -> None:
    """``--kv-dtype mixed``: dequantise the staged cold blocks into their slots, in place (design §6.1).

    Args:
        staged_k, staged_v: :class:`~sparda.kernels.quant.QuantizedKV` ``[B, H, S, block, d]``.
        k_dst, v_dst: ``[B, H, S, block, d]`` model-dtype slots, written where ``cold >= 0``.
        cold: ``[B, H, S]`` int64 host block each slot received as int4, ``-1`` none.
    Raises:
        SpardaError: mismatched shapes, strides or dtypes (Triton path).
    """
    if _on_triton(k_dst, v_dst, cold, staged_k.data) and supported_head_dim(k_dst.shape[-1]):
        _cold_slots.dequantize_cold_triton(staged_k, staged_v, k_dst, v_dst, cold)
    else:
        twins.dequantize_cold_reference(staged_k, staged_v, k_dst, v_dst, cold)


def rope_append(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                q_out: torch.Tensor, f_out: torch.Tensor | None, k_dst, v_dst,
                ck: torch.Tensor, *, num_kv_heads: int, group: int, num_f: int, block_size: int,
                kernel: int, stride: int, slot: int | None = None, ring: torch.Tensor | None = None,
                host: tuple | None = None, lengths: torch.Tensor | None = None, pool: tuple | None = None) -> None:
    """RoPE + KV append + compressed-key update of one decode token per row, in place (design §3.1, §6).

    Args:
        qkv: ``[B, (H_q + (2 + num_f) * H_kv) * d]`` stacked projection: Q, K, V, Forecast heads.
        cos, sin: ``[B, 1, 1, d]`` RoPE tables (storage dtype). pos: ``[B]`` int64 positions.
        q_out: ``[B, H_q, d]`` out. f_out: ``[B, num_f, H_kv, d]`` out, or ``None`` if ``num_f == 0``.
        k_dst, v_dst: ``[B, H_kv, T, d]`` full cache (``slot is None``) or slot buffer
            ``[B, H_kv, S + 1, block_size, d]`` (token at ``pos % block_size`` of ``slot``);
            tensors or :class:`~sparda.kernels.quant.QuantizedKV` (docs/kv_quant.md).
        ck: ``[B, H_kv, C_cap, d]`` compressed keys, updated when a window completes.
        num_kv_heads, group, num_f: ``H_kv``, ``G``, Forecast heads per KV head.
        block_size, kernel, stride: tokens.
        ring: ``[B, H_kv, kernel, d]`` last ``kernel`` keys, updated; ``None``: read ``k_dst``.
        host: optional ``(k, v, table)``: a host pool ``[H_kv, P, block_size, d]`` and its block
            table ``[B, N]`` int32 (page of each row's block, ``-1``: not written), written too;
            :class:`~sparda.kernels.quant.QuantizedKV` planes as ``k_dst`` holds them, or beside an
            unquantised ``k_dst`` (``kv_dtype`` ``mixed``, design §6.1: quantised here).
        lengths: optional ``[B]`` int64, set to ``pos + 1``.
        pool: optional ``(k, v, table, P)``, ``mixed``'s hot pool ``[H_kv, P', block_size, d]`` in
            ``k_dst``'s dtype and its table ``[B, P]``: the exact token goes to the page of pool
            slot ``(pos // block_size) mod P`` of its row too (an unquantised ``k_dst`` only).
    Raises:
        SpardaError: a quantised ``k_dst`` without ``ring``.
    """
    quantized = isinstance(k_dst, quant.QuantizedKV)
    if quantized and ring is None:
        raise SpardaError("rope_append of a quantised cache needs the ring of full-precision keys "
                          "(the compressed keys are computed from unquantised keys, docs/kv_quant.md)")
    args = (qkv, cos, sin, pos, q_out, f_out, k_dst, v_dst, ck)
    kw = dict(num_kv_heads=num_kv_heads, group=group, num_f=num_f, block_size=block_size, kernel=kernel,
              stride=stride, slot=slot, ring=ring, host=host, lengths=lengths, pool=pool)
    if _on_triton(qkv, k_dst.data if quantized else k_dst, ck) and supported_head_dim(q_out.shape[-1]):
        _rope_append.rope_append_triton(*args, **kw)
    else:
        twins.rope_append_reference(*args, **kw)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Residual add + RMSNorm of decode rows (Zhang & Sennrich 2019).

    Args:
        x: ``[R, N]`` contiguous bf16/fp16/fp32; ``x += delta`` in place. delta: ``[R, N]`` or ``None``.
        weight: ``[N]``. eps: ``rms_norm_eps``. out: optional ``[R, N]`` buffer.
    Returns:
        ``weight * (x / sqrt(mean(x^2) + eps))``, as :class:`sparda.model.llama.RMSNorm`.
    """
    if out is None:
        out = torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))
    if _on_triton(x, weight) and x.is_contiguous() and (delta is None or delta.is_contiguous()):
        return _norm.add_rmsnorm_triton(x, delta, weight, eps, out)
    return twins.add_rmsnorm_reference(x, delta, weight, eps, out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [R, 2 * inner]`` (gate first) -> ``[R, inner]`` (Shazeer 2020)."""
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    if _on_triton(gate_up) and gate_up.is_contiguous():
        return _norm.silu_mul_triton(gate_up, out)
    return twins.silu_mul_reference(gate_up, out)
