"""``dense``: full causal attention over the on-device KV cache."""

from __future__ import annotations

import torch

from sparda import kernels
from sparda.attention.base import AttentionMethod, dense_attention
from sparda.kernels import supported_head_dim

#: block size of the dense decode kernel's KV tiles (tokens; any power of two works)
_DECODE_BLOCK = 64


class DenseAttention(AttentionMethod):
    """Every query attends to every earlier token (the accuracy reference), or to the last
    ``W`` on a sliding-window layer (``shape.window(layer)``)."""

    name = "dense"
    batched_prefill = True  # per-query prefill (design §3.8)

    def attend(self, layer, q, h, cache, step):
        """Dense causal attention: ``q [B, H_kv, G, Tq, d]`` -> same shape, ``q``'s dtype.

        Reads K/V ``[B, H_kv, max_kv_len, d]`` from ``cache``; ``h`` is unused. On a
        sliding-window layer the query at ``p`` sees keys ``p - W < i <= p``. Raises
        SpardaError (from ``cache.view``) if ``step.max_kv_len`` exceeds the capacity.
        """
        num_tokens = step.max_kv_len
        k, v, _ = cache.view(layer, step.cache_rows, num_tokens)
        if layer == 0:
            self._count_dense(cache, step)
        window = self.shape.window(layer)
        if (step.phase == "decode" and q.is_cuda and q.shape[3] == 1 and supported_head_dim(q.shape[-1])
                and (window is None or window >= k.shape[-2])):
            # the split-KV decode kernel over every block: deterministic, so a replayed CUDA graph
            # gives the eager step's tokens (masked SDPA did not, in bf16 on the H200)
            ids = self._all_blocks(cache, q.shape[0], q.shape[1], k.shape[-2], q.device)
            out = kernels.decode_attention(q[:, :, :, 0], k, v, ids, step.kv_len, _DECODE_BLOCK)
            return out.unsqueeze(3)
        return dense_attention(q, k, v, step, window=window)

    def _all_blocks(self, cache, batch: int, heads: int, num_tokens: int, device) -> torch.Tensor:
        """``[B, H, ceil(T / 64)]`` int32 ids of every block, made once per shape and kept by
        ``cache`` (design §3.10): a graph captured on that cache reads a tensor that lives as
        long as it, whatever other caches this method serves in between."""
        n = -(-num_tokens // _DECODE_BLOCK)
        made = cache.owned(self, dict)
        key = (batch, heads, n, str(device))
        if key not in made:
            with torch.inference_mode():
                made[key] = torch.arange(n, dtype=torch.int32, device=device).expand(batch, heads, n).contiguous()
        return made[key]
