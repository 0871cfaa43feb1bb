"""The decode-step runner: static input buffers, eager or replayed as CUDA graphs.

A decode step of every method runs on static shapes (docs/cuda_graphs.md): the token
ids and positions live in preallocated device buffers, every layer's views span the
cache's capacity with per-row lengths on the device, counters are updated in place,
and nothing reads a device value on the host. So on CUDA one captured graph replays
every later step with a single launch, the side-stream prefetch of offloaded
``sparda`` included (the side stream forks from the capture stream and rejoins it at
each layer's prefetch wait).

One :class:`DecodeRunner` belongs to one KV cache (the graph bakes in the cache's
buffers). Its graphs are keyed by :meth:`AttentionMethod.graph_key` -- the host-side
branches of a step, e.g. whether the context has outgrown the dense fallback -- so a
method that crosses ``dense_len`` during a generation captures a second graph once.
Each key is first run eagerly (a warm-up that compiles the Triton kernels and
allocates the counters), then captured, then replayed; all graphs of a runner share
one memory pool. The rows of the step are the cache's rows: rows without a live
sequence are padding whose outputs the caller discards.

On the CPU, with ``cuda_graphs=False`` (CLI ``--eager``), or with a transfer engine
that synchronises the host (``copy``, ``sync``), the same static-shape step runs
eagerly.
"""

from __future__ import annotations

import time
import weakref

import torch


class DecodeRunner:
    """Decode steps of one cache on static buffers, replayed as CUDA graphs where possible.

    Args:
        model_runner: the :class:`~sparda.engine.runner.ModelRunner` (model, method, device).
        cache: its KV cache (``DeviceKVCache`` or ``OffloadKVCache``) of ``B`` rows.
        cuda_graphs: capture and replay on CUDA (ignored on the CPU).
    Attributes:
        tokens: ``[B]`` int64 device buffer, the token each row feeds this step.
        positions: ``[B]`` int64 device buffer, each token's position (tokens).
        use_graphs: whether steps replay graphs (CUDA, graphs on, no host-syncing engine).
        captures, replays: counts of captured graphs and of replayed steps.
        capture_s: wall seconds spent capturing them (host clock, device synchronised first).
    """

    def __init__(self, model_runner, cache, cuda_graphs: bool = True) -> None:
        self.model_runner = model_runner
        self._cache = weakref.ref(cache)  # the cache owns its runner: no reference cycle
        batch = cache.lengths.shape[0]
        device = model_runner.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)
        self.use_graphs = bool(cuda_graphs and device.type == "cuda"
                               and not (cache.engine is not None and cache.engine.syncs_host))
        self.graphs: dict = {}
        self.outputs: dict = {}
        self._warm: set = set()
        self._pool = None
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0

    @property
    def cache(self):
        """The KV cache this runner steps (raises if it was freed)."""
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the KV cache of this decode runner was freed")
        return cache

    def load(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy this step's ``tokens [B]`` and ``positions [B]`` (int64) into the buffers."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)

    def eager(self, live_len: int) -> torch.Tensor:
        """One eager decode step from the buffers; ``live_len`` (host int, tokens) is the
        longest row's length after this step's append. Returns logits ``[B, V]`` fp32."""
        return self.model_runner.decode_step(self.cache, self.tokens, self.positions, self.rows, live_len)

    @torch.inference_mode()
    def step(self, live_len: int) -> torch.Tensor:
        """Run one decode step from :attr:`tokens` / :attr:`positions`.

        Returns logits ``[B, V]`` fp32. With graphs this is the graph's static output
        tensor: read (or copy) it before the next step overwrites it.
        """
        if not self.use_graphs:
            return self.eager(live_len)
        key = self.model_runner.method.graph_key(live_len)
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._warm:  # compile kernels and allocate counters first
                self._warm.add(key)
                return self.eager(live_len)
            graph = self._capture(key, live_len)
        graph.replay()
        self.replays += 1
        return self.outputs[key]

    def _capture(self, key, live_len: int):
        device = self.model_runner.device
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.eager(live_len)
        self.graphs[key], self.outputs[key] = graph, out
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph
