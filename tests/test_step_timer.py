"""The engine's step times (``sparda.engine.step_timer``): through the engine on the CPU,
counters against what the steps did (prompt tokens run, with preemption the recomputed
ones, decode steps and rows), seconds within the steps' own wall time; the CUDA event path
with fake events, whose marks the test completes: nothing is read before the device passed
it, and nothing waits for it."""

from __future__ import annotations

import time

import pytest
import torch

from sparda import LLM, SamplingParams
from sparda.engine.engine import Engine
from sparda.engine.step_timer import CudaClock, HostClock, StepTimer
from test_preemption import _llm as _preempting_llm, _paged, _workload

pytestmark = pytest.mark.usefixtures("one_thread")


class FakeDevice:
    """A stream of fake CUDA events: each takes a device time when recorded (``clock()``, s),
    and is done only once :meth:`finish` passed it; reading an undone event raises, as CUDA's
    ``elapsed_time`` does, and ``synchronize`` fails the test."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock, self.recorded, self.done, self.streams = clock, [], 0, []

    def event(self):
        device = self

        class Event:
            def record(self, stream):
                device.streams.append(stream)
                self.at, self.index = device.clock(), len(device.recorded)
                device.recorded.append(self)

            def query(self):
                return self.index < device.done

            def elapsed_time(self, end):  # milliseconds
                if not (self.query() and end.query()):
                    raise RuntimeError("elapsed_time on an event the device has not passed")
                return (end.at - self.at) * 1e3

            def synchronize(self):
                raise AssertionError("the step timer waited for the device")

        return Event()

    def finish(self, upto: int | None = None) -> None:
        """The device passes the first ``upto`` events recorded (``None``: all)."""
        self.done = len(self.recorded) if upto is None else upto


def _run_counted(engine, requests):
    """Add ``requests`` (``(ids, params)``), step to the end timing each ``engine.step()``, and
    count from the requests' own state what each step did: prompt tokens run (growth of
    ``num_computed``, from 0 after a preemption), rows decoded (tokens added but a prompt's
    first). Checks each step's observed kind and time against it. Returns the counts."""
    seqs = [engine.add_request(ids, p) for ids, p in requests]
    observed = []
    engine.step_timer.observers.append(lambda kind, seconds: observed.append((kind, seconds)))
    count = dict(prefill_tokens=0, prefill_steps=0, decode_steps=0, decode_rows=0, wall=0.0, steps=0,
                 step_seconds=0.0)
    last = engine.step_timer.totals()
    while engine.has_work():
        before = [(s.num_computed, s.preemptions, len(s.output_ids)) for s in seqs]
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        ran = decoded = 0
        for seq, (computed, preemptions, outputs) in zip(seqs, before):
            ran += seq.num_computed - (0 if seq.preemptions > preemptions else computed)
            grew = len(seq.output_ids) - outputs
            decoded += grew - (outputs == 0 and grew > 0)  # a prompt's first token is its prefill's
        now = engine.step_timer.totals()
        assert now["prefill_tokens"] - last["prefill_tokens"] == ran
        assert now["decode_rows"] - last["decode_rows"] == decoded
        prefill_s, decode_s = (now[k] - last[k] for k in ("prefill_seconds", "decode_seconds"))
        assert (prefill_s > 0) == (ran > 0) and (decode_s > 0) == (decoded > 0), (ran, decoded, prefill_s, decode_s)
        assert prefill_s + decode_s <= wall
        if ran or decoded:  # resolved at once on the CPU: this step's kind and time
            (kind, seconds), = observed[count["steps"]:]
            assert kind == ("mixed" if ran else "decode") and prefill_s + decode_s <= seconds <= wall
            count["steps"] += 1
            count["step_seconds"] += seconds
        count["prefill_tokens"] += ran
        count["prefill_steps"] += ran > 0
        count["decode_steps"] += decoded > 0
        count["decode_rows"] += decoded
        count["wall"] += wall
        last = now
    assert len(observed) == count["steps"]
    return count, seqs


def _check_totals(engine, count):
    """The engine's metrics against ``count``: counters equal, seconds inside the steps' wall
    time and most of it."""
    m = engine.metrics()
    assert m["prefill_tokens_run_total"] == count["prefill_tokens"]
    assert m["prefill_steps_total"] == count["prefill_steps"]
    assert m["decode_steps_total"] == count["decode_steps"] == sum(m["decode_steps_by_bucket"].values())
    assert m["decode_rows_total"] == count["decode_rows"]
    busy = m["prefill_seconds_total"] + m["decode_seconds_total"]
    assert m["prefill_seconds_total"] > 0 and m["decode_seconds_total"] > 0
    assert busy <= count["step_seconds"] <= count["wall"]
    assert busy >= 0.7 * count["wall"], (busy, count["wall"])  # the forwards are most of a step (0.99 idle)
    return m


def test_chunked_prefill_counts_every_chunk_and_decode_step(make_tiny, fresh_seed):
    """A server-like engine (chunks of 32 under a budget of 40-90 tokens) with prompts of
    20-180 tokens: the prefill tokens run are the prompts' (each run once), over more steps
    than the prompts (chunks), and every request decodes ``max_tokens - 1`` rows."""
    gen = torch.Generator().manual_seed(fresh_seed)
    llm = LLM(make_tiny("llama"), method="dense", device="cpu", prefill_chunk_tokens=32)
    budget = int(torch.randint(40, 90, (), generator=gen))
    engine = Engine(llm, max_batch=3, max_model_len=200, max_prefill_tokens=budget)
    assert engine.chunked_prefill and isinstance(engine.step_timer.clock, HostClock)
    lengths = torch.randint(20, 180, (6,), generator=gen).tolist()
    news = torch.randint(2, 12, (6,), generator=gen).tolist()
    requests = [(torch.randint(0, 49152, (n,), generator=gen).tolist(), SamplingParams(max_tokens=m, ignore_eos=True))
                for n, m in zip(lengths, news)]
    count, _ = _run_counted(engine, requests)
    where = f"seed={fresh_seed} budget={budget} lengths={lengths}"
    assert count["prefill_tokens"] == sum(lengths), where
    assert count["decode_rows"] == sum(news) - len(news), where
    # a step runs at least one chunk, and at most the budget (a chunk is 32 <= budget)
    chunks = sum(-(-n // 32) for n in lengths)
    assert -(-sum(lengths) // budget) <= count["prefill_steps"] <= chunks, where
    m = _check_totals(engine, count)
    assert m["prompt_tokens_total"] == sum(lengths), where


def test_preempted_requests_count_their_recomputed_tokens(make_tiny, fresh_seed):
    """A paged pool far too small (tests/test_preemption.py): preempted requests re-prefill
    their prompt and tokens; the prefill tokens run count them, the prompt tokens do not."""
    llm = _preempting_llm(make_tiny("llama"), "sparse-offload", {}, None)  # no Forecast: sparse
    prompts, params = _workload(8)
    engine = _paged(llm)
    count, seqs = _run_counted(engine, list(zip(prompts, params)))
    m = _check_totals(engine, count)
    where = f"seed={fresh_seed}"
    assert m["preemptions"] > 0 and m["prompt_tokens_total"] == sum(map(len, prompts)), where
    assert m["prefill_tokens_run_total"] > m["prompt_tokens_total"], where
    # a recompute runs at most the prompt and every token but the last, per preemption
    most = sum(len(ids) + s.preemptions * (len(ids) + p.max_tokens - 1) for ids, p, s in zip(prompts, params, seqs))
    assert m["prefill_tokens_run_total"] <= most, where


def test_cuda_events_are_read_only_once_the_device_passed_them(fresh_seed):
    """The CUDA path on fake events of scripted device times: a step is counted only once
    every one of its marks is done (the host never waits), oldest first; seconds are the
    events' milliseconds / 1e3; a step whose part raised is dropped without blocking the
    next; every mark goes on the clock's stream."""
    gen = torch.Generator().manual_seed(fresh_seed)
    times = iter(torch.rand(100, generator=gen, dtype=torch.float64).cumsum(0).tolist())
    device = FakeDevice(clock=lambda: next(times))
    timer = StepTimer(CudaClock(None, event=device.event, stream=lambda: "the stream"))
    seen = []
    timer.observers.append(lambda kind, seconds: seen.append((kind, seconds)))
    tokens, rows = (int(v) for v in torch.randint(1, 500, (2,), generator=gen))

    timer.begin()                                  # marks 0: step start
    with timer.part("prefill", tokens):            # 1, 2
        pass
    with timer.part("decode", rows):               # 3, 4
        pass
    timer.end()                                    # 5: step end
    timer.begin()                                  # 6
    with timer.part("decode", rows + 1):           # 7, 8
        pass
    timer.end()                                    # 9
    timer.begin()                                  # 10: a step whose decode raises
    with pytest.raises(ValueError), timer.part("decode", 3):  # 11
        raise ValueError
    timer.end()
    timer.begin()                                  # 12
    with timer.part("prefill", 7):                 # 13, 14
        pass
    timer.end()                                    # 15
    at = [event.at for event in device.recorded]
    assert len(at) == 16 and set(device.streams) == {"the stream"}

    empty = dict(prefill_seconds=0.0, prefill_tokens=0, prefill_steps=0, decode_seconds=0.0, decode_steps=0,
                 decode_rows=0)
    for upto in (0, 3, 5):  # the first step's end not passed: nothing read
        device.finish(upto)
        assert timer.totals() == empty and timer.pending == 3 and not seen, upto
    device.finish(8)  # the first step, and the second's parts but not its end
    first = dict(prefill_seconds=at[2] - at[1], prefill_tokens=tokens, prefill_steps=1,
                 decode_seconds=at[4] - at[3], decode_steps=1, decode_rows=rows)
    assert timer.totals() == pytest.approx(first) and timer.pending == 2
    assert seen == [("mixed", pytest.approx(at[5] - at[0]))]
    device.finish()
    both = dict(first, decode_seconds=first["decode_seconds"] + at[8] - at[7], decode_steps=2,
                decode_rows=2 * rows + 1, prefill_seconds=first["prefill_seconds"] + at[14] - at[13],
                prefill_tokens=tokens + 7, prefill_steps=2)
    assert timer.totals() == pytest.approx(both) and timer.pending == 0
    assert seen[1:] == [("decode", pytest.approx(at[9] - at[6])), ("mixed", pytest.approx(at[15] - at[12]))]


def test_engine_on_cuda_events_resolves_at_the_next_step_or_read(make_tiny, fresh_seed):
    """The engine with the CUDA clock on fake events the device finishes only when the test
    says: a step's times wait for it (metrics unchanged, nothing observed), then a read of
    ``metrics()`` or the next step resolves them; the totals equal a host-clock run's counts."""
    llm = LLM(make_tiny("llama"), method="dense", device="cpu", prefill_chunk_tokens=32)
    engine = Engine(llm, max_batch=2, max_model_len=200, max_prefill_tokens=33)  # one chunk of 32 a step
    device = FakeDevice()
    engine.step_timer = StepTimer(CudaClock(None, event=device.event, stream=lambda: None))
    seen = []
    engine.step_timer.observers.append(lambda kind, seconds: seen.append(kind))
    n = int(torch.randint(40, 120, ()))
    engine.add_request(torch.randint(0, 49152, (n,)).tolist(), SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        m = engine.metrics()  # this step's marks not passed yet: only the earlier steps count
        assert engine.step_timer.pending == 1 and len(seen) == steps - 1, fresh_seed
        assert m["prefill_steps_total"] == seen.count("mixed"), fresh_seed
        device.finish()  # the device catches up; the next step (or read) resolves
    m = engine.metrics()
    assert engine.step_timer.pending == 0 and len(seen) == steps, fresh_seed
    chunks = -(-n // 32)
    assert m["prefill_tokens_run_total"] == n and m["prefill_steps_total"] == chunks == seen.count("mixed"), fresh_seed
    assert m["decode_rows_total"] == 3 and m["decode_steps_total"] == 3, fresh_seed
    assert seen.count("decode") == steps - chunks and m["prefill_seconds_total"] > 0 < m["decode_seconds_total"]
