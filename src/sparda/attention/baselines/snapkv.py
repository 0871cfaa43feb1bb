"""``snapkv``: prefill-time selection from an observation window on the block grid (Li et
al., "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024).

SnapKV looks at the attention of the last ``window`` prompt queries (``snapkv_window``,
default 32), smooths it with a 1-D pool (kernel 7) and keeps, per head, the prompt
positions it votes for plus the window itself; decoding then reads only those. Here, per
layer and KV head, at the end of the (dense) prefill: ``s_i = sum over the window's
queries and the G heads of the group of softmax_i`` over the prompt keys, max-pooled over
tokens (kernel 7, stride 1, padding 3), summed onto blocks; the §3.4 rule (design §3.4:
sinks + local window + top-k at the last prompt position) picks the blocks once. Decode
reads that fixed set plus every block from the prompt's local window (or observation
window, whichever starts earlier) on, the blocks written since included; so the set grows
by one block per ``block_size`` generated tokens, as SnapKV keeps every generated token.
A prompt under the dense fallback (design §3.6) keeps every block.
"""

from __future__ import annotations

import torch

from sparda.attention.base import BlockSparseMethod, dense_attention, prefill_rows
from sparda.attention.row_state import RowState, block_ids, decode_attention_any, fixed_set_mask, prime_fixed_set
from sparda.kernels import reference as ref
from sparda.kernels import token_attention_mass

#: SnapKV's pooling kernel over token positions
POOL_KERNEL = 7


def window_votes(q: torch.Tensor, k: torch.Tensor, window: int, block_size: int,
                 kernel: int = POOL_KERNEL) -> torch.Tensor:
    """SnapKV block scores of one prompt: ``[1, H, N]`` fp32.

    Args:
        q: ``[1, H, G, Tq, d]``: the prompt's last ``Tq`` queries (positions ``T - Tq .. T - 1``),
            ``Tq >= min(window, T)``; k: ``[1, H, T, d]`` prompt keys (positions ``0..T-1``).
        window: observation window (the last ``min(window, T)`` queries).
        block_size: tokens per block; ``N = ceil(T / block_size)``.
        kernel: token max-pool kernel (odd; padding ``kernel // 2``).
    Raises:
        ValueError: ``q`` holds fewer queries than the window.
    """
    t = k.shape[-2]
    w = min(window, t)
    if q.shape[-2] < w:
        raise ValueError(f"window_votes needs the last {w} queries, got {q.shape[-2]}")
    votes = token_attention_mass(q[..., q.shape[-2] - w:, :], k)  # [1, H, T], Triton on CUDA
    votes = torch.nn.functional.max_pool1d(votes, kernel, stride=1, padding=kernel // 2)
    return ref.sum_onto_blocks(votes, block_size)


class SnapKVAttention(BlockSparseMethod):
    """Method ``snapkv``: blocks chosen once from the observation window, then fixed."""

    name = "snapkv"
    batched_prefill = True  # each row's own observation window (design §3.8)
    prefill_across_steps = False  # RowState: prefilled whole in one engine step
    #: decode does not go through BlockSparseMethod.attend's mask: no dense heads (design §3.7)
    supports_dense_heads = False

    def __init__(self, config, shape, model=None, model_dir=None) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)
        self.window = config.snapkv_window
        #: (row, layer) -> the last ``window`` prefill queries ``[1, H, G, <= window, d]`` of the
        #: chunks so far (:meth:`prefill_select`)
        self._window_q: dict[tuple[int, int], torch.Tensor] = {}

        def make(rows, capacity, device):
            dims = (rows, shape.num_kv_heads, -(-capacity // config.selection.block_size))
            return {"fixed": [torch.zeros(dims, dtype=torch.bool, device=device) for _ in range(shape.num_layers)],
                    "start": torch.zeros(rows, dtype=torch.long, device=device)}
        self.state = RowState(make)

    def prefill_select(self, layer: int, q: torch.Tensor, k: torch.Tensor, cache, step) -> None:
        """Choose the prompt's kept blocks of ``layer`` (row ``step.rows[0]``) and store them.

        Chunked prefill: every chunk chooses from the prompt so far (the last chunk's choice
        stands); a chunk shorter than the window takes the window's earlier queries from the
        chunks before it (kept per row and layer, ``window`` queries each), so the votes
        equal an unchunked prefill's."""
        cfg = self.selection
        st = self.state.of(cache)
        t = k.shape[-2]
        row = step.rows[:1]
        last = step.q_pos[:, -1:]
        key = (step.row, layer)
        if q.shape[-2] < t and key in self._window_q:  # a later chunk: the window may reach back
            q = torch.cat([self._window_q[key], q], dim=-2)
        self._window_q[key] = q[..., -self.window:, :].clone()
        chosen = ref.select_blocks(window_votes(q, k, self.window, cfg.block_size).unsqueeze(2), last, cfg)
        start = min((t - 1) // cfg.block_size - cfg.local_blocks + 1, (t - min(self.window, t)) // cfg.block_size)
        start = max(start, 0)
        fixed = chosen[:, :, 0] & (block_ids(chosen.shape[-1], k.device)[:, :, 0] < start)
        st["fixed"][layer][row] = False
        st["fixed"][layer][row, :, :fixed.shape[-1]] = fixed
        st["start"][row] = start

    def reset(self) -> None:
        """Clear the stashed window queries of earlier prefills."""
        super().reset()
        self._window_q.clear()

    def state_from_cache(self, cache, context: int) -> None:
        """Benchmarks: a cache filled without a prefill gets a budget-sized fixed set per row
        (:func:`~sparda.attention.row_state.prime_fixed_set`; no queries exist to vote)."""
        st = self.state.of(cache)
        for fixed in st["fixed"]:
            prime_fixed_set(fixed, st["start"], context, self.selection)

    def attend(self, layer, q, h, cache, step):
        """``q [B, H_kv, G, Tq, d]`` -> same shape: dense prefill (then :meth:`prefill_select`),
        decode over the fixed set plus the recent blocks (:func:`fixed_set_mask`)."""
        k, v, _ = cache.view(layer, step.cache_rows, step.max_kv_len)
        if step.phase == "prefill":
            for sub, q_row, k_row in prefill_rows(step, q, k):  # a batched prefill: each row's own window
                self.prefill_select(layer, q_row, k_row, cache, sub)
            return dense_attention(q, k, v, step)
        st = self.state.of(cache)
        fixed = st["fixed"][layer][step.rows]
        mask = fixed_set_mask(fixed[..., :-(-k.shape[-2] // self.selection.block_size)],
                              st["start"][step.rows], step.q_pos, self.selection.block_size)
        self._count(cache, step, mask[..., -1, :])
        return decode_attention_any(q, k, v, mask, step, self.selection.block_size)
