"""Prefill block selection in Triton, per query token (design §3.2-3.4, §3.6, §4).

Scoring launch, grid ``(query tiles of BLOCK_M tokens, B*H)``: query-based (``SOFTMAX``;
pass 1 the per-head softmax max and sum, pass 2 the scores) or Forecast (raw dot products,
one pass), max-pooled onto blocks per offset of :func:`~sparda.kernels.reference.pool_window`
into an fp32 scratch row. Select launch: the rule of ``reference.select_blocks`` (bisection
or bracket top-k, design §3.4), writing the ``[B, H, Tq, N]`` bool mask. Twin:
:func:`sparda.kernels.twins.select_prefill_reference`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparda.config import SelectionConfig
from sparda.kernels._common import next_pow2
from sparda.kernels.twins import check_prefill_selection_inputs

_LOG2E = 1.4426950408889634
#: scratch (block scores) per launch at most, in fp32 elements (256 MiB); longer query
#: ranges are cut into sub-launches
_SCRATCH_ELEMS = 1 << 26


@triton.jit
def _select_rows(SCR, MASK, QPOS, b, h, sr, Tq, N, stride_pb, stride_sb, stride_sh, stride_st,
                 stride_mb, stride_mh, stride_mt, BS: tl.constexpr, INIT: tl.constexpr,
                 LOCAL: tl.constexpr, TOPK: tl.constexpr, BUDGET: tl.constexpr,
                 DENSE_LEN: tl.constexpr, N_P: tl.constexpr, RS: tl.constexpr):
    """The rule of ``reference.select_blocks`` on query rows ``sr [RS]``: scores from ``SCR``, mask
    entries out; top-k by 32-step bisection on order-preserving int32 keys (design §3.4)."""
    cols = tl.arange(0, N_P)
    in_row = cols < N
    s_ok = sr < Tq
    t = tl.load(QPOS + b * stride_pb + sr, mask=s_ok, other=-1).to(tl.int64)
    cur = tl.where(t >= 0, t // BS, -1)
    valid = in_row[None, :] & (cols[None, :] <= cur[:, None]) & s_ok[:, None]
    sc = tl.load(SCR + b * stride_sb + h * stride_sh + sr[:, None].to(tl.int64) * stride_st + cols[None, :],
                 mask=valid, other=float("-inf"))
    forced = (cols[None, :] < INIT) | (cols[None, :] > cur[:, None] - LOCAL)
    dense = (t + 1 < DENSE_LEN) | (cur + 1 <= BUDGET)
    base = valid & (forced | dense[:, None])
    cand = valid & (~base)
    # reference: nan_to_num(nan=-1e30, neginf=-1e30), +inf -> largest finite float
    x = tl.where(sc != sc, -1e30, sc)
    x = tl.where(x == float("-inf"), -1e30, x)
    x = tl.where(x == float("inf"), 3.4028234663852886e38, x)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving int32 (_rank_key)
    # finite scores give keys in [-0x7F800000, 0x7F7FFFFF]: non-candidates sit below them all
    key = tl.where(cand, key, -2147483648)
    n_cand = tl.sum(cand.to(tl.int32), 1)
    kk = tl.minimum(n_cand, TOPK)
    # per row: the largest tau with count(key >= tau) >= kk is the kk-th largest key;
    # int32 throughout (count(key >= lo) >= kk, count(key >= hi) < kk for kk >= 1)
    lo = tl.full([RS], -2147483647, tl.int32)
    hi = tl.full([RS], 0x7F800000, tl.int32)
    for _ in range(32):
        mid = (lo >> 1) + (hi >> 1) + (((lo & 1) + (hi & 1)) >> 1)  # floor((lo + hi) / 2), no overflow
        cnt = tl.sum((key >= mid[:, None]).to(tl.int32), 1)
        ok = cnt >= kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    gt = cand & (key > lo[:, None])
    eq = cand & (key == lo[:, None])
    n_gt = tl.sum(gt.to(tl.int32), 1)
    rank = tl.cumsum(eq.to(tl.int32), 1) - 1  # ties: the lower block index first
    sel = base | gt | (eq & (rank < (kk - n_gt)[:, None]))
    tl.store(MASK + b * stride_mb + h * stride_mh + sr[:, None].to(tl.int64) * stride_mt + cols[None, :],
             sel.to(tl.uint8), mask=s_ok[:, None] & in_row[None, :])


@triton.jit
def _prefill_select_kernel(
    Q, CK, QPOS, SCR, MASK,
    stride_qb, stride_qh, stride_qg, stride_qt,
    stride_cb, stride_ch, stride_cc, stride_pb,
    stride_sb, stride_sh, stride_st, stride_mb, stride_mh, stride_mt,
    H, Tq, C, N, qk_scale, shift,
    G: tl.constexpr, G_P: tl.constexpr, BM: tl.constexpr, D: tl.constexpr,
    KER: tl.constexpr, STR: tl.constexpr, BS: tl.constexpr, R: tl.constexpr, PAD: tl.constexpr,
    NB: tl.constexpr, CK_T: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr,
    TOPK: tl.constexpr, BUDGET: tl.constexpr, DENSE_LEN: tl.constexpr, N_P: tl.constexpr,
    RS: tl.constexpr, SOFTMAX: tl.constexpr, IEEE: tl.constexpr, FUSED_SELECT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    M: tl.constexpr = BM * G_P
    offs_m = tl.arange(0, M)
    t_loc = offs_m // G_P
    g = offs_m % G_P
    rows = pid_m * BM + t_loc
    row_ok = rows < Tq
    g_ok = g < G
    offs_d = tl.arange(0, D)
    qpos = tl.load(QPOS + b * stride_pb + rows, mask=row_ok, other=-1).to(tl.int64)
    vis_pos = qpos - shift  # the lookahead rule: layers >= 1 see windows complete before the token
    n_vis = tl.where(vis_pos >= KER - 1, tl.maximum(vis_pos - KER + 1, 0) // STR + 1, 0)
    n_vis = tl.minimum(n_vis, C)
    q = tl.load(Q + b * stride_qb + h * stride_qh + g[:, None].to(tl.int64) * stride_qg
                + rows[:, None].to(tl.int64) * stride_qt + offs_d[None, :],
                mask=(row_ok & g_ok)[:, None], other=0.0)
    if IEEE:
        q = q.to(tl.float32)
    ck_base = CK + b * stride_cb + h * stride_ch + offs_d[None, :]

    # ---- pass 1 (query-based): per-head softmax statistics, online rescale over key tiles
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if SOFTMAX:
        max_vis = tl.max(n_vis, 0)
        for c0 in range(0, max_vis, CK_T):
            offs_c = c0 + tl.arange(0, CK_T)
            ck = tl.load(ck_base + offs_c[:, None].to(tl.int64) * stride_cc, mask=(offs_c < C)[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(ck.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(ck))
            s = tl.where(offs_c[None, :] < n_vis[:, None], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
            m_i = m_new
    m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
    inv_l = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)

    # ---- pass 2: pooled block scores of the blocks up to the tile's last query block
    t_rows = pid_m * BM + tl.arange(0, BM)
    t_ok = t_rows < Tq
    last = tl.max(tl.load(QPOS + b * stride_pb + t_rows, mask=t_ok, other=-1), 0)
    num_need = tl.where(last >= 0, last // BS + 1, 0)
    scr_rows = SCR + b * stride_sb + h * stride_sh + t_rows[:, None].to(tl.int64) * stride_st
    for b0 in range(0, num_need, NB):
        blocks = b0 + tl.arange(0, NB)
        acc = tl.full([BM, NB], float("-inf"), tl.float32)
        for o in range(R + PAD):  # a loop, not unrolled: one set of tile buffers in shared memory
            j = blocks * R - PAD + o
            j_ok = (j >= 0) & (j < C)
            ck = tl.load(ck_base + tl.maximum(j, 0)[:, None].to(tl.int64) * stride_cc, mask=j_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(ck.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(ck))
            vis = j[None, :] < n_vis[:, None]
            if SOFTMAX:
                p = tl.where(vis & g_ok[:, None], tl.exp2(s * qk_scale - m_safe[:, None]) * inv_l[:, None], 0.0)
                val = tl.sum(tl.reshape(p, (BM, G_P, NB)), 1)  # group sum: rows are (token, head)
                val = tl.where(j_ok[None, :], val, float("-inf"))  # existing, invisible keys score 0
            else:
                val = tl.where(vis & j_ok[None, :], s, float("-inf"))
            acc = tl.maximum(acc, val)
        tl.store(scr_rows + blocks[None, :], acc, mask=t_ok[:, None] & (blocks < N)[None, :])

    if FUSED_SELECT:
        # ---- select in this program, RS rows at a time (``select_launch="fused"``: every
        # bisection step's row sum crosses warps, a barrier each; the default ``"split"``
        # runs this phase in _prefill_topk_kernel instead)
        tl.debug_barrier()  # the select phase reads rows other threads wrote
        for r0 in range(0, BM, RS):
            sr = pid_m * BM + r0 + tl.arange(0, RS)
            _select_rows(SCR, MASK, QPOS, b, h, sr, Tq, N, stride_pb, stride_sb, stride_sh, stride_st,
                         stride_mb, stride_mh, stride_mt, BS, INIT, LOCAL, TOPK, BUDGET, DENSE_LEN, N_P, RS)


@triton.jit
def _prefill_topk_kernel(
    SCR, MASK, QPOS, stride_pb, stride_sb, stride_sh, stride_st, stride_mb, stride_mh, stride_mt,
    H, Tq, N, BS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, TOPK: tl.constexpr,
    BUDGET: tl.constexpr, DENSE_LEN: tl.constexpr, N_P: tl.constexpr, RS: tl.constexpr,
):
    """Select launch, ``topk_search="bisect"``: grid ``(ceil(Tq / RS), B*H)``, ``RS`` rows per program."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    sr = tl.program_id(0) * RS + tl.arange(0, RS)
    _select_rows(SCR, MASK, QPOS, b, h, sr, Tq, N, stride_pb, stride_sb, stride_sh, stride_st,
                 stride_mb, stride_mh, stride_mt, BS, INIT, LOCAL, TOPK, BUDGET, DENSE_LEN, N_P, RS)


@triton.jit
def _prefill_topk_bracket_kernel(
    SCR, MASK, QPOS, stride_pb, stride_sb, stride_sh, stride_st, stride_mb, stride_mh, stride_mt,
    H, Tq, N, BS: tl.constexpr, INIT: tl.constexpr, LOCAL: tl.constexpr, TOPK: tl.constexpr,
    BUDGET: tl.constexpr, DENSE_LEN: tl.constexpr, N_P: tl.constexpr,
):
    """Select launch, ``topk_search="bracket"``: grid ``(Tq, B*H)``, one row per program; the
    mask of :func:`_select_rows` by the bracket search of design §3.4."""
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    r = tl.program_id(0)
    cols = tl.arange(0, N_P)
    t = tl.load(QPOS + b * stride_pb + r).to(tl.int64)  # positions in int64, block indices in int32
    cur = tl.where(t >= 0, t // BS, -1)
    last = tl.minimum(cur, N - 1)  # the query's own block: later ones are never selected
    dense = (t + 1 < DENSE_LEN) | (cur + 1 <= BUDGET)
    # candidates: blocks INIT .. cur - LOCAL (the others up to ``last`` are forced), none
    # under the dense fallback
    c_hi = tl.where(dense, INIT - 1, tl.minimum(cur - LOCAL, last)).to(tl.int32)
    last = last.to(tl.int32)
    n_cand = tl.maximum(c_hi - INIT + 1, 0)
    kk = tl.minimum(n_cand, TOPK)
    cand = (cols >= INIT) & (cols <= c_hi)
    sc = tl.load(SCR + b * stride_sb + h * stride_sh + r.to(tl.int64) * stride_st + cols, mask=cand, other=0.0)
    bits = sc.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # order-preserving int32 (_rank_key)
    # reference: NaN and -inf rank as -1e30 (key -1900671691), +inf as FLT_MAX (key 0x7F7FFFFF)
    nan_or_neginf = ((bits & 0x7FFFFFFF) > 0x7F800000) | (bits == -8388608)  # -8388608: -inf's bits
    key = tl.where(nan_or_neginf, -1900671691, tl.minimum(key, 0x7F7FFFFF))
    # non-candidates: INT32_MIN, below every candidate (>= key(-FLT_MAX) = -2139095040), so
    # their 31-bit key -2^30 lies below every candidate's (>= -1069547520)
    key = tl.where(cand, key, -2147483648)
    # invariant: count(key >> 1 >= lo) >= kk > count(key >> 1 >= hi)
    lo = tl.min(tl.where(key > -2147483648, key >> 1, 1069547520), 0)
    hi = (tl.max(key, 0) >> 1) + 1
    found = n_cand <= TOPK  # every candidate is chosen (none when there are none)
    while (hi - lo > 1) & (~found):
        mid = lo + ((hi - lo) >> 1)
        cnt = N_P + tl.sum(((key >> 1) - mid) >> 31, 0)
        ok = cnt >= kk
        found = cnt == kk
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    forced = (cols <= last) & ((cols < INIT) | (cols > c_hi))  # the valid non-candidates
    sel = forced | ((key >> 1) >= lo)
    if found == 0:
        # lo is the kk-th largest 31-bit key; the kk-th full key is 2 lo + 1 if at least
        # kk keys reach it, else 2 lo; ties at that key go to the lower block index
        up = 2 * lo + 1
        tau = tl.where(tl.sum((key >= up).to(tl.int32), 0) >= kk, up, 2 * lo)
        gt = key > tau
        eq = key == tau
        rank = tl.cumsum(eq.to(tl.int32), 0) - 1
        sel = forced | gt | (eq & (rank < kk - tl.sum(gt.to(tl.int32), 0)))
    tl.store(MASK + b * stride_mb + h * stride_mh + r.to(tl.int64) * stride_mt + cols, sel.to(tl.uint8),
             mask=cols < N)


def _default_block_m(rows_per_token: int, on_gpu: bool, softmax: bool = True) -> int:
    """Query tokens per program: ``128 // G_P`` (query-based) or 64 (Forecast) on the GPU, 64 // G_P
    elsewhere, at least 1 (design §3.4)."""
    target = 128 if on_gpu and softmax else 64
    return max(1, target // rows_per_token)


#: Register cap of the bracket top-k launch on CUDA (Triton ``maxnreg``; ``None``: uncapped;
#: design §3.4). Read at each launch (benchmarks vary it).
_BRACKET_MAXNREG = 128


def select_prefill_blocks_triton(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                                 num_blocks: int, cfg: SelectionConfig, *, lookahead: bool = False,
                                 block_m: int | None = None, return_scores: bool = False,
                                 num_warps: int | None = None, select_launch: str = "split",
                                 topk_rows: int | None = None, topk_warps: int | None = None,
                                 topk_search: str | None = None, num_stages: int | None = None):
    """Triton :func:`sparda.kernels.select_prefill_blocks` (same arguments), plus tuning (design §3.4):

    ``block_m``: query tokens per program (power of two; :func:`_default_block_m`).
    ``return_scores``: also return the ``[B, H, Tq, N]`` fp32 scores (unspecified past a
    query's own block). ``num_warps``, ``num_stages``: the scoring launch's Triton parameters.
    ``select_launch``: ``"split"`` (default, its own launch) or ``"fused"`` (end of the scoring
    program). ``topk_search``: ``"bracket"`` (default; ``topk_rows`` 1) or ``"bisect"``
    (``topk_rows`` rows per program); ``topk_warps``: warps of the select launch. Same mask
    under every choice.

    Returns:
        ``mask [B, H, Tq, N]`` bool, or ``(mask, scores)``.
    Raises:
        SpardaError: via :func:`~sparda.kernels.twins.check_prefill_selection_inputs`.
        ValueError: a bad tuning argument.
    """
    check_prefill_selection_inputs(query, ck, q_pos, need_pow2_head_dim=True)
    softmax = query.dim() == 5
    bsz, heads, num_ck, d = ck.shape
    num_q = q_pos.shape[1]
    groups = query.shape[2] if softmax else 1
    g_p = next_pow2(groups)
    if block_m is None:
        block_m = _default_block_m(g_p, query.is_cuda, softmax)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two, got {block_m}")
    if block_m * g_p < 16:  # tl.dot needs at least 16 rows
        block_m = 16 // g_p
    if select_launch not in ("split", "fused"):
        raise ValueError(f"select_launch must be 'split' or 'fused', got {select_launch!r}")
    if num_stages is None:  # the Forecast's 64-row tiles pipeline 3 deep on the GPU (design §3.4)
        num_stages = 3 if query.is_cuda and not softmax and block_m * g_p <= 64 else 1
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive int, got {num_stages!r}")
    if topk_search is None:
        topk_search = "bracket" if select_launch == "split" and topk_rows in (None, 1) else "bisect"
    if topk_search not in ("bisect", "bracket"):
        raise ValueError(f"topk_search must be 'bisect' or 'bracket', got {topk_search!r}")
    bracket = topk_search == "bracket"
    if bracket and (select_launch != "split" or topk_rows not in (None, 1)):
        raise ValueError("topk_search='bracket' runs one row per program in the split launch: "
                         f"got select_launch={select_launch!r}, topk_rows={topk_rows!r}")
    if num_q == 0 or num_blocks == 0:
        mask = torch.zeros(bsz, heads, num_q, num_blocks, dtype=torch.bool, device=ck.device)
        return (mask, torch.zeros(mask.shape, device=ck.device)) if return_scores else mask
    # no memset: the select phase stores every [token < Tq, block < N] entry (33.5 MB a chunk
    # at 128K, MiniCPM-8B shape, written once instead of twice)
    mask = torch.empty(bsz, heads, num_q, num_blocks, dtype=torch.uint8, device=ck.device)
    scores = None
    if ck.stride(-1) != 1:
        ck = ck.contiguous()
    if query.stride(-1) != 1:
        query = query.contiguous()
    q_pos = q_pos.contiguous()
    r = cfg.block_size // cfg.kernel_stride
    pad = -(-cfg.kernel_size // cfg.kernel_stride) - 1
    n_p = next_pow2(max(num_blocks, 2))
    rs = max(1, min(block_m, 8192 // n_p))
    rs = 1 << (rs.bit_length() - 1)  # power of two dividing block_m
    fused = select_launch == "fused"
    if topk_rows is None:
        topk_rows = 1 if bracket else max(1, min(8, 2048 // n_p))
    if isinstance(topk_rows, bool) or not isinstance(topk_rows, int) or topk_rows < 1 or topk_rows & (topk_rows - 1):
        raise ValueError(f"topk_rows must be a power of two, got {topk_rows}")
    if topk_warps is None:
        # bracket: 2 warps at N_P >= 2,048 (design §3.4), else 1;
        # bisection: a lane holds <= 64 scores
        topk_warps = (2 if n_p >= 2048 else 1) if bracket else max(1, min(8, topk_rows * n_p // 2048))
    if isinstance(topk_warps, bool) or not isinstance(topk_warps, int) or topk_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"topk_warps must be a power of two from 1 to 32, got {topk_warps!r}")
    nb = 64 if query.is_cuda else 16
    sub = num_q if return_scores else max(block_m, _SCRATCH_ELEMS // max(1, bsz * heads * num_blocks)
                                          // block_m * block_m)
    scratch = torch.empty(bsz, heads, min(sub, num_q), num_blocks, device=ck.device, dtype=torch.float32)
    ieee = query.dtype == torch.float32 or not query.is_cuda  # interpreter: no bf16 dot
    if softmax:
        sq = query.stride()
        q_strides = (sq[0], sq[1], sq[2], sq[3])
    else:
        sq = query.stride()
        q_strides = (sq[0], sq[1], 0, sq[2])
    for s0 in range(0, num_q, sub):
        s1 = min(num_q, s0 + sub)
        q_sub = query[..., s0:s1, :]
        pos_sub = q_pos[:, s0:s1]
        m_sub = mask[:, :, s0:s1]
        _prefill_select_kernel[(-(-(s1 - s0) // block_m), bsz * heads)](
            q_sub, ck, pos_sub, scratch, m_sub,
            *q_strides, ck.stride(0), ck.stride(1), ck.stride(2), pos_sub.stride(0),
            scratch.stride(0), scratch.stride(1), scratch.stride(2),
            m_sub.stride(0), m_sub.stride(1), m_sub.stride(2),
            heads, s1 - s0, num_ck, num_blocks, _LOG2E / math.sqrt(d), 1 if lookahead else 0,
            G=groups, G_P=g_p, BM=block_m, D=d, KER=cfg.kernel_size, STR=cfg.kernel_stride,
            BS=cfg.block_size, R=r, PAD=pad, NB=nb, CK_T=64 if query.is_cuda else 16,
            INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, TOPK=cfg.topk_blocks, BUDGET=cfg.budget_blocks,
            DENSE_LEN=cfg.dense_len, N_P=n_p, RS=rs, SOFTMAX=softmax, IEEE=ieee, FUSED_SELECT=fused,
            num_warps=num_warps or (8 if query.is_cuda and not softmax and block_m >= 128 else 4),
            num_stages=num_stages)  # default above: 3 for the Forecast's 64-row GPU tiles, else 1
        if not fused:  # the rule as its own launch, one of the two searches
            kernel, extra = ((_prefill_topk_bracket_kernel,
                              {"maxnreg": _BRACKET_MAXNREG} if query.is_cuda and _BRACKET_MAXNREG else {})
                             if bracket else (_prefill_topk_kernel, {"RS": topk_rows}))
            kernel[(-(-(s1 - s0) // topk_rows), bsz * heads)](
                scratch, m_sub, pos_sub, pos_sub.stride(0),
                scratch.stride(0), scratch.stride(1), scratch.stride(2),
                m_sub.stride(0), m_sub.stride(1), m_sub.stride(2),
                heads, s1 - s0, num_blocks, BS=cfg.block_size, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks,
                TOPK=cfg.topk_blocks, BUDGET=cfg.budget_blocks, DENSE_LEN=cfg.dense_len, N_P=n_p,
                num_warps=topk_warps, **extra)
    if return_scores:
        scores = scratch
        return mask.view(torch.bool), scores
    return mask.view(torch.bool)
