"""Dequantising Triton decode attention (int8/int4 cache, docs/kv_quant.md) under the
interpreter, against dense attention on the dequantised cache in float64."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import decode_attention, decode_attention_slots  # noqa: E402
from sparda.kernels.decode_attention import (  # noqa: E402
    decode_attention_quantized_triton, decode_attention_slots_quantized_triton)
from sparda.kernels.quant import QuantizedKV  # noqa: E402


def _dense_ref(q, keys, values, visible):
    """float64 softmax attention: ``q [B, H, G, d]``, ``keys/values [B, H, T, d]``,
    ``visible [B, H, T]`` bool -> ``[B, H, G, d]`` (rows seeing nothing: 0)."""
    q, keys, values = q.double(), keys.double(), values.double()
    logits = torch.einsum("bhgd,bhtd->bhgt", q, keys) / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(~visible[:, :, None], float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("bhgt,bhtd->bhgd", probs, values)


def _random_ids(bsz, heads, num_blocks, width):
    ids = torch.full((bsz, heads, width), -1, dtype=torch.int64)
    for b in range(bsz):
        for h in range(heads):
            chosen = torch.nonzero(torch.rand(num_blocks) < 0.6).flatten()[:width]
            ids[b, h, :len(chosen)] = chosen[torch.randperm(len(chosen))]
    return ids


def _kv(shape, kv_dtype):
    """Random K/V with per-token offsets and an outlier channel (as real keys have)."""
    x = torch.randn(shape) + 3 * torch.randn(*shape[:-1], 1)
    x[..., 5] *= 8
    return QuantizedKV.quantize(x, kv_dtype)


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("groups", [1, 3])
def test_quantized_decode_equals_dequantized_cache(kv_dtype, groups, rel_err):
    bsz, heads, d, block_size, num_keys = 3, 2, 32, 16, 203
    q = torch.randn(bsz, heads, groups, d)
    k, v = _kv((bsz, heads, num_keys, d), kv_dtype), _kv((bsz, heads, num_keys, d), kv_dtype)
    kv_len = torch.tensor([203, 37, 1])
    ids = _random_ids(bsz, heads, 13, 9)
    blocks = torch.arange(num_keys) // block_size
    selected = (blocks.view(1, 1, -1, 1) == ids[:, :, None]).any(-1)
    visible = selected & (torch.arange(num_keys).view(1, 1, -1) < kv_len.view(-1, 1, 1))
    ref = _dense_ref(q, k.dequantize(), v.dequantize(), visible)
    for splits in (1, 3):
        out = decode_attention_quantized_triton(q, k, v, ids.to(torch.int32), kv_len, block_size, num_splits=splits)
        assert rel_err(out, ref) < 1e-5, splits
    assert rel_err(decode_attention(q, k, v, ids, kv_len, block_size), ref) < 1e-5  # the CPU twin


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_slots_decode_equals_dequantized_slots(kv_dtype, rel_err):
    bsz, heads, groups, d, block_size, slots = 2, 3, 4, 16, 8, 5
    q = torch.randn(bsz, heads, groups, d)
    k, v = _kv((bsz, heads, slots, block_size, d), kv_dtype), _kv((bsz, heads, slots, block_size, d), kv_dtype)
    block_ids = torch.stack([torch.randperm(9)[:slots] for _ in range(bsz * heads)]).view(bsz, heads, slots)
    block_ids[0, 1, 2] = -1
    kv_len = torch.tensor([9 * block_size - 3, 4 * block_size + 1])
    pos = block_ids[..., None] * block_size + torch.arange(block_size)  # [B, H, S, bs]
    visible = ((block_ids[..., None] >= 0) & (pos < kv_len.view(-1, 1, 1, 1))).flatten(2)
    ref = _dense_ref(q, k.dequantize().flatten(2, 3), v.dequantize().flatten(2, 3), visible)
    slot_ids = torch.arange(slots).view(1, 1, -1)
    out = decode_attention_slots_quantized_triton(q, k, v, block_ids, slot_ids, kv_len, num_splits=2)
    assert rel_err(out, ref) < 1e-5
    assert rel_err(decode_attention_slots(q, k, v, block_ids, slot_ids, kv_len), ref) < 1e-5  # the CPU twin


def test_quantized_decode_rejects_mismatched_buffers():
    q = torch.randn(1, 2, 2, 32)
    k = QuantizedKV.quantize(torch.randn(1, 2, 64, 32), "int8")
    v = QuantizedKV.quantize(torch.randn(1, 2, 64, 32), "int4")
    with pytest.raises(SpardaError, match="one kv_dtype"):
        decode_attention_quantized_triton(q, k, v, torch.zeros(1, 2, 1, dtype=torch.long), torch.tensor([64]), 16)
