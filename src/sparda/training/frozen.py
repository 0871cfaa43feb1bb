"""The frozen model's attention during Forecast training: dense, or block-sparse over the
blocks its own queries select (design §5, ``--frozen-attention``).
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
    """Query tokens per chunk keeping ``[batch, heads, chunk, keys]`` fp32 within ``elements`` (1 to 4096)."""
    return max(1, min(4096, elements // max(1, batch * heads * keys)))


def selected_blocks(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor, num_blocks: int,
                    cfg: SelectionConfig) -> torch.Tensor:
    """Query-based selection (design §3.2-3.4): ``q [B, H, G, Tq, d]``, ``ck [B, H, C, d]``,
    ``q_pos [B, Tq]`` int64 -> ``[B, H, Tq, N]`` bool."""
    scores = ref.query_group_scores(q, ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
    return ref.select_blocks(ref.pool_to_blocks(scores, num_blocks, cfg), q_pos, cfg)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: SelectionConfig,
                     chunk: int | None = None) -> torch.Tensor:
    """Causal block-sparse attention of a sequence over its own selections (design §5): ``q [B, H,
    G, T, d]``, ``k, v [B, H, T, d]`` post-RoPE -> ``[B, H, G, T, d]``; ``chunk`` query tokens at a time."""
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
    """The ``attention`` hook of :meth:`sparda.model.llama.CausalLM.dense_layers`: ``None`` for
    ``dense``, ``(layer, q, k, v) -> [B, H, G, T, d]`` for ``sparse``. Raises SpardaError for an
    unknown mode or ``sparse`` with sliding-window layers."""
    if mode not in FROZEN_ATTENTION:
        raise SpardaError(f"unknown --frozen-attention {mode!r}; choose dense or sparse")
    if mode == "dense":
        return None
    if shape.windowed_layers():
        raise SpardaError("--frozen-attention sparse does not apply to sliding-window layers "
                          f"(layers {shape.windowed_layers()}); use --frozen-attention dense")
    return lambda layer, q, k, v: sparse_attention(q, k, v, cfg)
