"""RULER-style needle-in-a-haystack: single, multi-key, multi-value, multi-query (design §8)."""

from __future__ import annotations

import random

from sparda.eval.tasks.common import TaskSample, check_depth, fill_prompt, spread_depths, word_list


def _needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def _keys(rng: random.Random, count: int) -> list[str]:
    adjectives, nouns = word_list("adjective"), word_list("noun")
    keys: list[str] = []
    while len(keys) < count:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    return keys


def _values(rng: random.Random, count: int) -> list[str]:
    return [str(v) for v in rng.sample(range(1_000_000, 10_000_000), count)]


def make_niah(tokenizer, haystack: str, context_tokens: int, depth: float, seed: int,
              kind: str = "single", num_needles: int = 4, num_queries: int = 2) -> TaskSample:
    """One NIAH prompt of about ``context_tokens`` tokens, seeded by ``seed``.

    ``kind``: ``single``, ``multikey`` (``num_needles`` keys, one asked), ``multivalue`` (one
    key, ``num_needles`` values) or ``multiquery`` (``num_queries`` keys asked); ``contains``
    scoring for the first two, ``fraction`` otherwise.

    Raises:
        SpardaError: bad depth, or a length too short for the needles.
    """
    check_depth(depth)
    rng = random.Random(f"niah-{kind}-{seed}")
    count = 1 if kind == "single" else num_needles
    depths = spread_depths(rng, count, depth)
    if kind == "multivalue":
        key = _keys(rng, 1)[0]
        values = _values(rng, count)
        needles = [(d, _needle(key, v)) for d, v in zip(depths, values)]
        question = (f"What are all the special magic numbers for {key} mentioned in the provided text? "
                    "Answer with the numbers only, separated by commas.")
        answers, metric = values, "fraction"
    else:
        keys, values = _keys(rng, count), _values(rng, count)
        needles = [(d, _needle(k, v)) for d, k, v in zip(depths, keys, values)]
        asked = min(num_queries, count) if kind == "multiquery" else 1
        if asked == 1:
            question = (f"What is the special magic number for {keys[0]} mentioned in the provided text? "
                        "Answer with the number only.")
        else:
            question = (f"What are the special magic numbers for {', '.join(keys[:asked])} mentioned in the "
                        "provided text? Answer with the numbers only, separated by commas.")
        answers, metric = values[:asked], ("fraction" if asked > 1 else "contains")
    prompt = fill_prompt(tokenizer, haystack, context_tokens, needles, question, rng)
    return TaskSample(task=f"niah-{kind}", prompt=prompt, answers=tuple(answers), metric=metric,
                      depth=depth, context_tokens=context_tokens, max_new_tokens=16 * len(answers) + 8)
