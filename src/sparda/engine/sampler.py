"""Next-token sampling: greedy, or temperature with top-p (nucleus) filtering."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, V]`` fp32.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
    Returns:
        ``[B]`` int64 token ids.
    """
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
