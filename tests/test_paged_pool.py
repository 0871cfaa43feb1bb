"""The paged host KV pool behind the engine (design §3.11): ``plan_pool`` keeps within the
host budget against a brute force over rows and blocks, the bytes it predicts are the bytes
the cache allocates, and an engine whose budget holds ``R`` full rows serves several times
``R`` short requests at once with the tokens an unpaged engine gives them."""

from __future__ import annotations

import pytest
import torch

from sparda import LLM, SamplingParams
from sparda.engine.engine import Engine
from sparda.engine.memory import plan_pool
from sparda.errors import SpardaError

from test_memory import SMALL, _allocated

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.mark.parametrize("method,options", [("sparse-offload", {}), ("sparse-offload", {"kv_dtype": "int8"}),
                                            ("sparse-offload", {"kv_dtype": "mixed"}), ("sparda-random", {})])
def test_paged_bytes_are_the_allocated_bytes(tiny, method, options, fresh_seed):
    runner = LLM(str(tiny), method=method, device="cpu", **SMALL, **options).model_runner
    batch, capacity = int(torch.randint(1, 5, ())), int(torch.randint(20, 400, ()))
    blocks = int(torch.randint(1, 3 * batch * -(-capacity // SMALL["block_size"]), ()))
    cache = runner.new_cache(batch, capacity, host_blocks=blocks)
    assert runner.kv_bytes(batch, capacity, host_blocks=blocks) == _allocated(cache, runner.method), (
        batch, capacity, blocks, f"seed={fresh_seed}")
    assert runner.host_block_bytes() == (runner.kv_bytes(batch, capacity, host_blocks=blocks + 1)[1]
                                         - runner.kv_bytes(batch, capacity, host_blocks=blocks)[1])


def test_plan_pool_is_the_largest_pool_within_the_budget(tiny, fresh_seed):
    """On the CPU every byte is host memory: rows = min(max_batch, largest n whose n rows with
    one block each fit), blocks = the most (at most every row's capacity) that fit beside them."""
    runner = LLM(str(tiny), method="sparse-offload", device="cpu", **SMALL).model_runner
    capacity = int(torch.randint(256, 2048, ()))
    full = -(-capacity // SMALL["block_size"])
    row, least = sum(runner.kv_bytes(1, capacity)), sum(runner.kv_bytes(1, capacity, host_blocks=1))
    for _ in range(12):
        budget = int(torch.randint(least, 6 * row, ()))
        max_batch = int(torch.randint(1, 48, ()))
        plan = plan_pool(runner, capacity, max_batch, host_memory_gib=budget / 2**30)
        fits = max(n for n in range(1, 200) if sum(runner.kv_bytes(n, capacity, host_blocks=n)) <= budget)
        assert plan.rows == min(max_batch, fits), (budget, max_batch, f"seed={fresh_seed}")
        most = max(b for b in range(1, plan.rows * full + 1)
                   if sum(runner.kv_bytes(plan.rows, capacity, host_blocks=b)) <= budget)
        assert plan.host_bytes == sum(runner.kv_bytes(plan.rows, capacity, host_blocks=most)) <= budget
        if most == plan.rows * full:  # every row whole: unpaged
            assert plan.host_blocks is None and f"KV pool {plan.rows} rows x {capacity} tokens" in plan.line()
        else:
            assert plan.host_blocks == most, (budget, max_batch, f"seed={fresh_seed}")
            assert f"{plan.host_blocks} host blocks of {SMALL['block_size']} tokens" in plan.line()
    with pytest.raises(SpardaError, match=rf"^one KV row of {capacity} tokens does not fit: .*--host-memory-gib"
                                          r".*lower --max-model-len"):
        plan_pool(runner, capacity, 8, host_memory_gib=(least - 1) / 2**30)
    with pytest.raises(SpardaError) as refused:  # on the CPU there is no GPU budget to name
        plan_pool(runner, capacity, 8, host_memory_gib=(least - 1) / 2**30)
    assert "gpu-memory" not in str(refused.value)


def _serve(engine, prompts, max_tokens):
    """All requests at once; run to the end; the most rows held in one step and the outputs."""
    seqs = [engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True, logprobs=0))
            for ids, m in zip(prompts, max_tokens)]
    outputs, peak = {}, 0
    while engine.has_work():
        done = [delta for delta in engine.step() if delta.output is not None]
        outputs.update((delta.request_id, delta.output) for delta in done)
        peak = max(peak, engine.scheduler.rows_in_use + len(done))  # rows held during the step
        if engine.scheduler.block_pool is not None:  # blocks held: ceil((prompt + max_tokens) / bs) each
            held = sum(-(-(len(ids) + m) // SMALL["block_size"]) for s, ids, m in zip(seqs, prompts, max_tokens)
                       if s.request_id not in outputs)
            assert engine.metrics()["kv_blocks_used"] == held
    return peak, [outputs[s.request_id] for s in seqs]


# kv_dtype: rows a host budget of two unpaged rows must hold (on the CPU the device part, in
# the model dtype, is host memory too: quantised stores shrink the pages, not the rows;
# ``mixed`` adds a bf16 hot pool per row)
FLOORS = {"bf16": 8, "int8": 6, "mixed": 2}


@pytest.mark.parametrize("kv_dtype", sorted(FLOORS))
def test_a_budget_of_r_full_rows_serves_many_short_requests(make_tiny, kv_dtype, fresh_seed):
    """Eight layers (one resident): a row's device part is a fraction of a full row, so a host
    budget of two unpaged rows holds several paged ones with the blocks short requests need
    (reserved up front here; growing on demand: tests/test_preemption.py), and each request
    gets the tokens and log-probabilities an unpaged engine gives it."""
    options = {**SMALL, "kernel_size": 16, "kernel_stride": 16, "kv_dtype": kv_dtype}
    llm = LLM(str(make_tiny("llama", num_hidden_layers=8)), method="sparse-offload", device="cpu", **options)
    runner, mml, full_rows = llm.model_runner, 2048, 2
    budget = sum(runner.kv_bytes(full_rows, mml)) + 1000  # two rows of max_model_len, unpaged
    engine = Engine(llm, max_batch=8, max_model_len=mml, host_memory_gib=budget / 2**30, kv_admission="reserve")
    plan = engine.memory_plan
    assert plan.host_bytes <= budget and plan.rows >= FLOORS[kv_dtype], plan.line()
    assert plan.host_blocks >= plan.rows * 5, plan.line()  # prompts + max_tokens <= 80 tokens each
    count = plan.rows
    lengths = torch.randint(20, 71, (count,)).tolist()
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in lengths]
    max_tokens = torch.randint(2, 11, (count,)).tolist()
    peak, paged = _serve(engine, prompts, max_tokens)
    assert peak == count, (peak, count, f"seed={fresh_seed}")
    pool = engine.scheduler.block_pool
    assert pool.num_free == pool.num_blocks  # every block given back
    assert (engine.cache.block_table < 0).all()  # no row holds a page
    _, alone = _serve(Engine(llm, max_batch=count, max_model_len=mml), prompts, max_tokens)
    for i, (a, b) in enumerate(zip(paged, alone)):
        assert a.token_ids == b.token_ids, (i, f"seed={fresh_seed}")
        assert [e["logprob"] for e in a.logprobs] == pytest.approx([e["logprob"] for e in b.logprobs], abs=1e-5), (
            i, f"seed={fresh_seed}")
    room = plan.host_blocks * SMALL["block_size"]
    if room < mml:  # one request longer than the block pool: refused, naming the pool and the fix
        with pytest.raises(SpardaError, match=rf"exceeds the KV block pool of {room} tokens .*--host-memory-gib"):
            engine.add_request(list(range(50)), SamplingParams(max_tokens=room - 49, ignore_eos=True))
        fits = engine.add_request(list(range(50)), SamplingParams(max_tokens=room - 50, ignore_eos=True))
        engine.abort(fits.request_id)  # the largest that fits is queued
        with pytest.raises(SpardaError) as refused:
            engine.add_request(list(range(50)), SamplingParams(max_tokens=room - 49))
        assert refused.value.param == "max_tokens"  # the server's 400 names the field
        with pytest.raises(SpardaError, match=rf"^prompt of {room} tokens does not fit the KV block pool of {room} "
                                              r"tokens .*shorten the prompt or raise --host-memory-gib"):
            engine.add_request(list(range(room)), SamplingParams(max_tokens=1))
        unset = engine.add_request(list(range(30)), SamplingParams(max_tokens=None))  # capped at the pool
        assert unset.max_tokens == room - 30
        engine.abort(unset.request_id)
