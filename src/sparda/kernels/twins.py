"""PyTorch twins of the kernels whose interface differs from :mod:`reference`, built from it.

The CPU runtime and the dispatch fallbacks of :mod:`sparda.kernels` call these; no Triton.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import quant, reference
from sparda.kernels._common import check_head_dim, tl_float_dtype_ok


def ids_to_block_mask(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[..., W]`` block ids (-1 padded) -> ``[..., N]`` bool mask; ids outside ``[0, N)`` drop."""
    ids = block_ids.long()
    ids = torch.where((ids < 0) | (ids >= num_blocks), num_blocks, ids)
    mask = torch.zeros(*ids.shape[:-1], num_blocks + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, ids, True)[..., :num_blocks]


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               block_ids: torch.Tensor, kv_len: torch.Tensor,
                               block_size: int) -> torch.Tensor:
    """Twin of :func:`sparda.kernels.decode_attention` on unquantised K/V (no shape checks)."""
    num_blocks = -(-k.shape[2] // block_size)
    mask = ids_to_block_mask(block_ids, num_blocks)[:, :, None]  # [B, H, 1, N]
    q_pos = (kv_len.long() - 1).view(-1, 1)
    out = reference.block_sparse_attention(q[:, :, :, None], k, v, mask, q_pos, kv_len.long(), block_size)
    return out[:, :, :, 0]


def default_width(num_blocks: int, cfg: SelectionConfig) -> int:
    """Id-list width (blocks) that holds every decode selection: ``min(N, max(budget_blocks,
    ceil(dense_len / block_size)))``, at least 1 (design §3.4, §3.6)."""
    dense_blocks = -(-cfg.dense_len // cfg.block_size)
    return max(1, min(num_blocks, max(cfg.budget_blocks, dense_blocks)))


def check_selection_shapes(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, ck_len) -> None:
    """Check decode-selection inputs (any head dim): ``query [B, H, G, d]`` or ``[B, H, d]`` and
    ``ck [B, H, C, d]`` fp16/bf16/fp32, ``q_pos [B]``, ``ck_len`` ``None`` or ``[B]``.

    Raises:
        SpardaError: a bad dtype, rank or shape.
    """
    tl_float_dtype_ok(query, "query")
    tl_float_dtype_ok(ck, "ck")
    if query.dim() not in (3, 4):
        raise SpardaError(f"query must be [B, H, G, d] (query-based) or [B, H, d] (Forecast), "
                          f"got {tuple(query.shape)}")
    if ck.dim() != 4 or ck.shape[:2] != query.shape[:2] or ck.shape[-1] != query.shape[-1]:
        raise SpardaError(f"ck must be [B, H, C, d] matching query {tuple(query.shape)}, got {tuple(ck.shape)}")
    if q_pos.shape != (query.shape[0],):
        raise SpardaError(f"q_pos must be [B]={query.shape[0]} (decode position), got {tuple(q_pos.shape)}")
    if ck_len is not None and ck_len.shape != (query.shape[0],):
        raise SpardaError(f"ck_len must be [B], got {tuple(ck_len.shape)}")


def check_selection_inputs(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, ck_len) -> None:
    """:func:`check_selection_shapes` plus a head dim the kernel tiles.

    Raises:
        SpardaError: as :func:`check_selection_shapes`, or a head dim not a power of two >= 16.
    """
    check_selection_shapes(query, ck, q_pos, ck_len)
    check_head_dim(query.shape[-1])


def decode_block_scores_reference(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                                  num_blocks: int, cfg: SelectionConfig,
                                  ck_len: torch.Tensor | None = None) -> torch.Tensor:
    """Twin of ``selection.decode_block_scores_triton``: ``[B, H, N]`` fp32 block scores (design §3.2-3.3, §4).

    Raises:
        SpardaError: via :func:`check_selection_shapes`.
    """
    check_selection_shapes(query, ck, q_pos, ck_len)
    if ck_len is not None:  # row b sees only its first ck_len[b] compressed keys
        rows = [decode_block_scores_reference(query[i:i + 1], ck[i:i + 1, :, :int(ck_len[i])],
                                              q_pos[i:i + 1], num_blocks, cfg)
                for i in range(query.shape[0])]
        return torch.cat(rows, 0)
    pos = q_pos.view(-1, 1).long()
    if query.dim() == 3:
        scores = reference.forecast_scores(query[:, :, None], ck, pos, cfg.kernel_size, cfg.kernel_stride)
    else:
        scores = reference.query_group_scores(query[:, :, :, None], ck, pos, cfg.kernel_size,
                                              cfg.kernel_stride)
    return reference.pool_to_blocks(scores, num_blocks, cfg)[:, :, 0]


def mass_logit_scale(query: torch.Tensor) -> float | None:
    """What decode block scores are for the top-p mass (design §3.12): ``1 / sqrt(d)`` logits
    for Forecast queries ``[B, H, d]`` (the scale the Forecast is trained at, design §5),
    ``None`` (group-summed probabilities) for queries ``[B, H, G, d]``."""
    return 1.0 / math.sqrt(query.shape[-1]) if query.dim() == 3 else None


def select_decode_reference(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                            num_blocks: int, cfg: SelectionConfig, *,
                            ck_len: torch.Tensor | None = None, width: int | None = None,
                            return_mask: bool = False):
    """Twin of :func:`sparda.kernels.select_decode_blocks` (design §3.2-3.4, §3.12).

    Raises:
        SpardaError: via :func:`check_selection_shapes`.
    """
    scores = decode_block_scores_reference(query, ck, q_pos, num_blocks, cfg, ck_len)
    mask = reference.select_blocks(scores[:, :, None], q_pos.view(-1, 1).long(), cfg, adaptive=True,
                                   logit_scale=mass_logit_scale(query))[:, :, 0]
    width = default_width(num_blocks, cfg) if width is None else int(width)
    ids = reference.block_mask_to_indices(mask, width).to(torch.int32)
    return (ids, mask) if return_mask else ids


def slots_attention_reference(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                              block_ids: torch.Tensor, slot_ids: torch.Tensor,
                              kv_len: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`sparda.kernels.decode_attention_slots` (fp32 math, no
    shape checks; ``slot_ids`` clamped to ``[0, S)``)."""
    bsz, heads, groups, d = q.shape
    block_size = k_slots.shape[3]
    slot_ids = slot_ids.expand(block_ids.shape).long().clamp(0, k_slots.shape[2] - 1)
    idx = slot_ids[..., None, None].expand(-1, -1, -1, block_size, d)
    k_sel = torch.gather(k_slots.float(), 2, idx).flatten(2, 3)  # [B, H, W*bs, d]
    v_sel = torch.gather(v_slots.float(), 2, idx).flatten(2, 3)
    pos = block_ids.long()[..., None] * block_size + torch.arange(block_size, device=q.device)
    ok = (block_ids[..., None] >= 0) & (pos < kv_len.view(-1, 1, 1, 1))
    logits = torch.einsum("bhgd,bhkd->bhgk", q.float(), k_sel) / math.sqrt(d)
    logits = logits.masked_fill(~ok.flatten(2)[:, :, None], float("-inf"))
    probs = torch.softmax(logits, -1).nan_to_num(0.0)
    return torch.einsum("bhgk,bhkd->bhgd", probs, v_sel).to(q.dtype)


def diff_slots(slot_map: torch.Tensor, want: torch.Tensor, protect: torch.Tensor | None = None):
    """Diff a selection against the resident slots (design §6, step 4; static shapes).

    Args:
        slot_map: ``[B, H, S]`` int64 block per slot, ``-1`` empty.
        want: ``[B, H, N]`` bool, at most ``S`` per row (without ``protect``).
        protect: optional ``[B, H, S]`` bool: held slots never replaced (design §6.2's early
            diff); misses beyond the open slots are then not loaded.
    Returns:
        ``(load [B, H, S] int64 (-1 none), new_map [B, H, S], hits [B, H], misses [B, H])``.
    """
    b, h, s = slot_map.shape
    n = want.shape[-1]
    dev = slot_map.device
    ext = torch.cat([want, want.new_zeros(b, h, 1)], -1)  # index n = "empty"
    held = torch.where(slot_map < 0, n, slot_map)
    hit_slot = torch.gather(ext, -1, held)  # [B,H,S] slot's block is wanted
    resident = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev).scatter_(-1, held, True)[..., :n]
    miss = want & ~resident
    hits = hit_slot.sum(-1)
    misses = miss.sum(-1)
    # k-th miss (ascending block id) -> k-th replaceable slot (empty first, then stale)
    blocks = torch.arange(n, device=dev)
    miss_ids = torch.sort(torch.where(miss, blocks, n), dim=-1).values
    if n < s:
        miss_ids = torch.cat([miss_ids, miss_ids.new_full((b, h, s - n), n)], -1)
    miss_ids = miss_ids[..., :s]
    slots = torch.arange(s, device=dev)
    keep = hit_slot if protect is None else hit_slot | (protect & (slot_map >= 0))
    priority = torch.where(keep, 2, torch.where(slot_map < 0, 0, 1)) * s + slots
    order = torch.sort(priority, dim=-1).indices  # replaceable slots first
    load_sorted = torch.where(torch.gather(keep, -1, order), n, miss_ids)
    load = torch.full_like(slot_map, n).scatter_(-1, order, load_sorted)
    load = torch.where(load >= n, -1, load)
    new_map = torch.where(load >= 0, load, slot_map)
    return load, new_map, hits, misses


class HotSplit(NamedTuple):
    """``kv_dtype`` ``mixed``'s hot-pool operands of :func:`sparda.kernels.slot_diff` (design §6.1).

    ``hot [B, H, N]`` bool and ``last [B, H, N]`` int64: the layer's hot-block state
    (:class:`~sparda.cache.hot.HotBlocks`), updated by the hot rule when ``update`` (a fetch),
    only read otherwise (the early diff, design §6.2). ``pool_load, cold_load [B, H, S]``
    int64 out: per slot, the pool slot (``block mod P``) of a hot block it loads, the block id
    of a cold one (``-1`` elsewhere). ``pool_misses [B]`` int64: the hot loads, added to.
    ``pool_blocks, hot_steps, local_blocks``: ``P``, ``R >= 1``, ``L``.
    """

    hot: torch.Tensor
    last: torch.Tensor
    pool_load: torch.Tensor
    cold_load: torch.Tensor
    pool_misses: torch.Tensor
    pool_blocks: int
    hot_steps: int
    local_blocks: int
    update: bool


def hot_rule_update(hot: torch.Tensor, last: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, block_size: int,
                    local_blocks: int, pool_blocks: int, hot_steps: int) -> torch.Tensor:
    """One decode step of the hot rule (design §6.1) on ``hot, last [B, H, N]``, in place:
    ``ids [B, H, W]`` selected (``-1`` padded), ``pos [B]``. Returns the demoted blocks
    ``[B, H, N]`` bool."""
    num_blocks = hot.shape[-1]
    p = pos.view(-1, 1, 1)
    cur = p // block_size
    n = torch.arange(num_blocks, device=hot.device).view(1, 1, -1)
    picked = ids_to_block_mask(ids, num_blocks) | ((n > cur - local_blocks) & (n <= cur))
    last.copy_(torch.where(picked, p, last))
    keep = (hot & (p - last < hot_steps) & (n > cur - pool_blocks)) | (n == cur)
    demoted = hot & ~keep
    hot.copy_(keep)
    return demoted


def hot_split(hot: torch.Tensor, load: torch.Tensor, pool_blocks: int, block_size: int,
              pos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``load [B, H, S]`` (block per slot, ``-1`` none) split by ``hot [B, H, N]`` into
    ``(pool, cold)``: the pool slot of each hot block, the block id of each cold one (``-1``
    elsewhere). ``pos [B]``: an early copy, before its step's hot rule (design §6.2): a hot
    block whose pool slot the current block takes (``n <= c - P``) counts as cold."""
    is_hot = torch.gather(hot, -1, load.clamp(min=0)) & (load >= 0)
    if pos is not None:
        is_hot &= load > (pos // block_size).view(-1, 1, 1) - pool_blocks
    return torch.where(is_hot, load % pool_blocks, -1), torch.where(is_hot | (load < 0), -1, load)


def slot_diff_reference(ids: torch.Tensor, slot_map: torch.Tensor, pos: torch.Tensor, block_size: int,
                        num_blocks: int, load: torch.Tensor, attn_ids: torch.Tensor, counters=None,
                        compact=None, protect=None, hot: HotSplit | None = None) -> None:
    """Twin of :func:`sparda.kernels.slot_diff` (in place, no shape checks)."""
    if hot is not None and hot.update:  # the hot rule first: a demoted block's slot is emptied
        demoted = hot_rule_update(hot.hot, hot.last, ids, pos, block_size, hot.local_blocks, hot.pool_blocks,
                                  hot.hot_steps)
        slot_map.masked_fill_(torch.gather(demoted, -1, slot_map.clamp(min=0)) & (slot_map >= 0), -1)
    cur = (pos // block_size).view(-1, 1, 1)
    want = ids_to_block_mask(ids, num_blocks)
    want &= torch.arange(num_blocks, device=ids.device).view(1, 1, -1) != cur
    kept = None if protect is None else protect[..., :-1] >= 0
    new_load, new_map, hits, misses = diff_slots(slot_map, want, kept)
    if protect is not None:  # misses beyond the open slots are not loaded: count the loads
        misses = (new_load >= 0).sum(-1)
    ext = torch.cat([want, want.new_zeros(*want.shape[:2], 1)], -1)
    selected = torch.gather(ext, -1, torch.where(new_map < 0, num_blocks, new_map))
    load.copy_(new_load)
    slot_map.copy_(new_map)
    attn_ids[..., :-1] = torch.where(selected, new_map, -1).to(attn_ids.dtype)
    attn_ids[..., -1] = cur.view(-1, 1).to(attn_ids.dtype)
    if compact is not None:
        c_blk, c_slot = compact
        width, s = c_blk.shape[-1], slot_map.shape[-1]
        picked = attn_ids[..., :-1] >= 0
        order = torch.sort((~picked).to(torch.int8), dim=-1, stable=True).indices[..., :width - 1]
        keep = torch.gather(picked, -1, order)
        blocks = torch.where(keep, torch.gather(attn_ids[..., :-1], -1, order), -1)
        c_blk.fill_(-1)
        c_slot.zero_()
        n = blocks.shape[-1]
        c_blk[..., :n] = blocks.to(c_blk.dtype)
        c_slot[..., :n] = torch.where(keep, order, 0).to(c_slot.dtype)
        c_blk[..., -1] = cur.view(-1, 1).to(c_blk.dtype)
        c_slot[..., -1] = s
    if counters is not None:
        c_hits, c_misses, c_read, c_valid = counters
        c_hits.add_(hits.sum(-1))
        c_misses.add_(misses.sum(-1))
        c_read.add_((ids >= 0).sum((-1, -2)))
        c_valid.add_((cur.view(-1) + 1) * ids.shape[1])
    if hot is not None:
        pool, cold = hot_split(hot.hot, load, hot.pool_blocks, block_size, None if hot.update else pos)
        hot.pool_load.copy_(pool)
        hot.cold_load.copy_(cold)
        hot.pool_misses.add_((pool >= 0).sum((1, 2)))


def rope_append_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                          q_out: torch.Tensor, f_out: torch.Tensor | None, k_dst, v_dst, ck: torch.Tensor, *,
                          num_kv_heads: int, group: int, num_f: int, block_size: int, kernel: int, stride: int,
                          slot: int | None = None, ring: torch.Tensor | None = None, host=None,
                          lengths: torch.Tensor | None = None, pool=None) -> None:
    """Twin of :func:`sparda.kernels.rope_append` (in place, no shape checks)."""
    bsz = qkv.shape[0]
    d = q_out.shape[-1]
    hq, hk = num_kv_heads * group, num_kv_heads
    parts = qkv.view(bsz, hq + (2 + num_f) * hk, 1, d)  # [B, heads, 1, d]
    c, s = cos.view(bsz, 1, 1, d), sin.view(bsz, 1, 1, d)
    q_out.copy_(reference.apply_rope(parts[:, :hq], c, s)[:, :, 0])
    k = reference.apply_rope(parts[:, hq:hq + hk], c, s)[:, :, 0]  # [B, H, d]
    v = parts[:, hq + hk:hq + 2 * hk, 0]
    if num_f:
        f = reference.apply_rope(parts[:, hq + 2 * hk:], c, s)[:, :, 0]
        f_out.copy_(f.view(bsz, num_f, hk, d))
    if isinstance(k_dst, quant.QuantizedKV):  # as stored: quantised once, from the storage-dtype values
        k_tok = quant.QuantizedKV.quantize(k.to(q_out.dtype), k_dst.kv_dtype)
        v_tok = quant.QuantizedKV.quantize(v.to(q_out.dtype), k_dst.kv_dtype)
    else:
        k_tok, v_tok = k.to(k_dst.dtype), v.to(v_dst.dtype)
    rows = torch.arange(bsz, device=qkv.device)
    if slot is None:
        k_dst[rows, :, pos] = k_tok
        v_dst[rows, :, pos] = v_tok
    else:
        k_dst[rows, :, slot, pos % block_size] = k_tok
        v_dst[rows, :, slot, pos % block_size] = v_tok
    if host is not None:  # the host store may live in (pinned) host memory; pages by the table
        if isinstance(host[0], quant.QuantizedKV) and not isinstance(k_tok, quant.QuantizedKV):  # mixed
            hk_tok = quant.QuantizedKV.quantize(k.to(q_out.dtype), host[0].kv_dtype)
            hv_tok = quant.QuantizedKV.quantize(v.to(q_out.dtype), host[0].kv_dtype)
        else:
            hk_tok, hv_tok = k_tok, v_tok
        _write_host_token(host[0], host[1], host[2], rows, pos // block_size, pos % block_size, hk_tok, hv_tok)
    if pool is not None:  # mixed's hot pool: block n at pool slot n mod P
        _write_host_token(pool[0], pool[1], pool[2], rows, pos // block_size % pool[3], pos % block_size,
                          k_tok, v_tok)
    if ring is not None:
        ring[rows, :, pos % kernel] = k.to(ring.dtype)
    reference.update_compressed_keys(ck, k_dst if ring is None else ring, rows, pos, kernel, stride,
                                     ring=ring is not None)
    if lengths is not None:
        lengths.copy_(pos + 1)


def _write_host_token(dst_k, dst_v, table: torch.Tensor, rows: torch.Tensor, column: torch.Tensor,
                      offset: torch.Tensor, k_tok, v_tok) -> None:
    """``dst[:, table[rows, column], offset] = tok`` (``[H, pages, bs, d]`` host planes; tokens
    ``[B, H, d]``) for the rows whose page is ``>= 0``; ``dst`` may live in host memory."""
    hd = dst_k.device
    page = table.to(hd)[rows.to(hd), column.to(hd)].long()
    ok = (page >= 0).nonzero(as_tuple=True)[0]
    off = offset.to(hd)[ok]
    dst_k[:, page[ok], off] = k_tok[ok.to(k_tok.device)].to(hd).transpose(0, 1)
    dst_v[:, page[ok], off] = v_tok[ok.to(v_tok.device)].to(hd).transpose(0, 1)


def add_rmsnorm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                          out: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`sparda.kernels.add_rmsnorm`."""
    if delta is not None:
        x.add_(delta)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return out.copy_(weight * xf.to(x.dtype))


def silu_mul_reference(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`sparda.kernels.silu_mul`."""
    n = out.shape[-1]
    return out.copy_(torch.nn.functional.silu(gate_up[..., :n]) * gate_up[..., n:])


def check_prefill_selection_inputs(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                                   need_pow2_head_dim: bool = False) -> None:
    """Check prefill-selection inputs: ``query [B, H, G, Tq, d]`` or ``[B, H, Tq, d]`` and ``ck
    [B, H, C, d]`` fp16/bf16/fp32, integer ``q_pos [B, Tq]``.

    Raises:
        SpardaError: a bad dtype, rank or shape, or with ``need_pow2_head_dim`` a head dim
            not a power of two >= 16.
    """
    tl_float_dtype_ok(query, "query")
    tl_float_dtype_ok(ck, "ck")
    if query.dim() not in (4, 5):
        raise SpardaError(f"prefill query must be [B, H, G, Tq, d] (query-based) or [B, H, Tq, d] "
                          f"(Forecast), got {tuple(query.shape)}")
    if ck.dim() != 4 or ck.shape[:2] != query.shape[:2] or ck.shape[-1] != query.shape[-1]:
        raise SpardaError(f"ck must be [B, H, C, d] matching query {tuple(query.shape)}, got {tuple(ck.shape)}")
    if q_pos.shape != (query.shape[0], query.shape[-2]) or q_pos.is_floating_point():
        raise SpardaError(f"q_pos must be integer [B, Tq] = [{query.shape[0]}, {query.shape[-2]}], "
                          f"got {tuple(q_pos.shape)} {q_pos.dtype}")
    if need_pow2_head_dim:
        check_head_dim(query.shape[-1])


def select_prefill_reference(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                             num_blocks: int, cfg: SelectionConfig, *, lookahead: bool = False,
                             chunk: int = 1024, return_scores: bool = False):
    """Twin of :func:`sparda.kernels.select_prefill_blocks`, ``chunk`` query tokens at a time.

    Returns:
        ``mask [B, H, Tq, N]`` bool; with ``return_scores``, ``(mask, scores [B, H, Tq, N] fp32)``.
    Raises:
        SpardaError: via :func:`check_prefill_selection_inputs`.
    """
    check_prefill_selection_inputs(query, ck, q_pos)
    masks, all_scores = [], []
    q_pos = q_pos.long()
    for start in range(0, q_pos.shape[1], chunk):
        pos = q_pos[:, start:start + chunk]
        seen = pos - 1 if lookahead else pos
        if query.dim() == 5:
            scores = reference.query_group_scores(query[..., start:start + chunk, :], ck, seen,
                                                  cfg.kernel_size, cfg.kernel_stride)
        else:
            scores = reference.forecast_scores(query[..., start:start + chunk, :], ck, seen,
                                               cfg.kernel_size, cfg.kernel_stride)
        blocks = reference.pool_to_blocks(scores, num_blocks, cfg)
        masks.append(reference.select_blocks(blocks, pos, cfg))
        if return_scores:
            all_scores.append(blocks)
    shape = (*ck.shape[:2], 0, num_blocks)
    mask = torch.cat(masks, 2) if masks else torch.zeros(shape, dtype=torch.bool, device=ck.device)
    if return_scores:
        return mask, (torch.cat(all_scores, 2) if all_scores else torch.zeros(shape, device=ck.device))
    return mask


def dequantize_cold_reference(staged_k, staged_v, k_dst: torch.Tensor, v_dst: torch.Tensor,
                              cold: torch.Tensor) -> None:
    """Twin of :func:`sparda.kernels.dequantize_cold_slots` (dequantises the whole staging buffer)."""
    take = (cold >= 0)[..., None, None]
    for dst, staged in ((k_dst, staged_k), (v_dst, staged_v)):
        dst.copy_(torch.where(take, staged.dequantize(dst.dtype), dst))


#: off CUDA, bytes of the fp32 ``[H * G, queries, T]`` probabilities that SDPA's math
#: backend holds per call of :func:`token_attention_mass_reference` (queries are split to stay under it)
MASS_CHUNK_BYTES = 1 << 28


def token_attention_mass_reference(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Twin of :func:`sparda.kernels.token_attention_mass`, fp32.

    Column sums ``P^T 1`` are the gradient SDPA's backward gives ``V`` for an output gradient
    of ones, so no ``[G, Tq, T]`` probabilities exist; off CUDA queries go
    :data:`MASS_CHUNK_BYTES` at a time.
    """
    b, h, g, t, d = q.shape
    total = k.shape[-2]
    if t == 0:
        return q.new_zeros(b, h, total, dtype=torch.float32)
    step = t if q.device.type == "cuda" else max(1, MASS_CHUNK_BYTES // (4 * b * h * g * total))
    columns = []
    keys = torch.arange(total, device=q.device)
    with torch.inference_mode(False), torch.enable_grad():  # SDPA's backward: normal tensors
        kf = k.float().repeat_interleave(g, dim=1)  # [B, H*G, T, d]
        for start in range(0, t, step):
            stop = min(t, start + step)
            qf = q[..., start:stop, :].reshape(b, h * g, stop - start, d).float().clone()
            v = torch.zeros(b, h * g, total, d, dtype=torch.float32, device=q.device, requires_grad=True)
            if stop - start == total:  # the whole prompt in one call: plain causal
                out = torch.nn.functional.scaled_dot_product_attention(qf, kf, v, is_causal=True)
            else:
                pos = torch.arange(total - t + start, total - t + stop, device=q.device)
                allowed = keys.view(1, -1) <= pos.view(-1, 1)  # [Tq_chunk, T]
                out = torch.nn.functional.scaled_dot_product_attention(qf, kf, v, attn_mask=allowed)
            out.backward(torch.ones_like(out))
            columns.append(v.grad[..., 0])
    return torch.stack(columns).sum(0).view(b, h, g, total).sum(2)
