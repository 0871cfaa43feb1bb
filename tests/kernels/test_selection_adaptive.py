"""Mass-adaptive decode selection (design §3.12): the twin and the Triton kernel against a
float64 brute force on fresh random scores, budgets, thresholds and causal lengths."""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch

pytest.importorskip("triton")

from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import reference, twins  # noqa: E402
from sparda.kernels.selection import select_decode_blocks_triton, select_from_scores_triton  # noqa: E402

#: a boundary mass this close to ``p`` may fall either way in fp32 (sums of <= 100 masses)
NEAR = 1e-5
_FLT_MAX = 3.4028234663852886e38


def brute_topp(scores: list[float], t: int, cfg: SelectionConfig, logit_scale: float | None):
    """design §3.12 for one row in float64 Python: ``(sorted block ids, margin)``.

    Ranking as design §3.4: score descending, ties to the lower block, NaN/-inf as unscored
    (below every finite score), +inf first. Mass over the visible blocks, non-finite scores
    none: ``w = max(s, 0)`` (probabilities) or ``exp(c*s - max)`` (logits), ``mass = w / sum w``.
    A candidate is taken while the mass before it (forced blocks first) is ``< p`` (``p = 1``
    or a row without mass: every one), the count clamped to ``[min_scored, topk]``.
    ``margin``: the smallest ``|mass before a candidate - p|`` (how close rounding comes to
    flipping the count; ``inf`` under the dense fallback or ``p = 1``).
    """
    cur = t // cfg.block_size
    valid = list(range(cur + 1))
    if t + 1 < cfg.dense_len or cur + 1 <= cfg.budget_blocks:
        return valid, math.inf
    forced = [b for b in valid if b < cfg.init_blocks or b > cur - cfg.local_blocks]
    finite = {b: float(scores[b]) for b in valid if math.isfinite(scores[b])}
    if logit_scale is None:
        w = {b: max(s, 0.0) for b, s in finite.items()}
    else:
        top = max((logit_scale * s for s in finite.values()), default=0.0)
        w = {b: math.exp(logit_scale * s - top) for b, s in finite.items()}
    total = sum(w.values())
    mass = {b: (w.get(b, 0.0) / total if total > 0 else 0.0) for b in valid}

    def rank_value(b):
        s = scores[b]
        if math.isnan(s) or s == -math.inf:
            return -1e30
        return _FLT_MAX if s == math.inf else s

    rest = sorted((b for b in valid if b not in forced), key=lambda b: (-rank_value(b), b))
    p = cfg.topp_mass
    before, taken, margin = sum(mass[b] for b in forced), 0, math.inf
    for b in rest:
        if p < 1:
            margin = min(margin, abs(before - p))
        if before < p or p >= 1 or total == 0:
            taken += 1
        before += mass[b]
    count = min(max(taken, cfg.min_scored_blocks), cfg.topk_blocks, len(rest))
    return sorted(forced + rest[:count]), margin


def random_config(rng: random.Random) -> SelectionConfig:
    """A random budget and threshold: sinks 0-2, local window 2-5, top-k 1-12, a dense
    fallback length, ``p`` in (0, 1) or exactly 1, ``min_blocks`` unset or in range."""
    init, local, topk = rng.randint(0, 2), rng.randint(2, 5), rng.randint(1, 12)
    budget = init + local + topk
    p = 1.0 if rng.random() < 0.2 else 1.0 - rng.random()  # (0, 1]
    low = None if rng.random() < 0.3 else rng.randint(init + local, budget)
    return SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=init, local_blocks=local,
                           topk_blocks=topk, dense_len=rng.choice([0, 0, 100, 400]), topp_mass=p, min_blocks=low)


def random_scores(rng: random.Random, bsz: int, heads: int, num_blocks: int, logits: bool) -> torch.Tensor:
    """fp32 block scores: logits (normal, some rounded to ties) or probabilities (non-negative,
    ties and zeros, as pooled softmax mass); a few NaN and +-inf."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if logits:
        s = torch.randn(bsz, heads, num_blocks, generator=gen) * rng.choice([0.5, 3.0, 20.0])
    else:
        s = torch.rand(bsz, heads, num_blocks, generator=gen) ** 3 * 4
        s = torch.where(torch.rand(s.shape, generator=gen) < 0.2, 0.0, s)
    ties = torch.rand(s.shape, generator=gen) < 0.3
    s = torch.where(ties, (s * 2).round() / 2 + 0.0, s)  # + 0.0: no -0.0 (it ranks below +0.0)
    odd = torch.rand(s.shape, generator=gen)
    s = torch.where(odd < 0.02, float("nan"), s)
    s = torch.where((odd >= 0.02) & (odd < 0.04), float("-inf"), s)
    return torch.where((odd >= 0.04) & (odd < 0.045), float("inf"), s)


def _check_rows(mask: torch.Tensor, scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig,
                logit_scale: float | None, what: str) -> int:
    """Assert each row of ``mask [B, H, N]`` equals the brute force (a near-boundary row: its
    count within one); returns the rows checked exactly."""
    exact = 0
    for b in range(mask.shape[0]):
        for h in range(mask.shape[1]):
            want, margin = brute_topp(scores[b, h].tolist(), int(q_pos[b]), cfg, logit_scale)
            got = mask[b, h].nonzero().flatten().tolist()
            if margin < NEAR:
                assert abs(len(got) - len(want)) <= 1, (what, b, h)
                continue
            assert got == want, (what, b, h, cfg)
            exact += 1
    return exact


def _case(rng: random.Random):
    cfg = random_config(rng)
    bsz, heads, num_blocks = 3, 2, rng.randint(cfg.budget_blocks + 2, 70)
    # last block, somewhere selecting, and anywhere (dense fallback included)
    q_pos = torch.tensor([num_blocks * 16 - 1, rng.randrange((cfg.budget_blocks + 1) * 16, num_blocks * 16),
                          rng.randrange(num_blocks * 16)])
    logit_scale = rng.choice([None, 0.25, 1.0])
    scores = random_scores(rng, bsz, heads, num_blocks, logits=logit_scale is not None)
    return cfg, scores, q_pos, logit_scale


def test_twin_matches_float64_brute_force():
    rng = random.Random(torch.initial_seed())
    exact = 0
    for _ in range(60):
        cfg, scores, q_pos, scale = _case(rng)
        mask = reference.select_blocks(scores[:, :, None], q_pos[:, None], cfg, adaptive=True,
                                       logit_scale=scale)[:, :, 0]
        exact += _check_rows(mask, scores, q_pos, cfg, scale, "twin")
    assert exact >= 300  # near-boundary rows are rare


def test_triton_matches_float64_brute_force():
    rng = random.Random(torch.initial_seed())
    exact = 0
    for _ in range(25):
        cfg, scores, q_pos, scale = _case(rng)
        width = twins.default_width(scores.shape[-1], cfg)
        ids, mask = select_from_scores_triton(scores, q_pos, cfg, width, return_mask=True, adaptive=True,
                                              logit_scale=scale)
        exact += _check_rows(mask, scores, q_pos, cfg, scale, "triton")
        # fixed shape, -1 padded, ascending; the count lives in the ids on the device
        assert ids.shape == (*scores.shape[:2], width) and ids.dtype == torch.int32
        count = (ids >= 0).sum(-1)
        assert torch.equal(count, mask.sum(-1).clamp(max=width))
        assert torch.is_tensor(count) and count.device == scores.device
        for row, n in zip(ids.view(-1, width), count.view(-1).tolist()):
            assert torch.equal(row[n:], torch.full((width - n,), -1, dtype=torch.int32))
            assert torch.all(row[1:n] > row[:n - 1])
    assert exact >= 120


def test_p_one_takes_every_visible_block_up_to_topk():
    """``p = 1``, whatever ``min_blocks``: exactly today's fixed top-k, blocks of zero mass included."""
    rng = random.Random(torch.initial_seed())
    for _ in range(10):
        cfg, scores, q_pos, scale = _case(rng)
        one = dataclasses.replace(cfg, topp_mass=1.0)
        fixed = dataclasses.replace(cfg, topp_mass=None, min_blocks=None)
        want = reference.select_blocks(scores[:, :, None], q_pos[:, None], fixed)[:, :, 0]
        got = reference.select_blocks(scores[:, :, None], q_pos[:, None], one, adaptive=True,
                                      logit_scale=scale)[:, :, 0]
        assert torch.equal(got, want)
        ids, mask = select_from_scores_triton(scores, q_pos, one, None, True, adaptive=True, logit_scale=scale)
        assert torch.equal(mask, want)
        assert torch.equal(ids, select_from_scores_triton(scores, q_pos, fixed, None))


def test_unset_threshold_is_todays_selection():
    """``topp_mass`` unset: ``adaptive`` changes nothing, in the twin and the kernel."""
    rng = random.Random(torch.initial_seed())
    for _ in range(5):
        cfg, scores, q_pos, scale = _case(rng)
        fixed = dataclasses.replace(cfg, topp_mass=None, min_blocks=None)
        want = reference.select_blocks(scores[:, :, None], q_pos[:, None], fixed)
        assert torch.equal(reference.select_blocks(scores[:, :, None], q_pos[:, None], fixed, adaptive=True,
                                                   logit_scale=scale), want)
        ids, mask = select_from_scores_triton(scores, q_pos, fixed, None, True, adaptive=True, logit_scale=scale)
        assert torch.equal(mask, want[:, :, 0])
        assert torch.equal(ids, select_from_scores_triton(scores, q_pos, fixed, None))


@pytest.mark.parametrize("groups", [None, 4])  # None: Forecast logits at 1/sqrt(d); 4: group-summed softmax
def test_decode_selection_end_to_end(groups):
    """Score + pool + top-p: the kernel as the twin and as the brute force on the twin's
    block scores; the id width is that of ``max`` blocks whatever ``p``."""
    rng = random.Random(torch.initial_seed())
    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                          topk_blocks=8, dense_len=0, topp_mass=0.2 + 0.7 * rng.random(), min_blocks=4)
    bsz, heads, d, num_tokens = 3, 2, 32, 600
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    ck = torch.randn(bsz, heads, num_ck, d)
    query = torch.randn((bsz, heads, d) if groups is None else (bsz, heads, groups, d)) * 2
    q_pos = torch.tensor([num_tokens - 1, rng.randrange(200, num_tokens), rng.randrange(num_tokens)])
    num_blocks = -(-num_tokens // cfg.block_size)
    scale = twins.mass_logit_scale(query)
    assert scale == (1 / math.sqrt(d) if groups is None else None)
    ids, mask = select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg, return_mask=True)
    ref_ids, ref_mask = twins.select_decode_reference(query, ck, q_pos, num_blocks, cfg, return_mask=True)
    scores = twins.decode_block_scores_reference(query, ck, q_pos, num_blocks, cfg)
    _check_rows(ref_mask, scores, q_pos, cfg, scale, "twin")
    _check_rows(mask, scores, q_pos, cfg, scale, "triton")
    fixed = dataclasses.replace(cfg, topp_mass=None, min_blocks=None)
    assert ids.shape == ref_ids.shape == select_decode_blocks_triton(query, ck, q_pos, num_blocks, fixed).shape
    assert torch.all(mask.sum(-1) <= fixed.budget_blocks)


CUDA = pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                          reason="compiled Triton on CUDA (TRITON_INTERPRET=0 and a GPU)")


@CUDA
@pytest.mark.parametrize("groups", [None, 4])
def test_cuda_bf16_selection_and_graph_replay(groups):
    """On CUDA, bf16 queries and keys (the ``tl.dot`` path for groups): the rule on the kernel's
    own block scores equals the brute force, and a captured CUDA graph (no host sync) replays
    the adaptive selection of new inputs exactly as an eager call."""
    rng = random.Random(torch.initial_seed())
    dev = torch.device("cuda")
    for _ in range(10):
        cfg, scores, q_pos, scale = _case(rng)
        ids, mask = select_from_scores_triton(scores.to(dev), q_pos.to(dev), cfg, None, True, adaptive=True,
                                              logit_scale=scale)
        _check_rows(mask.cpu(), scores, q_pos, cfg, scale, "cuda rule")
    cfg = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                          topk_blocks=32, dense_len=0, topp_mass=0.5 + 0.4 * rng.random(), min_blocks=8)
    bsz, heads, d, num_tokens = 4, 8, 128, 32768
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    num_blocks = num_tokens // cfg.block_size
    shape = (bsz, heads, d) if groups is None else (bsz, heads, groups, d)
    query = torch.randn(shape, device=dev, dtype=torch.bfloat16)
    ck = torch.randn(bsz, heads, num_ck, d, device=dev, dtype=torch.bfloat16)
    q_pos = torch.tensor([num_tokens - 1, 20000, 9000, 300], device=dev)
    scale = twins.mass_logit_scale(query)
    from sparda.kernels.selection import decode_block_scores_triton

    scores = decode_block_scores_triton(query, ck, q_pos, num_blocks, cfg)
    ids, mask = select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg, return_mask=True)
    _check_rows(mask.cpu(), scores.cpu(), q_pos.cpu(), cfg, scale, "cuda end to end")
    select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg)
    query.copy_(torch.randn_like(query))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg))
    assert graphed.shape == ids.shape == (bsz, heads, twins.default_width(num_blocks, cfg))
