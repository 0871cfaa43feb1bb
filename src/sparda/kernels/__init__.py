"""Kernels for block-sparse attention, with dispatch by tensor device (design §3, §4, §6).

Each public function runs a Triton kernel when its tensors live on a CUDA device and
Triton imports, and the PyTorch twin (:mod:`sparda.kernels.reference`,
:mod:`sparda.kernels.twins`) otherwise. The choice depends on the tensors only: no
environment variable, no global switch. Head dims that the kernels do not tile (not a
power of two >= 16) also take the twin, which gives the same result more slowly.

Shapes: ``B`` batch, ``H`` KV heads, ``G`` query heads per KV head, ``T`` key tokens,
``Tq`` query tokens, ``C`` compressed keys, ``N`` KV blocks, ``W`` selected-block
slots, ``d`` head dim. Positions and lengths are in tokens; block ids count blocks of
``block_size`` tokens.
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
    """Attention of one decode token per sequence over its selected KV blocks (design §3.5).

    All ``G`` query heads of a KV head attend to that head's blocks. The query sits at
    position ``kv_len[b] - 1``: key ``i`` is visible iff it lies in a listed block and
    ``i < kv_len[b]``. Exact softmax over those keys, fp32 accumulation; a row that sees
    no key returns zeros. On CUDA: split-KV Triton kernel plus a combine step.

    Args:
        q: ``[B, H, G, d]`` fp16/bf16/fp32.
        k, v: ``[B, H, T, d]``, same dtype, the full on-device cache; or a quantised cache
            (:class:`~sparda.kernels.quant.QuantizedKV` of that logical shape), dequantised
            in registers on CUDA, by :func:`~sparda.kernels.quant.dequantize` in the twin.
        block_ids: ``[B, H, W]`` int32/int64 block ids, ``-1`` = padding, each id at most
            once per row (as from ``reference.block_mask_to_indices`` or
            :func:`select_decode_blocks`); order does not matter.
        kv_len: ``[B]`` integer, valid keys per sequence (``<= T``).
        block_size: tokens per block.
    Returns:
        ``[B, H, G, d]`` in ``q``'s dtype. Equals ``reference.block_sparse_attention``
        with ``Tq = 1``, ``q_pos = kv_len - 1`` and the mask of ``block_ids``.
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
                           block_ids: torch.Tensor, slot_ids: torch.Tensor, kv_len: torch.Tensor, *,
                           late: torch.Tensor | None = None, between=None) -> torch.Tensor:
    """Decode attention reading the offload runtime's slot buffer (design §6).

    Same result as :func:`decode_attention` on a cache whose logical block
    ``block_ids[b, h, w]`` is stored in slot ``slot_ids[b, h, w]``.

    Args:
        q: ``[B, H, G, d]``.
        k_slots, v_slots: ``[B, H, S, block_size, d]``, one KV block per slot, or quantised
            (:class:`~sparda.kernels.quant.QuantizedKV`; dequantised on read, as
            :func:`decode_attention`).
        block_ids: ``[B, H, W]`` logical block ids (``-1`` = skip); positions and the
            ``kv_len`` mask are computed from them.
        slot_ids: ``[B, H, W]`` (or broadcastable) physical slot of each entry. With a
            slot map ``[B, H, S]`` (logical block held by each slot, ``-1`` free), pass
            it as ``block_ids`` and ``torch.arange(S)`` as ``slot_ids``.
        kv_len: ``[B]`` valid keys per sequence.
        late, between: overlap with a pending copy (design §6). ``late [B, H, S]``: the
            logical block being copied into slot ``s`` this step (``-1`` none; entry
            ``s < S`` of ``block_ids`` must be slot ``s``, as the slot diff writes them).
            On CUDA the resident entries are attended first, then ``between()`` (the wait
            for the copy) runs, then the ``late`` slots are attended and combined in one
            kernel; elsewhere ``between()`` runs first. Same result either way.
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
        return fn(q, k_slots, v_slots, block_ids, slot_ids, kv_len, late=late, between=between)
    if between is not None:
        between()
    if quantized:
        k_slots, v_slots = k_slots.dequantize(), v_slots.dequantize()
    return twins.slots_attention_reference(q, k_slots, v_slots, block_ids, slot_ids, kv_len)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      block_mask: torch.Tensor | None, q_pos: torch.Tensor, kv_len: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """Block-sparse (or dense) causal prefill attention (design §3.5).

    Same signature and result as ``reference.block_sparse_attention`` (without its
    ``chunk``). On CUDA: a FlashAttention-2-style kernel whose 64-row tiles pack a few
    query tokens x all ``G`` query heads of a KV head (they share each token's
    selection), visit the union of those tokens' selected blocks, load each block once
    for all heads and mask each token exactly.

    Args:
        q: ``[B, H, G, Tq, d]`` fp16/bf16/fp32.
        k, v: ``[B, H, T, d]``, same dtype.
        block_mask: ``[B, H, Tq, N]`` bool, ``N >= ceil(T / block_size)``, or ``None``
            for dense causal attention.
        q_pos: ``[B, Tq]`` absolute positions; key ``i`` is visible iff ``i <= q_pos``,
            ``i < kv_len`` and its block is selected for that query.
        kv_len: ``[B]`` valid keys per sequence.
        block_size: tokens per block.
    Returns:
        ``[B, H, G, Tq, d]`` in ``q``'s dtype; rows that see no key are 0.
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
    """Decode block selection: score, pool, forced blocks + top-k (design §3.2-3.4, §4).

    Scores (see ``query``) are max-pooled onto blocks; the rule is ``reference.select_blocks`` at
    ``Tq = 1``: sinks, the local window (current block included), the dense fallback,
    then the ``topk_blocks`` best other valid blocks, ties to the lower id.

    Args:
        query: ``[B, H, G, d]`` queries -> query-based scores (per-head softmax over the
            visible compressed keys, summed over the group); or ``[B, H, d]`` Forecast
            queries -> raw dot products (``-inf`` where invisible).
        ck: ``[B, H, C, d]`` compressed keys (a preallocated buffer is fine).
        q_pos: ``[B]`` position of the decoded token; compressed key ``j`` is visible iff
            ``j*stride + kernel - 1 <= q_pos``.
        num_blocks: ``N``, blocks to score (cover ``q_pos // block_size``).
        cfg: the selection config (block size, compression kernel and stride).
        ck_len: optional ``[B]``: row ``b`` has only its first ``ck_len[b]`` compressed
            keys (as if ``ck`` were cut there), e.g. a Forecast scoring the next layer's
            keys before this step's window was appended (design §4).
        width: length of the returned id lists; default
            ``min(N, max(budget_blocks, ceil(dense_len / block_size)))``, which holds
            every selection with no host sync. Callers that never select in the dense
            fallback may pass ``cfg.budget_blocks``. Longer selections are cut.
        return_mask: also return the ``[B, H, N]`` bool block mask.
    Returns:
        ``block_ids [B, H, width]`` int32, ascending, padded with ``-1`` (feed it to
        :func:`decode_attention`); with ``return_mask``, ``(block_ids, mask)``.
    Raises:
        SpardaError: mismatched shapes or dtypes. Any head dim works: those the kernel
            does not tile take the PyTorch twin.
    """
    if _on_triton(query, ck, q_pos, ck_len) and supported_head_dim(query.shape[-1]):
        return _selection.select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg, ck_len=ck_len,
                                                      width=width, return_mask=return_mask)
    return twins.select_decode_reference(query, ck, q_pos, num_blocks, cfg, ck_len=ck_len,
                                         width=width, return_mask=return_mask)


def select_prefill_blocks(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, num_blocks: int,
                          cfg: SelectionConfig, *, lookahead: bool = False) -> torch.Tensor:
    """Prefill block selection per query token: score, pool, forced blocks + top-k
    (design §3.2-3.4, §3.6, §4), strictly causal.

    The rule is ``reference.select_blocks`` per query token: sinks, the local window
    (current block included), the dense fallback, then the ``topk_blocks`` best other valid
    blocks, ties to the lower block id. On CUDA one fused Triton kernel
    (:mod:`sparda.kernels.prefill_selection`; the query-based softmax reads the compressed
    keys twice: statistics, then probabilities); elsewhere the PyTorch twin
    ``twins.select_prefill_reference``.

    Args:
        query: ``[B, H, G, Tq, d]`` queries -> query-based scores (per-head softmax over the
            visible compressed keys, summed over the group); or ``[B, H, Tq, d]`` Forecast
            queries (RoPE applied) -> raw dot products.
        ck: ``[B, H, C, d]`` compressed keys of the scored layer (a view is fine); key
            ``j`` exists iff ``j < C``.
        q_pos: ``[B, Tq]`` integer positions of the query tokens (tokens).
        num_blocks: ``N``, blocks of the mask (cover ``max(q_pos) // block_size``).
        cfg: the selection config (block size, compression geometry, budget, dense_len).
        lookahead: score the compressed keys complete at ``q_pos - 1`` (a Forecast of
            layer >= 1, ``reference.lookahead_pos``); selection still at ``q_pos``.
    Returns:
        ``[B, H, Tq, N]`` bool block mask (feed it to :func:`prefill_attention`).
    Raises:
        SpardaError: mismatched shapes or dtypes. Any head dim works: those the kernel
            does not tile take the PyTorch twin.
    """
    if _on_triton(query, ck, q_pos) and supported_head_dim(query.shape[-1]):
        return _prefill_selection.select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg,
                                                                lookahead=lookahead)
    return twins.select_prefill_reference(query, ck, q_pos, num_blocks, cfg, lookahead=lookahead)


def token_attention_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Attention mass each key gets from a prefill chunk's queries, summed over the group
    (``h2o``'s starting scores and ``snapkv``'s votes, docs/baselines.md).

    ``mass[b, h, i] = sum_g sum_t softmax_i(q_{g,t} . k_i / sqrt(d))`` over the causally
    visible keys: query ``t`` of ``Tq`` sits at key position ``T - Tq + t`` (the whole
    prompt, a later chunk of a chunked prefill, or the prompt's last ``Tq`` queries). On
    CUDA with fp16/bf16 ``q`` and ``k`` of one dtype, two Triton passes (each query's
    log-sum-exp, then column sums; :mod:`sparda.kernels.attention_mass`); else the gradient
    SDPA's backward gives ``V`` in fp32
    (:func:`~sparda.kernels.twins.token_attention_mass_reference`), which on the H200 beats
    the kernel's fp32 tiles (3.0 against 5.7 ms at 4,096 tokens,
    design §7); neither materialises the
    ``[G, Tq, T]`` probabilities.

    Args:
        q: ``[B, H, G, Tq, d]``; k: ``[B, H, T, d]`` with ``T >= Tq``, every key valid
            (fp16/bf16/fp32; a ``k`` of another dtype than ``q``: both are taken in fp32, twin).
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
    """:func:`token_attention_mass` summed onto KV blocks of ``block_size`` tokens:
    ``[B, H, N]`` fp32, ``N = ceil(T / block_size)`` (the last block partial). Equals
    :func:`sparda.kernels.reference.block_attention_mass` summed over queries and the group
    (tests)."""
    return reference.sum_onto_blocks(token_attention_mass(q, k), block_size)


def compress_keys(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Compressed keys: mean of each complete window of ``kernel`` keys every ``stride`` (design §3.1).

    Args:
        k: ``[B, H, T, d]`` or ``[H, T, d]`` post-RoPE keys, fp16/bf16/fp32 (the twin takes
            any ``[..., T, d]``); the last dim contiguous for the kernel (else copied).
        kernel, stride: window length and step in tokens.
    Returns:
        ``[..., C, d]`` in ``k``'s dtype, ``C = reference.num_compressed(T, kernel, stride)``;
        the mean is taken in fp32.
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
    """The compressed keys that tokens ``start .. end - 1`` complete (design §3.1): windows
    ``j0 .. j1 - 1`` with ``j0 = num_compressed(start)``, ``j1 = num_compressed(end)``
    (a prefill chunk; ``start = 0``: every window of the prompt). The caches' prefill
    ``append`` calls it.

    Args:
        keys: ``[H, T, d]`` or ``[B, H, T, d]`` post-RoPE keys of positions ``0 .. T-1``,
            ``T >= end`` (only ``keys[..., j0*stride:end, :]`` is read).
        kernel, stride: window length and step in tokens.
    Returns:
        ``(j0, ck)`` with ``ck [..., j1 - j0, d]`` in ``keys``' dtype (:func:`compress_keys`:
        the Triton kernel on CUDA, :func:`reference.compress_keys` otherwise).
    """
    j0 = reference.num_compressed(start, kernel, stride)
    return j0, compress_keys(keys[..., j0 * stride:end, :], kernel, stride)


def slot_diff(ids: torch.Tensor, slot_map: torch.Tensor, pos: torch.Tensor, block_size: int,
              num_blocks: int, load: torch.Tensor, attn_ids: torch.Tensor, counters=None,
              compact=None) -> None:
    """Diff one layer's selection against its GPU slots, in place (design §6; no host sync).

    Selected blocks already in a slot are hits and stay; the ``k``-th missed block
    (ascending id) goes to the ``k``-th replaceable slot: empty slots first, then slots
    whose block is no longer selected, each in slot order. The current block (``pos //
    block_size``) is never loaded: it lives in the partial slot.

    Args:
        ids: ``[B, H, W]`` int32/int64 selected block ids, ``-1`` padded, each at most once
            per row (``W <= S + 1``; e.g. :func:`select_decode_blocks` with ``width = S``).
        slot_map: ``[B, H, S]`` int64 block held by each slot (``-1`` empty); updated.
        pos: ``[B]`` int64 position of this step's token.
        block_size: tokens per block. num_blocks: ``N``, an upper bound of the block ids.
        load: ``[B, H, S]`` int64 output: block to copy into each slot, ``-1`` none.
        attn_ids: ``[B, H, S + 1]`` int32/int64 output: logical block of each slot for this
            step's attention (``-1`` not selected), the current block last (the partial slot).
        counters: optional ``(hits, misses, blocks_read, blocks_valid)``, each ``[B]`` int64,
            incremented: hits and misses summed over heads, blocks read = selected ids
            (the current block included), blocks valid = ``pos // block_size + 1`` per head.
        compact: optional ``(attn_blocks, attn_slots)`` outputs, each ``[B, H, C]`` int32/int64
            with ``C >= min(W, S) + 1``: the entries of ``attn_ids`` that are selected, as
            (logical block, slot) pairs in slot order, then ``(-1, 0)`` padding, and the
            current block with slot ``S`` last. Attention over them reads ``C`` entries,
            not ``S + 1`` (spare slots beyond the selection, design §6).
    Raises:
        SpardaError: mismatched shapes or dtypes (Triton path).
    """
    if _on_triton(ids, slot_map, pos, load, attn_ids):
        _slot_diff.slot_diff_triton(ids, slot_map, pos, block_size, num_blocks, load, attn_ids, counters, compact)
    else:
        twins.slot_diff_reference(ids, slot_map, pos, block_size, num_blocks, load, attn_ids, counters, compact)


def dequantize_cold_slots(staged_k: quant.QuantizedKV, staged_v: quant.QuantizedKV, k_dst: torch.Tensor,
                          v_dst: torch.Tensor, cold: torch.Tensor) -> None:
    """``--kv-dtype mixed``: dequantise the cold blocks a fetch staged into their slots, in
    place (design §6.1; no host sync, static shapes for CUDA graphs).

    Args:
        staged_k, staged_v: :class:`~sparda.kernels.quant.QuantizedKV` ``[B, H, S, block, d]``
            (codes ``[..., d']`` uint8, scales ``[..., 2]`` fp32 ``(step, lo)``), one staged
            block per slot.
        k_dst, v_dst: ``[B, H, S, block, d]`` slots in the model dtype (a view of the
            layer's slot buffer), written where ``cold >= 0``.
        cold: ``[B, H, S]`` int64, the host block each slot received as int4 (``-1``: none,
            the slot keeps its values).
    On CUDA one Triton launch for K and V whose programs for slots with no cold block do
    nothing (:mod:`sparda.kernels.cold_slots`); elsewhere
    :func:`~sparda.kernels.twins.dequantize_cold_reference`.

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
                host: tuple | None = None, lengths: torch.Tensor | None = None) -> None:
    """RoPE + KV append + compressed-key update of one decode token per row, in place (design §3.1, §6).

    Args:
        qkv: ``[B, (H_q + (2 + num_f) * H_kv) * d]`` one layer's stacked projection output:
            queries, keys, values, then ``num_f`` Forecast heads per KV head.
        cos, sin: ``[B, 1, 1, d]`` RoPE tables of this step's positions (storage dtype).
        pos: ``[B]`` int64 token positions.
        q_out: ``[B, H_q, d]`` output, rotated queries. f_out: ``[B, num_f, H_kv, d]``
            output, rotated Forecast heads (``None`` if ``num_f == 0``).
        k_dst, v_dst: the full cache ``[B, H_kv, T, d]`` (``slot is None``) or an offload
            slot buffer ``[B, H_kv, S + 1, block_size, d]`` whose slot ``slot`` is the
            partial block (the token goes to ``pos % block_size`` there). Tensors in the
            storage dtype, or :class:`~sparda.kernels.quant.QuantizedKV` of that logical
            shape (a quantised cache, docs/kv_quant.md): K and V are quantised once per
            token and head (:func:`~sparda.kernels.quant.quantize`) and the codes and
            ``(step, lo)`` written; ``ring`` is then required.
        ck: ``[B, H_kv, C_cap, d]`` compressed keys, updated when the token completes a window.
        num_kv_heads, group: ``H_kv`` and ``G``. num_f: Forecast heads per KV head.
        block_size, kernel, stride: tokens (selection config).
        ring: ``[B, H_kv, kernel, d]`` the last ``kernel`` keys (offload cache), updated;
            ``None``: the window is read from ``k_dst`` (full cache only).
        host: optional ``(k, v)`` host store ``[B, H_kv, N, block_size, d]`` (pinned) that
            also receives the token (the same bytes; quantised like ``k_dst``).
        lengths: optional ``[B]`` int64, set to ``pos + 1`` (the model's last layer).
    The Triton kernel runs on CUDA tensors with a power-of-two head dim >= 16; otherwise
    the twin (:func:`sparda.kernels.twins.rope_append_reference`).

    Raises:
        SpardaError: a quantised ``k_dst`` without ``ring``.
    """
    quantized = isinstance(k_dst, quant.QuantizedKV)
    if quantized and ring is None:
        raise SpardaError("rope_append of a quantised cache needs the ring of full-precision keys "
                          "(the compressed keys are computed from unquantised keys, docs/kv_quant.md)")
    args = (qkv, cos, sin, pos, q_out, f_out, k_dst, v_dst, ck)
    kw = dict(num_kv_heads=num_kv_heads, group=group, num_f=num_f, block_size=block_size, kernel=kernel,
              stride=stride, slot=slot, ring=ring, host=host, lengths=lengths)
    if _on_triton(qkv, k_dst.data if quantized else k_dst, ck) and supported_head_dim(q_out.shape[-1]):
        _rope_append.rope_append_triton(*args, **kw)
    else:
        twins.rope_append_reference(*args, **kw)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Residual add + RMSNorm of decode rows (a decoder layer's norm, fused).

    Args:
        x: ``[R, N]`` contiguous residual stream (bf16/fp16/fp32); ``x += delta`` in place.
        delta: ``[R, N]`` same dtype, or ``None`` (norm only).
        weight: ``[N]`` norm weight. eps: the config's ``rms_norm_eps``.
        out: optional ``[R, N]`` output buffer (dtype of ``weight * x``).
    Returns:
        ``out = weight * (x / sqrt(mean(x^2) + eps))``, normalised in fp32 and cast to ``x``'s
        dtype before the weight (:class:`sparda.model.llama.RMSNorm`; Zhang & Sennrich 2019).
    """
    if out is None:
        out = torch.empty_like(x, dtype=torch.promote_types(weight.dtype, x.dtype))
    if _on_triton(x, weight) and x.is_contiguous() and (delta is None or delta.is_contiguous()):
        return _norm.add_rmsnorm_triton(x, delta, weight, eps, out)
    return twins.add_rmsnorm_reference(x, delta, weight, eps, out)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` from a stacked gate/up output ``gate_up [R, 2 * inner]``
    (contiguous, gate first) -> ``[R, inner]`` in its dtype (Shazeer 2020)."""
    if out is None:
        out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    if _on_triton(gate_up) and gate_up.is_contiguous():
        return _norm.silu_mul_triton(gate_up, out)
    return twins.silu_mul_reference(gate_up, out)
