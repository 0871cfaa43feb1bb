"""A request can only hurt itself (issue #46): an exception in one request's work ends
that request alone, the engine goes on; a crash of the engine thread is logged and ends
every request in flight."""

import threading
import time

import pytest
import torch

from sparda import LLM, SamplingParams
from sparda.engine.engine import Engine
from sparda.engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("one_thread")

#: prompts starting with this token id fail in detokenisation at their 3rd token (fault injection)
POISON = 4242


@pytest.fixture
def poisoned(monkeypatch):
    """Sequence.append raises for requests whose prompt starts with POISON, at their 3rd token."""
    append = Sequence.append

    def faulty(self, token, *args, **kwargs):
        if self.prompt_ids[0] == POISON and len(self.output_ids) == 2:
            raise RuntimeError("injected detokenisation fault")
        return append(self, token, *args, **kwargs)

    monkeypatch.setattr(Sequence, "append", faulty)


def _alone(llm, ids, n):
    return llm.generate([None], prompt_token_ids=[ids], max_new_tokens=n, ignore_eos=True)[0].token_ids


def test_a_failing_request_ends_alone_and_the_batch_goes_on(make_tiny, fresh_seed, poisoned, monkeypatch, capfd):
    llm = LLM(make_tiny("llama"), method="dense", device="cpu")
    engine = Engine(llm, max_batch=3, max_model_len=64)
    prefill = llm.model_runner.prefill_batch

    def faulty_prefill(cache, rows, prompts):  # a prompt starting with POISON + 1 fails its prefill forward
        if any(ids[0] == POISON + 1 for ids in prompts):  # (batched with others: the whole forward)
            raise RuntimeError("injected prefill fault")
        return prefill(cache, rows, prompts)

    monkeypatch.setattr(llm.model_runner, "prefill_batch", faulty_prefill)
    good = [torch.randint(0, 49152, (n,)).tolist() for n in (5, 9)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    seqs = [engine.add_request(good[0], params), engine.add_request([POISON, 1, 2, 3], params),
            engine.add_request([POISON + 1, 5, 6], params), engine.add_request(good[1], params)]
    outputs = {}
    for delta in engine.run():
        if delta.output is not None:
            outputs[delta.request_id] = delta.output
    got = [outputs[s.request_id] for s in seqs]
    assert [o.finish_reason for o in got] == ["length", "error", "error", "length"], f"seed {fresh_seed}"
    assert got[1].token_ids == got[1].token_ids[:2] and len(got[1].token_ids) == 2  # ended at its 3rd token
    assert got[0].token_ids == _alone(llm, good[0], 8) and got[3].token_ids == _alone(llm, good[1], 8)
    assert engine.scheduler.rows_in_use == 0 and not engine.has_work()
    assert engine.metrics()["requests_finished"] == {"length": 2, "error": 2}
    err = capfd.readouterr().err
    assert "injected detokenisation fault" in err and "injected prefill fault" in err and "the others go on" in err
    again = engine.add_request(good[0], params)  # the engine still serves
    assert [d.output for d in engine.run() if d.output][0].token_ids == got[0].token_ids
    assert again.finish_reason == "length"


def test_the_background_engine_ends_only_the_failing_request(make_tiny, poisoned):
    llm = LLM(make_tiny("llama"), method="dense", device="cpu")
    engine = Engine(llm, max_batch=2, max_model_len=64)
    finished, done = {}, threading.Event()

    def on_delta(delta):
        if delta.finished:
            finished[delta.request_id] = delta.finish_reason
            if len(finished) == 3:
                done.set()

    engine.start()
    try:
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        ids = [engine.add_request(p, params, on_delta=on_delta).request_id
               for p in ([1, 2, 3], [POISON, 2, 3], [7, 8, 9])]
        assert done.wait(120)
        assert [finished[i] for i in ids] == ["length", "error", "length"]
        assert engine.alive and engine.crashed is None
    finally:
        engine.shutdown()


def test_a_failed_batch_step_ends_the_running_rows_not_the_queue(make_tiny, monkeypatch):
    llm = LLM(make_tiny("llama"), method="dense", device="cpu")
    engine = Engine(llm, max_batch=1, max_model_len=64)
    decode, calls = llm.model_runner.decode, [0]

    def flaky(*args, **kwargs):  # the 3rd decode step of the engine raises
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("injected decode fault")
        return decode(*args, **kwargs)

    monkeypatch.setattr(llm.model_runner, "decode", flaky)
    finished, done = {}, threading.Event()

    def on_delta(delta):
        if delta.finished:
            finished[delta.request_id] = delta.finish_reason
            done.set() if len(finished) == 2 else None

    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = engine.add_request([1, 2, 3], params, on_delta=on_delta)
    second = engine.add_request([4, 5, 6], params, on_delta=on_delta)  # waits: one row
    engine.start()
    try:
        assert done.wait(120)
        assert finished == {first.request_id: "error", second.request_id: "length"}
        assert engine.alive and engine.scheduler.rows_in_use == 0
    finally:
        engine.shutdown()


def test_a_crash_of_the_engine_thread_is_logged_and_ends_what_is_in_flight(make_tiny, monkeypatch, capfd):
    llm = LLM(make_tiny("llama"), method="dense", device="cpu")
    engine = Engine(llm, max_batch=1, max_model_len=64)
    finished = threading.Event()
    engine.start()
    try:
        def broken():
            raise MemoryError("injected crash of the loop")

        monkeypatch.setattr(engine.scheduler, "has_work", broken)  # the loop itself fails, outside a step
        seq = engine.add_request([1, 2, 3], SamplingParams(max_tokens=4),
                                 on_delta=lambda d: finished.set() if d.finished else None)
        assert finished.wait(60) and seq.finish_reason == "error"
        deadline = time.monotonic() + 10
        while engine.alive:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert isinstance(engine.crashed, MemoryError) and not engine.accepting
        assert "the engine thread crashed (MemoryError: injected crash of the loop)" in capfd.readouterr().err
    finally:
        monkeypatch.undo()
        engine.shutdown()
