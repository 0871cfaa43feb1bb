"""The OpenAI API's request bodies and response objects, as ``sparda serve`` speaks them.

Every request body is checked here, at the HTTP boundary, before any work: one table per
endpoint, :data:`COMPLETION` and :data:`CHAT` (sharing :data:`COMMON`), gives each field
its accepted range, which is the range its consumer
(:class:`~sparda.engine.sampling_params.SamplingParams`, the sampler, torch's generator
seeding, the scheduler's rows) accepts; a value outside it is a 400 error naming the
field, the range and the value. Fields this server does not implement but that would
change the output (``n > 1``, ``echo``, penalties, ``logit_bias``, ``tools``,
``response_format``, ...) are refused by name (:data:`REFUSED`); other unknown fields
are ignored with a logged warning, as vLLM does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from sparda.engine.chat import check_messages
from sparda.engine.sampling_params import MAX_LOGPROBS, MIN_TEMPERATURE, SEED_MAX, SEED_MIN, SamplingParams
from sparda.engine.sequence import RequestOutput
from sparda.errors import SpardaError

log = logging.getLogger("sparda.server")

#: most stop strings per request, and characters per stop string (each generated token
#: scans them on the engine thread, so their size is bounded)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000
#: most ``stop_token_ids`` per request
MAX_STOP_TOKEN_IDS = 1024


class BadRequest(SpardaError):
    """A request the server refuses with 400; ``param`` names the field, if one is to blame."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the running server accepts: the model's vocabulary, ``--max-model-len`` and
    ``--max-waiting``."""

    vocab_size: int
    max_model_len: int
    max_waiting: int
    #: how few tokens a text can be (:func:`token_floor`), to refuse a prompt that cannot
    #: fit before tokenising it; None: no such refusal
    token_floor: TokenFloor | None = None


# ------------------------------------------------------------------ field rules
def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _shown(value) -> str:
    """``value`` as JSON spells it (``true``, ``null``, ``"text"``), cut to 60 characters (a
    refused value may be megabytes long)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # not from JSON (a caller's object)
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclasses.dataclass(frozen=True)
class Rule:
    """A field's accepted values: ``ok(value, limits)`` and the range in words,
    ``text(limits)``. ``None`` (JSON null) always means "the default"."""

    ok: Callable[[Any, Limits], bool]
    text: Callable[[Limits], str]


def _rule(ok, text) -> Rule:
    return Rule(ok, text if callable(text) else (lambda limits, text=text: text))


def _stop_ok(v, limits) -> bool:
    items = [v] if isinstance(v, str) else v
    return (isinstance(items, list) and 0 < len(items) <= MAX_STOP_STRINGS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in items))


def _max_tokens() -> Rule:
    return _rule(lambda v, lim: _int(v) and 1 <= v <= lim.max_model_len - 1,
                 lambda lim: f"an integer in [1, {lim.max_model_len - 1}] (--max-model-len {lim.max_model_len} "
                             "less one prompt token)")


#: fields both endpoints accept, with their ranges
COMMON: dict[str, Rule] = {
    "model": _rule(lambda v, lim: isinstance(v, str), "a string (GET /v1/models lists the served name)"),
    "max_tokens": _max_tokens(),
    "temperature": _rule(lambda v, lim: _number(v) and (v == 0 or MIN_TEMPERATURE <= v),
                         f"a finite number >= 0 (0 is greedy; a positive one at least {MIN_TEMPERATURE:g})"),
    "top_p": _rule(lambda v, lim: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": _rule(lambda v, lim: _int(v) and v >= -1, "an integer >= 1, or 0 / -1 for no top-k"),
    "stream": _rule(lambda v, lim: isinstance(v, bool), "true or false"),
    "stream_options": _rule(lambda v, lim: isinstance(v, dict), 'an object such as {"include_usage": true}'),
    "stop": _rule(_stop_ok, f"a string or a list of at most {MAX_STOP_STRINGS} strings, each of 1 to "
                            f"{MAX_STOP_CHARS} characters"),
    "stop_token_ids": _rule(lambda v, lim: isinstance(v, list) and len(v) <= MAX_STOP_TOKEN_IDS
                            and all(_int(t) and 0 <= t < lim.vocab_size for t in v),
                            lambda lim: f"a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                        f"[0, {lim.vocab_size})"),
    "seed": _rule(lambda v, lim: _int(v) and SEED_MIN <= v <= SEED_MAX, "an integer in [-2**63, 2**64 - 1]"),
    "ignore_eos": _rule(lambda v, lim: isinstance(v, bool), "true or false"),
    "user": _rule(lambda v, lim: isinstance(v, str), "a string"),
}

#: ``/v1/completions`` fields
COMPLETION: dict[str, Rule] = {
    **COMMON,
    "prompt": _rule(lambda v, lim: True, "a string, a list of strings, a list of token ids or a list of those"),
    "logprobs": _rule(lambda v, lim: _int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
}

#: ``/v1/chat/completions`` fields
CHAT: dict[str, Rule] = {
    **COMMON,
    "messages": _rule(lambda v, lim: isinstance(v, list) and len(v) > 0,
                      "a non-empty list of {'role': ..., 'content': ...} objects"),
    "max_completion_tokens": _max_tokens(),
    "logprobs": _rule(lambda v, lim: isinstance(v, bool), "true or false"),
    "top_logprobs": _rule(lambda v, lim: _int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"),
}

#: ``/tokenize`` fields: ``prompt`` (as completions, one text) or ``messages`` (as chat)
TOKENIZE: dict[str, Rule] = {
    "model": COMMON["model"],
    "prompt": _rule(lambda v, lim: isinstance(v, str) and len(v) > 0, "a non-empty string"),
    "messages": CHAT["messages"],
    "add_special_tokens": _rule(lambda v, lim: isinstance(v, bool), "true or false"),
}

#: ``/detokenize`` fields
DETOKENIZE: dict[str, Rule] = {
    "model": COMMON["model"],
    "tokens": _rule(lambda v, lim: isinstance(v, list) and all(_int(t) and 0 <= t < lim.vocab_size for t in v),
                    lambda lim: f"a list of token ids in [0, {lim.vocab_size})"),
}

#: fields every endpoint ignores silently (they change nothing but are common)
QUIET = frozenset()


def _absent(v) -> bool:
    return v is None or v in ([], {}, "")


def _is(*values) -> Callable[[Any], bool]:
    """Harmless when left out (``None``) or equal to one of ``values`` (numbers by value)."""
    return lambda v: v is None or any(v == x and type(v) is not bool or v is x for x in values)


def _unsupported(name: str, harmless: Callable[[Any], bool] = _absent, why: str = "",
                 fix: str = "leave it out") -> tuple[Callable[[Any], bool], str]:
    return harmless, f"{name} is not supported by sparda serve{why}; {fix}"


#: fields this server does not implement and that would change the output: refused
#: (400, by name) unless absent or at their no-op value. ``name: (harmless, message)``.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_is(1), "n must be 1: sparda serve returns one choice per prompt"),
    "best_of": (_is(1), "best_of must be 1 (or left out)"),
    "echo": _unsupported("echo", _is(False)),
    "suffix": _unsupported("suffix"),
    "presence_penalty": _unsupported("presence_penalty", _is(0), fix="leave it out or set 0"),
    "frequency_penalty": _unsupported("frequency_penalty", _is(0), fix="leave it out or set 0"),
    "repetition_penalty": _unsupported("repetition_penalty", _is(1), fix="leave it out or set 1"),
    "logit_bias": _unsupported("logit_bias"),
    "tools": _unsupported("tools", why=" (no tool calling)"),
    "tool_choice": _unsupported("tool_choice", _is("none", "auto"), why=" (no tool calling)"),
    "functions": _unsupported("functions", why=" (no function calling)"),
    "function_call": _unsupported("function_call", _is("none", "auto")),
    "response_format": _unsupported("response_format", _is({"type": "text"}), why=" (no structured output)"),
    "min_p": _unsupported("min_p", _is(0)),
    "min_tokens": _unsupported("min_tokens", _is(0)),
    "typical_p": _unsupported("typical_p", _is(1)),
    "length_penalty": _unsupported("length_penalty", _is(1)),
    "use_beam_search": (_is(False), "beam search is not supported by sparda serve"),
    "prompt_logprobs": _unsupported("prompt_logprobs", _is()),
    "allowed_token_ids": _unsupported("allowed_token_ids", _is()),
    "bad_words": _unsupported("bad_words"),
    "logits_processors": _unsupported("logits_processors"),
    **{name: _unsupported(name, _is(), why=" (no guided decoding)")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")},
    "include_stop_str_in_output": _unsupported("include_stop_str_in_output", _is(False)),
    "skip_special_tokens": _unsupported("skip_special_tokens: false", _is(True),
                                        why=" (special tokens are always skipped)"),
    "spaces_between_special_tokens": _unsupported("spaces_between_special_tokens", _is(True)),
    "truncate_prompt_tokens": _unsupported("truncate_prompt_tokens", _is()),
    "add_generation_prompt": _unsupported("add_generation_prompt: false", _is(True),
                                          why=" (the assistant turn is always opened)"),
    "continue_final_message": _unsupported("continue_final_message", _is(False)),
    "chat_template": _unsupported("chat_template", _is(), why=" (the model's own template is used)"),
    "chat_template_kwargs": _unsupported("chat_template_kwargs"),
    "documents": _unsupported("documents"),
    "audio": _unsupported("audio output", _is()),
    "modalities": (_is(["text"]), "sparda serve answers in text only: modalities ['text']"),
    "prediction": _unsupported("predicted outputs (prediction)", _is()),
    "web_search_options": (_is(), "web search is not supported by sparda serve"),
}

#: message keys besides role/content/name: refused when set, ignored otherwise
_MESSAGE_REFUSED = {"tool_calls": "tool calls", "function_call": "function calls"}


def check_fields(body, rules: dict[str, Rule], limits: Limits, *, warn_unknown: bool = True) -> dict:
    """Check a parsed JSON request body against ``rules`` and :data:`REFUSED`.

    Returns the body as a dict without its ignored fields. Raises BadRequest naming the
    first bad field and its range. Unknown fields are ignored, with one logged warning
    per request naming them.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(body).__name__}")
    out, ignored = {}, []
    for name, value in body.items():
        if name in rules:
            if value is not None and not rules[name].ok(value, limits):
                raise BadRequest(f"{name} must be {rules[name].text(limits)}, got {_shown(value)}", name)
            out[name] = value
        elif name in REFUSED:
            harmless, message = REFUSED[name]
            try:
                fine = harmless(value)
            except TypeError:  # an unhashable value compared with a tuple
                fine = False
            if not fine:
                raise BadRequest(message, name)
        elif name not in QUIET:
            ignored.append(name)
    options = out.get("stream_options")
    if options is not None:
        if not out.get("stream"):
            raise BadRequest("stream_options needs stream: true", "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise BadRequest(f"stream_options.include_usage must be true or false, got "
                             f"{_shown(options['include_usage'])}", "stream_options")
        ignored += [f"stream_options.{k}" for k in options if k != "include_usage"]
    if "messages" in out:
        ignored += _check_message_keys(out["messages"])
    if ignored and warn_unknown:
        log.warning("ignoring request fields sparda serve does not use: %s",
                    ", ".join(_logged_name(name) for name in ignored[:20]))
    return out


def _logged_name(name: str) -> str:
    """A client's field name as the server log shows it: as sent if short and printable,
    else JSON-escaped (ASCII) and cut to 60 characters, so that a name cannot forge log lines
    (a newline, a terminal escape) nor flood the log (a key of megabytes)."""
    if len(name) <= 60 and name.isprintable() and name.isascii() and ", " not in name:
        return name
    text = json.dumps(name)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_message_keys(messages: list) -> list[str]:
    """Refuse tool calls inside messages; the names of other unknown message keys."""
    ignored = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        for key, value in msg.items():
            if key in ("role", "content", "name"):
                continue
            if key in _MESSAGE_REFUSED and not _absent(value):
                raise BadRequest(f"messages[{i}].{key}: {_MESSAGE_REFUSED[key]} are not supported by sparda serve",
                                 "messages")
            ignored.append(f"messages[{i}].{key}")
    return ignored


def check_text(text: str, param: str) -> int:
    """Refuse text the tokenizer cannot encode: an unpaired UTF-16 surrogate (JSON allows
    ``"\\ud800"``; no UTF-8 text holds one). Raises BadRequest naming the position.
    Returns the text's length in UTF-8 bytes."""
    if text.isascii():  # O(1) in CPython, and no surrogate
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise BadRequest(f"{param} holds text that cannot be encoded: an unpaired surrogate "
                         f"{text[exc.start]!r} at character {exc.start}; send valid Unicode", param) from None


def completion_prompts(prompt, limits: Limits) -> list[str | list[int]]:
    """The prompts of a completions ``prompt``: strings (to tokenise) or token-id lists
    (checked against the vocabulary and ``--max-model-len``). Raises BadRequest."""
    shape = "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if prompt is None:
        raise BadRequest("missing required field 'prompt'", "prompt")
    if isinstance(prompt, str):
        prompt = [prompt]
    if not isinstance(prompt, list):
        raise BadRequest(f"{shape}, got {_shown(prompt)}", "prompt")
    if not prompt:
        raise BadRequest("prompt is empty; pass some text", "prompt")
    if all(_int(t) for t in prompt):
        prompt = [prompt]
    if len(prompt) > limits.max_waiting:
        raise BadRequest(f"prompt holds {len(prompt)} prompts, more than this server can ever queue at once "
                         f"(--max-waiting {limits.max_waiting}); send at most {limits.max_waiting} per request",
                         "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt is empty; pass some text", "prompt")
            check_prompt_bytes(p, check_text(p, "prompt"), limits)
            out.append(p)
        elif isinstance(p, list) and p and all(_int(t) for t in p):
            check_prompt_length(len(p), limits)
            bad = next((t for t in p if not 0 <= t < limits.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"prompt token ids must be in [0, {limits.vocab_size}), the model's vocabulary; "
                                 f"got {bad}", "prompt")
            out.append(p)
        elif isinstance(p, list) and not p:
            raise BadRequest("prompt is empty; pass some text", "prompt")
        else:
            raise BadRequest(f"{shape}, got {_shown(p)}", "prompt")
    return out


def check_prompt_length(num_prompt: int, limits: Limits, max_tokens: int | None = None, *,
                        at_least: bool = False) -> None:
    """Refuse a prompt that can never fit a row (as the scheduler would, before any work);
    ``at_least``: ``num_prompt`` is a lower bound (:func:`check_prompt_bytes`)."""
    if num_prompt >= limits.max_model_len:
        raise BadRequest(f"prompt of {'at least ' if at_least else ''}{num_prompt} tokens does not fit "
                         f"--max-model-len {limits.max_model_len} "
                         "(it needs room for at least one new token); shorten the prompt", "prompt")
    if max_tokens is not None and num_prompt + max_tokens > limits.max_model_len:
        raise BadRequest(f"prompt of {num_prompt} tokens plus max_tokens {max_tokens} exceeds --max-model-len "
                         f"{limits.max_model_len}; lower max_tokens to at most {limits.max_model_len - num_prompt}",
                         "max_tokens")


def check_prompt_bytes(text: str, num_bytes: int, limits: Limits) -> None:
    """Refuse, before tokenising it, a prompt ``text`` of ``num_bytes`` UTF-8 bytes that
    cannot fit --max-model-len by :attr:`Limits.token_floor` (a prompt of megabytes is
    refused at once, not after seconds of tokenising)."""
    floor = limits.token_floor
    if floor is None or -(-num_bytes // floor.bytes_per_token) < limits.max_model_len:
        return  # it may fit (the cheap bound, from the length alone)
    check_prompt_length(floor.tokens(text), limits, at_least=True)


@dataclasses.dataclass(frozen=True)
class TokenFloor:
    """A lower bound on how many tokens a text is, from its UTF-8 bytes alone
    (:func:`token_floor`): one token stands for at most ``bytes_per_token`` bytes, and
    the byte values in ``unkept`` may get no token at all (a byte-level vocabulary without
    them drops them)."""

    bytes_per_token: int
    unkept: bytes = b""

    def tokens(self, text: str) -> int:
        """At least how many tokens ``text`` is."""
        data = text.encode("utf-8")
        kept = len(data.translate(None, self.unkept)) if self.unkept else len(data)
        return -(-kept // self.bytes_per_token)


#: most a Unicode normalisation (NFC, NFKC, NFD, NFKD) or lowercasing shrinks UTF-8 text:
#: 4 bytes to 1 (NFKC of U+1D400 MATHEMATICAL BOLD CAPITAL A is "A"; Hangul jamo compose
#: 9 bytes to 3; KELVIN SIGN lowercases 3 bytes to 1)
_NORMALISER_SHRINK = 4
#: pre-tokenizers that keep every character of the text (split it, or replace spaces);
#: Split and Punctuation only unless their behaviour is "removed"
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"}


def _shrink(normalizer) -> int | None:
    """At most how many times fewer UTF-8 bytes ``normalizer`` (tokenizer.json) leaves
    of a text; None if unbounded or unknown (strip, regex replace, charsmaps, ...)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1
        for part in normalizer.get("normalizers", []):
            factor = _shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
        return _NORMALISER_SHRINK
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern, content = normalizer.get("pattern") or {}, normalizer.get("content") or ""
        if set(pattern) != {"String"} or not content or not pattern["String"]:
            return None
        return max(1, -(-len(pattern["String"].encode()) // len(content.encode())))
    return None


def _pre_tokenizers(pre_tokenizer) -> list[dict]:
    if pre_tokenizer is None:
        return []
    if pre_tokenizer.get("type") == "Sequence":
        return [p for part in pre_tokenizer.get("pretokenizers", []) for p in _pre_tokenizers(part)]
    return [pre_tokenizer]


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character standing for each byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def token_floor(tokenizer) -> TokenFloor | None:
    """How few tokens a text can be for ``tokenizer`` (:class:`TokenFloor`), or None where
    no bound is known: not a fast tokenizer; a model that can turn any run of unknown text
    into one token (WordPiece, BPE or Unigram without byte fallback, unless byte-level); a
    normaliser or pre-tokenizer that can drop text (strip, regex replace, whitespace split).

    Read once from the tokenizer.json structure. Byte-level BPE: each character of a token
    string is one byte of text, and byte values missing from the vocabulary may be dropped
    (``unkept``). Byte fallback: a token string's UTF-8 length bounds the normalised text it
    covers. Either is multiplied by how much the normaliser can shrink text (:func:`_shrink`).
    Added (special) tokens match the raw text: their content's UTF-8 length.
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        spec = json.loads(backend.to_str())
    except Exception:  # an unserialisable custom component
        return None
    model, pres = spec.get("model") or {}, _pre_tokenizers(spec.get("pre_tokenizer"))
    shrink = _shrink(spec.get("normalizer"))
    if (shrink is None or model.get("type") not in ("BPE", "Unigram")
            or any(p.get("type") not in _KEEPING_PRE_TOKENIZERS or str(p.get("behavior", "")).lower() == "removed"
                   for p in pres)):
        return None
    vocab = model.get("vocab") or {}
    pieces = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}
    unkept = b""
    if model["type"] == "BPE" and any(p["type"] == "ByteLevel" for p in pres):
        unkept = bytes(b for b, char in _byte_chars().items() if char not in pieces)
        longest = max(map(len, pieces))
    elif model.get("byte_fallback") and {f"<0x{b:02X}>" for b in range(256)} <= pieces:
        longest = max(len(p.encode("utf-8")) for p in pieces)
    else:
        return None
    added = [len(t["content"].encode("utf-8")) for t in spec.get("added_tokens") or ()]
    return TokenFloor(max([longest * shrink, *added]), unkept)


def chat_messages(messages) -> list[dict[str, str]]:
    """``{"role", "content"}`` dicts (and ``name`` where given) of a checked ``messages`` list
    (text parts joined).
    Raises BadRequest naming the first bad message."""
    for i, msg in enumerate(messages):
        if "role" not in msg:
            raise BadRequest(f"messages[{i}] is missing required field 'role'", "messages")
        if "content" not in msg:
            raise BadRequest(f"messages[{i}] is missing required field 'content' (a string or a list of text parts)",
                             "messages")
        if not isinstance(msg["role"], str):
            raise BadRequest(f"messages[{i}].role must be a string, got {_shown(msg['role'])}", "messages")
        if "name" in msg and msg["name"] is not None and not isinstance(msg["name"], str):
            raise BadRequest(f"messages[{i}].name must be a string, got {_shown(msg['name'])}", "messages")
    try:
        out = check_messages([{k: m[k] for k in ("role", "content", "name") if k in m} for m in messages])
    except SpardaError as exc:
        raise BadRequest(str(exc), "messages") from None
    for i, m in enumerate(out):
        check_text(m["content"], f"messages[{i}].content")
        if "name" in m:
            check_text(m["name"], f"messages[{i}].name")
    return out


def sampling_params(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The :class:`SamplingParams` of a checked request (OpenAI defaults: temperature 1,
    top_p 1). Raises BadRequest naming the offending field."""
    def get(name, default):
        value = body.get(name)
        return default if value is None else value

    try:
        return SamplingParams(temperature=float(get("temperature", 1.0)), top_p=float(get("top_p", 1.0)),
                              top_k=get("top_k", 0), max_tokens=max_tokens, stop=body.get("stop"),
                              stop_token_ids=body.get("stop_token_ids"), seed=body.get("seed"),
                              ignore_eos=get("ignore_eos", False), logprobs=logprobs)
    except SpardaError as exc:
        message = str(exc).replace("SamplingParams.", "")
        raise BadRequest(message, message.split(" ", 1)[0]) from None


# ------------------------------------------------------------------ responses
def new_id(prefix: str) -> str:
    """A fresh response id such as ``cmpl-1f3a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts summed over ``outputs``."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class TextOffsets:
    """Where each next token starts in a completion's text (legacy ``text_offset``), decoded
    as the engine decodes it: special tokens skipped, and a token inside a character split
    over several tokens at that character's offset. One per completion, fed its tokens in
    order (:meth:`take`), so that a stream's offsets equal the non-streamed ones."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.at = 0           # characters of the text before the window
        self.window: list[int] = []  # tokens since the last whole character
        self.partial = ""     # their text, ending inside a character

    def take(self, ids: list[int]) -> list[int]:
        """The offsets of ``ids``, the completion's next tokens."""
        out = []
        for token in ids:
            out.append(self.at + len(self.partial.rstrip("\ufffd")))
            self.window.append(token)
            self.partial = self.tokenizer.decode(self.window, skip_special_tokens=True)
            if not self.partial.endswith("\ufffd"):  # it ends on a whole character: the window moves on
                self.at, self.window, self.partial = self.at + len(self.partial), [], ""
        return out


def completion_logprobs(tokenizer, entries: list[dict] | None, offsets: TextOffsets | None = None) -> dict | None:
    """Legacy completions ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset`` (characters into the completion's text, from ``offsets``: the tokens
    before ``entries``, a stream's; None: ``entries`` are the whole completion).

    Offsets are not the sum of the tokens' own texts, which counts a split character's
    U+FFFD pieces and a skipped special token's name."""
    if entries is None:
        return None
    ids = [e["token_id"] for e in entries]
    return {"tokens": [tokenizer.decode([t]) for t in ids], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in e["top_logprobs"].items()} for e in entries],
            "text_offset": (offsets or TextOffsets(tokenizer)).take(ids)}


@functools.cache
def _byte_of() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the byte each character of a byte-level token stands for."""
    return {char: byte for byte, char in _byte_chars().items()}


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The UTF-8 bytes of one token, whose decoded text is ``text``. A token that ends or
    starts inside a multi-byte character decodes to U+FFFD; its real bytes come from its
    vocabulary piece (a byte-level piece spells one byte per character, a byte-fallback piece
    is ``<0xNN>``), kept only if they decode to ``text`` again; else ``text``'s own bytes."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    byte_of = _byte_of()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and piece:
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            with contextlib.suppress(ValueError):
                return bytes([int(piece[3:5], 16)])
        if all(char in byte_of for char in piece):
            raw = bytes(byte_of[char] for char in piece)
            if raw.decode("utf-8", "replace") == text:
                return raw
    return text.encode("utf-8")


def chat_logprobs(tokenizer, entries: list[dict] | None) -> dict | None:
    """Chat ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``."""
    if entries is None:
        return None

    def item(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(token_bytes(tokenizer, token_id, text))}

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
