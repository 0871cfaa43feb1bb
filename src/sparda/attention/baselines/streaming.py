"""``streaming``: StreamingLLM on the block grid (Xiao et al., "Efficient Streaming Language
Models with Attention Sinks", ICLR 2024).

StreamingLLM keeps the first few tokens (attention sinks) and a window of the most recent
tokens. Here the same block budget as ``sparse`` is spent that way: the ``init_blocks``
sink blocks, and the whole rest of the budget (``local_blocks + topk_blocks`` blocks) on
the most recent blocks, the current partial block included. The selection is positional:
each block is scored by its index and the §3.4 rule (design §3.4) picks the ``topk_blocks``
highest, i.e. the most recent ones outside the local window. Nothing is evicted from the
cache (the other blocks are only not read), and a needle further back than the window is
out of reach, by design.
"""

from __future__ import annotations

import torch

from sparda.attention.base import BlockSparseMethod


class StreamingAttention(BlockSparseMethod):
    """Method ``streaming``: sinks + the most recent ``local_blocks + topk_blocks`` blocks."""

    name = "streaming"
    batched_prefill = True  # per-query prefill (design §3.8)

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """Positional block scores ``[B, H_kv, Tq_chunk, N]`` fp32: block ``b`` scores ``b``, so
        the top-k of design §3.4 takes the most recent blocks outside the local window.
        ``N = ceil(T / block_size)`` for ``k [B, H_kv, T, d]``; ``q`` gives only the shape."""
        b, hk, _, _, _ = q.shape
        tq = q[..., chunk, :].shape[-2]
        num_blocks = -(-k.shape[-2] // self.selection.block_size)
        scores = torch.arange(num_blocks, device=q.device, dtype=torch.float32)
        return scores.expand(b, hk, tq, num_blocks)
