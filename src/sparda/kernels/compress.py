"""Compressed keys of a prefilled chunk in Triton (design §3.1); twin
:func:`sparda.kernels.reference.compress_keys`. Decode's update is in :mod:`~sparda.kernels.rope_append`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels import reference
from sparda.kernels._common import check_head_dim, tl_float_dtype_ok

_CK_TILE = 32


@triton.jit
def _compress_kernel(
    K, CK, H, C,
    stride_kb, stride_kh, stride_kt, stride_cb, stride_ch, stride_cc,
    D: tl.constexpr, KER: tl.constexpr, STR: tl.constexpr, CK_T: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_j = tl.program_id(1) * CK_T + tl.arange(0, CK_T)
    offs_d = tl.arange(0, D)
    ok = offs_j < C
    ptrs = K + b * stride_kb + h * stride_kh + (offs_j[:, None] * STR).to(tl.int64) * stride_kt + offs_d[None, :]
    acc = tl.zeros([CK_T, D], tl.float32)
    for r in range(KER):
        acc += tl.load(ptrs + r * stride_kt, mask=ok[:, None], other=0.0).to(tl.float32)
    out = acc / KER
    tl.store(CK + b * stride_cb + h * stride_ch + offs_j[:, None].to(tl.int64) * stride_cc + offs_d[None, :],
             out.to(CK.dtype.element_ty), mask=ok[:, None])


def _check_k(k: torch.Tensor) -> None:
    tl_float_dtype_ok(k, "k")
    if k.dim() != 4:
        raise SpardaError(f"k must be [B, H, T, d], got {tuple(k.shape)}")
    check_head_dim(k.shape[-1])


def compress_keys_triton(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Triton ``reference.compress_keys``: ``k [B, H, T, d]`` fp16/bf16/fp32 -> ``[B, H, C, d]``
    in ``k``'s dtype (design §3.1).

    Raises:
        SpardaError: ``k`` not 4-D, a bad dtype, or a head dim not a power of two >= 16.
    """
    _check_k(k)
    bsz, heads, num_tokens, d = k.shape
    num_ck = reference.num_compressed(num_tokens, kernel, stride)
    ck = torch.empty(bsz, heads, num_ck, d, device=k.device, dtype=k.dtype)
    if num_ck == 0:
        return ck
    if k.stride(-1) != 1:
        k = k.contiguous()
    _compress_kernel[(bsz * heads, -(-num_ck // _CK_TILE))](
        k, ck, heads, num_ck, k.stride(0), k.stride(1), k.stride(2),
        ck.stride(0), ck.stride(1), ck.stride(2),
        D=d, KER=kernel, STR=stride, CK_T=_CK_TILE, num_warps=4)
    return ck
