"""`sparda serve` as a process: loopback by default, SIGTERM drains and exits 0, one-line errors."""

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest

ENV = dict(os.environ, OMP_NUM_THREADS="1")


def start_serve(*args, env=None):
    """``sparda serve ARGS --port 0``: ``(process, "http://host:port", stderr lines so far)``
    once the banner is printed; later stderr lines keep arriving in that list."""
    proc = subprocess.Popen([sys.executable, "-m", "sparda.cli", "serve", "--port", "0", *args],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env or ENV)
    lines: queue.Queue = queue.Queue()
    seen: list[str] = []

    def read():
        for line in proc.stderr:
            seen.append(line)
            lines.put(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            assert proc.poll() is None, "".join(seen)
            continue
        found = re.search(r"on (http://[\d.]+:\d+)/v1", line)
        if found:
            return proc, found.group(1), seen
    proc.kill()
    pytest.fail("sparda serve did not start: " + "".join(seen))


def test_serve_binds_loopback_and_sigterm_drains_then_exits_0(make_tiny):
    proc, url, log = start_serve("--model", str(make_tiny("llama")), "--method", "dense", "--device", "cpu",
                               "--max-batch", "2", "--max-model-len", "128", "--served-model-name", "tiny")
    try:
        assert url.startswith("http://127.0.0.1:")
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=100, temperature=0,
                                           extra_body={"ignore_eos": True}, stream=True)
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)  # mid-stream: the running request is let finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        whole = client.completions.create  # new requests are refused: the socket is closed, or (a race
        # with uvicorn closing it) still open and answering 503 "shutting down"
        with pytest.raises((openai.APIConnectionError, openai.InternalServerError)) as refused:
            whole(model="tiny", prompt="hi", max_tokens=2)
        if isinstance(refused.value, openai.InternalServerError):
            assert refused.value.status_code == 503 and "shutting down" in str(refused.value)
        assert proc.wait(timeout=60) == 0
        assert any("draining 1 running and 0 waiting requests" in line for line in log), "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_refuses_a_busy_port_before_loading_the_model(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = subprocess.run([sys.executable, "-m", "sparda.cli", "serve", "--port", str(port)],
                             capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 2 and "loading" not in res.stderr
    assert res.stderr.strip() == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                                  "pick another --port")


def test_serve_sizes_the_kv_pool_by_the_memory_budget(make_tiny):
    """A budget that holds no row of --max-model-len tokens: one line with the row's bytes and
    the budget, exit 2 (design §3.11); one that holds a few rows: the pool takes them, and the
    banner says so."""
    tiny = str(make_tiny("llama"))
    base = [sys.executable, "-m", "sparda.cli", "serve", "--port", "0", "--model", tiny, "--method", "dense",
            "--device", "cpu", "--max-model-len", "4096"]
    res = subprocess.run([*base, "--host-memory-gib", "0.0001"], capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert re.fullmatch(r"error: one KV row of 4096 tokens does not fit: it needs host \d+\.\d\d MiB of a 0\.10 MiB "
                        r"budget \(--host-memory-gib\); lower --max-model-len, raise the budget, or use a smaller "
                        r"--kv-dtype", res.stderr.strip().splitlines()[-1]), res.stderr
    for bad in (["--host-memory-gib", "nan"], ["--host-memory-gib", "inf"], ["--gpu-memory-utilization", "nan"],
                ["--gpu-memory-utilization", "1.5"]):  # refused before the model loads
        res = subprocess.run([*base, *bad], capture_output=True, text=True, timeout=120, env=ENV)
        assert res.returncode == 2 and "loading" not in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert res.stderr.strip().splitlines() == [f"error: {bad[0]} must be " + (
            "a finite number of GiB > 0" if "host" in bad[0] else "in (0, 1]") + f", got {float(bad[1])!r}"]
    from sparda.engine.llm import LLM

    row = sum(LLM(tiny, method="dense", device="cpu").model_runner.kv_bytes(1, 4096))
    proc, _, log = start_serve("--model", tiny, "--method", "dense", "--device", "cpu", "--max-batch", "8",
                               "--max-model-len", "4096", "--host-memory-gib", str(3.5 * row / 2**30))
    proc.kill()
    proc.wait(timeout=60)
    assert any("KV pool 3 rows x 4096 tokens: host" in line and "room for 3 rows" in line for line in log), log


def test_serve_usage_error_is_one_line_exit_2():
    for args, flag in ((["--max-batch", "0"], "--max-batch"), (["--kv-admission", "lazy"], "--kv-admission")):
        res = subprocess.run([sys.executable, "-m", "sparda.cli", "serve", *args], capture_output=True,
                             text=True, timeout=120, env=ENV)
        assert res.returncode == 2 and (res.stderr.startswith(f"error: {flag}") or f"for '{flag}'" in res.stderr), res.stderr
        assert len(res.stderr.strip().splitlines()) == 1


def test_serve_says_how_a_paged_pool_takes_blocks(make_tiny):
    """An offloaded cache whose host budget holds 10 blocks for 2 rows of 256 tokens (32 whole):
    the banner names the blocks and the admission (design §3.11), ``grow`` by default."""
    from sparda.engine.llm import LLM

    tiny = str(make_tiny("llama"))
    runner = LLM(tiny, method="sparse-offload", device="cpu", block_size=16).model_runner
    budget = sum(runner.kv_bytes(2, 256, host_blocks=10)) + runner.host_block_bytes() // 2
    for args, says in (([], "blocks grow on demand, preempted by recompute"),
                       (["--kv-admission", "reserve"], "blocks reserved for prompt + max_tokens")):
        proc, _, log = start_serve("--model", tiny, "--method", "sparse-offload", "--device", "cpu", "--block-size",
                                   "16", "--max-batch", "2", "--max-model-len", "256", "--host-memory-gib",
                                   str(budget / 2**30), *args)
        proc.kill()
        proc.wait(timeout=60)
        assert any("10 host blocks of 16 tokens" in line and says in line for line in log), log


def test_serve_publishes_org_name_and_warns_off_loopback_without_a_key(tmp_path, make_tiny):
    """A model given as ORG/NAME is served under that name (not its snapshot's commit hash)."""
    import httpx

    from test_loader import _hub_cache

    _hub_cache(tmp_path / "hf" / "hub", "tiny-org/tiny-llama", make_tiny("llama"))
    env = dict(ENV, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    env.pop("SPARDA_API_KEY", None)
    proc, url, log = start_serve("--model", "tiny-org/tiny-llama", "--method", "dense", "--device", "cpu",
                                 "--max-batch", "1", "--max-model-len", "64", "--host", "0.0.0.0", env=env)
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        assert any("warning: serving on 0.0.0.0 without --api-key" in line for line in log), "".join(log)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["tiny-org/tiny-llama"]
        assert client.models.retrieve("tiny-org/tiny-llama").max_model_len == 64
        with pytest.raises(openai.NotFoundError, match="model 'tiny-org/other' does not exist"):
            client.models.retrieve("tiny-org/other")
        assert client.completions.create(model="tiny-org/tiny-llama", prompt="hi", max_tokens=2).choices
        assert httpx.get(url + "/v1/models/tiny-org/tiny-llama").json()["id"] == "tiny-org/tiny-llama"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_served_name_rule(tmp_path):
    from sparda.cli import served_name

    snapshot = tmp_path / "models--org--name" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert served_name("org/name", snapshot) == "org/name"
    assert served_name(str(snapshot), snapshot) == "0123abcd"  # a directory: its name
    assert served_name(None, None) == "sparda"


@pytest.mark.parametrize("signals", [["SIGTERM"], ["SIGINT", "SIGINT", "SIGINT", "SIGTERM", "SIGINT"]])
def test_shutdown_ends_every_stream_with_a_final_chunk_and_done_and_exits_0(make_tiny, signals):
    """Cut at the drain timeout (one signal) or at once (repeated signals): every stream and
    every waiting client still gets its last chunk / answer, and the exit status is 0."""
    import concurrent.futures
    import json

    import httpx

    env = dict(ENV, SPARDA_API_KEY="k-123")
    proc, url, log = start_serve("--model", str(make_tiny("llama")), "--method", "dense", "--device", "cpu",
                                 "--max-batch", "2", "--max-model-len", "2048", "--drain-timeout", "1",
                                 "--served-model-name", "tiny", env=env)
    auth = {"Authorization": "Bearer k-123"}

    def stream(prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, headers=auth, timeout=120) as response:
            assert response.status_code == 200
            return [line for line in response.iter_lines() if line]

    def plain():
        body = {"model": "tiny", "prompt": [9, 9], "max_tokens": 2000, "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=120)

    try:
        assert httpx.get(url + "/v1/models").status_code == 401  # SPARDA_API_KEY is read
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            streams = [pool.submit(stream, [1, 2, 3]), pool.submit(stream, [4, 5])]
            waiting = pool.submit(plain)  # queued: both rows are taken
            time.sleep(2.0)
            for name in signals:
                proc.send_signal(getattr(signal, name))
                time.sleep(0.05)
            for future in streams:
                lines = future.result(timeout=120)
                assert lines[-1] == "data: [DONE]", lines[-3:]
                last = json.loads(lines[-2][6:])
                assert last["choices"][0]["finish_reason"] == "abort", last
            answer = waiting.result(timeout=120)
            assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == 0, "".join(log)
        assert any("ending 3 requests in flight" in line for line in log), "".join(log)
        assert not any("Traceback" in line for line in log), "".join(log)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_prompt_of_megabytes_is_refused_at_once_and_health_stays_under_100_ms(make_tiny):
    """A ~9 MB prompt that cannot fit --max-model-len is a 400 from its byte length alone
    (at least ceil(bytes / longest token) tokens), not after ~10 s of tokenising 1.8M
    tokens; /health, polled while the request is in flight, answers within 100 ms."""
    import concurrent.futures
    import json
    import math
    import random

    import httpx
    from transformers import AutoTokenizer

    model = make_tiny("llama")
    longest = max(map(len, AutoTokenizer.from_pretrained(model).get_vocab()))  # byte-level: a character is a byte
    words = ["the", "model", "reads", "a", "very", "long", "prompt", "and", "refuses", "it", "quickly", "\n"]
    prompt = " ".join(random.choices(words, k=1_800_000))
    assert 8e6 < len(prompt.encode()) < 12e6
    tokens = math.ceil(len(prompt.encode()) / longest)
    # serialised here, not on the posting thread while /health is timed
    bodies = {"/v1/completions": json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2}).encode(),
              "/v1/chat/completions": json.dumps({"messages": [{"role": "user", "content": prompt}]}).encode()}
    proc, url, log = start_serve("--model", str(model), "--method", "dense", "--device", "cpu", "--max-batch", "1",
                                 "--max-model-len", "192", "--served-model-name", "tiny")
    try:
        passed = set()
        with httpx.Client() as health, concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert health.get(url + "/health").status_code == 200  # the connection, outside the timing
            for path, body in [*bodies.items(), *bodies.items()]:  # each twice: the second only if the first
                if path in passed:                                  # met a scheduling hiccup of a busy CI box
                    continue
                waits = []
                begun = time.perf_counter()
                pending = pool.submit(httpx.post, url + path, content=body, timeout=120,
                                      headers={"content-type": "application/json"})
                while not pending.done():
                    start = time.perf_counter()
                    assert health.get(url + "/health").status_code == 200
                    waits.append(time.perf_counter() - start)
                took = time.perf_counter() - begun
                response = pending.result()
                error = response.json()["error"]
                assert response.status_code == 400 and error["param"] == "prompt", error
                assert error["message"] == (f"prompt of at least {tokens} tokens does not fit --max-model-len 192 "
                                            "(it needs room for at least one new token); shorten the prompt")
                assert took < 5, f"{path}: the refusal took {took:.1f} s"
                assert waits, path
                if max(waits) < 0.1:
                    passed.add(path)
            assert passed == set(bodies), f"/health waited {sorted(waits)[-5:]} s beside {set(bodies) - passed}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices  # short prompts still run
    finally:
        proc.kill()
        proc.wait(timeout=60)
