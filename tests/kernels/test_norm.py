"""Add + RMSNorm and SiLU * mul kernels (interpreter) against the model's own modules."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.kernels.norm import add_rmsnorm_triton, silu_mul_triton  # noqa: E402
from sparda.model.llama import MLP, RMSNorm  # noqa: E402


@pytest.mark.parametrize("n", [96, 128, 1000])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm_matches_model_rmsnorm(n, with_delta, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    x = torch.randn(3, n, generator=gen) * 3
    delta = torch.randn(3, n, generator=gen) if with_delta else None
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n, generator=gen)
    resid = x + delta if with_delta else x
    expect = norm(resid)
    xs = x.clone()
    out = torch.empty(3, n)
    add_rmsnorm_triton(xs, delta, norm.weight.data, 1e-5, out)
    torch.testing.assert_close(xs, resid, rtol=0, atol=0)
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("inner", [64, 300])
def test_silu_mul_matches_model_mlp(inner, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    mlp = MLP(32, inner)
    h = torch.randn(4, 32, generator=gen)
    gate_up = torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], -1).detach()
    out = torch.empty(4, inner)
    silu_mul_triton(gate_up.contiguous(), out)
    expect = (mlp.act(mlp.gate_proj(h)) * mlp.up_proj(h)).detach()
    torch.testing.assert_close(out, expect, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mlp.down_proj(out), mlp(h).detach(), rtol=1e-5, atol=1e-6)
