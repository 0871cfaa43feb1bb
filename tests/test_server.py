"""`sparda serve` over real HTTP on 127.0.0.1, driven by the `openai` client.

The server (uvicorn + the engine's thread) runs in this process on a free loopback port;
references come from a second, independent LLM on the same checkpoint.
"""

import concurrent.futures
import json
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn

from sparda import LLM, SamplingParams
from sparda.engine.engine import Engine
from sparda.server.app import bind_socket, create_app

MODEL = "tiny-test"


pytestmark = pytest.mark.usefixtures("one_thread")


class Running:
    """A server in a background thread: ``url``, ``engine``, ``stop()``."""

    def __init__(self, llm, app_options=None, **engine_options):
        self.engine = Engine(llm, **engine_options)
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.engine, MODEL, drain_timeout_s=5.0, **(app_options or {})),
                                log_level="critical", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metrics(self) -> dict:
        """``/metrics`` parsed: ``{name or name{reason}: value}`` (model label dropped)."""
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line.startswith("#") or not line:
                continue
            name, value = line.rsplit(" ", 1)
            base, labels = name.split("{", 1)
            reason = [p.split("=")[1].strip('"') for p in labels.rstrip("}").split(",")
                      if p.startswith(("reason=", "bucket="))]
            out[f"{base}{{{reason[0]}}}" if reason else base] = float(value)
        return out

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
        assert not self.thread.is_alive() and not self.engine.alive


@pytest.fixture(scope="module")
def tiny_dir(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def server(tiny_dir):
    running = Running(LLM(tiny_dir, method="dense", device="cpu"), {"max_request_bytes": 2**16}, max_batch=8,
                      max_model_len=192, max_waiting=64)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """An independent LLM on the same checkpoint, for outputs computed alone."""
    return LLM(tiny_dir, method="dense", device="cpu")


def _alone(reference, ids, max_tokens):
    """Greedy ``(text, finish_reason, tokens)`` of one prompt alone, EOS honoured."""
    out = reference.generate([None], prompt_token_ids=[ids], max_new_tokens=max_tokens)[0]
    finish = "stop" if out.token_ids[-1] in reference.eos_ids() else "length"
    return out.text, finish, len(out.token_ids)


def _sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines() if line]


def test_models_health_and_metrics(server):
    models = server.client.models.list().data
    assert [m.id for m in models] == [MODEL] and models[0].max_model_len == 192
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    metrics = server.metrics()
    assert metrics["sparda_kv_rows_total"] == 8 and metrics["sparda_max_model_len_tokens"] == 192
    for name in ("sparda_requests_running", "sparda_requests_waiting", "sparda_kv_rows_in_use",
                 "sparda_generation_tokens_per_second", "sparda_generation_tokens_total", "sparda_decode_bucket_rows",
                 "sparda_cuda_graph_capture_seconds_total"):
        assert name in metrics


def test_completion_and_chat_equal_generate_alone(server, reference, bundled_tokenizer):
    prompt = "The quick brown fox"
    got = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=9, temperature=0)
    text, finish, count = _alone(reference, reference.encode(prompt, chat=False), 9)
    assert (got.choices[0].text, got.choices[0].finish_reason, got.usage.completion_tokens) == (text, finish, count)
    assert got.usage.prompt_tokens == len(reference.encode(prompt, chat=False))
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a colour."}]
    got = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=7, temperature=0)
    ids = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    text, finish, count = _alone(reference, ids, 7)
    choice = got.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", text, finish)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ids), count)


def test_streaming_deltas_concatenate_to_the_non_streamed_text(server):
    kwargs = dict(model=MODEL, prompt=[11, 12, 13, 14, 15], max_tokens=12, temperature=0)
    whole = server.client.completions.create(**kwargs).choices[0].text
    chunks = list(server.client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole and chunks[-1].choices[0].finish_reason
    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    chunks = list(server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == whole.choices[0].message.content and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    with httpx.stream("POST", server.url + "/v1/completions", json=dict(kwargs, stream=True)) as response:
        lines = _sse_lines(response)
    assert response.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)


def test_32_concurrent_requests_all_complete_and_equal_generate_alone(server, reference, fresh_seed):
    lengths = torch.randint(3, 120, (32,)).tolist()
    prompts = [torch.randint(0, 49152, (n,)).tolist() for n in lengths]
    max_tokens = torch.randint(1, 12, (32,)).tolist()

    def ask(i):
        kwargs = dict(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0)
        if i % 2:  # half of them streamed
            chunks = list(server.client.completions.create(stream=True, **kwargs))
            return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        choice = server.client.completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, range(32)))
    for i, (text, finish) in enumerate(answers):
        want_text, want_finish, _ = _alone(reference, prompts[i], max_tokens[i])
        assert (text, finish) == (want_text, want_finish), f"seed {fresh_seed}, request {i}"
    assert server.metrics()["sparda_kv_rows_in_use"] == 0


def test_disconnect_mid_stream_cancels_and_frees_the_row(server):
    before = server.metrics().get("sparda_requests_finished_total{abort}", 0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other = pool.submit(server.client.completions.create, model=MODEL, prompt=[5, 6, 7], max_tokens=30,
                            temperature=0)
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 150, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as response:
            events = response.iter_lines()
            got = [next(events) for _ in range(3)]
            assert server.metrics()["sparda_kv_rows_in_use"] >= 1
        assert all(json.loads(e[6:])["choices"][0]["finish_reason"] is None for e in got if e)
        assert len(other.result(timeout=120).choices[0].text) > 0  # the others go on
    deadline = time.monotonic() + 30
    while True:
        metrics = server.metrics()
        if metrics["sparda_kv_rows_in_use"] == 0 and metrics.get("sparda_requests_finished_total{abort}", 0) > before:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert metrics["sparda_requests_running"] == 0


@pytest.mark.parametrize("path, body, status, fragment", [
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be an integer in [1, 191]"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens must be an integer in [1, 191]"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens must be an integer in [1, 191] "
                                                              "(--max-model-len 192 less one prompt token), got \"ten\""),
    ("completions", {"prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens must be an integer in [1, 191]"),
    ("completions", {"prompt": "hi", "max_tokens": True}, 400, "got true"),  # as JSON spells it
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature must be a finite number >= 0"),
    ("completions", {"prompt": 42}, 400, "prompt must be a string, a list of strings, a list of token ids"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ("completions", {"prompt": "hi", "temperature": 1e-40}, 400, "a positive one at least 1e-05), got 1e-40"),
    ("completions", {"prompt": "hi", "top_p": 2}, 400, "top_p must be a number in (0, 1]"),
    ("completions", {"prompt": "hi", "top_k": -2}, 400, "top_k must be an integer >= 1, or 0 / -1"),
    ("completions", {"prompt": "hi", "seed": 2**64}, 400, "seed must be an integer in [-2**63, 2**64 - 1]"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs must be an integer in [0, 20]"),
    ("completions", {"prompt": "hi", "stop": ["x"] * 17}, 400, "stop must be a string or a list of at most 16"),
    ("completions", {"prompt": "hi", "stop": "x" * 1001}, 400, "each of 1 to 1000 characters, got \"xxx"),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop must be a string or a list"),
    ("completions", {"prompt": "hi", "stop_token_ids": [49152]}, 400,
     "stop_token_ids must be a list of at most 1024 token ids in [0, 49152)"),
    ("completions", {"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos must be true or false, got 1"),
    ("completions", {"prompt": "hi", "stream": "yes"}, 400, "stream must be true or false"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options needs stream: true"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n must be 1"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo is not supported"),
    ("completions", {"prompt": [3] * 200}, 400, "prompt of 200 tokens does not fit --max-model-len 192"),
    ("completions", {"prompt": [3] * 100, "max_tokens": 100}, 400,
     "prompt of 100 tokens plus max_tokens 100 exceeds --max-model-len 192"),
    ("completions", {"prompt": [3, 49152]}, 400, "prompt token ids must be in [0, 49152)"),
    ("completions", {"prompt": [[3, 4], [-1]]}, 400, "prompt token ids must be in [0, 49152)"),
    ("completions", {"prompt": [[3, 4], 5]}, 400, "prompt must be a string, a list of strings"),
    ("completions", {"prompt": "", "max_tokens": 3}, 400, "prompt is empty"),
    ("completions", {"max_tokens": 3}, 400, "missing required field 'prompt'"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist; this server serves"),
    ("completions", {"model": 7, "prompt": "hi"}, 400, "model must be a string"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "has role 'wizard'"),
    ("chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("chat/completions", {"messages": "hi"}, 400, "messages must be a non-empty list"),
    ("chat/completions", {}, 400, "missing required field 'messages'"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages[0] is missing required field 'content'"),
    ("chat/completions", {"messages": [3]}, 400, "messages[0] must be an object"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "images and audio are not supported"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens must be an integer in [1, 191]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 1.5}, 400,
     "max_completion_tokens must be an integer in [1, 191]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 99, "logprobs": True},
     400, "top_logprobs must be an integer in [0, 20]"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs needs logprobs: true"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 300}]}, 400,
     "does not fit --max-model-len 192"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, fragment):
    body = dict({"model": MODEL}, **body)
    response = httpx.post(f"{server.url}/v1/{path}", json=body)
    error = response.json()["error"]
    assert response.status_code == status and fragment in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    if status == 400 and " must be " in fragment and "[" not in fragment.split(" ", 1)[0]:  # the field is the param
        assert error["param"] == fragment.split(" ", 1)[0], error


def test_non_finite_numbers_and_unencodable_text_are_400(server):
    for raw, fragment in [(b'{"prompt": "hi", "temperature": NaN}', "temperature must be a finite number"),
                          (b'{"prompt": "hi", "top_p": Infinity}', "top_p must be a number in (0, 1], got Infinity"),
                          (b'{"prompt": "hi", "max_tokens": 1e400}', "max_tokens must be an integer"),
                          (b'{"prompt": "ab\\ud800c"}', "unpaired surrogate '\\ud800' at character 2"),
                          (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "unpaired surrogate"),
                          (b'[' * 20000 + b']' * 20000, "not valid JSON"),  # deeper than the parser's recursion limit
                          (b'{"prompt": "\xff\xfe"}', "not valid JSON"),
                          (b'[1, 2]', "the request body must be a JSON object, got list"),
                          # valid JSON past Python's int parsing limit: no advice to call sys.set_int_max_str_digits
                          (b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b'}', "an integer of more than 4300 digits")]:
        path = "chat/completions" if b"messages" in raw else "completions"
        response = httpx.post(f"{server.url}/v1/{path}", content=raw, headers={"content-type": "application/json"})
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text
        assert "sys." not in response.text, response.text


def test_the_openai_client_raises_its_own_errors(server):
    with pytest.raises(openai.BadRequestError, match="max_tokens must be"):
        server.client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        server.client.completions.create(model="nope", prompt="hi")
    response = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_full_queue_is_429_and_draining_is_503_with_retry_after(tiny_dir):
    running = Running(LLM(tiny_dir, method="dense", device="cpu"), max_batch=1, max_model_len=512, max_waiting=1)
    try:
        hold = SamplingParams(max_tokens=500, ignore_eos=True)
        first = running.engine.add_request([1, 2], hold)
        deadline = time.monotonic() + 30
        while running.engine.metrics()["requests_running"] < 1:  # it holds the only row
            assert time.monotonic() < deadline
            time.sleep(0.01)
        second = running.engine.add_request([3, 4], hold)  # it waits
        response = httpx.post(running.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 429 and response.headers["retry-after"] == "1"
        assert "queue is full" in response.json()["error"]["message"]
        metrics = running.metrics()
        assert metrics["sparda_requests_waiting"] == 1 and metrics["sparda_kv_rows_in_use"] == 1
        assert metrics["sparda_kv_tokens_in_use"] >= 2  # the first request's prompt at least
        running.engine.stop_accepting()
        response = httpx.post(running.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert httpx.get(running.url + "/health").status_code == 503
        running.engine.abort(first.request_id)
        running.engine.abort(second.request_id)
    finally:
        running.stop()


def test_offloaded_server_reports_hit_rate_and_bytes_per_token(tiny_dir):
    llm = LLM(tiny_dir, method="sparse-offload", device="cpu", block_size=16, kernel_size=8, kernel_stride=4,
              init_blocks=1, local_blocks=2, topk_blocks=2, dense_len=0)
    running = Running(llm, max_batch=2, max_model_len=192)
    try:
        prompts = [torch.randint(0, 49152, (n,)).tolist() for n in (120, 150)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda ids: running.client.completions.create(
                model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}), prompts))
        metrics = running.metrics()
        assert 0 < metrics["sparda_offload_hit_rate"] < 1 and metrics["sparda_offload_bytes_per_token"] > 0
        hits, misses = metrics["sparda_offload_hits_total"], metrics["sparda_offload_misses_total"]
        assert hits > 0 and misses > 0
        assert abs(hits / (hits + misses) - metrics["sparda_offload_hit_rate"]) < 1e-4
    finally:
        running.stop()


@pytest.fixture
def poisoned(monkeypatch):
    """Requests whose prompt starts with token 4242 fail in detokenisation at their 3rd token."""
    from sparda.engine.sequence import Sequence

    append = Sequence.append

    def faulty(self, token, *args, **kwargs):
        if self.prompt_ids[0] == 4242 and len(self.output_ids) == 2:
            raise RuntimeError("injected detokenisation fault")
        return append(self, token, *args, **kwargs)

    monkeypatch.setattr(Sequence, "append", faulty)


def test_a_request_failing_in_the_engine_hurts_only_itself(server, reference, poisoned):
    good = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beside = pool.submit(lambda: list(server.client.completions.create(stream=True, **good)))
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"model": MODEL, "prompt": [4242, 1, 2], "max_tokens": 20, "stream": True}) as response:
            lines = _sse_lines(response)
        assert lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[-2][6:])["error"]["type"] == "server_error"
        with pytest.raises(openai.APIError, match="the engine failed while running this request"):
            list(server.client.completions.create(model=MODEL, prompt=[4242, 9], stream=True, max_tokens=9))
        with pytest.raises(openai.InternalServerError, match="the engine failed"):
            server.client.completions.create(model=MODEL, prompt=[4242, 3], max_tokens=9, temperature=0)
        chunks = beside.result(timeout=120)
    assert "".join(c.choices[0].text for c in chunks) == _alone(reference, [5, 6, 7, 8], 20)[0]
    deadline = time.monotonic() + 30
    while server.metrics()["sparda_kv_rows_in_use"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.metrics()["sparda_requests_finished_total{error}"] >= 3


def test_a_crashed_engine_thread_makes_health_503_and_refuses_requests(tiny_dir, monkeypatch, capfd):
    running = Running(LLM(tiny_dir, method="dense", device="cpu"), max_batch=1, max_model_len=64)
    try:
        def broken():
            raise MemoryError("injected crash")

        monkeypatch.setattr(running.engine.scheduler, "has_work", broken)
        with pytest.raises(openai.InternalServerError, match="the engine failed"):
            running.client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3)
        response = httpx.get(running.url + "/health")
        assert response.status_code == 503 and "engine thread stopped" in response.json()["error"]["message"]
        response = httpx.post(running.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
        assert response.status_code == 503 and "engine thread stopped" in response.json()["error"]["message"]
        assert "the engine thread crashed (MemoryError: injected crash)" in capfd.readouterr().err
    finally:
        monkeypatch.undo()
        running.stop()


def test_unknown_fields_are_ignored_with_a_warning_and_output_changing_ones_refused(server, caplog):
    messages = [{"role": "user", "content": "Hi", "refusal": None}]
    plain = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    with caplog.at_level("WARNING", logger="sparda.server"):
        got = server.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, temperature=0, store=True, parallel_tool_calls=False,
            user="u-1", service_tier="auto", reasoning_effort="low", metadata={"k": "v"}, tools=[], n=1,
            response_format={"type": "text"}, extra_body={"frobnicate": 1, "logit_bias": {}})
    assert got.choices[0].message.content == plain.choices[0].message.content
    warned = [r.getMessage() for r in caplog.records if r.name == "sparda.server"]
    prefix = "ignoring request fields sparda serve does not use: "
    named = [set(w[len(prefix):].split(", ")) for w in warned if w.startswith(prefix)]
    assert {"store", "parallel_tool_calls", "service_tier", "reasoning_effort", "metadata", "frobnicate",
            "messages[0].refusal"} in named, warned  # user, tools: [], n: 1, logit_bias: {} are no-ops
    for extra, name in [({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"logit_bias": {"5": 3}}, "logit_bias"), ({"n": 3}, "n"),
                        ({"presence_penalty": 0.5}, "presence_penalty"), ({"min_tokens": 4}, "min_tokens"),
                        ({"guided_json": {}}, "guided_json"), ({"skip_special_tokens": False}, "skip_special_tokens"),
                        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
                         "messages")]:
        body = dict({"model": MODEL, "messages": messages}, **extra)
        response = httpx.post(server.url + "/v1/chat/completions", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == name and "not supported" in error["message"] \
            or name == "n" and "n must be 1" in error["message"], (name, error)



def test_an_ignored_field_name_cannot_forge_or_flood_the_log(server, caplog):
    """The warning naming ignored fields showed each name as sent: a key with a newline wrote
    a forged line into the server log, and one key of 60 KB wrote 60 KB per request (up to
    --max-request-bytes). Names are escaped and cut; the request itself is still served."""
    forged = "x\nERROR sparda: the engine thread died (forged)"
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, forged: 1, "y" * 60000: 2, "\x1b[2J": 3}
    with caplog.at_level("WARNING", logger="sparda.server"):
        assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
        messages = [{"role": "user", "content": "x", "z" * 60000: 1}]
        assert httpx.post(server.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": messages, "max_tokens": 1}).status_code == 200
    warned = [r.getMessage() for r in caplog.records if r.name == "sparda.server"]
    assert len(warned) == 2 and all(len(w) < 400 for w in warned), [w[:200] for w in warned]
    assert all("\n" not in w and "\x1b" not in w for w in warned), warned
    assert json.dumps(forged) in warned[0] and '"yyyy' in warned[0] and '"messages[0].zzzz' in warned[1]


def test_a_prompt_of_no_tokens_is_refused_before_any_prompt_is_queued(server):
    """Text the tokenizer drops whole ("\\x04", outside the byte-level vocabulary) is no tokens:
    the 400 named no field, and in a batch the prompts before it were queued, then aborted
    (counted as aborts in /metrics, as if a client had gone away)."""
    before = server.engine.metrics()["requests_finished"].get("abort", 0)
    for prompt, fragment in [("\x04\x06", "prompt is no tokens once tokenised"),
                             (["hello there", "\x04"], "prompt[1] is no tokens once tokenised")]:
        response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "prompt" and fragment in error["message"], error
    deadline = time.monotonic() + 30
    while server.engine.has_work():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert server.engine.metrics()["requests_finished"].get("abort", 0) == before


def test_every_error_is_an_openai_error_object(server, monkeypatch):
    def check(response, status, fragment):
        error = response.json()["error"]
        assert response.status_code == status and fragment in error["message"], response.text
        assert set(error) == {"message", "type", "param", "code"}

    check(httpx.get(server.url + "/v1/nope"), 404, "no such endpoint: GET /v1/nope")
    response = httpx.get(server.url + "/v1/completions")
    check(response, 405, "method not allowed: GET /v1/completions")
    assert response.headers["allow"] == "POST"
    big = {"model": MODEL, "prompt": "x" * 2**16}
    check(httpx.post(server.url + "/v1/completions", json=big), 413, "exceeds --max-request-bytes 65536")

    def chunked():  # no Content-Length: refused once the body passes the limit
        for _ in range(40):
            yield b" " * 2048

    check(httpx.post(server.url + "/v1/completions", content=chunked()), 413, "exceeds --max-request-bytes")
    check(httpx.post(server.url + "/v1/completions", content=b""), 400, "the request body is not valid JSON")
    # a schema violation: an OpenAI 400 naming the field, never FastAPI's 422 {"detail": ...}
    check(httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": "many"}),
          400, "max_tokens")

    def broken():
        raise RuntimeError("injected bug")

    monkeypatch.setattr(server.engine, "metrics", broken)
    check(httpx.get(server.url + "/metrics"), 500, "internal server error (see the server log)")
    monkeypatch.undo()
    assert server.client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices  # still serving


def test_tokenisation_runs_off_the_event_loop(server, monkeypatch):
    encode = server.engine.llm.encode

    def slow(text, chat=True):
        if text.startswith("slow"):
            time.sleep(2.0)
        return encode(text, chat)

    monkeypatch.setattr(server.engine.llm, "encode", slow)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, server.url + "/v1/completions",
                              json={"model": MODEL, "prompt": "slow prompt", "max_tokens": 2}, timeout=60)
        time.sleep(0.3)  # the tokenizer is busy now
        waits = []
        with httpx.Client() as client:
            client.get(server.url + "/health")  # the connection, outside the timing
            for _ in range(5):  # all within the 2 s tokenisation
                begun = time.perf_counter()
                assert client.get(server.url + "/health").status_code == 200
                waits.append(time.perf_counter() - begun)
        assert pending.result().status_code == 200
    waits.sort()
    # blocked behind the tokenisation, a wait would last ~1.7 s; a loaded CI machine adds tenths
    assert waits[2] < 0.5 and waits[-1] < 1.2, f"/health waited {waits} s behind a tokenisation"  # median, worst


def test_chat_logprobs_bytes_are_the_tokens_own_bytes(bundled_tokenizer, fresh_seed):
    """OpenAI's ``bytes`` is there for tokens that split a character: it was the UTF-8 of the
    decoded text, so a token ending inside "\U0001f642" said [239, 191, 189] (U+FFFD) and
    the bytes of a completion's tokens did not join to its text. Reference: the text's own
    UTF-8, cut into the tokens the tokenizer makes of it."""
    import random

    from sparda.server.protocol import chat_logprobs

    rng = random.Random(fresh_seed)
    pieces = ["\U0001f642", " na\u00efve", " \u6f22\u5b57", " \u2014 ok", "\u00e9t\u00e9", " \U0001d400", "\ud55c"]
    for _ in range(20):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 8)))
        ids = bundled_tokenizer.encode(text, add_special_tokens=False)
        entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": {t: -1.0}} for t in ids]
        content = chat_logprobs(bundled_tokenizer, entries)["content"]
        assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8"), (fresh_seed, text)
        assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    split = bundled_tokenizer.encode("\U0001f642", add_special_tokens=False)
    assert len(split) > 1 and "\ufffd" in bundled_tokenizer.decode(split[:1])  # the case is exercised


def test_completion_text_offsets_index_the_text(bundled_tokenizer, fresh_seed):
    """``text_offset`` summed each token's own decoded text: a character split over two
    tokens counted as its U+FFFD pieces (an emoji as 3 characters), and an EOS as its name
    (10), so every later offset pointed past its token in the text. Reference: the length of
    the text of the tokens before it, decoded whole, less a trailing partial character."""
    import random

    from sparda.server.protocol import TextOffsets, completion_logprobs

    rng = random.Random(fresh_seed)
    pieces = ["\U0001f642", " na\u00efve", " \u6f22\u5b57", " ok", "\u00e9t\u00e9", " \U0001d400", "<|im_end|>"]
    for _ in range(20):
        ids = bundled_tokenizer.encode("".join(rng.choice(pieces) for _ in range(rng.randint(1, 8))),
                                       add_special_tokens=False)
        entries = [{"token_id": t, "logprob": -1.0, "top_logprobs": {}} for t in ids]
        got = completion_logprobs(bundled_tokenizer, entries)["text_offset"]
        want = [len(bundled_tokenizer.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd"))
                for i in range(len(ids))]
        assert got == want, (fresh_seed, ids)
        offsets, cut = TextOffsets(bundled_tokenizer), rng.randint(0, len(ids))  # a stream: in pieces
        streamed = [completion_logprobs(bundled_tokenizer, part, offsets)["text_offset"]
                    for part in (entries[:cut], entries[cut:])]
        assert streamed[0] + streamed[1] == want, (fresh_seed, ids, cut)


def _record_encodes(server, monkeypatch) -> tuple[list[int], object]:
    """The lengths of the texts the server's tokenizer encodes from now on (a list that fills),
    and its own ``encode``."""
    tokenizer = server.engine.tokenizer
    encode, seen = tokenizer.encode, []

    def recording(text, *args, **kwargs):
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", recording)
    return seen, encode


def test_a_chat_too_long_to_fit_is_refused_before_it_is_tokenised(server, monkeypatch):
    """The chat check bounded only the longest message: a conversation of many short ones
    (9 MiB of them took 5 s on the one tokenizer thread, every other request waiting behind
    it) was tokenised whole before its length was refused. Its templated text is now refused
    by its bytes first; the tokenizer never sees it."""
    seen, encode = _record_encodes(server, monkeypatch)
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hello there"} for i in range(1200)]
    response = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
    error = response.json()["error"]
    assert response.status_code == 400 and "tokens does not fit --max-model-len 192" in error["message"], error
    assert seen == [], seen
    ok = server.client.chat.completions.create(model=MODEL, messages=messages[:3], max_tokens=2)
    assert ok.choices[0].message.content is not None and seen  # one that fits is tokenised as before


def test_tokenize_refuses_text_that_cannot_fit_before_tokenising(server, monkeypatch, fresh_seed):
    """/tokenize had no bound: 15 MiB held the one tokenizer thread 13 s. Text (or a chat) whose
    bytes alone show it cannot fit --max-model-len is refused as the completion endpoints refuse
    it, the tokenizer never seeing it; text that fits is counted as before."""
    import random

    seen, encode = _record_encodes(server, monkeypatch)
    rng = random.Random(fresh_seed)
    text = "".join(rng.choice(["hello ", "world ", "sparse ", "attention "]) for _ in range(6000))
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hello there"} for i in range(1200)]
    for body in ({"prompt": text}, {"messages": messages}):
        response = httpx.post(server.url + "/tokenize", json=body)
        error = response.json()["error"]
        assert response.status_code == 400 and "does not fit --max-model-len 192" in error["message"], (body.keys(),
                                                                                                       error)
    assert seen == [], seen
    got = httpx.post(server.url + "/tokenize", json={"prompt": text[:300]}).json()
    assert got["count"] == len(encode(text[:300])) and seen, (fresh_seed, got)  # fits: counted


def test_a_message_name_reaches_the_chat_template(server, monkeypatch, fresh_seed):
    """OpenAI's optional message ``name`` was dropped before the template saw it: a template
    that renders it now gets it (checked against the text built by hand); a name that is not
    a string is a 400."""
    import random

    tokenizer = server.engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", "{% for m in messages %}<{{ m.role }}{% if m.name %}:"
                        "{{ m.name }}{% endif %}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
                        "<assistant>{% endif %}")
    rng = random.Random(fresh_seed)
    name = "".join(rng.choice("abcdefxyz_") for _ in range(rng.randint(1, 12)))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": name}]
    got = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    text = f"<system>Be brief.\n<user:{name}>Hi\n<assistant>"
    assert got["tokens"] == tokenizer.encode(text, add_special_tokens=False), (fresh_seed, name, got)
    bad = httpx.post(server.url + "/v1/chat/completions",
                     json={"model": MODEL, "messages": [{"role": "user", "content": "Hi", "name": 3}]})
    assert bad.status_code == 400 and "messages[0].name must be a string" in bad.json()["error"]["message"]


def test_token_floor_is_a_lower_bound_on_real_token_counts(bundled_tokenizer):
    """ceil(kept bytes / bytes_per_token) never exceeds the real count, on adversarial text:
    the longest tokens repeated, special tokens back to back, whitespace runs, bytes the
    vocabulary drops, random Unicode; tokenizers with no sound bound get None."""
    import random

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from sparda.server.protocol import TokenFloor, token_floor

    floor = token_floor(bundled_tokenizer)
    vocab = bundled_tokenizer.get_vocab()
    longest = max(vocab, key=len)
    specials = bundled_tokenizer.all_special_tokens
    assert floor.bytes_per_token == max(len(longest), *(len(t.encode()) for t in specials))
    assert b"\x04" in floor.unkept and bundled_tokenizer.encode("\x04" * 50) == []  # dropped: counts 0 bytes
    pieces = [bundled_tokenizer.convert_tokens_to_string([longest]), "\n" + " " * 200, "\x04\x06\x13",
              *specials, "\u00e9", "\U0001d400", "\ud55c\uae00", "ab", " the"]
    for _ in range(300):
        text = "".join(random.choice(pieces) if random.random() < 0.7 else chr(random.randint(32, 0x2FFFF))
                       for _ in range(random.randint(1, 40)))
        text = text.encode("utf-8", "ignore").decode("utf-8")  # no lone surrogates
        real = len(bundled_tokenizer.encode(text))
        assert floor.tokens(text) <= real, (text, floor.tokens(text), real)
    # a SentencePiece-like byte-fallback BPE: spaces become "\u2581" (1 byte to 3)
    words = ["\u2581", "t", "h", "e", "a", "b", "\u2581t", "\u2581th", "\u2581the", "ab"]
    pieces = {f"<0x{b:02X}>": b for b in range(256)} | {w: 256 + i for i, w in enumerate(words)}
    spm = Tokenizer(models.BPE(pieces, [("\u2581", "t"), ("\u2581t", "h"), ("\u2581th", "e"), ("a", "b")],
                               byte_fallback=True))
    spm.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    spm_floor = token_floor(PreTrainedTokenizerFast(tokenizer_object=spm))
    assert spm_floor == TokenFloor(len("\u2581the".encode()), b"")
    for _ in range(100):
        text = "".join(random.choice([" the", "ab", " ", "\u00e9", "x"]) for _ in range(random.randint(1, 60)))
        assert spm_floor.tokens(text) <= len(spm.encode(text).ids), text
    word_split = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    word_split.pre_tokenizer = pre_tokenizers.Whitespace()
    stripped = Tokenizer(models.BPE({"a": 0, "<0x00>": 1}, [], byte_fallback=True))
    stripped.normalizer = normalizers.Strip()
    for backend in (word_split, stripped):
        assert token_floor(PreTrainedTokenizerFast(tokenizer_object=backend)) is None


@pytest.mark.parametrize("protect", [False, True])
def test_api_key_guards_the_api_with_the_openai_client(tiny_dir, protect):
    from sparda.server.app import exposure_warning

    running = Running(LLM(tiny_dir, method="dense", device="cpu"),
                      {"api_key": "s3cret-key", "protect_health_metrics": protect}, max_batch=1, max_model_len=64)
    try:
        def client(key):
            return openai.OpenAI(base_url=running.url + "/v1", api_key=key, max_retries=0, timeout=60)

        assert client("s3cret-key").completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert [m.id for m in client("s3cret-key").models.list().data] == [MODEL]
        for wrong in ("s3cret-kez", "s3cret-key-and-more", "unused"):
            with pytest.raises(openai.AuthenticationError, match="missing or incorrect API key"):
                client(wrong).completions.create(model=MODEL, prompt="hi", max_tokens=2)
        for headers in ({}, {"Authorization": "s3cret-key"}, {"Authorization": "Basic s3cret-key"}):
            response = httpx.post(running.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
        assert httpx.get(running.url + "/v1/nope").status_code == 401  # no probing of paths without the key
        for path in ("/health", "/metrics"):
            assert httpx.get(running.url + path).status_code == (401 if protect else 200)
            assert httpx.get(running.url + path, headers={"Authorization": "Bearer s3cret-key"}).status_code == 200
    finally:
        running.stop()
    assert exposure_warning("127.0.0.1", None) is None and exposure_warning("::1", None) is None
    assert exposure_warning("0.0.0.0", "k") is None
    assert "serving on 0.0.0.0 without --api-key" in exposure_warning("0.0.0.0", None)


def test_a_batch_that_can_never_be_queued_is_400_not_429(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 65})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "prompt"
    assert "prompt holds 65 prompts, more than this server can ever queue at once (--max-waiting 64)" \
        in error["message"]
    got = server.client.completions.create(model=MODEL, prompt=["hi"] * 64, max_tokens=1)  # the most it takes
    assert len(got.choices) == 64


def test_tokenize_detokenize_and_version(server, reference, bundled_tokenizer):
    import sparda

    text = "The quick brown fox"
    got = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert got == {"count": len(reference.encode(text, chat=False)), "max_model_len": 192,
                   "tokens": reference.encode(text, chat=False)}
    completion = server.client.completions.create(model=MODEL, prompt=text, max_tokens=1)
    assert completion.usage.prompt_tokens == got["count"]  # the ids the completion runs on
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
    ids = bundled_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat["tokens"] == list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": bundled_tokenizer.decode(got["tokens"])}
    assert httpx.get(server.url + "/version").json() == {"version": sparda.__version__}
    for path, body, fragment in [("/tokenize", {"prompt": "x", "messages": messages}, "pass one of 'prompt'"),
                                 ("/tokenize", {"prompt": ""}, "prompt must be a non-empty string"),
                                 ("/tokenize", b'{"prompt": "a\\ud800"}', "unpaired surrogate"),
                                 ("/detokenize", {"tokens": [1, 49152]}, "tokens must be a list of token ids in "
                                                                         "[0, 49152)"),
                                 ("/detokenize", {}, "missing required field 'tokens'")]:
        response = httpx.post(server.url + path, **({"content": body} if isinstance(body, bytes) else {"json": body}))
        assert response.status_code == 400 and fragment in response.json()["error"]["message"], response.text


def test_prometheus_metrics_from_prometheus_client(server):
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        response = httpx.get(server.url + "/metrics")
        assert response.headers["content-type"].startswith("text/plain; version=")
        return {s.name + ("{%s}" % s.labels["reason"] if "reason" in s.labels else "")
                + ("{le=%s}" % s.labels["le"] if "le" in s.labels else ""): s.value
                for family in text_string_to_metric_families(response.text) for s in family.samples
                if s.labels.get("model") == MODEL}

    before = scrape()
    for stream in (False, True):
        got = server.client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=6, temperature=0,
                                               stream=stream, extra_body={"ignore_eos": True})
        if stream:
            list(got)
    after = scrape()
    assert after["sparda_kv_rows_total"] == 8 and after["sparda_kv_rows_free"] == 8 - after["sparda_kv_rows_in_use"]
    assert after["sparda_requests_running"] == 0 and after["sparda_requests_waiting"] == 0
    assert after["sparda_requests_prefilling"] == 0 and after["sparda_kv_tokens_in_use"] == 0
    assert after["sparda_kv_tokens_total"] == 8 * 192
    assert after["sparda_preemptions_total"] == 0 and after["sparda_max_model_len_tokens"] == 192
    assert after["sparda_prompt_tokens_total"] - before["sparda_prompt_tokens_total"] == 6
    assert after["sparda_generation_tokens_total"] - before["sparda_generation_tokens_total"] == 12
    assert after["sparda_requests_finished_total{length}"] - before.get("sparda_requests_finished_total{length}", 0) == 2
    for name in ("sparda_time_to_first_token_seconds", "sparda_time_per_output_token_seconds",
                 "sparda_request_latency_seconds"):
        assert after[f"{name}_count"] - before[f"{name}_count"] == 2, name
        assert after[f"{name}_bucket{{le=+Inf}}"] == after[f"{name}_count"] and after[f"{name}_sum"] > 0
    assert "sparda_offload_hit_rate" not in after  # an on-device cache


def test_metrics_time_the_engine_steps_by_kind(server):
    """The step-time counters and ``engine_step_seconds{kind}``: two requests of 3 prompt
    tokens and 6 new ones, one after the other on an idle server, each a mixed step (its
    prompt, its first decode) and four decode steps; seconds within the requests' wall time."""
    from prometheus_client.parser import text_string_to_metric_families

    def scrape():
        text = httpx.get(server.url + "/metrics").text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model")
                if s.labels.get("model") == MODEL:
                    out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
        return out

    before = scrape()
    assert before["sparda_engine_step_seconds_count{kind=decode}"] >= 0  # both kinds are there from the start
    assert before["sparda_engine_step_seconds_count{kind=mixed}"] >= 0
    start = time.perf_counter()
    for _ in range(2):
        server.client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:  # the last step ends (and is timed) just after its final delta went out
        after = scrape()
        diff = {k: after[k] - before.get(k, 0.0) for k in after}
        if diff["sparda_engine_step_seconds_count{kind=decode}"] >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    wall = time.perf_counter() - start
    assert diff["sparda_prefill_tokens_run_total"] == 6 and diff["sparda_decode_rows_total"] == 10, diff
    assert diff["sparda_engine_step_seconds_count{kind=mixed}"] == 2, diff
    assert diff["sparda_engine_step_seconds_count{kind=decode}"] == 8, diff
    assert sum(v for k, v in diff.items() if k.startswith("sparda_decode_steps_total{bucket=")) == 10, diff
    busy = diff["sparda_prefill_seconds_total"] + diff["sparda_decode_seconds_total"]
    steps = diff["sparda_engine_step_seconds_sum{kind=decode}"] + diff["sparda_engine_step_seconds_sum{kind=mixed}"]
    assert diff["sparda_prefill_seconds_total"] > 0 and diff["sparda_decode_seconds_total"] > 0, diff
    assert busy <= steps <= wall, (busy, steps, wall)
    assert after["sparda_engine_step_seconds_bucket{kind=mixed,le=20.0}"] == after[
        "sparda_engine_step_seconds_count{kind=mixed}"]
