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
from sparda.server import bind_socket, create_app

MODEL = "tiny-test"


pytestmark = pytest.mark.usefixtures("one_thread")


class Running:
    """A server in a background thread: ``url``, ``engine``, ``stop()``."""

    def __init__(self, llm, **engine_options):
        self.engine = Engine(llm, **engine_options)
        sock = bind_socket("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(create_app(self.engine, MODEL, drain_timeout_s=5.0), log_level="error",
                                timeout_graceful_shutdown=5)
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
            reason = [p.split("=")[1].strip('"') for p in labels.rstrip("}").split(",") if p.startswith("reason=")]
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
    running = Running(LLM(tiny_dir, method="dense", device="cpu"), max_batch=8, max_model_len=192, max_waiting=64)
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
                 "sparda_generation_tokens_per_second", "sparda_generation_tokens_total"):
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
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens must be an integer >= 1"),
    ("completions", {"prompt": "hi", "max_tokens": -5}, 400, "max_tokens must be an integer >= 1"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "invalid value for 'max_tokens'"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "invalid value for 'temperature'"),
    ("completions", {"prompt": 42}, 400, "invalid value for 'prompt'"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature must be a finite number >= 0"),
    ("completions", {"prompt": "hi", "top_p": 2}, 400, "top_p must be a number in (0, 1]"),
    ("completions", {"prompt": "hi", "frobnicate": 1}, 400, "unrecognized request argument: frobnicate"),
    ("completions", {"prompt": "hi", "n": 2}, 400, "n must be 1"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo is not supported"),
    ("completions", {"prompt": [3] * 200}, 400, "prompt of 200 tokens does not fit --max-model-len 192"),
    ("completions", {"prompt": [3] * 100, "max_tokens": 100}, 400,
     "prompt of 100 tokens plus max_tokens 100 exceeds --max-model-len 192"),
    ("completions", {"prompt": [3, 49152]}, 400, "prompt token ids must be in [0, 49152)"),
    ("completions", {"prompt": "", "max_tokens": 3}, 400, "prompt is empty"),
    ("completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model 'gpt-4' does not exist; this server serves"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "has role 'wizard'"),
    ("chat/completions", {"messages": []}, 400, "messages must be a non-empty list"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "missing required field 'messages.0.content'"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400,
     "max_tokens must be an integer >= 1"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 300}]}, 400,
     "does not fit --max-model-len 192"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400,
     "unrecognized request argument: tools"),
])
def test_bad_requests_get_openai_errors(server, path, body, status, fragment):
    body = dict({"model": MODEL}, **body)
    response = httpx.post(f"{server.url}/v1/{path}", json=body)
    error = response.json()["error"]
    assert response.status_code == status and fragment in error["message"], error
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]


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
    finally:
        running.stop()
