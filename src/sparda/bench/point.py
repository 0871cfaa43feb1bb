"""One benchmark point: build the method's LLM, fill a cache directly, time prefill and decode
(docs/bench.md, How each number is measured).
"""

from __future__ import annotations

import gc
import statistics
import time

import torch

from sparda.bench.gpu_profile import kernel_summary
from sparda.bench.models import method_extra_bytes, weight_bytes
from sparda.bench.roofline import kv_read_breakdown, roofline_ms
from sparda.bench.timing import ComponentTimer
from sparda.bench.traces import (LOOKAHEAD2_RECALL, Replayer, replay_ids, replay_masks, synthetic_masks,
                                 trace_for)
from sparda.cache import pinned
from sparda.cache.host import available_host_bytes
from sparda.config import DEFAULT_SLOT_FACTOR
from sparda.engine import memory
from sparda.engine.graph_runner import DecodeRunner
from sparda.engine.llm import LLM
from sparda.errors import SpardaError
from sparda.kernels.quant import slot_dtype, token_bytes
from sparda.model.llama import StepInfo

#: methods whose KV cache lives in host memory (design §6)
HOST_KV = {"sparse-offload", "sparda-no-prefetch", "sparda"}


class OutOfMemory(Exception):
    """A point does not fit (device or host memory); recorded as ``oom``."""


class TimeBudgetExceeded(Exception):
    """The sweep's ``--time-budget-s`` ran out inside a point; recorded as ``skipped``."""


def check_deadline(deadline: float | None) -> None:
    """Raise :class:`TimeBudgetExceeded` once ``time.perf_counter()`` passes ``deadline`` (s)."""
    if deadline is not None and time.perf_counter() > deadline:
        raise TimeBudgetExceeded("time budget ran out inside the point")


def make_llm(model, method: str, selection, forecast, transfer: str = "auto", cuda_graphs: bool = True,
             kv_dtype: str = "bf16", slot_factor: float | None = None, lookahead: int = 1,
             forecast2=None) -> LLM:
    """The LLM a sweep method runs (``sparda``: offloaded with prefetch; ``dense``, ``sparse``,
    ``infinigen``: on-device cache); ``cuda_graphs`` (docs/cuda_graphs.md), ``kv_dtype`` (docs/kv_quant.md);
    ``lookahead`` 2 (``sparda`` only) with the two-ahead Forecast module ``forecast2`` (design §6.2)."""
    fields = {f: getattr(selection, f) for f in ("block_size", "kernel_size", "kernel_stride", "init_blocks",
                                                 "local_blocks", "topk_blocks", "dense_len")}
    two = dict(lookahead=2, forecast2=forecast2) if lookahead == 2 else {}
    return LLM.from_model(model, method=method, preset="small", forecast=forecast, transfer=transfer,
                          offload=True if method == "sparda" else None, cuda_graphs=cuda_graphs,
                          kv_dtype=kv_dtype, slot_factor=slot_factor, **fields, **two)


def release_memory(device: torch.device) -> None:
    """Give freed memory back: Python garbage, the CUDA and host caching allocators and
    :mod:`sparda.cache.pinned`'s pool, so the next point sees the free host memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pinned.POOL.release()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def sync(device: torch.device) -> None:
    """Wait for the device (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def is_oom(exc: BaseException) -> bool:
    """True for allocation failures: CUDA OOM, MemoryError, SpardaError about memory."""
    if isinstance(exc, (OutOfMemory, MemoryError)) or type(exc).__name__ == "OutOfMemoryError":
        return True
    msg = str(exc).lower()
    return isinstance(exc, (SpardaError, RuntimeError)) and ("fit" in msg or "out of memory" in msg
                                                             or "memory" in msg and "host" in msg)


def kv_need_bytes(method: str, shape, selection, kv_dtype: str, dtype: torch.dtype, batch: int,
                  capacity: int, slot_factor: float = DEFAULT_SLOT_FACTOR,
                  hot_blocks: int | None = None) -> tuple[int, int]:
    """``(device_bytes, host_bytes)`` of a point's KV cache, ``capacity`` tokens per row
    (:func:`sparda.engine.memory.kv_need_bytes`; offloaded methods, :data:`HOST_KV`, keep
    layer 0 resident). Raises SpardaError for ``mixed`` on a method that keeps its cache on the device."""
    if kv_dtype == "mixed" and method not in HOST_KV:
        raise SpardaError(f"kv_dtype mixed needs an offloaded cache; method {method} keeps it on the device")
    return memory.kv_need_bytes(shape, selection, kv_dtype, dtype, batch, capacity, offload=method in HOST_KV,
                                resident_layers=(0,), slot_factor=slot_factor, hot_blocks=hot_blocks)


def cache_need_bytes(llm: LLM, batch: int, capacity: int) -> tuple[int, int]:
    """``(device_bytes, host_bytes)`` of a point's KV cache (:meth:`ModelRunner.kv_bytes`)."""
    return llm.model_runner.kv_bytes(batch, capacity)


def largest_batch(method: str, shape, selection, kv_dtype: str, dtype: torch.dtype, capacity: int,
                  host_limit_bytes: float | None = None, device_limit_bytes: float | None = None) -> int:
    """Largest batch whose KV cache fits ``host_limit_bytes`` and ``device_limit_bytes`` (``None``:
    no limit on that side); 0 if one row does not fit.

    Raises:
        SpardaError: neither limit given, or no limit bounds this method's cache.
    """
    dev_row, host_row = kv_need_bytes(method, shape, selection, kv_dtype, dtype, 1, capacity)
    bounds = [int(limit // row) for limit, row in ((host_limit_bytes, host_row), (device_limit_bytes, dev_row))
              if limit is not None and row > 0]
    if not bounds:
        raise SpardaError(f"largest_batch: no memory limit bounds the KV cache of {method} "
                          "(give host_limit_bytes for offloaded methods, device_limit_bytes otherwise)")
    return max(0, min(bounds))


def run_steps(opts, name: str) -> int:
    """Steps of run ``name`` of ``opts``: 0 when absent, ``decode_steps * repeats`` when ``None``."""
    value = getattr(opts, name, 0)
    return opts.decode_steps * opts.repeats if value is None else int(value)


def point_capacity(context: int, opts) -> int:
    """Tokens per row of the cache :func:`decode_point` allocates: ``context`` plus every step it runs, plus one."""
    extra = (getattr(opts, "profile_steps", 0) + run_steps(opts, "timing_steps") + 2  # + timed warm-up/capture
             + getattr(opts, "parity_steps", 0) + run_steps(opts, "overlap_steps") + 3)
    total_steps = opts.warmup_steps + opts.decode_steps * opts.repeats + opts.breakdown_steps + extra
    return context + total_steps + 1


def check_memory(llm: LLM, batch: int, capacity: int, host_limit: float | None) -> None:
    """Raise :class:`OutOfMemory` before allocating a cache that cannot fit."""
    dev, host = cache_need_bytes(llm, batch, capacity)
    if llm.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(llm.device)
        if dev > free:
            raise OutOfMemory(f"KV cache needs {dev / 2**30:.1f} GiB on the GPU, {free / 2**30:.1f} GiB free")
    limit = host_limit if host_limit is not None else 0.9 * (available_host_bytes() or float("inf"))
    if host > limit:
        raise OutOfMemory(f"host KV needs {host / 2**30:.1f} GiB, limit {limit / 2**30:.1f} GiB")


def fill_cache(cache, shape, batch: int, context: int, device, dtype, seed: int = 0) -> None:
    """Write ``context`` seeded standard-normal post-RoPE K/V tokens (``dtype``) into every row of
    ``cache`` through its prefill path. Raises SpardaError past its capacity."""
    gen = torch.Generator(device=device).manual_seed(seed)
    q_pos = torch.arange(context, device=device).view(1, -1)
    for layer in range(shape.num_layers):
        k = torch.randn(1, shape.num_kv_heads, context, shape.head_dim, device=device, dtype=dtype, generator=gen)
        v = torch.randn(k.shape, device=device, dtype=dtype, generator=gen)
        for row in range(batch):
            step = StepInfo("prefill", torch.tensor([row], device=device), q_pos, q_pos[:, -1] + 1,
                            None, None, context, row=row)
            cache.append(layer, k, v, step)
        del k, v
    cache.lengths.fill_(context)
    cache.end_prefill()


def prime_method(method, cache, context: int) -> None:
    """Give a stateful selector its per-row state for a :func:`fill_cache` cache (``state_from_cache``)."""
    with torch.inference_mode():  # the state tensors are inference tensors
        method.state_from_cache(cache, context)


def host_rss_bytes() -> int:
    """Resident memory of this process (bytes; pinned host memory included once touched)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is optional
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, Linux KiB
    return psutil.Process().memory_info().rss


def measure_prefill(llm: LLM, tokens: int, seed: int = 0) -> dict:
    """``{"prefill_tokens", "ttft_ms", "prefill_tok_s"}`` of one random ``tokens``-token prompt
    (ms wall clock after a device sync; tokens/s)."""
    vocab = llm.model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    cfg = llm.config.selection
    warm = min(tokens, max(cfg.dense_len, cfg.budget_tokens) + 2 * cfg.block_size)
    for n in ((warm, tokens) if llm.device.type == "cuda" else (tokens,)):  # CUDA: compile first
        ids = torch.randint(0, vocab, (n,), generator=gen).tolist()
        llm.method.reset()
        cache = llm.new_cache(1, n + 1)
        sync(llm.device)
        start = time.perf_counter()
        logits = llm.prefill(cache, 0, ids)
        logits[-1].argmax()
        sync(llm.device)
        sec = time.perf_counter() - start
        del cache, logits
    return {"prefill_tokens": tokens, "ttft_ms": round(sec * 1e3, 3), "prefill_tok_s": round(tokens / sec, 1)}


def decode_point(llm: LLM, model_name: str, batch: int, context: int, opts, bandwidth: dict,
                 traces=None, deadline: float | None = None, hit_rate: float | None = None,
                 hit_rates=()) -> dict:
    """Measure one decode point; returns the record's measured fields (docs/bench.md).

    ``opts``: ``warmup_steps``, ``decode_steps``, ``repeats``, ``breakdown_steps``,
    ``host_limit_bytes``, optional ``profile_steps``, ``timing_steps``, ``parity_steps``,
    ``overlap_steps``, ``gpu_mem_gb``, ``lookahead_recall``. ``hit_rate``: replay
    :func:`~sparda.bench.traces.synthetic_masks` instead of ``traces``; ``hit_rates``: also each of
    these, as ``rec["hit_rate_points"]``. With ``lookahead=2`` and a replayed selection, the early
    copies replay the trace's recorded two-ahead predictions (a trace that has them, and
    ``lookahead_recall`` ``None``), else get :func:`~sparda.bench.traces.two_ahead_ids`
    predictions of it at ``lookahead_recall`` (default :data:`LOOKAHEAD2_RECALL`).
    ``deadline``: a ``time.perf_counter()`` value checked before every decode step.

    Raises:
        OutOfMemory: the cache does not fit. TimeBudgetExceeded: past ``deadline``.
    """
    dev, s, cfg = llm.device, llm.shape, llm.config.selection
    capacity = point_capacity(context, opts)
    total_steps = capacity - context - 1
    check_memory(llm, batch, capacity, opts.host_limit_bytes)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    llm.method.reset()
    cache = llm.new_cache(batch, capacity)
    fill_cache(cache, s, batch, context, dev, llm.dtype)
    prime_method(llm.method, cache, context)
    offloaded = cache.offload
    source = "native (random K/V)"
    replayer = None
    hit_rates = list(hit_rates) if offloaded else []
    if offloaded and hit_rate is None and hit_rates and not traces:
        hit_rate, hit_rates = hit_rates[0], hit_rates[1:]  # graphs must be captured with a replayer

    num_blocks = cache.num_blocks if offloaded else 0

    def synthetic(rate):
        return synthetic_masks(s.num_layers, s.num_kv_heads, cfg, [context] * batch, total_steps,
                               num_blocks, rate).to(dev)

    if offloaded and hit_rate is not None:  # synthetic selection with a chosen reuse
        replayer = Replayer(synthetic(hit_rate))
        replayer.install(cache)
        source = f"synthetic:hit_rate={hit_rate}"
    elif offloaded and traces:
        trace = trace_for(traces, llm.config.method)
        masks = replay_masks(trace, s.num_layers, s.num_kv_heads, cfg, [context] * batch, total_steps,
                             cache.num_blocks).to(dev)
        replayer = Replayer(masks)
        replayer.install(cache)
        source = f"trace:{trace.meta.get('method')}"
    two_ahead = replayer is not None and llm.config.lookahead == 2
    asked = getattr(opts, "lookahead_recall", None)
    recall = LOOKAHEAD2_RECALL if asked is None else asked  # of the modelled predictions
    recorded = two_ahead and source.startswith("trace:") and asked is None and trace.early is not None

    def predict(synthetic_point: bool = False) -> None:
        """The early copies' predictions of the replayed selection: the trace's recorded ones, or
        modelled (a synthetic selection has no recorded ones)."""
        if not two_ahead:
            return
        if recorded and not synthetic_point:
            replayer.replay_two_ahead(cache, replay_masks(trace, s.num_layers, s.num_kv_heads, cfg, [context] * batch,
                                                          total_steps, cache.num_blocks, early=True).to(dev))
        else:
            replayer.predict_two_ahead(cache, cfg, [context] * batch, recall)

    predict()
    host_peak = host_rss_bytes()
    tokens = torch.randint(0, llm.model.config.vocab_size, (batch,), device=dev)
    state = {"i": 0}

    runner = llm.runner(cache)

    def step(run=runner):
        check_deadline(deadline)
        i = state["i"]
        if replayer is not None:
            replayer.step = i
        run.positions.fill_(context + i)
        out = run.step(context + i + 1).argmax(-1)
        state["i"] = i + 1
        return out

    parity = None
    if getattr(opts, "parity_steps", 0) and runner.use_graphs:
        # eager reference from the filled state, then refill: the graph run starts from it too
        eager = DecodeRunner(llm.model_runner, cache, cuda_graphs=False)
        eager.load(tokens, torch.full((batch,), context, device=dev))
        reference = torch.stack([step(eager) for _ in range(opts.parity_steps)])
        state["i"] = 0
        llm.method.reset()
        cache.reset_counters()
        fill_cache(cache, s, batch, context, dev, llm.dtype)
        prime_method(llm.method, cache, context)
        if offloaded:
            for layer in cache.offloaded:
                cache.slot_map[layer].fill_(-1)
        del eager
        parity = reference
    runner.load(tokens, torch.full((batch,), context, device=dev))
    if parity is not None:
        replayed = torch.stack([step() for _ in range(opts.parity_steps)])
        parity = {"parity_steps": opts.parity_steps,
                  "graph_tokens_equal": bool(torch.equal(replayed, parity)),
                  "graph_token_mismatches": int((replayed != parity).sum().item())}
        # the TPOT times the same replayed steps with or without a parity check (past the
        # trace's end the replay runs it backwards, which churns more blocks)
        restart(state, cache)

    for _ in range(opts.warmup_steps):
        step()
    sync(dev)
    if offloaded:
        cache.prefetcher.reset()
    timed_from = state["i"]  # the replayed steps the TPOT covers (overlap_timing measures the same)
    tpots = _timed_repeats(step, opts, dev)
    timed_steps = opts.decode_steps * opts.repeats
    stats = cache.offload_stats(timed_steps * batch) if offloaded else {}
    profile = {"kernels_per_step": None, "gpu_kernel_ms": None, "kernel_top": None}
    if dev.type == "cuda" and getattr(opts, "profile_steps", 0):
        profile = profile_kernels(step, opts.profile_steps)
    timing = {}
    timing_steps = run_steps(opts, "timing_steps")
    if offloaded and timing_steps:
        timing = copy_timing(llm, cache, step, timing_steps, state, timed_from)
    breakdown = {}
    if opts.breakdown_steps:  # hooks run in eager steps only: a runner without graphs
        eager = DecodeRunner(llm.model_runner, cache, cuda_graphs=False)
        eager.load(tokens, runner.positions)
        timer = ComponentTimer(dev)
        timer.install(llm, cache)
        try:
            for _ in range(opts.breakdown_steps):
                timer.step(lambda: step(eager))
            breakdown = timer.summary()
        finally:
            timer.remove()
    tpot = statistics.median(tpots)
    overlap = {}
    steps_overlap = run_steps(opts, "overlap_steps")
    if offloaded and dev.type == "cuda" and steps_overlap and runner.use_graphs:
        overlap = overlap_timing(llm, cache, step, steps_overlap, tpot, state, timed_from)
    elem = torch.empty((), dtype=llm.dtype).element_size()
    w_bytes = weight_bytes(llm.model) + method_extra_bytes(llm)
    read_dtype = slot_dtype(llm.config.cache.kv_dtype) if offloaded else llm.config.cache.kv_dtype
    kv_parts = kv_read_breakdown(llm.config.method, s, cfg, batch, context, elem, token_bytes(s.head_dim, read_dtype, llm.dtype))
    kv_bytes = sum(kv_parts.values())

    def speed(tpot, stats, timing, overlap) -> dict:
        missed = stats.get("bytes_per_token", 0.0) * batch
        roof = roofline_ms(w_bytes, kv_bytes, missed, bandwidth["hbm_gbps"], bandwidth["pcie_gbps"])
        # an offloaded point without a copy timing has no measured wait (None), not a zero one
        untimed = None if offloaded else 0.0
        copy = timing.get("copy_ms", untimed)
        return {
            "decode_tok_s": round(batch / tpot * 1e3, 2), "tpot_ms": round(tpot, 4),
            "roofline_tpot_ms": round(roof, 4), "roofline_fraction": round(roof / tpot, 4),
            "roofline_bound": "pcie" if missed / bandwidth["pcie_gbps"] > (w_bytes + kv_bytes) / bandwidth["hbm_gbps"]
            else "hbm",
            "missed_bytes_per_step": round(missed, 1),
            "hit_rate": stats.get("hit_rate"), "pcie_bytes_per_token": stats.get("bytes_per_token", 0.0),
            "early_copies": stats.get("early_copies"),
            "exposed_wait_ms": timing.get("exposed_wait_ms", untimed),
            "exposed_transfer_ms": timing.get("exposed_transfer_ms", untimed), "copy_ms": copy,
            "lookahead_timeline_us": timing.get("timeline"), "timed_step_ms": timing.get("step_ms"),
            "hidden_fraction": timing.get("hidden_fraction"),
            # the copy timing run's own bytes over its own copy time (the TPOT's steps unless timing_steps is fewer)
            "timed_missed_bytes_per_step": timing.get("missed_bytes"),
            "pcie_gbps_overlapped": round(timing.get("missed_bytes", missed) / copy / 1e6, 2) if copy else None,
            **overlap}

    points = []
    for rate in hit_rates:  # the same cache and graphs, other replayed block ids
        check_deadline(deadline)
        replayer.ids.copy_(replay_ids(synthetic(rate), replayer.ids.shape[-1]))
        predict(synthetic_point=True)
        sub_tpots = timed_run(step, state, cache, opts, dev)
        sub_stats = cache.offload_stats(opts.decode_steps * opts.repeats * batch)
        sub_timing = copy_timing(llm, cache, step, timing_steps, state, opts.warmup_steps) if timing_steps else {}
        sub_tpot = statistics.median(sub_tpots)
        sub_overlap = overlap_timing(llm, cache, step, steps_overlap, sub_tpot, state,
                                     opts.warmup_steps) if overlap else {}
        points.append({**speed(sub_tpot, sub_stats, sub_timing, sub_overlap),
                       "tpot_ms_repeats": [round(t, 4) for t in sub_tpots], "target_hit_rate": rate,
                       "selection_source": f"synthetic:hit_rate={rate}",
                       **({"lookahead_recall": recall, "lookahead_predictions": "modelled"} if two_ahead else {})})
    host_peak = max(host_peak, host_rss_bytes())
    rec = {
        **speed(tpot, stats, timing, overlap),
        "tpot_ms_repeats": [round(t, 4) for t in tpots],
        "weight_bytes": w_bytes, "kv_read_bytes_per_step": kv_bytes, "kv_read_bytes_by_kind": kv_parts, "num_layers": s.num_layers,
        "gpu_mem_cap_gb": getattr(opts, "gpu_mem_gb", None),
        "date": __import__("datetime").datetime.now().isoformat(timespec="seconds"),
        "cuda_graph": runner.use_graphs and runner.replays > 0, **profile, **(parity or {}),
        "selection_ms": breakdown.get("selection"), "breakdown_ms": breakdown,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None,
        "peak_host_bytes": host_peak, "host_kv_bytes": cache.host.nbytes if offloaded else 0,
        "kv": "host" if offloaded else "device", "kv_dtype": llm.config.cache.kv_dtype,
        "selection_source": source if offloaded else "native",
        "target_hit_rate": hit_rate if offloaded else None,
        "read_fraction": round(cache.read_fraction(), 4),
        "lookahead": llm.config.lookahead if llm.config.method == "sparda" else None,
        "lookahead_recall": recall if two_ahead and not recorded else None,
        "lookahead_predictions": ("recorded" if recorded else "modelled") if two_ahead else None,
    }
    if points:
        rec["hit_rate_points"] = points
    del cache, replayer, runner
    release_memory(dev)
    if dev.type == "cuda":
        rec["host_free_bytes_after"] = available_host_bytes()
    return rec


def profile_kernels(step, steps: int) -> dict:
    """:func:`sparda.bench.gpu_profile.kernel_summary` of ``steps`` calls of ``step()``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_summary(prof.events(), steps)


def restart(state: dict, cache, index: int = 0) -> None:
    """Start the replayed steps over at step ``index`` from the filled context (offloaded: empty slots)."""
    state["i"] = index
    for slot_map in cache.slot_map.values():
        slot_map.fill_(-1)


def replay_to(step, state: dict, cache, start: int, minimum: int = 0) -> None:
    """:func:`restart`, then run the steps before ``start`` (at least ``minimum``) untimed."""
    pre = max(minimum, start)
    restart(state, cache, max(0, start - pre))
    for _ in range(pre):
        step()


def timed_run(step, state: dict, cache, opts, dev) -> list[float]:
    """Restart, ``warmup_steps`` untimed, counters zeroed, ``repeats`` x ``decode_steps`` timed:
    per-repeat TPOTs (ms)."""
    restart(state, cache)
    for _ in range(opts.warmup_steps):
        step()
    sync(dev)
    if cache.prefetcher is not None:
        cache.prefetcher.reset()
    return _timed_repeats(step, opts, dev)


def _timed_repeats(step, opts, dev) -> list[float]:
    """Per-repeat TPOTs (ms) of ``repeats`` x ``decode_steps`` steps, timed between device syncs."""
    tpots = []
    for _ in range(opts.repeats):
        sync(dev)
        start = time.perf_counter()
        for _ in range(opts.decode_steps):
            step()
        sync(dev)
        tpots.append((time.perf_counter() - start) / opts.decode_steps * 1e3)
    return tpots


class _NoGather:
    """A transfer engine that stores tokens like ``engine`` but copies no block."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.name = engine.name
        self.syncs_host = engine.syncs_host

    def gather(self, chunk, dst_k, dst_v, load) -> None:
        return None

    def gather_planes(self, chunk, planes, load) -> None:
        return None

    def store_tokens(self, chunk, k_tok, v_tok, pos) -> None:
        self.engine.store_tokens(chunk, k_tok, v_tok, pos)


def overlap_timing(llm: LLM, cache, step, steps: int, tpot_ms: float, state: dict | None = None,
                   start: int = 3) -> dict:
    """Compute and transfer of an offloaded decode step, each alone (CUDA graphs), over replayed
    steps ``start .. start + steps - 1`` from empty slots: ``compute_alone_ms`` (no gathers),
    ``transfer_alone_ms`` (the steps' gathers alone) and ``overlap_efficiency`` = (compute +
    transfer - ``tpot_ms``) / min(compute, transfer) (``None`` when nothing is copied).
    """
    state = state if state is not None else {}
    dev = llm.device
    real = cache.engine
    cache.engine = _NoGather(real)
    try:
        alone = DecodeRunner(llm.model_runner, cache, cuda_graphs=True)
        alone.load(llm.runner(cache).tokens, llm.runner(cache).positions)
        replay_to(lambda: step(alone), state, cache, start, minimum=3)  # warm-up, capture, one replay at least
        sync(dev)
        began = time.perf_counter()
        for _ in range(steps):
            step(alone)
        sync(dev)
        compute = (time.perf_counter() - began) / steps * 1e3
        del alone
    finally:
        cache.engine = real

    early = llm.config.lookahead == 2  # the early copies too (design §6.2)

    def gathers() -> None:
        for layer in cache.offloaded:
            planes = cache._slot_planes(layer)
            for chunk in cache.host.chunks[layer]:
                if early:
                    real.gather_planes(chunk, planes, cache.early_load[layer])
                real.gather_planes(chunk, planes, cache.load[layer])

    replay_to(step, state, cache, start, minimum=3)  # past the first steps after empty slots (all misses)
    sync(dev)
    side = torch.cuda.Stream(device=dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        gathers()  # compiled already; once eagerly before capture
        side.synchronize()
        with torch.cuda.graph(graph, stream=side):
            gathers()
    total = 0.0
    for _ in range(steps):
        step()
        sync(dev)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        total += begin.elapsed_time(end)
    transfer = total / steps
    del graph
    shorter = min(compute, transfer)
    eff = (compute + transfer - tpot_ms) / shorter if shorter > 1e-3 else None
    return {"compute_alone_ms": round(compute, 4), "transfer_alone_ms": round(transfer, 4),
            "overlap_efficiency": None if eff is None else round(eff, 4)}


def copy_timing(llm: LLM, cache, step, steps: int, state: dict | None = None, start: int = 0) -> dict:
    """Copy timing of an offloaded cache over replayed steps ``start .. start + steps - 1`` with
    device timestamps (:mod:`sparda.cache.timestamps`, docs/bench.md), in a runner of its own;
    ``state``: restart from empty slots and replay the earlier steps untimed.

    Returns per step ``copy_ms``, ``exposed_wait_ms``, ``exposed_transfer_ms``,
    ``hidden_fraction``, ``missed_bytes`` (K+V, all rows), ``step_ms``, and the last step's
    ``timeline`` (``[]`` off CUDA).
    """
    pref = cache.prefetcher
    pref.set_timing(True)
    timed = DecodeRunner(llm.model_runner, cache, cuda_graphs=llm.config.runtime.cuda_graphs)
    timed.load(llm.runner(cache).tokens, llm.runner(cache).positions)
    pre = 2 if timed.use_graphs else 0  # warm-up + capture of the timed graph
    try:
        if state is not None:
            replay_to(lambda: step(timed), state, cache, start, minimum=pre)
        else:
            for _ in range(pre):
                step(timed)
        sync(llm.device)
        pref.reset()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(timed)
        sync(llm.device)
        step_ms = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
        pref.resolve()
        copy, exposed = pref.copy_ms / steps, pref.exposed_ms / steps
        transfer, timeline = pref.exposed_transfer_ms / steps, pref.timeline()
        missed = pref.stats(tokens=steps)["bytes_per_token"]  # per step: every row's copy
    finally:
        pref.set_timing(False)  # the timed graph goes with its runner
    return {"copy_ms": round(copy, 4), "exposed_wait_ms": round(exposed, 4),
            "exposed_transfer_ms": round(transfer, 4), "timeline": timeline, "step_ms": round(step_ms, 4),
            "missed_bytes": missed, "hidden_fraction": round(1 - exposed / copy, 4) if copy > 0 else None}
