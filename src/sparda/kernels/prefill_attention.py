"""Block-sparse prefill attention in Triton, FlashAttention-2 style (design §3.5).

A program's ``BLOCK_M`` rows are ``BLOCK_M // G_P`` query tokens x the ``G_P =
next_pow2(G)`` heads of one KV head; it walks the union of those tokens' blocks
(:func:`tile_block_lists`) and masks each token exactly. Twin:
:func:`sparda.kernels.reference.block_sparse_attention`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels._common import check_head_dim, next_pow2, tl_float_dtype_ok

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    Q, K, V, O, QPOS, KV_LEN, MASK, TILE_IDS, TILE_CNT,
    stride_qb, stride_qh, stride_qg, stride_qt,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_og, stride_ot,
    stride_pb, stride_mb, stride_mh, stride_mt,
    H, Tq, T, num_m, tile_width, qk_scale,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
    BM: tl.constexpr, HAS_MASK: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_r = tl.arange(0, BM)
    tok = pid_m * (BM // G_P) + offs_r // G_P  # query token of each row
    g = (offs_r % G_P).to(tl.int64)  # its query head within the KV head's group
    tok_ok = tok < Tq
    row_ok = tok_ok & (g < G)
    tok64 = tok.to(tl.int64)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    qpos = tl.load(QPOS + b * stride_pb + tok64, mask=tok_ok, other=-1).to(tl.int64)
    kv_len = tl.minimum(tl.load(KV_LEN + b).to(tl.int64), T)
    q = tl.load(Q + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + tok64[:, None] * stride_qt
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh + offs_n[:, None] * stride_kt + offs_d[None, :]
    v_base = V + b * stride_vb + h * stride_vh + offs_n[:, None] * stride_vt + offs_d[None, :]
    mask_base = MASK + b * stride_mb + h * stride_mh + tok64 * stride_mt
    tile = pid_bh.to(tl.int64) * num_m + pid_m
    count = tl.load(TILE_CNT + tile)
    ids_base = TILE_IDS + tile * tile_width

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for i in range(0, count):
        blk = tl.load(ids_base + i).to(tl.int64)
        pos = blk * BS + offs_n
        col_ok = (offs_n < BS) & (pos < kv_len)
        k = tl.load(k_base + blk * BS * stride_kt, mask=col_ok[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        allowed = col_ok[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_MASK:
            sel = tl.load(mask_base + blk, mask=tok_ok, other=0)
            allowed = allowed & (sel != 0)[:, None]
        qk = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + blk * BS * stride_vt, mask=col_ok[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(O + b * stride_ob + h * stride_oh + g[:, None] * stride_og + tok64[:, None] * stride_ot
             + offs_d[None, :], out.to(O.dtype.element_ty), mask=row_ok[:, None])


def tile_block_lists(block_mask: torch.Tensor | None, q_pos: torch.Tensor, kv_len: torch.Tensor,
                     num_heads: int, num_keys: int, block_size: int, tokens_per_tile: int):
    """Blocks each tile of ``tokens_per_tile`` query tokens may need.

    Args:
        block_mask: ``[B, H, Tq, N]`` bool or ``None`` (dense causal). q_pos: ``[B, Tq]``; kv_len: ``[B]``.
    Returns:
        ``(ids [B*H*num_m, N] int32, counts [B*H*num_m] int32)``: the first ``counts`` ids, ascending.
    """
    bsz, num_q = q_pos.shape
    num_m = -(-num_q // tokens_per_tile)
    num_blocks = -(-num_keys // block_size)
    pad = num_m * tokens_per_tile - num_q
    pos = torch.nn.functional.pad(q_pos.long(), (0, pad), value=-1).view(bsz, num_m, tokens_per_tile)
    last = pos.amax(-1)  # [B, num_m] largest query position in the tile
    blocks = torch.arange(num_blocks, device=q_pos.device)
    reach = (blocks.view(1, 1, -1) * block_size <= last.unsqueeze(-1)) & (
        blocks.view(1, 1, -1) * block_size < kv_len.view(-1, 1, 1))  # [B, num_m, N]
    if block_mask is None:
        need = reach.unsqueeze(1).expand(bsz, num_heads, num_m, num_blocks)
    else:
        bm = block_mask[..., :num_blocks]
        if bm.shape[-1] < num_blocks:
            bm = torch.nn.functional.pad(bm, (0, num_blocks - bm.shape[-1]))
        if pad:
            bm = torch.nn.functional.pad(bm, (0, 0, 0, pad))
        need = bm.view(bsz, num_heads, num_m, tokens_per_tile, num_blocks).any(3) & reach.unsqueeze(1)
    need = need.reshape(bsz * num_heads * num_m, num_blocks)
    counts = need.sum(-1, dtype=torch.int32)
    # compaction without a sort: the needed block j goes to column (needed blocks before j);
    # the others all go to a spare last column, dropped
    slot = torch.where(need, need.cumsum(-1) - 1, num_blocks)
    ids = torch.zeros(need.shape[0], num_blocks + 1, dtype=torch.int32, device=need.device)
    ids.scatter_(1, slot, torch.arange(num_blocks, dtype=torch.int32, device=need.device).expand_as(slot))
    return ids[:, :num_blocks].contiguous(), counts


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             block_mask: torch.Tensor | None, q_pos: torch.Tensor,
                             kv_len: torch.Tensor, block_size: int, block_m: int = 64, *,
                             num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """Triton :func:`sparda.kernels.prefill_attention`; ``block_m`` rows per program (power of
    two >= 16), ``num_warps``/``num_stages`` Triton launch parameters.

    Raises:
        SpardaError: a bad dtype, rank or shape, or a head dim not a power of two >= 16.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        tl_float_dtype_ok(t, name)
    if q.dim() != 5:
        raise SpardaError(f"prefill q must be [B, H_kv, G, Tq, d], got {tuple(q.shape)}")
    bsz, heads, groups, num_q, d = q.shape
    check_head_dim(d)
    if k.shape[:2] != (bsz, heads) or k.shape[-1] != d or v.shape != k.shape or k.dtype != q.dtype:
        raise SpardaError(f"k/v {tuple(k.shape)} {k.dtype} do not match q {tuple(q.shape)} {q.dtype}")
    if q_pos.shape != (bsz, num_q) or kv_len.shape != (bsz,):
        raise SpardaError(f"q_pos must be [B, Tq] and kv_len [B], got {tuple(q_pos.shape)}, {tuple(kv_len.shape)}")
    num_keys = k.shape[2]
    num_blocks = -(-num_keys // block_size)
    if block_mask is not None and (block_mask.shape[:3] != (bsz, heads, num_q) or block_mask.dtype != torch.bool):
        raise SpardaError(f"block_mask must be bool [B, H_kv, Tq, N], got {tuple(block_mask.shape)} {block_mask.dtype}")
    out = torch.empty_like(q)
    if num_q == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    q_pos, kv_len = q_pos.contiguous(), kv_len.contiguous()
    g_p = next_pow2(groups)
    rows = max(block_m, g_p)  # rows per program: tokens_per_tile tokens x g_p heads
    tokens_per_tile = rows // g_p
    ids, counts = tile_block_lists(block_mask, q_pos, kv_len, heads, num_keys, block_size, tokens_per_tile)
    num_m = -(-num_q // tokens_per_tile)
    if block_mask is not None:
        mask_u8 = block_mask.view(torch.uint8)
        if mask_u8.shape[-1] < num_blocks:
            mask_u8 = torch.nn.functional.pad(mask_u8, (0, num_blocks - mask_u8.shape[-1]))
        ms = mask_u8.stride()
    else:
        mask_u8, ms = counts, (0, 0, 0, 0)
    ieee = q.dtype == torch.float32 or not q.is_cuda  # interpreter: no bf16 dot
    _prefill_kernel[(num_m, bsz * heads)](
        q, k, v, out, q_pos, kv_len, mask_u8, ids, counts,
        *q.stride()[:4], k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        *out.stride()[:4], q_pos.stride(0), ms[0], ms[1], ms[2],
        heads, num_q, num_keys, num_m, ids.shape[-1], _LOG2E / math.sqrt(d),
        G=groups, G_P=g_p, D=d, BS=block_size, BN=max(16, next_pow2(block_size)), BM=rows,
        HAS_MASK=block_mask is not None, IEEE=ieee,
        num_warps=num_warps or (4 if rows <= 64 else 8), num_stages=num_stages or (2 if ieee else 3))
    return out
