"""RoPE + KV append + compressed-key update of one decode token, in one Triton kernel.

Input is the output row of a layer's stacked projection GEMM (design §6 "QKV(+F)"):
``qkv [B, (H_q + 2 H_kv + n_f H_kv) * d]`` = queries, keys, values, then ``n_f`` Forecast
heads per KV head. One program per (row, KV head):

* applies RoPE (half-split, ``x * cos + rotate_half(x) * sin``, rounded to the storage
  dtype after each operation as PyTorch does) to the ``G`` queries, the key and the
  Forecast heads, and writes the rotated queries and Forecast heads out;
* writes the key and value at the token's position: into the full cache
  ``[B, H, T, d]`` (device cache, resident layers) or into the partial slot of the
  offload slot buffer ``[B, H, S + 1, bs, d]`` (position ``pos % bs`` of slot ``S``);
  optionally also into the host store ``[B, H, N, bs, d]`` (pinned, through UVA);
* keeps the compressed keys current (design §3.1): when the token completes window
  ``j`` (``(pos + 1 - kernel) % stride == 0``), ``ck[j]`` becomes the fp32 mean of the
  window's ``kernel`` keys, read from a ring of the last ``kernel`` keys (offload) or
  from the full cache; the ring is updated too;
* at the last layer, sets ``lengths[b] = pos + 1``.

The PyTorch twin is :func:`sparda.kernels.twins.rope_append_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.kernels._common import next_pow2


@triton.jit
def _rope(X, offs, offs_rot, sign, c, s, mask, DT: tl.constexpr):
    """RoPE of the vectors at ``X + offs`` (last dim the head dim), rounded like PyTorch in ``DT``."""
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    xr = tl.load(X + offs_rot, mask=mask, other=0.0).to(tl.float32) * sign
    a = (x * c).to(DT).to(tl.float32)
    b = (xr * s).to(DT).to(tl.float32)
    return (a + b).to(DT)


@triton.jit
def _rope_append_kernel(
    QKV, COS, SIN, POS, QOUT, FOUT, KDST, VDST, RING, CK, HK, HV, LENGTHS,
    stride_qkv, stride_cos,
    k_sb, k_sh, k_base, k_st, r_sb, r_sh, c_sb, c_sh, h_sb, h_sh, h_blk,
    H, C_CAP,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, NF: tl.constexpr,
    BS: tl.constexpr, KER: tl.constexpr, KER_P: tl.constexpr, STR: tl.constexpr,
    SLOT_MOD: tl.constexpr, USE_RING: tl.constexpr, HOST: tl.constexpr, LAST: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    DT = QOUT.dtype.element_ty
    pos = tl.load(POS + b).to(tl.int64)
    offs_d = tl.arange(0, D)
    half = D // 2
    offs_rot = (offs_d + half) % D
    sign = tl.where(offs_d < half, -1.0, 1.0)
    c = tl.load(COS + b * stride_cos + offs_d).to(tl.float32)
    s = tl.load(SIN + b * stride_cos + offs_d).to(tl.float32)
    row = QKV + b * stride_qkv
    hq = H * G
    # queries of this KV head's group: [G_P, D]
    offs_g = tl.arange(0, G_P)
    g_ok = offs_g[:, None] < G
    q_off = (h * G + offs_g[:, None]) * D
    q = _rope(row, q_off + offs_d[None, :], q_off + offs_rot[None, :], sign[None, :], c[None, :], s[None, :],
              g_ok, DT)
    tl.store(QOUT + b * hq * D + q_off + offs_d[None, :], q, mask=g_ok)
    # key, value
    k_off = (hq + h) * D
    k = _rope(row, k_off + offs_d, k_off + offs_rot, sign, c, s, offs_d < D, DT)
    v = tl.load(row + (hq + H + h) * D + offs_d).to(DT)
    for i in range(NF):  # Forecast heads: [B, NF, H, D]
        f_off = (hq + 2 * H + i * H + h) * D
        f = _rope(row, f_off + offs_d, f_off + offs_rot, sign, c, s, offs_d < D, DT)
        tl.store(FOUT + ((b * NF + i) * H + h) * D + offs_d, f)
    if SLOT_MOD:
        tok = pos % BS
    else:
        tok = pos
    dst = b * k_sb + h * k_sh + k_base + tok * k_st + offs_d
    tl.store(KDST + dst, k)
    tl.store(VDST + dst, v)
    if HOST:
        hdst = b * h_sb + h * h_sh + (pos // BS) * h_blk + (pos % BS) * D + offs_d
        tl.store(HK + hdst, k)
        tl.store(HV + hdst, v)
    # compressed key completed by this token (design §3.1): mean of the window's keys
    done = pos + 1 - KER
    j = tl.maximum(done, 0) // STR
    ready = (done >= 0) & (done % STR == 0) & (j < C_CAP)
    offs_w = tl.arange(0, KER_P)
    w_ok = offs_w < KER
    if USE_RING:
        slot = pos % KER
        ring = RING + b * r_sb + h * r_sh
        old = tl.load(ring + offs_w[:, None] * D + offs_d[None, :], mask=w_ok[:, None], other=0.0).to(tl.float32)
        win = tl.where((offs_w == slot)[:, None], k.to(tl.float32)[None, :], old)
        tl.store(ring + slot * D + offs_d, k)
    else:
        wpos = j * STR + offs_w  # window positions, the last one is pos
        prev = w_ok & (wpos != pos) & ready
        old = tl.load(KDST + b * k_sb + h * k_sh + wpos[:, None] * k_st + offs_d[None, :],
                      mask=prev[:, None], other=0.0).to(tl.float32)
        win = tl.where((wpos == pos)[:, None], k.to(tl.float32)[None, :], old)
    mean = tl.sum(tl.where(w_ok[:, None], win, 0.0), 0) / KER
    tl.store(CK + b * c_sb + h * c_sh + j * D + offs_d, mean.to(DT), mask=(offs_d < D) & ready)
    if LAST:
        if h == 0:
            tl.store(LENGTHS + b, pos + 1)


def rope_append_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                       q_out: torch.Tensor, f_out: torch.Tensor | None, k_dst: torch.Tensor, v_dst: torch.Tensor,
                       ck: torch.Tensor, *, num_kv_heads: int, group: int, num_f: int, block_size: int,
                       kernel: int, stride: int, slot: int | None = None, ring: torch.Tensor | None = None,
                       host: tuple[torch.Tensor, torch.Tensor] | None = None,
                       lengths: torch.Tensor | None = None) -> None:
    """Launch :func:`_rope_append_kernel` (see :func:`sparda.kernels.rope_append`)."""
    bsz = qkv.shape[0]
    d = q_out.shape[-1]
    if slot is None:  # full cache [B, H, T, d]
        k_sb, k_sh, k_st, k_base = k_dst.stride(0), k_dst.stride(1), k_dst.stride(2), 0
    else:  # slot buffer [B, H, S + 1, bs, d]: the partial slot
        k_sb, k_sh, k_st, k_base = k_dst.stride(0), k_dst.stride(1), k_dst.stride(3), slot * k_dst.stride(2)
    use_ring = ring is not None
    ring_t = ring if use_ring else ck
    hk, hv = host if host is not None else (k_dst, v_dst)
    h_strides = (hk.stride(0), hk.stride(1), hk.stride(2)) if host is not None else (0, 0, 0)
    _rope_append_kernel[(bsz, num_kv_heads)](
        qkv, cos, sin, pos, q_out, f_out if f_out is not None else q_out, k_dst, v_dst, ring_t, ck, hk, hv,
        lengths if lengths is not None else pos,
        qkv.stride(0), cos.stride(0),
        k_sb, k_sh, k_base, k_st, ring_t.stride(0), ring_t.stride(1), ck.stride(0), ck.stride(1), *h_strides,
        num_kv_heads, ck.shape[2],
        G=group, G_P=next_pow2(max(group, 2)), D=d, NF=num_f, BS=block_size, KER=kernel,
        KER_P=next_pow2(max(kernel, 2)), STR=stride, SLOT_MOD=slot is not None, USE_RING=use_ring,
        HOST=host is not None, LAST=lengths is not None, num_warps=4)
