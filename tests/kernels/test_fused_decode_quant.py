"""The fused decode step (sparda.model.fused) with a quantised KV cache against the unfused step.

The RoPE + append kernel runs under the Triton interpreter (``sparda.kernels.rope_append``
routed to the Triton launcher on CPU tensors; the other kernels take their twins): it
quantises each token in the kernel, where the unfused step quantises in PyTorch. On a
tiny random fp32 model, offloaded ``sparda`` (resident layer 0, host store written back
by the engine) and on-device ``sparse``, int8 and int4: the same greedy tokens, logits
within 1e-5, and the same cache bytes at the end.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.bench.models import random_forecast  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.kernels.rope_append import rope_append_triton  # noqa: E402
from sparda.model.fused import FusedDecoder  # noqa: E402

# dense_len 160 lies inside the generation: the longest row leaves the dense fallback mid-run
SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=160, init_blocks=1, local_blocks=2,
             topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _cache_bytes(cache) -> list[torch.Tensor]:
    """Every stored plane of a cache: codes and scales of K and V (host store, slots and
    resident layers of an offloaded cache; the full buffers of an on-device one)."""
    if cache.offload:
        bufs = [c.k for l in cache.offloaded for c in cache.host.chunks[l]] + \
               [c.v for l in cache.offloaded for c in cache.host.chunks[l]] + \
               list(cache.k_slots.values()) + list(cache.v_slots.values()) + \
               list(cache.k_full.values()) + list(cache.v_full.values())
    else:
        bufs = cache.k + cache.v
    return [t for b in bufs for t in (b.data, b.scale)]


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("method,offload", [("sparda", True), ("sparse", False)])
def test_fused_quantized_step_generates_the_unfused_tokens(tiny_model, method, offload, kv_dtype, fresh_seed,
                                                           monkeypatch):
    from sparda import kernels

    forecast = random_forecast(tiny_model)

    def make(fused: bool) -> LLM:
        return LLM.from_model(tiny_model, method=method, preset="small", forecast=forecast, offload=offload,
                              kv_dtype=kv_dtype, fused_decode=fused, cuda_graphs=False, **SMALL)

    fused, plain = make(True), make(False)
    fused.model_runner._fused_checked, fused.model_runner._fused = True, FusedDecoder(tiny_model, fused.method)  # the CUDA choice, on CPU
    assert plain.model_runner.fused_decoder() is None
    calls = []

    def triton_append(*args, **kw):
        calls.append(1)
        rope_append_triton(*args, **kw)

    monkeypatch.setattr(kernels, "rope_append", triton_append)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150, 41)]
    steps = 24
    out = {}
    for name, llm in (("fused", fused), ("plain", plain)):
        llm.method.reset()
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
        logits = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
        tokens, positions = logits.argmax(-1), torch.tensor([len(p) for p in prompts])
        generated, all_logits = [], []
        for _ in range(steps):  # each step feeds back its own greedy tokens
            logits = llm.decode(cache, tokens, positions)
            tokens, positions = logits.argmax(-1), positions + 1
            generated.append(tokens)
            all_logits.append(logits)
        out[name] = (torch.stack(generated), torch.stack(all_logits), cache)
    assert len(calls) == steps * tiny_model.shape.num_layers  # every fused append ran the kernel
    (tok_f, log_f, cache_f), (tok_p, log_p, cache_p) = out["fused"], out["plain"]
    what = (method, kv_dtype, f"seed={fresh_seed}")
    assert torch.equal(tok_f, tok_p), what
    assert _rel(log_f, log_p) <= 1e-5, what
    assert cache_f.offload == offload
    for got, want in zip(_cache_bytes(cache_f), _cache_bytes(cache_p)):
        assert torch.equal(got, want), what
