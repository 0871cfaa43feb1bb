"""Triton block-sparse prefill attention against reference.block_sparse_attention."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import prefill_attention, reference  # noqa: E402
from sparda.kernels.prefill_attention import prefill_attention_triton, tile_block_lists  # noqa: E402


def _inputs(groups, dtype=torch.float32, d=32, num_keys=150, num_q=45, block_size=16, seed=0):
    """Random inputs; ``seed`` offsets the test's recorded seed (tests/conftest.py), so each
    call site draws its own inputs and a failure replays with SPARDA_TEST_SEED."""
    bsz, heads = 2, 2
    gen = torch.Generator().manual_seed(torch.initial_seed() + seed)
    q = torch.randn(bsz, heads, groups, num_q, d, generator=gen).to(dtype)
    k = torch.randn(bsz, heads, num_keys, d, generator=gen).to(dtype)
    v = torch.randn(bsz, heads, num_keys, d, generator=gen).to(dtype)
    # sequence 0: the last num_q tokens of a full cache; sequence 1: a chunk ending at 97
    kv_len = torch.tensor([num_keys, 97])
    q_pos = torch.stack([torch.arange(num_keys - num_q, num_keys), torch.arange(97 - num_q, 97)])
    num_blocks = -(-num_keys // block_size)
    mask = torch.rand(bsz, heads, num_q, num_blocks, generator=gen) < 0.35
    return q, k, v, mask, q_pos, kv_len


def _brute_attention(q, k, v, mask, q_pos, kv_len, block_size):
    """float64 loops: softmax over keys ``i <= q_pos``, ``i < kv_len`` in selected blocks; 0 if none."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    b, h, g, tq, d = q.shape
    for bb in range(b):
        for hh in range(h):
            for t in range(tq):
                keys = [i for i in range(k.shape[2]) if i <= q_pos[bb, t] and i < kv_len[bb]
                        and (mask is None or mask[bb, hh, t, i // block_size])]
                if not keys:
                    continue
                kk, vv = k[bb, hh, keys].double(), v[bb, hh, keys].double()
                for gg in range(g):
                    p = torch.softmax(kk @ q[bb, hh, gg, t].double() / d ** 0.5, 0)
                    out[bb, hh, gg, t] = p @ vv
    return out


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_sparse_prefill_matches_reference(groups, rel_err):
    q, k, v, mask, q_pos, kv_len = _inputs(groups, seed=groups)
    ref = reference.block_sparse_attention(q, k, v, mask, q_pos, kv_len, 16)
    out = prefill_attention_triton(q, k, v, mask, q_pos, kv_len, 16, block_m=16)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("groups,block_m", [(16, 16), (16, 64), (5, 32), (32, 16)])
def test_packed_heads_match_brute_force(groups, block_m, rel_err):
    """Rows pack tokens x all G heads of a KV head (G = 16: one token per 16-row tile; G = 5:
    padding heads; G = 32 > block_m: one token per program) -- against float64 loops."""
    q, k, v, mask, q_pos, kv_len = _inputs(groups, d=16, num_keys=70, num_q=13, seed=20 + groups + block_m)
    want = _brute_attention(q, k, v, mask, q_pos, kv_len, 16)
    out = prefill_attention_triton(q, k, v, mask, q_pos, kv_len, 16, block_m=block_m)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("tokens_per_tile", [1, 3, 8])
def test_tile_block_lists_are_the_ascending_union(tokens_per_tile):
    """Each tile lists, ascending, exactly the blocks some of its tokens selected and can reach."""
    _, _, _, mask, q_pos, kv_len = _inputs(1, seed=40 + tokens_per_tile)
    ids, counts = tile_block_lists(mask, q_pos, kv_len, 2, 150, 16, tokens_per_tile)
    num_q, num_blocks = q_pos.shape[1], mask.shape[-1]
    num_m = -(-num_q // tokens_per_tile)
    for b in range(2):
        for h in range(2):
            for m in range(num_m):
                toks = range(m * tokens_per_tile, min(num_q, (m + 1) * tokens_per_tile))
                last = max(int(q_pos[b, t]) for t in toks)
                want = [j for j in range(num_blocks) if any(mask[b, h, t, j] for t in toks)
                        and j * 16 <= last and j * 16 < int(kv_len[b])]
                row = (b * 2 + h) * num_m + m
                assert int(counts[row]) == len(want)
                assert ids[row, :len(want)].tolist() == want


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


def test_cpu_dispatch_and_errors(rel_err):
    q, k, v, mask, q_pos, kv_len = _inputs(2, num_keys=40, num_q=8, seed=2)
    mask[0, 0, 3] = False  # a query that sees no key gets 0
    for m in (mask, None):
        want = _brute_attention(q, k, v, m, q_pos, kv_len, 16)
        got = prefill_attention(q, k, v, m, q_pos, kv_len, 16)  # CPU tensors: the PyTorch path
        assert got.dtype == q.dtype and rel_err(got, want) < 1e-5
    assert (got[0, 0, :, 3] != 0).all() and (prefill_attention(q, k, v, mask, q_pos, kv_len, 16)[0, 0, :, 3] == 0).all()
    with pytest.raises(SpardaError):
        prefill_attention_triton(q, k, v, mask.float(), q_pos, kv_len, 16)
    with pytest.raises(SpardaError):
        prefill_attention_triton(q[:, :, 0], k, v, mask, q_pos, kv_len, 16)
