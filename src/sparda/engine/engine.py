"""The one generation loop: continuous batching over a pool of KV-cache rows.

:class:`Engine` owns a cache of ``max_batch`` rows x ``max_model_len`` tokens and a
:class:`~sparda.engine.scheduler.Scheduler`. ``LLM.generate`` / ``chat`` /
``generate_stream`` (:func:`sparda.engine.offline.offline_engine`) and ``sparda serve``
run it. Each :meth:`Engine.step`:

1. drops cancelled requests (their rows are freed at once); on a paged cache that grows on
   demand (design §3.11), gives each decoding row the KV block its next token starts,
   preempting the newest running requests (recompute) when the pool runs out;
2. prefills: offline, it admits waiting requests into free rows (at most
   ``max_prefill_tokens`` prompt tokens per step, always at least one) and prefills their
   whole prompts, several per forward where the method allows it (design §3.8); with
   ``chunked_prefill`` (the server) it runs prefill chunks within the step's token budget,
   admitting waiting requests as their first chunk is taken (design §3.9), one prompt per
   forward; a prompt's last chunk samples its first token;
3. runs one decode step of the cache's first ``b`` rows (:meth:`ModelRunner.decode`, one
   captured CUDA graph per bucket on CUDA), ``b`` the smallest decode batch bucket that
   holds the highest decoding row (design §3.13; by default one bucket, every row); the rows
   past ``b`` are not touched. In it decoding rows run at their own positions, free rows as
   padding (token 0 at position 0, output discarded), half-prefilled rows at the position
   their next chunk starts (design §3.9);
4. samples each running row with its own parameters and generator
   (:func:`sparda.engine.sampler.sample_requests`), appends the token, streams the text it
   completes and frees the rows of requests that finished.

A request's output does not depend on which other requests share the batch: rows never
read each other's cache, sampling is per request, counters are per row. With
``static_live_len`` (the server) every decode step also takes the same host-side branch
whatever the batch holds (``max_position = max_model_len - 1``: the dense-fallback switch
of design §3.6 and the CUDA-graph key never depend on the neighbours), so with dense
attention in fp32 a request's logits are bit-identical alone or in a busy batch of the
same bucket (tested; the default has one bucket); the GEMMs of another bucket's row count
may round differently (design §3.13). Offline runs follow the longest running row
instead, as a static batch would.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator

import torch

from sparda.config import DEFAULT_KV_ADMISSION, GPU_SHARE, KV_ADMISSIONS
from sparda.engine.block_pool import BlockPool
from sparda.engine.memory import plan_pool, plan_rows
from sparda.engine.sampler import sample_requests
from sparda.engine.sampling_params import SamplingParams
from sparda.engine.scheduler import Scheduler
from sparda.engine.sequence import Delta, Sequence, Status
from sparda.engine.step_timer import CudaClock, HostClock, StepTimer
from sparda.errors import SpardaError

#: seconds of history behind the tokens/s figure of :meth:`Engine.metrics`
RATE_WINDOW_S = 10.0
#: seconds between two readings of the offload counters (each reading synchronises)
OFFLOAD_REFRESH_S = 1.0


class EngineStopped(SpardaError):
    """The engine is shutting down and takes no new requests (the server answers 503)."""


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SpardaError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def check_max_model_len(max_model_len, limit: int | None) -> int:
    """``max_model_len`` (tokens per request, prompt plus new tokens) checked against the model's
    context ``limit`` (``None``: unknown, not checked); returns it. Raises SpardaError for a
    non-integer, a value below 2 (a prompt token and a new one) or one above ``limit``."""
    _positive_int("max_model_len", max_model_len)
    if max_model_len < 2:
        raise SpardaError("max_model_len must be >= 2 (a prompt token and a new one)")
    if limit is not None and max_model_len > limit:
        raise SpardaError(f"--max-model-len {max_model_len} exceeds the model's context of {limit} tokens; "
                          f"use at most {limit}")
    return max_model_len


class Engine:
    """Continuous batching over a fixed pool of KV-cache rows (module docstring).

    Args:
        llm: a :class:`sparda.LLM` (model, tokenizer, attention method).
        max_batch: cache rows, i.e. requests decoding together (>= 1).
        max_model_len: tokens per row, prompt plus new tokens of one request (>= 2,
            at most the model's context); ``None``: the model's context.
        max_waiting: requests that may queue for a row before :class:`QueueFull`.
        max_prefill_tokens: prompt tokens admitted per step at most (at least one request);
            ``None``: every waiting request that finds a row.
        static_live_len: decode every step as if the longest row were ``max_model_len``
            (the server: outputs independent of the neighbours, module docstring).
        chunked_prefill: spread long prompts over steps (module docstring, design §3.8):
            each step runs at most ``max_prefill_tokens`` tokens, decode tokens included
            (at least one prefill chunk); ``None``: on with ``static_live_len`` and a
            ``max_prefill_tokens`` budget.
        gpu_memory_utilization, host_memory_gib: memory budgets of the KV pool (design
            §3.11, :func:`~sparda.engine.memory.plan_rows`): given either, the pool has
            ``max_batch`` rows or as many as the budgets hold, if fewer (:attr:`memory_plan`);
            an offloaded cache whose host budget cannot hold every row whole is paged
            (:func:`~sparda.engine.memory.plan_pool`: admission takes a request's KV blocks).
        kv_admission: how a paged cache gives requests their KV blocks (design §3.11):
            ``grow`` (on demand, preempting by recompute when the pool runs out) or ``reserve``
            (prompt + ``max_tokens`` at admission, never preempted); no effect unpaged.
    Raises:
        SpardaError: bad sizes, or a cache pool that does not fit in memory (bytes named).
    """

    def __init__(self, llm, max_batch: int = 8, max_model_len: int | None = None, max_waiting: int = 256, *,
                 max_prefill_tokens: int | None = None, static_live_len: bool = True,
                 chunked_prefill: bool | None = None, gpu_memory_utilization: float | None = None,
                 host_memory_gib: float | None = None, kv_admission: str = DEFAULT_KV_ADMISSION) -> None:
        limit = llm.shape.max_positions
        _positive_int("max_batch", max_batch)
        max_model_len = limit if max_model_len is None else check_max_model_len(max_model_len, limit)
        if not isinstance(max_waiting, int) or isinstance(max_waiting, bool) or max_waiting < 0:
            raise SpardaError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        if kv_admission not in KV_ADMISSIONS:
            raise SpardaError(f"--kv-admission must be one of {', '.join(KV_ADMISSIONS)}, got {kv_admission!r}")
        self.llm = llm
        self.runner = runner = llm.model_runner
        self.tokenizer = llm.tokenizer
        self.max_batch, self.max_model_len = max_batch, max_model_len
        self.max_prefill_tokens, self.static_live_len = max_prefill_tokens, static_live_len
        if chunked_prefill is None:
            chunked_prefill = static_live_len and max_prefill_tokens is not None
        if chunked_prefill and max_prefill_tokens is None:
            raise SpardaError("chunked prefill needs a token budget per step (max_prefill_tokens)")
        self.chunked_prefill = bool(chunked_prefill)
        self.vocab_size = llm.model.lm_head.out_features
        #: the KV pool sized by the memory budgets (design §3.11), ``None`` without budgets
        self.memory_plan = None
        if gpu_memory_utilization is not None or host_memory_gib is not None:
            plan = plan_pool if runner.offloaded else plan_rows  # offloaded: a paged host store
            self.memory_plan = plan(runner, max_model_len, max_batch,
                                    gpu_memory_utilization=GPU_SHARE if gpu_memory_utilization is None
                                    else gpu_memory_utilization, host_memory_gib=host_memory_gib)
            self.max_batch = max_batch = self.memory_plan.rows
        host_blocks = None if self.memory_plan is None else self.memory_plan.host_blocks
        start = time.perf_counter()
        self.cache = runner.new_cache(max_batch, max_model_len, host_blocks=host_blocks)
        runner.sync()
        self.cache_alloc_ms = (time.perf_counter() - start) * 1e3
        llm.method.reset()  # nothing kept from a generate() before (the cache's counters start at 0)
        block_size = runner.config.selection.block_size
        self.scheduler = Scheduler(max_batch, max_model_len, max_waiting,
                                   block_pool=None if host_blocks is None else BlockPool(host_blocks),
                                   block_size=block_size,
                                   block_bytes=0 if host_blocks is None else runner.host_block_bytes(),
                                   kv_admission=kv_admission)
        self.eos_ids = llm.eos_ids()
        self._kv_bytes_per_token = runner.kv_bytes_per_token()
        self._tokens = [0] * max_batch      # next input token per row (free rows: 0)
        self._positions = [0] * max_batch   # its position (free rows: 0)
        self._fetching: tuple[int, ...] | None = None  # the decoding rows cache.padding_rows holds
        if self.offloaded:  # padding rows copy no blocks (design §3.13)
            self.cache.padding_rows = torch.ones(max_batch, dtype=torch.bool, device=llm.device)
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self.accepting = True
        self._stop = False
        self._thread: threading.Thread | None = None
        #: the exception that killed the background thread, if one did
        self.crashed: BaseException | None = None
        # counters for metrics()
        self.started = time.time()
        self.generated_tokens = 0
        self.prompt_tokens = 0
        self.finished: collections.Counter[str] = collections.Counter()
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._decoded_tokens = 0
        self._offload: dict | None = None
        self._offload_done = [0, 0, 0]  # hits, misses, bytes copied of finished requests
        self._offload_at = 0.0
        #: an observer of decode steps (benchmarks, e.g. :class:`sparda.bench.traces.RowReplayer`),
        #: or ``None``: ``on_decode_start(row, position, request_id)`` when a row starts decoding (its
        #: prompt's first token sampled, or its recompute done), ``before_decode_step(rows)`` and
        #: ``after_decode_step(rows)`` around each decode step, ``rows`` the rows that decode in it
        self.decode_hook = None
        #: seconds of each step's prefill and decode work (:meth:`metrics`); its ``observers``
        #: get each step's wall time by kind (the server's histogram)
        self.step_timer = StepTimer(CudaClock(llm.device) if llm.device.type == "cuda" else HostClock())

    @property
    def offloaded(self) -> bool:
        """True if the KV cache lives in host memory (an OffloadKVCache)."""
        return self.cache.offload

    # ---------------------------------------------------------------- requests
    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None, *,
                    request_id: str | None = None, on_delta: Callable[[Delta], None] | None = None) -> Sequence:
        """Queue one request. Safe from any thread.

        Args:
            prompt_ids: prompt token ids (chat template already applied if wanted).
            params: :class:`SamplingParams` (default: greedy, 64 tokens). ``max_tokens=None``
                means up to the row's capacity, or what a paged pool holds if that is less.
            request_id: an id unique among live requests (default: a counter).
            on_delta: called with every :class:`Delta` of this request, on the engine's
                thread; keep it short (e.g. hand the delta to an event loop).
        Returns:
            The queued :class:`Sequence`.
        Raises:
            SpardaError: empty prompt, ids outside the vocabulary, prompt + ``max_tokens``
                over ``max_model_len`` (both sizes named); QueueFull; EngineStopped.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise SpardaError(f"sampling parameters must be a SamplingParams, got {type(params).__name__}")
        ids = list(prompt_ids)
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise SpardaError("prompt token ids must be integers")
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise SpardaError(f"prompt token ids must be in [0, {self.vocab_size}), the model's vocabulary")
        max_tokens = params.max_tokens
        if max_tokens is None:  # up to the row's end, or what the KV block pool holds if that is less
            room = min(self.max_model_len, self.scheduler.pool_tokens or self.max_model_len)
            max_tokens = max(room - len(ids), 1)
        self.scheduler.check(len(ids), max_tokens)
        with self._lock:
            if not self.accepting:
                raise EngineStopped("the server is shutting down and takes no new requests; retry on another replica")
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            if rid in self._seqs:
                raise SpardaError(f"request id {rid!r} is already in use")
            seq = Sequence(rid, ids, params, max_tokens, on_delta)
            self.scheduler.add(seq)
            self._seqs[rid] = seq
            self._work.notify_all()
        return seq

    def abort(self, request_id: str) -> None:
        """Cancel a request (waiting or running); its row is freed at the next step. Any thread."""
        with self._lock:
            seq = self._seqs.get(request_id)
            if seq is not None and seq.status is not Status.FINISHED:
                seq.cancelled = True
                self._work.notify_all()

    def has_work(self) -> bool:
        """True if a request waits or runs."""
        with self._lock:
            return self.scheduler.has_work()

    # -------------------------------------------------------------------- step
    def step(self) -> list[Delta]:
        """One iteration: drop cancelled, admit and prefill, decode the rows of a bucket (design §3.13).

        Returns the :class:`Delta` of every request that advanced (each one also goes to
        its ``on_delta``). An exception in one request's own work (its prefill, sampling,
        detokenisation) ends that request alone (:meth:`failed`); one in the batch's
        decode step propagates (the background loop ends the running requests with
        ``error`` and goes on). Timed by :attr:`step_timer` (no host sync).
        """
        self.step_timer.begin()
        try:
            return self._step()
        finally:
            self.step_timer.end()

    def _step(self) -> list[Delta]:
        events: list[tuple[Sequence, Delta]] = []
        with self._lock:
            for seq in self.scheduler.drop_cancelled():
                events.append((seq, self._finish(seq, "abort")))
            self._grow_blocks()
            if self.chunked_prefill:
                decoding = sum(seq.prefilled for seq in self.scheduler.running.values())
                plan = self.scheduler.plan(self.max_prefill_tokens - decoding, self._remaining_chunks)
            else:
                plan = [(seq, 0, seq.num_prefill) for seq in self.scheduler.admit(self.max_prefill_tokens)]
        if plan:
            with self.step_timer.part("prefill", sum(end - start for _, start, end in plan)):
                events.extend(self._prefill(plan))
        with self._lock:
            running = sorted((row, seq) for row, seq in self.scheduler.running.items() if seq.prefilled)
        if running:
            try:
                with self.step_timer.part("decode", len(running)):
                    events.extend(self._decode(running))
            except BaseException:
                self._deliver(events)  # what this step finished before the batch failed
                raise
        self._deliver(events)
        return [delta for _, delta in events]

    @staticmethod
    def _deliver(events: list[tuple[Sequence, Delta]]) -> None:
        for seq, delta in events:
            if seq.on_delta is not None:
                try:
                    seq.on_delta(delta)
                except Exception:  # noqa: BLE001 - a consumer's callback must not stop the others
                    print(f"sparda: the delta callback of request {seq.request_id} failed:", file=sys.stderr)
                    traceback.print_exc(file=sys.stderr)

    def failed(self, seq: Sequence, exc: BaseException) -> Delta:
        """End ``seq`` alone after ``exc`` was raised by its own work (prefill, sampling,
        detokenisation): log the traceback, free its row, finish it with reason ``error``.
        Returns its final delta; the engine goes on with the others."""
        print(f"sparda: request {seq.request_id} failed and was ended (the others go on): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        try:
            return self._finish(seq, "error")
        except Exception:  # noqa: BLE001 - its stats could not be read: free the row regardless
            traceback.print_exc(file=sys.stderr)
            with self._lock:
                if seq.row is not None:
                    with contextlib.suppress(Exception):
                        self._clear_row(seq.row)
                self.scheduler.free(seq)
                with contextlib.suppress(ValueError):
                    self.scheduler.waiting.remove(seq)
                self._seqs.pop(seq.request_id, None)
                self.finished["error"] += 1
            return Delta(seq.request_id, "", [], None, "error", seq.finish("error", {}))

    def _row_counters(self) -> list[torch.Tensor]:
        """Per-row ``[B]`` counters: the method's block counts (of this engine's cache), the
        offload hits/misses, early copies (design §6.2) and ``mixed``'s pool misses."""
        counters = [v for v in self.cache.counters.values()
                    if torch.is_tensor(v) and v.dim() == 1 and v.shape[0] == self.max_batch]
        prefetcher = self.cache.prefetcher
        if prefetcher is not None and prefetcher.hits is not None:
            counters += prefetcher.row_counters()  # last: _finish reads a preempted row's from the end
        return counters

    def _reset_row(self, row: int, values: list | None = None) -> None:
        """Zero ``row``'s counters, or set them to ``values`` (one per counter, as saved at a
        preemption); in place: a captured graph keeps counting into them."""
        with torch.inference_mode():
            for i, counter in enumerate(self._row_counters()):
                counter[row] = 0 if values is None else values[i]

    def _grow_blocks(self) -> None:
        """Growing (design §3.11): before this step's decode, extend the block table of every
        row the scheduler gave a block (in place: the decode step's append, eager or a CUDA
        graph replay, writes the token to that page) and clear the rows of the requests it
        preempted, keeping what their recompute does not rebuild (their counters, the
        cache's per-row decode history). Under the lock."""
        grown, preempted = self.scheduler.grow()
        for seq, row in preempted:
            if seq.output_ids and seq.saved_state is None:  # it decoded (not a half-done recompute)
                seq.saved_state = ([counter[row].clone() for counter in self._row_counters()],
                                   self.cache.decode_state(row))
            self._reset_row(row)
            self._clear_row(row)
        for seq in grown:
            self.cache.assign_blocks(seq.row, seq.blocks)

    def _remaining_chunks(self, seq: Sequence) -> list[tuple[int, int]]:
        """``seq``'s prefill chunks not yet run: :meth:`ModelRunner.chunks` of its
        :attr:`~Sequence.prefill_ids` from ``num_computed`` on, or all of them at once where a
        method or cache cannot spread them over steps (``ModelRunner.prefill_across_steps``)."""
        if not self.runner.prefill_across_steps:
            return [(0, seq.num_prefill)]
        return [(start, end) for start, end in self.runner.chunks(seq.num_prefill) if start >= seq.num_computed]

    def _prefill(self, plan: list[tuple[Sequence, int, int]]) -> list[tuple[Sequence, Delta]]:
        """Run this step's prefill chunks (``(seq, start, end)``, in order) and sample the
        first token of every prompt they complete; a request whose work fails fails alone.
        Whole prompts of an offline run share forwards where allowed (design §3.8); the
        server runs one prompt per forward, so that a request's K/V and logits do not
        depend on which prompts arrived with it (a padded batch rounds differently). A
        preempted request re-prefills its prompt and generated tokens (recompute) and samples
        nothing: it decodes its last token in this step."""
        for seq, start, _ in plan:
            if start == 0:  # admitted this step
                if seq.admitted is None:  # its first admission (a recompute keeps it)
                    seq.admitted = time.perf_counter()
                if self.scheduler.block_pool is not None:  # its host KV blocks (design §3.11)
                    self.cache.assign_blocks(seq.row, seq.blocks)
                self._reset_row(seq.row)
                if seq.generator is None:  # a recompute goes on with its generator
                    seed = seq.params.seed if seq.params.seed is not None else int.from_bytes(os.urandom(7), "little")
                    seq.generator = torch.Generator(device=self.llm.device).manual_seed(seed)
        whole = [seq for seq, start, end in plan if (start, end) == (0, seq.num_prefill)]
        groups = ([[i] for i in range(len(whole))] if self.static_live_len
                  else self.runner.prefill_groups(self.cache, [seq.prefill_ids for seq in whole]))
        events = []
        for group in groups:
            events += self._prefill_group([whole[i] for i in group])
        failed: set[str] = set()
        for seq, start, end in plan:
            if (start, end) == (0, seq.num_prefill) or seq.request_id in failed:
                continue
            begin = time.perf_counter()
            try:
                logits = self.runner.prefill_chunk(self.cache, seq.row, seq.prefill_ids, start, end)
            except Exception as exc:  # noqa: BLE001 - this request's own work
                failed.add(seq.request_id)
                events.append((seq, self.failed(seq, exc)))
                continue
            if not seq.output_ids:  # its prompt's, not a recompute's
                seq.prefill_ms += (time.perf_counter() - begin) * 1e3
            seq.num_computed = end
            if end < seq.num_prefill:  # a padding row until its last chunk (design §3.9)
                self._tokens[seq.row], self._positions[seq.row] = 0, end
                continue
            events += self._first_token(seq, logits)
        return events

    def _first_token(self, seq: Sequence, logits: torch.Tensor) -> list[tuple[Sequence, Delta]]:
        """Sample ``seq``'s first token from its prompt's last logits ``[1, V]``; zero its
        row's counters first (padding decodes of a half-prefilled row counted into them).
        A recompute (design §3.11) samples nothing: its row gets back its counters and decode
        history and runs its last generated token in this step's decode. Returns its event,
        if any."""
        try:
            if seq.output_ids:  # recomputed: it goes on where it stopped
                counters, history = seq.saved_state
                self._reset_row(seq.row, counters)
                self.cache.restore_decode_state(seq.row, history)
                seq.saved_state = None
                self._tokens[seq.row], self._positions[seq.row] = seq.output_ids[-1], seq.position
                self._decode_starts(seq)
                return []
            self._reset_row(seq.row)
            (token, logprob), = sample_requests(logits, [seq.params], [seq.generator])
            with self._lock:
                self.prompt_tokens += seq.num_prompt
            event = (seq, self._advance(seq, token, logprob))
            self._decode_starts(seq)
            return [event]
        except Exception as exc:  # noqa: BLE001 - this request alone fails
            return [(seq, self.failed(seq, exc))]

    def _decode_starts(self, seq: Sequence) -> None:
        """Tell :attr:`decode_hook` that ``seq`` (if it still holds its row) decodes from now on."""
        if self.decode_hook is not None and seq.row is not None:
            self.decode_hook.on_decode_start(seq.row, self._positions[seq.row], seq.request_id)

    def _prefill_group(self, batch: list[Sequence]) -> list[tuple[Sequence, Delta]]:
        """One prefill forward of ``batch``; if it fails, each request again alone, so that
        only the one whose prefill fails is failed."""
        start = time.perf_counter()
        try:
            logits = self.runner.prefill_batch(self.cache, [seq.row for seq in batch],
                                               [seq.prefill_ids for seq in batch])
        except Exception as exc:  # noqa: BLE001 - this request's own work (or one of the batch's)
            if len(batch) == 1:
                return [(batch[0], self.failed(batch[0], exc))]
            return [event for seq in batch for event in self._prefill_group([seq])]
        elapsed_ms = (time.perf_counter() - start) * 1e3
        events = []
        for i, seq in enumerate(batch):
            if not seq.output_ids:  # its prompt's, not a recompute's
                seq.prefill_ms, seq.prefill_batch = elapsed_ms, len(batch)
            seq.num_computed = seq.num_prefill
            events += self._first_token(seq, logits[i:i + 1])
        return events

    def _decode(self, running: list[tuple[int, Sequence]]) -> list[tuple[Sequence, Delta]]:
        """One decode step of the rows ``[0, b)``, ``b`` the bucket of the highest decoding row
        (``running``: ``(row, seq)`` by ascending row; design §3.13)."""
        device = self.llm.device
        rows = [row for row, _ in running]
        seqs = [seq for _, seq in running]
        batch = self.runner.runner(self.cache).bucket(rows[-1] + 1)
        tokens = torch.tensor(self._tokens[:batch], device=device)
        positions = torch.tensor(self._positions[:batch], device=device)
        # static: max_position at the row's end, the same branch (and graph) whoever else runs;
        # else the longest row held, half-prefilled ones too (free rows sit at 0)
        with self._lock:
            longest = self.max_model_len - 1 if self.static_live_len else max(
                self._positions[row] for row in self.scheduler.running)
        self._mark_padding(rows)
        hook = self.decode_hook
        if hook is not None:
            hook.before_decode_step(rows)
        logits = self.runner.decode(self.cache, tokens, positions, longest)
        if hook is not None:
            hook.after_decode_step(rows)
        try:
            picked = sample_requests(logits[rows], [seq.params for seq in seqs], [seq.generator for seq in seqs])
        except Exception:  # noqa: BLE001 - find whose sampling fails: one row at a time below
            picked = None
        self._decoded_tokens += len(seqs)
        events = []
        for i, (row, seq) in enumerate(running):
            try:
                tok, lp = picked[i] if picked is not None else sample_requests(
                    logits[row:row + 1], [seq.params], [seq.generator])[0]
                events.append((seq, self._advance(seq, tok, lp)))
            except Exception as exc:  # noqa: BLE001 - this request alone fails
                events.append((seq, self.failed(seq, exc)))
        if self.offloaded and time.perf_counter() - self._offload_at > OFFLOAD_REFRESH_S:
            self._refresh_offload()
        return events

    def _mark_padding(self, rows: list[int]) -> None:
        """An offloaded cache's :attr:`~sparda.cache.offload.OffloadKVCache.padding_rows`: every
        row but ``rows`` (those that decode), copied in place when they change. A free row
        selects nothing anyway; a half-prefilled one would fetch its cold selection at its
        chunk boundary, a full selection of copies each step, for a discarded output."""
        padding = self.cache.padding_rows if self.offloaded else None
        if padding is None or tuple(rows) == self._fetching:
            return
        mask = torch.ones(padding.shape[0], dtype=torch.bool)
        mask[list(rows)] = False
        with torch.inference_mode():
            padding.copy_(mask)
        self._fetching = tuple(rows)

    def _advance(self, seq: Sequence, token: int, logprob: dict | None) -> Delta:
        delta = seq.append(token, self.tokenizer, self.eos_ids, logprob)
        now = time.perf_counter()
        with self._lock:
            self.generated_tokens += 1
            self._rate.append((now, 1))
        if delta.finish_reason is not None:
            delta.output = self._finish(seq, delta.finish_reason).output
        else:
            self._tokens[seq.row] = token
            self._positions[seq.row] = seq.position
        return delta

    def _finish(self, seq: Sequence, reason: str) -> Delta:
        """Free ``seq``'s row and build its final output (a delta with no new text: text
        held back for a possible stop string is dropped on ``abort``/``error``, and was
        already released by :meth:`Sequence.append` on ``stop``/``length``)."""
        now = time.perf_counter()
        first = seq.first_token if seq.first_token is not None else now
        decoded = max(len(seq.output_ids) - 1, 0)
        stats = {
            "prompt_tokens": seq.num_prompt,
            "new_tokens": len(seq.output_ids),
            "queue_ms": round(((now if seq.admitted is None else seq.admitted) - seq.arrival) * 1e3, 3),
            "prefill_ms": round(seq.prefill_ms, 3),
            "prefill_batch": seq.prefill_batch,
            "preemptions": seq.preemptions,
            "ttft_ms": round((first - seq.arrival) * 1e3, 3) if seq.first_token is not None else None,
            "latency_ms": round((now - seq.arrival) * 1e3, 3),
            "decode_tok_s": round(decoded / (now - first), 3) if decoded and now > first else 0.0,
            "kv_cache_bytes": int(self._kv_bytes_per_token * max(seq.num_prompt + len(seq.output_ids) - 1, 0)),
            "kv_read_fraction": round(self.cache.read_fraction(seq.row), 4) if seq.row is not None else 1.0,
            "cache_alloc_ms": round(self.cache_alloc_ms, 3),
            "graph_capture_ms": round(self.runner.runner(self.cache).capture_s * 1e3, 3),
            "cuda_graph": self.runner.runner(self.cache).replays > 0,
        }
        # a request cancelled while preempted holds no row: its counters are the saved ones
        saved = seq.saved_state[0] if seq.row is None and seq.saved_state is not None else None
        if self.offloaded and (seq.row is not None or saved is not None):
            if saved is not None:
                saved = saved[-len(self.cache.prefetcher.row_counters()):]
            stats["offload"] = self.cache.offload_stats(max(decoded, 1), row=seq.row, saved=saved)
            self._offload_done[0] += stats["offload"]["hits"]
            self._offload_done[1] += stats["offload"]["misses"]
            self._offload_done[2] += stats["offload"]["bytes_copied"]
            if seq.row is not None:
                self._reset_row(seq.row)  # so that the live rows' counters cover running requests only
            self._refresh_offload()
        with self._lock:
            if seq.row is not None:
                self._clear_row(seq.row)
            self.scheduler.free(seq)
            self._seqs.pop(seq.request_id, None)
            self.finished[reason] += 1
        output = seq.finish(reason, stats)
        return Delta(seq.request_id, "", [], None, reason, output)

    def _clear_row(self, row: int) -> None:
        """Make a freed row plain padding: token 0 at position 0, length 0 and, offloaded,
        an empty block map (a stale one could name blocks past every live row's length)."""
        self._tokens[row] = 0
        self._positions[row] = 0
        if self.scheduler.block_pool is not None:
            self.cache.release_blocks(row)
        with torch.inference_mode():
            self.cache.lengths[row] = 0
            for slot_map in self.cache.slot_map.values():
                slot_map[row] = -1

    def _refresh_offload(self) -> None:
        """Engine-wide offload figures: finished requests plus the running rows (one sync); the
        bytes copied are the prefetcher's (early copies and ``mixed``'s pool blocks included)."""
        live = self.cache.offload_stats(1)
        hits, misses = self._offload_done[0] + live["hits"], self._offload_done[1] + live["misses"]
        copied = self._offload_done[2] + live["bytes_copied"]
        self._offload = {"hits": hits, "misses": misses,
                         "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
                         "bytes_copied": copied,
                         "bytes_per_token": round(copied / self._decoded_tokens, 1) if self._decoded_tokens else 0.0}
        self._offload_at = time.perf_counter()

    # ------------------------------------------------------------ synchronous
    def run(self) -> Iterator[Delta]:
        """Step until no request waits or runs, yielding every :class:`Delta` (offline use)."""
        while self.has_work():
            yield from self.step()

    # ------------------------------------------------------------- background
    def start(self) -> None:
        """Run :meth:`step` on a background thread whenever there is work (the server)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="sparda-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """True if the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # the thread itself dies: say so, end every request
            self.crashed = exc
            print(f"sparda: the engine thread crashed ({type(exc).__name__}: {exc}); every request in flight "
                  "is ended with an error and /health answers 503", file=sys.stderr)
            traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
            with contextlib.suppress(BaseException):
                self.stop_accepting()
                self._fail_all(waiting=True)

    def _serve(self) -> None:
        while True:
            with self._work:
                while not self._stop and not self.scheduler.has_work():
                    self._work.wait()
                stop, work = self._stop, self.scheduler.has_work()
            if not work and stop:
                return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - a whole-batch step failed: end the running rows, go on
                self._fail_all(exc)

    def _fail_all(self, exc: BaseException | None = None, waiting: bool = False) -> None:
        """End the running requests (and, with ``waiting``, the queued ones) with ``error``."""
        if exc is None:
            exc = RuntimeError("the engine stopped")
        with self._lock:
            seqs = list(self.scheduler.running.values())
            if waiting:
                seqs += list(self.scheduler.waiting)
                self.scheduler.waiting.clear()
        self._deliver([(seq, self.failed(seq, exc)) for seq in seqs])

    def stop_accepting(self) -> None:
        """Refuse new requests from now on (:class:`EngineStopped`); running ones go on."""
        with self._lock:
            self.accepting = False

    def shutdown(self, drain_timeout_s: float = 0.0) -> None:
        """Stop: refuse new requests, let the others finish for up to ``drain_timeout_s``
        seconds, cancel what is left (finish reason ``abort``) and join the thread."""
        self.stop_accepting()
        deadline = time.monotonic() + max(drain_timeout_s, 0.0)
        while self.alive and self.has_work() and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            for seq in list(self._seqs.values()):
                seq.cancelled = True
            self._stop = True
            self._work.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        elif self.has_work():
            self.step()

    # ---------------------------------------------------------------- metrics
    def metrics(self) -> dict:
        """A snapshot: ``requests_running`` (holding a row), ``requests_prefilling`` (of those,
        half-prefilled, design §3.9), ``requests_waiting``, ``kv_tokens_in_use`` (tokens in
        the cache), ``kv_tokens_total`` (rows x ``max_model_len``; paged, at most blocks x block
        size), ``kv_rows_in_use``,
        ``kv_rows_total``, ``max_model_len``, with a paged cache ``kv_blocks_used`` and
        ``kv_blocks_total`` (host KV blocks, design §3.11), ``generation_tokens_total``,
        ``prompt_tokens_total``, ``generation_tokens_per_s`` (over the last
        ``RATE_WINDOW_S`` seconds), ``requests_finished`` (by finish reason), ``preemptions``
        (requests preempted by recompute so far, design §3.11), ``decode_bucket`` (rows the
        last decode step ran, 0 before the first; design §3.13), ``decode_steps_by_bucket``
        (bucket -> decode steps), ``graph_capture_ms`` (capturing the CUDA graphs so far), the
        step times of :attr:`step_timer` (steps the device has finished; on CUDA the last step
        or two may still be missing): ``prefill_seconds_total`` (in steps' prefill work, first
        tokens' sampling included), ``prefill_tokens_run_total`` (the tokens it ran, recomputed
        ones of preempted requests included, which ``prompt_tokens_total`` leaves out),
        ``prefill_steps_total`` (steps with prefill work), ``decode_seconds_total`` (in decode
        steps, sampling included), ``decode_steps_total`` (those steps: the sum of
        ``decode_steps_by_bucket`` less steps not yet resolved or that raised),
        ``decode_rows_total`` (requests they decoded, one token each) and, on an offloaded
        cache, ``offload`` (``hit_rate``, ``bytes_per_token`` copied per decoded token, ...
        read at most every ``OFFLOAD_REFRESH_S`` seconds)."""
        times = self.step_timer.totals()  # before the lock: it resolves, and tells the observers
        now = time.perf_counter()
        with self._lock:
            while self._rate and self._rate[0][0] < now - RATE_WINDOW_S:
                self._rate.popleft()
            span = min(RATE_WINDOW_S, max(time.time() - self.started, 1e-3))
            held = list(self.scheduler.running.values())
            run = self.cache.decode_runner  # None before the first decode step (made on the engine's thread)
            out = {
                "requests_running": len(held),
                "requests_prefilling": sum(not seq.prefilled for seq in held),
                "requests_waiting": len(self.scheduler.waiting),
                "kv_tokens_in_use": sum(seq.num_cached for seq in held),
                "kv_tokens_total": self.max_batch * self.max_model_len if self.scheduler.block_pool is None
                else min(self.max_batch * self.max_model_len,
                         self.scheduler.block_pool.num_blocks * self.scheduler.block_size),
                "kv_rows_in_use": self.scheduler.rows_in_use,
                "kv_rows_total": self.max_batch,
                "max_model_len": self.max_model_len,
                "generation_tokens_total": self.generated_tokens,
                "prompt_tokens_total": self.prompt_tokens,
                "generation_tokens_per_s": round(sum(n for _, n in self._rate) / span, 3),
                "requests_finished": dict(self.finished),
                "preemptions": self.scheduler.preemptions,
                "decode_bucket": run.last_bucket if run else 0,
                "decode_steps_by_bucket": dict(sorted(run.bucket_steps.copy().items())) if run else {},  # atomic copy
                "graph_capture_ms": round(run.capture_s * 1e3, 3) if run else 0.0,
                "prefill_seconds_total": times["prefill_seconds"],
                "prefill_tokens_run_total": times["prefill_tokens"],
                "prefill_steps_total": times["prefill_steps"],
                "decode_seconds_total": times["decode_seconds"],
                "decode_steps_total": times["decode_steps"],
                "decode_rows_total": times["decode_rows"],
            }
            pool = self.scheduler.block_pool
            if pool is not None:
                out["kv_blocks_used"], out["kv_blocks_total"] = pool.num_used, pool.num_blocks
            if self.offloaded:
                out["offload"] = dict(self._offload or {"hit_rate": 0.0, "bytes_per_token": 0.0})
        return out

