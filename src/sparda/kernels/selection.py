"""Decode block selection in Triton, one query token per row (design §3.2-3.4, §4).

``_forecast_pool_kernel`` (Forecast dot products + max-pool); ``_query_logits_kernel`` +
``_query_pool_kernel`` (softmax needs the row-wide max and sum first); ``_select_kernel``
(forced blocks + exact top-k or the top-p count of design §3.12, sorted ids ``-1`` padded).
Twin: ``twins.select_decode_reference``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparda.config import SelectionConfig
from sparda.kernels._common import next_pow2, num_sms
from sparda.kernels import twins
from sparda.kernels.twins import check_selection_inputs, default_width

_LOG2E = 1.4426950408889634
_CK_TILE = 64  # compressed keys per program


@triton.jit
def _visible_count(QPOS, CK_LEN, b, C, KER: tl.constexpr, STR: tl.constexpr, HAS_CK_LEN: tl.constexpr):
    """(number of visible compressed keys, number of existing compressed keys) of row b."""
    t = tl.load(QPOS + b).to(tl.int64)
    c_b = C + 0 * t
    if HAS_CK_LEN:
        c_b = tl.minimum(c_b, tl.load(CK_LEN + b).to(tl.int64))
    n_vis = tl.where(t >= KER - 1, (tl.maximum(t - KER + 1, 0)) // STR + 1, 0)
    return tl.minimum(n_vis, c_b), c_b


@triton.jit
def _overlap(offs_j, blocks, c_b, KER: tl.constexpr, STR: tl.constexpr, BS: tl.constexpr):
    """[NB, CK] bool: compressed key j (existing) overlaps block b (reference.block_overlap)."""
    start = offs_j[None, :] * STR
    return ((start < (blocks[:, None] + 1) * BS) & (start + KER > blocks[:, None] * BS)
            & (offs_j[None, :] < c_b))


@triton.jit
def _forecast_pool_kernel(
    F, CK, QPOS, CK_LEN, OUT,
    stride_fb, stride_fh, stride_cb, stride_ch, stride_cc,
    H, C, N,
    D: tl.constexpr, KER: tl.constexpr, STR: tl.constexpr, BS: tl.constexpr,
    NB: tl.constexpr, NB_P: tl.constexpr, CK_T: tl.constexpr, HAS_CK_LEN: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    n_vis, c_b = _visible_count(QPOS, CK_LEN, b, C, KER, STR, HAS_CK_LEN)
    b0 = tl.program_id(1) * NB
    j0 = tl.maximum(b0 * BS - KER + STR, 0) // STR
    offs_j = j0 + tl.arange(0, CK_T)
    offs_d = tl.arange(0, D)
    f = tl.load(F + b * stride_fb + h * stride_fh + offs_d).to(tl.float32)
    vis = offs_j < n_vis
    ck = tl.load(CK + b * stride_cb + h * stride_ch + offs_j[:, None].to(tl.int64) * stride_cc
                 + offs_d[None, :], mask=vis[:, None], other=0.0)
    s = tl.sum(ck.to(tl.float32) * f[None, :], 1)
    s = tl.where(vis, s, float("-inf"))
    blocks = b0 + tl.arange(0, NB_P)
    ov = _overlap(offs_j, blocks, c_b, KER, STR, BS)
    pooled = tl.max(tl.where(ov, s[None, :], float("-inf")), 1)
    ok = (tl.arange(0, NB_P) < NB) & (blocks < N)
    tl.store(OUT + pid_bh.to(tl.int64) * N + blocks, pooled, mask=ok)


@triton.jit
def _query_logits_kernel(
    Q, CK, QPOS, CK_LEN, LOGITS, STATS,
    stride_qb, stride_qh, stride_qg, stride_cb, stride_ch, stride_cc,
    H, C, C_PAD, qk_scale,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, KER: tl.constexpr, STR: tl.constexpr,
    CK_T: tl.constexpr, HAS_CK_LEN: tl.constexpr, IEEE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_c = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    n_vis, c_b = _visible_count(QPOS, CK_LEN, b, C, KER, STR, HAS_CK_LEN)
    offs_g = tl.arange(0, G_P)
    offs_d = tl.arange(0, D)
    offs_j = pid_c * CK_T + tl.arange(0, CK_T)
    vis = offs_j < n_vis
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_g[:, None] * stride_qg + offs_d[None, :],
                mask=offs_g[:, None] < G, other=0.0)
    ck = tl.load(CK + b * stride_cb + h * stride_ch + offs_j[:, None].to(tl.int64) * stride_cc
                 + offs_d[None, :], mask=vis[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(ck.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(ck))
    s = tl.where(vis[None, :], s * qk_scale, float("-inf"))  # [G_P, CK_T], log2 domain
    row = pid_bh.to(tl.int64) * G
    tl.store(LOGITS + (row + offs_g[:, None]) * C_PAD + offs_j[None, :], s, mask=offs_g[:, None] < G)
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp2(s - m_safe[:, None]), 1)
    stat = STATS + ((pid_bh * tl.num_programs(1) + pid_c) * 2) * G + offs_g
    tl.store(stat, m, mask=offs_g < G)
    tl.store(stat + G, l, mask=offs_g < G)


@triton.jit
def _query_pool_kernel(
    LOGITS, STATS, QPOS, CK_LEN, OUT,
    H, C, C_PAD, N, num_chunks,
    G: tl.constexpr, G_P: tl.constexpr, KER: tl.constexpr, STR: tl.constexpr, BS: tl.constexpr,
    NB: tl.constexpr, NB_P: tl.constexpr, CK_T: tl.constexpr, NC_P: tl.constexpr,
    TILES: tl.constexpr, HAS_CK_LEN: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    n_vis, c_b = _visible_count(QPOS, CK_LEN, b, C, KER, STR, HAS_CK_LEN)
    offs_g = tl.arange(0, G_P)
    g_ok = offs_g < G
    offs_c = tl.arange(0, NC_P)
    stat = STATS + ((pid_bh * num_chunks + offs_c[:, None]) * 2) * G + offs_g[None, :]
    c_ok = (offs_c[:, None] < num_chunks) & g_ok[None, :]
    m_c = tl.load(stat, mask=c_ok, other=float("-inf"))
    l_c = tl.load(stat + G, mask=c_ok, other=0.0)
    m = tl.max(m_c, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(l_c * tl.exp2(m_c - m_safe[None, :]), 0)
    inv_l = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
    row = pid_bh.to(tl.int64) * G
    for r in range(TILES):  # several block tiles per program: the stats load above amortises
        b0 = (tl.program_id(1) * TILES + r) * NB
        j0 = tl.maximum(b0 * BS - KER + STR, 0) // STR
        offs_j = j0 + tl.arange(0, CK_T)
        vis = offs_j < n_vis
        lg = tl.load(LOGITS + (row + offs_g[:, None]) * C_PAD + offs_j[None, :],
                     mask=g_ok[:, None] & vis[None, :], other=float("-inf"))
        p = tl.exp2(lg - m_safe[:, None]) * inv_l[:, None]
        ps = tl.where(vis, tl.sum(p, 0), 0.0)
        blocks = b0 + tl.arange(0, NB_P)
        ov = _overlap(offs_j, blocks, c_b, KER, STR, BS)
        pooled = tl.max(tl.where(ov, ps[None, :], float("-inf")), 1)
        ok = (tl.arange(0, NB_P) < NB) & (blocks < N)
        tl.store(OUT + pid_bh.to(tl.int64) * N + blocks, pooled, mask=ok)


@triton.jit
def _adaptive_count(sc, valid, base, cand, key, n_cand, TOPK: tl.constexpr, TOPP: tl.constexpr,
                    MIN_K: tl.constexpr, LOGITS: tl.constexpr, SCALE: tl.constexpr):
    """Scored blocks to take under top-p mass (design §3.12; twin ``reference._adaptive_counts``).

    Bisects for the smallest int key ``v`` whose mass above it (forced blocks first) is
    below ``TOPP``; candidates above ``v`` are taken, those at ``v`` (equal scores, equal
    mass) in block order while the mass before each stays below ``TOPP``."""
    fin = valid & (sc == sc) & (sc != float("inf")) & (sc != float("-inf"))
    if LOGITS:
        y = tl.where(fin, sc * SCALE, float("-inf"))
        top = tl.max(y, 0)
        w = tl.where(fin, tl.exp2((y - tl.where(top == float("-inf"), 0.0, top)) * 1.4426950408889634), 0.0)
    else:
        w = tl.where(fin & (sc > 0), sc, 0.0)
    total = tl.sum(w, 0)
    mass = tl.where(total > 0, w / tl.where(total > 0, total, 1.0), 0.0)
    m_forced = tl.sum(tl.where(base, mass, 0.0), 0)
    mass = tl.where(cand, mass, 0.0)
    lo = tl.full([], -2147483649, tl.int64)  # mass above lo >= TOPP (or lo below every key)
    hi = tl.full([], 2147483647, tl.int64)  # mass above hi < TOPP (unless the forced mass is)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        below = m_forced + tl.sum(tl.where(key > mid, mass, 0.0), 0) < TOPP
        lo = tl.where(below, lo, mid)
        hi = tl.where(below, mid, hi)
    above = m_forced + tl.sum(tl.where(key > hi, mass, 0.0), 0)
    eq = cand & (key == hi)
    m_eq = tl.max(tl.where(eq, mass, 0.0), 0)
    rank = tl.cumsum(eq.to(tl.int32), 0) - 1
    n_eq = tl.sum((eq & (above + rank.to(tl.float32) * m_eq < TOPP)).to(tl.int32), 0)
    n_gt = tl.sum((cand & (key > hi)).to(tl.int32), 0)
    count = tl.where(above < TOPP, n_gt + n_eq, 0)
    if TOPP >= 1.0:
        count = n_cand
    count = tl.where(total > 0, count, n_cand)
    return tl.minimum(tl.minimum(tl.maximum(count, MIN_K), TOPK), n_cand)


@triton.jit
def _select_kernel(
    SCORES, QPOS, IDS, MASK, H, N, W,
    BS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, TOPK: tl.constexpr,
    BUDGET: tl.constexpr, DENSE_LEN: tl.constexpr, N_P: tl.constexpr, W_P: tl.constexpr,
    WRITE_MASK: tl.constexpr, ADAPTIVE: tl.constexpr, TOPP: tl.constexpr, MIN_K: tl.constexpr,
    LOGITS: tl.constexpr, SCALE: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    t = tl.load(QPOS + b).to(tl.int64)
    cur = tl.where(t >= 0, t // BS, -1)
    blocks = tl.arange(0, N_P)
    in_row = blocks < N
    sc = tl.load(SCORES + pid_bh.to(tl.int64) * N + blocks, mask=in_row, other=float("-inf"))
    valid = in_row & (blocks <= cur)
    forced = (blocks < INIT) | (blocks > cur - LOCAL)
    dense = (t + 1 < DENSE_LEN) | (cur + 1 <= BUDGET)
    base = valid & (forced | dense)
    cand = valid & (~base)
    # reference: nan_to_num(nan=-1e30, neginf=-1e30), +inf -> largest finite float
    x = tl.where(sc != sc, -1e30, sc)
    x = tl.where(x == float("-inf"), -1e30, x)
    x = tl.where(x == float("inf"), 3.4028234663852886e38, x)
    bits = x.to(tl.int32, bitcast=True)
    # order-preserving int keys as reference._rank_key (-0.0 ranks just below +0.0)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
    key = tl.where(cand, key, -2147483648)
    n_cand = tl.sum(cand.to(tl.int32), 0)
    if ADAPTIVE:
        kk = _adaptive_count(sc, valid, base, cand, key, n_cand, TOPK, TOPP, MIN_K, LOGITS, SCALE)
    else:
        kk = tl.minimum(n_cand, TOPK)
    # largest tau with count(key >= tau) >= kk: the kk-th largest key
    lo = tl.full([], -2147483647, tl.int64)
    hi = tl.full([], 2147483648, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        cnt = tl.sum((key >= mid).to(tl.int32), 0)
        ok = cnt >= kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    gt = cand & (key > lo)
    eq = cand & (key == lo)
    n_gt = tl.sum(gt.to(tl.int32), 0)
    rank = tl.cumsum(eq.to(tl.int32), 0) - 1
    sel = base | gt | (eq & (rank < kk - n_gt))
    if WRITE_MASK:
        tl.store(MASK + pid_bh.to(tl.int64) * N + blocks, sel.to(tl.int8), mask=in_row)
    pos = tl.cumsum(sel.to(tl.int32), 0) - 1
    count = tl.sum(sel.to(tl.int32), 0)
    row_ids = IDS + pid_bh.to(tl.int64) * W
    tl.store(row_ids + pos, blocks.to(IDS.dtype.element_ty), mask=sel & (pos < W))
    offs_w = tl.arange(0, W_P)
    tl.store(row_ids + offs_w, tl.full([W_P], -1, IDS.dtype.element_ty), mask=(offs_w >= count) & (offs_w < W))


def _tile_geometry(cfg: SelectionConfig) -> tuple[int, int, int]:
    """(ck per program, blocks per program, blocks per program padded to a power of 2)."""
    per_block = cfg.block_size // cfg.kernel_stride
    halo = -(-(cfg.kernel_size - cfg.kernel_stride) // cfg.kernel_stride)
    ck_t = max(_CK_TILE, next_pow2(per_block + halo))
    nb = (ck_t - halo) // per_block
    return ck_t, nb, next_pow2(nb)


def decode_block_scores_triton(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                               num_blocks: int, cfg: SelectionConfig,
                               ck_len: torch.Tensor | None = None) -> torch.Tensor:
    """Block scores ``[B, H, N]`` fp32 of one decode token.

    Raises:
        SpardaError: via ``twins.check_selection_inputs``.
    """
    check_selection_inputs(query, ck, q_pos, ck_len)
    bsz, heads, num_ck, d = ck.shape
    out = torch.empty(bsz, heads, num_blocks, device=ck.device, dtype=torch.float32)
    if num_blocks == 0:
        return out
    if ck.stride(-1) != 1:
        ck = ck.contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()
    q_pos = q_pos.contiguous()
    ck_len_t = q_pos if ck_len is None else ck_len.contiguous()
    ck_t, nb, nb_p = _tile_geometry(cfg)
    geo = dict(KER=cfg.kernel_size, STR=cfg.kernel_stride, HAS_CK_LEN=ck_len is not None)
    pool_grid = (bsz * heads, -(-num_blocks // nb))
    if query.dim() == 3:
        _forecast_pool_kernel[pool_grid](
            query, ck, q_pos, ck_len_t, out,
            query.stride(0), query.stride(1), ck.stride(0), ck.stride(1), ck.stride(2),
            heads, num_ck, num_blocks, D=d, BS=cfg.block_size, NB=nb, NB_P=nb_p, CK_T=ck_t,
            num_warps=4, **geo)
        return out
    groups = query.shape[2]
    g_p = max(16, next_pow2(groups))
    num_chunks = max(1, -(-num_ck // _CK_TILE))
    c_pad = num_chunks * _CK_TILE
    logits = torch.empty(bsz * heads * groups, c_pad, device=ck.device, dtype=torch.float32)
    stats = torch.empty(bsz * heads, num_chunks, 2, groups, device=ck.device, dtype=torch.float32)
    _query_logits_kernel[(bsz * heads, num_chunks)](
        query, ck, q_pos, ck_len_t, logits, stats,
        query.stride(0), query.stride(1), query.stride(2), ck.stride(0), ck.stride(1), ck.stride(2),
        heads, num_ck, c_pad, _LOG2E / math.sqrt(d),
        G=groups, G_P=g_p, D=d, CK_T=_CK_TILE,
        IEEE=query.dtype == torch.float32 or not query.is_cuda,  # interpreter: no bf16 dot
        num_warps=4, **geo)
    num_tiles = -(-num_blocks // nb)
    tiles = max(1, min(8, num_tiles * bsz * heads // (2 * num_sms(ck.device))))
    _query_pool_kernel[(bsz * heads, -(-num_tiles // tiles))](
        logits, stats, q_pos, ck_len_t, out, heads, num_ck, c_pad, num_blocks, num_chunks,
        G=groups, G_P=max(2, next_pow2(groups)), BS=cfg.block_size, NB=nb, NB_P=nb_p, CK_T=ck_t,
        NC_P=next_pow2(num_chunks), TILES=tiles, num_warps=4, **geo)
    return out


def select_from_scores_triton(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig,
                              width: int | None = None, return_mask: bool = False, *,
                              adaptive: bool = False, logit_scale: float | None = None):
    """``reference.select_blocks`` on ``[B, H, N]`` scores -> ``ids [B, H, width]`` int32 (sorted,
    -1 padded), or ``(ids, mask [B, H, N] bool)``; ``adaptive``, ``logit_scale`` as there
    (design §3.12: the count stays on the device, the width is fixed)."""
    bsz, heads, num_blocks = block_scores.shape
    width = default_width(num_blocks, cfg) if width is None else int(width)
    ids = torch.empty(bsz, heads, width, device=block_scores.device, dtype=torch.int32)
    mask = torch.empty(bsz, heads, num_blocks, device=block_scores.device, dtype=torch.int8) \
        if return_mask else ids
    n_p = next_pow2(max(num_blocks, 2))
    _select_kernel[(bsz * heads,)](
        block_scores.contiguous(), q_pos.contiguous(), ids, mask, heads, num_blocks, width,
        BS=cfg.block_size, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, TOPK=cfg.topk_blocks,
        BUDGET=cfg.budget_blocks, DENSE_LEN=cfg.dense_len, N_P=n_p, W_P=next_pow2(max(width, 2)),
        WRITE_MASK=return_mask, ADAPTIVE=adaptive and cfg.adaptive,
        TOPP=float(cfg.topp_mass) if cfg.adaptive else 1.0, MIN_K=cfg.min_scored_blocks,
        LOGITS=logit_scale is not None, SCALE=1.0 if logit_scale is None else float(logit_scale),
        num_warps=4 if n_p <= 1024 else 8)
    if return_mask:
        return ids, mask.bool()
    return ids


def select_decode_blocks_triton(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                                num_blocks: int, cfg: SelectionConfig, *,
                                ck_len: torch.Tensor | None = None, width: int | None = None,
                                return_mask: bool = False):
    """Triton :func:`sparda.kernels.select_decode_blocks`.

    Raises:
        SpardaError: via ``twins.check_selection_inputs``.
    """
    scores = decode_block_scores_triton(query, ck, q_pos, num_blocks, cfg, ck_len)
    return select_from_scores_triton(scores, q_pos, cfg, width, return_mask, adaptive=True,
                                     logit_scale=twins.mass_logit_scale(query))
