"""The offload runtime's slot diff in one Triton kernel, no sort, no host read (design §6 step 4).

One program per (row, KV head) writes ``load``, the updated ``slot_map``, ``attn_ids``, the
optional compact list and the counters of :func:`sparda.kernels.slot_diff`; membership is an
``[S, W]`` comparison matrix. With ``hot`` (``kv_dtype`` ``mixed``, design §6.1) the same
program runs the hot rule first (its slots' demotions from the old state, before the diff),
splits the loads into pool and cold lists, and then rewrites the layer's hot state: one pass
over the ``N`` blocks for the local window and the ``R``-step rule, then the selected blocks.
Twin: :func:`sparda.kernels.twins.slot_diff_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparda.errors import SpardaError
from sparda.kernels._common import next_pow2


#: ``mode`` of the hot-pool part of the kernel: none, split only (the early diff), rule + split (a fetch)
HOT_NONE, HOT_SPLIT, HOT_RULE = 0, 1, 2


@triton.jit
def _slot_diff_kernel(
    IDS, SLOT_MAP, POS, LOAD, ATTN, HITS, MISSES, READ, VALID, CBLK, CSLOT, PROTECT,
    HOT, LAST, PLOAD, CLOAD, PCOUNT,
    H, W, S, C, N, NPOOL, R, L,
    BS: tl.constexpr, W_P: tl.constexpr, S_P: tl.constexpr, C_P: tl.constexpr, COUNT: tl.constexpr,
    COMPACT: tl.constexpr, PROTECTED: tl.constexpr, HOT_MODE: tl.constexpr, N_T: tl.constexpr,
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
    if HOT_MODE == 2:  # the hot rule's verdict on the held blocks (old state): a demoted one leaves its slot
        hv = held >= 0
        h_hot = tl.load(HOT + row * N + held, mask=hv, other=0) != 0
        h_last = tl.load(LAST + row * N + held, mask=hv, other=0)
        h_sel = tl.max(((held[:, None] == ids[None, :]) & (ids[None, :] >= 0)).to(tl.int32), 1) > 0
        h_last = tl.where(h_sel | ((held > cur - L) & (held <= cur)), pos, h_last)
        h_keep = (h_hot & (pos - h_last < R) & (held > cur - NPOOL)) | (held == cur)
        held = tl.where(hv & h_hot & (~h_keep), -1, held)
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
    if HOT_MODE > 0:  # a loaded block is selected: hot after the rule iff hot before and n > c - P
        lv = load >= 0
        l_hot = lv & (tl.load(HOT + row * N + load, mask=lv, other=0) != 0) & (load > cur - NPOOL)
        tl.store(PLOAD + row * S + offs_s, tl.where(l_hot, load % NPOOL, -1), mask=s_ok)
        tl.store(CLOAD + row * S + offs_s, tl.where(lv & (~l_hot), load, -1), mask=s_ok)
        tl.atomic_add(PCOUNT + b, tl.sum(l_hot.to(tl.int64), 0))
    if HOT_MODE == 2:  # the new hot state: every block by the window and R-step rule, then the selected ones
        i_ok = (ids >= 0) & (ids < N)
        i_hot = tl.load(HOT + row * N + ids, mask=i_ok, other=0) != 0
        tl.debug_barrier()  # every read of the old state above precedes the writes below
        for n0 in range(0, N, N_T):
            n = n0 + tl.arange(0, N_T)
            n_ok = n < N
            old_hot = tl.load(HOT + row * N + n, mask=n_ok, other=0) != 0
            last = tl.load(LAST + row * N + n, mask=n_ok, other=0)
            last = tl.where((n > cur - L) & (n <= cur), pos, last)
            keep = (old_hot & (pos - last < R) & (n > cur - NPOOL)) | (n == cur)
            tl.store(LAST + row * N + n, last, mask=n_ok)
            tl.store(HOT + row * N + n, keep.to(tl.uint8), mask=n_ok)
        tl.debug_barrier()  # a selected block's entry below overwrites the pass's
        i_keep = (i_hot & (ids > cur - NPOOL)) | (ids == cur)  # last = pos: p - last < R for R >= 1
        tl.store(LAST + row * N + ids, tl.zeros([W_P], tl.int64) + pos, mask=i_ok)
        tl.store(HOT + row * N + ids, i_keep.to(tl.uint8), mask=i_ok)
    if COUNT:
        tl.atomic_add(HITS + b, tl.sum(hit_slot.to(tl.int64), 0))
        if PROTECTED:  # misses beyond the open slots are not loaded: count the loads
            tl.atomic_add(MISSES + b, tl.sum((load >= 0).to(tl.int64), 0))
        else:
            tl.atomic_add(MISSES + b, tl.sum(miss.to(tl.int64), 0))
        tl.atomic_add(READ + b, tl.sum((ids >= 0).to(tl.int64), 0))
        tl.atomic_add(VALID + b, cur + 1)


#: blocks of the hot state one pass of the hot rule reads at a time
HOT_TILE = 1024


def slot_diff_triton(ids: torch.Tensor, slot_map: torch.Tensor, pos: torch.Tensor, block_size: int,
                     num_blocks: int, load: torch.Tensor, attn_ids: torch.Tensor, counters=None,
                     compact=None, protect=None, hot=None) -> None:
    """Triton :func:`sparda.kernels.slot_diff`, in place.

    Raises:
        SpardaError: shapes, dtypes or devices that do not match.
    """
    check_slot_diff(ids, slot_map, pos, load, attn_ids, counters, compact, protect, hot)
    bsz, heads, width = ids.shape
    slots = slot_map.shape[-1]
    count = counters is not None
    hits, misses, read, valid = counters if count else (pos, pos, pos, pos)
    c_blk, c_slot = compact if compact is not None else (attn_ids, attn_ids)
    c_width = c_blk.shape[-1] if compact is not None else 1
    if hot is not None:
        mode = HOT_RULE if hot.update else HOT_SPLIT
        state = (hot.hot.view(torch.uint8), hot.last, hot.pool_load, hot.cold_load, hot.pool_misses)
        n, rule = hot.hot.shape[-1], (hot.pool_blocks, hot.hot_steps, hot.local_blocks)
    else:
        mode, state, n, rule = HOT_NONE, (load,) * 5, 1, (1, 1, 1)
    _slot_diff_kernel[(bsz * heads,)](
        ids, slot_map, pos, load, attn_ids, hits, misses, read, valid, c_blk, c_slot,
        protect if protect is not None else attn_ids, *state, heads, width, slots, c_width, n, *rule,
        BS=block_size, W_P=next_pow2(max(width, 2)), S_P=next_pow2(max(slots, 2)),
        C_P=next_pow2(max(c_width, 2)), COUNT=count, COMPACT=compact is not None, PROTECTED=protect is not None,
        HOT_MODE=mode, N_T=min(HOT_TILE, next_pow2(max(n, 2))), num_warps=4 if slots * width <= 4096 else 8)


def check_slot_diff(ids, slot_map, pos, load, attn_ids, counters, compact=None, protect=None, hot=None) -> None:
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
    if hot is not None:
        check_hot_split(hot, bsz, heads, slots)


def check_hot_split(hot, bsz: int, heads: int, slots: int) -> None:
    """Validate the ``hot`` operands (:class:`~sparda.kernels.twins.HotSplit`) of a slot diff.

    Raises:
        SpardaError: naming the operand that does not match.
    """
    if (hot.hot.dtype != torch.bool or hot.hot.dim() != 3 or hot.hot.shape[:2] != (bsz, heads)
            or hot.last.shape != hot.hot.shape or hot.last.dtype != torch.int64):
        raise SpardaError(f"hot state must be bool and int64 [B, H, N] with B, H = {bsz}, {heads}, got "
                          f"{tuple(hot.hot.shape)} {hot.hot.dtype} and {tuple(hot.last.shape)} {hot.last.dtype}")
    for name in ("pool_load", "cold_load"):
        t = getattr(hot, name)
        if t.shape != (bsz, heads, slots) or t.dtype != torch.int64:
            raise SpardaError(f"hot {name} must be int64 [B, H, S] = {(bsz, heads, slots)}, got {tuple(t.shape)}")
    if hot.pool_misses.shape != (bsz,) or hot.pool_misses.dtype != torch.int64:
        raise SpardaError("hot pool_misses must be int64 [B]")
    if hot.pool_blocks < 1 or hot.hot_steps < 1 or hot.local_blocks < 1:
        raise SpardaError(f"hot pool_blocks, hot_steps, local_blocks must be >= 1, got "
                          f"{hot.pool_blocks}, {hot.hot_steps}, {hot.local_blocks}")
    if any(not t.is_contiguous() for t in hot[:5]):
        raise SpardaError("hot slot diff operands must be contiguous")
