"""Two-layer lookahead (design §6.2) in the offloaded runtime: early copies and their schedule.

* the schedule against a brute-force simulation of which blocks are resident in every
  layer's slots when, given random sequences of selections (the runtime's selections are
  replaced by them): slot maps, hits, misses and early copies equal, every resident block
  holds its host bytes, and the calls run in the order of design §6.2;
* the two-ahead selection against a float64 brute force of the visibility rule;
* greedy tokens of ``lookahead=2`` equal those of ``lookahead=1`` (bf16 / int8 / mixed KV), and
  the fused decode step equals the unfused one with the two-ahead heads stacked in.

The option, the weight files and training: tests/test_forecast2.py. Tiny random models with
small blocks (block 16, kernel 8, stride 4, dense_len 0), so that selection drops blocks at
short lengths.
"""

from __future__ import annotations

import math

import pytest
import torch

from sparda.attention.forecast import load_forecast
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from test_forecast2 import SMALL, tiny, weights  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


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


# ------------------------------------------------------ the schedule, brute force

def _selection(gen, cur: int, prev: set[int] | None, cfg: SelectionConfig, reuse: float) -> set[int]:
    """Forced blocks plus ``topk`` others, each kept from ``prev`` with probability ``reuse``."""
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    free = [b for b in range(cur + 1) if b not in forced]
    keep = [b for b in sorted(prev or ()) if b in free and float(torch.rand((), generator=gen)) < reuse]
    rest = [b for b in free if b not in keep]
    order = torch.randperm(len(rest), generator=gen).tolist()
    return forced | set(keep[:cfg.topk_blocks]) | {rest[i] for i in order[:cfg.topk_blocks - len(keep[:cfg.topk_blocks])]}


def _prediction(gen, final: set[int], cur: int, cfg: SelectionConfig, recall: float) -> set[int]:
    """A two-ahead prediction of ``final``: its forced blocks, each free block kept with probability
    ``recall``, the others replaced by random blocks."""
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    free = sorted(final - forced)
    kept = {b for b in free if float(torch.rand((), generator=gen)) < recall}
    others = [b for b in range(cur + 1) if b not in forced and b not in kept]
    order = torch.randperm(len(others), generator=gen).tolist()
    return forced | kept | {others[i] for i in order[:len(free) - len(kept)]}


def _ids(sets, width: int) -> torch.Tensor:
    """``[B][H]`` sets of block ids -> ``[B, H, width]`` int32, ascending, ``-1`` padded."""
    out = torch.full((len(sets), len(sets[0]), width), -1, dtype=torch.int32)
    for b, row in enumerate(sets):
        for h, blocks in enumerate(row):
            out[b, h, :len(blocks)] = torch.tensor(sorted(blocks), dtype=torch.int32)
    return out


class Simulation:
    """design §6 and §6.2 as Python loops over one (row, KV head): slots, hits, misses, early copies."""

    def __init__(self, slots: int) -> None:
        self.map = [-1] * slots
        self.read: set[int] = set()  # slots the last fetch selected (what attention read)
        self.hits = self.misses = self.early = 0

    def fetch(self, want: set[int], cur: int) -> None:
        want = want - {cur}
        missed = sorted(b for b in want if b not in self.map)
        self.hits += sum(1 for b in self.map if b >= 0 and b in want)
        free = [s for s, b in enumerate(self.map) if b < 0] + [s for s, b in enumerate(self.map)
                                                              if b >= 0 and b not in want]
        for block, slot in zip(missed, free):
            self.map[slot] = block
        self.misses += len(missed)
        self.read = {s for s, b in enumerate(self.map) if b in want}

    def warm(self, predicted: set[int], cur: int) -> None:
        predicted = predicted - {cur}
        missed = sorted(b for b in predicted if b not in self.map)
        free = [s for s, b in enumerate(self.map) if b < 0] + [s for s, b in enumerate(self.map)
                                                              if b >= 0 and b not in predicted and s not in self.read]
        for block, slot in zip(missed, free):  # misses beyond the open slots are not copied
            self.map[slot] = block
            self.early += 1


def _replace_selections(cache, schedule: list, plan: dict):
    """Make ``cache.fetch`` / ``cache.warm`` use ``plan[(kind, layer)]`` ids (``kind`` "fetch" or
    "warm") and log ``(kind, layer)`` in ``schedule``."""
    fetch, warm = cache.fetch, cache.warm

    def new_fetch(layer, selection, pos, prefetch=False, counters=None):
        schedule.append(("fetch", layer))
        return fetch(layer, plan[("fetch", layer)], pos, prefetch, counters)

    def new_warm(layer, selection, pos):
        schedule.append(("warm", layer))
        return warm(layer, plan[("warm", layer)], pos)

    cache.fetch, cache.warm = new_fetch, new_warm


def _design_schedule(num_layers: int, lookahead: int, offloaded) -> list:
    """The calls of one decode step, design §6 / §6.2: in layer ``l`` the fetch of layer 0 (layer 0
    only), then of layer ``l+1``, then the early copy of layer ``l+2``."""
    calls = []
    for layer in range(num_layers):
        if layer == 0 and 0 in offloaded:
            calls.append(("fetch", 0))
        if layer + 1 < num_layers and layer + 1 in offloaded:
            calls.append(("fetch", layer + 1))
        if lookahead == 2 and layer + 2 < num_layers and layer + 2 in offloaded:
            calls.append(("warm", layer + 2))
    return calls


@pytest.mark.parametrize("recall,slot_factor,resident", [(0.7, 1.5, ()), (1.0, 1.0, (1,)), (0.3, 2.0, (0,))])
def test_schedule_matches_brute_force_residency(tiny, weights, recall, slot_factor, resident, fresh_seed):
    """Random selections replayed through the runtime with lookahead 1 and 2: after every step every
    offloaded layer's block map equals the simulation's, every slot holds its block's host bytes,
    the calls run in the design's order, and the hit / miss / early-copy counts equal the
    simulation's. With a perfect prediction (recall 1) lookahead 2 leaves fewer blocks to copy late."""
    gen = torch.Generator().manual_seed(fresh_seed)
    where = f"seed {fresh_seed}, recall {recall}, slot_factor {slot_factor}"
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (150, 113)]
    steps = 40
    totals = {}
    for lookahead in (1, 2):
        llm = _llm(tiny, weights, lookahead, resident=resident, slot_factor=slot_factor)
        cfg, num_layers = llm.config.selection, llm.shape.num_layers
        heads = llm.shape.num_kv_heads
        cache = llm.new_cache(len(prompts), max(map(len, prompts)) + steps + 1)
        for row, ids in enumerate(prompts):
            llm.prefill(cache, row, ids)
        offloaded = set(cache.offloaded)
        sims = {(layer, b, h): Simulation(cache.slots) for layer in offloaded for b in range(2) for h in range(heads)}
        schedule, plan = [], {}
        _replace_selections(cache, schedule, plan)
        sel_gen = torch.Generator().manual_seed(fresh_seed + 1)  # the same selections for both runs
        last: dict = {}
        tokens, positions = torch.tensor([7, 9]), torch.tensor([len(p) for p in prompts])
        for step in range(steps):
            curs = [int(p) // cfg.block_size for p in positions]
            for layer in range(num_layers):
                final = [[_selection(sel_gen, curs[b], last.get((layer, b, h)), cfg, 0.8) for h in range(heads)]
                         for b in range(2)]
                early = [[_prediction(sel_gen, final[b][h], curs[b], cfg, recall) for h in range(heads)]
                         for b in range(2)]
                for b in range(2):
                    for h in range(heads):
                        last[(layer, b, h)] = final[b][h]
                plan[("fetch", layer)] = _ids(final, cache.select_width)
                plan[("warm", layer)] = _ids(early, cache.select_width)
            schedule.clear()
            out = llm.decode(cache, tokens, positions)
            assert schedule == _design_schedule(num_layers, lookahead, offloaded), where
            for kind, layer in schedule:  # the simulation, in the runtime's order
                for b in range(2):
                    for h in range(heads):
                        blocks = {int(x) for x in plan[(kind, layer)][b, h] if x >= 0}
                        getattr(sims[(layer, b, h)], kind)(blocks, curs[b])
            for (layer, b, h), sim in sims.items():
                got = cache.slot_map[layer][b, h].tolist()
                assert got == sim.map, (where, lookahead, step, layer, b, h)
                for slot, block in enumerate(got):  # what attention may read is the host's bytes
                    if 0 <= block < curs[b]:
                        k, v = cache.host.block(layer, b, h, block)
                        assert torch.equal(cache.k_slots[layer][b, h, slot], k), (where, step, layer, block)
                        assert torch.equal(cache.v_slots[layer][b, h, slot], v), (where, step, layer, block)
            tokens, positions = out.argmax(-1), positions + 1
        stats = cache.offload_stats(steps * 2)
        want = {key: sum(getattr(s, key) for s in sims.values()) for key in ("hits", "misses", "early")}
        assert (stats["hits"], stats["misses"], stats["early_copies"]) == (want["hits"], want["misses"],
                                                                           want["early"]), (where, lookahead)
        assert stats["bytes_copied"] == 2 * (want["misses"] + want["early"]) * cache.host.block_bytes
        totals[lookahead] = want
    assert totals[1]["early"] == 0 and totals[2]["early"] > 0, where
    if recall == 1.0:
        assert totals[2]["misses"] < totals[1]["misses"], (where, totals)


def test_early_copies_never_evict_the_last_selection(fresh_seed):
    """The early diff on a scripted block map: a prediction with more misses than open slots copies
    into the empty slot and the stale unprotected one only, in block order, keeps the slots of the
    last selection and of its own hit, and counts what it copied; the next fetch finds the early
    copy as a hit and replaces what the prediction got wrong first."""
    from sparda.cache.offload import OffloadKVCache

    del fresh_seed  # a fixed scenario
    cfg = SelectionConfig(block_size=4, kernel_size=4, kernel_stride=2, init_blocks=0, local_blocks=2,
                          topk_blocks=2, dense_len=0)
    cache = OffloadKVCache(3, 1, 1, 2, 64, cfg, torch.float32, "cpu", engine="sync", slot_factor=1.5)
    layer, pos = 2, torch.tensor([63])  # current block 15
    assert (cache.select_width, cache.slots) == (4, 6)
    cache.slot_map[layer][0, 0] = torch.tensor([3, 4, 5, 6, -1, 8])
    cache.attn_ids[layer][0, 0] = torch.tensor([3, -1, 5, -1, -1, 8, 15], dtype=torch.int32)  # last selection
    cache.warm(layer, torch.tensor([[[1, 2, 4, 9]]]), pos)  # 4 is held; misses 1, 2, 9
    assert cache.slot_map[layer][0, 0].tolist() == [3, 4, 5, 2, 1, 8]  # empty slot 4, then stale slot 3
    assert cache.early_load[layer][0, 0].tolist() == [-1, -1, -1, 2, 1, -1]  # 9 found no open slot
    assert int(cache.prefetcher.early[0]) == 2 and int(cache.prefetcher.misses[0]) == 0
    assert int(cache.prefetcher.hits[0]) == 0 and cache.attn_ids[layer][0, 0].tolist()[:3] == [3, -1, 5]
    cache.fetch(layer, torch.tensor([[[1, 3, 9, 15]]]), pos)  # the selection: 1 (early) and 3 hit, 9 misses
    assert cache.slot_map[layer][0, 0].tolist() == [3, 9, 5, 2, 1, 8]
    assert (int(cache.prefetcher.hits[0]), int(cache.prefetcher.misses[0])) == (2, 1)


# ------------------------------------------------- the visibility rule, float64

def _rope64(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("local_blocks", [2, 1])
def test_two_ahead_selection_matches_float64_brute_force(tiny, weights, local_blocks, fresh_seed):
    """The ids each early copy is asked for equal design §6.2's selection in float64 loops: ``F2_{l-2}``
    of layer ``l-2``'s input at ``t`` scores layer ``l``'s compressed keys whose window ends at or before
    ``t - 1`` (tokens that complete a window included), pooled and selected by §3.4. With
    ``local_blocks = 1`` (set past the validation, as in tests/test_lookahead.py) the window the token
    completes overlaps a block that competes for the top-k, so scoring it would be seen."""
    llm = _llm(tiny, weights, 2)
    cfg, s = llm.config.selection, llm.shape
    object.__setattr__(cfg, "local_blocks", local_blocks)  # the method and the cache share this object
    two = load_forecast(weights[1], llm.model.config, s, ahead=2)[0]
    n = int(torch.randint(160, 180, ()).item())
    split = int(torch.randint(100, 110, ()).item())  # past the 96-token budget: every step selects
    ids = torch.randint(0, 1000, (n,)).tolist()
    hidden, asked, now = {}, {}, {}
    attend, cache_ref = llm.method.attend, {}

    def spy_attend(layer, q, h, cache, step):
        hidden.setdefault(layer, []).append(h[0].double())
        if "warm" not in cache_ref:
            cache_ref["warm"] = cache.warm

            def warm(target, selection, pos):
                asked[(now["t"], target)] = selection[0].clone()
                return cache_ref["warm"](target, selection, pos)

            cache.warm = warm
        return attend(layer, q, h, cache, step)

    llm.method.attend = spy_attend
    cache = llm.new_cache(1, n)
    llm.prefill(cache, 0, ids[:split])
    with torch.no_grad():  # compressed keys not yet written hold large values: scoring one is seen
        for ck in cache.ck:
            ck[:, :, cache.num_compressed(split):] = 1e3 * torch.randn_like(ck[:, :, cache.num_compressed(split):])
    for t in range(split, n):
        now["t"] = t
        llm.decode(cache, torch.tensor([ids[t]]), torch.tensor([t]))
    hidden = {layer: torch.cat(rows) for layer, rows in hidden.items()}  # [n, d_model] per layer
    d, kernel, stride, bs = s.head_dim, cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    cos, sin = (x[0, 0].double() for x in llm.model.rotary(torch.arange(n).view(1, -1), torch.float32))
    completes = compared = 0
    for layer in range(2, s.num_layers):
        wk = llm.model.model.layers[layer].self_attn.k_proj.weight.detach().double()
        keys = _rope64((hidden[layer] @ wk.T).view(n, s.num_kv_heads, d).transpose(0, 1), cos, sin)
        w = two.scorer(layer).weight.detach().double()
        for t in range(split, n):
            completes += (t + 1 - kernel) % stride == 0
            f = _rope64((w @ hidden[layer - 2][t]).view(s.num_kv_heads, d), cos[t], sin[t])
            cur = t // bs
            for head in range(s.num_kv_heads):
                block = [-math.inf] * (cur + 1)
                j = 0
                while j * stride + kernel - 1 <= t - 1:  # the rule: windows complete before t
                    score = float(f[head] @ keys[head, j * stride:j * stride + kernel].mean(0))
                    for b in range(j * stride // bs, min((j * stride + kernel - 1) // bs, cur) + 1):
                        block[b] = max(block[b], score)
                    j += 1
                forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
                rest = sorted((b for b in range(cur + 1) if b not in forced), key=lambda b: (-block[b], b))
                top = [block[b] for b in rest[:cfg.topk_blocks + 1]]
                gap = abs(top[-2] - top[-1]) if len(top) > cfg.topk_blocks and math.isfinite(top[-1]) else 1.0
                if 0 < gap < 1e-4 * (1 + abs(top[-1])):
                    continue  # a near tie: fp32 may pick either block (exact ties go to the lower block)
                got = {int(x) for x in asked[(t, layer)][head] if x >= 0}
                assert got == forced | set(rest[:cfg.topk_blocks]), (fresh_seed, t, layer, head)
                compared += 1
    assert completes >= 10 and compared >= 0.9 * (n - split) * (s.num_layers - 2) * s.num_kv_heads


# ------------------------------------------------------------ same tokens

@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "mixed"])
def test_lookahead_two_gives_the_tokens_of_lookahead_one(tiny, weights, kv_dtype, fresh_seed):
    """Early copies change what is resident, never what is attended: the same greedy tokens and the
    logits up to summation order (fp32), over a batch of two lengths; blocks were copied early and
    fewer were left to copy late. With int8 storage a summation-order difference can flip the
    rounding of one stored element by one step, which then shows wherever its block is attended: a
    looser bound there (one such flip measured 2e-5 to 6e-5 per step)."""
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
    bound = 1e-5 if kv_dtype == "bf16" else 1e-3
    assert ((one - two).norm() / one.norm()).item() <= bound, where
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


def test_each_request_counts_only_its_own_early_copies(tiny, weights, fresh_seed):
    """Early copies are counted per cache row and zeroed with the row's other counters when a
    request takes the row: in a 2-row engine whose rows serve six requests in turn, each
    request's ``offload.early_copies`` is what its row's counter gained over the decode steps
    it ran (read around every step; free rows' padding steps count for nobody)."""
    from sparda import SamplingParams
    from sparda.engine.engine import Engine

    engine = Engine(_llm(tiny, weights, 2), max_batch=2, max_model_len=200)
    early, counted = engine.cache.prefetcher.early, {}
    original = engine.runner.decode

    def decode(cache, tokens, positions, max_position=None):
        owners = {row: seq.request_id for row, seq in engine.scheduler.running.items() if seq.prefilled}
        before = early.clone()
        out = original(cache, tokens, positions, max_position)
        for row, request in owners.items():
            counted[request] = counted.get(request, 0) + int(early[row] - before[row])
        return out

    engine.runner.decode = decode
    prompts = [torch.randint(100, 20000, (int(n),)).tolist() for n in torch.randint(90, 150, (6,))]
    seqs = [engine.add_request(ids, SamplingParams(max_tokens=int(m), ignore_eos=True))
            for ids, m in zip(prompts, torch.randint(4, 20, (6,)))]
    outputs = {}
    while engine.has_work():
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = delta.output
    got = {s.request_id: outputs[s.request_id].stats["offload"]["early_copies"] for s in seqs}
    assert got == {s.request_id: counted.get(s.request_id, 0) for s in seqs}, (fresh_seed, got, counted)
    assert sum(got.values()) > 0, fresh_seed


def test_derive_of_an_in_memory_model_keeps_the_two_ahead_heads(tiny, weights):
    """``LLM.from_model`` takes both Forecasts as modules (no file to reload them from):
    ``derive`` hands them on, the two-ahead heads only while ``lookahead=2``."""
    from sparda.engine.llm import LLM

    base = _llm(tiny, weights, 1)
    one, two = (load_forecast(path, base.model.config, base.shape, ahead=a)[0] for path, a in zip(weights, (1, 2)))
    llm = LLM.from_model(base.model, method="sparda", offload=True, lookahead=2, forecast=one, forecast2=two, **SMALL)
    other = llm.derive(cuda_graphs=False)
    for mine, ref in ((other.method.forecast, one), (other.method.forecast2, two)):
        assert all(torch.equal(a, b) for a, b in zip(mine.state_dict().values(), ref.state_dict().values()))
    assert llm.derive(lookahead=1).method.forecast2 is None


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


# ------------------------------------------------------------ recorded predictions

def test_recorded_two_ahead_predictions_are_the_engines_early_copies(tiny, weights, fresh_seed):
    """A trace's ``early`` (``record_selection(..., forecast2=)``, docs/bench.md) holds what the
    offloaded ``lookahead=2`` engine asks its early copies for, step by step (that selection is
    checked against float64 above) on the same teacher-forced tokens: layers 0 and 1 hold none,
    and the trace's ``ids`` stay the one-layer Forecast's selection."""
    from sparda.bench.traces import record_selection, reuse_stats
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="sparda", offload=True, device="cpu", forecast=weights[0], lookahead=2,
              forecast2=weights[1], **SMALL)
    one = load_forecast(weights[0], llm.model.config, llm.shape)[0]
    two = load_forecast(weights[1], llm.model.config, llm.shape, ahead=2)[0]
    prompt, steps = int(torch.randint(100, 130, ()).item()), 12
    seqs = [torch.randint(100, 20000, (prompt + steps,)).tolist() for _ in range(2)]
    trace = record_selection(llm.model, seqs, prompt, steps, ("sparda",), forecast=one, forecast2=two,
                             **SMALL)["sparda"]
    assert trace.early is not None and trace.early.shape == trace.ids.shape
    assert (trace.early[:, :, :2] == -1).all() and (trace.early[:, :, 2:] >= 0).any()
    asked, fetched = {}, {}
    cache = llm.new_cache(2, prompt + steps)
    for row, seq in enumerate(seqs):
        llm.prefill(cache, row, seq[:prompt])
    warm, fetch, now = cache.warm, cache.fetch, {}

    def spy_warm(target, selection, pos):
        asked[(now["s"], target)] = selection.clone()
        return warm(target, selection, pos)

    def spy_fetch(layer, selection, pos, prefetch=False, counters=None):
        fetched.setdefault((now["s"], layer), selection.clone())
        return fetch(layer, selection, pos, prefetch, counters)

    cache.warm, cache.fetch = spy_warm, spy_fetch
    for s in range(steps):
        now["s"] = s
        llm.decode(cache, torch.tensor([seq[prompt + s] for seq in seqs]), torch.full((2,), prompt + s))
    for (table, got) in ((trace.early, asked), (trace.ids, fetched)):
        same = total = 0
        for (s, layer), ids in got.items():
            for row in range(2):
                for head in range(llm.shape.num_kv_heads):
                    want = {int(x) for x in table[s, row, layer, head] if x >= 0}
                    same += want == {int(x) for x in ids[row, head] if x >= 0}
                    total += 1
        # fp32 in two code paths: a near tie may go either way
        assert total >= steps * 2 * 3 * llm.shape.num_kv_heads and same >= 0.97 * total, (fresh_seed, same, total)
    stats = reuse_stats(trace)
    assert 0.0 <= stats["early_recall"] <= 1.0 and 0.0 <= stats["early_fresh"] <= 1.0
