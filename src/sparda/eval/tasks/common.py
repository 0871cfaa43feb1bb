"""What the tasks share: the sample record, haystacks, needle insertion, word lists (design §8).
Deterministic in ``seed``; no downloads (words from ``wonderwords``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

from sparda.errors import SpardaError

#: RULER's synthetic filler: carries no information, so any retrieved fact is the needle.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


@dataclass(frozen=True)
class TaskSample:
    """One evaluation prompt: ``task``, ``prompt`` (before any chat template), ``answers``,
    ``metric`` (``contains`` or ``fraction``, :func:`sparda.eval.metrics.score`), ``depth`` of
    the queried needle 0-1 (``None`` without one), ``context_tokens`` and ``max_new_tokens``."""

    task: str
    prompt: str
    answers: tuple[str, ...]
    metric: str
    depth: float | None
    context_tokens: int
    max_new_tokens: int = 32
    meta: dict = field(default_factory=dict, compare=False)


def check_depth(depth: float) -> None:
    """Raise SpardaError unless ``0 <= depth <= 1``."""
    if not 0.0 <= depth <= 1.0:
        raise SpardaError(f"depth must be in [0, 1], got {depth}")


def count_tokens(tokenizer, text: str) -> int:
    """Number of tokens of ``text`` (no special tokens)."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def haystack_window(tokenizer, haystack: str, num_tokens: int, rng: random.Random) -> str:
    """``num_tokens`` tokens of ``haystack`` (repeated if shorter) from a seeded offset. Raises
    SpardaError if ``num_tokens < 1`` or the haystack is empty."""
    if num_tokens < 1:
        raise SpardaError(f"context too short for this task's needles and question ({num_tokens} tokens left); "
                          "raise --lengths")
    ids = _haystack_ids(tokenizer, haystack)
    if not ids:
        raise SpardaError("empty haystack text; pass a non-empty --text file")
    if len(ids) < num_tokens:
        ids = ids * (num_tokens // len(ids) + 1)
    offset = rng.randint(0, len(ids) - num_tokens)
    return tokenizer.decode(list(ids[offset:offset + num_tokens]))


@lru_cache(maxsize=4)
def _haystack_ids(tokenizer, haystack: str) -> tuple[int, ...]:
    """Token ids of ``haystack``, cached for the next sample."""
    return tuple(tokenizer.encode(haystack, add_special_tokens=False))


def insert_at_depths(text: str, needles: list[tuple[float, str]]) -> str:
    """Insert each ``(depth, sentence)`` at the line or sentence break before ``depth`` (0-1, by
    characters of the original text). Raises SpardaError for a depth outside [0, 1]."""
    cuts = []
    for index, (depth, needle) in enumerate(needles):
        check_depth(depth)
        cut = int(len(text) * depth)
        brk = max(text.rfind("\n", 0, cut), text.rfind(". ", 0, cut) + 1)
        cuts.append((brk + 1 if brk > 0 and cut - brk < 400 else cut, index, needle))
    for cut, _, needle in sorted(cuts, key=lambda c: (-c[0], -c[1])):  # keeps list order on ties
        text = text[:cut] + " " + needle.strip() + " " + text[cut:]
    return text


def fill_prompt(tokenizer, haystack: str, context_tokens: int, needles: list[tuple[float, str]],
                question: str, rng: random.Random) -> str:
    """Haystack window + needles + question of about ``context_tokens`` tokens. Raises SpardaError
    if the length leaves no room."""
    fixed = count_tokens(tokenizer, " ".join(n for _, n in needles) + "\n\n" + question) + 2 * len(needles) + 4
    text = haystack_window(tokenizer, haystack, context_tokens - fixed, rng)
    return insert_at_depths(text, needles) + "\n\n" + question


def spread_depths(rng: random.Random, count: int, fixed: float | None = None) -> list[float]:
    """``count`` depths: the first is ``fixed`` (if given), the rest uniform in [0, 1]."""
    depths = [rng.random() for _ in range(count)]
    if fixed is not None:
        depths[0] = fixed
    return depths


@lru_cache(maxsize=4)
def word_list(kind: str = "noun") -> tuple[str, ...]:
    """Sorted lower-case single words of ``wonderwords`` (``noun``, ``adjective``, ``verb``),
    profanities removed. Raises SpardaError for an unknown ``kind``."""
    import wonderwords

    files = {"noun": wonderwords.Defaults.NOUNS, "adjective": wonderwords.Defaults.ADJECTIVES,
             "verb": wonderwords.Defaults.VERBS}
    if kind not in files:
        raise SpardaError(f"unknown word list {kind!r}; choose noun, adjective or verb")
    assets = resources.files("wonderwords") / "assets"
    bad = set((assets / wonderwords.Defaults.PROFANITIES.value).read_text().split())
    words = (assets / files[kind].value).read_text().split()
    return tuple(sorted({w.lower() for w in words if w.isalpha() and w.isascii() and w.lower() not in bad}))
