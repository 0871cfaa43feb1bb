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
from test_forecast2 import tiny, weights  # noqa: F401 - fixtures (5 layers, Forecasts of both kinds)

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)
#: method, options: a plain offloaded selection, the Forecast's, and lookahead 2's early copies (warm)
CASES = {"sparse-offload": ("sparse-offload", {}), "sparda": ("sparda", {"offload": True}),
         "sparda-lookahead2": ("sparda", {"offload": True, "lookahead": 2})}


@pytest.fixture(scope="module", params=list(CASES))
def llm(request, tiny, weights):  # noqa: F811 - fixtures
    method, options = CASES[request.param]
    if method == "sparda":
        options = {**options, "forecast": weights[0]}
        if options.get("lookahead") == 2:
            options["forecast2"] = weights[1]
    return LLM(str(tiny), method=method, device="cpu", cuda_graphs=False, dense_heads="none",
               prefill_chunk_tokens=32, **SMALL, **options)


def _run(llm, prompts, mask: bool):
    """Row 0 decodes a short prompt's request while row 1's long prompt is prefilled 32 tokens
    a step. Returns the outputs and, per step, row 1's (blocks read, hits, misses) and whether
    it was decode padding in that step (half-prefilled after the step's prefill), and its hits,
    misses and early copies (lookahead 2) so far."""
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
        steps.append((half, *(int(c[1]) if c is not None else 0 for c in (pref.hits, pref.misses, pref.early))))
    return [short.output(), long.output()], steps


def test_a_half_prefilled_row_fetches_nothing(llm, fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    vocab = llm.model.lm_head.out_features
    prompts = [rng.integers(3, vocab, int(rng.integers(50, 90))).tolist(),
               rng.integers(3, vocab, int(rng.integers(300, 400))).tolist()]
    got, steps = _run(llm, prompts, mask=True)
    want, unmasked = _run(llm, prompts, mask=False)
    padding = [i for i, (half, *_) in enumerate(steps) if half]
    assert len(padding) > 4, (fresh_seed, steps)  # the case is exercised: row 1 spans steps
    for i in padding:  # row 1's counters do not move while it is padding
        assert steps[i][1:] == (steps[i - 1][1:] if i else (0, 0, 0)), (fresh_seed, i, steps[:i + 2])
    moved = [i for i in padding if i and unmasked[i][1:] != unmasked[i - 1][1:]]
    assert moved, (fresh_seed, unmasked)  # without the mask a padding row does fetch
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids, fresh_seed
        for x, y in zip(a.logprobs, b.logprobs):
            assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-6), fresh_seed
