"""Decode's fused elementwise work in Triton: residual add + RMSNorm, SiLU * mul.

Twins: :func:`sparda.kernels.twins.add_rmsnorm_reference`, ``silu_mul_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.kernels._common import next_pow2


@triton.jit
def _add_rmsnorm_kernel(X, DELTA, W, Y, N, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    DT = X.dtype.element_ty
    x = tl.load(X + row * N + offs, mask=ok, other=0.0)
    if HAS_DELTA:
        x = (x.to(tl.float32) + tl.load(DELTA + row * N + offs, mask=ok, other=0.0).to(tl.float32)).to(DT)
        tl.store(X + row * N + offs, x, mask=ok)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    y = (w * (xf * r).to(DT).to(tl.float32)).to(Y.dtype.element_ty)
    tl.store(Y + row * N + offs, y, mask=ok)


@triton.jit
def _silu_mul_kernel(GU, OUT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    DT = OUT.dtype.element_ty
    g = tl.load(GU + row * 2 * N + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * 2 * N + N + offs, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)
    tl.store(OUT + row * N + offs, (act * u).to(DT), mask=ok)


def add_rmsnorm_triton(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                       out: torch.Tensor) -> torch.Tensor:
    """Launch the add + RMSNorm kernel on contiguous ``x [R, N]`` (see :func:`sparda.kernels.add_rmsnorm`)."""
    rows, n = x.shape
    _add_rmsnorm_kernel[(rows,)](x, delta if delta is not None else x, weight, out, n, float(eps),
                                 HAS_DELTA=delta is not None, BLOCK=next_pow2(n),
                                 num_warps=4 if n <= 2048 else 8)
    return out


def silu_mul_triton(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch the SiLU * mul kernel on contiguous ``gate_up [R, 2N]`` (see :func:`sparda.kernels.silu_mul`)."""
    rows, n = out.shape
    block = min(2048, next_pow2(n))
    _silu_mul_kernel[(rows, -(-n // block))](gate_up, out, n, BLOCK=block, num_warps=4)
    return out
