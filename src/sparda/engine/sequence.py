"""One request as the engine sees it: prompt, sampling parameters, output so far, state.

A :class:`Sequence` is created by :meth:`sparda.engine.engine.Engine.add_request`, waits
in the scheduler's queue, holds one KV-cache row while it runs and leaves it when it
finishes (or, preempted, goes back to the queue to re-prefill its prompt and the tokens it
generated, :meth:`Sequence.preempt`). Its text is decoded incrementally so that it can
stream: each new token adds the text it completes (a token that ends inside a multi-byte
character adds nothing until the character is whole), and text that could be the start of a
stop string is held back until it is known not to be one. The streamed deltas concatenate
exactly to the final ``text``.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from sparda.engine.sampling_params import SamplingParams


class Status(enum.Enum):
    """Where a request is: queued, holding a cache row, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """The result of one request (``LLM.generate(prompts, sampling_params)``, the server).

    Attributes:
        request_id: the engine's id of the request.
        text: the completion, special tokens skipped, cut before a stop string.
        token_ids: generated token ids (an EOS or stop token that ended it included).
        finish_reason: ``"stop"`` (EOS, a stop token or a stop string), ``"length"``
            (``max_tokens`` or the row's capacity), ``"abort"`` (cancelled) or ``"error"``.
        prompt_token_ids: the prompt as it was run (chat template applied).
        logprobs: with ``SamplingParams.logprobs = k``, one dict per generated token:
            ``token_id``, ``logprob`` (natural log, model distribution at temperature 1) and
            ``top_logprobs`` (``{token_id: logprob}`` of the ``k`` most likely tokens).
        stats: ``prompt_tokens``, ``new_tokens``, ``queue_ms`` (arrival to first admission),
            ``prefill_ms`` (of its prompt), ``preemptions`` (times it was preempted and
            recomputed, design §3.11), ``ttft_ms`` (arrival to first token), ``latency_ms``
            (arrival to finish), ``decode_tok_s`` (this request's tokens after the first over its own
            decode time), ``kv_cache_bytes`` (its K and V, all layers),
            ``kv_read_fraction`` (KV blocks read per decode step), and on offloaded caches
            ``offload``: this request's ``hits``, ``misses``, ``hit_rate``, ``bytes_copied``
            and ``bytes_per_token`` (its row's counters while it ran; copy times, where
            timed, are the whole batch's).
    """

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    prompt_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    stats: dict = field(default_factory=dict)


@dataclass
class Delta:
    """What one engine step added to a request (streaming).

    Attributes:
        request_id: the request.
        text: new text (may be empty: a partial character, held-back stop prefix).
        token_ids: new token ids (one per step while running, none for the final flush).
        logprobs: new per-token log-probability entries (as :class:`RequestOutput`), or None.
        finish_reason: None while running; set on the request's last delta.
        output: the complete :class:`RequestOutput`, on the last delta only.
    """

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    output: RequestOutput | None = None

    @property
    def finished(self) -> bool:
        """True on the request's last delta."""
        return self.finish_reason is not None


class Sequence:
    """One request: its prompt, parameters, row, generated tokens and text.

    Args:
        request_id: unique id.
        prompt_ids: prompt token ids (non-empty).
        params: the :class:`SamplingParams`.
        max_tokens: new tokens at most (``params.max_tokens`` resolved against the row).
        on_delta: called with each :class:`Delta` (from the engine's thread), or None.
    """

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, max_tokens: int,
                 on_delta=None) -> None:
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.max_tokens = max_tokens
        self.on_delta = on_delta
        self.status = Status.WAITING
        self.row: int | None = None
        #: the KV blocks a paged cache gave it (:mod:`sparda.engine.block_pool`), block ``n`` of
        #: its tokens in ``blocks[n]``
        self.blocks: list[int] = []
        #: the tokens its prefill puts in the cache: the prompt, or after a preemption the
        #: prompt plus every generated token but the last (which the next decode step runs)
        self.prefill_ids: list[int] = self.prompt_ids
        #: times it was preempted (recompute)
        self.preemptions = 0
        #: what its row held that a prefill does not rebuild, saved at a preemption and put
        #: back when its recompute ends: ``(counters, decode history)``, copies of the row's
        #: counters and of ``KVCache.decode_state``; ``None``: nothing saved
        self.saved_state: tuple[list, list] | None = None
        self.output_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        self.finish_reason: str | None = None
        self.cancelled = False
        self.generator: torch.Generator | None = None
        self.text = ""            # emitted so far
        self._held = ""           # decoded but held back (a possible stop-string prefix)
        self._prefix_offset = 0   # incremental detokenisation window over output_ids
        self._read_offset = 0
        self.arrival = time.perf_counter()
        self.admitted: float | None = None
        self.first_token: float | None = None
        self.finished_at: float | None = None
        self.prefill_ms = 0.0
        #: tokens of :attr:`prefill_ids` already in the cache (chunked prefill across steps, design §3.8)
        self.num_computed = 0
        self.admit_order = 0  # set by the scheduler at admission
        self.prefill_batch = 1  # requests that shared its prefill forward
        self.stats: dict = {}

    @property
    def num_prompt(self) -> int:
        """Prompt tokens."""
        return len(self.prompt_ids)

    @property
    def num_prefill(self) -> int:
        """Tokens its prefill puts in the cache (:attr:`prefill_ids`)."""
        return len(self.prefill_ids)

    @property
    def prefilled(self) -> bool:
        """True once every token of :attr:`prefill_ids` is in the cache (the request decodes)."""
        return self.num_computed >= self.num_prefill

    @property
    def num_cached(self) -> int:
        """Tokens in its KV cache row: its prefill's so far, then every token before :attr:`position`."""
        return self.position if self.prefilled and self.output_ids else self.num_computed

    def preempt(self) -> None:
        """Back to waiting, holding nothing: its next prefill (a recompute) runs the prompt and
        every generated token but the last; its output, text and generator stay."""
        self.status = Status.WAITING
        self.row, self.blocks = None, []
        self.prefill_ids = self.prompt_ids + self.output_ids[:-1] if self.output_ids else self.prompt_ids
        self.num_computed = 0
        self.preemptions += 1

    @property
    def position(self) -> int:
        """Position of the next token to run through the model (its last sampled one)."""
        return self.num_prompt + len(self.output_ids) - 1

    # ------------------------------------------------------------- text
    def _decode_new(self, tokenizer, final: bool) -> str:
        """Text completed by the tokens since the last call (a sliding decode window)."""
        ids = self.output_ids
        if self._read_offset >= len(ids):
            return ""
        before = tokenizer.decode(ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        after = tokenizer.decode(ids[self._prefix_offset:], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            return after[len(before):]
        return ""

    def _release(self, new: str, final: bool) -> tuple[str, bool]:
        """Apply the stop strings to ``new`` text: ``(text to emit, stop string found)``."""
        stops = self.params.stop
        pending = self._held + new
        self._held = ""
        if not stops:
            return pending, False
        cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
        if cut >= 0:
            return pending[:cut], True
        if final:
            return pending, False
        # hold back the longest tail that could still grow into a stop string
        longest = max(len(s) for s in stops) - 1
        for k in range(min(longest, len(pending)), 0, -1):
            tail = pending[-k:]
            if any(s.startswith(tail) for s in stops):
                self._held = tail
                return pending[:-k], False
        return pending, False

    # ---------------------------------------------------------- tokens
    def append(self, token: int, tokenizer, eos_ids: set[int], logprob: dict | None = None) -> Delta:
        """Add one sampled token; decide whether the request is finished.

        Args:
            token: the sampled token id.
            tokenizer: a Hugging Face tokenizer (``decode``).
            eos_ids: end-of-sequence ids (ignored with ``params.ignore_eos``).
            logprob: this token's log-probability entry, if ``params.logprobs`` is set.
        Returns:
            The :class:`Delta`; its ``finish_reason`` is set if this token ended the request
            (then call :meth:`finish`).
        """
        now = time.perf_counter()
        if self.first_token is None:
            self.first_token = now
        self.output_ids.append(token)
        if logprob is not None and self.logprobs is not None:
            self.logprobs.append(logprob)
        stop_token = token in self.params.stop_token_ids or (not self.params.ignore_eos and token in eos_ids)
        length = len(self.output_ids) >= self.max_tokens
        final = stop_token or length
        text, stop_string = self._release(self._decode_new(tokenizer, final), final)
        self.text += text
        reason = "stop" if stop_token or stop_string else "length" if length else None
        self.finish_reason = reason
        return Delta(self.request_id, text, [token], [logprob] if logprob is not None else None, reason)

    def finish(self, reason: str, stats: dict) -> RequestOutput:
        """Mark the request finished with ``reason`` and ``stats``; returns its output."""
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.finished_at = time.perf_counter()
        self.stats = stats
        return self.output()

    def output(self) -> RequestOutput:
        """The :class:`RequestOutput` as it stands."""
        return RequestOutput(request_id=self.request_id, text=self.text, token_ids=list(self.output_ids),
                             finish_reason=self.finish_reason, prompt_token_ids=list(self.prompt_ids),
                             logprobs=None if self.logprobs is None else list(self.logprobs),
                             stats=dict(self.stats))
