"""Two-layer lookahead (design §6.2) in the offloaded runtime: early copies and their schedule.

* greedy tokens of ``lookahead=2`` equal those of ``lookahead=1`` (bf16 / int8 / mixed KV), and
  the fused decode step equals the unfused one with the two-ahead heads stacked in.

The option, the weight files and training: tests/test_forecast2.py. Tiny random models with
small blocks (block 16, kernel 8, stride 4, dense_len 0), so that selection drops blocks at
short lengths.
"""

from __future__ import annotations


import pytest
import torch

from sparda.attention.forecast import Forecast, model_identity, save_forecast
from sparda.config import SelectionConfig
from sparda.errors import SpardaError

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    """5 layers: layers 2-4 get early copies."""
    return make_tiny("llama", num_hidden_layers=5)


@pytest.fixture(scope="module")
def weights(tiny, tmp_path_factory):
    """``(one-layer file, two-ahead file)`` of random Forecasts (scaled up: peaky scores). The
    two-ahead head of layer ``l`` is ``F_{l+1}``'s weights, read from layer ``l``'s input: a
    prediction that overlaps the one-layer selection, so that early copies turn into hits."""
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="dense", device="cpu")
    one, two = Forecast.for_shape(llm.shape), Forecast.for_shape(llm.shape, ahead=2)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0, 0.3)
        for layer, lin in enumerate(two.forecast):
            lin.weight.copy_(one.forecast[layer + 1].weight)
    path = tmp_path_factory.mktemp("forecast2")
    identity = model_identity(llm.model.config, llm.shape)
    save_forecast(one, path / "f1.safetensors", identity, dtype=torch.float32)
    save_forecast(two, path / "f2.safetensors", identity, dtype=torch.float32)
    return str(path / "f1.safetensors"), str(path / "f2.safetensors")


def _llm(tiny, weights, lookahead: int, resident=(), **extra):
    from sparda.engine.llm import LLM

    two = dict(lookahead=2, forecast2=weights[1]) if lookahead == 2 else {}
    llm = LLM(str(tiny), method="sparda", offload=True, device="cpu", forecast=weights[0], sparse_prefill=True,
              **SMALL, **two, **extra)
    llm.method.resident_layers = resident
    return llm


def test_lookahead_two_without_two_ahead_weights_names_the_training_command(tiny, weights):
    from sparda.engine.llm import LLM

    with pytest.raises(SpardaError, match="no two-ahead Forecast weights.*train-forecast"):
        LLM(str(tiny), method="sparda", offload=True, device="cpu", forecast=weights[0], lookahead=2, **SMALL)


# ------------------------------------------------------------ same tokens

@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "mixed"])
def test_lookahead_two_gives_the_tokens_of_lookahead_one(tiny, weights, kv_dtype, fresh_seed):
    """Early copies change what is resident, never what is attended: the same greedy tokens and the
    logits up to summation order (fp32), over a batch of two lengths; blocks were copied early and
    fewer were left to copy late."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (150, 97)]
    steps = 64
    runs = []
    for lookahead in (1, 2):
        llm = _llm(tiny, weights, lookahead, kv_dtype=kv_dtype)
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
        first = torch.stack([llm.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)])
        tokens, positions = first.argmax(-1), torch.tensor([len(p) for p in prompts])
        logits = []
        for _ in range(steps):
            out = llm.decode(cache, tokens, positions)
            logits.append(out)
            tokens, positions = out.argmax(-1), positions + 1
        runs.append((torch.stack(logits), cache.offload_stats(steps * len(prompts))))
    (one, stats1), (two, stats2) = runs
    where = f"seed {fresh_seed}, {kv_dtype}"
    assert torch.equal(one.argmax(-1), two.argmax(-1)), where
    assert ((one - two).norm() / one.norm()).item() <= 1e-5, where
    assert stats1["early_copies"] == 0 and stats2["early_copies"] > 0, where
    assert stats2["misses"] < stats1["misses"], (where, stats1, stats2)
    assert stats2["hits"] + stats2["misses"] == stats1["hits"] + stats1["misses"], where  # same selections


def test_fused_step_with_two_ahead_heads_equals_unfused(tiny, weights, fresh_seed):
    """The fused decode step stacks the two-ahead heads into the QKV(+F) GEMM (CPU twins): same
    logits and counters as the unfused step, and no Forecast projection of its own."""
    from sparda.model.fused import FusedDecoder

    fused, plain = _llm(tiny, weights, 2), _llm(tiny, weights, 2, fused_decode=False)
    fused.model_runner._fused_checked = True
    fused.model_runner._fused = FusedDecoder(fused.model, fused.method)
    assert [key for key, _ in fused.method.stacked_heads(1)] == [2, (3, 2)]
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (120, 77)]
    caches = []
    for llm in (fused, plain):
        cache = llm.new_cache(2, 200)
        first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
        caches.append(cache)
    tokens, positions = first.argmax(-1), torch.tensor([len(p) for p in prompts])
    fused.method.forecast2.project = lambda *a, **k: pytest.fail("the fused step projected F2 again")
    for _ in range(24):
        a, b = fused.decode(caches[0], tokens, positions), plain.decode(caches[1], tokens, positions)
        assert ((a - b).norm() / b.norm()).item() <= 1e-5, fresh_seed
        tokens, positions = b.argmax(-1), positions + 1
    sa, sb = caches[0].offload_stats(48), caches[1].offload_stats(48)
    assert (sa["hits"], sa["misses"], sa["early_copies"]) == (sb["hits"], sb["misses"], sb["early_copies"])
    assert sa["early_copies"] > 0




def test_mixed_early_copy_takes_no_pool_slot_of_the_current_block():
    """``mixed`` (design §6.2): before the step's hot rule, a hot block whose pool slot the current
    block takes (``n <= c - P``) is copied as int4, the other hot blocks from the pool."""
    from sparda.cache.hot import HotBlocks

    cfg = SelectionConfig(block_size=4, kernel_size=4, kernel_stride=2, init_blocks=0, local_blocks=2,
                          topk_blocks=2, dense_len=0)
    hot = HotBlocks((1,), 1, 1, 16, cfg, hot_blocks=5, hot_steps=4, device=torch.device("cpu"))
    hot.hot[1][0, 0, [3, 4, 7]] = True
    load = torch.tensor([[[3, 7, 4, 2, -1]]])
    pos = torch.tensor([32])  # first token of block 8; block 3 shares pool slot 3 with it
    pool, cold = hot.split(1, load, pos)
    assert pool.tolist() == [[[-1, 2, 4, -1, -1]]] and cold.tolist() == [[[3, -1, -1, 2, -1]]]
    pool, cold = hot.split(1, load)  # a fetch: after the hot rule, the state decides alone
    assert pool.tolist() == [[[3, 2, 4, -1, -1]]] and cold.tolist() == [[[-1, -1, -1, 2, -1]]]
