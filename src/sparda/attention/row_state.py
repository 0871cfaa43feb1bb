"""Per-row device state of the stateful selectors (``h2o``, ``quest``, ``snapkv``, ``shallow``).

A method never allocates cache memory, but some selectors keep a little state per KV
cache row across decode steps (accumulated attention, page bounds, a fixed block set, an
EMA of scores). :class:`RowState` holds those tensors, allocated once per KV cache at its
row count and capacity, so that a captured CUDA-graph decode step updates them in place
(docs/cuda_graphs.md: state in preallocated device tensors, nothing rebound). Prefill of
a row overwrites that row's state; decode reads and updates rows ``step.rows`` in place (the
cache's first ``b`` rows, design §3.13: the others are not touched).
"""

from __future__ import annotations

from typing import Callable

import torch


class RowState:
    """Named device tensors of a selector, one set per KV cache, kept by that cache
    (:meth:`sparda.cache.base.KVCache.owned`): an engine's cache and that of a ``generate``
    between its steps never share or replace each other's state, and a CUDA graph
    captured on one cache keeps pointing at live tensors.

    Args:
        make: returns ``name -> tensor`` whose first dim is the cache's ``rows`` (``B_cap``),
            for a cache of ``capacity`` tokens per row on ``device``.
    """

    def __init__(self, make: Callable[[int, int, torch.device], dict[str, object]]) -> None:
        self._make = make

    def of(self, cache) -> dict[str, object]:
        """``cache``'s state, made at its first use."""
        return cache.owned(self, lambda: self._make(cache.lengths.shape[0], cache.capacity, cache.lengths.device))

    def nbytes(self, rows: int, capacity: int) -> int:
        """Bytes of the state of a cache of ``rows`` x ``capacity`` tokens (made on the meta device)."""
        def tensors(value):
            if torch.is_tensor(value):
                yield value
            elif isinstance(value, (list, tuple, dict)):
                for item in value.values() if isinstance(value, dict) else value:
                    yield from tensors(item)
        return sum(t.nbytes for t in tensors(self._make(rows, capacity, torch.device("meta"))))


def block_ids(num_blocks: int, device) -> torch.Tensor:
    """``[1, 1, 1, N]`` int64 block indices (broadcast against ``[B, H, Tq, N]`` masks)."""
    return torch.arange(num_blocks, device=device).view(1, 1, 1, -1)


def fixed_set_mask(fixed: torch.Tensor, start: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Decode mask of a select-once method (``snapkv``, ``shallow --shallow-select-once``):
    the blocks chosen at the end of prefill plus every block from ``start`` on (the
    prompt's last blocks and those written since), causally valid only.

    Args:
        fixed: ``[B, H, N]`` bool, the blocks kept at prefill.
        start: ``[B]`` int64, first block always kept (the prompt's local window / observation window).
        q_pos: ``[B, 1]`` int64 query positions (tokens).
    Returns:
        ``[B, H, 1, N]`` bool.
    """
    blocks = block_ids(fixed.shape[-1], fixed.device)
    cur = (q_pos[:, -1] // block_size).view(-1, 1, 1, 1)
    recent = blocks >= start.view(-1, 1, 1, 1)
    return (fixed.unsqueeze(2) | recent) & (blocks <= cur)


def decode_attention_any(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, step,
                         block_size: int) -> torch.Tensor:
    """Exact decode attention over a block mask of any size (design §3.5).

    :func:`sparda.attention.base.sparse_attention` lists at most ``max(budget, dense
    fallback)`` blocks per row on CUDA; a select-once set grows with the generation, so
    this lists all ``N`` (a static width; ``-1`` padding is skipped by the kernel).

    Args: ``q [B, H, G, 1, d]``, ``k, v [B, H, T, d]``, ``mask [B, H, 1, N]`` bool.
    Returns: ``[B, H, G, 1, d]`` in ``q``'s dtype.
    """
    from sparda import kernels
    from sparda.kernels import reference as ref

    if not q.is_cuda:
        return ref.block_sparse_attention(q, k, v, mask, step.q_pos, step.kv_len, block_size)
    ids = ref.block_mask_to_indices(mask[..., -1, :], mask.shape[-1])
    return kernels.decode_attention(q[..., -1, :], k, v, ids, step.kv_len, block_size).unsqueeze(-2)


def prime_fixed_set(fixed: torch.Tensor, start: torch.Tensor, context: int, cfg) -> None:
    """Benchmarks (a cache filled without a prefill): a budget-sized fixed set in place --
    the sinks and the ``topk_blocks`` blocks after them, then the local window from
    ``(context - 1) // block_size - local_blocks + 1`` on. ``fixed [B, H, N]`` bool, ``start [B]``."""
    fixed.zero_()
    fixed[..., :cfg.init_blocks + cfg.topk_blocks] = True
    start.fill_(max((context - 1) // cfg.block_size - cfg.local_blocks + 1, 0))
