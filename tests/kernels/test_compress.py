"""Triton compressed-key construction and incremental update against the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.kernels import compress_keys, reference, twins, update_compressed_keys  # noqa: E402
from sparda.kernels.compress import compress_keys_triton, update_compressed_keys_triton  # noqa: E402


@pytest.mark.parametrize("num_tokens,kernel,stride", [(203, 32, 16), (77, 8, 4), (31, 32, 16), (32, 32, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compress_matches_reference(num_tokens, kernel, stride, dtype):
    k = torch.randn(2, 3, num_tokens, 32).to(dtype)
    out = compress_keys_triton(k, kernel, stride)
    ref = reference.compress_keys(k, kernel, stride)
    assert out.shape == ref.shape and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    cpu = compress_keys(k, kernel, stride)  # CPU dispatch, against a float64 loop over windows
    k64 = k.double()
    windows = []
    j = 0
    while j * stride + kernel <= num_tokens:
        windows.append(sum(k64[:, :, i] for i in range(j * stride, j * stride + kernel)) / kernel)
        j += 1
    want = torch.stack(windows, 2) if windows else k64.new_zeros(2, 3, 0, 32)
    assert cpu.shape == want.shape and cpu.dtype == dtype
    torch.testing.assert_close(cpu.double(), want.to(dtype).double(), rtol=tol, atol=tol)


def test_incremental_update_tracks_full_compression():
    """Decode appends one token per step to a ragged batch; after every step the buffer's
    first C entries equal compressing the whole prefix."""
    kernel, stride, total = 8, 4, 60
    k = torch.randn(3, 2, total, 16)
    start = torch.tensor([5, 17, 30])
    ck = torch.randn(3, 2, 12, 16)  # junk, capacity 12 (< windows of 60 tokens: must not overflow)
    ck_twin = ck.clone()
    for b in range(3):
        n = reference.num_compressed(int(start[b]), kernel, stride)
        ck[b, :, :n] = ck_twin[b, :, :n] = reference.compress_keys(k[b, :, :int(start[b])], kernel, stride)
    for step in range(1, 26):
        kv_len = start + step
        update_compressed_keys_triton(k, ck, kv_len, kernel, stride)
        twins.update_compressed_keys_reference(k, ck_twin, kv_len, kernel, stride)
        torch.testing.assert_close(ck, ck_twin, rtol=1e-6, atol=1e-6)
        for b in range(3):
            n = min(reference.num_compressed(int(kv_len[b]), kernel, stride), 12)
            full = reference.compress_keys(k[b, :, :int(kv_len[b])], kernel, stride)[:, :n]
            torch.testing.assert_close(ck[b, :, :n], full, rtol=1e-6, atol=1e-6)
    update_compressed_keys(k, ck_twin, start + 26, kernel, stride)  # CPU dispatch runs the twin
    update_compressed_keys_triton(k, ck, start + 26, kernel, stride)
    torch.testing.assert_close(ck, ck_twin, rtol=1e-6, atol=1e-6)
