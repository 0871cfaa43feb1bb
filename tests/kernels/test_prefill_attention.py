"""Triton block-sparse prefill attention against reference.block_sparse_attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import prefill_attention, reference  # noqa: E402
from sparda.kernels.prefill_attention import prefill_attention_triton  # noqa: E402


def _inputs(groups, dtype=torch.float32, d=32, num_keys=150, num_q=45, block_size=16, seed=0):
    bsz, heads = 2, 2
    q = torch.randn(bsz, heads, groups, num_q, d).to(dtype)
    k = torch.randn(bsz, heads, num_keys, d).to(dtype)
    v = torch.randn(bsz, heads, num_keys, d).to(dtype)
    # sequence 0: the last num_q tokens of a full cache; sequence 1: a chunk ending at 97
    kv_len = torch.tensor([num_keys, 97])
    q_pos = torch.stack([torch.arange(num_keys - num_q, num_keys), torch.arange(97 - num_q, 97)])
    num_blocks = -(-num_keys // block_size)
    mask = torch.rand(bsz, heads, num_q, num_blocks) < 0.35
    return q, k, v, mask, q_pos, kv_len


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_sparse_prefill_matches_reference(groups, rel_err):
    q, k, v, mask, q_pos, kv_len = _inputs(groups, seed=groups)
    ref = reference.block_sparse_attention(q, k, v, mask, q_pos, kv_len, 16)
    out = prefill_attention_triton(q, k, v, mask, q_pos, kv_len, 16, block_m=16)
    assert rel_err(out, ref) < 1e-5


def test_dense_prefill_and_default_tile(rel_err):
    q, k, v, _, q_pos, kv_len = _inputs(2, num_q=70, seed=5)
    ref = reference.block_sparse_attention(q, k, v, None, q_pos, kv_len, 16)
    assert rel_err(prefill_attention_triton(q, k, v, None, q_pos, kv_len, 16), ref) < 1e-5


def test_budget_larger_than_context_equals_dense(rel_err):
    """A mask selecting every block (and more columns than blocks) is dense causal attention."""
    q, k, v, _, q_pos, kv_len = _inputs(1, num_keys=70, num_q=33, block_size=24, seed=8)
    mask = torch.ones(2, 2, 33, 9, dtype=torch.bool)  # N = 9 > ceil(70 / 24)
    out = prefill_attention_triton(q, k, v, mask, q_pos, kv_len, 24, block_m=16)
    ref = reference.block_sparse_attention(q, k, v, None, q_pos, kv_len, 24)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, rel_err):
    q, k, v, mask, q_pos, kv_len = _inputs(2, dtype=dtype, d=64, seed=11)
    out = prefill_attention_triton(q, k, v, mask, q_pos, kv_len, 16, block_m=32)
    ref = reference.block_sparse_attention(q, k, v, mask, q_pos, kv_len, 16)
    assert out.dtype == dtype
    assert rel_err(out, ref.float()) < 1e-2


def test_cpu_dispatch_and_errors():
    q, k, v, mask, q_pos, kv_len = _inputs(1, num_keys=40, num_q=8, seed=2)
    assert torch.equal(prefill_attention(q, k, v, mask, q_pos, kv_len, 16),
                       reference.block_sparse_attention(q, k, v, mask, q_pos, kv_len, 16))
    with pytest.raises(SpardaError):
        prefill_attention_triton(q, k, v, mask.float(), q_pos, kv_len, 16)
    with pytest.raises(SpardaError):
        prefill_attention_triton(q[:, :, 0], k, v, mask, q_pos, kv_len, 16)
