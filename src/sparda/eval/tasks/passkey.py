"""Passkey retrieval: a number hidden at a chosen depth of a long haystack (design §8)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sparda.errors import SpardaError
from sparda.eval.tasks.common import _haystack_ids

QUESTION = "What is the pass key mentioned in the text above? Answer with the number only."


@dataclass(frozen=True)
class PasskeySample:
    """One passkey prompt: ``prompt``, ``answer``, ``depth`` (0-1) and ``context_tokens``."""

    prompt: str
    answer: str
    depth: float
    context_tokens: int


def needle_sentence(key: str) -> str:
    """The sentence that carries the pass key."""
    return f" The pass key is {key}. Remember it. {key} is the pass key. "


def make_passkey(tokenizer, haystack: str, context_tokens: int, depth: float, seed: int,
                 key: str | None = None) -> PasskeySample:
    """Hide a 5-digit pass key at ``depth`` of ``context_tokens`` tokens of ``haystack`` (seeded).
    Raises SpardaError for a depth outside [0, 1] or a haystack too short."""
    if not 0.0 <= depth <= 1.0:
        raise SpardaError(f"depth must be in [0, 1], got {depth}")
    rng = random.Random(seed)
    key = key or str(rng.randint(10000, 99999))
    ids = _haystack_ids(tokenizer, haystack)  # encoded once per haystack (~0.4 s for the novel)
    if len(ids) < context_tokens:
        raise SpardaError(f"haystack has {len(ids)} tokens, fewer than the {context_tokens} asked for")
    offset = rng.randint(0, len(ids) - context_tokens)
    text = tokenizer.decode(list(ids[offset:offset + context_tokens]))
    cut = int(len(text) * depth)
    line = text.rfind("\n", 0, cut)
    cut = line + 1 if line > 0 and cut - line < 2000 else cut
    prompt = text[:cut] + needle_sentence(key) + text[cut:] + "\n\n" + QUESTION
    return PasskeySample(prompt=prompt, answer=key, depth=depth, context_tokens=context_tokens)


def passkey_correct(sample: PasskeySample, completion: str) -> bool:
    """True if the completion contains the pass key."""
    return sample.answer in completion
