"""``dense``: full causal attention over the on-device KV cache."""

from __future__ import annotations

from sparda.attention.base import AttentionMethod, dense_attention


class DenseAttention(AttentionMethod):
    """Every query attends to every earlier token (the accuracy reference)."""

    name = "dense"

    def attend(self, layer, q, h, cache, step):
        num_tokens = step.max_kv_len
        k, v, _ = cache.view(layer, step.rows, num_tokens)
        if layer == 0:
            self._count_dense(step)
        return dense_attention(q, k, v, step)
