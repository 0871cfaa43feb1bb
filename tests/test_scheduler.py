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


def _reference_paged(order: list, free_rows: set, free_blocks: set, block: int, budget, chunk):
    """Admission with a paged cache, from scratch: the waiting requests first come first
    served, each needing a free row (the lowest) and ``ceil((prompt + max_tokens) / block)``
    free blocks (the lowest ids); the first that does not fit stops admission. ``chunk``
    ``None``: whole prompts within ``budget`` prompt tokens (the first always); else the
    chunked plan's rule: chunks of ``chunk`` tokens (a prompt's last one costs a token more)
    taken while they fit what is left of ``budget`` (the step's first always), a request
    admitted with its first chunk, the first chunk that does not fit ending the step.
    Returns ``{seq: (row, blocks)}`` in admission order."""
    rows, blocks, out, left = sorted(free_rows), sorted(free_blocks), {}, budget
    for seq in order:
        need = -(-(seq.num_prompt + seq.max_tokens) // block)
        if not rows or need > len(blocks):
            break
        if chunk is None:
            if out and budget is not None and seq.num_prompt > left:
                break
            costs = [seq.num_prompt]
        else:
            starts = range(0, seq.num_prompt, chunk)
            costs = [min(chunk, seq.num_prompt - a) + (a + chunk >= seq.num_prompt) for a in starts]
            if out and costs[0] > left:
                break
        out[seq] = (rows.pop(0), blocks[:need])
        blocks = blocks[need:]
        for i, cost in enumerate(costs):
            if chunk is not None and i and cost > left:
                return out
            left = None if left is None else left - cost
    return out


@pytest.mark.parametrize("trial", range(20))
def test_paged_admission_matches_a_brute_force_simulation(trial, fresh_seed):
    """Rows and KV blocks: what is admitted, into which row and blocks, in which order; blocks
    held by no two requests, every block accounted for, a request that can never fit refused."""
    from sparda.engine.block_pool import BlockPool
    from sparda.errors import SpardaError

    rng = random.Random(fresh_seed * 100 + trial)
    rows, length, block = rng.randint(1, 6), 512, rng.choice([16, 64])
    pool = BlockPool(rng.randint(length // block, 4 * length // block))
    chunk = rng.choice([None, 64, 200])
    sched = Scheduler(max_batch=rows, max_model_len=length, max_waiting=32, block_pool=pool, block_size=block)
    ids = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.45 and len(sched.waiting) < 32:
            prompt = rng.randint(1, 400)
            max_tokens = rng.randint(1, length - prompt)
            seq = Sequence(str(ids), [1] * prompt, SamplingParams(max_tokens=max_tokens), max_tokens, None)
            ids += 1
            if -(-(prompt + max_tokens) // block) > pool.num_blocks:
                with pytest.raises(SpardaError, match="KV block pool"):
                    sched.add(seq)
            else:
                sched.add(seq)
        elif op < 0.8:
            held = {b for s in sched.running.values() for b in s.blocks}
            budget = rng.choice([None, rng.randint(1, 600)]) if chunk is None else rng.randint(1, 600)
            # the chunked plan first runs half-prefilled requests; keep none so both paths compare
            want = _reference_paged(list(sched.waiting), set(range(rows)) - set(sched.running),
                                    set(range(pool.num_blocks)) - held, block, budget, chunk)
            if chunk is None:
                got = sched.admit(budget)
            else:
                got = list(dict.fromkeys(s for s, _, _ in sched.plan(budget, lambda s: [
                    (a, min(s.num_prompt, a + chunk)) for a in range(0, s.num_prompt, chunk) if a >= s.num_computed])))
            assert {s: (s.row, s.blocks) for s in got} == want, (fresh_seed, trial)
            for seq in got:  # run every prompt whole: no half-prefilled request stays
                seq.num_computed = seq.num_prompt
        elif sched.running:
            sched.free(rng.choice(list(sched.running.values())))
        held = [b for s in sched.running.values() for b in s.blocks]
        assert len(held) == len(set(held)) == pool.num_used, (fresh_seed, trial)
        assert all(len(s.blocks) == sched.blocks_needed(s) for s in sched.running.values())
