"""``sparda serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints (docs/serving.md): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true``: server-sent events ending in
``data: [DONE]``), ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`sparda.server.metrics`),
``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``, ``GET /version``.

A request can only hurt itself:

* every body is checked at the boundary (:mod:`sparda.server.protocol`: one table of
  field ranges) before any work; every error is an OpenAI error object
  ``{"error": {"message", "type", "param", "code"}}``, whatever raised it (a bad field,
  an unknown path or method, a body over ``--max-request-bytes``, a server bug);
* tokenisation and detokenisation run on a worker thread, never on the event loop;
* on the engine thread an exception in one request's work ends that request alone
  (``Engine.failed``): a non-streamed request gets a 500, a stream an error chunk and
  ``data: [DONE]``; the others go on. If the engine thread itself dies, ``/health``
  answers 503 and new requests are refused with 503.

400 for bad parameters (a prompt that does not fit ``--max-model-len``: both lengths
named), 404 for an unknown model, 429 with ``Retry-After`` when the queue is full, 503 with
``Retry-After`` while the server drains. A client that disconnects cancels its requests,
which frees their rows at the next engine step. SIGINT/SIGTERM stop accepting, let
running requests finish for up to ``--drain-timeout`` seconds, then end the rest (each
stream still gets a final chunk and ``data: [DONE]``) and exit with status 0; a second
signal ends them at once, later ones are ignored. With ``--api-key`` every path but
``/health`` and ``/metrics`` needs the bearer token (401).

The engine runs on its own thread; each HTTP request hands it requests and receives
their deltas on the event loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sparda.engine.chat import chat_token_ids
from sparda.engine.engine import Engine, EngineStopped
from sparda.engine.scheduler import QueueFull
from sparda.errors import SpardaError
from sparda.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from sparda.server.protocol import (CHAT, COMPLETION, DETOKENIZE, TOKENIZE, BadRequest, Limits, TextOffsets,
                                    chat_logprobs, chat_messages, chat_response, check_fields, check_prompt_bytes,
                                    check_prompt_length, check_text, completion_logprobs, completion_prompts,
                                    completion_response, error_body, new_id, sampling_params, token_floor, usage)

log = logging.getLogger("sparda.server")

#: seconds a client is told to wait (Retry-After) when the queue is full or the server drains
RETRY_AFTER_S = 1
#: seconds between two disconnect checks of a client waiting for a non-streamed answer
POLL_S = 0.25
#: default --max-request-bytes: a 1M-token prompt of token ids is about 7 MB of JSON
MAX_REQUEST_BYTES = 16 * 2**20
#: seconds uvicorn gives streams ended at the drain timeout to send their last chunks
FLUSH_S = 5.0
#: paths that need no API key unless --protect-health-metrics (probes, scrapers)
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: what a client is told when the engine failed while running its request
ENGINE_FAILED = "the engine failed while running this request (see the server log); other requests go on"


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | int | None = None, retry_after: int | None = None, headers: dict | None = None) -> JSONResponse:
    headers = dict(headers or {})
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers or None)


def _refusal(exc: SpardaError):
    """The HTTP error of an exception raised while checking or queuing a request."""
    if isinstance(exc, QueueFull):
        return _error(429, str(exc), "rate_limit_exceeded", retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineStopped):
        return _error(503, str(exc), "server_shutting_down", retry_after=RETRY_AFTER_S)
    return _error(400, str(exc), param=getattr(exc, "param", None))


async def _send_error(send, status: int, message: str, kind: str, headers: dict | None = None,
                      code: str | None = None) -> None:
    """An OpenAI error response sent straight through ASGI (from the middleware)."""
    body = json.dumps(error_body(message, kind, code=code)).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _Guard:
    """ASGI middleware in front of every endpoint.

    * With an ``api_key``, every path but ``open_paths`` needs ``Authorization: Bearer
      <key>`` (compared in constant time, :func:`hmac.compare_digest`); otherwise 401,
      before the body is read.
    * Bodies over ``max_request_bytes`` are refused with 413 before they are parsed (a
      declared ``Content-Length`` at once, a chunked body as soon as it passes the limit);
      a body within it is read and replayed to the application.
    """

    def __init__(self, app, max_request_bytes: int, api_key: str | None = None,
                 open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.max_bytes = max_request_bytes
        self.key = api_key.encode("utf-8") if api_key is not None else None
        self.open_paths = open_paths

    def authorized(self, scope) -> bool:
        if self.key is None or scope["path"] in self.open_paths:
            return True
        value = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = value.strip().partition(b" ")
        # compare_digest in any case (a missing or non-bearer header compares an empty token)
        matches = hmac.compare_digest(token.strip() if scheme.lower() == b"bearer" else b"", self.key)
        return matches and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if not self.authorized(scope):
            return await _send_error(send, 401, "missing or incorrect API key; send the header "
                                                "'Authorization: Bearer <--api-key>'", "invalid_request_error",
                                     {"WWW-Authenticate": "Bearer"}, code="invalid_api_key")
        if scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_large = (413, f"the request body exceeds --max-request-bytes {self.max_bytes}; send a smaller "
                          "request", "request_too_large")
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await _send_error(send, *too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await _send_error(send, *too_large)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class _Stream:
    """The deltas of one HTTP request's engine requests, delivered on the event loop.

    While it has open requests it is listed in ``live`` (the app's), so that a shutdown
    can end them (:meth:`end`) and each still gets its final chunk.
    """

    def __init__(self, engine: Engine, live: set, on_output=None) -> None:
        self.engine = engine
        self.on_output = on_output
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[str] = []
        self.open: set[str] = set()
        self.live = live
        live.add(self)

    def add(self, prompt_ids: list[int], params) -> None:
        """Queue one request (index = order of the calls). Raises as Engine.add_request."""
        index = len(self.ids)

        def on_delta(delta, index=index):  # on the engine's thread
            if delta.output is not None and self.on_output is not None:
                self.on_output(delta.output)
            with contextlib.suppress(RuntimeError):  # the loop is gone (server stopped)
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, delta))

        seq = self.engine.add_request(prompt_ids, params, request_id=new_id("req"), on_delta=on_delta)
        self.ids.append(seq.request_id)
        self.open.add(seq.request_id)

    async def next(self):
        """The next ``(index, delta)``."""
        index, delta = await self.queue.get()
        if delta.finished:
            self.open.discard(delta.request_id)
        return index, delta

    def cancel(self) -> None:
        """Abort every request of this HTTP request that has not finished (its client is
        gone or it is answered: nobody waits for their final deltas)."""
        for rid in list(self.open):
            self.engine.abort(rid)
        self.open.clear()
        self.live.discard(self)

    def end(self) -> None:
        """Abort the open requests but keep waiting for them: each one's final delta
        (finish reason ``abort``) still comes, so the client gets a last chunk and
        ``[DONE]``. Any thread."""
        for rid in list(self.open):
            self.engine.abort(rid)


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _engine_error_chunk() -> str:
    """The stream chunk of a request the engine failed (the openai client raises APIError)."""
    return _sse(error_body(ENGINE_FAILED, "server_error", code=500))


async def read_json(request: Request):
    """The request's body parsed as JSON. Raises BadRequest (not JSON, not UTF-8, too deep)."""
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        if "integer string conversion" in str(exc):  # valid JSON; Python's advice is for the server's code
            raise BadRequest(f"the request body holds an integer of more than {sys.get_int_max_str_digits()} "
                             "digits, which this server does not parse; send numbers in their fields' ranges") from None
        message = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise BadRequest(f"the request body is not valid JSON: {message}") from None


class Tokenizer:
    """The tokenizer's work for the HTTP side, on one worker thread (never the event loop).

    A prompt the tokenizer cannot encode (it raises, or its Rust core panics) is a 400.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sparda-tokenizer")

    async def run(self, fn, *args):
        """``fn(*args)`` on the worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    @staticmethod
    def guarded(fn, param: str, *args):
        """``fn(*args)``, with whatever the tokenizer raises turned into BadRequest naming ``param``."""
        try:
            return fn(*args)
        except SpardaError:
            raise
        except BaseException as exc:  # pyo3's PanicException derives from BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):
                raise
            raise BadRequest(f"{param} holds text the tokenizer cannot encode "
                             f"({type(exc).__name__}: {str(exc)[:160]})", param) from None

    def encode_prompts(self, prompts: list) -> list[list[int]]:
        return [p if isinstance(p, list) else self.guarded(self.engine.llm.encode, "prompt", p, False)
                for p in prompts]

    def encode_chat(self, messages: list[dict], check_text=None) -> list[int]:
        return self.guarded(chat_token_ids, "messages", self.tokenizer, messages, check_text)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def create_app(engine: Engine, model_name: str, drain_timeout_s: float = 30.0, banner: str | None = None, *,
               max_request_bytes: int = MAX_REQUEST_BYTES, api_key: str | None = None,
               protect_health_metrics: bool = False):
    """The FastAPI application serving ``engine`` under the name ``model_name``.

    The engine's thread starts with the app (lifespan) and stops when it shuts down,
    after letting requests finish for up to ``drain_timeout_s`` seconds. ``banner`` is
    printed to stderr once the server is ready. Request bodies over ``max_request_bytes``
    get 413. With ``api_key``, requests need ``Authorization: Bearer <api_key>`` (401
    otherwise), except ``/health`` and ``/metrics`` unless ``protect_health_metrics``.
    """
    worker = Tokenizer(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        if banner:
            print(banner, file=sys.stderr, flush=True)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown, drain_timeout_s)
            worker.close()

    live: set[_Stream] = set()

    def end_requests() -> int:
        """End every request in flight now (a shutdown past its drain timeout): each
        stream still gets a final chunk (finish reason ``abort``) and ``[DONE]``, each
        waiting client its answer so far. Any thread; returns how many HTTP requests."""
        streams = list(live)
        for stream in streams:
            stream.end()
        return len(streams)

    server_metrics = ServerMetrics(engine, model_name)
    app = FastAPI(title="sparda", lifespan=lifespan)
    app.state.end_requests = end_requests
    app.state.metrics = server_metrics
    app.add_middleware(_Guard, max_request_bytes=max_request_bytes, api_key=api_key,
                       open_paths=frozenset() if protect_health_metrics else OPEN_PATHS)
    app.state.engine = engine
    tokenizer = engine.tokenizer
    # token_floor: a prompt that cannot fit is refused by its byte length, before tokenising
    limits = Limits(engine.vocab_size, engine.max_model_len, engine.scheduler.max_waiting,
                    token_floor(tokenizer))

    # ------------------------------------------------------------- errors
    @app.exception_handler(SpardaError)
    async def refused(request, exc: SpardaError):
        return _refusal(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404:
            message = f"no such endpoint: {where} (see GET /v1/models, POST /v1/completions, ...)"
        elif exc.status_code == 405:
            message = f"method not allowed: {where}"
        else:
            message = str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, message, kind, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        return _error(400, f"invalid value for '{'.'.join(loc) or 'body'}': {err.get('msg', 'invalid')}",
                      param=param)

    @app.exception_handler(Exception)
    async def crashed(request, exc: Exception):
        log.error("internal error serving %s %s", request.method, request.url.path,
                  exc_info=(type(exc), exc, exc.__traceback__))
        return _error(500, "internal server error (see the server log)", "server_error")

    # ------------------------------------------------------------- helpers
    def chat_fits(text: str) -> None:
        """Refuse a chat's templated ``text`` whose bytes show it cannot fit, before it is tokenised."""
        check_prompt_bytes(text, check_text(text, "messages"), limits)

    def check_model(name: str | None):
        if name is not None and name != model_name:
            return _error(404, f"model '{name}' does not exist; this server serves '{model_name}' (GET /v1/models)",
                          param="model", code="model_not_found")
        return None

    def engine_down():
        if getattr(engine, "crashed", None) is not None:
            return _error(503, "the engine thread stopped (see the server log); this server takes no requests",
                          "server_error", retry_after=RETRY_AFTER_S)
        return None

    def start(prompts: list[list[int]], params):
        """Queue ``prompts``; an error response, or the :class:`_Stream`."""
        if (down := engine_down()) is not None:
            return down
        for i, ids in enumerate(prompts):  # every prompt checked before any is queued
            if not ids:  # text the tokenizer drops whole (control bytes outside its vocabulary)
                which = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
                raise BadRequest(f"{which} is no tokens once tokenised (the tokenizer drops all of its "
                                 "characters); pass some text", "prompt")
            check_prompt_length(len(ids), limits, params.max_tokens)
        stream = _Stream(engine, live, server_metrics.observe)
        try:
            for ids in prompts:
                stream.add(ids, params)
        except SpardaError as exc:
            stream.cancel()
            return _refusal(exc)
        return stream

    async def collect(stream: _Stream, request: Request):
        """Wait for every output of ``stream``; None if the client went away."""
        outputs = [None] * len(stream.ids)
        try:
            while stream.open:
                try:
                    index, delta = await asyncio.wait_for(stream.next(), POLL_S)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if delta.output is not None:
                    outputs[index] = delta.output
        finally:
            stream.cancel()
        return outputs

    async def reply(stream: _Stream, request: Request, build):
        """The non-streamed answer: ``build(outputs)`` (on the worker: it detokenises
        logprobs) once every output is in, or the error for a client that went away or
        a request the engine failed."""
        outputs = await collect(stream, request)
        if outputs is None:
            return _error(499, "client closed the request", "client_disconnected")
        if any(o is None or o.finish_reason == "error" for o in outputs):
            return _error(500, ENGINE_FAILED, "server_error")
        return JSONResponse(await worker.run(build, outputs))

    # ------------------------------------------------------------- endpoints
    @app.get("/health")
    async def health():
        if getattr(engine, "crashed", None) is not None or (engine.accepting and not engine.alive):
            return _error(503, "the engine thread stopped (see the server log)", "server_error",
                          retry_after=RETRY_AFTER_S)
        if not engine.accepting:
            return _error(503, "shutting down", "server_shutting_down", retry_after=RETRY_AFTER_S)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(server_metrics.render(), media_type=METRICS_CONTENT_TYPE)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(engine.started), "owned_by": "sparda",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return check_model(model_id) or model_card()

    @app.get("/version")
    async def version():
        from sparda import __version__

        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """Token ids of ``prompt`` (as /v1/completions encodes it) or of ``messages`` (as
        /v1/chat/completions: chat template applied, generation prompt added). Text whose
        bytes alone show it cannot fit ``--max-model-len`` is refused before it is tokenised,
        as those endpoints refuse it (megabytes would hold the one tokenizer thread)."""
        body = check_fields(await read_json(request), TOKENIZE, limits)
        if (refused := check_model(body.get("model"))) is not None:
            return refused
        if ("prompt" in body) == ("messages" in body):
            raise BadRequest("pass one of 'prompt' (text) or 'messages' (a chat)", "prompt")
        if "messages" in body:
            ids = await worker.run(worker.encode_chat, chat_messages(body["messages"]), chat_fits)
        else:
            check_prompt_bytes(body["prompt"], check_text(body["prompt"], "prompt"), limits)
            special = body.get("add_special_tokens", True)
            encode = functools.partial(tokenizer.encode, add_special_tokens=special)
            ids = await worker.run(worker.guarded, encode, "prompt", body["prompt"])
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """The text of ``tokens`` (special tokens kept, as the model sees them)."""
        body = check_fields(await read_json(request), DETOKENIZE, limits)
        if (refused := check_model(body.get("model"))) is not None:
            return refused
        if body.get("tokens") is None:
            raise BadRequest("missing required field 'tokens'", "tokens")
        return {"prompt": await worker.run(tokenizer.decode, body["tokens"])}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = check_fields(await read_json(request), COMPLETION, limits)
        if (refused := check_model(body.get("model"))) is not None:
            return refused
        max_tokens = body.get("max_tokens", 16)
        logprobs = body.get("logprobs")
        params = sampling_params(body, max_tokens, logprobs)
        prompts = await worker.run(worker.encode_prompts, completion_prompts(body.get("prompt"), limits))
        stream = start(prompts, params)
        if not isinstance(stream, _Stream):
            return stream
        rid = new_id("cmpl")
        if not body.get("stream"):
            return await reply(stream, request, lambda outs: completion_response(rid, model_name, outs, tokenizer))

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            outputs, offsets = [None] * len(stream.ids), [TextOffsets(tokenizer) for _ in stream.ids]
            try:
                while stream.open:
                    index, delta = await stream.next()
                    if delta.finish_reason == "error":
                        stream.cancel()
                        yield _engine_error_chunk()
                        break
                    if not delta.text and not delta.finished and logprobs is None:
                        continue
                    entries = None
                    if delta.logprobs is not None:
                        entries = await worker.run(completion_logprobs, tokenizer, delta.logprobs, offsets[index])
                    choice = {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                              "logprobs": entries}
                    outputs[index] = delta.output or outputs[index]
                    yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                "model": model_name, "choices": [choice]})
                else:
                    if include_usage:
                        yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                    "model": model_name, "choices": [], "usage": usage(outputs)})
                yield _sse("[DONE]")
            finally:
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = check_fields(await read_json(request), CHAT, limits)
        if (refused := check_model(body.get("model"))) is not None:
            return refused
        if "messages" not in body or body["messages"] is None:
            raise BadRequest("missing required field 'messages'", "messages")
        messages = chat_messages(body["messages"])
        # the template holds each message's text, maybe trimmed: at least the longest one
        longest = max((m["content"].strip() for m in messages), key=len)
        check_prompt_bytes(longest, check_text(longest, "messages"), limits)
        want_logprobs = bool(body.get("logprobs"))
        if body.get("top_logprobs") is not None and not want_logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (body.get("top_logprobs") or 0) if want_logprobs else None
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        params = sampling_params(body, max_tokens, logprobs)
        # the templated text refused by its bytes if it cannot fit, before it is tokenised: a
        # conversation of many short messages passes the longest-message check above
        prompt = await worker.run(worker.encode_chat, messages, chat_fits)
        stream = start([prompt], params)
        if not isinstance(stream, _Stream):
            return stream
        rid = new_id("chatcmpl")
        if not body.get("stream"):
            return await reply(stream, request, lambda outs: chat_response(rid, model_name, outs[0], tokenizer))

        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(delta: dict, finish_reason=None, logprobs=None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                         "model": model_name,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason,
                                      "logprobs": logprobs}]})

        async def events():
            output = None
            try:
                yield chunk({"role": "assistant", "content": ""})
                while stream.open:
                    _, delta = await stream.next()
                    if delta.finish_reason == "error":
                        stream.cancel()
                        yield _engine_error_chunk()
                        break
                    if not delta.text and not delta.finished and not want_logprobs:
                        continue
                    output = delta.output or output
                    entries = None
                    if delta.logprobs is not None:
                        entries = await worker.run(chat_logprobs, tokenizer, delta.logprobs)
                    yield chunk({"content": delta.text} if delta.text else {}, delta.finish_reason, entries)
                else:
                    if include_usage:
                        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                    "model": model_name, "choices": [], "usage": usage([output])})
                yield _sse("[DONE]")
            finally:
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The start-up warning for a server bound to a non-loopback address without an API key."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback or api_key is not None:
        return None
    return (f"warning: serving on {host} without --api-key: anyone who can reach this address can use the model; "
            "set --api-key (or SPARDA_API_KEY), or bind 127.0.0.1")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: a free port), not yet listening.

    Raises:
        SpardaError: the address cannot be resolved or bound (in use, no permission).
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise SpardaError(f"cannot resolve --host {host}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise SpardaError(f"cannot listen on {host}:{port}: {exc.strerror}; pick another --port") from None
    return sock


def _say(line: str) -> None:
    """One line on stderr from a signal handler: a raw write (``print`` there can re-enter a
    buffered write the main thread was in the middle of, and raise)."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


def serve(engine: Engine, model_name: str, sock: socket.socket, *, drain_timeout_s: float = 30.0,
          log_level: str = "warning", banner: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
          api_key: str | None = None, protect_health_metrics: bool = False) -> None:
    """Serve until SIGINT/SIGTERM (blocking), then drain and return.

    Args:
        engine: a started-or-not :class:`Engine` (its thread starts with the server).
        model_name: the name clients pass as ``model``.
        sock: a bound socket (:func:`bind_socket`).
        drain_timeout_s: seconds running requests get to finish after the signal.
        log_level: uvicorn's log level.
        banner: a line printed to stderr once the server is ready.
        max_request_bytes: larger request bodies get 413.
        api_key, protect_health_metrics: as :func:`create_app`.
    """
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with sparda's signal handling (no re-raise afterwards: exit 0).

        First SIGINT/SIGTERM: stop accepting, let requests run for ``drain_timeout_s``,
        then end what is left (each stream gets a final chunk and ``[DONE]``). Second:
        end them now. Later ones: ignored (the shutdown is under way; it waits for at
        most one engine step). uvicorn's own force-exit, which skips the engine's
        shutdown, is never used.
        """

        signals = 0
        timer: threading.Timer | None = None

        @contextlib.contextmanager
        def capture_signals(self):
            """SIGINT/SIGTERM to :meth:`handle_exit` while serving, then ignored: uvicorn's own
            restores the old handlers first, and a late signal in that gap interrupted the exit."""
            if threading.current_thread() is not threading.main_thread():  # signals: main thread only
                yield
                return
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.handle_exit)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(sig, signal.SIG_IGN)

        def handle_exit(self, sig, frame):
            self.signals += 1
            if self.signals == 1:
                engine.stop_accepting()
                m = engine.metrics()
                _say(f"shutting down: draining {m['requests_running']} running and {m['requests_waiting']} "
                     f"waiting requests for up to {drain_timeout_s:g} s (Ctrl-C again to stop now)")
                self.timer = threading.Timer(drain_timeout_s, self.end_requests, args=("the drain timeout passed",))
                self.timer.daemon = True
                self.timer.start()
            elif self.signals == 2:
                if self.timer is not None:
                    self.timer.cancel()
                self.end_requests("a second signal")
            elif self.signals == 3:
                _say("shutting down already; waiting for the current engine step")
            self.should_exit = True

        def end_requests(self, why: str) -> None:
            count = app.state.end_requests()
            if count:
                _say(f"shutting down: {why}; ending {count} requests in flight (each gets its final chunk)")

    app = create_app(engine, model_name, drain_timeout_s, banner, max_request_bytes=max_request_bytes,
                     api_key=api_key, protect_health_metrics=protect_health_metrics)
    # uvicorn waits for connections past the drain timeout, so that the ended streams flush
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s + FLUSH_S,
                            lifespan="on")
    try:
        Server(config).run(sockets=[sock])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a late signal must not interrupt the exit
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(sig, signal.SIG_IGN)
        engine.shutdown(0.0)  # no-op after the lifespan's; joins the thread if that did not run
