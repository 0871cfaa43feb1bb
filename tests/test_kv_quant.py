"""Quantised KV cache (docs/kv_quant.md): the rule's error bound, the caches' storage and
sizes, offloaded == on-device for every KV dtype, and a long generation close to bf16."""

from __future__ import annotations

import pytest
import torch

from sparda.cache.device import DeviceKVCache
from sparda.cache.offload import OffloadKVCache
from sparda.config import SelectionConfig
from sparda.engine.llm import LLM
from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.kernels import reference as ref
from sparda.model.llama import StepInfo

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


def _awkward(shape) -> torch.Tensor:
    """Random rows with per-token offsets, an outlier channel and a few constant rows."""
    x = torch.randn(shape) * torch.rand(*shape[:-1], 1) * 4 + 5 * torch.randn(*shape[:-1], 1)
    x[..., 3] *= 10
    x.view(-1, shape[-1])[::7] = 2.5  # constant rows: step 0, exact
    return x


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_round_trip_within_half_a_step(kv_dtype, head_dim):
    x = _awkward((3, 4, 37, head_dim))
    data, scale = quant.quantize(x, kv_dtype)
    assert data.dtype == torch.uint8 and data.shape[-1] == quant.packed_dim(head_dim, kv_dtype)
    assert scale.shape == (*x.shape[:-1], 2) and scale.dtype == torch.float32
    back = quant.dequantize(data, scale, kv_dtype)
    x64 = x.double()
    step = (x64.amax(-1, keepdim=True) - x64.amin(-1, keepdim=True)) / (2 ** quant.BITS[kv_dtype] - 1)
    err = (back.double() - x64).abs()
    slack = 4 * torch.finfo(torch.float32).eps * x64.abs().amax(-1, keepdim=True)  # two fp32 operations
    assert (err <= step / 2 + slack).all()  # the documented bound: half a quantisation step
    assert (err / (step / 2 + slack)).max() > 0.9  # and it is tight (random values fill the half step)
    constant = x.view(-1, head_dim)[::7]
    assert torch.equal(back.view(-1, head_dim)[::7], constant)
    assert torch.allclose(quant.max_error(scale).double(), step / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: where a CPU-scalar divisor is a reciprocal product"))])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_step_is_the_correctly_rounded_quotient(kv_dtype, device, fresh_seed):
    """The step is the fp32 range ``max - min`` over ``levels``, the quotient rounded once to fp32, as
    the Triton kernels' ``div_rn`` gives it (docs/kv_quant.md). Reference: the quotient in float64
    (exact to 2^-53; ``levels`` is 15 or 255, whose quotients never sit that close to a midpoint)."""
    x = _awkward((64, 8, 64)).to(device)
    _, scale = quant.quantize(x, kv_dtype)
    xf = x.float()
    span = (xf.amax(-1) - xf.amin(-1)).double()  # the fp32 subtraction the quantisers do
    want = (span / (2 ** quant.BITS[kv_dtype] - 1)).float()
    assert torch.equal(scale[..., 0], want), (fresh_seed, (scale[..., 0] != want).sum().item())


def test_int4_packs_two_values_per_byte():
    x = torch.tensor([[0.0, 15.0, 1.0, 14.0, 7.0, 8.0]])  # on the grid: step 1, lo 0
    data, scale = quant.quantize(x, "int4")
    assert data.tolist() == [[0 | 15 << 4, 1 | 14 << 4, 7 | 8 << 4]]
    assert torch.equal(quant.dequantize(data, scale, "int4"), x)
    with pytest.raises(SpardaError, match="even head dim"):
        quant.quantize(torch.randn(2, 5), "int4")
    with pytest.raises(SpardaError, match="unknown kv_dtype 'fp8'; choose one of bf16, int8, int4, mixed"):
        LLM("/nonexistent/model", method="sparse", kv_dtype="fp8", device="cpu")


def _step(phase, rows, q_pos, max_kv_len):
    return StepInfo(phase=phase, rows=rows, q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=None, sin=None,
                    max_kv_len=max_kv_len)


def _stored(cache, layer, rows, n):
    """K, V (dequantised) and compressed keys of ``rows``' first ``n`` tokens as stored: the
    device cache's ``view``, or an offloaded layer's host store read directly."""
    if not isinstance(cache, OffloadKVCache) or not cache.is_offloaded(layer):
        return cache.view(layer, rows, n)
    kv = [cache.host.read_tokens(layer, int(r), n) for r in rows]  # through the block table
    k, v = (quant.cat([x[i][None] for x in kv]) for i in (0, 1))
    ck = cache.ck[layer][rows, :, :cache.num_compressed(n)]
    return quant.as_float(k, cache.dtype), quant.as_float(v, cache.dtype), ck


@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
@pytest.mark.parametrize("offload", [False, True])
def test_cache_stores_quantized_and_compresses_unquantized_keys(kv_dtype, offload):
    """Two prefill chunks (a boundary inside a compression window) then decode tokens:
    ``view`` gives exactly the dequantised keys/values, the compressed keys are those of
    the unquantised keys, and the sizes count quantised bytes."""
    cfg = SelectionConfig(**SMALL)
    layers, b, h, d, cap = 2, 2, 2, 16, 120
    if offload:
        cache = OffloadKVCache(layers, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", kv_dtype=kv_dtype)
    else:
        cache = DeviceKVCache(layers, b, h, d, cap, cfg, torch.float32, "cpu", kv_dtype=kv_dtype)
    k_all = _awkward((b, layers, h, cap, d))
    v_all = _awkward((b, layers, h, cap, d))
    prompt = 70
    for row in range(b):
        for start, end in ((0, 45), (45, prompt)):  # 45: inside the window 40..47
            for layer in range(layers):
                cache.append(layer, k_all[row:row + 1, layer, :, start:end], v_all[row:row + 1, layer, :, start:end],
                             _step("prefill", torch.tensor([row]), torch.arange(start, end).view(1, -1), end))
    rows = torch.arange(b)
    for pos in range(prompt, prompt + 13):
        for layer in range(layers):
            cache.append(layer, k_all[:, layer, :, pos:pos + 1], v_all[:, layer, :, pos:pos + 1],
                         _step("decode", rows, torch.full((b, 1), pos), cap))
    n = prompt + 13
    for layer in range(layers):
        k, v, ck = _stored(cache, layer, rows, n)
        want_k = quant.QuantizedKV.quantize(k_all[:, layer, :, :n], kv_dtype).dequantize()
        want_v = quant.QuantizedKV.quantize(v_all[:, layer, :, :n], kv_dtype).dequantize()
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
        want_ck = ref.compress_keys(k_all[:, layer, :, :n], cfg.kernel_size, cfg.kernel_stride)
        # full precision (fp32 means summed in another order: a few ulps), not from the quantised keys
        assert torch.allclose(ck, want_ck, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride), want_ck,
                                  rtol=1e-5, atol=1e-5)
    token = quant.packed_dim(d, kv_dtype) + 8  # data + fp32 (step, lo)
    assert quant.token_bytes(d, kv_dtype, torch.float32) == token
    if offload:
        assert cache.host.block_bytes == cfg.block_size * token
        assert cache.host.nbytes == 2 * layers * b * h * cache.num_blocks * cfg.block_size * token
    else:
        assert cache.nbytes == 2 * layers * b * h * cap * token
        assert cache.used_bytes() == 2 * layers * h * token * int(cache.lengths.sum())


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _lockstep(ref_llm, off_llm, prompt: list[int], steps: int):
    """Greedy decode feeding the reference's tokens to both: worst logits rel. error, the
    fraction of steps whose argmax agrees, the second cache."""
    caches, firsts = [], []
    for llm in (ref_llm, off_llm):
        llm.method.reset()
        cache = llm.new_cache(1, len(prompt) + steps + 1)
        firsts.append(llm.prefill(cache, 0, prompt)[-1:])
        caches.append(cache)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    worst, agree = rel(firsts[1], firsts[0]), 0
    tokens, positions = firsts[0].argmax(-1), torch.tensor([len(prompt)])
    for _ in range(steps):
        a, b = ref_llm.decode(caches[0], tokens, positions), off_llm.decode(caches[1], tokens, positions)
        worst, agree = max(worst, rel(b, a)), agree + int((a.argmax(-1) == b.argmax(-1)).all())
        tokens, positions = a.argmax(-1), positions + 1
    return worst, agree / steps, caches[1]


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_offloaded_attention_equals_on_device(kv_dtype):
    """The same K/V appended to an on-device and an offloaded cache (two prefill chunks,
    then decode steps), the same random selections: decode attention over the fetched
    slots (host store -> gather of data and scales -> dequantising attention) equals
    attention over the on-device cache, and the host holds the on-device bytes."""
    from sparda import kernels

    cfg = SelectionConfig(**SMALL)
    b, h, g, d, cap, prompt, steps = 2, 2, 3, 16, 200, 70, 60
    dev = DeviceKVCache(1, b, h, d, cap, cfg, torch.float32, "cpu", kv_dtype=kv_dtype)
    off = OffloadKVCache(1, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", kv_dtype=kv_dtype)
    k_all, v_all = _awkward((b, h, cap, d)), _awkward((b, h, cap, d))
    for cache in (dev, off):
        for row in range(b):
            for start, end in ((0, 45), (45, prompt)):
                cache.append(0, k_all[row:row + 1, :, start:end], v_all[row:row + 1, :, start:end],
                             _step("prefill", torch.tensor([row]), torch.arange(start, end).view(1, -1), end))
    rows = torch.arange(b)
    worst = 0.0
    for pos in range(prompt, prompt + steps):
        step = _step("decode", rows, torch.full((b, 1), pos), cap)
        for cache in (dev, off):
            cache.append(0, k_all[:, :, pos:pos + 1], v_all[:, :, pos:pos + 1], step)
        cur = pos // cfg.block_size
        ids = torch.full((b, h, off.select_width), -1, dtype=torch.long)
        for r in range(b):
            for head in range(h):
                chosen = torch.randperm(cur)[:off.select_width - 1].sort().values
                ids[r, head, :len(chosen) + 1] = torch.cat([chosen, torch.tensor([cur])])
        q = torch.randn(b, h, g, d)
        kv_len, p = torch.full((b,), pos + 1), torch.full((b,), pos)
        off.fetch(0, ids, p)
        got = off.attend(0, q, kv_len, p)
        want = kernels.decode_attention(q, dev.k[0], dev.v[0], ids, kv_len, cfg.block_size)
        worst = max(worst, ((got.double() - want.double()).norm() / want.double().norm()).item())
    # fp32, two summation orders: the worst of 60 steps is ~3e-6 typically, 1.24e-5 at most in
    # ~500 draws (seed 492297693, int8); one wrong block or token moves it past 1e-2
    assert worst <= 5e-5
    assert off.prefetcher.stats(steps)["misses"] > 0
    n = prompt + steps
    kv = [off.host.read_tokens(0, r, n) for r in range(b)]
    for i, full in ((0, dev.k[0]), (1, dev.v[0])):
        host = quant.cat([x[i][None] for x in kv])
        host, full = quant.as_float(host, torch.float32), quant.as_float(full[:, :, :n], torch.float32)
        assert torch.equal(host, full)  # the host store holds the on-device bytes


@pytest.mark.parametrize("kv_dtype,resident", [("bf16", ()), ("int8", ()), ("int4", (0,))])
def test_offloaded_model_follows_on_device(tiny, kv_dtype, resident):
    """sparse-offload (host store, slots, gather of data + scales; chunked prefill) on a
    tiny model against on-device sparse, greedy tokens fed to both. bf16: equal logits
    (fp32). Quantised: the two paths' attention twins sum in different orders (~1e-7),
    and a value that lands within that of a rounding boundary of the quantiser is stored
    one step apart in the next layer (seen in 2 of 12 int8 runs), so the bound is that of
    a few such steps and most greedy tokens must agree; the exact equality of the stored
    bytes and of the attention over them is the test above."""
    from sparda.engine.llm import LLM

    common = dict(device="cpu", sparse_prefill=True, kv_dtype=kv_dtype, prefill_chunk_tokens=56, **SMALL)
    on_device = LLM(str(tiny), method="sparse", **common)
    off = LLM(str(tiny), method="sparse-offload", **common)
    off.method.resident_layers = resident
    prompt = torch.randint(100, 20000, (150,)).tolist()
    worst, agree, cache = _lockstep(on_device, off, prompt, 80)
    if kv_dtype == "bf16":
        assert worst <= 1e-5 and agree == 1.0
    else:
        assert worst <= 2e-2 and agree >= 0.9, (worst, agree)
    assert cache.offload_stats(80)["misses"] > 0
    token = quant.token_bytes(off.shape.head_dim, kv_dtype, torch.float32)
    assert cache.host.block_bytes == SMALL["block_size"] * token  # the bytes the gather moves per block


def test_llm_rejects_unknown_kv_dtype_before_loading():
    from sparda.engine.llm import LLM

    with pytest.raises(SpardaError, match="unknown kv_dtype 'int2'"):
        LLM("/nonexistent/model", kv_dtype="int2")



def test_long_generation_stays_close_to_bf16(tiny):
    """1,024 greedy tokens of the tiny model with a bf16 cache, then int8 and int4 caches
    decoding the same tokens (teacher-forced, in lockstep): next-token top-1 agreement
    with bf16 and the mean KL(bf16 || quantised) per step. Measured on such models:
    int8 agrees on 98.5-99.4 % (KL ~1e-5 nats), int4 on 73-81 % (KL ~2e-3); the floors
    leave room for other random models, and int4 must cost more than int8. A free int4
    generation of 1,024 tokens runs too."""
    from sparda.engine.llm import LLM

    prompt = torch.randint(100, 20000, (40,)).tolist()
    steps = 1024
    llms = {kv: LLM(str(tiny), method="sparse", device="cpu", kv_dtype=kv) for kv in ("bf16", "int8", "int4")}
    free = llms["int4"].generate(None, prompt_token_ids=[prompt], max_new_tokens=steps, ignore_eos=True)[0]
    assert len(free.token_ids) == steps and free.stats["kv_cache_bytes"] < llms["bf16"].kv_bytes_per_token() * (
        len(prompt) + steps) / 3
    caches = {kv: llm.new_cache(1, len(prompt) + steps) for kv, llm in llms.items()}
    logits = {kv: llm.prefill(caches[kv], 0, prompt)[-1:] for kv, llm in llms.items()}
    agree = {"int8": 0, "int4": 0}
    kl = {"int8": 0.0, "int4": 0.0}
    for i in range(steps):
        ref = logits["bf16"].log_softmax(-1)
        token = ref.argmax(-1)
        for kv in agree:
            agree[kv] += int(logits[kv].argmax(-1) == token)
            kl[kv] += float((ref.exp() * (ref - logits[kv].log_softmax(-1))).sum())
        if i + 1 < steps:
            pos = torch.tensor([len(prompt) + i])
            logits = {kv: llm.decode(caches[kv], token, pos) for kv, llm in llms.items()}
    rate = {kv: n / steps for kv, n in agree.items()}
    mean_kl = {kv: v / steps for kv, v in kl.items()}
    assert rate["int8"] >= 0.95 and mean_kl["int8"] < 1e-4, (rate, mean_kl)
    assert rate["int4"] >= 0.5 and mean_kl["int4"] < 0.05, (rate, mean_kl)
    assert mean_kl["int4"] > mean_kl["int8"] > 0
