"""The restricted KL loss of Forecast training and selection recall (design §5, §8)."""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref


def free_selection(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """``[B, H, Tq, N]`` bool: the top-k blocks of the §3.4 rule beyond the forced ones (ValueError
    for ``N >= 2^24``)."""
    mask = ref.select_blocks(block_scores, q_pos, cfg)
    return mask & ~ref.forced_blocks(q_pos, block_scores.shape[-1], cfg)


def restriction(teacher: torch.Tensor, q_pos: torch.Tensor, num_tokens: int,
                cfg: SelectionConfig) -> torch.Tensor:
    """``[B, H, Tq, C]`` bool entries the loss compares (design §5, Restriction): ``teacher [B, H,
    Tq, C]`` fp32, ``q_pos [B, Tq]`` int64, ``num_tokens`` the key length ``T``."""
    num_blocks = -(-num_tokens // cfg.block_size)
    blocks = ref.pool_to_blocks(teacher, num_blocks, cfg)
    kept = free_selection(blocks, q_pos, cfg)
    overlap = ref.block_overlap(teacher.shape[-1], num_blocks, cfg, teacher.device).float()  # [C,N]
    entries = torch.einsum("bhqn,cn->bhqc", kept.float(), overlap) > 0
    vis = ref.compressed_visible(q_pos, teacher.shape[-1], cfg.kernel_size, cfg.kernel_stride)[:, None]
    return entries & vis


def restricted(dist: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
    """``dist [..., C]`` on ``entries`` plus the rest bucket: ``[..., C + 1]``, rows keep their sum (design §5)."""
    kept = dist * entries
    rest = (dist.sum(-1, keepdim=True) - kept.sum(-1, keepdim=True)).clamp_min(0.0)
    return torch.cat([kept, rest], dim=-1)


def student_distribution(f: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                         cfg: SelectionConfig, layer: int, ahead: int = 1) -> torch.Tensor:
    """Student ``softmax(F . K~ / sqrt(d))`` under the lookahead rule (design §4, §5, §6.2): ``f [B, H,
    Tq, d]`` (RoPE applied) from ``ahead`` layers before ``layer``, ``ck [B, H, C, d]`` of ``layer``,
    ``q_pos [B, Tq]`` int64 -> ``[B, H, Tq, C]`` fp32, 0 at invisible keys."""
    pos = ref.lookahead_pos(q_pos, layer, ahead)
    logits = ref.forecast_scores(f, ck, pos, cfg.kernel_size, cfg.kernel_stride) / f.shape[-1] ** 0.5
    return torch.softmax(logits, dim=-1).nan_to_num(0.0)


def restricted_kl(teacher: torch.Tensor, student: torch.Tensor, entries: torch.Tensor,
                  reduction: str = "mean") -> torch.Tensor:
    """``KL(teacher || student)`` on the restricted entries + rest bucket (design §5): inputs
    ``[B, H, Tq, C]`` -> fp32 scalar, mean over rows (``"mean"``) or their sum (``"sum"``)."""
    t = restricted(teacher.float(), entries)
    s = restricted(student.float(), entries)
    kl = torch.xlogy(t, t) - torch.xlogy(t, s.clamp_min(1e-30))
    return kl.sum(-1).sum() if reduction == "sum" else kl.sum(-1).mean()


def recall(selected: torch.Tensor, target: torch.Tensor) -> float:
    """Fraction (host float, syncs) of ``target`` blocks ``[..., N]`` bool also in ``selected``;
    1.0 if ``target`` is empty (design §8)."""
    total = target.sum().item()
    return (selected & target).sum().item() / total if total else 1.0
