"""Decode padding copies nothing (design §3.13): in a server-like engine (chunked prefill
across steps) a half-prefilled row runs in each decode step as padding at its chunk boundary;
its selection is dropped (``OffloadKVCache.padding_rows``), so it selects, hits and misses no
block, while the decoding rows' tokens and log-probabilities equal those of an engine that
lets padding rows fetch (rows never read each other's cache)."""

from __future__ import annotations

import numpy as np
import pytest

from sparda import LLM, SamplingParams
from sparda.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)


@pytest.fixture(scope="module")
def llm(make_tiny):
    return LLM(str(make_tiny("llama")), method="sparse-offload", device="cpu", cuda_graphs=False,
               dense_heads="none", prefill_chunk_tokens=32, **SMALL)


def _run(llm, prompts, mask: bool):
    """Row 0 decodes a short prompt's request while row 1's long prompt is prefilled 32 tokens
    a step. Returns the outputs and, per step, row 1's (blocks read, hits, misses) and whether
    it was decode padding in that step (half-prefilled after the step's prefill)."""
    engine = Engine(llm, max_batch=2, max_model_len=512, max_prefill_tokens=34)
    if not mask:
        engine.cache.padding_rows = None
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    short, long = (engine.add_request(p, params) for p in prompts)
    pref = engine.cache.prefetcher
    steps = []
    while engine.has_work():
        engine.step()  # row 1 was padding in its decode step iff still half-prefilled after it
        half = long.row == 1 and 0 < long.num_computed < long.num_prefill
        steps.append((half, int(pref.hits[1]) if pref.hits is not None else 0,
                      int(pref.misses[1]) if pref.misses is not None else 0))
    return [short.output(), long.output()], steps


def test_a_half_prefilled_row_fetches_nothing(llm, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    vocab = llm.model.lm_head.out_features
    prompts = [rng.integers(3, vocab, int(rng.integers(50, 90))).tolist(),
               rng.integers(3, vocab, int(rng.integers(300, 400))).tolist()]
    got, steps = _run(llm, prompts, mask=True)
    want, unmasked = _run(llm, prompts, mask=False)
    padding = [i for i, (half, _, _) in enumerate(steps) if half]
    assert len(padding) > 4, (fresh_seed, steps)  # the case is exercised: row 1 spans steps
    for i in padding:  # row 1's counters do not move while it is padding
        assert steps[i][1:] == (steps[i - 1][1:] if i else (0, 0)), (fresh_seed, i, [s for s in steps if s[0]], steps[:i + 2])
    moved = [i for i in padding if i and unmasked[i][1:] != unmasked[i - 1][1:]]
    assert moved, (fresh_seed, unmasked)  # without the mask a padding row does fetch
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids, fresh_seed
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-6), fresh_seed
