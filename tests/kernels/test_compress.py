"""Triton compressed-key construction against a float64 loop over windows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda import kernels  # noqa: E402
from sparda.kernels import reference  # noqa: E402
from sparda.kernels.compress import compress_keys_triton  # noqa: E402


def _windows64(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """``[..., T, d]`` -> ``[..., C, d]`` float64: the mean of each complete window, a loop."""
    k64 = k.double()
    windows = []
    j = 0
    while j * stride + kernel <= k.shape[-2]:
        windows.append(sum(k64[..., i, :] for i in range(j * stride, j * stride + kernel)) / kernel)
        j += 1
    return torch.stack(windows, -2) if windows else k64.new_zeros(*k.shape[:-2], 0, k.shape[-1])


@pytest.mark.parametrize("num_tokens,kernel,stride", [(203, 32, 16), (77, 8, 4), (31, 32, 16), (32, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_matches_float64_windows(num_tokens, kernel, stride, dtype):
    k = torch.randn(2, 3, num_tokens, 32).to(dtype)
    want = _windows64(k, kernel, stride)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for out in (compress_keys_triton(k, kernel, stride), kernels.compress_keys(k, kernel, stride)):  # kernel, CPU dispatch
        assert out.shape == want.shape and out.dtype == dtype
        torch.testing.assert_close(out.double(), want.to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("start,end", [(0, 90), (37, 90), (39, 40), (40, 41), (0, 5)])
def test_completed_compressed_keys_of_a_cache_slice(start, end):
    """The caches' prefill call: the windows that tokens ``start .. end-1`` complete, read
    from a strided ``[H, capacity, d]`` cache row (the kernel on the slice, as on CUDA, and
    the CPU dispatch) equal the float64 windows of the whole prefix from ``j0`` on."""
    kernel, stride = 8, 4
    row = torch.randn(3, 128, 16)  # [H, capacity, d]
    j0, got = kernels.completed_compressed_keys(row, start, end, kernel, stride)
    assert j0 == reference.num_compressed(start, kernel, stride)
    want = _windows64(row[:, :end], kernel, stride)[:, j0:]
    assert got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    sliced = row[None, :, j0 * stride:end]  # what the CUDA dispatch hands the kernel
    torch.testing.assert_close(compress_keys_triton(sliced, kernel, stride)[0].double(), want, rtol=1e-6, atol=1e-6)
