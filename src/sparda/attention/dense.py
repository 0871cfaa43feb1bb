"""``dense``: full causal attention over the on-device KV cache."""

from __future__ import annotations

from sparda.attention.base import AttentionMethod, dense_attention


class DenseAttention(AttentionMethod):
    """Every query attends to every earlier token (the accuracy reference), or to the last
    ``W`` on a sliding-window layer (``shape.window(layer)``)."""

    name = "dense"

    def attend(self, layer, q, h, cache, step):
        """Dense causal attention: ``q [B, H_kv, G, Tq, d]`` -> same shape, ``q``'s dtype.

        Reads K/V ``[B, H_kv, max_kv_len, d]`` from ``cache``; ``h`` is unused. On a
        sliding-window layer the query at ``p`` sees keys ``p - W < i <= p``. Raises
        SpardaError (from ``cache.view``) if ``step.max_kv_len`` exceeds the capacity.
        """
        num_tokens = step.max_kv_len
        k, v, _ = cache.view(layer, step.rows, num_tokens)
        if layer == 0:
            self._count_dense(step)
        return dense_attention(q, k, v, step, window=self.shape.window(layer))
