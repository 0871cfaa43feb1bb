"""Checks of a generation request, run before any work: one SpardaError naming the argument and the fix.

:func:`check_sampling` and :func:`check_prompts` need no model, so the CLI runs them
before it loads one; :func:`check_request` (both, plus token ids against the
vocabulary) runs at the top of :meth:`sparda.LLM.generate`.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

from sparda.errors import SpardaError


def _whole(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _real(value) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


def check_sampling(max_new_tokens, temperature, top_p, seed=0) -> None:
    """Check the sampling arguments of a request.

    Args:
        max_new_tokens: a whole number >= 1 (tokens).
        temperature: a finite real >= 0 (0 is greedy).
        top_p: a real in ``(0, 1]``.
        seed: a whole number (the sampling generator's seed).
    Raises:
        SpardaError: the first bad argument, by name, with its value and the accepted range.
    """
    if not _whole(max_new_tokens) or max_new_tokens < 1:
        raise SpardaError(f"--max-new-tokens must be a whole number >= 1, got {max_new_tokens!r}")
    if not _real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise SpardaError(f"--temperature must be a finite number >= 0 (0 is greedy), "
                          f"got {temperature!r}")
    if not _real(top_p) or not 0 < top_p <= 1:  # NaN fails both comparisons
        raise SpardaError(f"--top-p must be a number in (0, 1] (1 keeps every token), got {top_p!r}")
    if not _whole(seed):
        raise SpardaError(f"--seed must be a whole number, got {seed!r}")


def check_prompts(prompts) -> list[str]:
    """Check text prompts: one string or a non-empty list of non-blank strings.

    Returns:
        The prompts as a list.
    Raises:
        SpardaError: no prompt, a blank one, or one that is not a string (a chat
            messages list among them: pass the text, ``chat=True`` applies the template).
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if isinstance(prompts, dict) or not isinstance(prompts, (list, tuple)):
        raise SpardaError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise SpardaError("prompts is empty; pass at least one prompt string")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, dict) or (isinstance(prompt, (list, tuple)) and prompt
                                        and all(isinstance(m, dict) for m in prompt)):
            raise SpardaError(f"prompts[{i}] is a chat message list, not a string; pass the user's text as "
                              "a string (chat=True wraps it in the chat template)")
        if not isinstance(prompt, str):
            raise SpardaError(f"prompts[{i}] must be a string, got {type(prompt).__name__}; "
                              "pass token ids through prompt_token_ids")
        if not prompt.strip():
            raise SpardaError("empty prompt; pass some text")
    return list(prompts)


def check_token_ids(prompt_token_ids, vocab_size: int) -> None:
    """Check ``prompt_token_ids``: a non-empty list of non-empty lists of ids in ``[0, vocab_size)``.

    Raises:
        SpardaError: the first bad prompt or id, by index, with the valid range.
    """
    if not isinstance(prompt_token_ids, (list, tuple)) or not prompt_token_ids:
        raise SpardaError("prompt_token_ids must be a non-empty list of token-id lists")
    for i, ids in enumerate(prompt_token_ids):
        if not isinstance(ids, (list, tuple)):
            raise SpardaError(f"prompt_token_ids[{i}] must be a list of token ids, got {type(ids).__name__}")
        if not ids:
            raise SpardaError(f"prompt_token_ids[{i}] is empty; pass at least one token id")
        for j, tok in enumerate(ids):
            if not _whole(tok) or not 0 <= tok < vocab_size:
                raise SpardaError(f"prompt_token_ids[{i}][{j}] = {tok!r} is not a token id of this model; "
                                  f"ids are whole numbers in [0, {vocab_size})")


def check_request(prompts, *, max_new_tokens, temperature, top_p, seed, prompt_token_ids, vocab_size: int) -> None:
    """All checks of :meth:`sparda.LLM.generate` (prompts are ignored when ``prompt_token_ids`` is given).

    Raises:
        SpardaError: see :func:`check_sampling`, :func:`check_prompts`, :func:`check_token_ids`.
    """
    check_sampling(max_new_tokens, temperature, top_p, seed)
    if prompt_token_ids is None:
        check_prompts(prompts)
    else:
        check_token_ids(prompt_token_ids, vocab_size)
