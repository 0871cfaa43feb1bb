"""RoPE + KV append + compressed-key update of one decode token in one Triton kernel
(design §3.1, §6 step 2); one program per (row, KV head).

Rounds like PyTorch in the storage dtype; a quantised cache (``QBITS`` 8/4) gets each token
quantised once by the rule of :func:`sparda.kernels.quant.quantize` (docs/kv_quant.md), the
ring and compressed keys the full-precision key. ``kv_dtype`` ``mixed`` (design §6.1): the
slot gets the exact token, the host store its int4 codes (``HQBITS``, quantised here) and
the hot pool the exact token at the block's pool slot (``POOL``). Twin:
:func:`sparda.kernels.twins.rope_append_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels import quant
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
def _round_half_even(x):
    """``x >= 0`` fp32 rounded to the nearest integer, ties to even (``torch.round``)."""
    f = tl.floor(x)
    frac = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((frac > 0.5) | ((frac == 0.5) & odd), f + 1.0, f)


@triton.jit
def _quantize(x, D: tl.constexpr, QBITS: tl.constexpr):
    """One head's ``x [D]`` fp32 quantised as :func:`sparda.kernels.quant.quantize`:
    ``(codes uint8 [D] or [D // 2], step, lo)``."""
    LEVELS: tl.constexpr = (1 << QBITS) - 1
    lo = tl.min(x, 0)
    step = tl.math.div_rn(tl.max(x, 0) - lo, tl.full((), LEVELS, tl.float32))
    safe = tl.where(step > 0, step, 1.0)  # a constant row: every code 0, dequantised to lo exactly
    q = _round_half_even(tl.math.div_rn(x - lo, tl.broadcast_to(safe, x.shape)))
    q = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.uint8)
    if QBITS == 4:
        even, odd = tl.split(tl.reshape(q, (D // 2, 2)))
        q = even | (odd << 4)
    return q, step, lo


@triton.jit
def _store_quantized(DATA, SCALE, dst, sdst, q, step, lo, ok, DQ: tl.constexpr):
    """Write codes ``q [DQ]`` at ``DATA + dst`` and ``(step, lo)`` at ``SCALE + sdst`` (if ``ok``)."""
    offs = tl.arange(0, DQ)
    tl.store(DATA + dst + offs, q, mask=(offs < DQ) & ok)
    two = tl.arange(0, 2)
    tl.store(SCALE + sdst + two, tl.where(two == 0, step, lo), mask=(two < 2) & ok)


@triton.jit
def _rope_append_kernel(
    QKV, COS, SIN, POS, QOUT, FOUT, KDST, VDST, KSC, VSC, RING, CK, HK, HV, HKS, HVS, TABLE, LENGTHS,
    PK, PV, PTABLE,
    stride_qkv, stride_cos,
    k_sb, k_sh, k_base, k_st, s_sb, s_sh, s_base, s_st, r_sb, r_sh, c_sb, c_sh,
    h_sh, h_page, h_st, hs_sh, hs_page, hs_st, t_row, p_sh, p_page, p_st, pt_row,
    H, C_CAP, NPOOL,
    G: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, NF: tl.constexpr,
    BS: tl.constexpr, KER: tl.constexpr, KER_P: tl.constexpr, STR: tl.constexpr,
    SLOT_MOD: tl.constexpr, USE_RING: tl.constexpr, HOST: tl.constexpr, LAST: tl.constexpr,
    QBITS: tl.constexpr, HQBITS: tl.constexpr, POOL: tl.constexpr,
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
    dst = b * k_sb + h * k_sh + k_base + tok * k_st
    if QBITS == 0:
        tl.store(KDST + dst + offs_d, k)
        tl.store(VDST + dst + offs_d, v)
        if HOST:  # the block's page (the block table); an unassigned block is not written
            page = tl.load(TABLE + b * t_row + pos // BS).to(tl.int64)
            if HQBITS == 0:
                hok = (offs_d < D) & (page >= 0)
                hdst = h * h_sh + tl.maximum(page, 0) * h_page + (pos % BS) * h_st + offs_d
                tl.store(HK + hdst, k, mask=hok)
                tl.store(HV + hdst, v, mask=hok)
            else:  # mixed: an exact slot, a quantised host store
                DQH: tl.constexpr = D if HQBITS == 8 else D // 2
                kq, k_step, k_lo = _quantize(k.to(tl.float32), D, HQBITS)
                vq, v_step, v_lo = _quantize(v.to(tl.float32), D, HQBITS)
                hdst = h * h_sh + tl.maximum(page, 0) * h_page + (pos % BS) * h_st
                hsdst = h * hs_sh + tl.maximum(page, 0) * hs_page + (pos % BS) * hs_st
                _store_quantized(HK, HKS, hdst, hsdst, kq, k_step, k_lo, page >= 0, DQH)
                _store_quantized(HV, HVS, hdst, hsdst, vq, v_step, v_lo, page >= 0, DQH)
    else:  # quantise once, store to the slot (or full cache) and the host store
        DQ: tl.constexpr = D if QBITS == 8 else D // 2
        kq, k_step, k_lo = _quantize(k.to(tl.float32), D, QBITS)
        vq, v_step, v_lo = _quantize(v.to(tl.float32), D, QBITS)
        sdst = b * s_sb + h * s_sh + s_base + tok * s_st
        _store_quantized(KDST, KSC, dst, sdst, kq, k_step, k_lo, pos >= 0, DQ)
        _store_quantized(VDST, VSC, dst, sdst, vq, v_step, v_lo, pos >= 0, DQ)
        if HOST:
            page = tl.load(TABLE + b * t_row + pos // BS).to(tl.int64)
            hok = page >= 0
            hdst = h * h_sh + tl.maximum(page, 0) * h_page + (pos % BS) * h_st
            hsdst = h * hs_sh + tl.maximum(page, 0) * hs_page + (pos % BS) * hs_st
            _store_quantized(HK, HKS, hdst, hsdst, kq, k_step, k_lo, hok, DQ)
            _store_quantized(HV, HVS, hdst, hsdst, vq, v_step, v_lo, hok, DQ)
    if POOL:  # mixed's hot pool: the exact token at pool slot (block mod NPOOL), through its table
        ppage = tl.load(PTABLE + b * pt_row + (pos // BS) % NPOOL).to(tl.int64)
        pok = (offs_d < D) & (ppage >= 0)
        pdst = h * p_sh + tl.maximum(ppage, 0) * p_page + (pos % BS) * p_st + offs_d
        tl.store(PK + pdst, k, mask=pok)
        tl.store(PV + pdst, v, mask=pok)
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
    else:  # unquantised full cache only (the launcher checks)
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


def _planes(buf):
    """``(data, scale or None, bits)`` of a cache buffer: a tensor (unquantised, bits 0)
    or a :class:`~sparda.kernels.quant.QuantizedKV`."""
    if isinstance(buf, quant.QuantizedKV):
        return buf.data, buf.scale, quant.BITS[buf.kv_dtype]
    return buf, None, 0


def _dst_strides(t: torch.Tensor, slot: int | None) -> tuple[int, int, int, int]:
    """``(row, head, base, token)`` strides of ``[B, H, T, x]`` or of slot ``slot`` of ``[B, H, S + 1, bs, x]``."""
    if slot is None:
        return t.stride(0), t.stride(1), 0, t.stride(2)
    return t.stride(0), t.stride(1), slot * t.stride(2), t.stride(3)


def rope_append_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                       q_out: torch.Tensor, f_out: torch.Tensor | None, k_dst, v_dst,
                       ck: torch.Tensor, *, num_kv_heads: int, group: int, num_f: int, block_size: int,
                       kernel: int, stride: int, slot: int | None = None, ring: torch.Tensor | None = None,
                       host: tuple | None = None, lengths: torch.Tensor | None = None,
                       pool: tuple | None = None) -> None:
    """Launch :func:`_rope_append_kernel` (see :func:`sparda.kernels.rope_append`).

    Raises:
        SpardaError: a quantised cache without ``ring``, K and V of different strides, a
            host store of another quantisation than a quantised cache, or a pool beside a
            quantised cache.
    """
    bsz = qkv.shape[0]
    d = q_out.shape[-1]
    kd, ks, bits = _planes(k_dst)
    vd, vs, _ = _planes(v_dst)
    if bits and ring is None:
        raise SpardaError("rope_append of a quantised cache needs the ring of full-precision keys")
    if kd.stride() != vd.stride() or (ks is not None and ks.stride() != vs.stride()):
        raise SpardaError("rope_append: K and V buffers must have the same strides")
    k_strides = _dst_strides(kd, slot)
    s_strides = _dst_strides(ks, slot) if ks is not None else (0, 0, 0, 0)
    use_ring = ring is not None
    ring_t = ring if use_ring else ck
    if host is not None:
        hk, hks, hbits = _planes(host[0])
        hv, hvs, _ = _planes(host[1])
        if hbits != bits and bits:
            raise SpardaError("rope_append: the host store and a quantised cache must hold the same kv_dtype")
        table = host[2]
        h_strides = (hk.stride(0), hk.stride(1), hk.stride(2))
        hs_strides = (hks.stride(0), hks.stride(1), hks.stride(2)) if hks is not None else (0,) * 3
    else:
        hk, hv, hks, hvs, table, hbits = kd, vd, ks, vs, pos, 0
        h_strides = hs_strides = (0, 0, 0)
    if pool is not None:
        if bits:
            raise SpardaError("rope_append: a hot pool goes with an unquantised cache (kv_dtype mixed)")
        pk, pv, ptable, npool = pool
        if pk.stride() != pv.stride() or pk.dtype != kd.dtype:
            raise SpardaError("rope_append: the pool's K and V must share strides and the cache's dtype")
        p_strides = (pk.stride(0), pk.stride(1), pk.stride(2), ptable.stride(0))
    else:
        pk, pv, ptable, npool = kd, vd, pos, 1
        p_strides = (0, 0, 0, 0)
    ksc, vsc = (ks, vs) if ks is not None else (kd, vd)
    hks, hvs = (hks, hvs) if hks is not None else (hk, hv)
    _rope_append_kernel[(bsz, num_kv_heads)](
        qkv, cos, sin, pos, q_out, f_out if f_out is not None else q_out, kd, vd, ksc, vsc, ring_t, ck,
        hk, hv, hks, hvs, table, lengths if lengths is not None else pos, pk, pv, ptable,
        qkv.stride(0), cos.stride(0),
        *k_strides, *s_strides, ring_t.stride(0), ring_t.stride(1), ck.stride(0), ck.stride(1),
        *h_strides, *hs_strides, table.stride(0), *p_strides,
        num_kv_heads, ck.shape[2], npool,
        G=group, G_P=next_pow2(max(group, 2)), D=d, NF=num_f, BS=block_size, KER=kernel,
        KER_P=next_pow2(max(kernel, 2)), STR=stride, SLOT_MOD=slot is not None, USE_RING=use_ring,
        HOST=host is not None, LAST=lengths is not None, QBITS=bits, HQBITS=hbits, POOL=pool is not None,
        num_warps=4)
