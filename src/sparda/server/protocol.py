"""The OpenAI API's request bodies and response objects, as ``sparda serve`` speaks them.

Request bodies are validated strictly: a field of the wrong type, or a field this server
does not know, is a 400 error (as the OpenAI API answers), never silently coerced or
ignored. Known fields this server does not implement (``n > 1``, ``echo``, penalties,
``logit_bias``, ...) are refused with a message saying so.
"""

from __future__ import annotations

import time
import uuid

from pydantic import BaseModel, ConfigDict

from sparda.engine.sampling_params import SamplingParams
from sparda.engine.sequence import RequestOutput
from sparda.errors import SpardaError


class BadRequest(SpardaError):
    """A request the server refuses with 400; ``param`` names the field, if one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` adds a last chunk with token counts."""

    include_usage: bool = False


class _Common(_Strict):
    """Fields shared by completions and chat completions (OpenAI names; ``top_k``,
    ``stop_token_ids`` and ``ignore_eos`` are the vLLM extensions)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse known fields this server does not implement (BadRequest naming the field)."""
        if self.n != 1:
            raise BadRequest("n must be 1: sparda serve returns one choice per prompt", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise BadRequest(f"{name} is not supported by sparda serve; leave it out or set 0", name)
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported by sparda serve; leave it out", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options needs stream: true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The :class:`SamplingParams` of this request (OpenAI defaults: temperature 1,
        top_p 1). Raises BadRequest naming the offending field."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                max_tokens=max_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                seed=self.seed, ignore_eos=self.ignore_eos, logprobs=logprobs)
        except SpardaError as exc:
            message = str(exc).replace("SamplingParams.", "")
            raise BadRequest(message, message.split(" ", 1)[0]) from None


class CompletionRequest(_Common):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings (one choice
    each), a list of token ids or a list of such lists. ``max_tokens`` defaults to 16
    (the OpenAI default); ``null`` fills the row (``--max-model-len`` minus the prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        """As :meth:`_Common.check_supported`, plus ``echo``, ``best_of``, ``suffix``."""
        super().check_supported()
        if self.echo:
            raise BadRequest("echo is not supported by sparda serve; leave it out", "echo")
        if self.best_of not in (None, 1):
            raise BadRequest("best_of must be 1 (or left out)", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported by sparda serve; leave it out", "suffix")


class ChatMessage(_Strict):
    """One message: ``role`` and ``content`` (a string or text parts); ``name`` is accepted."""

    role: str
    content: str | list[dict]
    name: str | None = None


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``. ``max_tokens`` (or ``max_completion_tokens``)
    defaults to the rest of the row; ``logprobs: true`` with ``top_logprobs: k``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def check_supported(self) -> None:
        """As :meth:`_Common.check_supported`; ``top_logprobs`` needs ``logprobs``."""
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-1f3a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts summed over ``outputs``."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def completion_logprobs(tokenizer, entries: list[dict] | None, offset: int = 0) -> dict | None:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` (characters, from ``offset``)."""
    if entries is None:
        return None
    tokens = [tokenizer.decode([e["token_id"]]) for e in entries]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top_logprobs"].items()} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list[dict] | None) -> dict | None:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if entries is None:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [dict(item(e["token_id"], e["logprob"]),
                             top_logprobs=[item(t, lp) for t, lp in e["top_logprobs"].items()]) for e in entries]}


def completion_response(rid: str, model: str, outputs: list[RequestOutput], tokenizer) -> dict:
    """A ``text_completion`` object with one choice per output."""
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": i, "text": o.text, "finish_reason": o.finish_reason,
                         "logprobs": completion_logprobs(tokenizer, o.logprobs)} for i, o in enumerate(outputs)],
            "usage": usage(outputs)}


def chat_response(rid: str, model: str, output: RequestOutput, tokenizer) -> dict:
    """A ``chat.completion`` object (one choice)."""
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": output.text},
                         "finish_reason": output.finish_reason,
                         "logprobs": chat_logprobs(tokenizer, output.logprobs)}],
            "usage": usage([output])}
