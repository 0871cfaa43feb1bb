"""Next-token sampling: greedy, or temperature with top-k / top-p (nucleus) filtering, per request."""

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
        keep[..., 0] = True  # the most likely token always stays (top_p under float32's least is 0 here)
        sorted_probs = sorted_probs * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample_requests(logits: torch.Tensor, params: list, generators: list) -> list[tuple[int, dict | None]]:
    """One token per request from ``logits [n, V]`` fp32, each with its own
    :class:`~sparda.engine.sampling_params.SamplingParams` and ``torch.Generator``.

    Returns ``(token_id, logprob entry or None)`` per request; the entry (with
    ``params.logprobs``) holds ``token_id``, ``logprob`` (natural log at temperature 1) and
    ``top_logprobs`` ``{token_id: logprob}`` of the ``logprobs`` most likely tokens."""
    tokens: list[int | None] = [None] * len(params)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:  # one host sync for every greedy row
        for i, tok in zip(greedy, logits[greedy].argmax(-1).tolist()):
            tokens[i] = tok
    for i, p in enumerate(params):
        if tokens[i] is None:
            row = logits[i:i + 1]
            if 0 < p.top_k < row.shape[-1]:
                kth = row.topk(p.top_k, dim=-1).values[:, -1:]
                row = row.masked_fill(row < kth, float("-inf"))
            tokens[i] = int(sample(row, p.temperature, p.top_p, generators[i])[0])
    out = []
    for i, p in enumerate(params):
        entry = None
        if p.logprobs is not None:
            logp = torch.log_softmax(logits[i].float(), dim=-1)
            top = logp.topk(p.logprobs) if p.logprobs else None
            entry = {"token_id": tokens[i], "logprob": float(logp[tokens[i]]),
                     "top_logprobs": {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))}
        out.append((tokens[i], entry))
    return out
