"""The Forecast projection and the ``sparda`` / ``infinigen`` methods (design §4, §6)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from sparda.attention.forecast import Forecast, ForecastAttention, model_identity, save_forecast
from sparda.config import SelectionConfig, SpardaConfig
from sparda.errors import SpardaError

SMALL = dict(block_size=32, topk_blocks=2, local_blocks=2, init_blocks=1, dense_len=64)


def _llm(make_tiny, **extra):
    from sparda.engine.llm import LLM

    return LLM(str(make_tiny("llama")), method="dense", device="cpu", **SMALL, **extra)


def _sparda(llm, forecast, in_prefill=True):
    config = SpardaConfig(method="sparda", selection=llm.config.selection, sparse_prefill=in_prefill)
    return ForecastAttention(config, llm.shape, model=llm.model, forecast=forecast)


def _install(llm, method):
    """Run ``llm`` with ``method``: ``llm.prefill`` / ``decode`` / ``logits`` go through its
    :class:`~sparda.engine.runner.ModelRunner`, which holds the method too."""
    llm.method = llm.model_runner.method = method


def test_parameter_count_and_projection_matches_float64():
    fc = Forecast(num_layers=30, hidden_size=576, num_kv_heads=3, head_dim=64)
    assert sum(p.numel() for p in fc.parameters()) == 29 * 576 * 192 + 576 * 192  # design §4
    small = Forecast(num_layers=3, hidden_size=24, num_kv_heads=2, head_dim=8)
    h = torch.randn(1, 5, 24)
    pos = torch.arange(5).view(1, -1) + int(torch.randint(0, 100, ()).item())
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))
    got = small.project(2, h, *_rope_tables(pos, inv))
    w = small.forecast[1].weight.double()
    for t in range(5):
        for head in range(2):
            f = w[head * 8:(head + 1) * 8] @ h[0, t].double()
            ang = pos[0, t].double() * inv
            x1, x2 = f[:4], f[4:]
            want = torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()])
            assert torch.allclose(got[0, head, t].double(), want, atol=1e-5)


def _rope_tables(pos, inv):
    emb = torch.cat([pos[..., None].double() * inv] * 2, -1).float()
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def test_decode_selection_matches_prefill_and_uses_previous_layer(make_tiny):
    """Decode masks (predicted in layer l from pre-append keys) equal prefill masks for the
    same token, and the logits match; the mask of layer l+1 comes from layer l's Forecast
    ``F_l`` applied to layer l's input."""
    llm = _llm(make_tiny)
    forecast = Forecast.for_shape(llm.shape)
    method = _sparda(llm, forecast)
    _install(llm, method)
    n = 208 + int(torch.randint(1, 16, ()).item())  # n % 16 != 0: no window completes at the last token
    ids = torch.randint(0, 1000, (n,)).tolist()
    full = llm.logits(ids)[-1]
    masks = {}
    original = method.select

    def spy(layer, q, h, cache, step, first=0):
        mask = original(layer, q, h, cache, step, first)
        masks[(step.phase, layer)] = mask[..., -1, :].clone()
        return mask
    method.select = spy
    predicted = {}
    original_predict = method.predict_next

    def spy_predict(layer, h, cache, step):
        predicted[layer + 1] = h.clone()
        return original_predict(layer, h, cache, step)
    method.predict_next = spy_predict
    inputs = {}
    original_attend = method.attend

    def spy_attend(layer, q, h, cache, step):
        inputs[(step.phase, layer)] = h.clone()
        return original_attend(layer, q, h, cache, step)
    method.attend = spy_attend

    def decode_last():
        method.reset()
        cache = llm.new_cache(1, n)
        llm.prefill(cache, 0, ids[:-1])
        return llm.decode(cache, torch.tensor([ids[-1]]), torch.tensor([n - 1]))[0]

    last = decode_last()
    decoded = {layer: masks[("decode", layer)] for layer in range(llm.shape.num_layers)}
    method.reset()
    llm.prefill(llm.new_cache(1, n), 0, ids)
    for layer in range(llm.shape.num_layers):
        assert torch.equal(masks[("decode", layer)], masks[("prefill", layer)])
    assert torch.allclose(last, full, atol=1e-3)
    dense = llm_dense_logits(llm, ids)
    assert not torch.allclose(full, dense, atol=1e-3)  # selection really dropped blocks
    # layer l+1's mask is predicted during layer l, from layer l's attention input ...
    for target in range(1, llm.shape.num_layers):
        assert torch.equal(predicted[target], inputs[("decode", target - 1)])
    # ... through F_l: a constant F_l (all scores tie: the lowest free blocks win) changes
    # the last layer's mask and no earlier one
    last_layer = llm.shape.num_layers - 1
    with torch.no_grad():
        method.forecast.forecast[last_layer - 1].weight.zero_()
    decode_last()
    for layer in range(last_layer):
        assert torch.equal(masks[("decode", layer)], decoded[layer])
    cur = (n - 1) // llm.config.selection.block_size
    free = [b for b in range(cur + 1) if b >= SMALL["init_blocks"] and b <= cur - SMALL["local_blocks"]]
    heads = masks[("decode", last_layer)][0, :, :cur + 1]
    for row in heads:  # (the random F_l may have picked these too: this is the deterministic check)
        assert row.nonzero().flatten().tolist() == sorted({0, cur - 1, cur, *free[:SMALL["topk_blocks"]]})


def llm_dense_logits(llm, ids):
    from sparda.attention.dense import DenseAttention

    keep = llm.method
    _install(llm, DenseAttention(llm.config, llm.shape))
    try:
        return llm.logits(ids)[-1]
    finally:
        _install(llm, keep)


def test_predict_next_brute_force(make_tiny):
    llm = _llm(make_tiny)
    fc = Forecast.for_shape(llm.shape)
    method = _sparda(llm, fc)
    cfg = llm.config.selection
    n = 190
    ids = torch.randint(0, 1000, (n,)).tolist()
    cache = llm.new_cache(1, n + 1)
    _install(llm, method)
    llm.prefill(cache, 0, ids)
    h = torch.randn(1, 1, llm.shape.hidden_size)
    step = llm.model_runner._step("decode", torch.tensor([0]), torch.tensor([[n]]))
    mask = method.predict_next(0, h, cache, step)[0, :, 0]  # [H, N]
    f = fc.project(1, h, step.cos, step.sin)[0, :, 0]  # [H, d]
    ck = cache.ck[1][0]
    num_ck = (n - cfg.kernel_size) // cfg.kernel_stride + 1
    for head in range(llm.shape.num_kv_heads):
        block = torch.full(((n + cfg.block_size) // cfg.block_size,), -math.inf)
        for j in range(num_ck):  # windows complete before the new token only
            s = float(f[head] @ ck[head, j])
            lo, hi = j * cfg.kernel_stride, j * cfg.kernel_stride + cfg.kernel_size
            for b in range(lo // cfg.block_size, (hi - 1) // cfg.block_size + 1):
                block[b] = max(block[b], s)
        cur = n // cfg.block_size
        forced = {0, *range(cur - cfg.local_blocks + 1, cur + 1)}
        rest = sorted((b for b in range(cur + 1) if b not in forced), key=lambda b: (-block[b], b))
        want = forced | set(rest[:cfg.topk_blocks])
        assert set(torch.nonzero(mask[head][:cur + 1]).flatten().tolist()) == want


def test_dense_prefill_option_and_infinigen(make_tiny):
    from sparda.attention.baselines.infinigen import InfiniGenAttention

    llm = _llm(make_tiny)
    ids = torch.randint(0, 1000, (150,)).tolist()
    dense = llm_dense_logits(llm, ids)
    _install(llm, _sparda(llm, Forecast.for_shape(llm.shape), in_prefill=False))
    assert torch.allclose(llm.logits(ids)[-1], dense, atol=1e-4)
    # infinigen with every column kept reproduces the scored layer's own queries
    ig = InfiniGenAttention(llm.config, llm.shape, model=llm.model, partial_ratio=1.0)
    layer = llm.model.model.layers[1]
    h = torch.randn(1, 7, llm.shape.hidden_size)
    pos = torch.arange(7).view(1, -1) + 40
    cos, sin = llm.model.rotary(pos, torch.float32)
    q, _, _ = layer.self_attn.project(h, cos, sin)
    assert torch.allclose(ig.partial_query(1, h, cos, sin), q, atol=1e-5)
    _install(llm, InfiniGenAttention(llm.config, llm.shape, model=llm.model))
    out = llm.generate(["hello " * 60], max_new_tokens=3, chat=False)[0]
    assert len(out.token_ids) >= 1


def test_sparda_without_weights_and_with_foreign_weights(make_tiny, tmp_path):
    from sparda.engine.llm import LLM
    from sparda.model.loader import load_config
    from sparda.model.llama import ModelShape

    with pytest.raises(SpardaError, match="train-forecast"):
        LLM(str(make_tiny("llama")), method="sparda", device="cpu")
    other = make_tiny("qwen2")
    config = load_config(other)
    shape = ModelShape.from_config(config)
    path = tmp_path / "q.safetensors"
    save_forecast(Forecast.for_shape(shape), path, model_identity(config, shape))
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # the user's usual mode, not 0600
    with pytest.raises(SpardaError, match="not for the loaded model"):
        LLM(str(make_tiny("llama")), method="sparda", device="cpu", forecast=str(path))


def test_shipped_weights_load_for_bundled_model():
    from sparda.engine.llm import LLM

    llm = LLM(None, method="sparda", device="cpu")
    assert int(llm.method.meta["step"]) > 0 and llm.method.meta["model_name"] == "SmolLM2-135M-Instruct"


@pytest.mark.slow
def test_bundled_passkey_with_sparda():
    from sparda.data import heldout_text
    from sparda.engine.llm import LLM
    from sparda.eval.tasks.passkey import make_passkey, passkey_correct

    llm = LLM(None, method="sparda", device="cpu")
    sample = make_passkey(llm.tokenizer, heldout_text(), 7000, 0.5, 0)
    assert passkey_correct(sample, llm.generate([sample.prompt], max_new_tokens=24)[0].text)


def test_sparda_random_is_seeded_and_selects_differently_from_sparse(make_tiny):
    import torch

    from sparda import LLM

    small = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, topk_blocks=2, local_blocks=2,
                 sparse_prefill=True)  # logits() scores prefill
    path = make_tiny("llama")
    ids = torch.randint(0, 49152, (int(torch.randint(180, 240, ())),)).tolist()
    first = LLM(path, method="sparda-random", device="cpu", **small).logits(ids)
    again = LLM(path, method="sparda-random", device="cpu", **small).logits(ids)
    assert torch.equal(first, again)
    assert (first - LLM(path, method="sparse", device="cpu", **small).logits(ids)).abs().max() > 1e-4
