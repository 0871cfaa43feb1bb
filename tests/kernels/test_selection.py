"""Triton decode selection (scoring + pooling + rule) against the reference."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from sparda.config import SelectionConfig  # noqa: E402
from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import reference, select_decode_blocks, twins  # noqa: E402
from sparda.kernels.selection import (  # noqa: E402
    decode_block_scores_triton, select_decode_blocks_triton, select_from_scores_triton)

# Small geometry with the paper's ratios (k = 2s, B_s = 4s) and a tight budget.
CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1,
                      local_blocks=2, topk_blocks=3, dense_len=40)
# Kernel 12 / stride 2 / block 8: a compressed key spans up to three blocks.
CFG_WIDE = SelectionConfig(block_size=8, kernel_size=12, kernel_stride=2, init_blocks=2,
                           local_blocks=3, topk_blocks=4, dense_len=0)


def _check_scores(out, ref):
    finite = torch.isfinite(ref)
    assert torch.equal(finite, torch.isfinite(out))
    assert torch.equal(out[~finite], ref[~finite])
    # fp32 dot products of d <= 32 terms with |q_i k_i| summing to ~50: another summation
    # order moves a result by a few ulps of that sum (seen: 2.1e-6 on a score of 0.08)
    torch.testing.assert_close(out[finite], ref[finite], rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("groups", [None, 1, 3, 4, 8, 16])  # None: Forecast [B, H, d]
@pytest.mark.parametrize("cfg", [CFG, CFG_WIDE], ids=["paper-ratio", "wide-kernel"])
def test_scores_and_selection_match_reference(groups, cfg):
    bsz, heads, d, num_tokens = 4, 2, 32, 277
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    ck = torch.randn(bsz, heads, num_ck, d)
    shape = (bsz, heads, d) if groups is None else (bsz, heads, groups, d)
    query = torch.randn(shape) * 2
    # ragged batch: last token, mid-block, before the first complete window, first token
    q_pos = torch.tensor([276, 131, cfg.kernel_size - 2, 0])
    num_blocks = -(-num_tokens // cfg.block_size)
    _check_scores(decode_block_scores_triton(query, ck, q_pos, num_blocks, cfg),
                  twins.decode_block_scores_reference(query, ck, q_pos, num_blocks, cfg))
    ids, mask = select_decode_blocks_triton(query, ck, q_pos, num_blocks, cfg, return_mask=True)
    ref_ids, ref_mask = twins.select_decode_reference(query, ck, q_pos, num_blocks, cfg, return_mask=True)
    assert torch.equal(mask, ref_mask)
    assert torch.equal(ids, ref_ids)
    assert ids.dtype == torch.int32


def test_ck_len_cuts_compressed_keys():
    """A Forecast scoring keys before this step's window was appended (design §4)."""
    bsz, heads, d = 3, 2, 16
    ck = torch.randn(bsz, heads, 60, d)  # preallocated buffer, tail is junk
    q_pos = torch.tensor([200, 99, 47])
    ck_len = torch.tensor([48, 23, 10])
    for query in (torch.randn(bsz, heads, d), torch.randn(bsz, heads, 4, d)):
        _check_scores(decode_block_scores_triton(query, ck, q_pos, 14, CFG, ck_len),
                      twins.decode_block_scores_reference(query, ck, q_pos, 14, CFG, ck_len))
        ids = select_decode_blocks_triton(query, ck, q_pos, 14, CFG, ck_len=ck_len)
        assert torch.equal(ids, twins.select_decode_reference(query, ck, q_pos, 14, CFG, ck_len=ck_len))


def test_budget_larger_than_context_selects_every_valid_block():
    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1,
                          local_blocks=4, topk_blocks=30, dense_len=0)
    query, ck = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 20, 16)
    q_pos = torch.tensor([83, 30])
    ids = select_decode_blocks_triton(query, ck, q_pos, 6, cfg)
    assert ids.shape == (2, 3, 6)
    assert torch.equal(ids[0], torch.arange(6, dtype=torch.int32).expand(3, 6))
    assert torch.equal(ids[1], torch.tensor([0, 1, -1, -1, -1, -1], dtype=torch.int32).expand(3, 6))


def test_rule_with_ties_and_non_finite_scores():
    """Exact top-k: ties go to the lower block, NaN/-inf rank as unscored, +inf first,
    -0.0 just below +0.0 (as ``reference._rank_key``)."""
    bsz, heads, num_blocks = 5, 3, 37
    scores = torch.randint(-3, 4, (bsz, heads, num_blocks)).float()  # many ties
    scores[0, 0, 5] = float("nan")
    scores[0, 1, 3:9] = float("-inf")
    scores[1, 2, 7] = float("inf")
    scores[2, 0, :] = -0.0
    scores[2, 0, 10:20] = 0.0
    q_pos = torch.tensor([36 * 16 + 3, 300, 500, 15, 60])
    for cfg in (CFG, CFG_WIDE, SelectionConfig(block_size=16, topk_blocks=0, dense_len=0, local_blocks=2)):
        for width in (None, 4, 60):
            ids, mask = select_from_scores_triton(scores, q_pos, cfg, width, return_mask=True)
            ref_mask = reference.select_blocks(scores[:, :, None], q_pos[:, None], cfg)[:, :, 0]
            assert torch.equal(mask, ref_mask)
            ref_ids = reference.block_mask_to_indices(ref_mask, twins.default_width(num_blocks, cfg)
                                                      if width is None else width)
            assert torch.equal(ids, ref_ids.to(torch.int32))


def test_bf16_inputs():
    query = torch.randn(2, 2, 4, 32).bfloat16()
    ck = torch.randn(2, 2, 30, 32).bfloat16()
    q_pos = torch.tensor([130, 70])
    _check_scores(decode_block_scores_triton(query, ck, q_pos, 9, CFG),
                  twins.decode_block_scores_reference(query, ck, q_pos, 9, CFG))


def _brute_decode_selection(query, ck, t, cfg, num_ck):
    """design §3.2-3.4 for one head and one decode token, float64 Python loops.

    ``query [d]`` (Forecast: raw dot products) or ``[G, d]`` (softmax per query head over
    the visible keys of ``q . ck / sqrt(d)``, summed); ``ck [C, d]``, only the first ``num_ck`` exist. Returns the
    sorted selected block ids and whether the top-k was decided by a near tie."""
    k, s, bs = cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    visible = [j for j in range(num_ck) if j * s + k - 1 <= t]
    q = query.double().view(-1, query.shape[-1])
    per_key = {j: 0.0 for j in visible}
    for g in range(q.shape[0]):
        logits = [float(q[g] @ ck[j].double()) for j in visible]
        if query.dim() == 1:
            per_key = dict(zip(visible, logits))
            break
        logits = [x / math.sqrt(q.shape[1]) for x in logits]
        top = max(logits, default=0.0)
        z = sum(math.exp(x - top) for x in logits)
        for j, x in zip(visible, logits):
            per_key[j] += math.exp(x - top) / z
    cur = t // bs
    if t + 1 < cfg.dense_len or cur + 1 <= cfg.budget_blocks:
        return list(range(cur + 1)), False
    block = {}
    for b in range(cur + 1):
        over = [per_key[j] for j in visible if j * s < (b + 1) * bs and j * s + k > b * bs]
        block[b] = max(over) if over else -1e30
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    rest = sorted((b for b in block if b not in forced), key=lambda b: (-block[b], b))
    kk = cfg.topk_blocks
    near = len(rest) > kk and 0 < abs(block[rest[kk - 1]] - block[rest[kk]]) < 1e-5
    return sorted(forced | set(rest[:kk])), near


def test_cpu_dispatch_matches_brute_force_and_errors():
    """CPU tensors: selection of the decode token against an independent float64 loop."""
    d, num_blocks = 16, 12
    q_pos = torch.tensor([int(torch.randint(150, 16 * num_blocks, ())), 97])
    ck = torch.randn(2, 2, reference.num_compressed(16 * num_blocks, CFG.kernel_size, CFG.kernel_stride), d)
    ck_len = torch.tensor([30, 20])
    for query in (torch.randn(2, 2, d) * 2, torch.randn(2, 2, 3, d) * 2):
        for cut in (None, ck_len):
            ids, mask = select_decode_blocks(query, ck, q_pos, num_blocks, CFG, ck_len=cut, return_mask=True)
            for b in range(2):
                for h in range(2):
                    num_ck = ck.shape[2] if cut is None else int(cut[b])
                    want, near = _brute_decode_selection(query[b, h], ck[b, h], int(q_pos[b]), CFG, num_ck)
                    if near:
                        continue
                    assert mask[b, h].nonzero().flatten().tolist() == want
                    assert ids[b, h][ids[b, h] >= 0].tolist() == want
    query = torch.randn(1, 2, 16)
    ck, q_pos = torch.randn(1, 2, 10, 16), torch.tensor([60])
    with pytest.raises(SpardaError):
        select_decode_blocks_triton(query, ck, q_pos.view(1, 1), 4, CFG)
    with pytest.raises(SpardaError):
        select_decode_blocks_triton(torch.randn(1, 3, 16), ck, q_pos, 4, CFG)
