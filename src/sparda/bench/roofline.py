"""Roofline of a decode step (docs/bench.md): ``max((weight_bytes + kv_bytes) / HBM,
missed_bytes / PCIe)`` with bandwidths measured in the same run.
"""

from __future__ import annotations

import time

import torch

from sparda.errors import SpardaError


def roofline_ms(weight_bytes: float, kv_bytes: float, missed_bytes: float,
                hbm_gbps: float, pcie_gbps: float) -> float:
    """Lower bound of one decode step, ms: ``max((W + KV) / HBM, missed / PCIe)``; bytes per step,
    bandwidths GB/s. Raises SpardaError for a non-positive bandwidth or negative bytes."""
    if hbm_gbps <= 0 or pcie_gbps <= 0:
        raise SpardaError(f"bandwidths must be positive, got HBM {hbm_gbps} / PCIe {pcie_gbps} GB/s")
    if min(weight_bytes, kv_bytes, missed_bytes) < 0:
        raise SpardaError("byte counts must be >= 0")
    return max((weight_bytes + kv_bytes) / (hbm_gbps * 1e6), missed_bytes / (pcie_gbps * 1e6))


def kv_read_breakdown(method: str, shape, selection, batch: int, context: int, elem_bytes: int,
                      kv_token_bytes: int | None = None) -> dict[str, int]:
    """KV bytes one decode step reads from device memory, whole batch and all layers (design §3),
    by kind: ``kv`` (K and V as attention reads them), ``compressed_keys``.

    ``dense``: all keys and values; block-sparse: ``min(budget, blocks)`` blocks of K and V plus
    the compressed keys per layer and KV head. ``elem_bytes``: model-dtype element;
    ``kv_token_bytes``: one token of one head in K as attention reads it, codes and scales
    (default ``head_dim * elem_bytes``; an offloaded cache's GPU slots: ``mixed``'s are in
    the model dtype, its int4 codes only cross PCIe).
    """
    ck_token = shape.head_dim * elem_bytes
    kv_token = ck_token if kv_token_bytes is None else kv_token_bytes
    lh = batch * shape.num_layers * shape.num_kv_heads
    if method == "dense" or context < selection.dense_len:
        return {"kv": 2 * lh * context * kv_token, "compressed_keys": 0}
    blocks = -(-context // selection.block_size)
    read = min(selection.budget_blocks, blocks) * selection.block_size
    kern, stride = selection.kernel_size, selection.kernel_stride
    num_ck = max(0, (context - kern) // stride + 1)
    return {"kv": lh * 2 * read * kv_token, "compressed_keys": lh * num_ck * ck_token}


def kv_read_bytes(*args, **kwargs) -> int:
    """The sum of :func:`kv_read_breakdown` (same arguments)."""
    return sum(kv_read_breakdown(*args, **kwargs).values())


def _time(fn, device: torch.device, reps: int) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / reps


def measure_bandwidth(device: torch.device, nbytes: int | None = None) -> dict[str, float]:
    """``{"hbm_gbps", "pcie_gbps", "bandwidth_bytes"}``: ``2 * nbytes / t`` of a device copy and
    ``nbytes / t`` of a pinned host-to-device copy (CPU: memcpy), GB/s."""
    cuda = device.type == "cuda"
    nbytes = nbytes or ((2 << 30) if cuda else (64 << 20))
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    hbm = 2 * nbytes / _time(lambda: dst.copy_(src), device, 10 if cuda else 3) / 1e9
    del src, dst
    host_n = min(n, (1 << 30) // 2)
    host = torch.empty(host_n, dtype=torch.bfloat16, pin_memory=cuda)
    dst = torch.empty(host_n, dtype=torch.bfloat16, device=device)
    pcie = 2 * host_n / _time(lambda: dst.copy_(host, non_blocking=True), device, 10 if cuda else 3) / 1e9
    del host, dst
    if cuda:
        torch.cuda.empty_cache()
    return {"hbm_gbps": round(hbm, 1), "pcie_gbps": round(pcie, 1), "bandwidth_bytes": nbytes}
