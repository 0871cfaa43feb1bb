"""The overlapped slot attention (design §6): resident slots, then ``between()`` (the wait for
the copy), then the copied slots plus the combine -- against one float64 softmax over the
union, for plain and quantised slot buffers, on layouts the slot diff writes."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import decode_attention_slots, slot_diff  # noqa: E402
from sparda.kernels.decode_attention import (  # noqa: E402
    decode_attention_slots_quantized_triton, decode_attention_slots_triton)
from sparda.kernels.quant import QuantizedKV  # noqa: E402


def _float64_attention(q, k_slots, v_slots, attn_ids, kv_len):
    """Softmax over every token of every selected slot (``attn_ids [B, H, S + 1]``, slot ``s``
    = entry ``s``), keys ``< kv_len``; float64 loops over rows and heads."""
    bsz, heads, groups, d = q.shape
    block_size = k_slots.shape[3]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(bsz):
        for h in range(heads):
            keys, values = [], []
            for s, blk in enumerate(attn_ids[b, h].tolist()):
                for t in range(block_size):
                    if blk >= 0 and blk * block_size + t < kv_len[b]:
                        keys.append(k_slots[b, h, s, t].double())
                        values.append(v_slots[b, h, s, t].double())
            if keys:
                kk, vv = torch.stack(keys), torch.stack(values)
                p = torch.softmax(q[b, h].double() @ kk.T / math.sqrt(d), -1)
                out[b, h] = p @ vv
    return out


def _layout(bsz, heads, slots, block_size, num_blocks, steps, seed):
    """Slot diff outputs after ``steps`` random selections: ``attn_ids [B, H, S + 1]`` (int32) and
    ``load [B, H, S]`` of the last one, and the position of its token."""
    gen = torch.Generator().manual_seed(seed)
    slot_map = torch.full((bsz, heads, slots), -1, dtype=torch.long)
    load = torch.full_like(slot_map, -1)
    attn_ids = torch.full((bsz, heads, slots + 1), -1, dtype=torch.int32)
    pos = torch.full((bsz,), num_blocks * block_size - 3, dtype=torch.long)
    cur = int(pos[0]) // block_size
    for _ in range(steps):
        ids = torch.full((bsz, heads, slots), -1, dtype=torch.long)
        for b in range(bsz):
            for h in range(heads):
                chosen = torch.randperm(cur, generator=gen)[:slots - 1].sort().values
                ids[b, h, :len(chosen)] = chosen
                ids[b, h, len(chosen)] = cur
        slot_diff(ids, slot_map, pos, block_size, num_blocks, load, attn_ids)
    return attn_ids, load, pos


@pytest.mark.parametrize("groups,d,slots", [(1, 16, 6), (3, 32, 6), (4, 16, 6), (16, 16, 6), (4, 16, 21)])
def test_overlapped_equals_one_softmax_over_the_union(groups, d, slots, rel_err):
    """(21 slots: the late list is wider than one 16-entry vector and not a power of two.)"""
    bsz, heads, block_size = 2, 2, 8
    num_blocks = slots + 5
    seed = torch.initial_seed()
    attn_ids, load, pos = _layout(bsz, heads, slots, block_size, num_blocks, steps=3, seed=seed)
    assert (load >= 0).any() and ((load < 0) & (attn_ids[..., :slots] >= 0)).any()  # both phases work
    q = torch.randn(bsz, heads, groups, d)
    k_slots, v_slots = torch.randn(bsz, heads, slots + 1, block_size, d), torch.randn(bsz, heads, slots + 1, block_size, d)
    kv_len = pos + 1
    slot_ids = torch.arange(slots + 1).view(1, 1, -1)
    want = _float64_attention(q, k_slots, v_slots, attn_ids, kv_len)
    calls = []
    for splits in (1, 2, 5):
        out = decode_attention_slots_triton(q, k_slots, v_slots, attn_ids, slot_ids, kv_len, num_splits=splits,
                                            late=load, between=lambda: calls.append(splits))
        assert rel_err(out, want) < 1e-5, splits
    assert calls == [1, 2, 5]  # between() runs once per call
    plain = decode_attention_slots_triton(q, k_slots, v_slots, attn_ids, slot_ids, kv_len, num_splits=2)
    assert rel_err(plain, want) < 1e-5
    # the dispatcher on CPU tensors: between() first, then the PyTorch twin
    assert rel_err(decode_attention_slots(q, k_slots, v_slots, attn_ids, slot_ids, kv_len, late=load,
                                          between=lambda: calls.append("cpu")), want) < 1e-5
    assert calls[-1] == "cpu"


def test_every_slot_late_and_no_slot_late(rel_err):
    """All selected slots were copied this step (cold start), or none was (all hits)."""
    bsz, heads, groups, d, slots, block_size = 1, 2, 4, 16, 4, 8
    q = torch.randn(bsz, heads, groups, d)
    k_slots, v_slots = torch.randn(bsz, heads, slots + 1, block_size, d), torch.randn(bsz, heads, slots + 1, block_size, d)
    attn_ids = torch.tensor([[[0, 3, 5, -1, 6], [1, 2, -1, 4, 6]]], dtype=torch.int32)
    kv_len = torch.tensor([6 * block_size + 2])
    slot_ids = torch.arange(slots + 1).view(1, 1, -1)
    want = _float64_attention(q, k_slots, v_slots, attn_ids, kv_len)
    for late in (attn_ids[..., :slots].long(), torch.full((bsz, heads, slots), -1)):
        out = decode_attention_slots_triton(q, k_slots, v_slots, attn_ids, slot_ids, kv_len, late=late)
        assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_overlapped_quantized_slots(kv_dtype, rel_err):
    bsz, heads, groups, d, slots, block_size, num_blocks = 2, 2, 3, 32, 5, 8, 9
    attn_ids, load, pos = _layout(bsz, heads, slots, block_size, num_blocks, steps=2, seed=torch.initial_seed() + 1)
    q = torch.randn(bsz, heads, groups, d)
    shape = (bsz, heads, slots + 1, block_size, d)
    k_slots = QuantizedKV.quantize(torch.randn(shape) + 2 * torch.randn(*shape[:-1], 1), kv_dtype)
    v_slots = QuantizedKV.quantize(torch.randn(shape), kv_dtype)
    kv_len = pos + 1
    slot_ids = torch.arange(slots + 1).view(1, 1, -1)
    want = _float64_attention(q, k_slots.dequantize(), v_slots.dequantize(), attn_ids, kv_len)
    out = decode_attention_slots_quantized_triton(q, k_slots, v_slots, attn_ids, slot_ids, kv_len, num_splits=2,
                                                  late=load, between=lambda: None)
    assert rel_err(out, want) < 1e-5


def test_bad_late_raises():
    q = torch.randn(1, 2, 4, 16)
    k_slots = v_slots = torch.randn(1, 2, 5, 8, 16)
    attn_ids = torch.full((1, 2, 5), -1, dtype=torch.int32)
    with pytest.raises(SpardaError, match="late"):
        decode_attention_slots_triton(q, k_slots, v_slots, attn_ids, torch.arange(5).view(1, 1, -1),
                                      torch.tensor([10]), late=torch.full((1, 2, 6), -1))
