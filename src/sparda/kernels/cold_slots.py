"""``--kv-dtype mixed``: dequantise the cold blocks staged for their GPU slots, one Triton
launch for K and V (design §6.1). Grid ``(S, B*H)``; a slot with no cold block does nothing.
Twin: :func:`sparda.kernels.twins.dequantize_cold_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.kernels._common import check_head_dim, next_pow2
from sparda.kernels.decode_attention import _dequantize


@triton.jit
def _cold_slots_kernel(
    KD, KS, VD, VS, KO, VO, COLD,
    stride_db, stride_dh, stride_ds, stride_dt, stride_sb, stride_ss_h, stride_ss, stride_st,
    stride_ob, stride_oh, stride_os, stride_ot, stride_vob, stride_voh, stride_vos, stride_vot,
    stride_cb, stride_ch, H, BS, D: tl.constexpr, BS_P: tl.constexpr, QBITS: tl.constexpr,
):
    s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    cold = tl.load(COLD + b * stride_cb + h * stride_ch + s)
    offs_t = tl.arange(0, BS_P)
    offs_d = tl.arange(0, D)
    tok_ok = (offs_t < BS) & (cold >= 0)
    offs_c = offs_d // 2 if QBITS == 4 else offs_d  # int4: two columns per byte
    src = b * stride_db + h * stride_dh + s * stride_ds + offs_t[:, None] * stride_dt + offs_c[None, :]
    scl = b * stride_sb + h * stride_ss_h + s * stride_ss + offs_t * stride_st
    ok = tok_ok[:, None]
    k = _dequantize(tl.load(KD + src, mask=ok, other=0), KS + scl, tok_ok, offs_d, QBITS)
    v = _dequantize(tl.load(VD + src, mask=ok, other=0), VS + scl, tok_ok, offs_d, QBITS)
    k_dst = KO + b * stride_ob + h * stride_oh + s * stride_os + offs_t[:, None] * stride_ot + offs_d[None, :]
    v_dst = VO + b * stride_vob + h * stride_voh + s * stride_vos + offs_t[:, None] * stride_vot + offs_d[None, :]
    tl.store(k_dst, k.to(KO.dtype.element_ty), mask=ok)
    tl.store(v_dst, v.to(VO.dtype.element_ty), mask=ok)


def dequantize_cold_triton(staged_k: quant.QuantizedKV, staged_v: quant.QuantizedKV, k_dst: torch.Tensor,
                           v_dst: torch.Tensor, cold: torch.Tensor) -> None:
    """Triton :func:`sparda.kernels.dequantize_cold_slots`.

    Raises:
        SpardaError: mismatched shapes, strides or dtypes.
    """
    b, h, s, bs, d = k_dst.shape
    check_head_dim(d)
    for name, st in (("staged_k", staged_k), ("staged_v", staged_v)):
        if st.data.shape != (b, h, s, bs, quant.packed_dim(d, st.kv_dtype)) or st.scale.shape != (b, h, s, bs, 2):
            raise SpardaError(f"{name}: codes {tuple(st.data.shape)} / scales {tuple(st.scale.shape)} do not "
                              f"stage [B, H, S, block, d] = {(b, h, s, bs, d)} slots")
    if (staged_k.data.stride() != staged_v.data.stride() or staged_k.scale.stride() != staged_v.scale.stride()
            or staged_k.kv_dtype != staged_v.kv_dtype):
        raise SpardaError("staged_k and staged_v must share their layout and kv_dtype")
    if v_dst.shape != k_dst.shape or v_dst.dtype != k_dst.dtype or cold.shape != (b, h, s):
        raise SpardaError(f"k_dst {tuple(k_dst.shape)}, v_dst {tuple(v_dst.shape)} and cold {tuple(cold.shape)} "
                          "must be [B, H, S, block, d], the same, and [B, H, S]")
    if k_dst.stride(-1) != 1 or v_dst.stride(-1) != 1 or staged_k.data.stride(-1) != 1 or cold.stride(-1) != 1:
        raise SpardaError("the head dim of the slots and codes, and cold's slot dim, must be contiguous")
    if b * h * s == 0:
        return
    dd, sc = staged_k.data.stride(), staged_k.scale.stride()
    if sc[-1] != 1:
        raise SpardaError("the (step, lo) pairs of the staged scales must be contiguous")
    ko, vo = k_dst.stride(), v_dst.stride()
    _cold_slots_kernel[(s, b * h)](
        staged_k.data, staged_k.scale, staged_v.data, staged_v.scale, k_dst, v_dst, cold,
        dd[0], dd[1], dd[2], dd[3], sc[0], sc[1], sc[2], sc[3],
        ko[0], ko[1], ko[2], ko[3], vo[0], vo[1], vo[2], vo[3], cold.stride(0), cold.stride(1), h, bs,
        D=d, BS_P=next_pow2(bs), QBITS=4 if staged_k.kv_dtype == "int4" else 8, num_warps=4)
