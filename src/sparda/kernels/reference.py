"""Pure-PyTorch reference of the block-sparse backbone and the lookahead rule (design §3, §4).

The twin of every Triton kernel and the CPU runtime's implementation. Scores, pooling,
compressed-key means and attention mass are fp32; :func:`block_sparse_attention` runs SDPA
in the inputs' dtype. Shapes: keys/values ``[B, H, T, d]``, queries ``[B, H, G, Tq, d]``
(query head ``h*G + g`` of KV head ``h``), ``q_pos [B, Tq]`` int64 tokens, compressed keys
``[B, H, C, d]``, block scores/masks ``[B, H, Tq, N]``; notation of design §2.
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
    """RoPE, half-split: ``x [B, H, T, d]`` by ``cos, sin [B, 1, T, d]`` -> ``x * cos +
    rotate_half(x) * sin`` in the promoted dtype (Su et al. 2021)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def num_compressed(num_tokens: int, kernel: int, stride: int) -> int:
    """Number of complete compression windows over ``num_tokens`` tokens (design §3.1)."""
    return 0 if num_tokens < kernel else (num_tokens - kernel) // stride + 1


def compress_keys(k: torch.Tensor, kernel: int, stride: int) -> torch.Tensor:
    """Mean-pool keys ``[..., T, d]`` (any float dtype) into ``[..., C, d]`` of ``k``'s dtype,
    fp32 mean (design §3.1)."""
    num = num_compressed(k.shape[-2], kernel, stride)
    if num == 0:
        return k.new_zeros(*k.shape[:-2], 0, k.shape[-1])
    windows = k.float().unfold(-2, kernel, stride)[..., :num, :, :]  # [..., C, d, kernel]
    return windows.mean(-1).to(k.dtype)


def update_compressed_keys(ck: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor,
                           kernel: int, stride: int, ring: bool = False) -> None:
    """Write the compressed key each row's new token completes, in place, no host sync (design §3.1).

    Args:
        ck: ``[B_all, H, C_cap, d]``, written in place.
        keys: ``[B_all, H, T, d]`` with this step's token written, or with ``ring`` the last
            ``kernel`` keys ``[B_all, H, kernel, d]`` (key ``t`` at ``t % kernel``).
        rows: ``[B]`` int64 cache rows. pos: ``[B]`` int64 positions. kernel, stride: tokens.
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
    """Causal visibility of compressed keys (design §3.1): ``[B, Tq, C]`` bool from ``q_pos [B, Tq]`` int64."""
    ends = torch.arange(num_ck, device=q_pos.device) * stride + kernel - 1
    return ends.view(1, 1, -1) <= q_pos.unsqueeze(-1)


def lookahead_pos(q_pos: torch.Tensor, target_layer: int, ahead: int = 1) -> torch.Tensor:
    """The lookahead rule (design §4, §6.2): ``[B, Tq]`` int64 positions up to which a selector
    run ``ahead`` layers before ``target_layer`` sees the target's compressed keys: ``q_pos - 1``
    when it runs in an earlier layer, ``q_pos`` for layer 0's own ``W^C_0`` (``ahead`` counts as 0
    there). Raises ValueError for ``ahead > target_layer >= 1`` (no such layer) or ``ahead < 0``."""
    if ahead < 0 or (target_layer > 0 and ahead > target_layer):
        raise ValueError(f"no selector runs {ahead} layers before layer {target_layer}")
    return q_pos - 1 if target_layer > 0 and ahead > 0 else q_pos


def query_group_scores(q: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                       kernel: int, stride: int) -> torch.Tensor:
    """Query-based compressed scores summed over the GQA group (design §3.2).

    Args:
        q: ``[B, H, G, Tq, d]`` any float dtype (fp32 math). ck: ``[B, H, C, d]``.
        q_pos: ``[B, Tq]`` int64. kernel, stride: tokens.
    Returns:
        ``[B, H, Tq, C]`` fp32, 0 at invisible keys.
    """
    d = q.shape[-1]
    logits = torch.matmul(q.float(), ck.float().unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    vis = compressed_visible(q_pos, ck.shape[-2], kernel, stride)[:, None, None]  # [B,1,1,Tq,C]
    logits = logits.masked_fill(~vis, NEG_INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    return probs.sum(dim=2)


def forecast_scores(f: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor,
                    kernel: int, stride: int) -> torch.Tensor:
    """Forecast scores, raw dot products (design §4): ``f [B, H, Tq, d]`` (RoPE applied), ``ck
    [B, H, C, d]``, ``q_pos [B, Tq]`` int64 -> ``[B, H, Tq, C]`` fp32, ``-inf`` where invisible."""
    scores = torch.einsum("bhqd,bhcd->bhqc", f.float(), ck.float())
    vis = compressed_visible(q_pos, ck.shape[-2], kernel, stride)[:, None]
    return scores.masked_fill(~vis, NEG_INF)


def block_overlap(num_ck: int, num_blocks: int, cfg: SelectionConfig,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """``[C, N]`` bool: compressed key ``j`` overlaps block ``b`` (design §3.3)."""
    j = torch.arange(num_ck, device=device)
    b = torch.arange(num_blocks, device=device)
    start = (j * cfg.kernel_stride).view(-1, 1)
    end = start + cfg.kernel_size
    return (start < (b + 1).view(1, -1) * cfg.block_size) & (end > (b * cfg.block_size).view(1, -1))


def pool_window(cfg: SelectionConfig) -> tuple[int, int, int]:
    """Max-pool geometry ``(kernel, stride, left_padding)`` from compressed keys to blocks (design §3.3)."""
    r = cfg.block_size // cfg.kernel_stride
    p = -(-cfg.kernel_size // cfg.kernel_stride) - 1
    return r + p, r, p


def pool_to_blocks(scores: torch.Tensor, num_blocks: int, cfg: SelectionConfig) -> torch.Tensor:
    """Max-pool compressed scores ``[..., C]`` onto ``N`` blocks (design §3.3).

    Args:
        scores: ``[..., C]``; invisible entries ``-inf`` (or 0 for softmax scores).
        num_blocks: ``N``. cfg: block size and compression geometry.
    Returns:
        ``[..., N]`` fp32, ``-inf`` where no key overlaps.
    """
    kernel, stride, pad = pool_window(cfg)
    num_ck = scores.shape[-1]
    right = max(0, (num_blocks - 1) * stride + kernel - pad - num_ck)
    padded = torch.nn.functional.pad(scores.float(), (pad, right), value=NEG_INF)
    return padded.unfold(-1, kernel, stride)[..., :num_blocks, :].amax(-1)


def _rank_key(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 ranking keys of ``[..., N]`` fp32 scores: order-preserving int32 bits << 24,
    low bits ``2^24 - 1 - index`` (ties to the lower block, design §3.4)."""
    if scores.shape[-1] >= 1 << 24:
        raise ValueError("more than 2^24 blocks per row are not supported")
    bits = scores.float().contiguous().view(torch.int32)
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()
    index = torch.arange(scores.shape[-1], device=scores.device)
    return (mono << 24) + ((1 << 24) - 1 - index)


def forced_blocks(q_pos: torch.Tensor, num_blocks: int, cfg: SelectionConfig) -> torch.Tensor:
    """``[B, 1, Tq, N]`` bool: the forced blocks and the causally invalid ones (design §3.4)."""
    blocks = torch.arange(num_blocks, device=q_pos.device).view(1, 1, 1, -1)
    cur = (q_pos // cfg.block_size).unsqueeze(1).unsqueeze(-1)
    return (blocks < cfg.init_blocks) | (blocks > cur - cfg.local_blocks) | (blocks > cur)


def block_mass(block_scores: torch.Tensor, valid: torch.Tensor, logit_scale: float | None) -> torch.Tensor:
    """Each valid block's share of the row's mass, fp32 (design §3.12).

    Args:
        block_scores: ``[..., N]`` pooled block scores; non-finite ones carry no mass.
        valid: bool, broadcastable: the causally visible blocks.
        logit_scale: ``None``: the scores are probabilities (``mass = s / sum s``, negatives
            0); a float ``c``: logits (``mass = softmax(c * s)`` over the valid blocks).
    Returns:
        ``[..., N]`` fp32 summing to 1 over each row (all 0 where the row has no mass).
    """
    s = block_scores.float()
    ok = valid & torch.isfinite(s)
    if logit_scale is None:
        w = torch.where(ok, s.clamp(min=0.0), 0.0)
    else:
        y = torch.where(ok, s * logit_scale, NEG_INF)
        top = y.amax(-1, keepdim=True)
        w = torch.where(ok, torch.exp(y - torch.where(top == NEG_INF, 0.0, top)), 0.0)
    total = w.sum(-1, keepdim=True)
    return torch.where(total > 0, w / torch.where(total > 0, total, 1.0), 0.0)


def _adaptive_counts(order: torch.Tensor, cand: torch.Tensor, mass: torch.Tensor, base: torch.Tensor,
                     cfg: SelectionConfig) -> torch.Tensor:
    """``[..., 1]`` scored blocks taken under ``topp_mass`` (design §3.12): the candidates in
    rank ``order`` whose preceding mass (forced blocks first) is below ``p``, clamped to
    ``[min_scored_blocks, topk_blocks]`` and to the candidates there are."""
    p = float(cfg.topp_mass)
    m_sorted = torch.gather(torch.where(cand, mass, 0.0), -1, order)
    forced = torch.where(base, mass, 0.0).sum(-1, keepdim=True)
    before = forced + torch.cumsum(m_sorted, -1) - m_sorted
    no_mass = mass.sum(-1, keepdim=True) == 0
    taken = torch.gather(cand, -1, order) & ((before < p) | (p >= 1.0) | no_mass)
    n_cand = cand.sum(-1, keepdim=True)
    count = taken.sum(-1, keepdim=True).clamp(cfg.min_scored_blocks, cfg.topk_blocks)
    return torch.minimum(count, n_cand)


def select_blocks(block_scores: torch.Tensor, q_pos: torch.Tensor, cfg: SelectionConfig, *,
                  adaptive: bool = False, logit_scale: float | None = None) -> torch.Tensor:
    """The selection rule, sinks + local window + top-k per KV head (design §3.4, §3.6).

    Args:
        block_scores: ``[B, H, Tq, N]``; ``-inf`` and NaN rank below every finite score.
        q_pos: ``[B, Tq]`` int64. cfg: the selection config.
        adaptive: decode: with ``cfg.topp_mass`` set, take the mass-adaptive number of
            scored blocks instead of ``topk_blocks`` (design §3.12).
        logit_scale: what the scores are for the mass (:func:`block_mass`).
    Returns:
        ``[B, H, Tq, N]`` bool block mask.
    Raises:
        ValueError: ``N >= 2^24`` blocks per row.
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
    if adaptive and cfg.adaptive:
        cand = valid & ~base
        order = torch.sort(_rank_key(ranked), dim=-1, descending=True).indices
        mass = block_mass(block_scores, valid, logit_scale)
        count = _adaptive_counts(order, cand, mass, base, cfg)
        take = torch.arange(num_blocks, device=order.device) < count  # the first `count` in rank order
        return base | torch.zeros_like(base).scatter_(-1, order, take)
    order = torch.topk(_rank_key(ranked), k, dim=-1).indices
    chosen = torch.zeros_like(base).scatter_(-1, order, True)
    return base | (chosen & valid & ~base & (ranked > NEG_INF))


def block_mask_to_indices(mask: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Bool mask ``[..., N]`` -> ascending int64 ids ``[..., width]``, ``-1`` padded (design §3.5).
    ``width`` defaults to the widest row (one host sync); a smaller one keeps the lowest ids."""
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

    Args:
        q: ``[B, H, G, Tq, d]``. k, v: ``[B, H, T, d]``, one float dtype.
        block_mask: ``[B, H, Tq, N]`` bool, ``N >= ceil(T / block_size)``, or ``None`` (dense).
        q_pos: ``[B, Tq]`` int64; key ``i`` visible iff ``i <= q_pos`` and ``i < kv_len``.
        kv_len: ``[B]`` int64. block_size: tokens.
        chunk: query tokens per chunk (memory ``B*H*G*chunk*T``; one host sync each).
    Returns:
        ``[B, H, G, Tq, d]`` in ``q``'s dtype; a row that sees no key is 0.
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
    """Per-token ``[..., T]`` summed onto blocks: ``[..., ceil(T / block_size)]``."""
    num_blocks = -(-x.shape[-1] // block_size)
    x = torch.nn.functional.pad(x, (0, num_blocks * block_size - x.shape[-1]))
    return x.view(*x.shape[:-1], num_blocks, block_size).sum(-1)


def block_attention_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor,
                         kv_len: torch.Tensor, block_size: int, chunk: int = 1024) -> torch.Tensor:
    """True attention mass per block, summed over the group, fp32 (oracle scores, design §8).

    Args:
        q: ``[B, H, G, Tq, d]``. k: ``[B, H, T, d]``. q_pos: ``[B, Tq]``, kv_len: ``[B]`` int64.
        block_size: tokens. chunk: query tokens per chunk (memory ``B*H*G*chunk*T`` fp32).
    Returns:
        ``[B, H, Tq, ceil(T / block_size)]`` fp32; rows sum to ``G`` (0 if no key is visible).
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
