"""The decode-step runner: static input buffers, eager or replayed as CUDA graphs.

A decode step of every method runs on static shapes (docs/cuda_graphs.md): the token
ids and positions live in preallocated device buffers, every layer's views span the
cache's capacity with per-row lengths on the device, counters are updated in place,
and nothing reads a device value on the host. So on CUDA one captured graph replays
every later step with a single launch, the side-stream prefetch of offloaded
``sparda`` included (the side stream forks from the capture stream and rejoins it at
each layer's prefetch wait).

A step runs the cache's first ``b`` rows, ``b`` a decode batch bucket (design §3.13,
:mod:`sparda.engine.buckets`): it reads the first ``b`` entries of the runner's buffers
(views) and leaves the rows past ``b`` untouched. One :class:`DecodeRunner` belongs to
one KV cache (the graph bakes in the cache's buffers). Its graphs are keyed by the
bucket and :meth:`AttentionMethod.graph_key` -- the host-side branches of a step, e.g.
whether the context has outgrown the dense fallback -- so a method that crosses
``dense_len`` during a generation captures a second graph per bucket once. Each key is
first run eagerly (a warm-up that compiles the Triton kernels and allocates the
counters), then captured, then replayed; all graphs of a runner share one memory pool
(they never run concurrently, and what outlives a replay -- counters, cache state --
was allocated by the eager warm-up, outside the pool). Rows below ``b`` without a live
sequence are padding whose outputs the caller discards.

On the CPU, with ``cuda_graphs=False`` (CLI ``--eager``), or with a transfer engine
that synchronises the host (``copy``, ``sync``), the same static-shape step of the same
rows runs eagerly.
"""

from __future__ import annotations

import time
import weakref

import torch

from sparda.engine.buckets import bucket_for, decode_buckets


class DecodeRunner:
    """Decode steps of one cache on static buffers, replayed as CUDA graphs where possible.

    Args:
        model_runner: the :class:`~sparda.engine.runner.ModelRunner` (model, method, device).
        cache: its KV cache (``DeviceKVCache`` or ``OffloadKVCache``) of ``B`` rows.
        cuda_graphs: capture and replay on CUDA (ignored on the CPU).
    Attributes:
        tokens: ``[B]`` int64 device buffer, the token each row feeds this step.
        positions: ``[B]`` int64 device buffer, each token's position (tokens).
        buckets: the decode batch buckets, ascending, the last ``B`` (design §3.13).
        use_graphs: whether steps replay graphs (CUDA, graphs on, no host-syncing engine).
        captures, replays: counts of captured graphs and of replayed steps.
        capture_s: wall seconds spent capturing them (host clock, device synchronised first).
        last_bucket: rows of the last step (0 before any). bucket_steps: bucket -> steps run.
    """

    def __init__(self, model_runner, cache, cuda_graphs: bool = True) -> None:
        self.model_runner = model_runner
        self._cache = weakref.ref(cache)  # the cache owns its runner: no reference cycle
        batch = cache.lengths.shape[0]
        device = model_runner.device
        self.batch = batch
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)
        self.rows = torch.arange(batch, device=device)
        self.buckets = decode_buckets(model_runner.config.runtime.cuda_graph_sizes, batch)
        self.use_graphs = bool(cuda_graphs and device.type == "cuda"
                               and not (cache.engine is not None and cache.engine.syncs_host))
        self.graphs: dict = {}
        self.outputs: dict = {}
        self._warm: set = set()
        self._pool = None
        self.captures = 0
        self.replays = 0
        self.capture_s = 0.0
        self.last_bucket = 0
        self.bucket_steps: dict[int, int] = {}

    @property
    def cache(self):
        """The KV cache this runner steps (raises if it was freed)."""
        cache = self._cache()
        if cache is None:
            raise RuntimeError("the KV cache of this decode runner was freed")
        return cache

    def bucket(self, needed: int) -> int:
        """The bucket of a step whose highest decoding row is ``needed - 1``: the smallest of
        :attr:`buckets` that is at least ``needed`` (:func:`~sparda.engine.buckets.bucket_for`)."""
        return bucket_for(self.buckets, needed)

    def load(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """Copy this step's ``tokens [b]`` and ``positions [b]`` (int64, rows ``0 .. b - 1``,
        ``b <= B``) into the front of the buffers."""
        b = tokens.shape[0]
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)

    def eager(self, live_len: int, batch: int | None = None) -> torch.Tensor:
        """One eager decode step of rows ``0 .. batch - 1`` (``None``: every row) from the
        buffers; ``live_len`` (host int, tokens) is the longest row's length after this
        step's append. Returns logits ``[batch, V]`` fp32."""
        b = self.batch if batch is None else batch
        return self.model_runner.decode_step(self.cache, self.tokens[:b], self.positions[:b], self.rows[:b],
                                             live_len)

    @torch.inference_mode()
    def step(self, live_len: int, batch: int | None = None) -> torch.Tensor:
        """Run one decode step of rows ``0 .. batch - 1`` (``None``: every row; usually a
        bucket, :meth:`bucket`) from :attr:`tokens` / :attr:`positions`; rows past it are
        not touched.

        Returns logits ``[batch, V]`` fp32. With graphs this is the graph's static output
        tensor: read (or copy) it before the next step overwrites it.

        Raises:
            ValueError: ``batch`` outside ``1 .. B``.
        """
        b = self.batch if batch is None else int(batch)
        if not 1 <= b <= self.batch:
            raise ValueError(f"a decode step of {b} rows on a cache of {self.batch} rows")
        self.last_bucket = b
        self.bucket_steps[b] = self.bucket_steps.get(b, 0) + 1
        if not self.use_graphs:
            return self.eager(live_len, b)
        key = (b, self.model_runner.method.graph_key(live_len))
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self._warm:  # compile kernels and allocate counters first
                self._warm.add(key)
                return self.eager(live_len, b)
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
            out = self.eager(live_len, key[0])
        self.graphs[key], self.outputs[key] = graph, out
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        return graph
