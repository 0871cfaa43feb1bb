"""``sparse`` and ``oracle``: block selection from the layer's own queries (design §3, §8).

``sparse`` is InfLLM-V2-style, training-free: compressed scores
``sum_h softmax(q_h . K~ / sqrt(d))`` over the GQA group, max-pooled onto blocks.
``oracle`` ranks blocks by their true attention mass (a measurement upper bound).
Both then apply the same rule, :func:`sparda.kernels.reference.select_blocks`.
"""

from __future__ import annotations

from sparda import kernels
from sparda.attention.base import BlockSparseMethod
from sparda.kernels import reference as ref


def fused_prefill_selection(t) -> bool:
    """Whether prefill selection runs the fused kernel, :func:`sparda.kernels.select_prefill_blocks`
    (CUDA tensors; the CPU runtime keeps the chunked reference path of
    :meth:`BlockSparseMethod.select`, which gives the same masks)."""
    return t.is_cuda


class SparseAttention(BlockSparseMethod):
    """Query-based block-sparse attention (design §3.2–3.5)."""

    name = "sparse"
    batched_prefill = True  # per-query prefill (design §3.8)

    def select(self, layer, q, h, cache, step, first=0):
        """Block mask ``[B, H_kv, Tq - first, N]`` bool (design §3.2-3.4).

        CUDA decode: the fused Triton scoring + pooling + selection
        (:func:`sparda.kernels.select_decode_blocks`, ``Tq - first = 1``); CUDA prefill: the
        fused per-token kernel (:func:`sparda.kernels.select_prefill_blocks`); otherwise
        :meth:`BlockSparseMethod.select`. ``N = ceil(step.max_kv_len / block_size)``.
        Raises SpardaError (Triton path) on an unsupported dtype or head dim.
        """
        if step.phase == "prefill" and fused_prefill_selection(q):
            ck = cache.compressed_keys(layer, step.cache_rows, step.max_kv_len)
            num_blocks = -(-step.max_kv_len // self.selection.block_size)
            return kernels.select_prefill_blocks(q[..., first:, :], ck, step.q_pos[:, first:], num_blocks,
                                                 self.selection)
        if step.phase != "decode" or not q.is_cuda:
            return super().select(layer, q, h, cache, step, first)
        # CUDA decode: fused scoring + pooling + selection rule (Triton), no host sync.
        _, _, ck = cache.view(layer, step.cache_rows, step.max_kv_len)
        num_blocks = -(-step.max_kv_len // self.selection.block_size)
        ids, mask = kernels.select_decode_blocks(q[..., -1, :], ck, step.q_pos[:, -1], num_blocks,
                                                 self.selection, return_mask=True)
        self.decode_ids[layer] = ids
        return mask.unsqueeze(2)

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """Query-based block scores ``[B, H_kv, Tq_chunk, N]`` fp32 (design §3.2-3.3).

        ``sum_h softmax(q_h . ck / sqrt(d))`` over the group, max-pooled onto blocks;
        ``q [B, H_kv, G, Tq, d]``, ``k [B, H_kv, T, d]``, ``ck [B, H_kv, C, d]``,
        ``N = ceil(T / block_size)``.
        """
        cfg = self.selection
        scores = ref.query_group_scores(q[..., chunk, :], ck, step.q_pos[:, chunk],
                                        cfg.kernel_size, cfg.kernel_stride)
        num_blocks = -(-k.shape[-2] // cfg.block_size)
        return ref.pool_to_blocks(scores, num_blocks, cfg)


class OracleAttention(BlockSparseMethod):
    """Selects the top-k blocks by exact attention mass (group-summed softmax), design §8."""

    name = "oracle"
    batched_prefill = True  # per-query prefill (design §3.8)
    scores_hold_every_key = True  # exact softmax over every key: [B, H, G, chunk, T] fp32

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """True attention mass per block ``[B, H_kv, Tq_chunk, N]`` fp32, group-summed (design §8).

        ``q [B, H_kv, G, Tq, d]``, ``k [B, H_kv, T, d]``; ``N = ceil(T / block_size)``;
        each row sums to ``G``.
        """
        return ref.block_attention_mass(q[..., chunk, :], k, step.q_pos[:, chunk], step.kv_len,
                                        self.selection.block_size)
