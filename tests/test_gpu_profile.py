"""sparda.bench.gpu_profile: the union of kernel intervals against a brute force, the kernel and
gap summaries of a made-up trace, and a real CPU trace."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparda.bench.gpu_profile import busy_us, gap_summary, kernel_summary, profile_call

CUDA, CPU = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU


def _event(name, device, start, end):
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=device, time_range=span)


def test_busy_time_is_the_union_of_intervals(fresh_seed):
    g = np.random.default_rng(fresh_seed)
    for _ in range(50):
        n = int(g.integers(0, 12))
        starts = g.integers(0, 200, n)
        ends = starts + g.integers(0, 40, n)  # zero-length ones too
        covered = np.zeros(260, dtype=bool)  # integer grid: a unit [t, t+1) is busy if any interval holds it
        for a, b in zip(starts, ends):
            covered[a:b] = True
        order = g.permutation(n)
        assert busy_us(zip(starts[order], ends[order])) == covered.sum()


def test_summaries_of_a_made_up_trace():
    events = [_event("gemm", CUDA, 0, 10), _event("gemm", CUDA, 5, 20),      # two streams overlap: busy 0-20
              _event("Memcpy HtoD", CUDA, 30, 40),                          # a copy: busy, not a kernel
              _event("topk", CUDA, 50, 53),
              _event("cudaStreamSynchronize", CPU, 20, 30), _event("cudaStreamSynchronize", CPU, 41, 49),
              _event("cudaHostAlloc", CPU, 60, 100), _event("cudaLaunchKernel", CPU, 0, 1),
              _event("aten::mm", CPU, 0, 2)]
    k = kernel_summary(events, steps=1)
    assert k["kernels_per_step"] == 3 and k["gpu_kernel_ms"] == pytest.approx(0.028)
    assert [(t["name"], t["per_step"], t["ms"]) for t in k["kernel_top"]] == [("gemm", 2, 0.025), ("topk", 1, 0.003)]
    g = gap_summary(events, wall_ms=0.1)
    assert g["gpu_busy_ms"] == pytest.approx(0.033) and g["gpu_idle_ms"] == pytest.approx(0.067)
    assert g["runtime_calls"] == {"cudaHostAlloc": {"count": 1, "host_ms": 0.04},
                                  "cudaStreamSynchronize": {"count": 2, "host_ms": 0.018}}
    assert gap_summary(events, wall_ms=0.01)["gpu_idle_ms"] == 0.0  # clamped


def test_profile_call_on_the_cpu():
    a = torch.randn(64, 64)
    out = profile_call(lambda: [a @ a for _ in range(3)], cuda=False)
    assert out["kernels_per_step"] == 0 and out["gpu_busy_ms"] == 0.0
    assert out["wall_ms"] > 0 and out["gpu_idle_ms"] == out["wall_ms"] and out["runtime_calls"] == {}
