"""Pure-PyTorch reference of SparDA's block-sparse attention (design §3, §4).

Every Triton kernel in ``sparda.kernels`` has its twin here, and the CPU runtime uses
these functions directly. They favour clarity over speed. Scores, pooling, compressed-key
means and attention mass are computed in fp32 (float64 inputs are rounded to fp32); the
attention itself (:func:`block_sparse_attention`) runs
``torch.nn.functional.scaled_dot_product_attention`` in the inputs' dtype.

Shape conventions (``B`` batch, ``H`` KV heads, ``G`` query heads per KV head,
``Tq`` query tokens, ``T`` key tokens, ``C`` compressed keys, ``N`` KV blocks,
``d`` head dim):

* keys / values: ``[B, H, T, d]``
* queries: ``[B, H, G, Tq, d]`` (query head ``h*G + g`` belongs to KV head ``h``)
* query positions ``q_pos``: ``[B, Tq]`` int64, absolute token positions
* compressed keys: ``[B, H, C, d]``; compressed key ``j`` is the mean of keys
  ``[j*stride, j*stride + kernel)`` and is visible to a query at position ``t``
  iff ``j*stride + kernel - 1 <= t``.
* block scores / block masks: ``[B, H, Tq, N]``; block ``b`` holds tokens
  ``[b*block_size, (b+1)*block_size)``.
"""

from __future__ import annotations

import math

import torch

from sparda.config import SelectionConfig

NEG_INF = float("-inf")
# A valid (causally visible) block that no compressed key scores yet ranks below every
# scored block but above invalid (future) ones.
_UNSCORED = -1e30


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, half-split convention (the model's queries and keys, and
    the Forecast's queries): rotate ``x [B, H, T, d]`` by ``cos, sin [B, 1, T, d]``.

    Returns ``x * cos + rotate_half(x) * sin`` in the inputs' promoted dtype, where
    ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])``.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def num_compressed(num_tokens: int, kernel: int, stride: int) -> int:
    """Number of complete compression windows over ``num_tokens`` tokens (design §3.1)."""
    return 0 if num_tokens < kernel else (num_tokens - kernel) // stride + 1


def compress_keys(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Mean-pool keys into compressed keys (design §3.1).

    Args:
        k: ``[..., T, d]`` post-RoPE keys, any float dtype.
    Returns:
        ``[..., C, d]`` with ``C = num_compressed(T, kernel, stride)``, dtype of ``k``
        (the mean is taken in fp32).
    """
    num = num_compressed(k.shape[-2], kernel, stride)
    if num == 0:
        return k.new_zeros(*k.shape[:-2], 0, k.shape[-1])
    windows = k.float().unfold(-2, kernel, stride)[..., :num, :, :]  # [..., C, d, kernel]
    return windows.mean(-1).to(k.dtype)


def update_compressed_keys(ck: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                           kernel: int, stride: int, ring: bool = False) -> None:
    """After a decode append, write the compressed key that each row's new token completes,
    in place (design §3.1; no host sync, static shapes).

    The token at ``pos`` completes window ``j`` when ``pos + 1 - kernel = j * stride`` with
    ``0 <= j < C_cap``; then ``ck[row, :, j]`` becomes the fp32 mean of the window's
    ``kernel`` keys (oldest first, as :func:`compress_keys` averages them), cast to ``ck``'s
    dtype. Other entries, and rows whose token completes no window, are left as they are.
    The one PyTorch form of this update: both caches' decode ``append`` and the twin of the
    fused RoPE + append kernel (:func:`sparda.kernels.twins.rope_append_reference`) call it.

    Args:
        ck: ``[B_all, H, C_cap, d]`` compressed-key buffer, written in place.
        keys: the layer's keys with this step's token already written, ``[B_all, H, T, d]``
            (the window is read at positions ``j*stride ..``, clamped to ``T - 1``), or with
            ``ring`` the last ``kernel`` keys ``[B_all, H, kernel, d]``, key ``t`` at
            ``t % kernel``.
        rows: ``[B]`` int64 cache rows of this step; pos: ``[B]`` int64 token positions.
        kernel, stride: window length and step in tokens.
    """
    done = pos + 1 - kernel  # the window's first token
    j = done.clamp(min=0) // stride
    ready = (done >= 0) & (done % stride == 0) & (j < ck.shape[2])
    j = torch.where(ready, j, 0)
    index = (j * stride).view(-1, 1) + torch.arange(kernel, device=pos.device)
    index = index % kernel if ring else index.clamp(max=keys.shape[2] - 1)
    window = keys[rows.view(-1, 1), :, index]  # [B, kernel, H, d], oldest first
    new = window.float().mean(1).to(ck.dtype)  # [B, H, d]
    ck[rows, :, j] = torch.where(ready.view(-1, 1, 1), new, ck[rows, :, j])


def compressed_visible(q_pos: torch.Tensor, num_ck: int, kernel: int, stride: int) -> torch.Tensor:
    """Causal visibility of compressed keys (design §3.1-3.2): ``[B, Tq, C]`` bool.

    Compressed key ``j`` covers tokens ``[j*stride, j*stride + kernel)``; a query at
    position ``t`` (``q_pos [B, Tq]`` int64, tokens) sees it iff its last token ``<= t``.
    """
    ends = torch.arange(num_ck, device=q_pos.device) * stride + kernel - 1
    return ends.view(1, 1, -1) <= q_pos.unsqueeze(-1)


def lookahead_pos(q_pos: torch.Tensor, target_layer: int) -> torch.Tensor:
    """The lookahead rule (design §4): up to which position a selector may see the
    compressed keys of ``target_layer`` when it picks blocks for a query at ``q_pos``.

    A selector of layer ``l+1 >= 1`` (the Forecast ``F_l``, ``infinigen``'s partial query)
    runs during layer ``l``, before this step's token is appended to layer ``l+1``; it
    scores layer ``l+1``'s compressed keys *as they stood before that token*, i.e. the
    windows complete at ``q_pos - 1``. The window that the token at ``q_pos`` completes is
    not scored; it lies in the forced local window (``SelectionConfig`` refuses budgets
    where it would not), so the selection loses nothing. Layer 0 is scored by its own
    current-layer projection after the append: it sees the windows complete at ``q_pos``.

    Decode implements it by cutting the keys (``predict_next``, offloaded ``ck_len``);
    prefill, Forecast training, the selection report and ``infinigen`` call this function.

    Args:
        q_pos: ``[B, Tq]`` int64 query positions (tokens). target_layer: the scored layer.
    Returns:
        ``[B, Tq]`` int64 positions to pass as ``q_pos`` to :func:`compressed_visible`
        (and the score functions built on it).
    """
    return q_pos - 1 if target_layer > 0 else q_pos


def query_group_scores(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                       kernel: int, stride: int) -> torch.Tensor:
    """Query-based compressed scores, summed over the GQA group (design §3.2).

    ``p_h = softmax(q_h . ck / sqrt(d))`` over the causally visible compressed keys,
    summed over the ``G`` query heads of each KV head.

    Args:
        q: ``[B, H, G, Tq, d]`` queries (any float dtype; computed in fp32).
        ck: ``[B, H, C, d]`` compressed keys.
        q_pos: ``[B, Tq]`` int64 query positions (tokens).
        kernel, stride: compression window and stride (tokens; design §3.1: 32, 16).
    Returns:
        ``[B, H, Tq, C]`` fp32; zeros at invisible keys (rows with no visible key are 0).
    """
    d = q.shape[-1]
    logits = torch.matmul(q.float(), ck.float().unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    vis = compressed_visible(q_pos, ck.shape[-2], kernel, stride)[:, None, None]  # [B,1,1,Tq,C]
    logits = logits.masked_fill(~vis, NEG_INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.sum(dim=2)


def forecast_scores(f: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                    kernel: int, stride: int) -> torch.Tensor:
    """Forecast scores: raw dot products, one row per KV head (design §4).

    Args:
        f: ``[B, H, Tq, d]`` Forecast queries (RoPE applied; any float dtype, fp32 math).
        ck: ``[B, H, C, d]`` compressed keys of the scored layer.
        q_pos: ``[B, Tq]`` int64 query positions (tokens).
        kernel, stride: compression window and stride (tokens; design §3.1).
    Returns:
        ``[B, H, Tq, C]`` fp32, ``-inf`` at causally invisible compressed keys.
    """
    scores = torch.einsum("bhqd,bhcd->bhqc", f.float(), ck.float())
    vis = compressed_visible(q_pos, ck.shape[-2], kernel, stride)[:, None]
    return scores.masked_fill(~vis, NEG_INF)


def block_overlap(num_ck: int, num_blocks: int, cfg: SelectionConfig,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Which compressed keys overlap which blocks: ``[C, N]`` bool (design §3.3).

    Compressed key ``j`` covers tokens ``[j*s, j*s + k)``; block ``b`` covers
    ``[b*B_s, (b+1)*B_s)``; they overlap iff the intervals intersect. With
    ``k=32, s=16, B_s=64`` this is max-pool kernel 5, stride 4, padding 1.
    """
    j = torch.arange(num_ck, device=device)
    b = torch.arange(num_blocks, device=device)
    start = (j * cfg.kernel_stride).view(-1, 1)
    end = start + cfg.kernel_size
    return (start < (b + 1).view(1, -1) * cfg.block_size) & (end > (b * cfg.block_size).view(1, -1))


def pool_window(cfg: SelectionConfig) -> tuple[int, int, int]:
    """Max-pool geometry ``(kernel, stride, left_padding)`` mapping compressed keys to blocks.

    Derived from the overlap rule of :func:`block_overlap` (design §3.3): with
    ``r = block_size / kernel_stride`` and ``p = ceil(kernel_size / kernel_stride) - 1``,
    block ``b`` pools compressed keys ``b*r - p .. b*r + r - 1``, i.e. kernel ``r + p``,
    stride ``r``, left padding ``p`` (5, 4, 1 for ``k=32, s=16, B_s=64``).
    """
    r = cfg.block_size // cfg.kernel_stride
    p = -(-cfg.kernel_size // cfg.kernel_stride) - 1
    return r + p, r, p


def pool_to_blocks(scores: torch.Tensor, num_blocks: int, cfg: SelectionConfig) -> torch.Tensor:
    """Max-pool compressed scores onto KV blocks (design §3.3).

    Args:
        scores: ``[..., C]``; invisible entries must be ``-inf`` (or 0 for softmax
            scores, which are non-negative).
        num_blocks: ``N``, KV blocks of the context (``ceil(tokens / block_size)``).
        cfg: the block size and compression geometry (:func:`pool_window`).
    Returns:
        ``[..., N]`` fp32: per block the max over the compressed keys overlapping it
        (:func:`block_overlap`), ``-inf`` where none exists.
    """
    kernel, stride, pad = pool_window(cfg)
    num_ck = scores.shape[-1]
    right = max(0, (num_blocks - 1) * stride + kernel - pad - num_ck)
    padded = torch.nn.functional.pad(scores.float(), (pad, right), value=NEG_INF)
    return padded.unfold(-1, kernel, stride)[..., :num_blocks, :].amax(-1)


def _rank_key(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 ranking keys for ``[..., N]`` fp32 scores: larger score first, and
    equal scores (adjacent blocks share a compressed key, softmax underflows to 0) go to
    the lower block index. The fp32 bits are mapped to order-preserving int32 values and
    shifted left by 24 bits; the low bits hold ``2^24 - 1 - index``."""
    if scores.shape[-1] >= 1 << 24:
        raise ValueError("more than 2^24 blocks per row are not supported")
    bits = scores.float().contiguous().view(torch.int32)
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    index = torch.arange(scores.shape[-1], device=scores.device)
    return (mono << 24) + ((1 << 24) - 1 - index)


def forced_blocks(q_pos: torch.Tensor, num_blocks: int, cfg: SelectionConfig) -> torch.Tensor:
    """Blocks the top-k never competes for: ``[B, 1, Tq, N]`` bool (design §3.4).

    True for the forced blocks (the ``init_blocks`` sinks and the ``local_blocks`` most
    recent valid blocks) and for the causally invalid ones (after the query's block).
    ``q_pos [B, Tq]`` int64 token positions; ``num_blocks`` ``N``.
    """
    blocks = torch.arange(num_blocks, device=q_pos.device).view(1, 1, 1, -1)
    cur = (q_pos // cfg.block_size).unsqueeze(1).unsqueeze(-1)
    return (blocks < cfg.init_blocks) | (blocks > cur - cfg.local_blocks) | (blocks > cur)


def select_blocks(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig) -> torch.Tensor:
    """The selection rule (design §3.4, §3.6): sinks + local window + top-k, per KV head.

    For a query at position ``t`` the causally valid blocks are ``0 .. t // B_s``.
    Forced: blocks ``< init_blocks`` and the ``local_blocks`` most recent valid blocks.
    Then the ``topk_blocks`` highest-scoring other valid blocks (ties go to the lower
    block index). If the budget covers every valid block, or ``t + 1 < dense_len``
    (dense fallback), every valid block is selected.

    Args:
        block_scores: ``[B, H, Tq, N]``; larger is better; ``-inf`` and NaN count as
            unscored (ranked below every scored block, chosen only to fill the top-k).
        q_pos: ``[B, Tq]`` int64 query positions.
    Returns:
        ``[B, H, Tq, N]`` bool block mask.
    Raises:
        ValueError: ``N >= 2^24`` blocks per row (the tie-breaking key's limit).
    """
    num_blocks = block_scores.shape[-1]
    blocks = torch.arange(num_blocks, device=block_scores.device).view(1, 1, 1, -1)
    valid = blocks <= (q_pos // cfg.block_size).unsqueeze(1).unsqueeze(-1)  # [B,1,Tq,N]
    forced = forced_blocks(q_pos, num_blocks, cfg)  # and invalid, which `valid` removes
    dense = ((q_pos + 1 < cfg.dense_len) | (q_pos // cfg.block_size + 1 <= cfg.budget_blocks))
    dense = dense.unsqueeze(1).unsqueeze(-1)
    base = (valid & (forced | dense)).expand(block_scores.shape)
    k = min(cfg.topk_blocks, num_blocks)
    if k == 0:
        return base.clone()
    ranked = block_scores.float().nan_to_num(nan=_UNSCORED, neginf=_UNSCORED)
    ranked = ranked.masked_fill(~valid | base, NEG_INF)
    order = torch.topk(_rank_key(ranked), k, dim=-1).indices
    chosen = torch.zeros_like(base).scatter_(-1, order, True)
    return base | (chosen & valid & ~base & (ranked > NEG_INF))


def block_mask_to_indices(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Turn a bool block mask ``[..., N]`` into sorted int64 block ids ``[..., width]``,
    padded with -1 (the index lists the kernels read, design §3.5; callers cast to int32).

    ``width`` defaults to the largest number of selected blocks in any row (one host
    synchronisation); a smaller ``width`` keeps the lowest ids.
    """
    counts = mask.sum(-1)
    width = int(counts.max().item()) if width is None else width
    n = mask.shape[-1]
    key = torch.where(mask, torch.arange(n, device=mask.device), n)
    ids = torch.sort(key, dim=-1).values[..., :width]
    if ids.shape[-1] < width:
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], width - ids.shape[-1]), n)], -1)
    return torch.where(ids >= n, -1, ids)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           block_mask: torch.Tensor | None, q_pos: torch.Tensor,
                           kv_len: torch.Tensor, block_size: int,
                           chunk: int = 512) -> torch.Tensor:
    """Exact softmax attention over the selected blocks, causal (design §3.5).

    Each query chunk only reads keys up to its last position; the softmax itself is
    ``torch.nn.functional.scaled_dot_product_attention`` with a boolean mask.

    Args:
        q: ``[B, H, G, Tq, d]``. k, v: ``[B, H, T, d]``.
        block_mask: ``[B, H, Tq, N]`` bool with ``N >= ceil(T / block_size)``, or
            ``None`` for dense causal attention.
        q_pos: ``[B, Tq]`` positions; key ``i`` is visible iff ``i <= q_pos`` and
            ``i < kv_len``. A query that sees no key gets 0.
        kv_len: ``[B]`` valid keys per sequence (tokens).
        block_size: tokens per KV block (``B_s``).
        chunk: query tokens per chunk (bounds memory at ``B*H*G*chunk*T`` floats).
        q, k and v share one float dtype; ``q_pos`` and ``kv_len`` are int64. One host
        synchronisation per chunk (its largest position). ``Tq = 0`` gives an empty output.
    Returns:
        ``[B, H, G, Tq, d]`` in ``q``'s dtype.
    """
    b, h, g, tq, d = q.shape
    outs = []
    for start in range(0, tq, chunk):
        pos = q_pos[:, start:start + chunk]
        num_keys = min(int(pos.max().item()) + 1, k.shape[-2])
        key_idx = torch.arange(num_keys, device=q.device)
        allowed = (key_idx.view(1, 1, -1) <= pos.unsqueeze(-1)) & (
            key_idx.view(1, 1, -1) < kv_len.view(-1, 1, 1))  # [B,Tq,T]
        allowed = allowed.unsqueeze(1)  # [B,1,Tq,T]
        if block_mask is not None:
            blocks = -(-num_keys // block_size)
            tok = block_mask[:, :, start:start + chunk, :blocks].repeat_interleave(block_size, dim=-1)
            allowed = allowed & tok[..., :num_keys]  # [B,H,Tq,T]
        qc = q[..., start:start + chunk, :]
        rows = qc.shape[-2]
        # Fold KV heads into the batch: the G query heads of a group share one mask row.
        mask = allowed.expand(b, h, rows, num_keys).reshape(b * h, 1, rows, num_keys)
        out = torch.nn.functional.scaled_dot_product_attention(
            qc.reshape(b * h, g, rows, d), k[:, :, :num_keys].reshape(b * h, 1, num_keys, d),
            v[:, :, :num_keys].reshape(b * h, 1, num_keys, d), attn_mask=mask, enable_gqa=True)
        seen = mask.any(-1).view(b, h, 1, rows, 1)  # rows that see no key give 0, as the kernels do
        outs.append(torch.where(seen, out.view(b, h, g, rows, d), 0.0))
    return torch.cat(outs, dim=-2) if outs else q.new_zeros(q.shape)


def sum_onto_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-token values ``[..., T]`` summed onto KV blocks of ``block_size`` tokens:
    ``[..., ceil(T / block_size)]`` (the last block partial)."""
    num_blocks = -(-x.shape[-1] // block_size)
    x = torch.nn.functional.pad(x, (0, num_blocks * block_size - x.shape[-1]))
    return x.view(*x.shape[:-1], num_blocks, block_size).sum(-1)


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                         kv_len: torch.Tensor, block_size: int, chunk: int = 1024) -> torch.Tensor:
    """True attention mass per block, summed over the GQA group (oracle scores, design §8).

    ``mass[b, h, t, n] = sum_g sum_{i in block n} softmax_i(q_g . k_i / sqrt(d))`` over the
    causally visible keys, in fp32.

    Args:
        q: ``[B, H, G, Tq, d]`` (``Tq = 0`` gives ``[B, H, 0, N]``). k: ``[B, H, T, d]``.
        q_pos: ``[B, Tq]`` int64; kv_len: ``[B]`` int64 (tokens), as in
            :func:`block_sparse_attention`.
        block_size: tokens per KV block.
        chunk: query tokens per chunk (memory about ``B*H*G*chunk*T`` fp32).
    Returns:
        ``[B, H, Tq, N]`` fp32 with ``N = ceil(T / block_size)``; each row sums to ``G``
        (0 for a query that sees no key).
    """
    d = q.shape[-1]
    num_keys = k.shape[-2]
    num_blocks = -(-num_keys // block_size)
    key_idx = torch.arange(num_keys, device=q.device)
    kf = k.float()
    outs = []
    for start in range(0, q.shape[-2], chunk):
        qc = q[..., start:start + chunk, :].float()
        pos = q_pos[:, start:start + chunk]
        allowed = (key_idx.view(1, 1, -1) <= pos.unsqueeze(-1)) & (
            key_idx.view(1, 1, -1) < kv_len.view(-1, 1, 1))
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qc, kf) / math.sqrt(d)
        logits = logits.masked_fill(~allowed[:, None, None], NEG_INF)
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)  # [B,H,Tq,T]
        outs.append(sum_onto_blocks(probs, block_size))
    return torch.cat(outs, dim=-2) if outs else q.new_zeros(*q.shape[:2], 0, num_blocks, dtype=torch.float32)
