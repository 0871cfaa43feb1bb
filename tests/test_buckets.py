"""Decode batch buckets (design §3.13): a decode step runs the cache's first ``b`` rows only.

* the buckets and the bucket of a step against brute force; the default is one bucket of all
  rows (every step runs every row), ``auto`` and lists turn buckets on;
* a step of ``b`` rows leaves every per-row tensor of rows ``b ..`` bit for bit (K/V, compressed
  keys, rings, lengths, counters, slot maps, the hot pool's state, the host store, the
  selectors' row state) and gives rows ``< b`` the logits of the full-batch step;
* engines whose buckets change as requests finish give every request the greedy tokens,
  log-probabilities and counters of the full-batch engine (and of generate() alone),
  for every method and KV dtype, lookahead 2 included; so do paged engines that grow and
  preempt (recompute), and server-like engines (chunked prefill) whose requests finish on
  their first token or are cancelled half-prefilled or decoding;
* a row taken again gives its new request the tokens and counters of generate() alone;
* ``mixed`` through CUDA's fused decode step on the CPU twins (its hot-pool bookkeeping in the
  slot diff, the pool and int4 store written by the append, design §6.1) gives the bucket
  step's rows and the bucketed engine's requests what the full batch gives them.

The step's GEMMs over ``b`` rows may round differently from those over ``B`` (MKL on the
CPU below 6 rows), so logits and log-probabilities agree to fp32 rounding, greedy tokens up
to a near tie (a flip there parts the continuations; ``near_tie.agree_up_to_a_tie``).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from sparda import LLM, SamplingParams, SpardaError
from sparda.bench.op_count import force_fused, twin_engine
from sparda.cache.host import HostChunk
from sparda.engine.buckets import auto_sizes, bucket_for, decode_buckets
from sparda.engine.engine import Engine
from sparda.kernels import quant
from near_tie import agree_up_to_a_tie
from test_forecast2 import weights  # noqa: F401 - fixture: (one-layer, two-ahead) Forecast files of tiny
from test_preemption import SMALL as PAGED, _paged, _serve, _workload

pytestmark = pytest.mark.usefixtures("one_thread")

#: small blocks and no dense fallback: 90+ token prompts drop blocks (budget 5 blocks = 80 tokens)
SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=2)

#: (method, options): every method, the KV dtypes where they apply
CASES = [
    ("dense", {}), ("sparse", {}), ("sparse", {"kv_dtype": "int8"}), ("sparse", {"kv_dtype": "int4"}),
    ("oracle", {}), ("infinigen", {}), ("streaming", {}), ("h2o", {}), ("quest", {"quest_page_size": 4}),
    ("snapkv", {}), ("shallow", {"shallow_layers": 1}),
    ("sparda", {"offload": False}), ("sparda", {"offload": True}), ("sparda", {"offload": True, "kv_dtype": "int4"}),
    ("sparda", {"offload": True, "kv_dtype": "mixed"}), ("sparse-offload", {}),
    ("sparse-offload", {"kv_dtype": "int8"}), ("sparse-offload", {"kv_dtype": "mixed"}),
    ("sparda-no-prefetch", {}), ("shallow", {"shallow_layers": 1, "offload": True}),
    ("sparda", {"offload": True, "lookahead": 2}),
]
IDS = [m + "".join(f"-{k}={v}" for k, v in o.items()) for m, o in CASES]


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _llm(tiny, weights, method, options, **extra):
    """An LLM of ``tiny``; sparda methods take ``weights`` (one-layer, two-ahead Forecast files)."""
    kwargs = dict(SMALL, **options, **extra)
    if method.startswith("sparda"):
        kwargs["forecast"] = weights[0]
    if options.get("lookahead") == 2:
        kwargs["forecast2"] = weights[1]
    return LLM(str(tiny), method=method, device="cpu", **kwargs)


# --------------------------------------------------------------------------- buckets
def test_buckets_cap_to_the_rows_and_always_hold_them(fresh_seed):
    assert auto_sizes(32) == decode_buckets("auto", 32) == (1, 2, 4, 8, 16, 24, 32)
    assert decode_buckets("auto", 3) == (1, 2, 3) and decode_buckets("auto", 1) == (1,)
    assert decode_buckets("auto", 20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets((4, 64), 32) == (4, 32) and decode_buckets((64,), 32) == (32,)
    rng = random.Random(fresh_seed)
    for _ in range(200):
        rows = rng.randint(1, 70)
        assert decode_buckets(None, rows) == (rows,), fresh_seed  # the default: every step runs every row
        auto = [1, 2, 4] + list(range(8, 72, 8))  # brute force: 1, 2, 4, the multiples of 8, then the rows
        assert decode_buckets("auto", rows) == tuple(n for n in auto if n < rows) + (rows,), (fresh_seed, rows)
        sizes = tuple(sorted(set(rng.sample(range(1, 90), rng.randint(1, 6)))))
        buckets = decode_buckets(sizes, rows)
        assert list(buckets) == sorted(set(buckets)) and buckets[-1] == rows, (fresh_seed, sizes, rows)
        assert set(buckets) == {n for n in sizes if n < rows} | {rows}
        for needed in range(1, rows + 1):  # brute force: the smallest bucket that holds the rows
            assert bucket_for(buckets, needed) == min(n for n in buckets if n >= needed), (fresh_seed, buckets)
        with pytest.raises(ValueError):
            bucket_for(buckets, rows + 1)


def test_cuda_graph_sizes_are_checked_once_by_the_config():
    from sparda.config import build_config

    assert build_config(method="dense", device="cpu", cuda_graph_sizes="8, 2,8,1").runtime.cuda_graph_sizes == (1, 2, 8)
    assert build_config(method="dense", device="cpu", cuda_graph_sizes=[4, 1]).runtime.cuda_graph_sizes == (1, 4)
    assert build_config(method="dense", device="cpu").runtime.cuda_graph_sizes is None
    for auto in ("auto", " Auto"):
        assert build_config(method="dense", device="cpu", cuda_graph_sizes=auto).runtime.cuda_graph_sizes == "auto"
    for bad in ("1,,2", "-1", "2.5", [True], [2.0], [], 4, "a", "auto,8", "automatic"):
        with pytest.raises(SpardaError, match="cuda_graph_sizes must be auto or a comma list of integers >= 1") as info:
            build_config(method="dense", device="cpu", cuda_graph_sizes=bad)
        assert "\n" not in str(info.value) and "e.g. --cuda-graph-sizes auto or" in str(info.value)


# ------------------------------------------------------------ one step, rows past b
def _row_tensors(obj, rows: int, path: str = "cache", seen=None):
    """Every tensor reachable from ``obj`` whose first dim is the cache's ``rows`` (name ->
    tensor): K/V, compressed keys, rings, lengths, counters, slot maps, hot state, row state."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return {}
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return {path: obj} if obj.dim() and obj.shape[0] == rows else {}
    if isinstance(obj, quant.QuantizedKV):
        return {**_row_tensors(obj.data, rows, path + ".data", seen),
                **_row_tensors(obj.scale, rows, path + ".scale", seen)}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    elif type(obj).__module__.startswith("sparda.") and hasattr(obj, "__dict__") and not isinstance(obj, HostChunk):
        items = vars(obj).items()
    else:
        return {}
    out = {}
    for key, value in items:
        if key in ("decode_runner", "engine", "model_runner"):
            continue
        out.update(_row_tensors(value, rows, f"{path}.{key}", seen))
    return out


def _host_pages(cache, rows):
    """The host store's pages of ``rows``: every offloaded layer and stored plane, the hot pool too."""
    if not cache.offload:
        return []
    stores = [(cache.host.chunks, cache.host.table.host)]
    if cache.host.pool:
        stores.append((cache.host.pool, cache.host.pool_table.host))
    out = []
    for chunks_of, table in stores:
        for row in rows:
            pages = [int(p) for p in table[row] if p >= 0]
            for chunks in chunks_of.values():
                for chunk in chunks:
                    local = [p - chunk.page0 for p in pages if chunk.page0 <= p < chunk.page1]
                    for part in chunk.planes():
                        out += [part.k[:, local], part.v[:, local]]
    return out


@torch.inference_mode()
def _filled(llm, rows, prompts, capacity):
    llm.method.reset()
    cache = llm.new_cache(rows, capacity)
    first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
    return cache, first.argmax(-1)


@pytest.mark.parametrize("method,options", CASES, ids=IDS)
def test_a_bucket_step_leaves_the_rows_past_it_bit_for_bit(tiny, weights, method, options, fresh_seed):
    """Six filled rows, four decode steps of the first ``b`` (1, where a [1]-shaped tensor would
    broadcast over every row, and a random 2..5): every per-row tensor of rows ``b ..`` (and
    their host pages) is unchanged bit for bit, rows ``< b`` advance, and their logits equal
    those of the full-batch step on a twin cache (fp32 rounding; a quantised store up to one
    flipped code)."""
    llm = _llm(tiny, weights, method, options)
    for b in (1, int(torch.randint(2, 6, ()))):
        _check_bucket_step(llm, 6, b, f"seed {fresh_seed}, {method} {options}, b={b}")


def _check_bucket_step(llm, rows: int, b: int, where: str) -> None:
    lengths = torch.randint(90, 180, (rows,)).tolist()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    cache, tokens = _filled(llm, rows, prompts, max(lengths) + 16)
    twin, twin_tokens = _filled(llm, rows, prompts, max(lengths) + 16)
    assert torch.equal(tokens, twin_tokens)
    positions = torch.tensor(lengths)
    # a quantised store: b-row and B-row GEMMs round apart, which can flip one stored code by a
    # step; that element then shows in later steps (~1e-4 measured at int8)
    tol = 1e-4 if llm.config.cache.kv_dtype == "bf16" else 2e-3
    for step in range(4):
        before = {k: v.clone() for k, v in _row_tensors(cache, rows).items()}
        pages = [t.clone() for t in _host_pages(cache, range(b, rows))]
        lengths_before = cache.lengths.clone()
        got = llm.decode(cache, tokens[:b], positions[:b])
        want = llm.decode(twin, tokens, positions)
        at = f"{where}, step {step}"
        assert got.shape[0] == b
        assert torch.allclose(got, want[:b], rtol=tol, atol=tol), at
        after = _row_tensors(cache, rows)
        assert set(before) <= set(after), at
        for name, value in after.items():  # tensors made by this step (the counters) start at 0
            old = before.get(name, torch.zeros_like(value))
            assert torch.equal(value[b:].nan_to_num(), old[b:].nan_to_num()), (at, name)
            assert torch.equal(value[b:].isnan(), old[b:].isnan()), (at, name)
        for old, new in zip(pages, _host_pages(cache, range(b, rows))):
            assert torch.equal(old, new), (at, "host pages")
        assert torch.equal(cache.lengths[:b], lengths_before[:b] + 1), at
        written = [name for name, value in after.items() if name in before and name.split(".")[1] in ("k", "k_slots")
                   and not torch.equal(value[:b], before[name][:b])]
        assert written, at  # rows < b did run: their K (or partial slot) took the token
        # rows < b on the bucketed step's tokens; the twin's rows past b run on (never compared)
        tokens = torch.cat([got.argmax(-1), want[b:].argmax(-1)])
        positions = torch.cat([positions[:b] + 1, positions[b:] + 1])
    runner = llm.runner(cache)
    assert runner.bucket_steps == {b: 4} and runner.last_bucket == b


# ------------------------------------------------------------------- whole engines
@contextlib.contextmanager
def _watched(engine, seen: list):
    """While in the block, every decode step of ``engine`` appends ``(rows it ran, the
    brute-force bucket of the rows that decode)`` to ``seen``."""
    runner = engine.runner.runner(engine.cache)
    original = engine.runner.decode

    def decode(cache, tokens, positions, max_position=None):
        decoding = [row for row, seq in engine.scheduler.running.items() if seq.prefilled]
        seen.append((tokens.shape[0], min(n for n in runner.buckets if n >= max(decoding) + 1)))
        return original(cache, tokens, positions, max_position)

    engine.runner.decode = decode
    try:
        yield
    finally:
        del engine.runner.decode


def _run(engine, prompts, max_tokens, every=2):
    """Add one request every ``every`` steps; after each step record the step's bucket and
    the brute-force bucket of the rows that decoded. Returns outputs, (bucket, brute) per step."""
    outputs, seqs, pending, seen = {}, [], list(zip(prompts, max_tokens)), []
    with _watched(engine, seen):
        step = 0
        while pending or engine.has_work():
            if pending and step % every == 0:
                ids, m = pending.pop(0)
                seqs.append(engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2)))
            for delta in engine.step():
                if delta.output is not None:
                    outputs[delta.request_id] = delta.output
            step += 1
    return [outputs[s.request_id] for s in seqs], seen


def _rows_invariant(llm, sizes, rows: int) -> bool:
    """Whether this BLAS computes each row of the model's products over ``m`` rows bit for bit
    as over ``rows`` rows, for every ``m`` in ``sizes`` (MKL on the CPU: from 6 rows up; below,
    another kernel rounds differently), probed on the model's own linear layers."""
    gen = torch.Generator().manual_seed(0)
    for lin in {id(m): m for m in llm.model.modules() if isinstance(m, torch.nn.Linear)}.values():
        x = torch.randn(rows, lin.in_features, generator=gen)
        with torch.inference_mode():
            full = lin(x)
            if not all(torch.equal(lin(x[:m]), full[:m]) for m in sizes):
                return False
    return True


#: the engine-level cases (the step-level test above runs every one)
ENGINE_CASES = [c for c in CASES if c[0] not in ("oracle", "infinigen", "streaming", "snapkv")
                and c != ("shallow", {"shallow_layers": 1})]


@pytest.mark.parametrize("method,options", ENGINE_CASES, ids=[IDS[CASES.index(c)] for c in ENGINE_CASES])
def test_a_bucketed_engine_equals_the_full_batch_engine(tiny, weights, method, options, fresh_seed):
    """Twelve requests through a 9-row engine of buckets 6 and 9, admitted one a step and
    finishing at different times, so the highest decoding row crosses 6 up and down: every
    step's bucket is the brute force's, and every request gets the full-batch engine's greedy
    tokens, log-probabilities, KV read fraction and offload hits / misses -- bit for bit where
    the BLAS rounds a row alike at 6 and 9 rows (:func:`_rows_invariant`), else to rounding."""
    llm = _llm(tiny, weights, method, options, cuda_graph_sizes=[6])
    full = llm.derive(cuda_graph_sizes=[9])
    lengths = torch.randint(90, 150, (12,)).tolist()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    # rows 0-5 long; rows 6-8 short, then taken again by the last three: 6 -> 9 -> 6 -> 9 -> 6
    max_tokens = [30] * 6 + torch.randint(2, 7, (6,)).tolist()
    bucketed, seen = _run(Engine(llm, max_batch=9, max_model_len=200), prompts, max_tokens, every=1)
    reference, full_seen = _run(Engine(full, max_batch=9, max_model_len=200), prompts, max_tokens, every=1)
    where = f"seed {fresh_seed}, {method} {options}"
    assert all(b == brute for b, brute in seen), (where, seen)
    assert {b for b, _ in full_seen} == {9}
    used = [b for b, _ in seen]
    assert set(used) == {6, 9} and any(x > y for x, y in zip(used, used[1:])), (where, used)  # buckets change
    exact = _rows_invariant(llm, (6,), 9)
    for got, want in zip(bucketed, reference):
        if exact:
            assert got.token_ids == want.token_ids, where
            assert [e["logprob"] for e in got.logprobs] == [e["logprob"] for e in want.logprobs], where
        elif not agree_up_to_a_tie(got, want, 1e-3, where):
            continue  # parted at a near tie: other tokens, other counters
        assert got.stats["kv_read_fraction"] == pytest.approx(want.stats["kv_read_fraction"],
                                                              abs=0 if exact else 1e-3), where
        if exact and "offload" in want.stats:
            keys = ("hits", "misses", "pool_misses", "early_copies")
            assert [got.stats["offload"].get(k) for k in keys] == [want.stats["offload"].get(k) for k in keys], where


def test_small_buckets_give_the_full_batch_tokens(tiny, weights, fresh_seed):
    """Buckets 1, 2, 4 of a 5-row engine (the BLAS rounds these row counts differently from 5):
    the full-batch engine's greedy tokens, log-probabilities to rounding; the bucket of every
    step is the brute force's, and it rises and falls."""
    for method, options in (("dense", {}), ("sparse-offload", {"kv_dtype": "int8"})):
        llm = _llm(tiny, weights, method, options, cuda_graph_sizes=[1, 2, 4])
        full = llm.derive(cuda_graph_sizes=[5])
        lengths = torch.randint(90, 150, (7,)).tolist()
        prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
        max_tokens = [40] + torch.randint(2, 12, (6,)).tolist()  # row 0 outlives the rest: the bucket falls
        bucketed, seen = _run(Engine(llm, max_batch=5, max_model_len=200), prompts, max_tokens)
        reference, _ = _run(Engine(full, max_batch=5, max_model_len=200), prompts, max_tokens)
        where = f"seed {fresh_seed}, {method}"
        assert all(b == brute for b, brute in seen), (where, seen)
        used = [b for b, _ in seen]
        assert {1, 2, 4} <= set(used) and used[-1] == 1 and max(used) > 1, (where, used)
        for got, want in zip(bucketed, reference):
            agree_up_to_a_tie(got, want, 1e-3, where)


def test_bucketed_dense_requests_equal_each_alone(tiny, weights, fresh_seed):
    """The automatic buckets: every request of a busy engine gets the tokens of generate()
    alone; metrics name the buckets used."""
    llm = _llm(tiny, weights, "dense", {}, cuda_graph_sizes="auto")
    lengths = torch.randint(5, 120, (6,)).tolist()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    max_tokens = torch.randint(1, 14, (6,)).tolist()
    engine = Engine(llm, max_batch=4, max_model_len=140)
    outputs, seen = _run(engine, prompts, max_tokens, every=1)
    for ids, m, got in zip(prompts, max_tokens, outputs):
        alone = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=m, ignore_eos=True)[0]
        assert got.token_ids == alone.token_ids, f"seed {fresh_seed}"
        assert "graph_capture_ms" in got.stats
    metrics = engine.metrics()
    assert metrics["decode_bucket"] == seen[-1][0]
    assert metrics["decode_steps_by_bucket"] == {b: sum(x == b for x, _ in seen) for b, _ in seen}
    assert metrics["graph_capture_ms"] == 0.0  # the CPU runs eagerly


def test_the_default_is_one_bucket_of_all_rows(tiny, weights, fresh_seed):
    """Without ``cuda_graph_sizes`` every decode step runs every row, as a step without buckets:
    one request in an engine of 2-6 rows steps them all, the free ones as padding (token 0 at
    position 0: their length becomes 1), while ``auto`` steps only bucket 1 and leaves the free
    rows empty; both give the tokens of generate() alone."""
    rows = int(torch.randint(2, 7, ()))
    prompt = torch.randint(100, 20000, (int(torch.randint(20, 100, ())),)).tolist()
    new = int(torch.randint(3, 9, ()))
    llm = _llm(tiny, weights, "sparse", {})
    assert llm.config.runtime.cuda_graph_sizes is None
    alone = llm.generate([None], prompt_token_ids=[prompt], max_new_tokens=new, ignore_eos=True)[0]
    where = f"seed {fresh_seed}, {rows} rows"
    for sizes, bucket, padded in ((None, rows, 1), ("auto", 1, 0)):
        engine = Engine(llm if sizes is None else llm.derive(cuda_graph_sizes=sizes), max_batch=rows,
                        max_model_len=120)
        runner = engine.runner.runner(engine.cache)
        want = (rows,) if sizes is None else tuple(n for n in (1, 2, 4) if n < rows) + (rows,)  # rows < 8
        assert runner.buckets == want, (where, sizes, runner.buckets)
        (got,), seen = _run(engine, [prompt], [new])
        assert seen == [(bucket, bucket)] * (new - 1), (where, sizes, seen)  # the first token is the prefill's
        assert got.token_ids == alone.token_ids, (where, sizes)
        # row 0 was freed at the end; the free rows took a padding token in every step, or none
        assert engine.cache.lengths[1:].tolist() == [padded] * (rows - 1), (where, sizes)
        metrics = engine.metrics()
        assert metrics["decode_bucket"] == bucket and metrics["decode_steps_by_bucket"] == {bucket: new - 1}


def test_a_bucketed_paged_engine_grows_and_preempts_as_the_full_batch_one(tiny, weights, fresh_seed):
    """A paged host pool that grows on demand and preempts by recompute (design §3.11), with
    the automatic buckets of its 4 rows: every step's bucket is the brute force's and some go
    below 4 rows, the same requests are preempted as often as with the default single bucket,
    every block comes back, and every request gets the default engine's tokens and
    log-probabilities (to rounding: GEMMs of other row counts, design §3.13) -- a recomputed
    row's restored decode history and counters (``KVCache.decode_state``) run in its bucket."""
    for method, options in (("sparse-offload", {"kv_dtype": "mixed"}), ("sparda", {"offload": True, "lookahead": 2})):
        llm = _llm(tiny, weights, method, dict(PAGED, **options), cuda_graph_sizes="auto")
        prompts, params = _workload(8)
        runs = []
        for engine in (_paged(llm), _paged(llm.derive(cuda_graph_sizes=None))):
            seen = []
            with _watched(engine, seen):
                outputs, _, seqs, _ = _serve(engine, prompts, params)
            pool = engine.scheduler.block_pool
            assert pool.num_free == pool.num_blocks and engine.scheduler.rows_in_use == 0  # every block back
            runs.append((outputs, [s.preemptions for s in seqs], seen))
        (got, preempted, seen), (want, full_preempted, full_seen) = runs
        where = f"seed {fresh_seed}, {method} {options}"
        assert all(b == brute for b, brute in seen) and min(b for b, _ in seen) < 4, (where, seen)
        assert {b for b, _ in full_seen} == {4}, where
        assert preempted == full_preempted and sum(preempted) >= 1, (where, preempted, full_preempted)
        for i, (mine, ref) in enumerate(zip(got, want)):
            if params[i].temperature:  # seeded sampling: no tie to judge
                assert mine.token_ids == ref.token_ids, (where, i)
            agree_up_to_a_tie(mine, ref, 1e-3, (where, i))


#: stateful selectors (row state indexed by ``rows``) and the offloaded caches with per-row copy state
STATEFUL = [("h2o", {}), ("quest", {"quest_page_size": 4}), ("snapkv", {}), ("streaming", {}),
            ("sparda", {"offload": True, "lookahead": 2}), ("sparse-offload", {"kv_dtype": "mixed"})]
STATEFUL_IDS = [m + "".join(f"-{k}={v}" for k, v in o.items()) for m, o in STATEFUL]


@pytest.mark.parametrize("method,options", STATEFUL, ids=STATEFUL_IDS)
def test_a_reused_row_gives_each_request_its_tokens_and_counters_alone(tiny, weights, method, options, fresh_seed):
    """Six requests (some of one token) through 3 rows of ``auto`` buckets, so rows are taken
    again: each request gets the greedy tokens of generate() alone, and its KV read fraction and
    offload hits, misses, early and pool copies -- nothing of a row's earlier request or padding
    leaks into a later one's state or counters."""
    llm = _llm(tiny, weights, method, options, cuda_graph_sizes="auto")
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in torch.randint(90, 150, (6,)).tolist()]
    max_tokens = [1] + torch.randint(1, 14, (5,)).tolist()
    outputs, seen = _run(Engine(llm, max_batch=3, max_model_len=170), prompts, max_tokens, every=1)
    assert len({b for b, _ in seen}) > 1, seen
    for i, (ids, m, got) in enumerate(zip(prompts, max_tokens, outputs)):
        alone = llm.generate(None, SamplingParams(max_tokens=m, ignore_eos=True), prompt_token_ids=[ids])[0]
        where = f"seed {fresh_seed}, {method} {options}, request {i}"
        assert got.token_ids == alone.token_ids, where
        assert got.stats["kv_read_fraction"] == pytest.approx(alone.stats["kv_read_fraction"], abs=1e-3), where
        if "offload" in alone.stats:
            keys = ("hits", "misses", "early_copies", "pool_misses")
            assert [got.stats["offload"].get(k) for k in keys] == [alone.stats["offload"].get(k) for k in keys], where


def _drive(engine, requests, aborts):
    """``requests`` ``(step, id, prompt, max_tokens)`` added and ``aborts`` ``(step, id)`` cancelled
    before those steps; every decode step checks that the cache's rows past its bucket kept every
    per-row tensor bit for bit. Returns id -> output, and the rows of each decode step."""
    rows, steps, outputs = engine.max_batch, [], {}
    original = engine.runner.decode

    def decode(cache, tokens, positions, max_position=None):
        b = tokens.shape[0]
        before = {k: v[b:].clone() for k, v in _row_tensors(cache, rows).items()}
        out = original(cache, tokens, positions, max_position)
        for name, value in _row_tensors(cache, rows).items():
            old = before.get(name, torch.zeros_like(value[b:]))  # made by this step: starts at 0
            assert torch.equal(value[b:].nan_to_num(), old.nan_to_num()), (name, b)
        steps.append(b)
        return out

    engine.runner.decode = decode
    try:
        step = 0
        while engine.has_work() or any(at >= step for at, *_ in requests):
            for at, rid, ids, m in requests:
                if at == step:
                    engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True, logprobs=2), request_id=rid)
            for at, rid in aborts:
                if at == step:
                    engine.abort(rid)
            outputs.update((d.request_id, d.output) for d in engine.step() if d.output is not None)
            step += 1
    finally:
        del engine.runner.decode
    return outputs, steps


@pytest.mark.parametrize("method,options", STATEFUL, ids=STATEFUL_IDS)
def test_chunked_prefill_and_cancels_with_buckets_equal_the_default(tiny, weights, method, options, fresh_seed):
    """A server-like 4-row engine (chunked prefill of 32 tokens, 40 a step): requests that finish
    on their first token, one cancelled half-prefilled and one cancelled while decoding, under
    ``auto``, an explicit ``3,5`` (5 above the rows) and ``[1]``: every decode step leaves the rows
    past its bucket untouched, and every request gets the default single bucket's tokens, finish
    reason, log-probabilities (to rounding) and counters."""
    g = torch.Generator().manual_seed(fresh_seed)
    P = lambda n: torch.randint(100, 20000, (n,), generator=g).tolist()  # noqa: E731
    requests = [(0, "a", P(100), 25), (0, "b", P(140), 1), (1, "c", P(160), 12), (2, "d", P(30), 1),
                (3, "e", P(150), 20), (5, "f", P(120), 15), (6, "g", P(95), 18), (12, "h", P(60), 6)]
    aborts = [(4, "e"), (14, "f")]  # e: its prompt half prefilled; f: decoding
    runs = {}
    for sizes in (None, "auto", "3,5", [1]):
        llm = _llm(tiny, weights, method, dict(options, prefill_chunk_tokens=32), cuda_graph_sizes=sizes)
        engine = Engine(llm, max_batch=4, max_model_len=200, max_prefill_tokens=40)
        runs[str(sizes)] = outputs, steps = _drive(engine, requests, aborts)
        assert engine.metrics()["decode_steps_by_bucket"] == {b: steps.count(b) for b in set(steps)}
    ref, ref_steps = runs["None"]
    where = f"seed {fresh_seed}, {method} {options}"
    assert set(ref_steps) == {4} and ref["e"].finish_reason == ref["f"].finish_reason == "abort", where
    assert len(ref["b"].token_ids) == len(ref["d"].token_ids) == 1 and len(ref["e"].token_ids) == 0, where
    assert set(runs["auto"][1]) == {1, 2, 4} and set(runs["3,5"][1]) <= {3, 4} and 1 in runs["[1]"][1], where
    for sizes, (outputs, _) in runs.items():
        assert set(outputs) == set(ref), (where, sizes)
        for rid, got in outputs.items():
            want = ref[rid]
            at = (where, sizes, rid)
            assert got.finish_reason == want.finish_reason, at
            if not agree_up_to_a_tie(got, want, 1e-3, at):
                continue  # parted at a near tie: other tokens, other counters
            assert got.stats["kv_read_fraction"] == pytest.approx(want.stats["kv_read_fraction"], abs=1e-3), at
            if "offload" in want.stats:
                for key in ("hits", "misses", "early_copies", "pool_misses"):  # rounding may move a block
                    assert got.stats["offload"].get(key) == pytest.approx(want.stats["offload"].get(key), abs=2), at


# ------------------------------------------------- mixed: the fused bookkeeping in buckets
def _fused_twins(llm) -> list:
    """Make ``llm`` decode through CUDA's fused step on the CPU twins and give every cache it
    makes the stand-in of CUDA's asynchronous engine (:mod:`sparda.bench.op_count`): ``mixed``'s
    append then writes the int4 store and the hot pool itself, as on CUDA. Returns the list of
    the caches it makes (filled as they are made)."""
    runner = llm.model_runner
    force_fused(runner)
    make, made = runner.new_cache, []

    def new_cache(*args, **kwargs):
        cache = make(*args, **kwargs)
        twin_engine(cache)
        made.append(cache)
        return cache

    runner.new_cache = new_cache
    return made


@pytest.mark.parametrize("lookahead", [1, 2])
def test_mixed_fused_bookkeeping_runs_the_bucket_rows_only(tiny, weights, lookahead, fresh_seed):
    """``kv_dtype`` ``mixed`` with its hot rule and pool / cold split in the slot diff and its
    token stores in the fused append (design §6.1), lookahead 1 and 2 (the early diff's split):
    a step of the first ``b`` rows (1 and a random 2..5) leaves every per-row tensor of rows
    ``b ..`` (hot state, slot maps, slots, cold staging, counters) and their host pages (int4
    store and hot pool) bit for bit and gives rows ``< b`` the full-batch step's logits; an
    engine of the automatic buckets (1, 2, 4, 5 of 5 rows) gives every request the tokens and
    log-probabilities of the default single bucket."""
    options = {"offload": True, "kv_dtype": "mixed", **({"lookahead": 2} if lookahead == 2 else {})}
    llm = _llm(tiny, weights, "sparda", options)
    made = _fused_twins(llm)
    where = f"seed {fresh_seed}, lookahead {lookahead}"
    for b in (1, int(torch.randint(2, 6, ()))):
        _check_bucket_step(llm, 6, b, f"{where}, b={b}")
    assert made and all(c._fused_host(layer) is not None for c in made for layer in c.offloaded), where
    lengths = torch.randint(90, 150, (7,)).tolist()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    max_tokens = [24] + torch.randint(2, 10, (6,)).tolist()  # row 0 outlives the rest: the bucket falls
    runs = []
    for sizes in ("auto", None):
        other = llm.derive(cuda_graph_sizes=sizes)
        made = _fused_twins(other)
        runs.append(_run(Engine(other, max_batch=5, max_model_len=200), prompts, max_tokens))
        assert len(made) == 1 and made[0]._fused_host(made[0].offloaded[0]) is not None, where
    (bucketed, seen), (reference, full_seen) = runs
    assert all(b == brute for b, brute in seen) and {b for b, _ in full_seen} == {5}, (where, seen)
    used = [b for b, _ in seen]
    assert min(used) < 5 and used[-1] == 1, (where, used)
    for got, want in zip(bucketed, reference):
        agree_up_to_a_tie(got, want, 1e-3, where)
