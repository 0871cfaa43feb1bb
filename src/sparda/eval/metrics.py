"""Task scores and model-quality metrics of ``sparda eval`` (design §8): scoring, logit
comparison against dense, budgets in % of the context, decode block hit rates.
"""

from __future__ import annotations

import math
import re

import torch

from sparda.errors import SpardaError


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.strip().lower())


def exact_match(answers: tuple[str, ...] | list[str], completion: str) -> float:
    """1.0 if the completion, normalised (lower case, collapsed spaces, trailing period
    dropped), equals the answers joined by ``", "`` (or the single answer), else 0.0."""
    got = _norm(completion).rstrip(".")
    return float(got in {_norm(", ".join(answers)), _norm(" ".join(answers))})


def contains(answers: tuple[str, ...] | list[str], completion: str) -> float:
    """1.0 if the completion contains ``answers[0]`` (case-insensitive), else 0.0."""
    return float(answers[0].lower() in completion.lower())


def fraction_found(answers: tuple[str, ...] | list[str], completion: str) -> float:
    """Share (0-1) of ``answers`` the completion contains as whole words (case-insensitive)."""
    text = completion.lower()
    found = sum(bool(re.search(rf"(?<![\w]){re.escape(a.lower())}(?![\w])", text)) for a in answers)
    return found / len(answers)


SCORERS = {"exact": exact_match, "contains": contains, "fraction": fraction_found}


def score(sample, completion: str) -> float:
    """Score (0-1) of ``completion`` under ``sample.metric``. Raises SpardaError for an unknown metric."""
    if sample.metric not in SCORERS:
        raise SpardaError(f"unknown metric {sample.metric!r}; choose from {', '.join(SCORERS)}")
    return SCORERS[sample.metric](sample.answers, completion)


@torch.no_grad()
def logit_terms(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-position terms behind perplexity, agreement and KL, float64, no host sync.

    Args:
        logits, reference: ``[N, V]`` method and dense logits (any float dtype).
        targets: ``[N]`` int64 true next tokens.
    Returns:
        ``[N]`` float64 ``nll``, ``ref_nll`` (nats), ``agree`` (argmax equal, 0/1) and ``kl``
        (``KL(dense || method)``, nats).
    """
    lp = torch.log_softmax(logits.double(), -1)
    ref = torch.log_softmax(reference.double(), -1)
    tgt = targets.view(-1, 1)
    return {"nll": -lp.gather(-1, tgt)[:, 0], "ref_nll": -ref.gather(-1, tgt)[:, 0],
            "agree": (lp.argmax(-1) == ref.argmax(-1)).double(), "kl": (ref.exp() * (ref - lp)).sum(-1)}


@torch.no_grad()
def compare_logits(logits: torch.Tensor, reference: torch.Tensor, targets: torch.Tensor,
                   chunk: int = 1024) -> dict[str, float]:
    """:func:`logit_terms` summed over positions, ``chunk`` at a time (memory ``chunk x V`` fp64).

    Returns:
        ``positions``, ``nll_sum``, ``ref_nll_sum``, ``agree_sum``, ``kl_sum`` (nats).
    Raises:
        SpardaError: mismatched shapes.
    """
    if logits.shape != reference.shape or logits.shape[0] != targets.shape[0]:
        raise SpardaError(f"logit shapes differ: {tuple(logits.shape)} vs {tuple(reference.shape)} "
                          f"with {tuple(targets.shape)} targets")
    out = {"positions": int(targets.shape[0]), "nll_sum": 0.0, "ref_nll_sum": 0.0, "agree_sum": 0.0, "kl_sum": 0.0}
    for start in range(0, targets.shape[0], chunk):
        sl = slice(start, start + chunk)
        for name, term in logit_terms(logits[sl], reference[sl], targets[sl]).items():
            out[f"{name}_sum"] += term.sum().item()
    return out


def perplexity(nll_sum: float, positions: int) -> float:
    """``exp(nll_sum / positions)``; ``nan`` for zero positions."""
    return math.exp(nll_sum / positions) if positions else float("nan")


def budget_topk(percent: float, context_tokens: int, selection) -> int:
    """``topk_blocks`` making the whole budget about ``percent`` % of a ``context_tokens`` context's
    blocks (>= 0). Raises SpardaError unless ``0 < percent <= 100``."""
    if not 0 < percent <= 100:
        raise SpardaError(f"budget must be a percentage in (0, 100], got {percent}")
    blocks = -(-context_tokens // selection.block_size)
    return max(0, round(blocks * percent / 100) - selection.init_blocks - selection.local_blocks)


def runtime_hit_rate(offload_stats: dict) -> float | None:
    """Block hit rate (0-1) counted by the offload runtime (design §6) from
    ``Completion.stats["offload"]``; ``None`` when it fetched nothing."""
    def total(value) -> float:
        return float(torch.as_tensor(value, dtype=torch.float64).sum())

    hits, misses = offload_stats.get("hits"), offload_stats.get("misses")
    if hits is not None and misses is not None:
        return total(hits) / (total(hits) + total(misses)) if total(hits) + total(misses) else None
    rate = offload_stats.get("hit_rate")
    return None if rate is None else float(rate)


class HitRateTracker:
    """Step-to-step block hit rate of an on-device block-sparse method in decode, per row (design §8).

    Wraps ``method.select`` (instance attribute): blocks selected at step ``t`` that were also
    selected at ``t - 1`` over blocks selected at ``t``, summed over layers and KV heads. Device
    buffers, no host sync (CUDA graphs). Dense methods report ``None``; offloaded ones use
    :func:`runtime_hit_rate`.
    """

    def __init__(self, method) -> None:
        self._prev: dict[int, torch.Tensor] = {}  # layer -> [B, H_kv, N] bool, last step's mask
        self._last_pos: dict[int, torch.Tensor] = {}  # layer -> [B] int64, last recorded position
        self._hits: torch.Tensor | None = None  # [B, positions] int64, summed over layers
        self._selected: torch.Tensor | None = None
        selection = getattr(method, "selection", None)
        #: tokens per KV block: the buffers span ``N * block_size`` positions
        self._block_size = getattr(selection, "block_size", 64)
        self.active = hasattr(method, "select")
        if self.active:
            inner = method.select

            def select(layer, q, h, cache, step, *args, **kwargs):
                mask = inner(layer, q, h, cache, step, *args, **kwargs)
                if step.phase == "decode":
                    self._record(layer, mask[..., -1, :], step.q_pos[:, -1])
                return mask

            method.select = select

    def _buffers(self, layer: int, mask: torch.Tensor) -> None:
        """(Re)allocate for ``mask [B, H_kv, N]`` (eager steps only)."""
        batch, _, blocks = mask.shape
        width = blocks * self._block_size
        if self._hits is None or self._hits.shape != (batch, width) or self._hits.device != mask.device:
            self._hits = torch.zeros(batch, width, dtype=torch.long, device=mask.device)
            self._selected = torch.zeros_like(self._hits)
            self._prev.clear()
            self._last_pos.clear()
        if layer not in self._prev or self._prev[layer].shape != mask.shape:
            self._prev[layer] = torch.zeros_like(mask, dtype=torch.bool)
            self._last_pos[layer] = torch.full((batch,), -2, dtype=torch.long, device=mask.device)

    def _record(self, layer: int, mask: torch.Tensor, pos: torch.Tensor) -> None:
        """Add one decode step of ``layer``: ``mask [B, H_kv, N]`` bool at ``pos [B]`` int64, in place."""
        self._buffers(layer, mask)
        prev, last = self._prev[layer], self._last_pos[layer]
        follows = (last == pos - 1).long()  # [B]: the row's previous step was recorded
        hits = (mask & prev).flatten(1).sum(-1) * follows
        selected = mask.flatten(1).sum(-1) * follows
        index = pos.view(-1, 1)
        self._hits.scatter_add_(1, index, hits.view(-1, 1))
        self._selected.scatter_add_(1, index, selected.view(-1, 1))
        prev.copy_(mask)
        last.copy_(pos)

    def reset(self) -> None:
        """Zero the counts and forget the previous steps (call between generations)."""
        with torch.inference_mode():  # the buffers are made inside generate's inference mode
            if self._hits is not None:
                self._hits.zero_()
                self._selected.zero_()
            for last in self._last_pos.values():
                last.fill_(-2)

    def take_rows(self, spans: list[tuple[int, int]]) -> list[float | None]:
        """Hit rate (0-1, ``None`` if nothing recorded) of row ``b`` over decode positions ``spans[b] =
        (first, last)`` inclusive, then :meth:`reset`."""
        rates: list[float | None] = []
        if self._hits is None:
            rates = [None] * len(spans)
        else:
            hits, selected = self._hits.cpu(), self._selected.cpu()
            for row, (first, last) in enumerate(spans):
                sel = int(selected[row, first:last + 1].sum()) if last >= first else 0
                rates.append(int(hits[row, first:last + 1].sum()) / sel if sel else None)
        self.reset()
        return rates
