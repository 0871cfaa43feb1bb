"""The restricted KL loss of Forecast training (design §5) and selection recall.

Restriction: the teacher's selected blocks under the §3.4 rule, minus the forced
init/local blocks, expanded to the compressed keys that overlap them; the two
distributions are compared on those entries plus one *rest bucket* holding all
remaining mass, so both restricted distributions sum to 1.
"""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref


def free_selection(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """The top-k blocks the §3.4 rule picks beyond the forced ones: ``[B, H, Tq, N]`` bool.

    ``block_scores [B, H, Tq, N]`` (any float dtype, larger is better); ``q_pos [B, Tq]`` int64.
    Raises ValueError (from ``reference.select_blocks``) for ``N >= 2^24``.
    """
    mask = ref.select_blocks(block_scores, q_pos, cfg)
    return mask & ~ref.forced_blocks(q_pos, block_scores.shape[-1], cfg)


def restriction(teacher: torch.Tensor, q_pos: torch.Tensor, num_tokens: int,
                cfg: SelectionConfig) -> torch.Tensor:
    """Compressed-key entries compared by the loss: ``[B, H, Tq, C]`` bool (design §5, Restriction).

    Args: ``teacher [B, H, Tq, C]`` fp32 (non-negative, 0 at invisible keys); ``q_pos [B, Tq]``
    int64; ``num_tokens`` the key length ``T`` in tokens (sets the block count).
    """
    num_blocks = -(-num_tokens // cfg.block_size)
    blocks = ref.pool_to_blocks(teacher, num_blocks, cfg)
    kept = free_selection(blocks, q_pos, cfg)
    overlap = ref.block_overlap(teacher.shape[-1], num_blocks, cfg, teacher.device).float()  # [C,N]
    entries = torch.einsum("bhqn,cn->bhqc", kept.float(), overlap) > 0
    vis = ref.compressed_visible(q_pos, teacher.shape[-1], cfg.kernel_size, cfg.kernel_stride)[:, None]
    return entries & vis


def restricted(dist: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """``dist [..., C]`` restricted to ``entries`` (bool, same shape) plus a rest bucket:
    ``[..., C+1]`` in ``dist``'s dtype; rows sum to ``dist``'s row sum (1 for a distribution,
    0 for an all-0 row), design §5."""
    kept = dist * entries
    rest = (dist.sum(-1, keepdim=True) - kept.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([kept, rest], dim=-1)


def student_distribution(f: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                         cfg: SelectionConfig, layer: int) -> torch.Tensor:
    """Student ``softmax(F . K~ / sqrt(d))`` over the compressed keys the Forecast sees at
    inference, fp32 (design §5).

    Args: ``f [B, H, Tq, d]`` Forecast queries (RoPE applied); ``ck [B, H, C, d]`` of the
    scored ``layer``; ``q_pos [B, Tq]`` int64 query positions. Visibility follows the
    lookahead rule (:func:`sparda.kernels.reference.lookahead_pos`): for ``layer >= 1`` the
    windows complete before the query's token, for layer 0 those complete at it.
    Returns: ``[B, H, Tq, C]`` fp32 (0 at invisible keys; all-0 rows where none is visible).
    """
    pos = ref.lookahead_pos(q_pos, layer)
    logits = ref.forecast_scores(f, ck, pos, cfg.kernel_size, cfg.kernel_stride) / f.shape[-1] ** 0.5
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def restricted_kl(teacher: torch.Tensor, student: torch.Tensor, entries: torch.Tensor,
                  reduction: str = "mean") -> torch.Tensor:
    """``KL(teacher || student)`` on the restricted entries + rest bucket (design §5).

    Inputs ``[B, H, Tq, C]``; returns a fp32 scalar: averaged over rows (batch, KV heads,
    query tokens) for ``reduction="mean"``, summed for ``"sum"`` (callers that score query
    tokens in chunks divide the sum by the total row count themselves).
    """
    t = restricted(teacher.float(), entries)
    s = restricted(student.float(), entries)
    kl = torch.xlogy(t, t) - torch.xlogy(t, s.clamp_min(1e-30))
    return kl.sum(-1).sum() if reduction == "sum" else kl.sum(-1).mean()


def recall(selected: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction (0-1, a host float; syncs) of ``target`` blocks (``[..., N]`` bool) that
    ``selected`` (same shape, bool) also holds; 1.0 when ``target`` is empty (design §8 recall)."""
    total = target.sum().item()
    return (selected & target).sum().item() / total if total else 1.0
