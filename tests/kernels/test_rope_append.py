"""The RoPE + append kernel (interpreter) against the caches' own decode append and the twin."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.cache.device import DeviceKVCache  # noqa: E402
from sparda.cache.offload import OffloadKVCache  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import quant  # noqa: E402
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


def _assign_random_pages(caches, gen) -> None:
    """The same random pages (a permutation of a pool larger than needed) for every row of
    every cache of ``caches`` (alike), so the host writes follow a block table that is not
    the identity."""
    c = caches[0]
    order = torch.randperm(c.host_blocks, generator=gen).tolist()
    n = c.num_blocks
    for cache in caches:
        for row in range(c.batch):
            cache.assign_blocks(row, order[row * n:(row + 1) * n])


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
    cache = OffloadKVCache(2, b, hk, d, cap, CFG, torch.float32, "cpu", engine="sync",
                           host_blocks=b * -(-cap // CFG.block_size) + 5)
    _assign_random_pages([cache], gen)
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
           ring=ring, host=(hk_, hv_, cache.block_table), lengths=lengths)
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


# ----------------------------------------------------------------- quantised caches (docs/kv_quant.md)
def _decode_inputs(gen, b, hk, g, nf, d, pos):
    """A random stacked projection row per cache row and the RoPE tables of ``pos [B]``."""
    qkv = torch.randn(b, (hk * g + (2 + nf) * hk) * d, generator=gen) * 3
    theta = pos.view(-1, 1).float() * (1.0 / 100.0 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([theta, theta], -1)
    return qkv, emb.cos().view(b, 1, 1, d), emb.sin().view(b, 1, 1, d)


def _prefill(caches, layers, gen, b, hk, d, lengths):
    """The same random K/V prefill (one row at a time) into every cache."""
    for layer in range(layers):
        for row in range(b):
            n = int(lengths[row])
            kk, vv = torch.randn(1, hk, n, d, generator=gen), torch.randn(1, hk, n, d, generator=gen)
            step = StepInfo("prefill", torch.tensor([row]), torch.arange(n).view(1, -1), torch.tensor([n]),
                            None, None, n)
            for cache in caches:
                cache.append(layer, kk, vv, step)


def _assert_same_quantized(got, want, what):
    """Codes and ``(step, lo)`` bit-identical: the kernel rounds RoPE like PyTorch and
    quantises with IEEE divisions and ties-to-even, so from the same key it computes the
    same codes. (Where the compiler contracts fp32 RoPE into FMAs on the GPU, a key can
    differ by an ulp and its code by one step; bf16 RoPE rounds after every operation.)"""
    assert torch.equal(got.data, want.data), f"{what}: codes differ"
    assert torch.equal(got.scale, want.scale), f"{what}: scales differ"


def _assert_offloaded_same(cache, ref, what):
    """:func:`_assert_same_quantized` on an offloaded cache's resident layer 0 and the slot
    buffer and first host chunk of layer 1."""
    _assert_same_quantized(cache.k_full[0], ref.k_full[0], f"{what} resident K")
    _assert_same_quantized(cache.v_full[0], ref.v_full[0], f"{what} resident V")
    _assert_same_quantized(cache.k_slots[1], ref.k_slots[1], f"{what} slot K")
    _assert_same_quantized(cache.v_slots[1], ref.v_slots[1], f"{what} slot V")
    chunk, want = cache.host.chunks[1][0], ref.host.chunks[1][0]
    _assert_same_quantized(chunk.k, want.k, f"{what} host K")
    _assert_same_quantized(chunk.v, want.v, f"{what} host V")


def _dispatch_to(monkeypatch, fn, calls: dict):
    """Route :func:`sparda.kernels.rope_append` to ``fn`` (the Triton launcher, run by the
    interpreter on CPU tensors, or the twin), counting calls in ``calls[fn.__name__]``."""
    from sparda import kernels

    def run(*args, **kw):
        calls[fn.__name__] = calls.get(fn.__name__, 0) + 1
        fn(*args, **kw)

    monkeypatch.setattr(kernels, "rope_append", run)


def _fused_and_unfused_steps(ref_c, fused, monkeypatch, calls, gen, dims, lengths, steps, layers, cap, dtype=None):
    """Decode ``steps`` random tokens per row into every layer: ``ref_c.append`` (unfused), then
    ``rope_append`` of each of ``fused``, the first through the Triton kernel, the second
    through the twin (its rotated queries and Forecast heads checked); yields ``(i, layer, pos,
    step, qkv)`` after each layer."""
    b, hk, g, nf, d = dims
    for i in range(steps):
        pos = lengths + i
        step = StepInfo("decode", torch.arange(b), pos.view(-1, 1), pos + 1, None, None, cap)
        for layer in range(layers):
            qkv, step.cos, step.sin = _decode_inputs(gen, b, hk, g, nf, d, pos)
            if dtype is not None:
                qkv, step.cos, step.sin = qkv.to(dtype), step.cos.to(dtype), step.sin.to(dtype)
            q, k, v, f = _split(qkv, b, hk, g, nf, d, step.cos, step.sin)
            ref_c.append(layer, k, v, step)
            for cache, fn in zip(fused, (rope_append_triton, twins.rope_append_reference)):
                _dispatch_to(monkeypatch, fn, calls)
                q_out, f_out = cache.rope_append(layer, qkv, step, g, nf)
                torch.testing.assert_close(q_out, q, rtol=1e-6, atol=1e-6)
                if nf:
                    torch.testing.assert_close(f_out, f, rtol=1e-6, atol=1e-6)
            yield i, layer, pos, step, qkv


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("g,nf,d", [(1, 0, 64), (3, 1, 128), (4, 2, 64)])
def test_quantized_offload_append_matches_unfused(kv_dtype, g, nf, d, fresh_seed, monkeypatch):
    """A quantised offloaded cache, resident layer 0 and offloaded layer 1, 12 decode steps
    from lengths 13 / 30 / 47 (every row crosses a block boundary of 16 and completes
    compression windows): the fused append -- ``OffloadKVCache.rope_append`` with
    the Triton kernel (host write-back by the engine), the same with the twin, and the
    kernel writing the host store itself (``host=``) -- leaves the slot, resident and host
    codes and scales bit-identical to the unfused ``append`` (quantise in PyTorch), and the
    ring and compressed keys of the full-precision keys."""

    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, layers, cap, steps = 3, 2, 2, 64, 12
    lengths = torch.tensor([13, 30, 47])
    make = lambda: OffloadKVCache(layers, b, hk, d, cap, CFG, torch.float32, "cpu", engine="sync",  # noqa: E731
                                  resident_layers=(0,), kv_dtype=kv_dtype, host_blocks=b * cap // CFG.block_size + 3)
    ref_c, tri_c, twin_c, host_c = caches = [make() for _ in range(4)]
    _assign_random_pages(caches, gen)
    _prefill(caches, layers, gen, b, hk, d, lengths)
    for c in caches[1:]:
        c.lengths.copy_(ref_c.lengths)
    calls = {}
    for _, layer, pos, step, qkv in _fused_and_unfused_steps(ref_c, (tri_c, twin_c), monkeypatch, calls, gen,
                                                              (b, hk, g, nf, d), lengths, steps, layers, cap):
        # the kernel writing the host store itself (UVA on the GPU)
        q_out = torch.empty(b, hk * g, d)
        f_out = torch.empty(b, nf, hk, d) if nf else None
        common = dict(num_kv_heads=hk, group=g, num_f=nf, block_size=CFG.block_size, kernel=CFG.kernel_size,
                      stride=CFG.kernel_stride, ring=host_c.ring[layer],
                      lengths=host_c.lengths if layer == layers - 1 else None)
        if layer in host_c.resident:
            rope_append_triton(qkv, step.cos, step.sin, pos, q_out, f_out, host_c.k_full[layer],
                               host_c.v_full[layer], host_c.ck[layer], **common)
        else:
            chunk = host_c.host.chunks[layer][0]
            rope_append_triton(qkv, step.cos, step.sin, pos, q_out, f_out, host_c.k_slots[layer],
                               host_c.v_slots[layer], host_c.ck[layer], slot=host_c.slots,
                               host=(chunk.k, chunk.v, chunk.table), **common)
    assert calls == {"rope_append_triton": steps * layers, "rope_append_reference": steps * layers}
    for name, cache in (("triton", tri_c), ("twin", twin_c), ("triton host=", host_c)):
        what = f"{name} {kv_dtype} g={g} d={d} seed={fresh_seed}"
        _assert_offloaded_same(cache, ref_c, what)
        for layer in range(layers):
            torch.testing.assert_close(cache.ring[layer], ref_c.ring[layer], rtol=0, atol=0)
            torch.testing.assert_close(cache.ck[layer], ref_c.ck[layer], rtol=1e-5, atol=1e-6)
        assert torch.equal(cache.lengths, lengths + steps)
    # the partial slot and the host hold codes, not zeros; compressed keys are not from dequantised keys
    assert ref_c.k_slots[1].scale[:, :, ref_c.slots].abs().sum() > 0


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("g,nf,d", [(4, 0, 128), (3, 1, 64), (1, 2, 64)])
def test_quantized_device_append_matches_unfused(kv_dtype, g, nf, d, fresh_seed, monkeypatch):
    """A quantised on-device cache (``DeviceKVCache.rope_append``, Triton kernel): 18 decode
    steps across block boundaries leave codes, scales, ring and compressed keys as the
    unfused ``append``; values half-way between two codes round to the even one
    (``torch.round``), a constant row stores step 0 and comes back exactly; the
    compressed keys are the full-precision keys' means."""
    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, cap, steps = 3, 2, 64, 18
    lengths = torch.tensor([9, 16, 31])
    ref_c, tri_c = caches = [DeviceKVCache(1, b, hk, d, cap, CFG, torch.float32, "cpu", kv_dtype=kv_dtype)
                             for _ in range(2)]
    _prefill(caches, 1, gen, b, hk, d, lengths)
    calls = {}
    _dispatch_to(monkeypatch, rope_append_triton, calls)
    keys = []
    levels = 2 ** quant.BITS[kv_dtype] - 1
    ties = torch.arange(d, dtype=torch.float32) % (levels - 1) + 0.5  # lo 0, step 1: (x - lo) / step = n + 1/2
    ties[0], ties[1] = 0.0, float(levels)
    v_off = (hk * g + hk) * d
    for i in range(steps):
        pos = lengths + i
        step = StepInfo("decode", torch.arange(b), pos.view(-1, 1), pos + 1, None, None, cap)
        qkv, step.cos, step.sin = _decode_inputs(gen, b, hk, g, nf, d, pos)
        qkv[0, v_off:v_off + d] = ties  # row 0, head 0: values half-way between codes
        qkv[1, v_off + d:v_off + 2 * d] = 2.5  # row 1, head 1: a constant row (step 0)
        q, k, v, f = _split(qkv, b, hk, g, nf, d, step.cos, step.sin)
        keys.append(k[:, :, 0])
        ref_c.append(0, k, v, step)
        q_out, f_out = tri_c.rope_append(0, qkv, step, g, nf)
        torch.testing.assert_close(q_out, q, rtol=1e-6, atol=1e-6)
    assert calls == {"rope_append_triton": steps}
    what = f"{kv_dtype} g={g} d={d} seed={fresh_seed}"
    _assert_same_quantized(tri_c.k[0], ref_c.k[0], f"{what} K")
    _assert_same_quantized(tri_c.v[0], ref_c.v[0], f"{what} V")
    assert torch.equal(tri_c.ring[0], ref_c.ring[0])
    torch.testing.assert_close(tri_c.ck[0], ref_c.ck[0], rtol=1e-5, atol=1e-6)
    assert torch.equal(tri_c.lengths, lengths + steps)
    decoded = slice(int(lengths[0]), int(lengths[0]) + steps)
    tie_codes = tri_c.v[0][0, 0, decoded].dequantize()
    assert torch.equal(tie_codes, torch.round(ties).expand_as(tie_codes))  # ties to even, as torch.round
    assert not torch.equal(torch.round(ties), torch.floor(ties + 0.5))  # (the test has ties that matter)
    const = tri_c.v[0][1, 1, int(lengths[1]):int(lengths[1]) + steps]
    assert torch.equal(const.scale, torch.tensor([0.0, 2.5]).expand_as(const.scale))
    assert torch.equal(const.dequantize(), torch.full((steps, d), 2.5))
    # row 2's last window (tokens 40..47) is all decoded: its compressed key is the mean of the fp32 keys
    j = (47 + 1 - CFG.kernel_size) // CFG.kernel_stride
    want = torch.stack([keys[p - 31][2] for p in range(40, 48)]).mean(0)
    torch.testing.assert_close(tri_c.ck[0][2, :, j], want, rtol=1e-5, atol=1e-6)


def test_quantized_append_needs_the_ring():
    from sparda import kernels
    from sparda.errors import SpardaError

    b, hk, d = 1, 1, 16
    kd, vd = (quant.QuantizedKV.zeros((b, hk, 32, d), "int8") for _ in range(2))
    qkv, cos, sin = _decode_inputs(torch.Generator().manual_seed(0), b, hk, 1, 0, d, torch.tensor([5]))
    with pytest.raises(SpardaError, match="ring"):
        kernels.rope_append(qkv, cos, sin, torch.tensor([5]), torch.empty(b, hk, d), None, kd, vd,
                            torch.zeros(b, hk, 8, d), num_kv_heads=hk, group=1, num_f=0, block_size=16,
                            kernel=8, stride=4)


@pytest.fixture
def interpreter_bf16_rtne(monkeypatch):
    """Make the Triton 3.6 interpreter convert fp32 -> bf16 as compiled Triton does.

    ``x.to(tl.bfloat16)`` defaults to round-to-nearest-even (``semantic.cast``: "for fp
    downcasting default rounding mode should be RTNE"; on the GPU ``cvt.rn.bf16.f32``), but
    the interpreter's ``cast_impl`` truncates the mantissa, so every bf16 rounding in a
    kernel run on the CPU is up to one ulp off PyTorch's. Here the conversion goes through
    ``torch.Tensor.to(torch.bfloat16)`` (RTNE) instead; every other cast is untouched."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            out = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interp.TensorHandle(out.numpy().view(np.uint16).reshape(src.data.shape), tl.bfloat16)
        return original(self, src, dst_type)

    monkeypatch.setattr(interp.InterpreterBuilder, "cast_impl", cast_impl)


def test_interpreter_bf16_rounding_patch(interpreter_bf16_rtne, fresh_seed):
    """The patch above rounds a Triton fp32 -> bf16 cast exactly as PyTorch (products of two
    bf16, so fp32 holds them exactly and every tie and carry is PyTorch's to decide)."""
    import triton
    import triton.language as tl

    @triton.jit
    def mul(X, Y, O, N: tl.constexpr):
        o = tl.arange(0, N)
        tl.store(O + o, (tl.load(X + o).to(tl.float32) * tl.load(Y + o).to(tl.float32)).to(tl.bfloat16))

    gen = torch.Generator().manual_seed(fresh_seed)
    x, y = (torch.randn(4096, generator=gen) * 3).bfloat16(), torch.rand(4096, generator=gen).bfloat16()
    out = torch.empty(4096, dtype=torch.bfloat16)
    mul[(1,)](x, y, out, N=4096)
    assert torch.equal(out, x * y), f"seed={fresh_seed}"


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("g,d", [(4, 128), (16, 128), (3, 64)])
def test_quantized_append_in_bf16_matches_unfused(kv_dtype, g, d, fresh_seed, monkeypatch, interpreter_bf16_rtne):
    """The GPU's configuration, which the fp32 tests above do not reach: a **bf16** model
    (``q/k/v`` and the RoPE tables in bf16, so the kernel rounds RoPE to bf16 after each
    operation) with a quantised cache. 10 decode steps into an on-device cache and into an
    offloaded one (slot and host store written by the kernel through ``host=``, resident
    layer 0), keys with a per-channel offset and an outlier channel (as real keys): the
    codes and ``(step, lo)`` are bit-identical to the unfused ``append`` of
    ``apply_rope`` in bf16 quantised by PyTorch, and the rotated queries equal PyTorch's.
    ``g = 16`` is the MiniCPM4.1-8B group (32 query heads on 2 KV heads). A difference here
    would be a kernel defect, not the stacked GEMM rounding a key differently."""
    bf = torch.bfloat16
    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, cap, steps, nf = 3, 2, 64, 10, 1
    lengths = torch.tensor([5, 16, 40])
    offset = torch.randn(d, generator=gen) * 2
    offset[int(torch.randint(d, (1,), generator=gen))] = 40.0  # an outlier channel
    dev_ref, dev_tri = (DeviceKVCache(1, b, hk, d, cap, CFG, bf, "cpu", kv_dtype=kv_dtype) for _ in range(2))
    off_ref, off_tri = (OffloadKVCache(2, b, hk, d, cap, CFG, bf, "cpu", engine="sync", resident_layers=(0,),
                                       kv_dtype=kv_dtype) for _ in range(2))
    _prefill([dev_ref, dev_tri], 1, gen, b, hk, d, lengths)
    _prefill([off_ref, off_tri], 2, gen, b, hk, d, lengths)
    for c in (dev_tri, off_tri):
        c.lengths.copy_(lengths)
    calls = {}
    _dispatch_to(monkeypatch, rope_append_triton, calls)
    k_off = hk * g * d
    for i in range(steps):
        pos = lengths + i
        step = StepInfo("decode", torch.arange(b), pos.view(-1, 1), pos + 1, None, None, cap)
        for layer, (ref_c, tri_c) in ((0, (dev_ref, dev_tri)), (0, (off_ref, off_tri)), (1, (off_ref, off_tri))):
            qkv, cos, sin = _decode_inputs(gen, b, hk, g, nf, d, pos)
            qkv[:, k_off:k_off + hk * d] += offset.repeat(hk)
            qkv, step.cos, step.sin = qkv.to(bf), cos.to(bf), sin.to(bf)
            q, k, v, f = _split(qkv, b, hk, g, nf, d, step.cos, step.sin)
            assert k.dtype == bf
            ref_c.append(layer, k, v, step)
            if layer == 0:  # the on-device cache, or the offloaded cache's resident layer
                q_out, _ = tri_c.rope_append(layer, qkv, step, g, nf)
            else:  # the kernel writes the host store itself (UVA on the GPU)
                q_out, f_out = torch.empty(b, hk * g, d, dtype=bf), torch.empty(b, nf, hk, d, dtype=bf)
                chunk = tri_c.host.chunks[layer][0]
                rope_append_triton(qkv, step.cos, step.sin, pos, q_out, f_out, tri_c.k_slots[layer],
                                   tri_c.v_slots[layer], tri_c.ck[layer], num_kv_heads=hk, group=g, num_f=nf,
                                   block_size=CFG.block_size, kernel=CFG.kernel_size, stride=CFG.kernel_stride,
                                   slot=tri_c.slots, ring=tri_c.ring[layer], host=(chunk.k, chunk.v, chunk.table),
                                   lengths=tri_c.lengths)
                assert torch.equal(f_out, f), f"Forecast heads differ, seed={fresh_seed}"
            assert torch.equal(q_out, q), f"rotated queries differ from PyTorch's bf16 RoPE, seed={fresh_seed}"
    what = f"bf16 {kv_dtype} g={g} d={d} seed={fresh_seed}"
    _assert_same_quantized(dev_tri.k[0], dev_ref.k[0], f"{what} device K")
    _assert_same_quantized(dev_tri.v[0], dev_ref.v[0], f"{what} device V")
    _assert_offloaded_same(off_tri, off_ref, what)
    assert calls["rope_append_triton"] == 2 * steps  # the device cache and the resident layer


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("g,nf,d", [(1, 0, 64), (3, 1, 32)])
def test_mixed_offload_append_writes_slot_store_and_pool(dtype, g, nf, d, fresh_seed, monkeypatch, request):
    """``kv_dtype`` ``mixed`` (design §6.1), 12 decode steps across block boundaries, a pool of 3
    blocks (so pool slots wrap): the fused append writing the slot, the int4 store (quantised
    in the kernel) and the hot pool itself (``_fused_host``: ``host=`` and ``pool=``, the kernel
    under the interpreter and the twin) leaves the exact slot and pool tokens and the int4
    codes and scales bit-identical to the unfused ``append`` (the sync engine's two stores of
    :meth:`_store_tokens`); bf16 too (rounding as compiled Triton does)."""
    from sparda.bench.op_count import TwinEngine
    from sparda.cache.mixed import MixedOffloadKVCache

    if dtype == "bf16":
        request.getfixturevalue("interpreter_bf16_rtne")
    dt = torch.bfloat16 if dtype == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(fresh_seed)
    b, hk, layers, cap, steps = 3, 2, 2, 96, 12
    lengths = torch.tensor([13, 30, 47])

    def make(engine):
        cache = MixedOffloadKVCache(layers, b, hk, d, cap, CFG, dt, "cpu", engine="sync", resident_layers=(0,),
                                    hot_blocks=3, hot_steps=2)
        if engine is not None:
            cache.engine = cache.prefetcher.engine = engine
        return cache

    ref_c, tri_c, twin_c = caches = [make(None), make(TwinEngine()), make(TwinEngine())]
    assert ref_c._fused_host(1) is None and set(tri_c._fused_host(1)) == {"host", "pool"}
    _prefill(caches, layers, gen, b, hk, d, lengths)
    for c in caches[1:]:
        c.lengths.copy_(ref_c.lengths)
    calls = {}
    for _ in _fused_and_unfused_steps(ref_c, (tri_c, twin_c), monkeypatch, calls, gen, (b, hk, g, nf, d), lengths,
                                      steps, layers, cap, dt):
        pass
    assert calls == {"rope_append_triton": steps * layers, "rope_append_reference": steps * layers}
    for name, cache in (("triton", tri_c), ("twin", twin_c)):
        what = f"{name} mixed {dtype} g={g} d={d} seed={fresh_seed}"
        assert torch.equal(cache.k_slots[1], ref_c.k_slots[1]) and torch.equal(cache.v_slots[1], ref_c.v_slots[1]), what
        assert torch.equal(cache.k_full[0], ref_c.k_full[0]) and torch.equal(cache.v_full[0], ref_c.v_full[0]), what
        chunk, want = cache.host.chunks[1][0], ref_c.host.chunks[1][0]
        _assert_same_quantized(chunk.k, want.k, f"{what} host K")
        _assert_same_quantized(chunk.v, want.v, f"{what} host V")
        pool, want = cache.host.pool[1][0], ref_c.host.pool[1][0]
        assert torch.equal(pool.k, want.k) and torch.equal(pool.v, want.v), f"{what} pool"
        for layer in range(layers):
            assert torch.equal(cache.ring[layer], ref_c.ring[layer]), what
            torch.testing.assert_close(cache.ck[layer], ref_c.ck[layer], rtol=1e-5, atol=1e-6)
    # the pool holds this step's exact tokens at pool slot block mod 3, the store their codes
    ref_pool = ref_c.host.pool[1][0]
    last = lengths + steps - 1
    for r in range(b):
        blk = int(last[r]) // CFG.block_size
        got = ref_pool.k[:, ref_c.host.pool_table.host[r, blk % 3], int(last[r]) % CFG.block_size]
        assert torch.equal(got, ref_c.k_slots[1][r, :, ref_c.slots, int(last[r]) % CFG.block_size])
