"""Admission against a brute-force simulation: first come first served, the lowest free row,
at most ``max_tokens`` prompt tokens per step (the first request always), cancelled requests
dropped and their rows freed at once."""

import random

import pytest

from sparda.engine.sampling_params import SamplingParams
from sparda.engine.scheduler import QueueFull, Scheduler
from sparda.engine.sequence import Sequence, Status
from sparda.errors import SpardaError


def add_or_refuse(sched, num_blocks: int, block: int, rid: str, prompt: int, max_tokens: int):
    """Add a request of ``prompt`` tokens and ``max_tokens`` to ``sched``; one larger than the
    whole pool of ``num_blocks`` blocks of ``block`` tokens must be refused. Returns the
    sequence added, or ``None`` when refused."""
    seq = Sequence(rid, [1] * prompt, SamplingParams(max_tokens=max_tokens), max_tokens, None)
    if -(-(prompt + max_tokens) // block) > num_blocks:
        with pytest.raises(SpardaError, match="KV block pool"):
            sched.add(seq)
        return None
    sched.add(seq)
    return seq


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
    """Rows and KV blocks reserved for prompt + max_tokens (``kv_admission="reserve"``): what
    is admitted, into which row and blocks, in which order; blocks held by no two requests,
    every block accounted for, a request that can never fit refused."""
    from sparda.engine.block_pool import BlockPool

    rng = random.Random(fresh_seed * 100 + trial)
    rows, length, block = rng.randint(1, 6), 512, rng.choice([16, 64])
    pool = BlockPool(rng.randint(length // block, 4 * length // block))
    chunk = rng.choice([None, 64, 200])
    sched = Scheduler(max_batch=rows, max_model_len=length, max_waiting=32, block_pool=pool, block_size=block,
                      kv_admission="reserve")
    ids = 0
    for _ in range(150):
        op = rng.random()
        if op < 0.45 and len(sched.waiting) < 32:
            prompt = rng.randint(1, 400)
            max_tokens = rng.randint(1, length - prompt)
            seq = add_or_refuse(sched, pool.num_blocks, block, str(ids), prompt, max_tokens)
            ids += 1
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


class _GrowModel:
    """Grow-on-demand admission with preemption by recompute, from the rules alone (design
    §3.11): plain lists and sets, no heap. A request: ``prompt``, ``max_tokens``, ``out``
    (tokens generated), ``prefill`` (tokens its next prefill writes), ``done`` (of them in the
    cache), ``row``, ``blocks``."""

    def __init__(self, rows: int, blocks: int, block: int):
        self.free_rows, self.free_blocks, self.block = set(range(rows)), set(range(blocks)), block
        self.watermark = max(1, -(-blocks // 100))  # ceil(1 % of the pool), at least one block
        self.running: list = []  # admission order
        self.waiting: list = []
        self.state: dict = {}
        self.preemptions = 0

    def add(self, seq):
        self.state[seq] = dict(prompt=seq.num_prompt, max_tokens=seq.max_tokens, out=0, prefill=seq.num_prompt,
                               done=0, row=None, blocks=[])
        self.waiting.append(seq)

    def _take(self, count: int) -> list:
        got = sorted(self.free_blocks)[:count]
        self.free_blocks -= set(got)
        return got

    def release(self, seq):
        r = self.state[seq]
        if seq in self.running:
            self.running.remove(seq)
            self.free_rows.add(r["row"])
            self.free_blocks |= set(r["blocks"])
        if seq in self.waiting:
            self.waiting.remove(seq)
        r["row"], r["blocks"] = None, []

    def grow(self):
        """Every decoding request, oldest first, gets the blocks of the token it runs; the
        newest running one is preempted (to the front of the queue) while blocks are short."""
        grown, preempted = [], []
        for seq in list(self.running):
            r = self.state[seq]
            if seq not in self.running or r["done"] < r["prefill"]:
                continue
            position = r["prompt"] + r["out"] - 1
            need = -(-(position + 1) // self.block) - len(r["blocks"])
            if need <= 0:
                continue
            while len(self.free_blocks) < need:
                victim = self.running[-1]
                v = self.state[victim]
                preempted.append((victim, v["row"]))
                self.release(victim)
                v["prefill"] = v["prompt"] + v["out"] - 1 if v["out"] else v["prompt"]
                v["done"] = 0
                self.waiting.insert(0, victim)
                self.preemptions += 1
                if victim is seq:
                    break
            if seq in self.running:
                r["blocks"] = r["blocks"] + self._take(need)
                grown.append(seq)
        return grown, preempted

    def _fits(self, seq) -> bool:
        need = -(-(self.state[seq]["prefill"] + 1) // self.block) + (self.watermark if self.running else 0)
        return bool(self.free_rows) and need <= len(self.free_blocks)

    def _admit(self, seq):
        r = self.state[seq]
        self.waiting.remove(seq)
        r["row"] = min(self.free_rows)
        self.free_rows.discard(r["row"])
        r["blocks"] = self._take(-(-(r["prefill"] + 1) // self.block))
        self.running.append(seq)

    def plan(self, budget: int, chunk: int) -> list:
        """The chunked plan: half-prefilled requests first (admission order), then waiting ones
        as they fit; a chunk taken while its cost fits what is left (the first always)."""
        plan, left = [], budget

        def spans(seq):
            r = self.state[seq]
            return [(a, min(r["prefill"], a + chunk)) for a in range(0, r["prefill"], chunk) if a >= r["done"]]

        def take(seq) -> bool:
            nonlocal left
            for start, end in spans(seq):
                cost = end - start + (end == self.state[seq]["prefill"])
                if plan and cost > left:
                    return False
                plan.append((seq, start, end))
                left -= cost
            return True

        for seq in [s for s in self.running if self.state[s]["done"] < self.state[s]["prefill"]]:
            if not take(seq):
                return plan
        while self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            start, end = spans(seq)[0]
            if plan and end - start + (end == self.state[seq]["prefill"]) > left:
                break
            self._admit(seq)
            if not take(seq):
                break
        return plan

    def admit(self, budget) -> list:
        """Whole prefills: waiting requests while they fit, their prefills within ``budget`` (the first always)."""
        out, total = [], 0
        while self.waiting and self._fits(self.waiting[0]):
            size = self.state[self.waiting[0]]["prefill"]
            if out and budget is not None and total + size > budget:
                break
            out.append(self.waiting[0])
            self._admit(self.waiting[0])
            total += size
        return out


@pytest.mark.parametrize("trial", range(24))
def test_grow_on_demand_with_preemption_matches_a_brute_force_simulation(trial, fresh_seed):
    """``kv_admission="grow"`` step by step against :class:`_GrowModel` over random workloads:
    which requests are admitted (row, block ids), which blocks each decoding request gets,
    which one is preempted (the most recently admitted) and where it goes (the queue's front,
    to re-prefill prompt + generated tokens but the last), blocks held by no two requests,
    every block accounted for; a request that can never fit the pool refused at add time."""
    from sparda.engine.block_pool import BlockPool

    rng = random.Random(fresh_seed * 100 + trial)
    rows, length, block = rng.randint(2, 8), 256, rng.choice([8, 16, 32])
    full = length // block  # blocks of one whole row; a pool of one up to half the rows' worth
    pool = BlockPool(rng.randint(full, max(full, rows * full // 2)))
    chunk = rng.choice([None, 16, 24, 64, 1000])
    sched = Scheduler(max_batch=rows, max_model_len=length, max_waiting=64, block_pool=pool, block_size=block,
                      kv_admission="grow")
    model = _GrowModel(rows, pool.num_blocks, block)
    where = f"seed={fresh_seed} trial={trial} rows={rows} blocks={pool.num_blocks} block={block} chunk={chunk}"
    assert sched.grows and sched.watermark == model.watermark, where
    chunks = lambda s: [(a, min(s.num_prefill, a + chunk)) for a in range(0, s.num_prefill, chunk)  # noqa: E731
                        if a >= s.num_computed]
    ids, preempted_ever = 0, 0

    def finish(seq):
        sched.free(seq)
        model.release(seq)

    def generate(seq):  # one sampled token; the request ends at max_tokens or, now and then, at EOS
        seq.output_ids.append(1)
        model.state[seq]["out"] += 1
        if len(seq.output_ids) >= seq.max_tokens or rng.random() < 0.005:
            finish(seq)

    for _ in range(500):
        for _ in range(rng.choice([0, 0, 1, 2])):  # arrivals
            if len(sched.waiting) >= sched.max_waiting:
                break
            prompt = rng.randint(1, rng.choice([length // 4, length - 1]))
            max_tokens = rng.randint(1, min(rng.choice([length // 4, length]), length - prompt))
            seq = add_or_refuse(sched, pool.num_blocks, block, str(ids), prompt, max_tokens)
            ids += 1
            if seq is not None:
                model.add(seq)
        if rng.random() < 0.05 and model.state:  # a cancel, waiting (maybe preempted) or running
            seq = rng.choice([s for s in model.state if s in model.running or s in model.waiting] or [None])
            if seq is not None:
                seq.cancelled = True
                for s in sched.drop_cancelled():
                    finish(s)
        want = model.grow()
        got = sched.grow()
        assert got == want, where
        preempted_ever += len(got[1])
        for seq, _ in got[1]:
            assert seq.status is Status.WAITING and seq.row is None and seq.blocks == [], where
            assert seq.prefill_ids == seq.prompt_ids + seq.output_ids[:-1], where
        if chunk is None:
            budget = rng.choice([None, rng.randint(1, 600)])
            want = model.admit(budget)
            got = sched.admit(budget)
            assert got == want, where
            plan = [(s, 0, s.num_prefill) for s in got]
        else:
            budget = rng.randint(1, 80)
            want = model.plan(budget, chunk)
            plan = sched.plan(budget, chunks)
            assert plan == want, where
        assert list(sched.waiting) == model.waiting and list(sched.running.values()) == model.running, where
        for seq in model.running:
            assert (seq.row, seq.blocks) == (model.state[seq]["row"], model.state[seq]["blocks"]), where
            assert seq.status is Status.RUNNING
        held = [b for s in sched.running.values() for b in s.blocks]
        assert len(held) == len(set(held)) == pool.num_used, where
        # run the step: the chunks, a fresh prompt's first token, then one decode token per prefilled row
        for seq, start, end in plan:
            assert start == seq.num_computed, where
            seq.num_computed = model.state[seq]["done"] = end
            if seq.prefilled and not seq.output_ids:
                generate(seq)
        for seq in [s for s in sched.running.values() if s.prefilled]:
            assert len(seq.blocks) == -(-(seq.position + 1) // block), where  # the token it runs has a page
            generate(seq)
        assert sched.preemptions == model.preemptions == preempted_ever, where
    while model.running or model.waiting:  # drain: cancel everything, every block comes back
        for seq in model.running + model.waiting:
            seq.cancelled = True
        for s in sched.drop_cancelled():
            finish(s)
    assert pool.num_free == pool.num_blocks and sched.rows_in_use == 0 and not sched.waiting, where
