"""The engine's time per step, split into its prefill and decode work, taken without a host sync.

:class:`StepTimer` marks the start and end of each :meth:`Engine.step` and of its two parts:
``prefill`` (the step's prefill chunks or whole prompts, the first tokens they sample
included; design §3.9) and ``decode`` (the decode step of a bucket, its sampling and the
deltas it builds; design §3.13). On the CPU a mark is a ``time.perf_counter()`` reading
(:class:`HostClock`); on CUDA it is a CUDA event recorded on the device's current stream
(:class:`CudaClock`), read only once ``Event.query()`` says the device has passed it: at the
next step, or when the totals are read. The step never waits for the device. An event pair
times the device's stream from the first mark to the second, host gaps included where the
device waited for the host.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable

#: the kinds of step :attr:`StepTimer.observers` are told: decode only, or prefill work in it
STEP_KINDS = ("decode", "mixed")


class HostClock:
    """Marks are ``time.perf_counter()`` seconds, ready at once (the CPU)."""

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark) -> bool:
        return True

    def seconds(self, start, end) -> float:
        return end - start


class CudaClock:
    """Marks are CUDA events (timing on) recorded on ``device``'s current stream, ready once
    ``query()`` is true; ``event`` and ``stream`` make them (defaults: ``torch.cuda.Event``,
    ``torch.cuda.current_stream(device)``; a test passes its own)."""

    def __init__(self, device, event: Callable | None = None, stream: Callable | None = None) -> None:
        import torch

        self.event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self.stream = stream or (lambda: torch.cuda.current_stream(device))

    def mark(self):
        event = self.event()
        event.record(self.stream())
        return event

    def ready(self, mark) -> bool:
        return bool(mark.query())

    def seconds(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3  # milliseconds


class _Step:
    __slots__ = ("start", "end", "parts")

    def __init__(self, start) -> None:
        self.start, self.end = start, None
        self.parts: dict[str, tuple] = {}  # kind -> (start mark, end mark, count)


class StepTimer:
    """Seconds and counts of the engine's steps (module docstring), totalled once resolved.

    Counted per step whose marks the clock has resolved: ``prefill_seconds``,
    ``prefill_tokens`` (tokens of the chunks or prompts the step planned, recomputed tokens of
    preempted requests included) and ``prefill_steps`` (steps with prefill work);
    ``decode_seconds``, ``decode_steps`` and ``decode_rows`` (requests decoded, one token
    each). A step that raised, or ran neither part, is not counted. Each counted step's wall
    time (start to end of :meth:`Engine.step`) goes to every ``observers`` callable as
    ``(kind, seconds)``, ``kind`` ``decode`` (decode only) or ``mixed`` (prefill work, with or
    without decode), on the thread that resolves it.

    Args:
        clock: :class:`HostClock` or :class:`CudaClock` (``mark``, ``ready``, ``seconds``).
    """

    def __init__(self, clock) -> None:
        self.clock = clock
        self.observers: list[Callable[[str, float], None]] = []
        self._lock = threading.Lock()
        self._pending: deque[_Step] = deque()  # ended, not yet resolved, oldest first
        self._step: _Step | None = None  # the step under way (the engine's thread only)
        self._open: str | None = None  # its part under way
        self._totals = {"prefill_seconds": 0.0, "prefill_tokens": 0, "prefill_steps": 0,
                        "decode_seconds": 0.0, "decode_steps": 0, "decode_rows": 0}

    def begin(self) -> None:
        """A step starts: resolve what the device has passed, mark the start."""
        self.resolve()
        self._step, self._open = _Step(self.clock.mark()), None

    @contextlib.contextmanager
    def part(self, kind: str, count: int):
        """Time the block as the step's ``kind`` (``prefill``: ``count`` tokens; ``decode``:
        ``count`` rows). If the block raises, the step is not counted."""
        self._open = kind
        start = self.clock.mark()
        yield
        self._step.parts[kind] = (start, self.clock.mark(), count)
        self._open = None

    def end(self) -> None:
        """The step ends: queue its marks for resolution (a step that raised, or did nothing,
        is dropped) and resolve what is ready."""
        step, self._step = self._step, None
        if step is None or self._open is not None or not step.parts:
            self._open = None
            return
        step.end = self.clock.mark()
        with self._lock:
            self._pending.append(step)
        self.resolve()

    def resolve(self) -> None:
        """Add every ended step whose marks are all ready, oldest first; stops at the first
        that is not (the device runs them in order)."""
        clock = self.clock
        with self._lock:
            while self._pending:
                step = self._pending[0]
                marks = [step.start, step.end] + [m for s, e, _ in step.parts.values() for m in (s, e)]
                if not all(clock.ready(m) for m in marks):
                    return
                self._pending.popleft()
                totals = self._totals
                for kind, (start, end, count) in step.parts.items():
                    totals[f"{kind}_seconds"] += clock.seconds(start, end)
                    totals[f"{kind}_steps"] += 1
                    totals["prefill_tokens" if kind == "prefill" else "decode_rows"] += count
                kind = "mixed" if "prefill" in step.parts else "decode"
                seconds = clock.seconds(step.start, step.end)
                for observer in list(self.observers):
                    try:
                        observer(kind, seconds)
                    except Exception:  # noqa: BLE001 - an observer must not stop the engine
                        print("sparda: a step-time observer failed:", file=sys.stderr)
                        traceback.print_exc(file=sys.stderr)

    def totals(self) -> dict:
        """The totals so far (after resolving what is ready): keys of the class docstring."""
        self.resolve()
        with self._lock:
            return dict(self._totals)

    @property
    def pending(self) -> int:
        """Ended steps not yet resolved (the device has not passed their marks)."""
        with self._lock:
            return len(self._pending)
