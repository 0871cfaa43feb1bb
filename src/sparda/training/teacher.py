"""The strictly causal fine-grained teacher of Forecast training (design §5).

The real queries of layer ``l`` score *fine* compressed keys (kernel 2, stride 1,
post-RoPE): per query head ``softmax(q . K_fine / sqrt(d))``, summed over the ``G``
heads of a group, max-pooled onto the inference grid (kernel ``k``, stride ``s``)
and renormalised over the inference-grid compressed keys visible to the query.

Strict causality: fine key ``j`` averages tokens ``j, j+1`` and is visible to a query
at position ``t`` iff ``j + 1 <= t`` (no future token leaks); inference-grid key ``i``
pools fine keys ``j in [i*s, i*s + k - 2]`` (those inside its window) and is visible iff
``i*s + k - 1 <= t``, exactly as the student sees it.
"""

from __future__ import annotations

import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref

FINE_KERNEL, FINE_STRIDE = 2, 1


def pool_fine_to_grid(fine: torch.Tensor, num_ck: int, cfg: SelectionConfig) -> torch.Tensor:
    """Max-pool fine scores ``[..., T-1]`` (fine key ``j`` covers tokens ``j, j+1``) onto the
    inference grid: compressed key ``i`` takes the max over fine keys ``i*s .. i*s + k - 2``.

    Returns ``[..., num_ck]`` in ``fine``'s dtype (0 where a window holds no fine key).
    design §5 (Teacher: fine kernel 2, stride 1, max-pooled onto the k 32, s 16 grid).
    """
    width = cfg.kernel_size - FINE_KERNEL + 1
    need = (num_ck - 1) * cfg.kernel_stride + width if num_ck else 0
    if num_ck == 0:
        return fine.new_zeros(*fine.shape[:-1], 0)
    padded = torch.nn.functional.pad(fine, (0, max(0, need - fine.shape[-1])))
    return padded.unfold(-1, width, cfg.kernel_stride)[..., :num_ck, :].amax(-1)


def fine_keys(k: torch.Tensor) -> torch.Tensor:
    """The teacher's fine compressed keys: ``k [B, H, T, d]`` -> ``[B, H, T-1, d]`` (kernel 2,
    stride 1: key ``j`` is the mean of tokens ``j, j+1``), in ``k``'s dtype (design §5)."""
    return ref.compress_keys(k, FINE_KERNEL, FINE_STRIDE)


@torch.no_grad()
def teacher_distribution(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                         cfg: SelectionConfig, fine_keys: torch.Tensor | None = None) -> torch.Tensor:
    """Teacher distribution over inference-grid compressed keys (design §5).

    Args:
        q: ``[B, H, G, Tq, d]`` layer queries (post-RoPE). k: ``[B, H, T, d]`` post-RoPE keys.
        q_pos: ``[B, Tq]`` int64 query positions (``< T``).
        fine_keys: ``fine_keys(k)`` when the caller scores several query chunks of one
            layer (computed here otherwise).
    Returns:
        ``[B, H, Tq, C]`` fp32, ``C = num_compressed(T, k, s)``; each row sums to 1 over the
        visible compressed keys (0 elsewhere); rows with no visible key are all 0.
    """
    fine_keys = fine_keys if fine_keys is not None else ref.compress_keys(k, FINE_KERNEL, FINE_STRIDE)
    fine = ref.query_group_scores(q, fine_keys, q_pos, FINE_KERNEL, FINE_STRIDE)  # [B,H,Tq,T-1]
    num_ck = ref.num_compressed(k.shape[-2], cfg.kernel_size, cfg.kernel_stride)
    grid = pool_fine_to_grid(fine, num_ck, cfg)
    vis = ref.compressed_visible(q_pos, num_ck, cfg.kernel_size, cfg.kernel_stride)[:, None]
    grid = grid.masked_fill(~vis, 0.0)
    total = grid.sum(-1, keepdim=True)
    return torch.where(total > 0, grid / total.clamp_min(1e-30), 0.0)
