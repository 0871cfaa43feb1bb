"""``--kv-dtype mixed`` with its hot-pool bookkeeping in the slot diff and its token stores in the
fused append (design §6.1) against the bookkeeping it replaced: ``OldBookkeeping`` of
benchmarks/check_mixed.py (the hot rule, the demoted slots and the pool / cold split in PyTorch
around a plain slot diff, the token written to the pool and the int4 store after the append),
its rule and split replaced here by copies of the code as it was. Offloaded ``sparda`` on a tiny
fp32 model (5 layers), lookahead 1 and 2 (early copies, design §6.2), the fused decode step of
CUDA on the CPU twins: the same logits, hot states, slot maps, slot contents, host bytes and
counters at every step; the ops one decode step issues per offloaded layer stay within
:data:`MIXED_OPS_PER_LAYER` (:mod:`sparda.bench.op_count`), near bf16 and int8; and the GPU
check script runs its kernel and parity checks on the CPU."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sparda.bench.op_count import decode_op_counts, force_fused, twin_engine
from sparda.kernels.twins import ids_to_block_mask
from test_forecast2 import SMALL, tiny, weights  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")

#: counted ops of one decode step in an offloaded layer's iteration (its attention, the next
#: layer's selection, slot diff and copies): bf16 and int8 issue 14 on the tiny model, mixed two
#: more copies (the pool gather and the cold dequantisation)
MIXED_OPS_PER_LAYER = 16


def _check_mixed():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "check_mixed.py"
    spec = importlib.util.spec_from_file_location("check_mixed", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------- the replaced rule, as it was
def _old_update(hot, layer, ids, pos):
    """``HotBlocks.update`` as it was: the rule in PyTorch, the demoted blocks returned."""
    p = pos.view(-1, 1, 1)
    cur = p // hot.block_size
    n = torch.arange(hot.num_blocks).view(1, 1, -1)
    picked = ids_to_block_mask(ids, hot.num_blocks) | ((n > cur - hot.local) & (n <= cur))
    last = hot.last[layer]
    last.copy_(torch.where(picked, p, last))
    state = hot.hot[layer]
    keep = (state & (p - last < hot.steps) & (n > cur - hot.pool_blocks)) | (n == cur)
    demoted = state & ~keep
    state.copy_(keep)
    return demoted


def _old_split(hot, layer, load, pos=None):
    """``HotBlocks.split`` as it was."""
    is_hot = torch.gather(hot.hot[layer], -1, load.clamp(min=0)) & (load >= 0)
    if pos is not None:
        is_hot &= load > (pos // hot.block_size).view(-1, 1, 1) - hot.pool_blocks
    return torch.where(is_hot, load % hot.pool_blocks, -1), torch.where(is_hot | (load < 0), -1, load)


def _llm(tiny, weights, lookahead):
    from sparda.engine.llm import LLM

    two = dict(lookahead=2, forecast2=weights[1]) if lookahead == 2 else {}
    llm = LLM(str(tiny), method="sparda", offload=True, device="cpu", forecast=weights[0], kv_dtype="mixed",
              kv_hot_steps=2, kv_hot_blocks=4, **SMALL, **two)
    force_fused(llm.model_runner)  # CUDA's decode step, on the twins
    return llm


def _snapshot(cache):
    layers = cache.offloaded
    return ([cache.hot.hot[l].clone() for l in layers] + [cache.hot.last[l].clone() for l in layers]
            + [cache.slot_map[l].clone() for l in layers] + [cache.k_slots[l].clone() for l in layers]
            + [cache.v_slots[l].clone() for l in layers])


def _host_bytes(cache):
    out = []
    for layer in cache.offloaded:
        for c in cache.host.chunks[layer]:
            out += [c.k.data, c.k.scale, c.v.data, c.v.scale]
        for c in cache.host.pool[layer]:
            out += [c.k, c.v]
    return out


@pytest.mark.parametrize("lookahead", [1, 2])
def test_fused_bookkeeping_equals_the_replaced_one(tiny, weights, lookahead, fresh_seed):
    """Two rows of 150 and 97 tokens, 48 greedy steps (the pool of 4 blocks wraps, blocks are
    demoted, pool and cold copies both happen): every step's logits, hot state, slot maps and
    slots are equal, and at the end the host store, the pool and the counters."""
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (150, 97)]
    steps = 48
    runs = []
    for old in (False, True):
        llm = _llm(tiny, weights, lookahead)
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
        if old:
            cache.__class__ = _check_mixed().OldBookkeeping  # the sync engine: the append's stores after it
            cache.hot.update = functools.partial(_old_update, cache.hot)
            cache.hot.split = functools.partial(_old_split, cache.hot)
        else:
            twin_engine(cache)  # CUDA's path: the fused append writes the store and the pool
        assert (cache._fused_host(1) is None) == old
        first = torch.stack([llm.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)])
        runs.append((llm, cache, first))
    (new_llm, new_c, first), (old_llm, old_c, old_first) = runs
    assert torch.equal(first, old_first)
    tokens, positions = first.argmax(-1), torch.tensor([len(p) for p in prompts])
    where = f"lookahead {lookahead}, seed {fresh_seed}"
    demoted = 0
    for step in range(steps):
        hot_before = [t.clone() for t in old_c.hot.hot.values()]
        a = new_llm.decode(new_c, tokens, positions)
        b = old_llm.decode(old_c, tokens, positions)
        assert torch.equal(a, b), (where, step, ((a - b).norm() / b.norm()).item())
        for got, want in zip(_snapshot(new_c), _snapshot(old_c), strict=True):
            assert torch.equal(got, want), (where, step)
        demoted += sum(int((h & ~n).sum()) for h, n in zip(hot_before, old_c.hot.hot.values()))
        tokens, positions = b.argmax(-1), positions + 1
    for got, want in zip(_host_bytes(new_c), _host_bytes(old_c), strict=True):
        assert torch.equal(got, want), where
    sa, sb = (c.offload_stats(steps * len(prompts)) for c in (new_c, old_c))
    assert (sa.pop("engine"), sb.pop("engine")) == ("twin", "sync") and sa == sb, where
    assert demoted > 0 and 0 < sa["pool_misses"] < sa["misses"], (where, demoted, sa)
    if lookahead == 2:
        assert sa["early_copies"] > 0, where


def test_mixed_ops_per_layer_stay_near_the_other_dtypes(tiny, weights):
    """A decode step of offloaded ``sparda`` counted as CUDA launches it (:mod:`sparda.bench.op_count`,
    the fused step on the twins): in every offloaded layer that fetches for the next one, mixed
    issues at most :data:`MIXED_OPS_PER_LAYER` ops, two more than bf16 and int8 (its pool gather and
    cold dequantisation); before its bookkeeping moved into the slot diff and the append it was 98."""
    from sparda.engine.llm import LLM

    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (150, 97)]
    per_layer = {}
    for kv in ("bf16", "int8", "mixed"):
        llm = LLM(str(tiny), method="sparda", offload=True, device="cpu", forecast=weights[0], kv_dtype=kv, **SMALL)
        force_fused(llm.model_runner)
        counter = decode_op_counts(llm.model_runner, prompts, warmup=2, steps=1)[0]
        layers = sorted(k for k in counter.per_layer() if isinstance(k, int))
        per_layer[kv] = max(counter.per_layer()[layer] for layer in layers[1:-1])
        if kv == "mixed":
            ops = counter.breakdown(layers[1])
            assert ops.get("kernels.slot_diff") == 1 and ops.get("kernels.rope_append") == 1, ops
    assert per_layer["mixed"] <= MIXED_OPS_PER_LAYER, per_layer
    assert per_layer["mixed"] <= per_layer["int8"] + 2 and per_layer["int8"] == per_layer["bf16"], per_layer


def test_gpu_check_script_runs_on_the_cpu(capsys, tmp_path):
    """benchmarks/check_mixed.py parses its options and, on the CPU (twins), runs its kernel and
    parity checks on the tiny shape: every line identical; ``--out`` (as benchmarks/gpu_checks.sh
    passes it) gets the verdict."""
    script = _check_mixed()
    args = script.parse_args([])
    assert (args.device, args.model, args.checks, args.out) == ("cuda", "minicpm-8b", "kernels,parity,speed", None)
    assert script.main(["--device", "cpu", "--model", "tiny", "--context", "400", "--steps", "2", "--batch", "2",
                        "--checks", "kernels,parity", "--out", str(tmp_path / "mixed")]) == 0
    out = capsys.readouterr().out
    assert out.count("identical=True") == 7 and out.strip().endswith("OK"), out
    record = json.loads((tmp_path / "mixed" / "check_mixed.json").read_text())
    assert record["ok"] is True and record["options"]["checks"] == "kernels,parity" and record["speed"] == []
