"""``sparda serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

Endpoints (docs/serving.md): ``GET /v1/models``, ``POST /v1/completions``,
``POST /v1/chat/completions`` (``stream: true``: server-sent events ending in
``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus text format).

Errors are OpenAI error objects: 400 for bad parameters (wrong types, unknown fields,
``max_tokens`` <= 0, a prompt that does not fit ``--max-model-len``, both lengths named),
404 for an unknown model, 429 with ``Retry-After`` when the queue is full, 503 with
``Retry-After`` while the server drains. A client that disconnects cancels its requests,
which frees their rows at the next engine step. SIGINT/SIGTERM stop accepting, let
running requests finish for up to ``--drain-timeout`` seconds, cancel the rest and exit
with status 0 (a second Ctrl-C exits at once).

The engine runs on its own thread; each HTTP request hands it requests and receives
their deltas on the event loop through ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import sys
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from sparda.engine.chat import chat_token_ids
from sparda.engine.engine import Engine, EngineStopped
from sparda.engine.scheduler import QueueFull
from sparda.errors import SpardaError
from sparda.server.protocol import (BadRequest, ChatCompletionRequest, CompletionRequest, chat_logprobs,
                                    chat_response, completion_logprobs, completion_response, error_body,
                                    new_id, usage)

#: seconds a client is told to wait (Retry-After) when the queue is full or the server drains
RETRY_AFTER_S = 1
#: seconds between two disconnect checks of a client waiting for a non-streamed answer
POLL_S = 0.25


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
           code: str | None = None, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)


def _refusal(exc: SpardaError):
    """The HTTP error of an exception raised while queuing a request."""
    if isinstance(exc, QueueFull):
        return _error(429, str(exc), "rate_limit_exceeded", retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineStopped):
        return _error(503, str(exc), "server_shutting_down", retry_after=RETRY_AFTER_S)
    return _error(400, str(exc), param=getattr(exc, "param", None))


def prometheus_text(metrics: dict, model: str) -> str:
    """Engine metrics (:meth:`Engine.metrics`) in the Prometheus text format, ``sparda_`` prefix."""
    label = f'model="{model}"'
    lines = []

    def put(name: str, kind: str, doc: str, value, extra: str = "") -> None:
        if not any(line.startswith(f"# TYPE sparda_{name} ") for line in lines):
            lines.extend([f"# HELP sparda_{name} {doc}", f"# TYPE sparda_{name} {kind}"])
        lines.append(f"sparda_{name}{{{label}{extra}}} {value}")

    put("requests_running", "gauge", "Requests holding a KV-cache row.", metrics["requests_running"])
    put("requests_waiting", "gauge", "Requests queued for a row.", metrics["requests_waiting"])
    put("kv_rows_in_use", "gauge", "KV-cache rows in use.", metrics["kv_rows_in_use"])
    put("kv_rows_total", "gauge", "KV-cache rows (--max-batch).", metrics["kv_rows_total"])
    put("max_model_len_tokens", "gauge", "Tokens per row (--max-model-len).", metrics["max_model_len"])
    put("generation_tokens_total", "counter", "Tokens generated.", metrics["generation_tokens_total"])
    put("prompt_tokens_total", "counter", "Prompt tokens prefilled.", metrics["prompt_tokens_total"])
    put("generation_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
        metrics["generation_tokens_per_s"])
    for reason, count in sorted(metrics["requests_finished"].items()):
        put("requests_finished_total", "counter", "Requests finished, by finish reason.", count,
            f',reason="{reason}"')
    if "offload" in metrics:
        put("offload_hit_rate", "gauge", "Fraction of selected KV blocks already on the device.",
            metrics["offload"].get("hit_rate", 0.0))
        put("offload_bytes_per_token", "gauge", "K+V bytes copied host-to-device per decoded token.",
            metrics["offload"].get("bytes_per_token", 0.0))
    return "\n".join(lines) + "\n"


class _Stream:
    """The deltas of one HTTP request's engine requests, delivered on the event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.ids: list[str] = []
        self.open: set[str] = set()

    def add(self, prompt_ids: list[int], params) -> None:
        """Queue one request (index = order of the calls). Raises as Engine.add_request."""
        index = len(self.ids)

        def on_delta(delta, index=index):
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
        """Abort every request of this HTTP request that has not finished."""
        for rid in list(self.open):
            self.engine.abort(rid)
        self.open.clear()


def _sse(payload) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def create_app(engine: Engine, model_name: str, drain_timeout_s: float = 30.0, banner: str | None = None):
    """The FastAPI application serving ``engine`` under the name ``model_name``.

    The engine's thread starts with the app (lifespan) and stops when it shuts down,
    after letting requests finish for up to ``drain_timeout_s`` seconds. ``banner`` is
    printed to stderr once the server is ready.
    """
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        if banner:
            print(banner, file=sys.stderr, flush=True)
        yield
        await asyncio.to_thread(engine.shutdown, drain_timeout_s)

    app = FastAPI(title="sparda", lifespan=lifespan)
    app.state.engine = engine
    tokenizer = engine.tokenizer

    @app.exception_handler(RequestValidationError)
    async def invalid(request, exc: RequestValidationError):
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
        if err.get("type") == "extra_forbidden":
            message = f"unrecognized request argument: {'.'.join(loc)}"
        elif err.get("type") == "json_invalid" or not loc:
            message = f"the request body is not valid JSON: {err.get('msg', 'invalid')}"
        elif err.get("type") == "missing":
            message = f"missing required field '{'.'.join(loc)}'"
        else:
            message = f"invalid value for '{param}': {err.get('msg', 'invalid')}"
        return _error(400, message, param=param)

    def check_model(name: str | None):
        if name is not None and name != model_name:
            return _error(404, f"model '{name}' does not exist; this server serves '{model_name}' (GET /v1/models)",
                          param="model", code="model_not_found")
        return None

    def start(prompts: list[list[int]], params):
        """Queue ``prompts``; an error response, or the :class:`_Stream`."""
        stream = _Stream(engine)
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

    def failed(outputs):
        if any(o.finish_reason == "error" for o in outputs):
            return _error(500, "the engine failed while running this request (see the server log)", "server_error")
        return None

    async def reply(stream: _Stream, request: Request, build):
        """The non-streamed answer: ``build(outputs)`` once every output is in, or the
        error for a client that went away or a failed engine."""
        outputs = await collect(stream, request)
        if outputs is None:
            return _error(499, "client closed the request", "client_disconnected")
        return failed(outputs) or JSONResponse(build(outputs))

    @app.get("/health")
    async def health():
        if not engine.accepting or not engine.alive:
            return _error(503, "shutting down" if not engine.accepting else "the engine thread stopped",
                          "server_shutting_down", retry_after=RETRY_AFTER_S)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(prometheus_text(engine.metrics(), model_name),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(engine.started),
                                            "owned_by": "sparda", "max_model_len": engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        if (refused := check_model(body.model)) is not None:
            return refused
        try:
            body.check_supported()
            params = body.sampling_params(body.max_tokens, body.logprobs)
            prompts = _completion_prompts(engine.llm, body.prompt)
        except SpardaError as exc:
            return _refusal(exc)
        stream = start(prompts, params)
        if not isinstance(stream, _Stream):
            return stream
        rid = new_id("cmpl")
        if not body.stream:
            return await reply(stream, request, lambda outs: completion_response(rid, model_name, outs, tokenizer))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events():
            outputs, offsets = [None] * len(stream.ids), [0] * len(stream.ids)
            try:
                while stream.open:
                    index, delta = await stream.next()
                    if not delta.text and not delta.finished and body.logprobs is None:
                        continue
                    choice = {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                              "logprobs": completion_logprobs(tokenizer, delta.logprobs, offsets[index])}
                    offsets[index] += len(delta.text)
                    outputs[index] = delta.output or outputs[index]
                    yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                "model": model_name, "choices": [choice]})
                if include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": int(time.time()),
                                "model": model_name, "choices": [], "usage": usage(outputs)})
                yield _sse("[DONE]")
            finally:
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        if (refused := check_model(body.model)) is not None:
            return refused
        try:
            body.check_supported()
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            prompt = chat_token_ids(tokenizer, [{"role": m["role"], "content": m["content"]} for m in messages])
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            params = body.sampling_params(max_tokens, logprobs)
        except SpardaError as exc:
            return _refusal(exc)
        stream = start([prompt], params)
        if not isinstance(stream, _Stream):
            return stream
        rid = new_id("chatcmpl")
        if not body.stream:
            return await reply(stream, request, lambda outs: chat_response(rid, model_name, outs[0], tokenizer))

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

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
                    if not delta.text and not delta.finished and not body.logprobs:
                        continue
                    output = delta.output or output
                    yield chunk({"content": delta.text} if delta.text else {}, delta.finish_reason,
                                chat_logprobs(tokenizer, delta.logprobs))
                if include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                "model": model_name, "choices": [], "usage": usage([output])})
                yield _sse("[DONE]")
            finally:
                stream.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def _completion_prompts(llm, prompt) -> list[list[int]]:
    """Token ids of each prompt of a completions request (no chat template)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise BadRequest("prompt is empty; pass some text", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    out = []
    for p in prompt:
        if isinstance(p, str):
            if not p:
                raise BadRequest("prompt is empty; pass some text", "prompt")
            out.append(llm.encode(p, chat=False))
        else:
            out.append(list(p))
    return out


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


def serve(engine: Engine, model_name: str, sock: socket.socket, *, drain_timeout_s: float = 30.0,
          log_level: str = "warning", banner: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM (blocking), then drain and return.

    Args:
        engine: a started-or-not :class:`Engine` (its thread starts with the server).
        model_name: the name clients pass as ``model``.
        sock: a bound socket (:func:`bind_socket`).
        drain_timeout_s: seconds running requests get to finish after the signal.
        log_level: uvicorn's log level.
        banner: a line printed to stderr once the server is ready.
    """
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # no re-raise of the signal afterwards: exit 0
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            if not self.should_exit:
                engine.stop_accepting()
                m = engine.metrics()
                print(f"shutting down: draining {m['requests_running']} running and {m['requests_waiting']} "
                      f"waiting requests for up to {drain_timeout_s:g} s (Ctrl-C again to stop now)",
                      file=sys.stderr, flush=True)
            self.should_exit = True

    app = create_app(engine, model_name, drain_timeout_s, banner)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=drain_timeout_s, lifespan="on")
    Server(config).run(sockets=[sock])
