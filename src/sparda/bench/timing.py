"""Per-component decode timing of an instrumented run (docs/bench.md, Breakdown): hooks and
instance wrappers on an LLM and its cache; nested intervals give each component its
exclusive time (CUDA events on the compute stream, else ``time.perf_counter``).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch

#: components reported (``other``: embedding, norms, RoPE, residuals; the step minus the rest)
COMPONENTS = ("projections", "selection", "attention", "mlp", "transfer", "append", "lm_head", "other")


class ComponentTimer:
    """Nested interval timer with hooks into an LLM and its cache (``device``: CUDA events, else wall clock)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.intervals: list[list] = []  # [name, start, end, parent]
        self.stack: list[int] = []
        self._undo: list = []
        self.steps = 0

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def push(self, name: str) -> None:
        """Open an interval named ``name`` (nested inside the open one)."""
        parent = self.stack[-1] if self.stack else -1
        self.intervals.append([name, self._mark(), None, parent])
        self.stack.append(len(self.intervals) - 1)

    def pop(self) -> None:
        """Close the innermost open interval."""
        self.intervals[self.stack.pop()][2] = self._mark()

    def wrap(self, obj, attr: str, name: str) -> None:
        """Time every call of ``obj.attr`` as ``name`` (instance attribute, undone by :meth:`remove`)."""
        original = getattr(obj, attr)

        def timed(*args, **kwargs):
            self.push(name)
            try:
                return original(*args, **kwargs)
            finally:
                self.pop()

        had = attr in vars(obj)
        setattr(obj, attr, timed)
        self._undo.append(lambda: setattr(obj, attr, original) if had else delattr(obj, attr))

    def hook(self, module: torch.nn.Module, name: str) -> None:
        """Time every forward of ``module`` as ``name``."""
        pre = module.register_forward_pre_hook(lambda *_: self.push(name))
        post = module.register_forward_hook(lambda *_: self.pop())
        self._undo += [pre.remove, post.remove]

    def install(self, llm, cache) -> None:
        """Instrument ``llm`` (projections, MLPs, LM head, selection, attention) and ``cache`` (append, fetch, wait)."""
        for layer in llm.model.model.layers:
            attn = layer.self_attn
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                self.hook(proj, "projections")
            self.hook(layer.mlp, "mlp")
        self.hook(llm.model.lm_head, "lm_head")
        method = llm.method
        self.wrap(method, "attend", "attention")
        for attr in ("before_layer", "select", "_select"):
            if hasattr(method, attr):
                self.wrap(method, attr, "selection")
        if hasattr(method, "forecast"):
            self.wrap(method.forecast, "project", "selection")
        self.wrap(cache, "append", "append")
        if cache.offload:
            self.wrap(cache, "fetch", "transfer")
            self.wrap(cache.prefetcher, "wait", "transfer")

    def remove(self) -> None:
        """Undo every hook and wrapper."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def step(self, fn):
        """Run ``fn()`` (one decode step) as one ``step`` interval; returns its result."""
        self.push("step")
        try:
            return fn()
        finally:
            self.pop()
            self.steps += 1

    def _elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3

    def summary(self) -> dict[str, float]:
        """Exclusive ms per decode step of each of :data:`COMPONENTS` plus ``total`` (synchronises)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        inclusive = [self._elapsed_ms(s, e) for _, s, e, _ in self.intervals]
        child = defaultdict(float)
        for i, (_, _, _, parent) in enumerate(self.intervals):
            if parent >= 0:
                child[parent] += inclusive[i]
        out = defaultdict(float)
        for i, (name, _, _, _) in enumerate(self.intervals):
            out["other" if name == "step" else name] += inclusive[i] - child[i]
            if name == "step":
                out["total"] += inclusive[i]
        steps = max(self.steps, 1)
        return {k: round(out.get(k, 0.0) / steps, 4) for k in COMPONENTS + ("total",)}


def cuda_ms(fn, reps: int = 20) -> float:
    """Mean ms of one ``fn()`` on the current CUDA stream: one untimed call, then ``reps`` timed."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps
