"""PyTorch twins of the kernels whose interface differs from :mod:`reference`.

Everything here is built from :mod:`sparda.kernels.reference` (decode selection, decode
attention from a block-id list) or is a small fp32 twin of its own (the slot-buffer
decode and the incremental compressed-key update). No Triton: the CPU runtime and the
dispatch fallbacks in :mod:`sparda.kernels` use these directly.
"""

from __future__ import annotations

import math

import torch

from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import reference
from sparda.kernels._common import check_head_dim, tl_float_dtype_ok


def ids_to_block_mask(block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``[..., W]`` integer block ids (-1 padded) -> ``[..., N]`` bool mask; ids outside ``[0, N)`` drop."""
    ids = block_ids.long()
    ids = torch.where((ids < 0) | (ids >= num_blocks), num_blocks, ids)
    mask = torch.zeros(*ids.shape[:-1], num_blocks + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter_(-1, ids, True)[..., :num_blocks]


def decode_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               block_ids: torch.Tensor, kv_len: torch.Tensor,
                               block_size: int) -> torch.Tensor:
    """Decode attention over a block-id list via ``reference.block_sparse_attention``.

    The query sits at position ``kv_len - 1``; ``q [B, H, G, d]`` -> ``[B, H, G, d]`` in
    ``q``'s dtype. ``k, v [B, H, T, d]``; ``block_ids [B, H, W]`` int (-1 padded);
    ``kv_len [B]`` int (tokens); ``block_size`` in tokens. No shape checks (the Triton twin
    raises SpardaError on a mismatch).
    """
    num_blocks = -(-k.shape[2] // block_size)
    mask = ids_to_block_mask(block_ids, num_blocks)[:, :, None]  # [B, H, 1, N]
    q_pos = (kv_len.long() - 1).view(-1, 1)
    out = reference.block_sparse_attention(q[:, :, :, None], k, v, mask, q_pos, kv_len.long(), block_size)
    return out[:, :, :, 0]


def default_width(num_blocks: int, cfg: SelectionConfig) -> int:
    """Static id-list width (blocks) that holds every decode selection (no host sync).

    Returns ``min(num_blocks, max(budget_blocks, ceil(dense_len / block_size)))``, at
    least 1 (design §3.4, §3.6). The budget bounds a sparse selection; the dense fallback (``t + 1 < dense_len``)
    selects at most ``ceil(dense_len / block_size)`` blocks.
    """
    dense_blocks = -(-cfg.dense_len // cfg.block_size)
    return max(1, min(num_blocks, max(cfg.budget_blocks, dense_blocks)))


def check_selection_shapes(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, ck_len) -> None:
    """Check the decode-selection inputs of one query token per sequence (design §3.2, §4),
    for any head dim (what the PyTorch twins need).

    Args:
        query: ``[B, H, G, d]`` (query-based) or ``[B, H, d]`` (Forecast), fp16/bf16/fp32.
        ck: ``[B, H, C, d]`` compressed keys, fp16/bf16/fp32.
        q_pos: ``[B]`` integer token position. ck_len: ``None`` or ``[B]`` integer.
    Raises:
        SpardaError: a bad dtype, rank or shape mismatch.
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
    """:func:`check_selection_shapes` plus the head dim the Triton selection kernel tiles.

    Raises:
        SpardaError: as :func:`check_selection_shapes`, or a head dim that is not a power
            of two >= 16 (the dispatch in :mod:`sparda.kernels` sends those to the twins).
    """
    check_selection_shapes(query, ck, q_pos, ck_len)
    check_head_dim(query.shape[-1])


def decode_block_scores_reference(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                                  num_blocks: int, cfg: SelectionConfig,
                                  ck_len: torch.Tensor | None = None) -> torch.Tensor:
    """PyTorch twin of :func:`decode_block_scores_triton`, built from ``reference`` (design §3.2-3.3, §4).

    Args: ``query [B, H, G, d]`` (softmax
    scores summed over the group) or ``[B, H, d]`` (Forecast raw dot products),
    ``ck [B, H, C, d]``, ``q_pos [B]`` int, ``num_blocks`` ``N``, ``ck_len`` ``[B]`` or None.
    Returns:
        ``[B, H, N]`` fp32 block scores.
    Raises:
        SpardaError: via :func:`check_selection_shapes` (any head dim is accepted).
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


def select_decode_reference(query: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                            num_blocks: int, cfg: SelectionConfig, *,
                            ck_len: torch.Tensor | None = None, width: int | None = None,
                            return_mask: bool = False):
    """Decode selection from the reference functions: score, pool, select, to ids (design §3.2-3.4).

    Args as :func:`decode_block_scores_reference`; ``width`` defaults to
    :func:`default_width`.
    Returns:
        ``ids [B, H, width]`` int32, ascending, -1 padded; with ``return_mask``,
        ``(ids, mask [B, H, N] bool)``.
    Raises:
        SpardaError: via :func:`check_selection_shapes` (any head dim is accepted).
    """
    scores = decode_block_scores_reference(query, ck, q_pos, num_blocks, cfg, ck_len)
    mask = reference.select_blocks(scores[:, :, None], q_pos.view(-1, 1).long(), cfg)[:, :, 0]
    width = default_width(num_blocks, cfg) if width is None else int(width)
    ids = reference.block_mask_to_indices(mask, width).to(torch.int32)
    return (ids, mask) if return_mask else ids


def slots_attention_reference(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                              block_ids: torch.Tensor, slot_ids: torch.Tensor,
                              kv_len: torch.Tensor) -> torch.Tensor:
    """PyTorch twin of :func:`decode_attention_slots_triton` (fp32 math, design §3.5, §6).

    Args:
        q: ``[B, H, G, d]``. k_slots, v_slots: ``[B, H, S, block_size, d]``.
        block_ids: ``[B, H, W]`` int logical block ids (-1 = skip).
        slot_ids: ``[B, H, W]`` int slot of each block (broadcastable; clamped to ``[0, S)``).
        kv_len: ``[B]`` int valid tokens per sequence.
    Returns:
        ``[B, H, G, d]`` in ``q``'s dtype; rows that see no key are 0. No shape checks.
    """
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


def update_compressed_keys_reference(k: torch.Tensor, ck: torch.Tensor, kv_len: torch.Tensor,
                                     kernel: int, stride: int) -> None:
    """PyTorch twin of :func:`update_compressed_keys_triton` (in place, no host sync, design §3.1).

    ``k [B, H, T, d]``, ``ck [B, H, C_max, d]`` (written in place, its dtype),
    ``kv_len [B]`` int tokens including the new one; ``kernel``/``stride`` in tokens.
    No shape checks.
    """
    n = kv_len.long() - kernel
    j = n.clamp(min=0) // stride
    do = (n >= 0) & (n.clamp(min=0) % stride == 0) & (j < ck.shape[2])
    rows = (n.clamp(min=0).view(-1, 1) + torch.arange(kernel, device=k.device)).clamp(max=k.shape[2] - 1)
    idx = rows.view(-1, 1, kernel, 1).expand(-1, k.shape[1], -1, k.shape[3])
    win = torch.gather(k, 2, idx).float().mean(2).to(ck.dtype)  # [B, H, d]
    jc = j.clamp(max=ck.shape[2] - 1).view(-1, 1, 1, 1).expand(-1, k.shape[1], 1, k.shape[3])
    old = torch.gather(ck, 2, jc)[:, :, 0]
    new = torch.where(do.view(-1, 1, 1), win, old)
    ck.scatter_(2, jc, new[:, :, None])
