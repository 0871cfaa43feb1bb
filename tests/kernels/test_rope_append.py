"""The RoPE + append kernel (interpreter) against the caches' own decode append and the twin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.cache.device import DeviceKVCache  # noqa: E402
from sparda.cache.offload import OffloadKVCache  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import reference as ref  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.kernels.rope_append import rope_append_triton  # noqa: E402
from sparda.model.llama import StepInfo  # noqa: E402

CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                      topk_blocks=2, dense_len=64)


def _inputs(gen, b, hk, g, nf, d, cap):
    qkv = torch.randn(b, (hk * g + (2 + nf) * hk) * d, generator=gen)
    # positions: some complete a window (pos + 1 - kernel divisible by stride), some do not
    pos = torch.randint(CFG.kernel_size, cap - 2, (b,), generator=gen)
    pos[0] = 4 * int(torch.randint(2, (cap - CFG.kernel_size - 2) // 4, (1,), generator=gen)) + CFG.kernel_size - 1
    theta = pos.view(-1, 1).float() * (1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([theta, theta], -1)
    return qkv, emb.cos().view(b, 1, 1, d), emb.sin().view(b, 1, 1, d), pos


def _split(qkv, b, hk, g, nf, d, cos, sin):
    parts = qkv.view(b, hk * g + (2 + nf) * hk, 1, d)
    q = ref.apply_rope(parts[:, :hk * g], cos, sin)
    k = ref.apply_rope(parts[:, hk * g:hk * g + hk], cos, sin)
    v = parts[:, hk * g + hk:hk * g + 2 * hk]
    f = ref.apply_rope(parts[:, hk * g + 2 * hk:], cos, sin)
    return q[:, :, 0], k, v, f[:, :, 0].reshape(b, nf, hk, d)


@pytest.mark.parametrize("g,nf,d", [(1, 0, 16), (3, 1, 32), (4, 2, 16)])
def test_rope_append_offload_slot_matches_cache_append(g, nf, d, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, cap = 3, 2, 90
    qkv, cos, sin, pos = _inputs(gen, b, hk, g, nf, d, cap)
    cache = OffloadKVCache(2, b, hk, d, cap, CFG, torch.float32, "cpu", engine="sync")
    for layer in range(2):  # random history: prefill every row with random keys
        for row in range(b):
            kk = torch.randn(1, hk, cap, d, generator=gen)
            step = StepInfo("prefill", torch.tensor([row]), torch.arange(cap).view(1, -1),
                            torch.tensor([cap]), None, None, cap)
            cache.append(layer, kk[..., :int(pos[row]), :].contiguous(), kk[..., :int(pos[row]), :].contiguous(),
                         StepInfo("prefill", torch.tensor([row]), torch.arange(int(pos[row])).view(1, -1),
                                  pos[row:row + 1], None, None, int(pos[row])))
    layer = 1
    state = [t.clone() for t in (cache.k_slots[layer], cache.v_slots[layer], cache.ring[layer], cache.ck[layer],
                                 cache.host.chunks[layer][0].k, cache.host.chunks[layer][0].v)]
    q, k, v, f = _split(qkv, b, hk, g, nf, d, cos, sin)
    step = StepInfo("decode", torch.arange(b), pos.view(-1, 1), pos + 1, cos, sin, cap, int(pos.max()) + 1)
    cache.append(layer, k, v, step)  # the cache's own decode append: the reference
    for fn in (rope_append_triton, twins.rope_append_reference):
        ks, vs, ring, ck, hk_, hv_ = [t.clone() for t in state]
        q_out = torch.full((b, hk * g, d), float("nan"))
        f_out = torch.full((b, nf, hk, d), float("nan")) if nf else None
        lengths = torch.zeros(b, dtype=torch.long)
        fn(qkv, cos, sin, pos, q_out, f_out, ks, vs, ck, num_kv_heads=hk, group=g, num_f=nf,
           block_size=CFG.block_size, kernel=CFG.kernel_size, stride=CFG.kernel_stride, slot=cache.slots,
           ring=ring, host=(hk_, hv_), lengths=lengths)
        torch.testing.assert_close(q_out, q, rtol=1e-6, atol=1e-6)
        if nf:
            torch.testing.assert_close(f_out, f, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ks, cache.k_slots[layer], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(vs, cache.v_slots[layer], rtol=0, atol=0)
        torch.testing.assert_close(ring, cache.ring[layer], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ck, cache.ck[layer], rtol=1e-5, atol=1e-6)
        if fn is twins.rope_append_reference:  # one PyTorch compressed-key update: bit-identical
            assert torch.equal(ck, cache.ck[layer]) and torch.equal(ring, cache.ring[layer])
        torch.testing.assert_close(hk_, cache.host.chunks[layer][0].k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(hv_, cache.host.chunks[layer][0].v, rtol=0, atol=0)
        assert torch.equal(lengths, pos + 1)
    assert not torch.equal(state[3], cache.ck[layer])  # row 0 completed a window: a compressed key changed


@pytest.mark.parametrize("g,nf,d", [(4, 0, 16), (1, 1, 32)])
def test_rope_append_device_cache_matches_cache_append(g, nf, d, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, cap = 2, 2, 70
    qkv, cos, sin, pos = _inputs(gen, b, hk, g, nf, d, cap)
    cache = DeviceKVCache(1, b, hk, d, cap, CFG, torch.float32, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.ck[0].copy_(torch.randn(cache.ck[0].shape, generator=gen))
    state = [t.clone() for t in (cache.k[0], cache.v[0], cache.ck[0])]
    q, k, v, f = _split(qkv, b, hk, g, nf, d, cos, sin)
    cache.append(0, k, v, StepInfo("decode", torch.arange(b), pos.view(-1, 1), pos + 1, cos, sin, cap))
    for fn in (rope_append_triton, twins.rope_append_reference):
        kd, vd, ck = [t.clone() for t in state]
        q_out = torch.empty(b, hk * g, d)
        f_out = torch.empty(b, nf, hk, d) if nf else None
        fn(qkv, cos, sin, pos, q_out, f_out, kd, vd, ck, num_kv_heads=hk, group=g, num_f=nf,
           block_size=CFG.block_size, kernel=CFG.kernel_size, stride=CFG.kernel_stride)
        torch.testing.assert_close(q_out, q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kd, cache.k[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(vd, cache.v[0], rtol=0, atol=0)
        torch.testing.assert_close(ck, cache.ck[0], rtol=1e-5, atol=1e-6)
        if fn is twins.rope_append_reference:  # one PyTorch compressed-key update: bit-identical
            assert torch.equal(ck, cache.ck[0])
