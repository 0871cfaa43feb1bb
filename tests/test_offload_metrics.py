"""The engine-wide offload figures of ``Engine.metrics()`` (and so ``/metrics``'
``sparda_offload_hit_rate`` and ``sparda_offload_bytes_per_token``) against the requests' own:
with every request finished they are the sums of the requests' ``offload`` stats -- early copies
(lookahead 2, design §6.2) and ``mixed``'s pool misses (a pool block each) included -- in the
default single bucket and with ``auto`` buckets (design §3.13), whose free rows below the bucket
decode as padding."""

from __future__ import annotations

import pytest
import torch

from sparda import SamplingParams
from sparda.engine.engine import Engine
from test_buckets import _llm
from test_forecast2 import weights  # noqa: F401 - fixture: (one-layer, two-ahead) Forecast files of tiny

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("sparse-offload", {}), ("sparse-offload", {"kv_dtype": "mixed"}),
         ("sparda", {"offload": True, "lookahead": 2})]


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.mark.parametrize("sizes", [None, "auto"])
@pytest.mark.parametrize("method,options", CASES, ids=[m + "".join(f"-{v}" for v in o.values()) for m, o in CASES])
def test_engine_offload_figures_are_the_sums_of_the_requests(tiny, weights, method, options, sizes, fresh_seed):
    """Five requests through a 4-row engine, admitted over the first steps and finishing at
    different times (rows are reused): hits, misses, bytes copied and bytes per decoded token of
    the engine equal those summed over the requests' stats."""
    llm = _llm(tiny, weights, method, options, cuda_graph_sizes=sizes)
    engine = Engine(llm, max_batch=4, max_model_len=200)
    lengths = torch.randint(90, 150, (5,)).tolist()
    new = torch.randint(4, 16, (5,)).tolist()
    pending = [(torch.randint(100, 20000, (n,)).tolist(), m) for n, m in zip(lengths, new)]
    outputs = []
    while pending or engine.has_work():
        if pending:
            ids, m = pending.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True))
        outputs += [delta.output for delta in engine.step() if delta.output is not None]
    where = f"seed {fresh_seed}, {method} {options}, sizes {sizes}"
    assert len(outputs) == 5, where
    stats = [o.stats["offload"] for o in outputs]
    got = engine.metrics()["offload"]  # refreshed when the last request finished
    want = {key: sum(s[key] for s in stats) for key in ("hits", "misses", "bytes_copied")}
    assert {key: got[key] for key in want} == want, (where, got, want)
    decoded = sum(m - 1 for m in new)  # the first token of each is its prefill's
    assert got["bytes_per_token"] == round(want["bytes_copied"] / decoded, 1), (where, got)
    assert got["hit_rate"] == round(want["hits"] / (want["hits"] + want["misses"]), 4), where
    if options.get("lookahead") == 2:
        assert sum(s["early_copies"] for s in stats) > 0, where  # the early copies were counted
    if options.get("kv_dtype") == "mixed":
        assert sum(s["pool_misses"] for s in stats) > 0, where
