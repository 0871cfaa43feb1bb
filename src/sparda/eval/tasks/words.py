"""RULER-style aggregation tasks (design §8): common-words extraction (``cwe``) and
frequent-words extraction (``fwe``). Words come from the ``wonderwords`` noun list."""

from __future__ import annotations

import random

from sparda.errors import SpardaError
from sparda.eval.tasks.common import TaskSample, count_tokens, word_list


def _fit(build, tokenizer, context_tokens: int, start: int) -> tuple[str, object]:
    """The largest ``n`` whose ``build(n) -> (text, extra)`` stays under ``context_tokens`` tokens."""
    n = max(start, 1)
    for _ in range(4):
        text, extra = build(n)
        have = count_tokens(tokenizer, text)
        if abs(have - context_tokens) < 0.01 * context_tokens and have <= context_tokens:
            return text, extra
        n = max(1, int(n * context_tokens / have * (0.99 if have > context_tokens else 1.0)))
    text, extra = build(n)
    while count_tokens(tokenizer, text) > context_tokens and n > 1:
        n = int(n * 0.97)
        text, extra = build(n)
    return text, extra


def make_common_words(tokenizer, context_tokens: int, seed: int, num_common: int = 10,
                      freq_common: int | None = None, freq_rare: int | None = None) -> TaskSample:
    """Numbered word list, ``num_common`` words ``freq_common`` times (RULER: 30, less for short
    contexts), the rest ``freq_rare`` times; ``fraction`` scoring, ``depth=None``. Raises
    SpardaError if the list cannot fill ``context_tokens``."""
    if freq_common is None:
        freq_common = min(30, max(4, context_tokens // (12 * num_common)))
    if freq_rare is None:
        freq_rare = 3 if freq_common >= 12 else 1
    rng = random.Random(f"cwe-{seed}")
    vocab = list(word_list("noun"))
    rng.shuffle(vocab)
    common = vocab[:num_common]
    head = ("Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n")
    question = (f"\nQuestion: What are the {num_common} most common words in the above list? "
                "Answer with the words only, separated by commas.")

    def build(num_rare: int):
        if num_rare > len(vocab) - num_common:
            raise SpardaError(f"the word list is too small for {context_tokens} tokens of cwe; use a shorter length")
        words = common * freq_common + vocab[num_common:num_common + num_rare] * freq_rare
        order = random.Random(f"cwe-order-{seed}-{num_rare}")
        order.shuffle(words)
        return head + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words)) + question, None

    prompt, _ = _fit(build, tokenizer, context_tokens, max(1, context_tokens // (4 * freq_rare) - 100))
    return TaskSample(task="cwe", prompt=prompt, answers=tuple(common), metric="fraction", depth=None,
                      context_tokens=context_tokens, max_new_tokens=8 * num_common + 16)


def make_frequent_words(tokenizer, context_tokens: int, seed: int, num_answers: int = 3,
                        alpha: float = 2.0, vocab_size: int = 400) -> TaskSample:
    """Words drawn with Zipf frequencies (count ∝ ``rank**-alpha``); the ``num_answers`` most
    frequent are asked; ``fraction`` scoring, ``depth=None``. Raises ValueError if
    ``vocab_size`` exceeds the noun list."""
    rng = random.Random(f"fwe-{seed}")
    vocab = rng.sample(word_list("noun"), vocab_size)
    weights = [(r + 1) ** -alpha for r in range(vocab_size)]
    head = ("Read the following text and track how often each word appears. "
            "Find the three most frequently appearing words.\n")
    question = (f"\nQuestion: What are the {num_answers} most frequently appearing words in the above text? "
                "Answer with the words only, separated by commas.")

    def build(total: int):
        counts = [max(1, round(total * w / sum(weights))) for w in weights]
        words = [w for w, c in zip(vocab, counts) for _ in range(c)]
        random.Random(f"fwe-order-{seed}-{total}").shuffle(words)
        return head + " ".join(words) + question, counts

    prompt, _ = _fit(build, tokenizer, context_tokens, context_tokens // 2)
    return TaskSample(task="fwe", prompt=prompt, answers=tuple(vocab[:num_answers]), metric="fraction",
                      depth=None, context_tokens=context_tokens, max_new_tokens=8 * num_answers + 16)
