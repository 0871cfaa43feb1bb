"""Triton attention mass per key (h2o's prefill scores) against a float64 brute force."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda import kernels  # noqa: E402
from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.kernels.attention_mass import token_attention_mass_triton  # noqa: E402


def _inputs(groups, num_keys, num_q, d=16, seed=0):
    """Random ``q [2, 2, G, Tq, d]``, ``k [2, 2, T, d]`` (scaled so that softmaxes are peaked
    and flat in places); ``seed`` offsets the test's recorded seed (tests/conftest.py)."""
    gen = torch.Generator().manual_seed(torch.initial_seed() + seed)
    q = torch.randn(2, 2, groups, num_q, d, generator=gen) * 2
    k = torch.randn(2, 2, num_keys, d, generator=gen) * 2
    return q, k


def _brute_mass(q, k):
    """float64 loops: query ``t`` at position ``T - Tq + t`` sees keys ``0 .. T - Tq + t``;
    its softmax over them, summed onto each key, over queries and the group."""
    b, h, g, tq, d = q.shape
    total = k.shape[2]
    out = torch.zeros(b, h, total, dtype=torch.float64)
    for bb in range(b):
        for hh in range(h):
            for t in range(tq):
                seen = total - tq + t + 1
                logits = q[bb, hh, :, t].double() @ k[bb, hh, :seen].double().T / d ** 0.5  # [G, seen]
                out[bb, hh, :seen] += torch.softmax(logits, -1).sum(0)
    return out


@pytest.mark.parametrize("groups,num_keys,num_q,block_m,block_n,splits", [
    (1, 37, 37, 16, 16, 1),    # whole prompt, ragged tiles
    (3, 150, 4, 16, 16, None),  # one query tile: the keys split (2 of 80) by default
    (3, 100, 100, 16, 16, 4),  # 4 splits of 32 keys: late splits no early query reaches
    (3, 53, 53, 16, 16, 1),    # padding head (G_P = 4): 4 tokens per 16-row tile
    (3, 77, 20, 32, 16, 3),    # a later chunk: queries at the last 20 of 77 positions
    (4, 40, 1, 16, 32, None),  # one query (a decode-sized chunk)
    (16, 45, 45, 16, 16, 2),   # one token per tile
    (5, 64, 64, 64, 64, None),  # the default tiles, a single key tile
])
def test_token_mass_matches_brute_force(groups, num_keys, num_q, block_m, block_n, splits, rel_err):
    q, k = _inputs(groups, num_keys, num_q, seed=groups + num_q)
    want = _brute_mass(q, k)
    got = token_attention_mass_triton(q, k, block_m=block_m, block_n=block_n, key_splits=splits)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) < 1e-5
    assert (got.double() - want).abs().max() < 1e-4
    # every query's probabilities sum to one per head
    assert torch.allclose(got.double().sum(-1), torch.full((2, 2), float(groups * num_q), dtype=torch.float64))


def test_views_of_a_bigger_batch_and_cache(rel_err):
    """As h2o calls it in a batched prefill: one row's queries and the first ``T`` keys of a
    capacity-sized cache (non-contiguous views), head dim 64."""
    gen = torch.Generator().manual_seed(torch.initial_seed() + 3)
    q_all = torch.randn(3, 2, 3, 40, 64, generator=gen) * 2
    cache = torch.randn(3, 2, 96, 64, generator=gen) * 2
    q, k = q_all[1:2, :, :, :33], cache[1:2, :, :33]
    assert not k.is_contiguous()
    assert rel_err(token_attention_mass_triton(q, k, block_m=16, block_n=16), _brute_mass(q, k)) < 1e-5


def test_twin_matches_brute_force(rel_err):
    """The PyTorch twin (SDPA backward, queries split under MASS_CHUNK_BYTES) on the same inputs."""
    q, k = _inputs(3, 61, 25, seed=7)
    assert rel_err(twins.token_attention_mass_reference(q, k), _brute_mass(q, k)) < 1e-5


def test_block_mass_sums_token_mass_onto_blocks(rel_err):
    """``kernels.prefill_block_mass`` (CPU: the twin) against the brute force's tokens summed
    per block of 8, including a partial last block."""
    q, k = _inputs(2, 50, 50, seed=11)
    want = torch.nn.functional.pad(_brute_mass(q, k), (0, 6)).view(2, 2, 7, 8).sum(-1)
    assert rel_err(kernels.prefill_block_mass(q, k, 8), want) < 1e-5


def test_refusals():
    q, k = _inputs(2, 20, 20)
    with pytest.raises(SpardaError, match="at least as many keys"):
        token_attention_mass_triton(q, k[:, :, :10])
    with pytest.raises(SpardaError, match="same batch"):
        token_attention_mass_triton(q, k.double().float()[:1])
    with pytest.raises(SpardaError, match="power of two"):
        token_attention_mass_triton(q[..., :12], k[..., :12])
    with pytest.raises(SpardaError, match="fp16, bf16 or fp32"):
        token_attention_mass_triton(q.double(), k.double())


@pytest.mark.parametrize("name,options", [("h2o", {}), ("snapkv", {"snapkv_window": 6})])
def test_methods_through_the_kernel(name, options, monkeypatch):
    """h2o's accumulated mass and snapkv's votes with the Triton kernel in place of the CPU
    twin (the path CUDA takes), through tests/test_baselines.py's float64 brute force of the
    whole method: prefill rows of different lengths, then decode steps (head dim 16)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "test_baselines.py"
    spec = importlib.util.spec_from_file_location("baselines_brute_force", path)
    brute = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(brute)
    monkeypatch.setattr(brute, "D", 16)  # a head dim the kernel tiles
    calls = []

    def through_kernel(q, k):
        calls.append(q.shape)
        return token_attention_mass_triton(q, k, block_m=16, block_n=16)

    monkeypatch.setattr(twins, "token_attention_mass_reference", through_kernel)
    brute.check(name, 3, "select", options, seed=torch.initial_seed() % 2**31)
    assert calls  # the method's prefill went through the kernel


@pytest.mark.parametrize("q_dtype,k_dtype,on_kernel", [
    (torch.bfloat16, torch.bfloat16, True), (torch.float16, torch.float16, True),
    (torch.float32, torch.float32, False), (torch.bfloat16, torch.float32, False)])
def test_dispatch_keeps_fp32_on_the_sdpa_twin(q_dtype, k_dtype, on_kernel, monkeypatch):
    """CUDA dispatch (forced here): fp16/bf16 go to the Triton kernel, fp32 and mixed dtypes to
    the twin, faster in fp32 on the H200 (design §7);
    either way the masses equal the float64 brute force."""
    calls = []
    monkeypatch.setattr(kernels, "_on_triton", lambda *t: True)
    monkeypatch.setattr(kernels._attention_mass, "token_attention_mass_triton",
                        lambda q, k: calls.append("kernel") or twins.token_attention_mass_reference(q, k))
    q, k = _inputs(3, 40, 24, seed=5)
    q, k = q.to(q_dtype), k.to(k_dtype)
    got = kernels.token_attention_mass(q, k)
    assert calls == (["kernel"] if on_kernel else [])
    want = _brute_mass(q.float(), k.float())
    assert (got - want).abs().max() / want.abs().max() < 1e-2
