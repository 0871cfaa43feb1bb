"""Admission against a brute-force simulation: first come first served, the lowest free row,
at most ``max_tokens`` prompt tokens per step (the first request always), cancelled requests
dropped and their rows freed at once."""

import random

import pytest

from sparda.engine.sampling_params import SamplingParams
from sparda.engine.scheduler import QueueFull, Scheduler
from sparda.engine.sequence import Sequence, Status


def _reference_admit(waiting: list, free: set, budget):
    """What one step should admit: (request, row) pairs, recomputed from scratch."""
    out, total, free = [], 0, set(free)
    for seq in waiting:
        if not free or (out and budget is not None and total + seq.num_prompt > budget):
            break
        row = min(free)
        free.discard(row)
        out.append((seq, row))
        total += seq.num_prompt
    return out


@pytest.mark.parametrize("trial", range(20))
def test_admission_matches_a_brute_force_simulation(trial, fresh_seed):
    rng = random.Random(fresh_seed * 100 + trial)
    rows, length = rng.randint(1, 6), 400
    sched = Scheduler(max_batch=rows, max_model_len=length, max_waiting=rng.randint(0, 8))
    waiting, running, ids = [], {}, 0
    for _ in range(200):
        op = rng.random()
        if op < 0.45:  # a request arrives
            prompt = rng.randint(1, 300)
            seq = Sequence(str(ids), [1] * prompt, SamplingParams(max_tokens=length - prompt), length - prompt, None)
            ids += 1
            if len(waiting) >= sched.max_waiting:
                with pytest.raises(QueueFull):
                    sched.add(seq)
            else:
                sched.add(seq)
                waiting.append(seq)
        elif op < 0.75:  # an engine step admits
            budget = rng.choice([None, rng.randint(1, 600)])
            want = _reference_admit(waiting, set(range(rows)) - set(running), budget)
            got = sched.admit(budget)
            assert [(s, s.row) for s in got] == want, (fresh_seed, trial)
            for seq, row in want:
                waiting.remove(seq)
                running[row] = seq
                assert seq.status is Status.RUNNING
        elif op < 0.9 and running:  # a request finishes
            row = rng.choice(sorted(running))
            sched.free(running.pop(row))
        elif waiting or running:  # a request is cancelled, waiting or running
            seq = rng.choice(waiting + list(running.values()))
            seq.cancelled = True
            dropped = sched.drop_cancelled()
            assert dropped == [s for s in waiting if s.cancelled] + [s for s in running.values() if s.cancelled]
            for s in dropped:  # the engine frees a cancelled request's row once it has read it
                assert s.row is None or sched.running[s.row] is s
                sched.free(s)
            waiting = [s for s in waiting if not s.cancelled]
            running = {r: s for r, s in running.items() if not s.cancelled}
        assert list(sched.waiting) == waiting and sched.running == running
        assert sched.rows_in_use == len(running) <= rows


def _reference_plan(order: list, free: set, budget: int, chunk: int):
    """One chunked-prefill step from scratch: ``order`` = half-prefilled requests in admission
    order then the waiting queue (``seq, done`` pairs); chunks of ``chunk`` tokens taken first
    come first served while they fit ``budget`` (the step's first always), a prompt's last
    chunk costing one token more (its first decode token, in the same step); a waiting
    request needs a free row (the lowest). Returns ``[(seq, start, end)], {seq: row}``."""
    plan, rows, left, free = [], {}, budget, sorted(free)
    for seq, done, waiting in order:
        spans = [(s, min(seq.num_prompt, s + chunk)) for s in range(0, seq.num_prompt, chunk) if s >= done]
        costs = [end - start + (end == seq.num_prompt) for start, end in spans]
        if waiting:
            if not free or (plan and costs[0] > left):
                return plan, rows
            rows[seq] = free.pop(0)
        for (start, end), cost in zip(spans, costs):
            if plan and cost > left:
                return plan, rows
            plan.append((seq, start, end))
            left -= cost
    return plan, rows


@pytest.mark.parametrize("trial", range(20))
def test_chunked_prefill_plan_matches_a_brute_force_simulation(trial, fresh_seed):
    rng = random.Random(fresh_seed * 100 + trial)
    rows, length, chunk = rng.randint(1, 5), 400, rng.choice([16, 50, 128])
    sched = Scheduler(max_batch=rows, max_model_len=length, max_waiting=16)
    chunks = lambda seq: [(s, min(seq.num_prompt, s + chunk)) for s in range(0, seq.num_prompt, chunk)  # noqa: E731
                          if s >= seq.num_computed]
    admitted, ids = [], 0
    for _ in range(120):
        op = rng.random()
        if op < 0.4 and len(sched.waiting) < 16:
            prompt = rng.randint(1, 300)
            sched.add(Sequence(str(ids), [1] * prompt, SamplingParams(max_tokens=1), 1, None))
            ids += 1
        elif op < 0.8:  # a step: plan, then run the chunks
            budget = rng.randint(-3, 300)
            half = [s for s in admitted if s.row is not None and not s.prefilled]
            order = [(s, s.num_computed, False) for s in half] + [(s, 0, True) for s in sched.waiting]
            want, want_rows = _reference_plan(order, set(range(rows)) - set(sched.running), budget, chunk)
            got = sched.plan(budget, chunks)
            assert got == want, (fresh_seed, trial)
            assert {s: s.row for s in want_rows} == want_rows, (fresh_seed, trial)
            admitted += list(want_rows)
            for seq, start, end in got:
                assert start == seq.num_computed, (fresh_seed, trial)
                seq.num_computed = end
        elif sched.running:  # a request finishes or is cancelled
            seq = rng.choice(list(sched.running.values()))
            sched.free(seq)
        assert sched.rows_in_use <= rows
