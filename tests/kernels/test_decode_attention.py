"""Triton decode attention (dense cache and slot buffer) against the reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import decode_attention, decode_attention_slots, reference, twins  # noqa: E402
from sparda.kernels.decode_attention import (  # noqa: E402
    decode_attention_slots_triton, decode_attention_triton)


def _ref(q, k, v, ids, kv_len, block_size):
    """Straight from reference.block_sparse_attention (Tq = 1, q_pos = kv_len - 1)."""
    n = -(-k.shape[2] // block_size)
    mask = torch.zeros(*ids.shape[:2], n, dtype=torch.bool)
    for (b, h, w) in (ids >= 0).nonzero().tolist():
        mask[b, h, ids[b, h, w]] = True
    out = reference.block_sparse_attention(q.unsqueeze(3), k, v, mask.unsqueeze(2),
                                           (kv_len - 1).view(-1, 1), kv_len, block_size)
    return out.squeeze(3)


def _random_ids(mask_p: float, bsz: int, heads: int, num_blocks: int, width: int) -> torch.Tensor:
    """Random distinct block ids per row, shuffled, padded with -1 to ``width``."""
    ids = torch.full((bsz, heads, width), -1, dtype=torch.int64)
    for b in range(bsz):
        for h in range(heads):
            chosen = torch.nonzero(torch.rand(num_blocks) < mask_p).flatten()[:width]
            ids[b, h, :len(chosen)] = chosen[torch.randperm(len(chosen))]
    return ids


@pytest.mark.parametrize("groups", [1, 3, 4, 8, 16])
def test_decode_matches_reference_fp32(groups, rel_err):
    bsz, heads, d, block_size, num_keys = 3, 2, 32, 16, 203
    q = torch.randn(bsz, heads, groups, d)
    k, v = torch.randn(bsz, heads, num_keys, d), torch.randn(bsz, heads, num_keys, d)
    kv_len = torch.tensor([203, 37, 1])  # ragged, not block multiples, one single-key sequence
    ids = _random_ids(0.5, bsz, heads, 13, 9)
    ref = _ref(q, k, v, ids, kv_len, block_size)
    for splits in (1, 3):
        out = decode_attention_triton(q, k, v, ids.to(torch.int32), kv_len, block_size, num_splits=splits)
        assert rel_err(out, ref) < 1e-5, splits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_half_precision(dtype, rel_err):
    bsz, heads, groups, d, block_size, num_keys = 2, 2, 4, 64, 32, 150
    q = torch.randn(bsz, heads, groups, d).to(dtype)
    k = torch.randn(bsz, heads, num_keys, d).to(dtype)
    v = torch.randn(bsz, heads, num_keys, d).to(dtype)
    kv_len = torch.tensor([150, 71])
    ids = _random_ids(0.7, bsz, heads, 5, 5)
    out = decode_attention_triton(q, k, v, ids, kv_len, block_size, num_splits=2)
    assert out.dtype == dtype
    assert rel_err(out, _ref(q, k, v, ids, kv_len, block_size).float()) < 1e-2


def test_budget_larger_than_context_and_empty_rows(rel_err):
    """Every block selected plus -1 padding; a row with only padding returns zeros."""
    bsz, heads, groups, d, block_size, num_keys = 2, 2, 4, 16, 24, 70  # block 24: not a power of 2
    q = torch.randn(bsz, heads, groups, d)
    k, v = torch.randn(bsz, heads, num_keys, d), torch.randn(bsz, heads, num_keys, d)
    kv_len = torch.tensor([70, 25])
    ids = torch.full((bsz, heads, 10), -1)
    ids[:, :, :3] = torch.tensor([2, 0, 1])
    ids[1, 1] = -1
    out = decode_attention_triton(q, k, v, ids, kv_len, block_size, num_splits=4)
    ref = _ref(q, k, v, ids, kv_len, block_size)
    assert rel_err(out, ref) < 1e-5
    assert torch.equal(out[1, 1], torch.zeros_like(out[1, 1]))


@pytest.mark.parametrize("groups", [1, 4])
def test_slot_buffer_matches_dense_cache(groups, rel_err):
    """Blocks scattered into random slots give the same result as the dense cache."""
    bsz, heads, d, block_size, num_blocks, slots = 2, 2, 32, 16, 9, 6
    num_keys = num_blocks * block_size - 5
    q = torch.randn(bsz, heads, groups, d)
    k, v = torch.randn(bsz, heads, num_keys, d), torch.randn(bsz, heads, num_keys, d)
    kv_len = torch.tensor([num_keys, 50])
    ids = _random_ids(0.6, bsz, heads, num_blocks, slots)
    slot_ids = torch.stack([torch.randperm(slots) for _ in range(bsz * heads)]).view(bsz, heads, slots)
    kpad = torch.nn.functional.pad(k, (0, 0, 0, num_blocks * block_size - num_keys))
    vpad = torch.nn.functional.pad(v, (0, 0, 0, num_blocks * block_size - num_keys))
    k_slots = torch.randn(bsz, heads, slots, block_size, d)  # junk in unused slots
    v_slots = torch.randn(bsz, heads, slots, block_size, d)
    for b in range(bsz):
        for h in range(heads):
            for w in range(slots):
                if ids[b, h, w] >= 0:
                    blk = ids[b, h, w]
                    k_slots[b, h, slot_ids[b, h, w]] = kpad[b, h, blk * block_size:(blk + 1) * block_size]
                    v_slots[b, h, slot_ids[b, h, w]] = vpad[b, h, blk * block_size:(blk + 1) * block_size]
    ref = _ref(q, k, v, ids, kv_len, block_size)
    out = decode_attention_slots_triton(q, k_slots, v_slots, ids, slot_ids, kv_len, num_splits=2)
    assert rel_err(out, ref) < 1e-5
    twin = twins.slots_attention_reference(q, k_slots, v_slots, ids, slot_ids, kv_len)
    assert rel_err(twin, ref) < 1e-5
    assert rel_err(decode_attention_slots(q, k_slots, v_slots, ids, slot_ids, kv_len), ref) < 1e-5


def test_cpu_dispatch_uses_reference(rel_err):
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    ids, kv_len = torch.tensor([[[0, 2, -1], [1, -1, -1]]]), torch.tensor([40])
    assert rel_err(decode_attention(q, k, v, ids, kv_len, 16), _ref(q, k, v, ids, kv_len, 16)) < 1e-6


def test_bad_inputs_raise():
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 40, 16)
    ids, kv_len = torch.zeros(1, 2, 3, dtype=torch.int64), torch.tensor([40])
    with pytest.raises(SpardaError):
        decode_attention_triton(q, k, k, ids.float(), kv_len, 16)
    with pytest.raises(SpardaError):
        decode_attention_triton(torch.randn(1, 2, 3, 24), torch.randn(1, 2, 40, 24),
                                torch.randn(1, 2, 40, 24), ids, kv_len, 16)
    with pytest.raises(SpardaError):
        decode_attention_triton(q, k, k.half(), ids, kv_len, 16)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_compact_list_narrower_than_the_slot_buffer(kv_dtype, rel_err, fresh_seed):
    """The offloaded cache's attention input with spare slots (design §6): a compact list of
    ``C`` (block, slot) entries, ``-1`` padded, the partial slot ``S`` last, over a buffer of
    ``S + 1 > C`` slots whose unlisted slots hold junk; equals attention over the dense
    cache's selected blocks (kernel and CPU twin; fp32, or the dequantised slot values)."""
    from sparda.kernels import quant
    from sparda.kernels.decode_attention import decode_attention_slots_quantized_triton

    gen = torch.Generator().manual_seed(fresh_seed)
    bsz, heads, groups, d, block_size, slots, width, num_blocks = 2, 3, 4, 16, 8, 11, 4, 20
    k_slots = torch.randn(bsz, heads, slots + 1, block_size, d, generator=gen)
    v_slots = torch.randn(bsz, heads, slots + 1, block_size, d, generator=gen)
    if kv_dtype != "bf16":
        k_slots, v_slots = (quant.QuantizedKV.quantize(x, kv_dtype) for x in (k_slots, v_slots))
    k_vals, v_vals = (quant.as_float(x, torch.float32) for x in (k_slots, v_slots))
    kv_len = torch.tensor([num_blocks * block_size - 3, (num_blocks - 1) * block_size + 1])
    blocks = torch.full((bsz, heads, width + 1), -1, dtype=torch.int32)
    where = torch.zeros_like(blocks)
    k = torch.randn(bsz, heads, num_blocks * block_size, d, generator=gen)  # junk in unselected blocks
    v = torch.randn(k.shape, generator=gen)
    for b in range(bsz):
        cur = int(kv_len[b] - 1) // block_size
        for h in range(heads):
            n = int(torch.randint(0, width + 1, (1,), generator=gen))  # 0: only the partial block
            held = torch.randperm(slots, generator=gen)[:n].sort().values
            chosen = torch.randperm(cur, generator=gen)[:n]
            blocks[b, h, :n], where[b, h, :n] = chosen.int(), held.int()
            blocks[b, h, -1], where[b, h, -1] = cur, slots
            for blk, s in zip(chosen.tolist() + [cur], held.tolist() + [slots]):
                k[b, h, blk * block_size:(blk + 1) * block_size] = k_vals[b, h, s]
                v[b, h, blk * block_size:(blk + 1) * block_size] = v_vals[b, h, s]
    q = torch.randn(bsz, heads, groups, d, generator=gen)
    ref = _ref(q, k, v, blocks.long(), kv_len, block_size)
    fn = decode_attention_slots_triton if kv_dtype == "bf16" else decode_attention_slots_quantized_triton
    assert rel_err(fn(q, k_slots, v_slots, blocks, where, kv_len, num_splits=2), ref) < 1e-5, fresh_seed
    assert rel_err(decode_attention_slots(q, k_slots, v_slots, blocks, where, kv_len), ref) < 1e-5, fresh_seed
