"""The fused decode step (sparda.model.fused) against the plain modules, every method.

On the CPU the fused step's kernels dispatch to their PyTorch twins, so this checks the
fused step's structure (stacked QKV(+F) and gate/up GEMMs, RoPE + append through the
caches' ``rope_append``, fused norms, Forecast queries handed over in
``step.projections``) end to end: same logits (fp32, <= 1e-5 relative), same block
counters and hit/miss counts as the unfused step, over a batch of three lengths that
crosses the dense fallback; with quantised KV caches too (int8/int4: the fused append
quantises each token, the unfused one in PyTorch; mixed: both write the int4 store and the
hot pool through the cache). The Triton kernels themselves are
tested under the interpreter (tests/kernels/, the quantised fused step end to end in
tests/kernels/test_fused_decode_quant.py) and in bf16 on the GPU (``benchmarks/bench_decode.py fused``).
"""

from __future__ import annotations

import pytest
import torch

from sparda.model.fused import FusedDecoder
from test_graph_runner import METHODS, SMALL, _llm, _rel, tiny  # noqa: F401 - fixture
from test_offload import forecast_file  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")


def _force_fused(llm):
    llm.model_runner._fused_checked = True
    llm.model_runner._fused = FusedDecoder(llm.model, llm.method)
    return llm


# quantised KV caches (docs/kv_quant.md): the fused append quantises each token itself
QUANTIZED = [("sparse", {"kv_dtype": "int8"}), ("sparda", {"offload": False, "kv_dtype": "int4"}),
             ("sparda", {"offload": True, "kv_dtype": "int8"}), ("sparse-offload", {"kv_dtype": "int4"}),
             ("sparda", {"offload": True, "kv_dtype": "mixed"}), ("sparse-offload", {"kv_dtype": "mixed"})]


@pytest.mark.parametrize("method,extra", METHODS + QUANTIZED,
                         ids=[m + ("-offload" if e.get("offload") else "") + (f"-{e['kv_dtype']}" if "kv_dtype" in e
                                                                              else "")
                              for m, e in METHODS + QUANTIZED])
def test_fused_step_equals_unfused_step(tiny, forecast_file, method, extra, fresh_seed):
    fused = _force_fused(_llm(tiny, forecast_file, method, extra))
    plain = _llm(tiny, forecast_file, method, dict(extra, fused_decode=False))
    assert plain.model_runner.fused_decoder() is None
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150, 41)]
    steps = 30
    caches = []
    for llm in (fused, plain):
        llm.method.reset()
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 7)
        first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
        caches.append(cache)
    tokens, positions = first.argmax(-1), torch.tensor([len(p) for p in prompts])
    if hasattr(fused.method, "forecast"):  # decode takes the Forecast queries from the stacked GEMM
        fused.method.forecast.project = lambda *a, **k: pytest.fail("the fused step projected the Forecast again")
    for _ in range(steps):
        a = fused.decode(caches[0], tokens, positions)
        b = plain.decode(caches[1], tokens, positions)
        assert _rel(a, b) <= 1e-5, (method, int(positions.max()), f"seed={fresh_seed}")
        tokens, positions = b.argmax(-1), positions + 1
    assert caches[0].read_fraction() == pytest.approx(caches[1].read_fraction(), abs=1e-12)
    for row in range(3):
        assert caches[0].read_fraction(row) == pytest.approx(caches[1].read_fraction(row), abs=1e-12)
    if caches[0].prefetcher is not None:
        sa, sb = caches[0].offload_stats(steps * 3), caches[1].offload_stats(steps * 3)
        assert (sa["hits"], sa["misses"]) == (sb["hits"], sb["misses"]) and sa["misses"] > 0


def test_stacked_weights_are_views_and_shared_once(tiny, forecast_file):
    """Stacking keeps one copy of each weight: the model's q/k/v and gate/up weights and the
    Forecast heads are views of the stacked tensors; a second decoder on the same model
    re-stacks and the first rebuilds before its next step."""
    llm = _llm(tiny, forecast_file, "sparda", {"offload": False})
    before = {n: p.detach().clone() for n, p in llm.model.named_parameters()}
    first = FusedDecoder(llm.model, llm.method)
    attn, mlp = llm.model.model.layers[1].self_attn, llm.model.model.layers[1].mlp
    assert attn.q_proj.weight.data_ptr() == first.qkv_w[1].data_ptr()
    assert mlp.gate_proj.weight.data_ptr() == first.gate_up_w[1].data_ptr()
    assert llm.method.forecast.forecast[1].weight.data_ptr() == first.qkv_w[1][-attn.k_proj.weight.shape[0]:].data_ptr()
    for n, p in llm.model.named_parameters():
        assert torch.equal(p, before[n]), n
    second = FusedDecoder(llm.model, llm.method)
    assert not first._current() and second._current()
