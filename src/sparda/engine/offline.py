"""Offline runs of the request engine: ``LLM.generate(prompts, SamplingParams)``,
``LLM.generate_stream`` and ``LLM.chat`` build a fresh synchronous :class:`Engine`, queue
every request, and step it to the end."""

from __future__ import annotations

from collections.abc import Iterator

from sparda.engine.engine import Engine
from sparda.engine.sampling_params import SamplingParams
from sparda.engine.sequence import Delta, RequestOutput
from sparda.errors import SpardaError


def run_requests(llm, prompt_ids: list[list[int]], params: list[SamplingParams],
                 max_batch: int | None = None) -> Iterator[tuple[int, Delta]]:
    """Run requests through a fresh synchronous engine, yielding ``(index, delta)``.

    The engine's rows hold the longest prompt plus its ``max_tokens`` (``None``: up to the
    model's context); ``max_batch`` defaults to one row per request. Raises SpardaError
    for a request that does not fit, before anything runs.
    """
    limit = llm.shape.max_positions
    for ids, p in zip(prompt_ids, params):
        llm._check_length(len(ids), p.max_tokens or 1)
    need = max(len(ids) + (p.max_tokens if p.max_tokens is not None else limit) for ids, p in zip(prompt_ids, params))
    engine = Engine(llm, max_batch=max_batch or len(prompt_ids), max_model_len=min(max(need, 2), limit),
                    max_waiting=len(prompt_ids))
    for i, (ids, p) in enumerate(zip(prompt_ids, params)):
        engine.add_request(ids, p, request_id=str(i))
    return ((int(delta.request_id), delta) for delta in engine.run())


def generate_requests(llm, prompt_ids: list[list[int]], params: list[SamplingParams],
                      max_batch: int | None = None) -> list[RequestOutput]:
    """:func:`run_requests` to the end: one :class:`RequestOutput` per request, in order."""
    outputs: list[RequestOutput | None] = [None] * len(prompt_ids)
    for i, delta in run_requests(llm, prompt_ids, params, max_batch):
        if delta.output is not None:
            outputs[i] = delta.output
    return outputs


def request_inputs(llm, prompts, sampling_params, chat: bool = True,
                   prompt_token_ids: list[list[int]] | None = None) -> tuple[list[list[int]], list[SamplingParams]]:
    """Token ids and one :class:`SamplingParams` per request, checked before anything runs.

    ``prompts``: a string or a list of strings (wrapped in the chat template if ``chat``),
    replaced by ``prompt_token_ids`` if given; ``sampling_params``: one for all requests or
    a list of one per request. Raises SpardaError: no prompts, an empty one, a list of
    parameters of the wrong length or type.
    """
    if prompt_token_ids is None:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts or [])
        if any(not isinstance(p, str) for p in prompts):
            raise SpardaError("prompts must be strings (or pass prompt_token_ids)")
        if any(not p.strip() for p in prompts):
            raise SpardaError("empty prompt; pass some text")
        prompt_token_ids = [llm.encode(p, chat) for p in prompts]
    prompt_token_ids = [list(ids) for ids in prompt_token_ids]
    if not prompt_token_ids:
        raise SpardaError("no prompts given; pass a string or a non-empty list")
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * len(prompt_token_ids)
    else:
        params = list(sampling_params)
        if len(params) != len(prompt_token_ids) or not all(isinstance(p, SamplingParams) for p in params):
            raise SpardaError(f"pass one SamplingParams for all prompts or a list of {len(prompt_token_ids)} "
                              f"(one per prompt), got {len(params)}")
    return prompt_token_ids, params
