"""The offload runtime's slot diff in one Triton kernel, no sort, no host read (design §6 step 4).

One program per (row, KV head) writes ``load``, the updated ``slot_map``, ``attn_ids``, the
optional compact list and the counters of :func:`sparda.kernels.slot_diff`; membership is an
``[S, W]`` comparison matrix. Twin: :func:`sparda.kernels.twins.slot_diff_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels._common import next_pow2


@triton.jit
def _slot_diff_kernel(
    IDS, SLOT_MAP, POS, LOAD, ATTN, HITS, MISSES, READ, VALID, CBLK, CSLOT, PROTECT,
    H, W, S, C,
    BS: tl.constexpr, W_P: tl.constexpr, S_P: tl.constexpr, C_P: tl.constexpr, COUNT: tl.constexpr,
    COMPACT: tl.constexpr, PROTECTED: tl.constexpr,
):
    pid = tl.program_id(0)
    b = pid // H
    row = pid.to(tl.int64)
    pos = tl.load(POS + b).to(tl.int64)
    cur = pos // BS
    offs_w = tl.arange(0, W_P)
    offs_s = tl.arange(0, S_P)
    s_ok = offs_s < S
    ids = tl.load(IDS + row * W + offs_w, mask=offs_w < W, other=-1).to(tl.int64)
    wanted = (ids >= 0) & (ids != cur)
    held = tl.load(SLOT_MAP + row * S + offs_s, mask=s_ok, other=-1)
    same = (held[:, None] == ids[None, :]) & wanted[None, :] & (held[:, None] >= 0)  # [S_P, W_P]
    hit_slot = tl.max(same.to(tl.int32), 1) > 0
    resident = tl.max(same.to(tl.int32), 0) > 0
    miss = wanted & (~resident)
    miss_rank = tl.cumsum(miss.to(tl.int32), 0) - 1
    empty = s_ok & (held < 0)
    stale = s_ok & (held >= 0) & (~hit_slot)
    if PROTECTED:  # the early diff (design §6.2): the layer's last selection keeps its slots
        kept = tl.load(PROTECT + row * (S + 1) + offs_s, mask=s_ok, other=-1) >= 0
        stale = stale & (~kept)
    n_empty = tl.sum(empty.to(tl.int32), 0)
    slot_rank = tl.where(empty, tl.cumsum(empty.to(tl.int32), 0) - 1,
                         tl.where(stale, n_empty + tl.cumsum(stale.to(tl.int32), 0) - 1, -1))
    take = (slot_rank[:, None] == miss_rank[None, :]) & miss[None, :] & (slot_rank[:, None] >= 0)
    load = tl.max(tl.where(take, ids[None, :], -1), 1)
    new_map = tl.where(load >= 0, load, held)
    selected = hit_slot | (load >= 0)
    tl.store(LOAD + row * S + offs_s, load, mask=s_ok)
    tl.store(SLOT_MAP + row * S + offs_s, new_map, mask=s_ok)
    tl.store(ATTN + row * (S + 1) + offs_s, tl.where(selected, new_map, -1).to(ATTN.dtype.element_ty), mask=s_ok)
    tl.store(ATTN + row * (S + 1) + S, cur.to(ATTN.dtype.element_ty))
    if COMPACT:  # selected slots in slot order (k-th selected slot -> entry k), then -1, the current block last
        pick = selected & s_ok
        rank = tl.cumsum(pick.to(tl.int32), 0) - 1
        n_sel = tl.sum(pick.to(tl.int32), 0)
        tl.store(CBLK + row * C + rank, new_map.to(CBLK.dtype.element_ty), mask=pick)
        tl.store(CSLOT + row * C + rank, offs_s.to(CSLOT.dtype.element_ty), mask=pick)
        offs_c = tl.arange(0, C_P)
        tail = (offs_c >= n_sel) & (offs_c < C - 1)
        tl.store(CBLK + row * C + offs_c, tl.full([C_P], -1, tl.int32).to(CBLK.dtype.element_ty), mask=tail)
        tl.store(CSLOT + row * C + offs_c, tl.zeros([C_P], tl.int32).to(CSLOT.dtype.element_ty), mask=tail)
        tl.store(CBLK + row * C + C - 1, cur.to(CBLK.dtype.element_ty))
        tl.store(CSLOT + row * C + C - 1, (cur * 0 + S).to(CSLOT.dtype.element_ty))  # the partial slot
    if COUNT:
        tl.atomic_add(HITS + b, tl.sum(hit_slot.to(tl.int64), 0))
        if PROTECTED:  # misses beyond the open slots are not loaded: count the loads
            tl.atomic_add(MISSES + b, tl.sum((load >= 0).to(tl.int64), 0))
        else:
            tl.atomic_add(MISSES + b, tl.sum(miss.to(tl.int64), 0))
        tl.atomic_add(READ + b, tl.sum((ids >= 0).to(tl.int64), 0))
        tl.atomic_add(VALID + b, cur + 1)


def slot_diff_triton(ids: torch.Tensor, slot_map: torch.Tensor, pos: torch.Tensor, block_size: int,
                     num_blocks: int, load: torch.Tensor, attn_ids: torch.Tensor, counters=None,
                     compact=None, protect=None) -> None:
    """Triton :func:`sparda.kernels.slot_diff`, in place.

    Raises:
        SpardaError: shapes, dtypes or devices that do not match.
    """
    check_slot_diff(ids, slot_map, pos, load, attn_ids, counters, compact, protect)
    bsz, heads, width = ids.shape
    slots = slot_map.shape[-1]
    count = counters is not None
    hits, misses, read, valid = counters if count else (pos, pos, pos, pos)
    c_blk, c_slot = compact if compact is not None else (attn_ids, attn_ids)
    c_width = c_blk.shape[-1] if compact is not None else 1
    _slot_diff_kernel[(bsz * heads,)](
        ids, slot_map, pos, load, attn_ids, hits, misses, read, valid, c_blk, c_slot,
        protect if protect is not None else attn_ids, heads, width, slots, c_width,
        BS=block_size, W_P=next_pow2(max(width, 2)), S_P=next_pow2(max(slots, 2)),
        C_P=next_pow2(max(c_width, 2)), COUNT=count, COMPACT=compact is not None, PROTECTED=protect is not None,
        num_warps=4 if slots * width <= 4096 else 8)


def check_slot_diff(ids, slot_map, pos, load, attn_ids, counters, compact=None, protect=None) -> None:
    """Validate :func:`sparda.kernels.slot_diff` operands.

    Raises:
        SpardaError: naming the operand that does not match.
    """
    if ids.dim() != 3 or slot_map.dim() != 3 or ids.shape[:2] != slot_map.shape[:2]:
        raise SpardaError(f"ids [B, H, W] and slot_map [B, H, S] must share B and H, got "
                          f"{tuple(ids.shape)} and {tuple(slot_map.shape)}")
    bsz, heads, slots = slot_map.shape
    if ids.shape[-1] > slots + 1:
        raise SpardaError(f"{ids.shape[-1]} selected ids cannot fit {slots} slots plus the partial one")
    if slot_map.dtype != torch.int64 or load.dtype != torch.int64 or load.shape != slot_map.shape:
        raise SpardaError("slot_map and load must be int64 [B, H, S]")
    if attn_ids.shape != (bsz, heads, slots + 1) or attn_ids.dtype not in (torch.int32, torch.int64):
        raise SpardaError(f"attn_ids must be int32/int64 [B, H, S + 1], got {tuple(attn_ids.shape)}")
    if pos.shape != (bsz,):
        raise SpardaError(f"pos must be [B]={bsz}, got {tuple(pos.shape)}")
    if compact is not None:
        c_blk, c_slot = compact
        if (c_blk.shape != c_slot.shape or c_blk.dim() != 3 or c_blk.shape[:2] != (bsz, heads)
                or c_blk.shape[-1] < min(ids.shape[-1], slots) + 1
                or c_blk.dtype not in (torch.int32, torch.int64) or c_slot.dtype not in (torch.int32, torch.int64)):
            raise SpardaError(f"compact attention ids must be two int32/int64 [B, H, C] tensors with C >= "
                              f"min(W, S) + 1 = {min(ids.shape[-1], slots) + 1}, got {tuple(c_blk.shape)} "
                              f"and {tuple(c_slot.shape)}")
    if protect is not None and (protect.shape != (bsz, heads, slots + 1)
                                or protect.dtype not in (torch.int32, torch.int64)):
        raise SpardaError(f"protect must be int32/int64 [B, H, S + 1] (a layer's attn_ids), got "
                          f"{tuple(protect.shape)}")
    tensors = [ids, slot_map, load, attn_ids, pos] + list(counters or ()) + list(compact or ()) + (
        [protect] if protect is not None else [])
    if any(not t.is_contiguous() for t in tensors):
        raise SpardaError("slot diff operands must be contiguous")
    if counters is not None and any(c.shape != (bsz,) or c.dtype != torch.int64 for c in counters):
        raise SpardaError("slot diff counters must be int64 [B]")
