"""KV-pool sizing (design §3.11): the bytes ``ModelRunner.kv_bytes`` predicts are the bytes the
caches allocate (counted tensor by tensor), and ``plan_rows`` keeps the pool within the budget,
against a brute force over row counts."""

from __future__ import annotations

import pytest
import torch

from sparda.engine.llm import LLM
from sparda.engine.memory import plan_rows
from sparda.errors import SpardaError
from sparda.kernels import quant

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3, cuda_graphs=False, dense_heads="none")
# method, LLM options
CASES = [("dense", {}), ("sparse", {"kv_dtype": "int8"}), ("sparse", {"kv_dtype": "int4"}),
         ("sparse-offload", {}), ("sparse-offload", {"kv_dtype": "int8"}), ("sparse-offload", {"kv_dtype": "mixed"}),
         ("sparse-offload", {"kv_dtype": "mixed", "kv_hot_blocks": 9}), ("sparse-offload", {"slot_factor": 2.5}),
         ("shallow", {"shallow_layers": 2, "offload": True}), ("sparda-random", {}), ("quest", {}),
         ("quest", {"kv_dtype": "int8"}), ("h2o", {}), ("snapkv", {}), ("shallow", {"shallow_layers": 1})]


def _tensors(value):
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, quant.QuantizedKV):
        yield value.data
        yield value.scale
    elif torch.is_tensor(value):
        yield value


def _allocated(cache, method) -> tuple[int, int]:
    """``(device, host)`` bytes of K/V, slots and their maps, compressed keys, rings, the hot
    blocks' state and the selector's per-row state, tensor by tensor."""
    state = 0 if method.state is None else sum(t.nbytes for t in _tensors(method.state.of(cache)))
    if not cache.offload:
        names = ("k", "v", "ck", "ring")
        return sum(t.nbytes for name in names for t in _tensors(getattr(cache, name))) + state, 0
    names = ("k_slots", "v_slots", "k_full", "v_full", "ck", "ring", "cold_k", "cold_v", "slot_map", "load",
             "attn_ids", "attn_blocks", "attn_slots")
    device = state + sum(t.nbytes for name in names for t in _tensors(getattr(cache, name)))
    if cache.hot is not None:
        device += sum(t.nbytes for t in _tensors([cache.hot.hot, cache.hot.last, cache.host.pool_table.table]))
    device += cache.block_table.nbytes
    host = sum(t.nbytes for chunks in (cache.host.chunks, cache.host.pool) for layer in chunks.values()
               for chunk in layer for t in _tensors([chunk.k, chunk.v]))
    return device, host


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.mark.parametrize("method,options", CASES, ids=[m + "".join(f"-{k}={v}" for k, v in o.items()) for m, o in CASES])
def test_predicted_bytes_are_the_allocated_bytes(tiny, method, options, fresh_seed):
    llm = LLM(str(tiny), method=method, device="cpu", **SMALL, **options)
    batch, capacity = int(torch.randint(1, 5, ())), int(torch.randint(20, 400, ()))
    cache = llm.new_cache(batch, capacity)
    assert llm.model_runner.kv_bytes(batch, capacity) == _allocated(cache, llm.method), (batch, capacity,
                                                                                          f"seed={fresh_seed}")


def test_plan_rows_is_the_largest_pool_within_the_budget(tiny, fresh_seed):
    """On the CPU every byte is host memory: rows = min(max_batch, largest n with bytes(n) <= budget)."""
    llm = LLM(str(tiny), method="sparse-offload", device="cpu", **SMALL)
    runner = llm.model_runner
    capacity = int(torch.randint(64, 2048, ()))
    row = sum(runner.kv_bytes(1, capacity))
    for _ in range(20):
        budget = int(torch.randint(row, 40 * row, ()))
        max_batch = int(torch.randint(1, 48, ()))
        plan = plan_rows(runner, capacity, max_batch, host_memory_gib=budget / 2**30)
        fits = max(n for n in range(1, 64) if sum(runner.kv_bytes(n, capacity)) <= budget)
        assert plan.rows == min(max_batch, fits), (budget, max_batch, f"seed={fresh_seed}")
        assert plan.host_bytes == sum(runner.kv_bytes(plan.rows, capacity)) <= budget
        assert f"KV pool {plan.rows} rows x {capacity} tokens" in plan.line()
    with pytest.raises(SpardaError, match=rf"^one KV row of {capacity} tokens does not fit: it needs host .*"
                                          r"--host-memory-gib.*lower --max-model-len"):
        plan_rows(runner, capacity, 8, host_memory_gib=(row - 1) / 2**30)
