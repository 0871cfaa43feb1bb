"""The attention-method interface: every method attends; block-sparse ones also select.

A method sees one layer at a time: ``attend(layer, q, h, cache, step)`` gets the layer's
queries, its attention input ``h`` (what the Forecast reads) and the cache after this
step's append, and returns the attention output. Methods choose blocks but never
allocate cache memory.
"""

from __future__ import annotations

import dataclasses

import torch

from sparda.attention.dense_heads import dense_head_mask, widen_to_dense
from sparda.config import SpardaConfig
from sparda import kernels
from sparda.kernels import reference as ref


class AttentionMethod:
    """Base class. Subclasses implement :meth:`attend`.

    Attributes:
        config: the :class:`SpardaConfig`.
        shape: the model's :class:`~sparda.model.llama.ModelShape`.

    A method keeps no per-cache state of its own: decode counters and per-row selector
    state live in the cache it is handed (:class:`~sparda.cache.base.KVCache`).
    """

    name = "base"
    #: a prefill of several right-padded prompts at once (design §3.8) gives each row what its
    #: prefill alone gives: a method whose prefill is a function of each query's position
    #: and the keys before it, or that keeps its per-row state from each row's own tokens
    #: (:func:`prefill_rows`), says so; ``sparda.LLM`` prefills the prompts of any other
    #: method one at a time
    batched_prefill = False
    #: a prompt may be prefilled in chunks spread over engine steps, with decode steps of
    #: other rows between them (design §3.8): no per-row state that a padding decode of the
    #: half-prefilled row would change (the selectors with :class:`RowState` keep it whole)
    prefill_across_steps = True
    #: the method reads an offloaded KV cache (``sparda.attention.offload``)
    offloaded = False
    #: per-row selector state kept by each cache (:class:`~sparda.attention.row_state.RowState`), if any
    state = None

    def __init__(self, config: SpardaConfig, shape, model=None, model_dir=None) -> None:
        #: the :class:`~sparda.model.llama.CausalLM` (lookahead methods read its weights)
        self.model = model
        #: the checkpoint directory (Forecast methods find shipped weights from it)
        self.model_dir = model_dir
        self.config = config
        self.selection = config.selection
        self.shape = shape

    def reset(self) -> None:
        """Forget what the method keeps between calls (called before each prefill); the
        counters and per-row state of a cache are the cache's (:meth:`KVCache.reset_counters`)."""
        self.__dict__.pop("_decode_ids", None)

    def state_bytes(self, rows: int, capacity: int) -> int:
        """Device bytes of the per-row :attr:`state` a cache of ``rows`` x ``capacity`` tokens keeps."""
        return 0 if self.state is None else self.state.nbytes(rows, capacity)

    def cache_resident_layers(self) -> tuple[int, ...]:
        """The layers an offloaded KV cache keeps whole on the device (none by default)."""
        return ()

    def state_from_cache(self, cache, context: int) -> None:
        """Benchmarks: per-row selector state for a cache filled with ``context`` tokens
        without a prefill (the stateful selectors; nothing for the others)."""

    def attend(self, layer: int, q: torch.Tensor, h: torch.Tensor, cache, step) -> torch.Tensor:
        """Attention output ``[B, H_kv, G, Tq, d]`` for queries ``q [B, H_kv, G, Tq, d]``.

        ``h [B, Tq, d_model]`` is the layer's attention input (post-RMSNorm hidden state).
        """
        raise NotImplementedError

    def graph_key(self, live_len: int):
        """Hashable summary of every host-side branch a decode step takes when its longest
        row holds ``live_len`` tokens (tokens). Two steps with the same key launch the same
        kernels on the same shapes, so one captured CUDA graph serves both
        (:mod:`sparda.engine.graph_runner`). ``None``: no branch (dense)."""
        return None

    def _count(self, cache, step, read_mask: torch.Tensor | None) -> None:
        """Add one decode step's per-row block counts to ``cache.counters`` (device tensors:
        no host sync). ``read_mask``: ``[B, ...]`` bool, the blocks this layer reads; ``None`` = all valid."""
        if step.phase != "decode":
            return
        valid = (step.q_pos[:, -1] // self.selection.block_size + 1) * self.shape.num_kv_heads  # [B]
        read = valid if read_mask is None else read_mask.reshape(read_mask.shape[0], -1).sum(-1)
        self._accumulate(cache, "blocks_read", read)
        self._accumulate(cache, "blocks_valid", valid)

    @staticmethod
    def _accumulate(cache, key: str, value: torch.Tensor) -> None:
        """``cache.counters[key] += value`` in place (``[B]`` int64 on the device), so that a
        captured CUDA graph keeps counting on replay (:meth:`KVCache.counter`)."""
        cache.counter(key, value.shape[0], value.device).add_(value)

    @staticmethod
    def _counters(cache, step) -> tuple[torch.Tensor, torch.Tensor]:
        """``(blocks_read, blocks_valid)``: ``[B]`` int64 device counters of this decode step's
        rows in ``cache``, allocated on first use, for kernels that count in place (the slot diff)."""
        b, dev = step.q_pos.shape[0], step.q_pos.device
        return cache.counter("blocks_read", b, dev), cache.counter("blocks_valid", b, dev)

    def _count_ids(self, cache, step, ids: torch.Tensor) -> None:
        """:meth:`_count` from selected block ids ``[B, H, W]`` (``-1`` padded) instead of a mask."""
        if step.phase != "decode":
            return
        valid = (step.q_pos[:, -1] // self.selection.block_size + 1) * self.shape.num_kv_heads
        self._accumulate(cache, "blocks_read", (ids >= 0).sum((-1, -2)))
        self._accumulate(cache, "blocks_valid", valid)

    def _count_dense(self, cache, step) -> None:
        self._count(cache, step, None)


def prefill_rows(step, *tensors: torch.Tensor):
    """The rows of a prefill step, for methods that keep per-row state from their prompt.

    Yields ``(row_step, *rows)`` with ``tensors`` (batch first, tokens in dim -2: queries
    ``[B, H_kv, G, T, d]``, keys ``[B, H_kv, T, d]``): for a batched prefill
    (``step.row_lengths``, design §3.8) one per batch row, each tensor cut to that row's
    real tokens (``[1, ..., n, d]``), with the one-row :class:`~sparda.model.llama.StepInfo`
    its prefill alone would have (``rows``, ``q_pos``, ``kv_len``, RoPE tables,
    ``max_kv_len = n``, ``row``); otherwise ``(step, *tensors)`` itself once.
    """
    if step.row_lengths is None:
        yield (step, *tensors)
        return
    for i, (row, n) in enumerate(step.row_lengths):
        sub = dataclasses.replace(step, rows=step.rows[i:i + 1], q_pos=step.q_pos[i:i + 1, :n],
                                  kv_len=step.kv_len.new_full((1,), n), cos=step.cos[i:i + 1, :, :n],
                                  sin=step.sin[i:i + 1, :, :n], max_kv_len=n, live_len=n, row=row,
                                  row_lengths=None, projections={})
        yield (sub, *(t[i:i + 1, ..., :n, :] for t in tensors))


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step,
                    window: int | None = None) -> torch.Tensor:
    """Dense causal attention through ``torch.nn.functional.scaled_dot_product_attention``.

    Args:
        q: ``[B, H_kv, G, Tq, d]``; k, v: ``[B, H_kv, T, d]``; ``step.q_pos``,
            ``step.kv_len`` give causality and per-row lengths.
        window: sliding window in tokens (:func:`window_attention`), ``None`` = full.
    Returns:
        ``[B, H_kv, G, Tq, d]`` in ``q``'s dtype.
    """
    if window is not None and window < k.shape[-2]:
        return window_attention(q, k, v, step, window)
    b, hk, g, t, d = q.shape
    qf = q.reshape(b, hk * g, t, d)
    if step.phase == "prefill":
        if t != k.shape[-2]:  # a later prefill chunk: its queries are the last t of the keys
            return prefill_chunk_attention(q, k, v)
        out = torch.nn.functional.scaled_dot_product_attention(qf, k, v, is_causal=True, enable_gqa=True)
    else:
        keys = torch.arange(k.shape[-2], device=q.device)
        allowed = (keys.view(1, 1, -1) <= step.q_pos.unsqueeze(-1)) & (keys.view(1, 1, -1) < step.kv_len.view(-1, 1, 1))
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, k, v, attn_mask=allowed.unsqueeze(1), enable_gqa=True)
    return out.view(b, hk, g, t, d)


def prefill_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Dense causal attention of a prefill chunk: the ``Tq`` queries sit at the last
    ``Tq`` of the ``T`` key positions (query ``i`` sees keys ``<= T - Tq + i``; chunked prefill).

    CUDA: the Triton prefill kernel without a block mask (``kernels.prefill_attention``,
    exact causal masking by position, no ``[Tq, T]`` mask in memory); elsewhere SDPA with
    a lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``).

    Args:
        q: ``[B, H_kv, G, Tq, d]``; k, v: ``[B, H_kv, T, d]`` with ``T >= Tq``, same dtype.
    Returns:
        ``[B, H_kv, G, Tq, d]`` in ``q``'s dtype.
    """
    b, hk, g, t, d = q.shape
    num_keys = k.shape[-2]
    if q.is_cuda:
        q_pos = torch.arange(num_keys - t, num_keys, device=q.device).expand(b, t)
        kv_len = torch.full((b,), num_keys, device=q.device, dtype=torch.long)
        return kernels.prefill_attention(q, k, v, None, q_pos, kv_len, 64)
    from torch.nn.attention.bias import causal_lower_right

    out = torch.nn.functional.scaled_dot_product_attention(
        q.reshape(b, hk * g, t, d), k, v, attn_mask=causal_lower_right(t, num_keys), enable_gqa=True)
    return out.view(b, hk, g, t, d)


#: prefill query tokens per chunk of :func:`window_attention` (bounds the mask's memory)
WINDOW_CHUNK_TOKENS = 1024


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step, window: int) -> torch.Tensor:
    """Sliding-window causal attention: the query at position ``p`` sees keys ``i`` with
    ``p - window < i <= p`` and ``i < kv_len`` (transformers' ``sliding_window_overlay``).

    Decode masks all ``T`` keys (no host sync); prefill (positions ``0..Tq-1``) runs
    :data:`WINDOW_CHUNK_TOKENS` queries at a time over only the keys their windows reach.

    Args:
        q: ``[B, H_kv, G, Tq, d]``; k, v: ``[B, H_kv, T, d]``; ``step`` a StepInfo;
            window: tokens (>= 1).
    Returns:
        ``[B, H_kv, G, Tq, d]`` in ``q``'s dtype.
    """
    b, hk, g, t, d = q.shape
    keys = torch.arange(k.shape[-2], device=q.device)
    off = k.shape[-2] - t  # prefill: the queries are the last t key positions (a later chunk: off > 0)
    spans = [(0, t, 0, k.shape[-2])] if step.phase != "prefill" else [
        (start, min(start + WINDOW_CHUNK_TOKENS, t), max(0, off + start - window + 1),
         off + min(start + WINDOW_CHUNK_TOKENS, t))
        for start in range(0, t, WINDOW_CHUNK_TOKENS)]
    out = []
    for start, end, lo, hi in spans:
        pos = step.q_pos[:, start:end].unsqueeze(-1)  # [B, c, 1]
        key = keys[lo:hi].view(1, 1, -1)
        allowed = (key <= pos) & (key > pos - window) & (key < step.kv_len.view(-1, 1, 1))
        out.append(torch.nn.functional.scaled_dot_product_attention(
            q[..., start:end, :].reshape(b, hk * g, end - start, d), k[:, :, lo:hi], v[:, :, lo:hi],
            attn_mask=allowed.unsqueeze(1), enable_gqa=True))
    return torch.cat(out, dim=-2).view(b, hk, g, t, d)


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     step, first: int, cfg, ids: torch.Tensor | None = None) -> torch.Tensor:
    """Exact attention over the selected blocks (design §3.5) for queries ``first..``.

    CPU tensors use :func:`sparda.kernels.reference.block_sparse_attention`; CUDA tensors
    the Triton kernels (block-sparse prefill tiles; split-KV decode over block ids).

    Args:
        q: ``[B, H_kv, G, Tq', d]``; k, v: ``[B, H_kv, T, d]``; mask: ``[B, H_kv, Tq', N]``.
        ids: optional decode block ids ``[B, H_kv, W]`` of the same selection (from the
            selection kernel): used as is instead of sorting ``mask`` into ids.
    Returns:
        ``[B, H_kv, G, Tq', d]``.
    """
    q_pos = step.q_pos[:, first:]
    if not q.is_cuda:
        return ref.block_sparse_attention(q, k, v, mask, q_pos, step.kv_len, cfg.block_size)
    if step.phase == "prefill":
        return kernels.prefill_attention(q, k, v, mask, q_pos, step.kv_len, cfg.block_size)
    # Decode rows select at most max(budget, dense fallback) blocks: a fixed width, no sync.
    if ids is None:
        width = min(mask.shape[-1], max(cfg.budget_blocks, -(-cfg.dense_len // cfg.block_size)))
        ids = ref.block_mask_to_indices(mask[..., -1, :], width)
    return kernels.decode_attention(q[..., -1, :], k, v, ids, step.kv_len, cfg.block_size).unsqueeze(-2)


class BlockSparseMethod(AttentionMethod):
    """Block-sparse attention (design §3): score blocks, select per KV head, attend exactly.

    Subclasses implement :meth:`block_scores`; the selection rule lives in
    :func:`sparda.kernels.reference.select_blocks`.
    """

    #: query tokens scored and attended per chunk in prefill (bounds memory)
    chunk_tokens = 1024
    #: :meth:`block_scores` holds a score per query and *key* (``oracle``: ``[B, H, G, chunk,
    #: T]`` fp32), so a batched prefill scores ``chunk_tokens / B`` queries per row at a time;
    #: the others hold one per query and block or compressed key, and keep whole chunks
    scores_hold_every_key = False
    #: decode goes through :meth:`attend`'s mask, so ``config.dense_heads`` applies (design §3.7)
    supports_dense_heads = True
    #: what :meth:`block_scores` are for the top-p mass (design §3.12): ``None`` probabilities,
    #: a float the scale of logits
    mass_logit_scale: float | None = None

    def block_scores(self, layer: int, q: torch.Tensor, h: torch.Tensor, cache, step,
                     k: torch.Tensor, ck: torch.Tensor, chunk: slice) -> torch.Tensor:
        """Block scores ``[B, H_kv, Tq_chunk, N]`` for the query tokens in ``chunk``."""
        raise NotImplementedError

    def needs_selection(self, step) -> bool:
        """False when every query falls under the dense fallback (design §3.6)."""
        return self.selects_at(step.live_len)

    def selects_at(self, live_len: int) -> bool:
        """Whether a step whose longest row holds ``live_len`` tokens selects (design §3.6).

        A host-side decision on a host int: it flips once as the context grows past the
        dense fallback, and the CUDA-graph runner keys its graphs on it (:meth:`graph_key`)."""
        cfg = self.selection
        last = live_len - 1
        return last + 1 >= cfg.dense_len and last // cfg.block_size + 1 > cfg.budget_blocks

    def graph_key(self, live_len: int):
        """The host-side branch a decode step of ``live_len`` tokens takes (see
        :meth:`AttentionMethod.graph_key`): whether it selects."""
        return self.selects_at(live_len)

    @property
    def decode_ids(self) -> dict:
        """Layer -> decode block ids ``[B, H_kv, W]`` int32 that a selection kernel produced
        alongside its mask this step (attention reads them directly: no sort)."""
        return self.__dict__.setdefault("_decode_ids", {})

    def before_layer(self, layer: int, q: torch.Tensor, h: torch.Tensor, cache, step) -> None:
        """Hook run at the start of every layer's attention (Forecast methods use it).

        Args as :meth:`attend`: ``q [B, H_kv, G, Tq, d]``, ``h [B, Tq, d_model]``, the cache
        after this step's append and the :class:`~sparda.model.llama.StepInfo`.
        """

    def dense_prefix(self, step) -> int:
        """How many leading prefill queries fall under the dense fallback (design §3.6):
        query ``t`` does iff ``t + 1 < dense_len`` or its ``t // B_s + 1`` valid blocks fit
        the budget. Prefill positions grow from the chunk's start ``step.max_kv_len - Tq``
        (0 unless chunked), so these form a prefix. 0 in decode."""
        if step.phase != "prefill":
            return 0
        cfg = self.selection
        start = step.max_kv_len - step.q_pos.shape[1]
        return min(step.q_pos.shape[1], max(0, max(cfg.dense_len - 1, cfg.budget_blocks * cfg.block_size) - start))

    def select(self, layer: int, q, h, cache, step, first: int = 0) -> torch.Tensor:
        """Block mask ``[B, H_kv, Tq - first, N]`` bool for this layer's queries ``first..Tq-1``.

        Scores ``chunk_tokens`` queries at a time with :meth:`block_scores` (``chunk_tokens /
        B`` of each of the ``B`` rows where :attr:`scores_hold_every_key`, so that a batched
        prefill holds what one prompt's would) and applies the selection rule (design §3.4;
        in decode the top-p budget of §3.12 where set); ``N = ceil(step.max_kv_len / block_size)``.
        """
        num_tokens = step.max_kv_len
        k, _, ck = cache.view(layer, step.cache_rows, num_tokens)
        num_blocks = -(-num_tokens // self.selection.block_size)
        tokens = max(1, self.chunk_tokens // q.shape[0]) if self.scores_hold_every_key else self.chunk_tokens
        masks = []
        for start in range(first, q.shape[-2], tokens):
            chunk = slice(start, start + tokens)
            scores = self.block_scores(layer, q, h, cache, step, k, ck, chunk)
            masks.append(ref.select_blocks(scores[..., :num_blocks], step.q_pos[:, chunk], self.selection,
                                           adaptive=step.phase == "decode", logit_scale=self.mass_logit_scale))
        return torch.cat(masks, dim=2)

    def _dense_heads(self, layer: int, step, device) -> torch.Tensor | None:
        """``[H_kv]`` bool of ``layer``'s KV heads kept dense in this decode step
        (``config.dense_heads``, design §3.7), or ``None`` (none, or not a decode step)."""
        heads = self.config.dense_heads
        if not heads or step.phase != "decode":
            return None
        cached = self.__dict__.setdefault("_dense_head_masks", {})
        key = (layer, str(device))
        if key not in cached:
            cached[key] = dense_head_mask(heads, layer, self.shape.num_kv_heads, device)
        return cached[key]

    def attend(self, layer, q, h, cache, step):
        """Block-sparse attention of one layer (design §3.4-3.6): ``q [B, H_kv, G, Tq, d]`` -> same shape.

        Runs :meth:`before_layer`, then dense attention where the dense fallback covers
        every query (or in prefill without ``config.sparse_prefill``); otherwise dense for
        the :meth:`dense_prefix` and :meth:`select` + exact attention over the selected
        blocks for the rest; in decode the KV heads of ``config.dense_heads`` read every
        visible block instead (design §3.7). ``h [B, Tq, d_model]`` is the attention input. Output in
        ``q``'s dtype. Raises SpardaError only through ``cache.view`` (tokens over capacity).
        """
        self.before_layer(layer, q, h, cache, step)
        num_tokens = step.max_kv_len
        k, v, _ = cache.view(layer, step.cache_rows, num_tokens)
        if not self.needs_selection(step) or (step.phase == "prefill" and not self.config.sparse_prefill):
            self._count_dense(cache, step)
            return dense_attention(q, k, v, step)
        first = self.dense_prefix(step)
        mask = self.select(layer, q, h, cache, step, first)
        ids = self.decode_ids.pop(layer, None) if step.phase == "decode" else None
        dense = self._dense_heads(layer, step, q.device)
        if dense is not None:  # design §3.7: these heads read every visible block
            mask = widen_to_dense(mask, dense, step.q_pos[:, first:], self.selection.block_size)
            ids = ref.block_mask_to_indices(mask[..., -1, :], mask.shape[-1]) if q.is_cuda else None
        self._count(cache, step, mask[..., -1, :])
        out = sparse_attention(q[..., first:, :], k, v, mask, step, first, self.selection, ids)
        if first == 0:
            return out
        # The dense-fallback prefix attends causally to the keys up to its last position.
        end = num_tokens - q.shape[-2] + first
        head = dense_attention(q[..., :first, :], k[:, :, :end], v[:, :, :end], step)
        return torch.cat([head, out], dim=-2)
