"""Triton prefill selection (scoring + pooling + rule per query token) against the reference.

The reference is ``twins.select_prefill_reference``: ``reference.query_group_scores`` /
``forecast_scores`` + ``pool_to_blocks`` + ``select_blocks``, the functions the CPU runtime
runs (``BlockSparseMethod.select``). Scores are compared with a tolerance; the masks
exactly, except on rows whose top-k boundary is a near tie in the reference's own scores
(another fp32 summation order may flip those); the kernel's rule is also checked
exactly against ``reference.select_blocks`` applied to the kernel's own scores.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.config import SelectionConfig  # noqa: E402
from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import reference, select_prefill_blocks, twins  # noqa: E402
from sparda.kernels.prefill_selection import select_prefill_blocks_triton  # noqa: E402

# The paper's ratios (k = 2s, B_s = 4s) at block 16, a tight budget and a dense fallback.
CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1,
                      local_blocks=2, topk_blocks=3, dense_len=40)
# Kernel 12 / stride 2 / block 8: a compressed key spans up to three blocks (pool halo 5 > r 4).
CFG_WIDE = SelectionConfig(block_size=8, kernel_size=12, kernel_stride=2, init_blocks=2,
                           local_blocks=3, topk_blocks=4, dense_len=0)
NEAR = 1e-4  # relative gap at the top-k boundary below which a row may flip


def _near_tie_rows(scores, q_pos, cfg):
    """``[B, H, Tq]`` bool: rows whose k-th and (k+1)-th candidate block scores (design §3.4)
    differ, by less than ``NEAR`` of the row's largest score. Exact ties stay in: they come
    from a compressed key that two adjacent blocks share, the same value in both pools,
    so both implementations see the tie and give it to the lower block."""
    num_blocks = scores.shape[-1]
    blocks = torch.arange(num_blocks).view(1, 1, 1, -1)
    cur = (q_pos // cfg.block_size)[:, None, :, None]
    forced = reference.forced_blocks(q_pos, num_blocks, cfg)
    cand = (blocks <= cur) & ~forced
    ranked = scores.nan_to_num(nan=-1e30, neginf=-1e30).masked_fill(~cand, float("-inf"))
    top = ranked.sort(-1, descending=True).values
    k = cfg.topk_blocks
    if top.shape[-1] <= k:
        return torch.zeros(scores.shape[:3], dtype=torch.bool)
    scale = top[..., :1].abs().clamp_min(1e-6)
    gap = (top[..., k - 1] - top[..., k]).abs() / scale[..., 0]
    return torch.isfinite(top[..., k]) & (gap > 0) & (gap < NEAR)


def _check(query, ck, q_pos, num_blocks, cfg, lookahead, block_m=None):
    mask, scores = select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg, lookahead=lookahead,
                                                block_m=block_m, return_scores=True)
    ref_mask, ref_scores = twins.select_prefill_reference(query, ck, q_pos, num_blocks, cfg,
                                                          lookahead=lookahead, return_scores=True)
    assert mask.dtype == torch.bool and mask.shape == ref_mask.shape
    valid = (torch.arange(num_blocks).view(1, 1, 1, -1) <= (q_pos // cfg.block_size)[:, None, :, None])
    valid = valid.expand(ref_scores.shape)
    finite = torch.isfinite(ref_scores) & valid
    assert torch.equal(torch.isfinite(scores) & valid, finite)
    assert torch.equal(scores[valid & ~finite], ref_scores[valid & ~finite])
    torch.testing.assert_close(scores[finite], ref_scores[finite], rtol=1e-5, atol=5e-5)
    # the rule, exactly, on the kernel's own scores (blocks past the query's are never read)
    assert torch.equal(mask, reference.select_blocks(scores.nan_to_num(0.0), q_pos, cfg))
    # against the reference end to end, except near ties of the reference's scores
    near = _near_tie_rows(ref_scores, q_pos, cfg)
    assert near.float().mean() < 0.05
    assert torch.equal(mask[~near], ref_mask[~near])
    return mask


@pytest.mark.parametrize("groups,lookahead", [(None, False), (None, True), (1, False), (3, False),
                                              (4, True), (16, False)])  # None: Forecast [B, H, Tq, d]
@pytest.mark.parametrize("cfg", [CFG, CFG_WIDE], ids=["paper-ratio", "wide-kernel"])
def test_prefill_selection_matches_reference(groups, lookahead, cfg):
    bsz, heads, d = 2, 2, 32
    num_tokens = int(torch.randint(130, 160, ()))  # not a multiple of the block size (mostly)
    num_q = 24 if groups == 16 else 50  # G = 16 is 16 rows per token under the interpreter
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    ck = torch.randn(bsz, heads, num_ck, d)
    shape = (bsz, heads, num_q, d) if groups is None else (bsz, heads, groups, num_q, d)
    query = torch.randn(shape) * 2
    # row 0: the prompt's last tokens; row 1: a chunk from position 5 (dense-fallback prefix,
    # tokens before the first complete window)
    start = int(torch.randint(0, 8, ()))
    q_pos = torch.stack([torch.arange(num_tokens - num_q, num_tokens), torch.arange(start, start + num_q)])
    num_blocks = -(-num_tokens // cfg.block_size)
    mask = _check(query, ck, q_pos, num_blocks, cfg, lookahead)
    assert (mask.sum(-1) < (q_pos // cfg.block_size + 1)[:, None]).any()  # selection dropped blocks


def test_ties_go_to_the_lower_block():
    """Integer queries and keys: raw dot products are exact and tie often (Forecast), so
    the kernel and the reference must agree bit for bit, ties to the lower block index
    (both top-k searches: ``bracket``'s tie pass runs on these rows)."""
    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                          topk_blocks=4, dense_len=0)
    bsz, heads, d, num_tokens, num_q = 2, 3, 16, 200, 40
    ck = torch.randint(-1, 2, (bsz, heads, reference.num_compressed(num_tokens, 8, 4), d)).float()
    f = torch.randint(-1, 2, (bsz, heads, num_q, d)).float()
    q_pos = torch.stack([torch.arange(num_tokens - num_q, num_tokens), torch.arange(100, 100 + num_q)])
    want = twins.select_prefill_reference(f, ck, q_pos, 13, cfg, lookahead=True)
    for search in ("bisect", "bracket"):
        mask = select_prefill_blocks_triton(f, ck, q_pos, 13, cfg, lookahead=True, topk_search=search)
        assert torch.equal(mask, want), search


def test_sub_launches_and_block_m():
    """Query ranges cut into several launches (scratch bound) and other tile heights give
    the same masks as one launch."""
    import sparda.kernels.prefill_selection as ps

    bsz, heads, d, num_tokens, num_q = 1, 2, 16, 140, 45
    ck = torch.randn(bsz, heads, reference.num_compressed(num_tokens, 8, 4), d)
    q = torch.randn(bsz, heads, 2, num_q, d) * 2
    q_pos = torch.arange(num_tokens - num_q, num_tokens).view(1, -1)
    whole = select_prefill_blocks_triton(q, ck, q_pos, 9, CFG)
    old = ps._SCRATCH_ELEMS
    try:
        ps._SCRATCH_ELEMS = bsz * heads * 9 * 16  # 16 query rows per launch
        cut = select_prefill_blocks_triton(q, ck, q_pos, 9, CFG, block_m=8)
    finally:
        ps._SCRATCH_ELEMS = old
    assert torch.equal(cut, whole)
    _check(q, ck, q_pos, 9, CFG, False, block_m=2)


@pytest.mark.parametrize("groups", [None, 4])
def test_select_launches_agree(groups):
    """The rule as its own launch (default ``split``, several rows-per-program and warp
    counts, both top-k searches) gives the mask of the rule run inside the scoring program
    (``fused``), and both equal the reference rule on the kernel's scores; lengths not
    multiples of the block."""
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    bsz, heads, d = 2, 2, 16
    num_tokens = int(torch.randint(150, 200, (), generator=gen))
    num_q = 30
    num_blocks = -(-num_tokens // CFG.block_size)
    ck = torch.randn(bsz, heads, reference.num_compressed(num_tokens, 8, 4), d, generator=gen)
    shape = (bsz, heads, num_q, d) if groups is None else (bsz, heads, groups, num_q, d)
    q = torch.randn(shape, generator=gen)
    q_pos = torch.stack([torch.arange(num_tokens - num_q, num_tokens), torch.arange(60, 60 + num_q)])
    fused, scores = select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, lookahead=groups is None,
                                                 select_launch="fused", return_scores=True)
    assert torch.equal(fused, reference.select_blocks(scores.nan_to_num(0.0), q_pos, CFG)), f"seed {seed}"
    # the default (bracket, one row per program), the bisection at 1, 4 and 8 rows per program
    for rows, warps, search in ((None, None, None), (1, 1, "bisect"), (4, 2, None), (8, 1, None)):
        split = select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, lookahead=groups is None,
                                             topk_rows=rows, topk_warps=warps, topk_search=search)
        assert torch.equal(split, fused), f"seed {seed}, topk_rows {rows}, topk_warps {warps}, {search}"
    for warps in (2,):
        bracket = select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, lookahead=groups is None,
                                               topk_search="bracket", topk_warps=warps)
        assert torch.equal(bracket, fused), f"seed {seed}, bracket, topk_warps {warps}"
    with pytest.raises(ValueError, match="select_launch"):
        select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, select_launch="other")
    with pytest.raises(ValueError, match="num_stages"):
        select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, num_stages=0)
    with pytest.raises(ValueError, match="topk_search"):
        select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, topk_search="radix")
    with pytest.raises(ValueError, match="one row per program"):
        select_prefill_blocks_triton(q, ck, q_pos, num_blocks, CFG, topk_search="bracket", topk_rows=2)


def test_bf16_inputs():
    ck = torch.randn(1, 2, 30, 32).bfloat16()
    f = torch.randn(1, 2, 20, 32).bfloat16()
    q_pos = torch.arange(110, 130).view(1, -1)
    mask, scores = select_prefill_blocks_triton(f, ck, q_pos, 9, CFG, return_scores=True)
    _, ref = twins.select_prefill_reference(f, ck, q_pos, 9, CFG, return_scores=True)
    valid = (torch.arange(9).view(1, 1, 1, -1) <= (q_pos // 16)[:, None, :, None]) & torch.isfinite(ref)
    torch.testing.assert_close(scores[valid], ref[valid], rtol=1e-5, atol=5e-5)
    assert torch.equal(mask, reference.select_blocks(scores.nan_to_num(0.0), q_pos, CFG))


def _brute_prefill_row(query, ck, t, cfg, lookahead):
    """design §3.2-3.4 for one head and one prefill token in float64 loops: sorted block ids."""
    import math

    k, s, bs = cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    seen = t - 1 if lookahead else t
    visible = [j for j in range(ck.shape[0]) if j * s + k - 1 <= seen]
    q = query.double().view(-1, query.shape[-1])
    per_key = {j: 0.0 for j in range(ck.shape[0])}
    if query.dim() == 1:
        per_key = {j: (float(q[0] @ ck[j].double()) if j in visible else -math.inf) for j in range(ck.shape[0])}
    else:
        for g in range(q.shape[0]):
            logits = {j: float(q[g] @ ck[j].double()) / math.sqrt(q.shape[1]) for j in visible}
            top = max(logits.values(), default=0.0)
            z = sum(math.exp(x - top) for x in logits.values())
            for j, x in logits.items():
                per_key[j] += math.exp(x - top) / z
    cur = t // bs
    if t + 1 < cfg.dense_len or cur + 1 <= cfg.budget_blocks:
        return list(range(cur + 1)), False
    block = {}
    for b in range(cur + 1):
        over = [per_key[j] for j in per_key if j * s < (b + 1) * bs and j * s + k > b * bs]
        block[b] = max(over) if over and max(over) > -math.inf else -1e30
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    rest = sorted((b for b in block if b not in forced), key=lambda b: (-block[b], b))
    kk = cfg.topk_blocks
    near = len(rest) > kk and abs(block[rest[kk - 1]] - block[rest[kk]]) < 1e-5
    return sorted(forced | set(rest[:kk])), near


def test_cpu_dispatch_matches_brute_force_and_errors():
    """CPU tensors take the PyTorch twin: checked against independent float64 loops."""
    d, num_tokens, num_q = 16, 120, 30
    ck = torch.randn(1, 2, reference.num_compressed(num_tokens, 8, 4), d)
    q_pos = torch.arange(num_tokens - num_q, num_tokens).view(1, -1)
    for query, lookahead in ((torch.randn(1, 2, num_q, d) * 2, True), (torch.randn(1, 2, 3, num_q, d) * 2, False)):
        mask = select_prefill_blocks(query, ck, q_pos, 8, CFG, lookahead=lookahead)
        for h in range(2):
            for i in range(num_q):
                qi = query[0, h, i] if query.dim() == 4 else query[0, h, :, i]
                want, near = _brute_prefill_row(qi, ck[0, h], int(q_pos[0, i]), CFG, lookahead)
                if not near:
                    assert mask[0, h, i].nonzero().flatten().tolist() == want
    with pytest.raises(SpardaError, match="q_pos"):
        select_prefill_blocks_triton(torch.randn(1, 2, 5, 16), ck, q_pos, 8, CFG)
    with pytest.raises(SpardaError, match="ck must be"):
        select_prefill_blocks_triton(torch.randn(1, 3, num_q, 16), ck, q_pos, 8, CFG)
    with pytest.raises(SpardaError, match="head dim"):
        select_prefill_blocks_triton(torch.randn(1, 2, num_q, 24), torch.randn(1, 2, 5, 24), q_pos, 8, CFG)


def test_methods_prefill_through_the_kernel(make_tiny, monkeypatch):
    """The CUDA branch of ``sparse`` and ``sparda`` prefill (``fused_prefill_selection``),
    run here through the Triton kernel under the interpreter, chunked (64 tokens), gives
    the logits of the CPU path (the chunked reference of ``BlockSparseMethod.select``)."""
    import sparda.attention.blocksparse as blocksparse
    import sparda.attention.forecast as forecast
    import sparda.kernels as kernels
    from sparda.engine.llm import LLM

    small = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
                 topk_blocks=3)
    tiny = make_tiny("llama")
    ids = torch.randint(100, 20000, (int(torch.randint(130, 145, ())),)).tolist()
    calls = []

    def through_kernel(*args, **kwargs):
        calls.append(args[0].dim())
        return select_prefill_blocks_triton(*args, **kwargs)

    for method in ("sparse", "sparda-random"):
        llm = LLM(str(tiny), method=method, device="cpu", sparse_prefill=True, prefill_chunk_tokens=64, **small)
        want = llm.logits(ids)
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "select_prefill_blocks", through_kernel)
            for module in (blocksparse, forecast):
                patch.setattr(module, "fused_prefill_selection", lambda t: True)
            got = llm.logits(ids)
        assert ((got - want).norm() / want.norm()).item() < 2e-5, method
    layers = llm.shape.num_layers
    assert calls == [5] * (2 * layers) + [4] * (2 * layers)  # chunks 2 and 3 select (chunk 1 is dense)


@pytest.mark.parametrize("mode", ["mixed", "all-equal", "all-inf", "all-nan", "all-neg-inf"])
def test_top_k_keys_at_the_edges_of_float32(mode):
    """The top-k search on order-preserving int32 keys (ties, +-inf, NaN, +-FLT_MAX,
    denormals, -1e30, top-k 0 ... larger than the candidates) selects what the reference
    rule selects (Forecast scores = one compressed-key coordinate)."""
    edge = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.4028234663852886e38, -3.4028234663852886e38,
                         1e-45, -1e-45, 0.0, -0.0, 1.0, 1.0, -1e30, 2.0, -2.0, 1e30, -1.0])
    bsz, heads, d, num_keys, num_q = 1, 2, 16, 16 * 30, 32
    num_ck = reference.num_compressed(num_keys, 16, 16)
    for topk in (0, 1, 3, 7, 40):
        cfg = SelectionConfig(block_size=16, kernel_size=16, kernel_stride=16, init_blocks=1, local_blocks=1,
                              topk_blocks=topk, dense_len=0)
        if mode == "mixed":
            v = edge[torch.randint(0, len(edge), (bsz, heads, num_ck))]
        else:
            v = torch.full((bsz, heads, num_ck), {"all-equal": 0.5, "all-inf": float("inf"), "all-nan": float("nan"),
                                                  "all-neg-inf": float("-inf")}[mode])
        ck = torch.zeros(bsz, heads, num_ck, d)
        ck[..., 0] = v
        q = torch.zeros(bsz, heads, num_q, d)
        q[..., 0] = 1.0
        q_pos = torch.arange(num_keys - num_q, num_keys).view(1, -1)
        num_blocks = -(-num_keys // 16)
        want = twins.select_prefill_reference(q, ck, q_pos, num_blocks, cfg)
        for search in ("bisect", "bracket"):
            got = select_prefill_blocks_triton(q, ck, q_pos, num_blocks, cfg, topk_search=search)
            assert torch.equal(got, want), (mode, topk, search, (got != want).nonzero()[:5].tolist())


# ---- the Forecast's prefill path end to end (ForecastAttention.before_layer + select)

PATH_CFG = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
                topk_blocks=3)  # budget 6 blocks: queries < 96 fall under the dense fallback


def _forecast_llm(offload: bool, chunk: int):
    """``sparda`` (random-weight tiny Llama: 3 layers, 4 Q / 2 KV heads, d 16, fp32; a
    Forecast seeded from the test's seed) on the CPU, chunked prefill of ``chunk`` tokens."""
    from transformers import LlamaConfig

    from sparda.attention.forecast import Forecast
    from sparda.engine.llm import LLM
    from sparda.model.llama import CausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=1024, rms_norm_eps=1e-5)
    model = CausalLM(config).eval().requires_grad_(False)
    return LLM.from_model(model, None, method="sparda", preset="small", offload=offload, prefill_chunk_tokens=chunk,
                          forecast=Forecast.seeded(model.shape, torch.initial_seed() % 2**31), **PATH_CFG)


def _fused_branch(monkeypatch):
    """Make ``sparse``/``sparda`` prefill take their CUDA branch (the Triton kernel, here
    under the interpreter)."""
    import sparda.attention.blocksparse as blocksparse
    import sparda.attention.forecast as forecast
    import sparda.kernels as kernels

    monkeypatch.setattr(kernels, "select_prefill_blocks", select_prefill_blocks_triton)
    for module in (blocksparse, forecast):
        monkeypatch.setattr(module, "fused_prefill_selection", lambda t: True)


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "device"])
def test_forecast_prefill_path_selects_the_reference_blocks(offload, monkeypatch):
    """Every layer and chunk of a chunked ``sparda`` prefill (prompt and chunk lengths not
    multiples of the block size, a chunk that starts inside the dense-fallback prefix):
    the block mask of the fused path (:meth:`ForecastAttention.select`, Triton kernel) equals
    the CPU runtime's reference (``BlockSparseMethod.select``: ``forecast_scores`` +
    ``pool_to_blocks`` + ``select_blocks``) on the same stored Forecast queries and
    compressed keys, except rows whose top-k boundary is a near tie of the reference scores."""
    from sparda.attention.base import BlockSparseMethod

    _fused_branch(monkeypatch)
    cfg = SelectionConfig(**PATH_CFG)
    num_tokens = int(torch.randint(0, 4, ())) * 16 + int(torch.randint(1, 16, ())) + 150  # mid-block end
    ids = torch.randint(0, 300, (num_tokens,)).tolist()
    for chunk in (41, 64):
        llm = _forecast_llm(offload, chunk)
        method, fused = llm.method, llm.method.select
        seen = []

        def checked(layer, q, h, cache, step, first=0):
            k, _, ck = cache.view(layer, step.rows, step.max_kv_len)
            num_blocks = -(-step.max_kv_len // cfg.block_size)
            scores = method.block_scores(layer, q, h, cache, step, k, ck, slice(first, None))[..., :num_blocks]
            want = BlockSparseMethod.select(method, layer, q, h, cache, step, first)  # keeps the queries
            got = fused(layer, q, h, cache, step, first)  # the fused branch: pops them
            q_pos = step.q_pos[:, first:]
            near = _near_tie_rows(scores, q_pos, cfg)
            assert got.shape == want.shape and got.dtype == torch.bool
            bad = (got != want).any(-1) & ~near
            assert not bad.any(), (f"layer {layer}, chunk end {step.max_kv_len}, first {first}: block lists differ "
                                   f"at (b, h, t) {bad.nonzero()[:4].tolist()}")
            seen.append((layer, step.max_kv_len, first, float(near.float().mean()),
                         bool((got.sum(-1) < (q_pos // cfg.block_size + 1)[:, None]).any())))
            return got

        monkeypatch.setattr(method, "select", checked)
        llm.prefill(llm.new_cache(1, num_tokens + 8), 0, ids)
        ends = sorted({end for _, end, *_ in seen})
        starts = [end - chunk for end in ends]
        assert len(seen) == llm.shape.num_layers * len(ends) and ends[-1] == num_tokens, seen
        assert any(f > 0 for _, _, f, _, _ in seen), "no chunk started inside the dense-fallback prefix"
        assert any(s % cfg.block_size for s in starts[:-1]) or chunk % cfg.block_size == 0
        assert all(near < 0.05 for *_, near, _ in seen), seen
        assert all(dropped for *_, dropped in seen[-llm.shape.num_layers:]), "selection kept every block"


_SYNC_OPS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.is_nonzero", "aten.equal",
             "aten.allclose", "aten._assert_async")


def _prefill_ops(llm, ids, monkeypatch):
    """``[(layer, chunk end, hook, op, [(shape, dtype)...])]``: every op that allocates, writes or
    syncs (views and no-op casts left out) issued inside ``before_layer`` and ``select`` of
    each layer and chunk (a dispatch mode around each call), plus each launch of the
    selection kernel as op ``"kernel"``."""
    import sparda.kernels.prefill_selection as ps
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    log, where = [], []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket)
            inputs = {t.untyped_storage().data_ptr() for t in (*args, *(kwargs or {}).values())
                      if isinstance(t, torch.Tensor)}
            outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
            fresh = [o for o in outs if o.untyped_storage().data_ptr() not in inputs]
            writes = any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)
            if fresh or writes or name in _SYNC_OPS:
                log.append((*where[-1], name, [(tuple(o.shape), o.dtype) for o in (fresh or outs)]))
            return out

    class Launch:  # the interpreter runs the kernel outside the mode (its NumPy views are no ops)
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def run(*args, **kwargs):
                log.append((*where[-1], self.name, [grid]))
                with _disable_current_modes():
                    return self.kernel[grid](*args, **kwargs)
            return run

    monkeypatch.setattr(ps, "_prefill_select_kernel", Launch(ps._prefill_select_kernel, "kernel"))
    monkeypatch.setattr(ps, "_prefill_topk_kernel", Launch(ps._prefill_topk_kernel, "topk"))
    monkeypatch.setattr(ps, "_prefill_topk_bracket_kernel", Launch(ps._prefill_topk_bracket_kernel, "topk"))
    method = llm.method
    for hook in ("before_layer", "select"):
        def traced(layer, q, h, cache, step, *rest, _fn=getattr(method, hook), _hook=hook):
            where.append((layer, step.max_kv_len, _hook))
            try:
                with Ops():
                    return _fn(layer, q, h, cache, step, *rest)
            finally:
                where.pop()
        monkeypatch.setattr(method, hook, traced)
    llm.prefill(llm.new_cache(1, len(ids) + 8), 0, ids)
    return log


@pytest.mark.parametrize("offload", [True, False], ids=["offloaded", "device"])
def test_forecast_prefill_ops_per_chunk(offload, monkeypatch):
    """The ops the Forecast's prefill selection issues per layer and chunk, exactly (a
    regression guard): the projection and its RoPE of the chunk's tokens in the model dtype
    (``before_layer``; layer 0 also projects ``W^C_0``), the compressed keys of the row
    (a gather on the offloaded cache, a view on the device), the mask and score scratch
    allocated *empty* (no memset), the scoring launch and the top-k launch; no host sync, no copy, no upcast,
    nothing of the whole prompt's length but the compressed keys."""
    _fused_branch(monkeypatch)
    monkeypatch.setattr(torch, "empty", torch._C._VariableFunctions.empty)  # unpoisoned: no fill ops
    cfg = SelectionConfig(**PATH_CFG)
    chunk = 48
    num_tokens = 3 * chunk + int(torch.randint(1, chunk, ()))
    llm = _forecast_llm(offload, chunk)
    log = _prefill_ops(llm, torch.randint(0, 300, (num_tokens,)).tolist(), monkeypatch)
    s, f32 = llm.shape, torch.float32
    heads, d = s.num_kv_heads, s.head_dim
    want = []
    for end in range(chunk, num_tokens + chunk, chunk):
        end = min(end, num_tokens)
        tq = end - (end - 1) // chunk * chunk
        first = llm.method.dense_prefix(type("S", (), {"phase": "prefill", "max_kv_len": end,
                                                       "q_pos": torch.zeros(1, tq)})())
        if end - 1 < max(cfg.dense_len - 1, cfg.budget_blocks * cfg.block_size):
            continue  # every query under the dense fallback: no Forecast, no selection
        n, c = -(-end // cfg.block_size), reference.num_compressed(end, cfg.kernel_size, cfg.kernel_stride)
        rows = 1  # the default top-k search (bracket) runs one row per program
        rope = [("aten.linear", [((1, tq, heads * d), f32)]), ("aten.neg", [((1, heads, tq, d // 2), f32)]),
                ("aten.cat", [((1, heads, tq, d), f32)])] + [(op, [((1, heads, tq, d), f32)])
                                                              for op in ("aten.mul", "aten.mul", "aten.add")]
        for layer in range(s.num_layers):
            projections = (layer == 0) + (layer + 1 < s.num_layers)
            want += [(layer, end, "before_layer", *op) for op in rope * projections]
            gather = [(layer, end, "select", "aten.index", [((1, heads, c, d), f32)])] if offload else []
            want += gather + [(layer, end, "select", "aten.empty", [((1, heads, tq - first, n), torch.uint8)]),
                              (layer, end, "select", "aten.empty", [((1, heads, tq - first, n), f32)]),
                              (layer, end, "select", "kernel", [(-(-(tq - first) // 64), heads)]),
                              (layer, end, "select", "topk", [(-(-(tq - first) // rows), heads)])]
    assert [e for e in log if e[3] in _SYNC_OPS] == []
    assert len({e[1] for e in want}) >= 2  # at least two selecting chunks
    assert log == want, next(((i, a, b) for i, (a, b) in enumerate(zip(log, want)) if a != b), (len(log), len(want)))


def test_bracket_top_k_at_positions_past_int32():
    """The bracket search reads positions as int64, like the rule and the bisection: query
    positions near and past 2^31 select what ``reference.select_blocks`` selects (the top-k
    launch on given block scores, N = 8)."""
    import sparda.kernels.prefill_selection as ps

    cfg = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=2,
                          topk_blocks=2, dense_len=2048)
    n = 8
    scores = torch.randn(1, 1, 3, n)
    q_pos = torch.tensor([[2**31 - 1, 2**31 + 100, 2**32 + 64 * 5]])
    mask = torch.full((1, 1, 3, n), 7, dtype=torch.uint8)
    ps._prefill_topk_bracket_kernel[(3, 1)](
        scores, mask, q_pos, q_pos.stride(0), scores.stride(0), scores.stride(1), scores.stride(2),
        mask.stride(0), mask.stride(1), mask.stride(2), 1, 3, n, BS=64, INIT=1, LOCAL=2, TOPK=2,
        BUDGET=cfg.budget_blocks, DENSE_LEN=cfg.dense_len, N_P=n, num_warps=1)
    assert torch.equal(mask.bool(), reference.select_blocks(scores, q_pos, cfg))
