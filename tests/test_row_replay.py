"""Per-row trace replay in the serving engine (:class:`sparda.bench.traces.RowReplayer`, the
server benchmark's ``--replay-trace``): what an offloaded cache fetches for a decoding row
against :func:`~sparda.bench.traces.replay_masks` computed directly for that row's start
position and request, at every step of the row's own count (wrap-around of the cycle
included); rows that do not decode pass on the method's own selection (an engine's cache then
drops it, design §3.13; tests/test_padding_rows.py) and keep their counters."""

from __future__ import annotations

import math
import zlib

import numpy as np
import pytest
import torch

from sparda import LLM, SamplingParams
from sparda.bench.traces import RowReplayer, SelectionTrace, replay_masks, two_ahead_ids
from sparda.cache.offload import OffloadKVCache
from sparda.config import SelectionConfig
from sparda.engine.engine import Engine
from sparda.errors import SpardaError
from sparda.kernels.reference import block_mask_to_indices
from test_bench import _synthetic_trace

pytestmark = pytest.mark.usefixtures("one_thread")

#: block 16, budget 1 + 2 + 3 blocks: rows past 96 tokens replay a mapped top-k
SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)
STEPS = 5  # trace steps: a cycle of 8


def _trace(seed: int) -> SelectionTrace:
    """A trace of 5 steps, 3 rows, 3 layers, 2 KV heads (forced blocks and a slowly changing top-k of 4)."""
    return _synthetic_trace(seed, steps=STEPS, rows=3)


def _key(trace: SelectionTrace, request_id: str) -> int:
    period = 2 * (trace.ids.shape[0] - 1)
    return zlib.crc32(request_id.encode()) % math.lcm(trace.ids.shape[1], period // math.gcd(7, period))


def _with_early(trace: SelectionTrace, seed: int) -> SelectionTrace:
    """``trace`` with recorded two-ahead predictions: another synthetic trace's ids, none at layer 0."""
    early = _synthetic_trace(seed + 1, steps=trace.ids.shape[0], rows=trace.ids.shape[1]).ids.copy()
    early[:, :, 0] = -1
    return SelectionTrace(trace.ids, trace.pos, trace.meta, early)


def _reference(trace, cfg, layers, heads, blocks, width, position, request_id, early=False):
    """``[period, L, H, width]`` int64: bench's replay of one row (replay_masks, block_mask_to_indices)."""
    period = 2 * (trace.ids.shape[0] - 1)
    masks = replay_masks(trace, layers, heads, cfg, [position], period, blocks, first_row=_key(trace, request_id),
                         early=early)
    ids = block_mask_to_indices(masks[:, :, 0], min(width, blocks))
    return torch.nn.functional.pad(ids, (0, width - ids.shape[-1]), value=-1)


def test_first_row_is_a_row_of_a_larger_batch(fresh_seed):
    rng = np.random.default_rng(fresh_seed)
    trace, cfg = _trace(fresh_seed), SelectionConfig(**SMALL)
    k, pos = int(rng.integers(0, 9)), int(rng.integers(200, 900))
    wide = replay_masks(trace, 3, 4, cfg, [pos] * (k + 2), 11, 64)
    rows = replay_masks(trace, 3, 4, cfg, [pos, pos], 11, 64, first_row=k)
    assert torch.equal(rows, wide[:, :, k:k + 2]), k
    # first_row k and k + lcm(R, period / gcd(7, period)) replay alike: the request keys lose nothing
    again = replay_masks(trace, 3, 4, cfg, [pos, pos], 11, 64, first_row=k + math.lcm(3, 8 // math.gcd(7, 8)))
    assert torch.equal(rows, again), k


@pytest.mark.parametrize("recall", [None, 0.5, "recorded"])
def test_row_ids_are_bench_replay_of_the_rows_own_steps(recall, fresh_seed):
    """Three rows, two start at different steps and lengths; row 2 sits out some steps (its
    counter stays, it passes on its own selection); 21 steps cross the cycle of 8 twice. The
    early copies: untouched (lookahead 1), modelled at a recall, or the trace's recorded ones."""
    rng = np.random.default_rng(fresh_seed)
    trace, cfg = _trace(fresh_seed), SelectionConfig(**SMALL)
    recorded = recall == "recorded"
    if recorded:
        trace, recall = _with_early(trace, fresh_seed), None
    cache = OffloadKVCache(3, 3, 2, 8, 1024, cfg, torch.float32, "cpu", resident_layers=(0,))
    got: list[tuple[str, int, torch.Tensor]] = []
    cache.fetch = lambda layer, ids, pos, prefetch=False, counters=None: got.append(("fetch", layer, ids.clone()))
    cache.warm = lambda layer, ids, pos: got.append(("warm", layer, ids.clone()))
    replayer = RowReplayer(trace, cache, recall=recall, recorded=recorded)
    starts = {1: (int(rng.integers(100, 500)), "req-a"), 2: (int(rng.integers(500, 900)), "req-b")}
    refs = {row: _reference(trace, cfg, 3, 2, cache.num_blocks, cache.select_width, p, rid)
            for row, (p, rid) in starts.items()}
    early = {row: two_ahead_ids(refs[row][:, :, None].to(torch.int32), cfg, [starts[row][0]], recall,
                                seed=_key(trace, starts[row][1]))[:, :, 0] for row in refs} if recall else {}
    if recorded:
        early = {row: _reference(trace, cfg, 3, 2, cache.num_blocks, cache.select_width, p, rid, early=True)
                 for row, (p, rid) in starts.items()}
        assert not torch.equal(early[1], refs[1])
    counts = {1: 0, 2: 0}
    replayer.on_decode_start(1, *starts[1])
    for step in range(21):
        if step == 3:
            replayer.on_decode_start(2, *starts[2])
        rows = [1] + ([2] if 3 <= step and step % 5 != 4 else [])
        own = torch.randint(-1, 60, (3, 2, cache.select_width - 2), dtype=torch.int32)
        replayer.before_decode_step(rows)
        got.clear()
        for layer in (1, 2):
            cache.fetch(layer, own, torch.zeros(3, dtype=torch.long))
            cache.warm(layer, own, torch.zeros(3, dtype=torch.long))
        replayer.after_decode_step(rows)
        assert [g[:2] for g in got] == [("fetch", 1), ("warm", 1), ("fetch", 2), ("warm", 2)]
        for kind, layer, ids in got:
            if kind == "warm" and recall is None and not recorded:  # lookahead 1: the early copies are left alone
                assert ids is not own and torch.equal(ids, own)
                continue
            assert ids.shape == (3, 2, cache.select_width), ids.shape
            assert torch.equal(ids[0, :, :-2], own[0]) and (ids[0, :, -2:] == -1).all()  # never decodes
            for row in (1, 2):
                if row in rows:
                    table = refs[row] if kind == "fetch" else early[row]
                    want = table[counts[row] % 8, layer]
                else:
                    want = torch.nn.functional.pad(own[row], (0, 2), value=-1)
                assert torch.equal(ids[row].long(), want.long()), (kind, step, row, layer, counts, fresh_seed)
        before = dict(counts)
        for row in rows:
            counts[row] += 1
        assert replayer.step.tolist() == [0, counts[1] % 8, counts[2] % 8], (step, before, rows)
    assert counts[1] == 21 and counts[2] > 8  # both wrapped


def test_order_keys_replay_the_bench_batch_rows(fresh_seed):
    """``keys="order"``: requests starting to decode at one position, in any rows, replay the rows
    of bench's batch (replay_masks of ``B`` rows) in the order they start; a recompute keeps the
    request's row; the key wraps at ``keys``."""
    rng = np.random.default_rng(fresh_seed)
    trace, cfg = _trace(fresh_seed), SelectionConfig(**SMALL)
    cache = OffloadKVCache(3, 3, 2, 8, 1024, cfg, torch.float32, "cpu", resident_layers=(0,))
    replayer = RowReplayer(trace, cache, keys="order")
    pos, period = int(rng.integers(100, 900)), 2 * (trace.ids.shape[0] - 1)
    bench = replay_masks(trace, 3, 2, cfg, [pos] * 3, period, cache.num_blocks)  # [period, L, 3, H, N]
    rows = [int(r) for r in rng.permutation(3)]  # bench row n starts decoding on cache row rows[n]
    for n, row in enumerate(rows):
        replayer.on_decode_start(row, pos, f"req-{fresh_seed}-{n}")
    for n, row in enumerate(rows):
        want = block_mask_to_indices(bench[:, :, n], min(cache.select_width, cache.num_blocks))
        want = torch.nn.functional.pad(want, (0, cache.select_width - want.shape[-1]), value=-1)
        assert torch.equal(replayer.ids[row].long(), want.long()), (n, row, fresh_seed)
    assert replayer.request_key(f"req-{fresh_seed}-1") == 1  # a recompute: the same bench row
    assert replayer.request_key("another") == 3 % replayer.keys
    with pytest.raises(SpardaError, match="'hash' or 'order'"):
        RowReplayer(trace, cache, keys="random")
    with pytest.raises(SpardaError, match="no two-ahead predictions"):
        RowReplayer(trace, cache, recorded=True)
    with pytest.raises(SpardaError, match="not both"):
        RowReplayer(_with_early(trace, fresh_seed), cache, recall=0.5, recorded=True)


def test_an_on_device_cache_is_refused():
    from sparda.cache.device import DeviceKVCache

    cache = DeviceKVCache(2, 1, 2, 8, 256, SelectionConfig(**SMALL), torch.float32, "cpu")
    with pytest.raises(SpardaError, match="offloaded"):
        RowReplayer(_trace(0), cache)


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), method="sparse-offload", device="cpu", cuda_graphs=False, dense_heads="none",
               prefill_chunk_tokens=32, **SMALL)


def _serve(llm, trace, requests, rows=3, max_model_len=512, **engine_options):
    """Run ``requests`` (``(at_step, request_id, prompt, max_tokens)``) through a server-like
    engine (chunked prefill of 32 tokens) with the trace replayed; per decode step the rows that
    decode, their request ids, the step counters before it and what the cache's own ``fetch``
    received (layer -> ids, pos)."""
    engine = Engine(llm, max_batch=rows, max_model_len=max_model_len, max_prefill_tokens=32 + rows,
                    **engine_options)
    cache, log = engine.cache, []
    fetch = cache.fetch

    def recorder(layer, ids, pos, prefetch=False, counters=None):
        log[-1]["fetched"][layer] = (ids.clone(), pos.clone())
        return fetch(layer, ids, pos, prefetch, counters)

    cache.fetch = recorder
    replayer = RowReplayer.attach(engine, trace)
    before = replayer.before_decode_step

    def observe(rows):
        log.append({"rows": list(rows), "ids": {r: engine.scheduler.running[r].request_id for r in rows},
                    "counters": replayer.step.clone(), "fetched": {}})
        before(rows)

    replayer.before_decode_step = observe
    params = {rid: SamplingParams(max_tokens=n, ignore_eos=True) for _, rid, _, n in requests}
    step = 0
    while step == 0 or engine.has_work():
        for at, rid, prompt, _ in requests:
            if at == step:
                engine.add_request(prompt, params[rid], request_id=rid)
        engine.step()
        step += 1
    return engine, replayer, log


def _check(log, trace, cache, shape):
    """Every decoding row fetched its request's table at its own step count since it started
    decoding (at the position it first decoded at); other rows fetched no replayed ids and
    kept their counters. Returns request id -> the ids it fetched (layer 1, step by step), and
    request id -> how many times it started decoding."""
    layers, heads = shape
    period = 2 * (trace.ids.shape[0] - 1)
    runs, seen, starts = {}, {}, {}
    for t, entry in enumerate(log):
        for row in range(cache.batch):
            if row not in entry["rows"]:  # an idle row's counter moved only if it decoded the step before
                if t:
                    last = log[t - 1]
                    assert int(entry["counters"][row]) == (int(last["counters"][row]) + (row in last["rows"])) % period
                continue
            rid = entry["ids"][row]
            pos = int(entry["fetched"][1][1][row])
            if t == 0 or row not in log[t - 1]["rows"] or log[t - 1]["ids"][row] != rid:  # starts decoding
                runs[row] = (rid, pos, t)
                starts[rid] = starts.get(rid, 0) + 1
            _, start, first = runs[row]
            n = t - first
            assert pos == start + n and int(entry["counters"][row]) == n % period, (t, row, pos, start, n)
            ref = _reference(trace, SelectionConfig(**SMALL), layers, heads, cache.num_blocks, cache.select_width,
                             start, rid)
            for layer in (1, 2):
                ids = entry["fetched"][layer][0][row]
                assert torch.equal(ids.long(), ref[n % ref.shape[0], layer]), (t, row, layer, rid, n)
            seen.setdefault(rid, []).append(entry["fetched"][1][0][row].clone())
    return seen, starts


@pytest.mark.parametrize("sizes", [None, "auto"])
def test_engine_rows_fetch_their_requests_replayed_ids_alone_or_busy(llm, sizes, fresh_seed):
    """The default single bucket, and ``auto`` (design §3.13), whose steps fetch the ids of
    their bucket's rows only."""
    g = torch.Generator().manual_seed(fresh_seed)
    trace = _trace(fresh_seed)
    llm = llm if sizes is None else llm.derive(cuda_graph_sizes=sizes)
    shape = (llm.shape.num_layers, llm.shape.num_kv_heads)
    a, b, c = (torch.randint(0, 49152, (n,), generator=g).tolist() for n in (150, 230, 120))
    engine, replayer, busy = _serve(llm, trace, [(0, "a", a, 20), (4, "b", b, 14), (9, "c", c, 3)])
    fetched_rows = {e["fetched"][1][0].shape[0] for e in busy}
    assert fetched_rows == ({3} if sizes is None else {1, 2, 3}), fetched_rows  # auto: a alone runs bucket 1
    seen, starts = _check(busy, trace, engine.cache, shape)
    assert starts == {"a": 1, "b": 1, "c": 1}, starts
    assert [len(seen[r]) for r in "abc"] == [19, 13, 2], {r: len(v) for r, v in seen.items()}  # past a cycle of 8
    assert any(len(e["rows"]) < 3 for e in busy) and any(len(e["rows"]) == 3 for e in busy)
    # c decoded its 2 steps and left: its row's counter stays where it stopped
    row_c = next(r for e in busy for r, rid in e["ids"].items() if rid == "c")
    assert int(replayer.step[row_c]) == 2 and replayer.starts[row_c][0] == len(c)
    del engine
    engine, _, alone = _serve(llm, trace, [(0, "a", a, 20)], rows=1)
    solo, _ = _check(alone, trace, engine.cache, shape)
    assert len(solo["a"]) == 19 and all(torch.equal(x, y) for x, y in zip(solo["a"], seen["a"]))


def test_a_recomputed_request_replays_again_from_where_it_resumes(llm, fresh_seed):
    """A paged pool of 9 blocks for two requests of 9 blocks each: one is preempted, and its
    recompute starts a new table at the position it resumes at, its counter from 0."""
    g = torch.Generator().manual_seed(fresh_seed)
    trace = _trace(fresh_seed)
    page = llm.model_runner.host_block_bytes()
    budget = sum(llm.model_runner.kv_bytes(2, 144, host_blocks=9)) + page // 2
    prompts = [torch.randint(0, 49152, (50,), generator=g).tolist() for _ in range(2)]
    engine, _, log = _serve(llm, trace, [(0, "a", prompts[0], 80), (1, "b", prompts[1], 80)], rows=2,
                            max_model_len=144, host_memory_gib=budget / 2**30)
    assert engine.memory_plan.host_blocks == 9 and engine.scheduler.preemptions > 0, engine.memory_plan.line()
    seen, starts = _check(log, trace, engine.cache, (llm.shape.num_layers, llm.shape.num_kv_heads))
    assert sorted(len(v) for v in seen.values()) == [79, 79], {r: len(v) for r, v in seen.items()}
    assert sorted(starts.values())[-1] > 1, starts  # a recompute started decoding again
