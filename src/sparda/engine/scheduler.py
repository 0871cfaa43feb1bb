"""Continuous batching: the queue, admission into KV-cache rows and blocks, when to prefill.

The KV cache is allocated once when the engine starts: ``max_batch`` rows (a row is where a
request's per-request state lives: its GPU slots, compressed keys, counters) of
``max_model_len`` tokens, and, where the cache is paged (the offloaded host store, design
§3.11), a :class:`~sparda.engine.block_pool.BlockPool` of KV blocks that hold the tokens
themselves. How a paged request takes its blocks is ``kv_admission``:

* ``grow`` (the default): at admission the blocks of the tokens its prefill writes plus its
  first decode token, ``ceil((prefill + 1) / block_size)``, if that many are free beyond a
  headroom of :func:`watermark_blocks` (none when nothing else runs); before each decode
  step :meth:`Scheduler.grow` gives a decoding request the block its next token starts.
  When none is free the most recently admitted running request is *preempted by
  recompute*: its row and blocks are freed and it goes back to the front of the queue, to
  re-prefill its prompt plus the tokens it generated and go on where it stopped;
* ``reserve``: at admission ``ceil((prompt + max_tokens) / block_size)`` blocks, so a
  running request never runs out and nothing is preempted.

Either way:

* a request whose prompt plus ``max_tokens`` exceeds ``max_model_len``, or needs more blocks
  than the whole pool holds, can never fit and is refused when it is added
  (:class:`SpardaError` naming the sizes);
* otherwise it waits, first come first served, until a row and its blocks are free (a
  request never overtakes an earlier one, so a long one is not starved by short ones);
* a queue already holding ``max_waiting`` requests refuses more (:class:`QueueFull`;
  preempted requests go back whatever the queue holds).

Offline, prefill is whole-prompt (chunked inside, design §3.8): each engine step admits
waiting requests up to a prompt-token budget (at least one, :meth:`Scheduler.admit`). The
server spreads prompts over steps in chunks (:meth:`Scheduler.plan`, design §3.9). Then
each step runs one decode step of every running row. A
row is freed as soon as its request finishes (EOS, a stop token or string, ``max_tokens``)
or is cancelled.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import math

from sparda.config import DEFAULT_KV_ADMISSION
from sparda.engine.block_pool import BlockPool, blocks_for
from sparda.engine.memory import size_text
from sparda.engine.sequence import Sequence, Status
from sparda.errors import SpardaError


#: share of a grow-on-demand pool's blocks kept free at admission while other requests run,
#: so that the running ones can reach their next blocks without preempting the newcomer
WATERMARK = 0.01


def watermark_blocks(num_blocks: int) -> int:
    """Blocks an admission leaves free beside running requests: ``ceil(WATERMARK * num_blocks)``, >= 1."""
    return max(1, math.ceil(WATERMARK * num_blocks))


class QueueFull(SpardaError):
    """The waiting queue is full; retry later (the server answers 429)."""


class Scheduler:
    """FIFO queue plus ``max_batch`` KV-cache rows of ``max_model_len`` tokens (and blocks).

    Not thread-safe on its own: the engine calls it under its lock.

    Args:
        max_batch: cache rows (requests decoding together), >= 1.
        max_model_len: tokens per row (prompt + new tokens of one request), >= 2.
        max_waiting: requests that may wait for a row, >= 0.
        block_pool: a paged cache's free list (``None``: rows alone bound admission).
        block_size: tokens per KV block of ``block_pool``.
        block_bytes: bytes of one block (for the refusal message; 0: not named).
        kv_admission: ``grow`` or ``reserve`` (module docstring; checked by the engine);
            without a block pool, rows alone bound admission either way.
    """

    def __init__(self, max_batch: int, max_model_len: int, max_waiting: int, *,
                 block_pool: BlockPool | None = None, block_size: int = 64, block_bytes: int = 0,
                 kv_admission: str = DEFAULT_KV_ADMISSION) -> None:
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.block_pool, self.block_size, self.block_bytes = block_pool, block_size, block_bytes
        #: blocks grow on demand, with preemption by recompute (a paged cache in ``grow`` mode)
        self.grows = block_pool is not None and kv_admission == "grow"
        #: blocks an admission leaves free beside running requests (0 unless :attr:`grows`)
        self.watermark = watermark_blocks(block_pool.num_blocks) if self.grows else 0
        #: requests preempted so far (recompute)
        self.preemptions = 0
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: dict[int, Sequence] = {}  # row -> sequence, in admission order
        self._free = list(range(max_batch))      # a heap: the lowest free row first
        self._order = itertools.count()          # admission order (Sequence.admit_order)

    def check(self, num_prompt: int, max_tokens: int) -> None:
        """Refuse a request that can never fit a row.

        Raises:
            SpardaError: empty prompt, or prompt + ``max_tokens`` over ``max_model_len`` or,
                paged, over the whole KV block pool.
        """
        if num_prompt == 0:
            raise SpardaError("empty prompt; pass some text")
        if num_prompt >= self.max_model_len:
            raise SpardaError(f"prompt of {num_prompt} tokens does not fit --max-model-len {self.max_model_len} "
                              "(it needs room for at least one new token); shorten the prompt or raise --max-model-len")
        if num_prompt + max_tokens > self.max_model_len:
            raise SpardaError(f"prompt of {num_prompt} tokens plus max_tokens {max_tokens} exceeds --max-model-len "
                              f"{self.max_model_len}; lower max_tokens to at most {self.max_model_len - num_prompt} "
                              "or raise --max-model-len")
        pool = self.block_pool
        if pool is not None and blocks_for(num_prompt + max_tokens, self.block_size) > pool.num_blocks:
            room = self.pool_tokens
            size = f" ({size_text(pool.num_blocks * self.block_bytes)})" if self.block_bytes else ""
            if num_prompt >= room:
                raise SpardaError(f"prompt of {num_prompt} tokens does not fit the KV block pool of {room} tokens"
                                  f"{size} (it needs room for at least one new token); shorten the prompt or raise "
                                  "--host-memory-gib")
            exc = SpardaError(f"prompt of {num_prompt} tokens plus max_tokens {max_tokens} exceeds the KV block pool "
                              f"of {room} tokens{size}; lower max_tokens to at most {room - num_prompt} "
                              "or raise --host-memory-gib")
            exc.param = "max_tokens"  # the server's 400 names the field
            raise exc

    @property
    def pool_tokens(self) -> int | None:
        """Tokens the whole KV block pool holds (``None`` without one)."""
        return None if self.block_pool is None else self.block_pool.num_blocks * self.block_size

    def blocks_needed(self, seq: Sequence) -> int:
        """KV blocks ``seq`` takes at admission (0 without a block pool): growing, those of its
        prefill and first decode token; reserving, those of prompt + ``max_tokens``."""
        if self.block_pool is None:
            return 0
        if self.grows:
            return blocks_for(seq.num_prefill + 1, self.block_size)
        return blocks_for(seq.num_prompt + seq.max_tokens, self.block_size)

    def _fits(self, seq: Sequence) -> bool:
        """A row is free and, paged, ``seq``'s blocks are (growing: plus :attr:`watermark` if
        another request runs)."""
        if not self._free:
            return False
        if self.block_pool is None:
            return True
        headroom = self.watermark if self.running else 0
        return self.blocks_needed(seq) + headroom <= self.block_pool.num_free

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (checked with :meth:`check`). Raises SpardaError, or QueueFull."""
        self.check(seq.num_prompt, seq.max_tokens)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"the queue is full ({self.max_waiting} requests waiting); retry later")
        self.waiting.append(seq)

    @property
    def rows_in_use(self) -> int:
        """Cache rows held by running requests."""
        return len(self.running)

    def has_work(self) -> bool:
        """True if a request waits or runs."""
        return bool(self.waiting or self.running)

    def drop_cancelled(self) -> list[Sequence]:
        """Take cancelled requests out of the queue; returns them, the waiting ones then the
        running ones, whose rows stay theirs until :meth:`free` (the engine reads a row's
        counters and clears it first)."""
        gone = [s for s in self.waiting if s.cancelled]
        if gone:
            self.waiting = collections.deque(s for s in self.waiting if not s.cancelled)
        return gone + [seq for seq in self.running.values() if seq.cancelled]

    def grow(self) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """Growing: before a decode step, give every decoding request the blocks of the token
        it runs (``ceil((position + 1) / block_size)``), oldest admission first, each from the
        lowest free ids; where none is free, preempt the most recently admitted running
        request (:meth:`preempt`) until enough are, or until the one that needs them was
        preempted itself. O(running).

        Returns ``(grown, preempted)``: the requests whose :attr:`Sequence.blocks` grew (the
        engine extends their block tables) and the preempted ones with the row each held (the
        engine clears it); both empty unless :attr:`grows`.
        """
        grown: list[Sequence] = []
        preempted: list[tuple[Sequence, int]] = []
        if not self.grows:
            return grown, preempted
        pool = self.block_pool
        for seq in list(self.running.values()):
            if seq.row is None or not seq.prefilled:  # preempted in this loop, or still prefilling
                continue
            need = blocks_for(seq.position + 1, self.block_size) - len(seq.blocks)
            if need <= 0:
                continue
            while pool.num_free < need:
                victim = next(reversed(self.running.values()))
                preempted.append((victim, victim.row))
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.row is not None:
                seq.blocks += pool.allocate(need)
                grown.append(seq)
        return grown, preempted

    def preempt(self, seq: Sequence) -> None:
        """Preempt running ``seq`` by recompute: free its row and blocks and put it at the
        front of the queue, to re-prefill its prompt and generated tokens
        (:meth:`Sequence.preempt`)."""
        del self.running[seq.row]
        heapq.heappush(self._free, seq.row)
        self.block_pool.free(seq.blocks)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def admit(self, max_tokens: int | None = None) -> list[Sequence]:
        """Waiting requests, first come first served, each given the lowest free row (and,
        paged, the lowest free blocks), while the next one's row and blocks are free and
        their prefills total at most ``max_tokens`` (``None``: no bound;
        the first one is admitted whatever its length)."""
        admitted: list[Sequence] = []
        total = 0
        while self.waiting and self._fits(self.waiting[0]):
            size = self.waiting[0].num_prefill
            if admitted and max_tokens is not None and total + size > max_tokens:
                break
            seq = self.waiting.popleft()
            self._place(seq)
            admitted.append(seq)
            total += size
        return admitted

    def plan(self, budget: int, chunks) -> list[tuple[Sequence, int, int]]:
        """The prefill chunks of one engine step with chunked prefill (design §3.9).

        ``budget`` tokens (``max_num_batched_tokens`` less this step's decode tokens) go,
        first come first served, to the half-prefilled requests in admission order, then to
        waiting requests, each admitted into the lowest free row (and its blocks, while they
        are free) once its first chunk is taken; a request's next chunk (``chunks(seq)`` lists its remaining ``(start, end)``
        spans) costs its tokens, plus one for a prompt's last chunk (that request decodes in
        this step too), and is taken if it fits what is left, or if no chunk was taken yet
        this step (so a prefill always moves); the first chunk that does not fit ends the
        step's plan (no request overtakes an earlier one). Returns ``(seq, start, end)`` in
        run order.
        """
        plan: list[tuple[Sequence, int, int]] = []
        left = budget

        def cost(spans, i: int) -> int:
            return spans[i][1] - spans[i][0] + (i == len(spans) - 1)

        def take(seq: Sequence) -> bool:  # True: every chunk of seq fitted
            nonlocal left
            spans = chunks(seq)
            for i, (start, end) in enumerate(spans):
                if plan and cost(spans, i) > left:
                    return False
                plan.append((seq, start, end))
                left -= cost(spans, i)
            return True

        for seq in sorted((s for s in self.running.values() if not s.prefilled), key=lambda s: s.admit_order):
            if not take(seq):
                return plan
        while self.waiting and self._fits(self.waiting[0]):
            seq = self.waiting[0]
            if plan and cost(chunks(seq), 0) > left:
                break
            self._place(self.waiting.popleft())
            if not take(seq):
                break
        return plan

    def _place(self, seq: Sequence) -> None:
        seq.row = heapq.heappop(self._free)
        if self.block_pool is not None:
            seq.blocks = self.block_pool.allocate(self.blocks_needed(seq))
        seq.status = Status.RUNNING
        seq.admit_order = next(self._order)
        self.running[seq.row] = seq

    def free(self, seq: Sequence) -> None:
        """Give ``seq``'s row and blocks back (finished or cancelled); no-op if it holds none."""
        if seq.row is not None and self.running.get(seq.row) is seq:
            del self.running[seq.row]
            heapq.heappush(self._free, seq.row)
            if self.block_pool is not None:
                self.block_pool.free(seq.blocks)
        seq.row, seq.blocks = None, []
