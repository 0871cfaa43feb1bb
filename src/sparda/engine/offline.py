"""Offline runs of the one loop: ``LLM.generate``, ``generate_stream`` and ``chat`` build a
fresh synchronous :class:`Engine`, queue every request, and step it to the end."""

from __future__ import annotations

import logging
from collections.abc import Iterator

from sparda.engine.engine import Engine
from sparda.engine.sampling_params import SamplingParams
from sparda.engine.sequence import Delta
from sparda.engine.validate import check_prompts, check_token_ids
from sparda.config import spell
from sparda.errors import SpardaError


def offline_engine(llm, prompts, sampling_params, chat: bool = True,
                   prompt_token_ids: list[list[int]] | None = None,
                   max_batch: int | None = None) -> Iterator[tuple[int, Delta]]:
    """Run prompts through a fresh synchronous :class:`Engine`, yielding ``(index, delta)``.

    Rows hold the longest prompt plus its ``max_tokens`` (``None``: up to the model's
    context), rounded up as :meth:`ModelRunner.cache_capacity`; ``max_batch`` defaults to one
    row per request. Everything is checked before anything runs.

    Raises:
        SpardaError: bad prompts or parameters, a request longer than the model's context.
    """
    ids, params = request_inputs(llm, prompts, sampling_params, chat, prompt_token_ids)
    limit = llm.shape.max_positions
    for prompt, p in zip(ids, params):
        new = p.max_tokens or 1
        if len(prompt) + new > limit:
            raise SpardaError(f"prompt of {len(prompt)} tokens plus {new} new tokens exceeds the model's context of "
                              f"{limit} tokens; shorten the prompt or lower --max-new-tokens")
        note_dense_fallback(llm, len(prompt), new)
    need = max(len(prompt) + (p.max_tokens if p.max_tokens is not None else limit - len(prompt))
               for prompt, p in zip(ids, params))
    engine = Engine(llm, max_batch=max_batch or len(ids), max_model_len=min(max(llm.cache_capacity(need), 2), limit),
                    max_waiting=len(ids), static_live_len=False)
    for i, (prompt, p) in enumerate(zip(ids, params)):
        engine.add_request(prompt, p, request_id=str(i))
    return ((int(delta.request_id), delta) for delta in engine.run())


def note_dense_fallback(llm, num_prompt: int, max_new: int) -> None:
    """Say once per LLM and cause, on stderr (logger ``sparda``), that a block-sparse method
    attends densely to a request of ``num_prompt`` prompt tokens (design §3.6)."""
    config = llm.config
    reason = None if config.method == "dense" else config.selection.dense_reason(num_prompt + max_new - 1)
    cause = reason and ("dense_len" if "--dense-len" in reason else "topk_blocks")
    noted = llm.model_runner.dense_noted
    if reason and cause not in noted:
        noted.add(cause)
        logging.getLogger("sparda").warning(spell(  # keywords; the CLI's log filter spells flags
            f"note: {config.method} falls back to dense attention (design §3.6) for a prompt of {num_prompt} tokens "
            f"with up to {max_new} new: {reason}", "api"))


def request_inputs(llm, prompts, sampling_params, chat: bool = True,
                   prompt_token_ids: list[list[int]] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    """Token ids and one :class:`SamplingParams` per request, checked before anything runs.

    ``prompts``: a string or a list of strings (wrapped in the chat template if ``chat``),
    replaced by ``prompt_token_ids`` if given; ``sampling_params``: one for all requests or
    a list of one per request. Raises SpardaError: no prompts, an empty one, a list of
    parameters of the wrong length or type.
    """
    if prompt_token_ids is None:
        prompt_token_ids = [llm.encode(p, chat) for p in check_prompts(prompts)]
    else:
        check_token_ids(prompt_token_ids, llm.model.config.vocab_size)
    prompt_token_ids = [list(ids) for ids in prompt_token_ids]
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompt_token_ids)
    else:
        params = list(sampling_params)
        if len(params) != len(prompt_token_ids) or not all(isinstance(p, SamplingParams) for p in params):
            raise SpardaError(f"pass one SamplingParams for all prompts or a list of {len(prompt_token_ids)} "
                              f"(one per prompt), got {len(params)}")
    return prompt_token_ids, params
