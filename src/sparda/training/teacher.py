"""The strictly causal fine-grained teacher of Forecast training (design §5, Teacher)."""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref

FINE_KERNEL, FINE_STRIDE = 2, 1


def pool_fine_to_grid(fine: torch.Tensor, num_ck: int, cfg: SelectionConfig) -> torch.Tensor:
    """Max-pool fine scores ``[..., T-1]`` onto the inference grid: ``[..., num_ck]`` in ``fine``'s
    dtype; key ``i`` takes fine keys ``i*s .. i*s + k - 2`` (design §5)."""
    width = cfg.kernel_size - FINE_KERNEL + 1
    need = (num_ck - 1) * cfg.kernel_stride + width if num_ck else 0
    if num_ck == 0:
        return fine.new_zeros(*fine.shape[:-1], 0)
    padded = torch.nn.functional.pad(fine, (0, max(0, need - fine.shape[-1])))
    return padded.unfold(-1, width, cfg.kernel_stride)[..., :num_ck, :].amax(-1)


def fine_keys(k: torch.Tensor) -> torch.Tensor:
    """Fine compressed keys (window 2, stride 1, design §5): ``k [B, H, T, d]`` -> ``[B, H, T-1, d]``."""
    return ref.compress_keys(k, FINE_KERNEL, FINE_STRIDE)


@torch.no_grad()
def teacher_distribution(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                         cfg: SelectionConfig, fine_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher distribution over the grid's compressed keys (design §5): ``q [B, H, G, Tq, d]``,
    ``k [B, H, T, d]`` post-RoPE, ``q_pos [B, Tq]`` int64 ``< T`` (``fine_keys``: of ``k`` if
    known) -> ``[B, H, Tq, C]`` fp32, rows summing to 1 over visible keys (0 if none)."""
    fine_keys = fine_keys if fine_keys is not None else ref.compress_keys(k, FINE_KERNEL, FINE_STRIDE)
    fine = ref.query_group_scores(q, fine_keys, q_pos, FINE_KERNEL, FINE_STRIDE)  # [B,H,Tq,T-1]
    num_ck = ref.num_compressed(k.shape[-2], cfg.kernel_size, cfg.kernel_stride)
    grid = pool_fine_to_grid(fine, num_ck, cfg)
    vis = ref.compressed_visible(q_pos, num_ck, cfg.kernel_size, cfg.kernel_stride)[:, None]
    grid = grid.masked_fill(~vis, 0.0)
    total = grid.sum(-1, keepdim=True)
    return torch.where(total > 0, grid / total.clamp_min(1e-30), 0.0)
