"""Decode attention over selected KV blocks: Triton split-KV kernel plus combine (design §3.5, §6).

Grid ``(B * H_kv, splits)``; the ``G`` query heads of a KV head share its block list. Layouts:
the full cache ``[B, H, T, d]``, or the slot buffer ``[B, H, S, block_size, d]`` with a block
table (positions always from the logical block id). ``QBITS`` 8/4 reads a quantised cache
and dequantises in registers (docs/kv_quant.md). Twins: ``twins.decode_attention_reference``,
``twins.slots_attention_reference``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.kernels._common import check_head_dim, next_pow2, num_sms, tl_float_dtype_ok

_LOG2E = 1.4426950408889634
_MAX_SPLITS = 64


@triton.jit
def _dequantize(x, scale_ptr, tok_ok, offs_d, QBITS: tl.constexpr):
    """Quantised ``[tokens, d]`` tile -> fp32 ``q * step + lo`` (``QBITS`` 8, or 4: two values
    per byte, the even dim in the low nibble); ``scale_ptr`` points at each token's
    ``(step, lo)`` pair (sparda.kernels.quant)."""
    if QBITS == 4:
        x = (x >> ((offs_d % 2) * 4)[None, :]) & 15
    step = tl.load(scale_ptr, mask=tok_ok, other=0.0)
    lo = tl.load(scale_ptr + 1, mask=tok_ok, other=0.0)
    return x.to(tl.float32) * step[:, None] + lo[:, None]


@triton.jit
def _row_setup(Q, K, V, KS, VS, b, h, stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_kt,
               stride_vb, stride_vh, stride_vt, stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh,
               stride_vst, G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BS_P: tl.constexpr,
               QBITS: tl.constexpr):
    """One (row, KV head)'s query ``[G_P, D]`` (padding heads 0) and the base pointers of its
    K/V (and scale) tiles, to which a block's offset is added."""
    offs_g = tl.arange(0, G_P)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, BS_P)
    g_ok = offs_g < G
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                mask=g_ok[:, None], other=0.0)
    offs_c = offs_d // 2 if QBITS == 4 else offs_d  # int4: two columns per byte
    k_base = K + b * stride_kb + h * stride_kh + offs_t[:, None] * stride_kt + offs_c[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_t[:, None] * stride_vt + offs_c[None, :]
    ks_base = KS + b * stride_ksb + h * stride_ksh + offs_t * stride_kst
    vs_base = VS + b * stride_vsb + h * stride_vsh + offs_t * stride_vst
    return offs_g, offs_d, offs_t, g_ok, q, k_base, v_base, ks_base, vs_base


@triton.jit
def _accumulate_block(q, m_i, l_i, acc, k_ptrs, v_ptrs, ks_ptrs, vs_ptrs, tok_ok, offs_d, qk_scale,
                      QBITS: tl.constexpr, IEEE: tl.constexpr):
    """Online-softmax update of ``(m_i, l_i, acc)`` (log2 domain) with one KV block:
    ``k_ptrs``/``v_ptrs`` ``[BS_P, d]`` pointers, ``tok_ok`` its valid tokens."""
    k = tl.load(k_ptrs, mask=tok_ok[:, None], other=0.0)
    if QBITS > 0:  # dequantise in registers (sparda.kernels.quant)
        k = _dequantize(k, ks_ptrs, tok_ok, offs_d, QBITS)
        if not IEEE:
            k = k.to(q.dtype)
    if IEEE:
        qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    qk = tl.where(tok_ok[None, :], qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(qk - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptrs, mask=tok_ok[:, None], other=0.0)
    if QBITS > 0:
        v = _dequantize(v, vs_ptrs, tok_ok, offs_d, QBITS)
        if not IEEE:
            v = v.to(q.dtype)
    if IEEE:
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    Q, K, V, LOGICAL, PHYS, KV_LEN, O, LSE, KS, VS,
    stride_qb, stride_qh, stride_qg,
    stride_kb, stride_kh, stride_kblk, stride_kt,
    stride_vb, stride_vh, stride_vblk, stride_vt,
    stride_ksb, stride_ksh, stride_ksblk, stride_kst,
    stride_vsb, stride_vsh, stride_vsblk, stride_vst,
    stride_ib, stride_ih, stride_pb, stride_ph,
    stride_ob, stride_oh, stride_os, stride_og,
    H, W, token_limit, blocks_per_split, qk_scale,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BS_P: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr,
    QBITS: tl.constexpr = 0,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    kv_len = tl.minimum(tl.load(KV_LEN + b).to(tl.int64), token_limit)

    offs_g, offs_d, offs_t, g_ok, q, k_base, v_base, ks_base, vs_base = _row_setup(
        Q, K, V, KS, VS, b, h, stride_qb, stride_qh, stride_qg, stride_kb, stride_kh, stride_kt,
        stride_vb, stride_vh, stride_vt, stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
        G, G_P, D, BS_P, QBITS)
    ids_base = LOGICAL + b * stride_ib + h * stride_ih
    phys_base = PHYS + b * stride_pb + h * stride_ph

    m_i = tl.full([G_P], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D], tl.float32)
    start = pid_s * blocks_per_split
    for j in range(0, blocks_per_split):
        i = start + j
        blk = tl.load(ids_base + i, mask=i < W, other=-1).to(tl.int64)
        phys = tl.load(phys_base + i, mask=i < W, other=0).to(tl.int64)
        pos = blk * BS + offs_t
        tok_ok = (offs_t < BS) & (pos < kv_len) & (blk >= 0)
        m_i, l_i, acc = _accumulate_block(
            q, m_i, l_i, acc, k_base + phys * stride_kblk, v_base + phys * stride_vblk,
            ks_base + phys * stride_ksblk, vs_base + phys * stride_vsblk, tok_ok, offs_d, qk_scale,
            QBITS, IEEE)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_ptrs = O + b * stride_ob + h * stride_oh + pid_s * stride_os + offs_g[:, None] * stride_og + offs_d[None, :]
    if SPLIT:
        tl.store(o_ptrs, out, mask=g_ok[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(LSE + (pid_bh * tl.num_programs(1) + pid_s) * G_P + offs_g, lse)
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=g_ok[:, None])


@triton.jit
def _decode_combine_kernel(
    PART, LSE, O,
    stride_pbh, stride_ps, stride_pg,
    stride_ob, stride_oh, stride_og,
    H, num_splits,
    G_P: tl.constexpr, D: tl.constexpr, S_P: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    g = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    offs_s = tl.arange(0, S_P)
    offs_d = tl.arange(0, D)
    s_ok = offs_s < num_splits
    lse = tl.load(LSE + (pid_bh * num_splits + offs_s) * G_P + g, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    part = tl.load(PART + pid_bh.to(tl.int64) * stride_pbh + offs_s[:, None] * stride_ps + g * stride_pg
                   + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + g * stride_og + offs_d,
             out.to(O.dtype.element_ty))


def choose_num_splits(batch_heads: int, width: int, device: torch.device) -> int:
    """Splits per (sequence, KV head) so that the grid fills the GPU about four times."""
    target = 4 * num_sms(device)
    splits = -(-target // max(batch_heads, 1))
    return max(1, min(splits, _MAX_SPLITS, -(-width // 2)))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_ids: torch.Tensor,
           kv_len: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        tl_float_dtype_ok(t, name)
    if q.dim() != 4:
        raise SpardaError(f"decode q must be [B, H_kv, G, d], got shape {tuple(q.shape)}")
    bsz, heads, _, d = q.shape
    check_head_dim(d)
    if k.shape[:2] != (bsz, heads) or k.shape[-1] != d or v.shape != k.shape:
        raise SpardaError(f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} do not match q {tuple(q.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise SpardaError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if block_ids.dim() != 3 or block_ids.shape[:2] != (bsz, heads):
        raise SpardaError(f"block_ids must be [B, H_kv, W], got {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise SpardaError(f"block_ids must be int32 or int64, got {block_ids.dtype}")
    if kv_len.shape != (bsz,):
        raise SpardaError(f"kv_len must be [B]={bsz}, got {tuple(kv_len.shape)}")


def _launch(q, k_view, v_view, logical, phys, kv_len, block_size, token_limit, num_splits,
            num_warps, num_stages, ks_view=None, vs_view=None, qbits=0):
    """Strides of ``k_view``/``v_view`` (b, h, block, token-in-block), last dim contiguous;
    ``ks_view``/``vs_view`` of the ``[..., 2]`` fp32 scales (``None`` unquantised)."""
    bsz, heads, groups, d = q.shape
    width = logical.shape[-1]
    out = torch.empty_like(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    logical = logical.contiguous()
    phys = phys.contiguous()
    kv_len = kv_len.contiguous()
    if width == 0:
        return out.zero_()
    if num_splits is None:
        num_splits = choose_num_splits(bsz * heads, width, q.device)
    num_splits = max(1, min(int(num_splits), width, _MAX_SPLITS))
    per_split = -(-width // num_splits)
    num_splits = -(-width // per_split)
    g_p = max(16, next_pow2(groups))
    bs_p = max(16, next_pow2(block_size))
    ieee = q.dtype == torch.float32 or not q.is_cuda  # interpreter: no bf16 dot
    qk_scale = _LOG2E / math.sqrt(d)
    ks, vs = k_view, v_view
    if ks_view is None:  # unquantised: the scale pointers are unused
        ks_view, vs_view = (k_view[0], (0, 0, 0, 0)), (v_view[0], (0, 0, 0, 0))
    scales = (ks_view[0], vs_view[0], *ks_view[1], *vs_view[1])
    common = dict(G=groups, G_P=g_p, D=d, BS=block_size, BS_P=bs_p, IEEE=ieee, QBITS=qbits,
                  num_warps=num_warps, num_stages=num_stages)
    grid = (bsz * heads, num_splits)
    if num_splits == 1:
        _decode_split_kernel[grid](
            q, ks[0], vs[0], logical, phys, kv_len, out, out, scales[0], scales[1],
            q.stride(0), q.stride(1), q.stride(2),
            *ks[1], *vs[1], *scales[2:],
            logical.stride(0), logical.stride(1), phys.stride(0), phys.stride(1),
            out.stride(0), out.stride(1), 0, out.stride(2),
            heads, width, token_limit, per_split, qk_scale, SPLIT=False, **common)
        return out
    part = torch.empty(bsz * heads, num_splits, groups, d, device=q.device, dtype=torch.float32)
    lse = torch.empty(bsz * heads, num_splits, g_p, device=q.device, dtype=torch.float32)
    _decode_split_kernel[grid](
        q, ks[0], vs[0], logical, phys, kv_len, part, lse, scales[0], scales[1],
        q.stride(0), q.stride(1), q.stride(2),
        *ks[1], *vs[1], *scales[2:],
        logical.stride(0), logical.stride(1), phys.stride(0), phys.stride(1),
        heads * part.stride(0), part.stride(0), part.stride(1), part.stride(2),
        heads, width, token_limit, per_split, qk_scale, SPLIT=True, **common)
    _decode_combine_kernel[(bsz * heads, groups)](
        part, lse, out,
        part.stride(0), part.stride(1), part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        heads, num_splits, G_P=g_p, D=d, S_P=max(2, next_pow2(num_splits)), num_warps=4)
    return out


def decode_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            block_ids: torch.Tensor, kv_len: torch.Tensor, block_size: int,
                            num_splits: int | None = None, *, num_warps: int = 4,
                            num_stages: int = 2) -> torch.Tensor:
    """Triton :func:`sparda.kernels.decode_attention` on the full cache.

    Args:
        q: ``[B, H_kv, G, d]`` fp16/bf16/fp32, ``d`` a power of two >= 16.
        k, v: ``[B, H_kv, T, d]`` same dtype, last dim contiguous.
        block_ids: ``[B, H_kv, W]`` int32/int64, ``-1`` padded, unique per row.
        kv_len: ``[B]`` integer. block_size: tokens.
        num_splits: KV splits per (row, head); ``None``: from the SM count.
        num_warps, num_stages: Triton launch parameters.
    Returns:
        ``[B, H_kv, G, d]`` in ``q``'s dtype, fp32 accumulation.
    Raises:
        SpardaError: a shape/dtype mismatch or an unsupported head dim.
    """
    _check(q, k, v, block_ids, kv_len)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    ks = (k, (k.stride(0), k.stride(1), block_size * k.stride(2), k.stride(2)))
    vs = (v, (v.stride(0), v.stride(1), block_size * v.stride(2), v.stride(2)))
    return _launch(q, ks, vs, block_ids, block_ids, kv_len, block_size, k.shape[2], num_splits,
                   num_warps, num_stages)


def decode_attention_slots_triton(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                                  block_ids: torch.Tensor, slot_ids: torch.Tensor,
                                  kv_len: torch.Tensor, num_splits: int | None = None, *,
                                  num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Triton :func:`sparda.kernels.decode_attention_slots` (design §6).

    Args:
        q: ``[B, H_kv, G, d]``. k_slots, v_slots: ``[B, H_kv, S, block_size, d]``.
        block_ids: ``[B, H_kv, W]`` logical ids (``-1`` skip). slot_ids: ``[B, H_kv, W]``
            slots in ``[0, S)``, or ``arange(S)`` with a slot map as ``block_ids``.
        kv_len: ``[B]``.
    Returns:
        ``[B, H_kv, G, d]`` in ``q``'s dtype.
    Raises:
        SpardaError: a shape/dtype mismatch or an unsupported head dim.
    """
    if k_slots.dim() != 5 or v_slots.shape != k_slots.shape:
        raise SpardaError(f"k_slots/v_slots must be [B, H_kv, S, block_size, d], got "
                          f"{tuple(k_slots.shape)}/{tuple(v_slots.shape)}")
    _check(q, k_slots[:, :, 0], v_slots[:, :, 0], block_ids, kv_len)
    if slot_ids.shape != block_ids.shape:
        slot_ids = slot_ids.expand(block_ids.shape)
    if k_slots.stride(-1) != 1 or v_slots.stride(-1) != 1:
        k_slots, v_slots = k_slots.contiguous(), v_slots.contiguous()
    block_size = k_slots.shape[3]
    ks = (k_slots, (k_slots.stride(0), k_slots.stride(1), k_slots.stride(2), k_slots.stride(3)))
    vs = (v_slots, (v_slots.stride(0), v_slots.stride(1), v_slots.stride(2), v_slots.stride(3)))
    return _launch(q, ks, vs, block_ids, slot_ids, kv_len, block_size, 2**62, num_splits,
                   num_warps, num_stages)


def _check_quantized(q: torch.Tensor, k, v, block_ids: torch.Tensor, kv_len: torch.Tensor) -> int:
    """:func:`_check` for a quantised cache (``k, v``: :class:`~sparda.kernels.quant.QuantizedKV`
    of logical shape ``[B, H, ..., d]``); returns the bits per value (8 or 4)."""
    if not isinstance(k, quant.QuantizedKV) or not isinstance(v, quant.QuantizedKV) or k.kv_dtype != v.kv_dtype:
        raise SpardaError("k and v must both be QuantizedKV of one kv_dtype")
    if k.shape != v.shape or k.data.dtype != torch.uint8 or k.scale.dtype != quant.SCALE_DTYPE:
        raise SpardaError(f"quantised k/v must be uint8 data + fp32 scales of one shape, got "
                          f"{tuple(k.shape)}/{tuple(v.shape)}")
    tl_float_dtype_ok(q, "q")
    if q.dim() != 4 or k.shape[:2] != q.shape[:2] or k.shape[-1] != q.shape[-1]:
        raise SpardaError(f"k/v shapes {tuple(k.shape)} do not match q {tuple(q.shape)}")
    check_head_dim(q.shape[-1])
    if block_ids.dim() != 3 or block_ids.shape[:2] != q.shape[:2]:
        raise SpardaError(f"block_ids must be [B, H_kv, W], got {tuple(block_ids.shape)}")
    if block_ids.dtype not in (torch.int32, torch.int64):
        raise SpardaError(f"block_ids must be int32 or int64, got {block_ids.dtype}")
    if kv_len.shape != (q.shape[0],):
        raise SpardaError(f"kv_len must be [B]={q.shape[0]}, got {tuple(kv_len.shape)}")
    return quant.BITS[k.kv_dtype]


def decode_attention_quantized_triton(q: torch.Tensor, k, v, block_ids: torch.Tensor, kv_len: torch.Tensor,
                                      block_size: int, num_splits: int | None = None, *,
                                      num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """:func:`decode_attention_triton` over a :class:`~sparda.kernels.quant.QuantizedKV` cache
    (``data [B, H_kv, T, d']`` uint8, ``scale [B, H_kv, T, 2]`` fp32), dequantised in registers.

    Raises:
        SpardaError: a shape/dtype mismatch or an unsupported head dim.
    """
    qbits = _check_quantized(q, k, v, block_ids, kv_len)
    k, v = k.contiguous(), v.contiguous()
    views = [(t, (t.stride(0), t.stride(1), block_size * t.stride(2), t.stride(2)))
             for t in (k.data, v.data, k.scale, v.scale)]
    return _launch(q, views[0], views[1], block_ids, block_ids, kv_len, block_size, k.shape[2], num_splits,
                   num_warps, num_stages, views[2], views[3], qbits)


def decode_attention_slots_quantized_triton(q: torch.Tensor, k_slots, v_slots, block_ids: torch.Tensor,
                                            slot_ids: torch.Tensor, kv_len: torch.Tensor,
                                            num_splits: int | None = None, *, num_warps: int = 4,
                                            num_stages: int = 2) -> torch.Tensor:
    """:func:`decode_attention_slots_triton` over :class:`~sparda.kernels.quant.QuantizedKV` slots
    (``data [..., d']`` uint8, ``scale [..., 2]`` fp32).

    Raises:
        SpardaError: a shape/dtype mismatch or an unsupported head dim.
    """
    if k_slots.dim() != 5:
        raise SpardaError(f"k_slots/v_slots must be [B, H_kv, S, block_size, d], got {tuple(k_slots.shape)}")
    qbits = _check_quantized(q, k_slots, v_slots, block_ids, kv_len)
    if slot_ids.shape != block_ids.shape:
        slot_ids = slot_ids.expand(block_ids.shape)
    k_slots, v_slots = k_slots.contiguous(), v_slots.contiguous()
    views = [(t, (t.stride(0), t.stride(1), t.stride(2), t.stride(3)))
             for t in (k_slots.data, v_slots.data, k_slots.scale, v_slots.scale)]
    return _launch(q, views[0], views[1], block_ids, slot_ids, kv_len, k_slots.shape[3], 2**62, num_splits,
                   num_warps, num_stages, views[2], views[3], qbits)
