"""What a ``torch.profiler`` trace says about a GPU run: kernel time (:func:`kernel_summary`)
and GPU idle time with the blocking runtime calls behind it (:func:`gap_summary`).
"""

from __future__ import annotations

import time

import torch

#: CUDA runtime calls that block the host until the device (or a stream / event) is done
SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")
#: runtime calls that allocate or free memory (pinned host allocations are slow)
ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost", "cudaHostRegister",
               "cudaHostUnregister")


def busy_us(intervals) -> float:
    """Length of the union of ``[start, end)`` intervals (µs here), in any order."""
    total, end = 0.0, None
    for lo, hi in sorted((float(a), float(b)) for a, b in intervals if b > a):
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total


def _is_kernel(ev) -> bool:
    return ev.device_type == torch.autograd.DeviceType.CUDA and not ev.name.startswith(("Memcpy", "Memset",
                                                                                          "cudaMem"))


def kernel_summary(events, steps: int = 1, top: int = 12) -> dict:
    """``kernels_per_step``, ``gpu_kernel_ms`` (ms per step, every stream) and ``kernel_top`` of
    profiler ``events`` over ``steps`` steps; memcpy/memset excluded, graph kernels one by one."""
    kernels, total_us, by_name = 0, 0.0, {}
    for ev in events:
        if not _is_kernel(ev):
            continue
        kernels += 1
        us = ev.time_range.elapsed_us()
        total_us += us
        calls, name_us = by_name.get(ev.name[:80], (0, 0.0))
        by_name[ev.name[:80]] = (calls + 1, name_us + us)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_step": round(kernels / steps, 1), "gpu_kernel_ms": round(total_us / steps / 1e3, 4),
            "kernel_top": [{"name": n, "per_step": round(c / steps, 1), "ms": round(u / steps / 1e3, 4)}
                           for n, (c, u) in ranked]}


def gap_summary(events, wall_ms: float) -> dict:
    """``gpu_busy_ms`` (union of kernel and memcpy intervals), ``gpu_idle_ms = wall_ms -
    gpu_busy_ms`` (>= 0) and ``runtime_calls`` (count, host ms of :data:`SYNC_CALLS` /
    :data:`ALLOC_CALLS`); ``wall_ms`` the profiled call's host time."""
    device = [(ev.time_range.start, ev.time_range.end) for ev in events
              if ev.device_type == torch.autograd.DeviceType.CUDA]
    busy = busy_us(device) / 1e3
    calls: dict[str, list] = {}
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if name.startswith(SYNC_CALLS + ALLOC_CALLS):
            count, ms = calls.get(name, (0, 0.0))
            calls[name] = (count + 1, ms + ev.time_range.elapsed_us() / 1e3)
    return {"wall_ms": round(wall_ms, 3), "gpu_busy_ms": round(busy, 3),
            "gpu_idle_ms": round(max(0.0, wall_ms - busy), 3),
            "runtime_calls": {n: {"count": c, "host_ms": round(ms, 3)} for n, (c, ms) in sorted(calls.items())}}


def profile_call(fn, *, cuda: bool | None = None) -> dict:
    """``fn()`` once under ``torch.profiler`` (CUDA activity when ``cuda``), synchronised inside:
    :func:`kernel_summary` merged with :func:`gap_summary`."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available() if cuda is None else cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    events = prof.events()
    return {**kernel_summary(events), **gap_summary(events, wall_ms)}
