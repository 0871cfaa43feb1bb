"""The frozen model's attention during Forecast training (design §5): dense, or block-sparse
over the blocks the layer's own queries select.

``sparse`` (design §5: "the frozen model runs teacher-selected sparse attention"): each
layer attends over exactly the blocks that the query-based selector of design §3.2-3.4 —
the layer's real queries against its compressed keys, the selector the Forecast learns
to stand in for, i.e. method ``sparse`` — picks for every query token, so the hidden
states that reach the next layer (and feed its Forecast and teacher) are those of block-
sparse inference rather than of dense attention. Queries under the dense fallback
(design §3.6) see every block. Attention runs through :func:`sparda.kernels.prefill_attention`
(the Triton block-sparse prefill kernel on CUDA, its PyTorch reference on the CPU), a
chunk of query tokens at a time so that the block mask and the score matrix stay bounded
at 64K tokens.
"""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import reference as ref

FROZEN_ATTENTION = ("dense", "sparse")

#: fp32 elements of the ``[B, H_q, chunk, keys]`` score matrix per query chunk (1 GiB; a few
#: such temporaries live at once: softmax, mask)
SCORE_ELEMENTS = 1 << 28


def query_chunk(batch: int, heads: int, keys: int, elements: int = SCORE_ELEMENTS) -> int:
    """Query tokens per chunk so that a ``[batch, heads, chunk, keys]`` fp32 matrix holds at
    most ``elements`` entries (at least 1, at most 4096)."""
    return max(1, min(4096, elements // max(1, batch * heads * keys)))


def selected_blocks(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, num_blocks: int,
                    cfg: SelectionConfig) -> torch.Tensor:
    """The query-based selection of design §3.2-3.4 (method ``sparse``): ``[B, H, Tq, N]`` bool.

    Args: ``q [B, H, G, Tq, d]`` the layer's post-RoPE queries; ``ck [B, H, C, d]`` its
    compressed keys; ``q_pos [B, Tq]`` int64 positions (tokens); ``num_blocks`` ``N``.
    """
    scores = ref.query_group_scores(q, ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
    return ref.select_blocks(ref.pool_to_blocks(scores, num_blocks, cfg), q_pos, cfg)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: SelectionConfig,
                     chunk: int | None = None) -> torch.Tensor:
    """Causal block-sparse attention of a whole sequence over its own selected blocks (design §5).

    Args:
        q: ``[B, H, G, T, d]``; k, v: ``[B, H, T, d]`` (post-RoPE, positions ``0..T-1``).
        cfg: the selection budget. chunk: query tokens per chunk (default :func:`query_chunk`).
    Returns:
        ``[B, H, G, T, d]`` in ``q``'s dtype: for each query, exact softmax attention over the
        keys of its selected blocks up to its own position (dense below the fallback).
    """
    b, h, g, t, _ = q.shape
    ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride)
    num_blocks = -(-t // cfg.block_size)
    pos = torch.arange(t, device=q.device).expand(b, t)
    kv_len = torch.full((b,), t, device=q.device, dtype=torch.long)
    step = chunk or query_chunk(b, h * g, max(ck.shape[-2], 1))
    outs = []
    for start in range(0, t, step):
        rows = slice(start, start + step)
        qc, pc = q[..., rows, :], pos[:, rows]
        mask = selected_blocks(qc, ck, pc, num_blocks, cfg)
        outs.append(kernels.prefill_attention(qc, k, v, mask, pc, kv_len, cfg.block_size))
    return torch.cat(outs, dim=-2)


def frozen_attention(mode: str, cfg: SelectionConfig, shape):
    """The ``attention`` hook of :meth:`sparda.model.llama.CausalLM.dense_layers` for ``mode``.

    Returns ``None`` for ``dense`` (the model's own causal SDPA, sliding windows included) and
    a callable ``(layer, q, k, v) -> [B, H, G, T, d]`` for ``sparse``.
    Raises SpardaError: an unknown mode, or ``sparse`` on a model with sliding-window layers
    (block-sparse methods refuse those, design §3).
    """
    if mode not in FROZEN_ATTENTION:
        raise SpardaError(f"unknown --frozen-attention {mode!r}; choose dense or sparse")
    if mode == "dense":
        return None
    if shape.windowed_layers():
        raise SpardaError("--frozen-attention sparse does not apply to sliding-window layers "
                          f"(layers {shape.windowed_layers()}); use --frozen-attention dense")
    return lambda layer, q, k, v: sparse_attention(q, k, v, cfg)
