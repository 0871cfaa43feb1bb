"""The static-shape decode step (docs/cuda_graphs.md) against the step it replaced.

The reference is the pre-graph decode step: views cut to the longest row's live length
(``max_kv_len = live_len``), built here by hand. The static step exposes the whole cache
capacity and masks by per-row lengths; on the CPU it runs eagerly and must give the same
logits (fp32, <= 1e-5 relative) for every method, a batch of different lengths, and a
context that crosses the dense fallback mid-generation. CUDA-graph replay itself is
checked on the GPU by ``benchmarks/bench_decode.py graphs`` (docs/cuda_graphs.md).
"""

from __future__ import annotations

import pytest
import torch

from sparda.engine.llm import LLM
from test_offload import forecast_file  # noqa: F401 - fixture

# small blocks so that selection drops blocks at short lengths; dense_len 160 lies inside
# the generation, so the host-side branch (and the graph key) flips mid-run
SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=160, init_blocks=1, local_blocks=2,
             topk_blocks=3)
METHODS = [("dense", {}), ("sparse", {}), ("oracle", {}), ("infinigen", {}), ("sparda", {"offload": False}),
           ("sparda", {"offload": True}), ("sparse-offload", {}), ("sparda-no-prefetch", {}),
           ("streaming", {}), ("h2o", {}), ("quest", {"quest_page_size": 4}), ("snapkv", {}),
           ("shallow", {"shallow_layers": 1}), ("shallow", {"shallow_layers": 2, "shallow_select_once": True})]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _llm(tiny, forecast_file, method, extra):
    kwargs = dict(SMALL, **extra)
    if method.startswith("sparda"):
        kwargs["forecast"] = forecast_file
    return LLM(str(tiny), method=method, device="cpu", **kwargs)


@torch.inference_mode()
def _dynamic_step(llm, cache, tokens, positions):
    """The decode step before static shapes: views of ``max(positions) + 1`` tokens."""
    live = int(positions.max()) + 1
    rows = torch.arange(tokens.shape[0])
    step = llm.model_runner._step("decode", rows, positions.view(-1, 1), live, live)
    return llm.model(tokens.view(-1, 1), step, cache, llm.method)[:, -1]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("method,extra", METHODS, ids=[m + ("-offload" if e.get("offload") else "")
                                                       + ("-once" if e.get("shallow_select_once") else "")
                                                       for m, e in METHODS])
def test_static_step_equals_dynamic_step(tiny, forecast_file, method, extra, fresh_seed):
    """Every method: static-shape logits == dynamic-view logits over 40 steps of a batch of
    three lengths whose longest row crosses dense_len (160) at step 10."""
    static, dynamic = _llm(tiny, forecast_file, method, extra), _llm(tiny, forecast_file, method, extra)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150, 41)]
    steps = 40
    caches = []
    for llm in (static, dynamic):
        llm.method.reset()
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 7)  # capacity > live length
        first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
        caches.append(cache)
    tokens, positions = first.argmax(-1), torch.tensor([len(p) for p in prompts])
    crossed = set()
    for _ in range(steps):
        crossed.add(static.method.graph_key(int(positions.max()) + 1))
        a = static.decode(caches[0], tokens, positions)
        b = _dynamic_step(dynamic, caches[1], tokens, positions)
        assert _rel(a, b) <= 1e-5, (method, int(positions.max()), f"seed={fresh_seed}")
        tokens, positions = b.argmax(-1), positions + 1
    if method not in ("dense",) and not static.method.offloaded:
        assert crossed == {False, True}  # both host-side branches ran (two graphs on CUDA)
    assert caches[0].read_fraction() == pytest.approx(caches[1].read_fraction(), abs=1e-12)


def test_graph_key_is_the_dense_fallback_rule(tiny, forecast_file):
    """graph_key flips exactly where the longest row outgrows dense_len and the budget
    (brute force over lengths)."""
    llm = _llm(tiny, forecast_file, "sparse", {})
    cfg = llm.config.selection
    for live in range(1, 400):
        blocks = -(-live // cfg.block_size)
        expected = live >= cfg.dense_len and blocks > cfg.budget_blocks
        assert llm.method.graph_key(live) is expected, live
    assert _llm(tiny, forecast_file, "dense", {}).method.graph_key(300) is None


@torch.inference_mode()
def test_long_generation_equals_a_dynamic_greedy_loop(tiny, forecast_file):
    """1,024 greedy tokens from generate() (static step, device-side token history, EOS
    checks every few steps) equal a plain loop over the dynamic step."""
    llm = _llm(tiny, forecast_file, "sparda", {"offload": False})
    prompt = torch.randint(100, 20000, (60,)).tolist()
    out = llm.generate(None, prompt_token_ids=[prompt], max_new_tokens=1024, ignore_eos=True)[0]
    ref = _llm(tiny, forecast_file, "sparda", {"offload": False})
    ref.method.reset()
    cache = ref.new_cache(1, len(prompt) + 1024)
    tok = ref.prefill(cache, 0, prompt)[-1:].argmax(-1)
    pos = torch.tensor([len(prompt)])
    expected = [int(tok)]
    for _ in range(1023):
        tok = _dynamic_step(ref, cache, tok, pos).argmax(-1)
        pos = pos + 1
        expected.append(int(tok))
    assert out.token_ids == expected
    assert out.stats["cuda_graph"] is False  # the CPU runs the static step eagerly


def test_generation_stops_at_eos_like_a_plain_loop(tiny, forecast_file, monkeypatch):
    """EOS is checked on the host only every few steps; the tokens are cut exactly at the
    first EOS of each row (reference: a plain greedy loop with a per-step check)."""
    llm = _llm(tiny, forecast_file, "sparse", {})
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (50, 80)]
    free = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=40, ignore_eos=True)
    eos = free[0].token_ids[11]  # a token row 0 produces at step 11
    monkeypatch.setattr(llm, "eos_ids", lambda: {eos})
    cut = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=40)
    for full, got in zip(free, cut):
        ids = full.token_ids
        stop = ids.index(eos) + 1 if eos in ids else len(ids)
        assert got.token_ids == ids[:stop]


def test_offload_stats_are_per_prompt(tiny, forecast_file):
    """Per-prompt hits/misses add up to the batch totals and differ between prompts of
    different lengths; a prompt's decode_tok_s is its own (tokens over its own steps)."""
    llm = _llm(tiny, forecast_file, "sparse-offload", {})
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (300, 90)]
    out = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=24, ignore_eos=True)
    a, b = out[0].stats["offload"], out[1].stats["offload"]
    assert a["hits"] + a["misses"] > 0 and b["hits"] + b["misses"] > 0
    assert (a["hits"], a["misses"]) != (b["hits"], b["misses"])
    assert a["bytes_copied"] == 2 * a["misses"] * SMALL["block_size"] * llm.shape.head_dim * 4
    assert "copy_ms" not in a  # timing is off unless asked (offload_timing=True)
    # each request's tokens over its own decode time: both ran every step of the batch
    assert out[0].stats["decode_tok_s"] == pytest.approx(out[1].stats["decode_tok_s"], rel=0.2)
    assert out[0].stats["decode_tok_s"] > 0
    # per call, shared by its prompts: the cache allocation, and no graph capture on the CPU
    assert out[0].stats["cache_alloc_ms"] == out[1].stats["cache_alloc_ms"] > 0
    assert out[0].stats["graph_capture_ms"] == out[1].stats["graph_capture_ms"] == 0.0


def test_decode_tok_s_of_a_prompt_that_stops_early_is_its_own_rate(tiny, forecast_file, monkeypatch):
    """U6: a prompt that stopped early showed its tokens over the whole batch's decode time
    (1.8 tok/s instead of 17.8). Every row decodes one token per step while it runs, so the
    rate of a row that stops at EOS equals that of the row that runs on, and both equal the
    batch's steps over the decode time (clock stubbed: 10 ms per step)."""
    import time as time_mod

    llm = _llm(tiny, forecast_file, "sparse", {})
    for _ in range(12):  # a random tiny model can repeat itself: draw prompts until row 0 has a token of its own
        prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (50, 80)]
        free = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=30, ignore_eos=True)
        first = free[0].token_ids
        candidates = [t for t in first[4:29] if t not in free[1].token_ids and first.index(t) >= 4]  # decodes >= 4
        if candidates:
            break
    assert candidates, "row 0 produced no token of its own to stop at in 12 draws of prompts"
    eos = candidates[int(torch.randint(len(candidates), ()))]
    monkeypatch.setattr(llm, "eos_ids", lambda: {eos})
    clock = {"now": 0.0}
    from sparda.engine.graph_runner import DecodeRunner

    step = DecodeRunner.step

    def step_10ms(self, *args, **kwargs):
        clock["now"] += 0.010
        return step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeRunner, "step", step_10ms)
    monkeypatch.setattr(time_mod, "perf_counter", lambda: clock["now"])
    out = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=30)
    short, long = out
    assert len(short.token_ids) == first.index(eos) + 1 < len(long.token_ids) == 30
    assert short.stats["decode_tok_s"] == long.stats["decode_tok_s"] == pytest.approx(100.0, rel=1e-6)


def test_offload_timing_on_the_cpu_counts_copies(tiny, forecast_file):
    llm = _llm(tiny, forecast_file, "sparse-offload", {"offload_timing": True})
    out = llm.generate(None, prompt_token_ids=[torch.randint(100, 20000, (200,)).tolist()],
                       max_new_tokens=8, ignore_eos=True)[0].stats["offload"]
    assert out["misses"] > 0 and out["copy_ms"] > 0 and out["exposed_wait_ms"] == out["copy_ms"]


@pytest.mark.parametrize("method,extra", [("sparse", {}), ("sparda", {"offload": True}), ("h2o", {})],
                         ids=["sparse", "sparda-offloaded", "h2o"])
def test_generate_rounds_the_cache_capacity(tiny, forecast_file, monkeypatch, method, extra):
    """``generate`` allocates a capacity rounded up to ``CAPACITY_ROUND`` tokens (within the
    model's context) so that calls of similar lengths share decode shapes; the extra
    capacity changes no token against an exact-capacity cache (prompts of different
    lengths, a generation that crosses the dense fallback)."""
    from sparda.engine import runner as llm_module

    llm = _llm(tiny, forecast_file, method, extra)
    limit = llm.shape.max_positions
    for tokens in torch.randint(1, limit + 1, (200,)).tolist() + [1, limit, 512, 513]:
        cap = llm.cache_capacity(tokens)
        assert tokens <= cap <= max(tokens, limit) and cap - tokens < llm_module.CAPACITY_ROUND
        assert cap % llm_module.CAPACITY_ROUND == 0 or cap == limit
    made = []
    real = llm.model_runner.new_cache
    monkeypatch.setattr(llm.model_runner, "new_cache",
                        lambda batch, capacity, **kw: made.append(capacity) or real(batch, capacity, **kw))
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (int(torch.randint(120, 150, ())), 70)]
    rounded = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=40, ignore_eos=True)
    monkeypatch.setattr(llm_module, "CAPACITY_ROUND", 1)
    exact = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=40, ignore_eos=True)
    want = max(map(len, prompts)) + 40
    assert made == [max(want, min(-(-want // 512) * 512, limit)), want] and made[0] > want
    assert [o.token_ids for o in rounded] == [o.token_ids for o in exact]
