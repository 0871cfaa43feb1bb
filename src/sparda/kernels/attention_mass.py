"""Attention mass per key of a prefill in Triton, two passes, no ``[G, Tq, T]`` tensor (design §7).

:func:`_row_lse_kernel`: each query's log-sum-exp (online max and sum, fp32);
:func:`_column_mass_kernel`: per ``BN`` keys, ``sum exp(q . k - lse)`` down each column.
Tiles pack ``BM // G_P`` query tokens x the ``G_P = next_pow2(G)`` heads of a KV head.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels._common import check_head_dim, next_pow2, num_sms, tl_float_dtype_ok

_LOG2E = 1.4426950408889634


@triton.jit
def _row_lse_kernel(
    Q, K, M_OUT, L_OUT,
    stride_qb, stride_qh, stride_qg, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_lb, stride_lh, stride_lg, stride_ls,
    H, Tq, T, key_chunk, qk_scale,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_s = tl.program_id(2)  # which ``key_chunk`` keys: a split of the keys, combined on the host
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_r = tl.arange(0, BM)
    tok = pid_m * (BM // G_P) + offs_r // G_P
    g = (offs_r % G_P).to(tl.int64)
    row_ok = (tok < Tq) & (g < G)
    tok64 = tok.to(tl.int64)
    qpos = T - Tq + tok64  # query t sits at key position T - Tq + t
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BN)
    q = tl.load(Q + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + tok64[:, None] * stride_qt
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = K + b * stride_kb + h * stride_kh + offs_d[None, :]
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    lo = pid_s * key_chunk
    # keys the tile's last token sees, within this split
    hi = tl.minimum(tl.minimum(T - Tq + (pid_m + 1) * (BM // G_P), T), lo + key_chunk)
    for start in range(lo, hi, BN):
        pos = start + offs_n
        k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kt, mask=(pos < T)[:, None], other=0.0)
        if IEEE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        allowed = row_ok[:, None] & (pos[None, :] <= qpos[:, None]) & (pos < T)[None, :]
        qk = tl.where(allowed, qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(qk - m_safe[:, None]), 1)
        m_i = m_new
    at = b * stride_lb + h * stride_lh + g * stride_lg + pid_s * stride_ls + tok64
    tl.store(M_OUT + at, m_i, mask=row_ok)
    tl.store(L_OUT + at, l_i, mask=row_ok)


@triton.jit
def _column_mass_kernel(
    Q, K, LSE, OUT,
    stride_qb, stride_qh, stride_qg, stride_qt, stride_kb, stride_kh, stride_kt,
    stride_lb, stride_lh, stride_lg, stride_ob, stride_oh,
    H, Tq, T, qk_scale,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    tt = BM // G_P  # query tokens per tile
    offs_r = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    pos = pid_n * BN + tl.arange(0, BN)
    col_ok = pos < T
    k = tl.load(K + b * stride_kb + h * stride_kh + pos[:, None].to(tl.int64) * stride_kt + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    g = (offs_r % G_P).to(tl.int64)
    acc = tl.zeros([BN], tl.float32)
    first = tl.maximum(pid_n * BN - (T - Tq), 0) // tt  # tiles before it hold no query that sees these keys
    for m in range(first, tl.cdiv(Tq, tt)):
        tok = m * tt + offs_r // G_P
        row_ok = (tok < Tq) & (g < G)
        tok64 = tok.to(tl.int64)
        q = tl.load(Q + b * stride_qb + h * stride_qh + g[:, None] * stride_qg + tok64[:, None] * stride_qt
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + g * stride_lg + tok64, mask=row_ok, other=float("inf"))
        if IEEE:
            qk = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        allowed = row_ok[:, None] & col_ok[None, :] & (pos[None, :] <= (T - Tq + tok64)[:, None])
        p = tl.where(allowed, tl.exp2(qk * qk_scale - lse[:, None]), 0.0)
        acc += tl.sum(p, 0)
    tl.store(OUT + b * stride_ob + h * stride_oh + pos, acc, mask=col_ok)


def token_attention_mass_triton(q: torch.Tensor, k: torch.Tensor, block_m: int = 64,
                                block_n: int = 64, key_splits: int | None = None) -> torch.Tensor:
    """Triton :func:`sparda.kernels.token_attention_mass`.

    Args:
        q: ``[B, H, G, Tq, d]`` fp16/bf16/fp32. k: ``[B, H, T, d]`` same dtype, ``T >= Tq``.
        block_m, block_n: rows and keys per tile (powers of two >= 16; fp32 on CUDA: at most 32).
        key_splits: programs per query tile of the log-sum-exp pass; ``None``: about two per
            SM when query tiles are few, else one.
    Returns:
        ``[B, H, T]`` fp32; each ``(b, h)`` sums to ``G * Tq``.
    Raises:
        SpardaError: a bad dtype, rank or shape, ``T < Tq``, or a head dim not a power of two >= 16.
    """
    for name, t in (("q", q), ("k", k)):
        tl_float_dtype_ok(t, name)
    if q.dim() != 5 or k.dim() != 4:
        raise SpardaError(f"attention mass needs q [B, H, G, Tq, d] and k [B, H, T, d], got {tuple(q.shape)}, "
                          f"{tuple(k.shape)}")
    bsz, heads, groups, num_q, d = q.shape
    check_head_dim(d)
    num_keys = k.shape[2]
    if k.shape[:2] != (bsz, heads) or k.shape[-1] != d or k.dtype != q.dtype or num_keys < num_q:
        raise SpardaError(f"k {tuple(k.shape)} {k.dtype} does not match q {tuple(q.shape)} {q.dtype} "
                          "(same batch, heads, head dim and dtype; at least as many keys as queries)")
    out = torch.empty(bsz, heads, num_keys, dtype=torch.float32, device=q.device)
    if num_q == 0 or num_keys == 0:
        return out.zero_()
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k))
    ieee = q.dtype == torch.float32 or not q.is_cuda  # the interpreter has no bf16 dot
    if ieee and q.is_cuda:  # fp32 dots on CUDA cores: 64 x 64 tiles spill registers (sm_90 SASS)
        block_m, block_n = min(block_m, 32), min(block_n, 32)
    g_p = next_pow2(groups)
    rows = max(block_m, g_p)
    tokens_per_tile = rows // g_p
    num_m = -(-num_q // tokens_per_tile)
    # few query tiles (snapkv's window, a short chunk): split the keys so that the pass fills the GPU
    splits = key_splits or max(1, min(-(-num_keys // (4 * block_n)), -(-2 * num_sms(q.device) // (num_m * bsz * heads))))
    key_chunk = -(-num_keys // (splits * block_n)) * block_n
    splits = -(-num_keys // key_chunk)
    m_part = torch.empty(bsz, heads, groups, splits, num_q, dtype=torch.float32, device=q.device)
    l_part = torch.empty_like(m_part)
    common = dict(G=groups, G_P=g_p, D=d, BM=rows, BN=block_n, IEEE=ieee, num_warps=4,
                  num_stages=2 if ieee else 3)
    scale = _LOG2E / math.sqrt(d)
    q_k_strides = (*q.stride()[:4], k.stride(0), k.stride(1), k.stride(2))
    _row_lse_kernel[(num_m, bsz * heads, splits)](
        q, k, m_part, l_part, *q_k_strides, *m_part.stride()[:4], heads, num_q, num_keys, key_chunk, scale,
        **common)
    # log2-sum-exp2 over the splits (a split no key of which a query sees holds m = -inf, l = 0)
    m_max = m_part.amax(3)
    lse = (m_max + torch.log2((l_part * torch.exp2(m_part - m_max.unsqueeze(3))).sum(3))).contiguous()
    _column_mass_kernel[(-(-num_keys // block_n), bsz * heads)](
        q, k, lse, out, *q_k_strides, *lse.stride()[:3], out.stride(0), out.stride(1), heads, num_q, num_keys,
        scale, **common)
    return out
