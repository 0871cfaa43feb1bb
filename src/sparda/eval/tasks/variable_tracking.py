"""RULER-style variable tracking (design §8): list every variable a chain assigns the value to."""

from __future__ import annotations

import random
import string

from sparda.eval.tasks.common import NOISE, TaskSample, fill_prompt


def _names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names:
            names.append(name)
    return names


def make_variable_tracking(tokenizer, haystack: str, context_tokens: int, seed: int,
                           num_chains: int = 1, num_hops: int = 4) -> TaskSample:
    """One prompt of about ``context_tokens`` tokens: ``num_chains`` chains of ``num_hops + 1``
    assignments, the first one asked; ``fraction`` scoring, ``depth=None``. Raises SpardaError
    if the length is too short for the chains."""
    rng = random.Random(f"vt-{seed}")
    haystack = haystack or NOISE
    names = _names(rng, num_chains * (num_hops + 1))
    values = [str(v) for v in rng.sample(range(10_000, 100_000), num_chains)]
    needles = []
    for c in range(num_chains):
        chain = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        depths = sorted(rng.uniform(0.02, 0.95) for _ in chain)
        needles.append((depths[0], f"VAR {chain[0]} = {values[c]} ."))
        needles += [(d, f"VAR {cur} = VAR {prev} .") for d, prev, cur in zip(depths[1:], chain, chain[1:])]
    question = (f"Find all variables that are assigned the value {values[0]} in the text above. "
                "Answer with the variable names only, separated by spaces.")
    prompt = fill_prompt(tokenizer, haystack, context_tokens, needles, question, rng)
    answers = tuple(names[:num_hops + 1])
    return TaskSample(task="vt", prompt=prompt, answers=answers, metric="fraction", depth=None,
                      context_tokens=context_tokens, max_new_tokens=8 * len(answers) + 8)
