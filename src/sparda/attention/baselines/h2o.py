"""``h2o``: Heavy-Hitter Oracle on the block grid (Zhang et al., "H2O: Heavy-Hitter Oracle
for Efficient Generative Inference of Large Language Models", NeurIPS 2023).

H2O keeps a recent window plus the "heavy hitters": the tokens with the largest attention
accumulated over every query so far, and evicts the rest for good. Here, per layer, KV
head and block: ``acc[b]`` sums the attention mass the block received (softmax
probabilities summed over the block's tokens and the ``G`` query heads of the group) from
every prompt query (the prompt is prefilled densely) and from every decoded query (over
the blocks it read). Each decode step keeps the sinks, the local window and the
``topk_blocks`` blocks of highest ``acc`` (design §3.4 with ``acc`` as the score); every
other valid block is *evicted*. Eviction is permanent without a separate flag: only read
blocks gain mass and ``acc`` never decreases, so every kept block stays above a block at
the moment it was dropped, and every block that later enters (leaving the local window)
has beaten a kept one; a dropped block can never rank in the top-k again. So each new
block leaving the local window competes with the kept ones, one in, one out, as in
H2O's cache (the test checks that no dropped block returns).

What eviction means here: the cache still holds the evicted blocks (sparda's caches are
preallocated and shared by all methods), but no query reads them; the read set, and so
the accuracy, is that of a cache which dropped them, while the memory saving of a real
eviction cache is not realised. Under the dense fallback (design §3.6) nothing is evicted.
"""

from __future__ import annotations

import math

import torch

from sparda.attention.base import BlockSparseMethod, dense_attention, prefill_rows, sparse_attention
from sparda.attention.row_state import RowState
from sparda.kernels import prefill_block_mass
from sparda.kernels import reference as ref

def selected_block_mass(q: torch.Tensor, k: torch.Tensor, ids: torch.Tensor, q_pos: torch.Tensor,
                        kv_len: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention mass per read block of one decode query, over the read blocks only.

    Args:
        q: ``[B, H, G, 1, d]``; k: ``[B, H, T, d]``.
        ids: ``[B, H, W]`` int64 read block ids, ``-1`` padded (:func:`block_mask_to_indices`).
        q_pos: ``[B, 1]`` int64; kv_len: ``[B]`` int64 (tokens).
    Returns:
        ``[B, H, W]`` fp32: ``sum_g sum_{i in block} softmax_i(q_g . k_i / sqrt(d))`` with the
        softmax over the read tokens (0 at padding), as the sparse attention weighs them.
    Gathers ``W * block_size`` keys per head (static shapes, no host sync).
    """
    b, h, g, _, d = q.shape
    width = ids.shape[-1]
    offsets = torch.arange(block_size, device=q.device)
    tok = ids.clamp(min=0).unsqueeze(-1) * block_size + offsets  # [B, H, W, Bs]
    ok = (ids.unsqueeze(-1) >= 0) & (tok <= q_pos.view(-1, 1, 1, 1)) & (tok < kv_len.view(-1, 1, 1, 1))
    tok = tok.clamp(max=k.shape[-2] - 1).reshape(b, h, -1)
    keys = k.gather(2, tok.unsqueeze(-1).expand(-1, -1, -1, d)).float()  # [B, H, W*Bs, d]
    logits = torch.einsum("bhgd,bhtd->bhgt", q[..., -1, :].float(), keys) / math.sqrt(d)
    logits = logits.masked_fill(~ok.reshape(b, h, 1, -1), float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B, H, W*Bs]
    return probs.view(b, h, width, block_size).sum(-1)


class H2OAttention(BlockSparseMethod):
    """Method ``h2o``: sinks + local window + heavy-hitter blocks, evicted blocks never return."""

    name = "h2o"
    batched_prefill = True  # the mass of each row's own queries (design §3.8)
    prefill_across_steps = False  # RowState: prefilled whole in one engine step
    #: decode does not go through BlockSparseMethod.attend's mask: no dense heads (design §3.7)
    supports_dense_heads = False

    def __init__(self, config, shape, model=None, model_dir=None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)

        def make(rows, capacity, device):
            dims = (rows, shape.num_kv_heads, -(-capacity // config.selection.block_size))
            return {"acc": [torch.zeros(dims, device=device) for _ in range(shape.num_layers)]}
        self.state = RowState(make)

    def prefill_mass(self, q: torch.Tensor, k: torch.Tensor, step) -> torch.Tensor:
        """``[1, H, N]`` fp32: the attention mass each block got from this prefill chunk's
        queries (:func:`sparda.kernels.prefill_block_mass`: Triton on CUDA)."""
        return prefill_block_mass(q, k, self.selection.block_size)

    def decode_mask(self, layer: int, cache, step) -> torch.Tensor:
        """This step's read mask ``[B, H, 1, N]`` bool: design §3.4 with ``acc`` as the scores."""
        acc = self.state.of(cache)["acc"][layer][step.rows]
        return ref.select_blocks(acc.unsqueeze(2), step.q_pos, self.selection)

    def state_from_cache(self, cache, context: int) -> None:
        """Benchmarks: a cache filled without a prefill starts with no accumulated mass."""
        for acc in self.state.of(cache)["acc"]:
            acc.zero_()

    def attend(self, layer, q, h, cache, step):
        """``q [B, H_kv, G, Tq, d]`` -> same shape. Prefill: dense, and the block masses of the
        prompt start ``acc`` (chunked prefill: the first chunk, whose queries see all ``T``
        keys, resets ``acc``; each later chunk adds its queries' masses). Decode: :meth:`decode_mask`, exact attention over it, then the
        mass it gave each read block is added to ``acc`` (in place)."""
        k, v, _ = cache.view(layer, step.cache_rows, step.max_kv_len)
        st = self.state.of(cache)
        if step.phase == "prefill":
            for sub, q_row, k_row in prefill_rows(step, q, k):  # a batched prefill: each row's own prompt
                row = sub.rows[:1]
                mass = self.prefill_mass(q_row, k_row, sub)
                if q_row.shape[-2] == k_row.shape[-2]:  # the first (or only) chunk of the prompt starts afresh
                    st["acc"][layer][row] = 0.0
                st["acc"][layer][row, :, :mass.shape[-1]] += mass  # a later chunk adds its queries' mass
            return dense_attention(q, k, v, step)
        mask = self.decode_mask(layer, cache, step)
        self._count(cache, step, mask[..., -1, :])
        out = sparse_attention(q, k, v, mask, step, 0, self.selection)
        cfg = self.selection
        width = min(mask.shape[-1], max(cfg.budget_blocks, -(-cfg.dense_len // cfg.block_size)))
        ids = ref.block_mask_to_indices(mask[..., -1, :], width)
        mass = selected_block_mass(q, k, ids, step.q_pos, step.kv_len, cfg.block_size)
        acc = st["acc"][layer][step.rows]
        acc.scatter_add_(-1, ids.clamp(min=0), mass)
        st["acc"][layer][step.rows] = acc
        return out
