"""Device ops issued per decode step and layer, counted on any device (design §6, §6.1).

:class:`OpCounter` counts what one decode step would launch on CUDA, without a GPU:

* every call of a :mod:`sparda.kernels` dispatch function (a Triton kernel on CUDA, its PyTorch
  twin elsewhere) and of the cache's transfer engine (``gather``, ``gather_planes``,
  ``store_tokens``: one UVA kernel on CUDA) counts **one** op, whatever the twin runs inside;
* every other ATen op counts one, except those that launch nothing on CUDA: views and
  metadata ops (``view``, ``slice``, ``expand``, ``t`` ...) and uninitialised allocations
  (``empty``, ``empty_strided``, ``empty_like``).

Ops are attributed to the layer whose iteration of the decode loop issues them: from the
layer's append (``cache.rope_append`` in the fused step, ``cache.append`` in the unfused one)
to the next layer's; ``"pre"`` before layer 0 (embedding, first norm), ``"head"`` from the LM
head on. Layer ``l``'s iteration holds its own attention and, under ``sparda``, the selection,
slot diff and copy of layer ``l + 1``. A dispatch function that launches two kernels on CUDA
(decode attention's split and combine, selection's scoring and rule) counts one here; the
GPU check (``benchmarks/check_mixed.py``) counts real kernels with ``torch.profiler``.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparda import kernels
from sparda.cache.transfer import SyncEngine

#: ATen ops that launch no kernel on CUDA besides views: uninitialised allocations and metadata
FREE_OPS = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
                      "lift_fresh", "alias", "resolve_conj", "resolve_neg", "is_same_size", "size", "stride",
                      "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "is_contiguous",
                      "_has_compatible_shallow_copy_type", "record_stream", "set_"})
#: transfer-engine methods that are one kernel each on CUDA (the ``uva`` engine)
ENGINE_METHODS = ("gather", "gather_planes", "store_tokens")


def _launches_nothing(func) -> bool:
    if func.is_view:
        return True
    return func.overloadpacket.__name__ in FREE_OPS


class OpCounter(TorchDispatchMode):
    """Counts device ops (module doc) while active; ``counts[(layer, name)]``.

    ``name`` is ``kernels.<fn>``, ``engine.<method>`` or ``aten.<op>``. Use :meth:`watch`
    to wrap the dispatch layer and a cache (its engine and layer boundaries).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.layer: int | str = "pre"
        self._depth = 0  # > 0 inside a counted kernel or engine call
        #: the counted step's logits (:func:`count_decode_step`)
        self.logits: torch.Tensor | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._depth == 0 and not _launches_nothing(func):
            self.counts[(self.layer, f"aten.{func.overloadpacket.__name__}")] += 1
        return func(*args, **(kwargs or {}))

    def _kernel(self, name: str, fn):
        def counted(*args, **kwargs):
            if self._depth == 0:
                self.counts[(self.layer, name)] += 1
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return counted

    def _layer_start(self, fn):
        def start(layer, *args, **kwargs):
            if self._depth == 0:
                self.layer = layer
            return fn(layer, *args, **kwargs)
        return start

    @contextlib.contextmanager
    def watch(self, cache, model=None):
        """Wrap :mod:`sparda.kernels`' dispatch functions, ``cache``'s engine methods and
        append hooks (layer boundaries) and, given ``model``, its LM head (``"head"``) for
        the block; undone on exit. Enter the counter itself (``with counter:``) to count."""
        patches = [(kernels, name, self._kernel(f"kernels.{name}", getattr(kernels, name)))
                   for name in kernels.__all__ if callable(getattr(kernels, name))]
        patches += [(cache.engine, name, self._kernel(f"engine.{name}", getattr(cache.engine, name)))
                    for name in ENGINE_METHODS]
        patches += [(cache, name, self._layer_start(getattr(cache, name))) for name in ("rope_append", "append")]
        saved = [(obj, name, obj.__dict__.get(name)) for obj, name, _ in patches]
        hook = None
        try:
            for obj, name, fn in patches:
                setattr(obj, name, fn)
            if model is not None:
                hook = model.lm_head.register_forward_pre_hook(lambda *_: setattr(self, "layer", "head"))
            yield self
        finally:
            if hook is not None:
                hook.remove()
            for obj, name, old in reversed(saved):
                if old is None:
                    delattr(obj, name)
                else:
                    setattr(obj, name, old)

    def per_layer(self) -> dict:
        """``{layer: ops}`` (``"pre"``, layer ints, ``"head"``)."""
        out: Counter = Counter()
        for (layer, _), n in self.counts.items():
            out[layer] += n
        return dict(out)

    def breakdown(self, layer) -> dict[str, int]:
        """``{name: ops}`` of one layer, most first."""
        rows = [(name, n) for (lay, name), n in self.counts.items() if lay == layer]
        return dict(sorted(rows, key=lambda kv: (-kv[1], kv[0])))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def count_decode_step(runner, cache, tokens: torch.Tensor, positions: torch.Tensor) -> OpCounter:
    """The ops of one static-shape decode step (what a CUDA graph captures:
    :meth:`~sparda.engine.runner.ModelRunner.decode_step`) of every cache row; ``tokens,
    positions [B]`` int64. The step runs (the cache advances by one token)."""
    counter = OpCounter()
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    live = int(positions.max()) + 1
    with torch.inference_mode(), counter.watch(cache, runner.model), counter:
        counter.logits = runner.decode_step(cache, tokens, positions, rows, live)
    return counter


class TwinEngine(SyncEngine):
    """The ``sync`` engine's indexing under another name: an offloaded cache then takes the
    path it takes with CUDA's asynchronous ``uva`` engine (the fused append writes the token
    to host memory itself, ``OffloadKVCache._fused_host``), so the CPU count is CUDA's."""

    name = "twin"
    syncs_host = False


def twin_engine(cache) -> None:
    """Give an offloaded ``cache`` on the CPU a :class:`TwinEngine` (module doc); else nothing."""
    if getattr(cache, "offload", False) and cache.device.type != "cuda":
        cache.engine = cache.prefetcher.engine = TwinEngine()


def force_fused(runner) -> None:
    """Make ``runner`` (a :class:`~sparda.engine.runner.ModelRunner`) take the fused decode step
    of CUDA (:class:`~sparda.model.fused.FusedDecoder`) on any device: on the CPU its kernels
    dispatch to their twins, so the ops counted are the CUDA step's."""
    from sparda.model.fused import FusedDecoder

    with torch.inference_mode(False), torch.no_grad():
        runner._fused = FusedDecoder(runner.model, runner.method)
    runner._fused_checked = True


def decode_op_counts(runner, prompts: list[list[int]], warmup: int = 3, steps: int = 2,
                     extra_capacity: int = 16) -> list[OpCounter]:
    """Prefill ``prompts`` (one cache row each), decode ``warmup`` greedy steps uncounted, then
    ``steps`` counted ones (:func:`count_decode_step`); one :class:`OpCounter` per counted step.
    On the CPU an offloaded cache gets :func:`twin_engine` (CUDA's path)."""
    runner.method.reset()
    capacity = max(map(len, prompts)) + warmup + steps + extra_capacity
    cache = runner.new_cache(len(prompts), capacity)
    twin_engine(cache)
    with torch.inference_mode():
        logits = torch.stack([runner.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)])
    dev = logits.device
    tokens = logits.argmax(-1)
    positions = torch.tensor([len(p) for p in prompts], device=dev)
    counted = []
    for i in range(warmup + steps):
        if i < warmup:
            with torch.inference_mode():
                out = runner.decode_step(cache, tokens, positions, torch.arange(len(prompts), device=dev),
                                         int(positions.max()) + 1)
        else:
            counter = count_decode_step(runner, cache, tokens, positions)
            counted.append(counter)
            out = counter.logits
        tokens, positions = out.argmax(-1), positions + 1
    return counted
