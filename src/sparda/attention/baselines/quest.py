"""``quest``: query-aware page selection on the block grid (Tang et al., "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024).

Quest keeps, per page of ``P`` tokens (``quest_page_size``, default 16; pages tile the
blocks, so ``P`` divides ``block_size``), the element-wise minimum ``m`` and maximum ``M``
of its post-RoPE keys. For a query ``q`` the upper bound of any ``q . k`` in the page is
``sum_i max(q_i m_i, q_i M_i) = q+ . M + q- . m`` (``q+ = max(q, 0)``, ``q- = min(q, 0)``).
Changes for the block grid and GQA: the bound is summed over the ``G`` query heads of a
KV head (one selection per KV head, design §3.4), a block scores the maximum bound of its
pages, and then the §3.4 rule (sinks + local window + top-k, dense fallback) selects. A
page is scored only once complete (its last token at or before the query); the partial
page lies in the current block, which is always local. The bounds are kept per layer and
cache row in preallocated device tensors (about ``2 / P`` of the key cache) and updated in
place as tokens arrive, so a decode step reads ``2 / P`` of the keys to select.
"""

from __future__ import annotations

import torch

from sparda.attention.base import BlockSparseMethod, prefill_rows
from sparda.attention.row_state import RowState


def page_bounds(k: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise min and max of the keys of every page: ``k [..., T, d]`` ->
    ``(min, max)``, each ``[..., ceil(T / page), d]`` in ``k``'s dtype (a last partial page
    covers its tokens only)."""
    t = k.shape[-2]
    pages = -(-t // page)
    pad = pages * page - t
    lo = torch.nn.functional.pad(k.transpose(-1, -2), (0, pad), value=float("inf")).transpose(-1, -2)
    hi = torch.nn.functional.pad(k.transpose(-1, -2), (0, pad), value=float("-inf")).transpose(-1, -2)
    shape = (*k.shape[:-2], pages, page, k.shape[-1])
    return lo.reshape(shape).amin(-2), hi.reshape(shape).amax(-2)


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, q_pos: torch.Tensor, page: int) -> torch.Tensor:
    """Quest upper bounds summed over the group: ``[B, H, Tq, P_n]`` fp32.

    Args:
        q: ``[B, H, G, Tq, d]`` queries. lo, hi: ``[B, H, P_n, d]`` page bounds.
        q_pos: ``[B, Tq]`` int64 positions; page ``j`` is scored iff ``(j+1) * page - 1 <= q_pos``.
        page: tokens per page.
    Returns:
        ``sum_g (q+ . hi + q- . lo)``, ``-inf`` at pages not yet complete.
    """
    qf = q.float()
    # the group sum moved inside: sum_g (q+_g . hi) = (sum_g q+_g) . hi, one [Tq, d] x [d, P_n]
    # product per KV head instead of G (broadcasting hi over the group copied it G times)
    bound = (torch.matmul(qf.clamp(min=0).sum(2), hi.float().transpose(-1, -2))
             + torch.matmul(qf.clamp(max=0).sum(2), lo.float().transpose(-1, -2)))
    ends = (torch.arange(lo.shape[-2], device=q.device) + 1) * page - 1
    done = ends.view(1, 1, 1, -1) <= q_pos.view(q_pos.shape[0], 1, -1, 1)
    return bound.masked_fill(~done, float("-inf"))


def pages_to_blocks(scores: torch.Tensor, num_blocks: int, pages_per_block: int) -> torch.Tensor:
    """Max over the pages of each block: ``[..., P_n]`` -> ``[..., N]`` (``-inf`` where a block
    has no scored page)."""
    need = num_blocks * pages_per_block
    if scores.shape[-1] < need:
        scores = torch.nn.functional.pad(scores, (0, need - scores.shape[-1]), value=float("-inf"))
    return scores[..., :need].reshape(*scores.shape[:-1], num_blocks, pages_per_block).amax(-1)


class QuestAttention(BlockSparseMethod):
    """Method ``quest``: per-page key bounds, query-aware top-k blocks every step."""

    name = "quest"
    batched_prefill = True  # each row's own page bounds (design §3.8)
    prefill_across_steps = False  # RowState: prefilled whole in one engine step

    def __init__(self, config, shape, model=None, model_dir=None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)
        self.page = config.quest_page_size

        def make(rows, capacity, device):
            pages = -(-capacity // self.page)
            dims = (rows, shape.num_kv_heads, pages, shape.head_dim)
            dtype = next(model.parameters()).dtype if model is not None else torch.float32
            return {"lo": [torch.full(dims, float("inf"), dtype=dtype, device=device) for _ in range(shape.num_layers)],
                    "hi": [torch.full(dims, float("-inf"), dtype=dtype, device=device) for _ in range(shape.num_layers)]}
        self.state = RowState(make)

    def update_bounds(self, layer: int, cache, step) -> None:
        """Write this step's keys into the page bounds of ``layer`` (in place, no host sync).

        Prefill (positions ``0..T-1``; each row of a batched prefill its own, design §3.8):
        every page from the row's keys. Decode (one
        token per row at ``q_pos``): its page restarts at the page's first token, else takes
        the element-wise min / max with the stored bound."""
        st = self.state.of(cache)
        lo, hi = st["lo"][layer], st["hi"][layer]
        k, _, _ = cache.view(layer, step.cache_rows, step.max_kv_len)
        if step.phase == "prefill":
            for sub, k_row in prefill_rows(step, k):  # a batched prefill: each row's own keys
                row = sub.rows[:1]
                mn, mx = page_bounds(k_row, self.page)
                lo[row] = float("inf")
                hi[row] = float("-inf")
                lo[row, :, :mn.shape[-2]] = mn.to(lo.dtype)
                hi[row, :, :mx.shape[-2]] = mx.to(hi.dtype)
            return
        pos = step.q_pos[:, -1]
        new = k[torch.arange(k.shape[0], device=k.device), :, pos].to(lo.dtype)  # [B, H, d]
        index = pos // self.page
        fresh = (pos % self.page == 0).view(-1, 1, 1)
        lo[step.rows, :, index] = torch.where(fresh, new, torch.minimum(lo[step.rows, :, index], new))
        hi[step.rows, :, index] = torch.where(fresh, new, torch.maximum(hi[step.rows, :, index], new))

    def state_from_cache(self, cache, context: int) -> None:
        """Benchmarks: page bounds of every row from a cache filled without a prefill
        (``context`` tokens per row)."""
        st = self.state.of(cache)
        rows = torch.arange(cache.lengths.shape[0], device=cache.lengths.device)
        for layer, (lo, hi) in enumerate(zip(st["lo"], st["hi"])):
            k, _, _ = cache.view(layer, rows, context)
            mn, mx = page_bounds(k, self.page)
            lo[:, :, :mn.shape[-2]] = mn.to(lo.dtype)
            hi[:, :, :mx.shape[-2]] = mx.to(hi.dtype)

    def before_layer(self, layer, q, h, cache, step):
        """Keep the page bounds current (also under the dense fallback)."""
        self.update_bounds(layer, cache, step)

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """Quest block scores ``[B, H_kv, Tq_chunk, N]`` fp32: the largest page bound per block
        (:func:`page_scores`, :func:`pages_to_blocks`); ``N = ceil(T / block_size)`` of
        ``k [B, H_kv, T, d]``."""
        st = self.state.of(cache)
        lo, hi = st["lo"][layer][step.rows], st["hi"][layer][step.rows]
        num_blocks = -(-k.shape[-2] // self.selection.block_size)
        pages = min(lo.shape[-2], -(-k.shape[-2] // self.page))
        scores = page_scores(q[..., chunk, :], lo[:, :, :pages], hi[:, :, :pages], step.q_pos[:, chunk], self.page)
        return pages_to_blocks(scores, num_blocks, self.selection.block_size // self.page)
