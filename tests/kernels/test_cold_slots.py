"""``--kv-dtype mixed``'s dequantisation of staged cold blocks into their slots (Triton,
under the interpreter) against :func:`sparda.kernels.quant.dequantize` applied slot by slot
in float64: slots that got a cold block hold its values, every other slot is untouched."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.errors import SpardaError  # noqa: E402
from sparda.kernels import quant, twins  # noqa: E402
from sparda.kernels.cold_slots import dequantize_cold_triton  # noqa: E402


def _case(kv_dtype, b, h, s, bs, d, gen):
    staged = [quant.QuantizedKV.quantize(torch.randn(b, h, s, bs, d, generator=gen) * 3, kv_dtype) for _ in range(2)]
    buf = [torch.randn(b, h, s + 1, bs, d, generator=gen) for _ in range(2)]  # the layer's slots, partial one last
    cold = torch.randint(0, 50, (b, h, s), generator=gen)
    cold[torch.rand(b, h, s, generator=gen) < 0.6] = -1  # most slots got nothing cold this step
    return staged, buf, cold


@pytest.mark.parametrize("kv_dtype,bs,d", [("int4", 16, 32), ("int4", 12, 16), ("int8", 16, 16)])
def test_cold_slots_match_dequantize_and_leave_other_slots(kv_dtype, bs, d):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    gen = torch.Generator().manual_seed(seed)
    b, h, s = 2, 3, 5
    staged, buf, cold = _case(kv_dtype, b, h, s, bs, d, gen)
    before = [x.clone() for x in buf]
    dequantize_cold_triton(staged[0], staged[1], buf[0][:, :, :s], buf[1][:, :, :s], cold)
    take = cold >= 0
    assert take.any() and (~take).any(), f"seed {seed}"
    for got, old, st in zip(buf, before, staged):
        want = quant.dequantize(st.data, st.scale.double(), kv_dtype, torch.float64)
        torch.testing.assert_close(got[:, :, :s][take].double(), want[take], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"seed {seed}: {m}")
        assert torch.equal(got[:, :, :s][~take], old[:, :, :s][~take]), f"seed {seed}"
        assert torch.equal(got[:, :, s], old[:, :, s]), f"seed {seed}"  # the partial slot
    # the twin (the CPU path) writes the same slots
    twin = [x.clone() for x in before]
    twins.dequantize_cold_reference(staged[0], staged[1], twin[0][:, :, :s], twin[1][:, :, :s], cold)
    for got, ref in zip(buf, twin):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


def test_cold_slots_bf16_destination_and_errors():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    staged, buf, cold = _case("int4", 1, 2, 3, 16, 16, gen)
    dst = [x.bfloat16() for x in buf]
    dequantize_cold_triton(staged[0], staged[1], dst[0][:, :, :3], dst[1][:, :, :3], cold)
    take = cold >= 0
    want = quant.dequantize(staged[0].data, staged[0].scale.double(), "int4", torch.float64)
    # one bf16 rounding (the interpreter's cast truncates, the GPU's rounds to nearest)
    torch.testing.assert_close(dst[0][:, :, :3][take].double(), want[take], rtol=2**-7, atol=1e-6)
    assert torch.equal(dst[1][:, :, :3][~take], buf[1].bfloat16()[:, :, :3][~take])
    with pytest.raises(SpardaError, match="do not stage"):
        dequantize_cold_triton(staged[0][:, :, :2], staged[1], dst[0][:, :, :3], dst[1][:, :, :3], cold)
    with pytest.raises(SpardaError, match="must be"):
        dequantize_cold_triton(staged[0], staged[1], dst[0][:, :, :3], dst[1][:, :, :3], cold[..., :2])
