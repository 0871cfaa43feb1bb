"""The CLI: output format, JSON, and one-line errors with exit code 2."""

import json
import re
import subprocess
import sys

import pytest


def run(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "sparda.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=600)


def test_version_and_help():
    assert run("--version").stdout.startswith("sparda, version")
    out = run("generate", "--help").stdout
    for flag in ("--prompt-file", "--topk-blocks", "--local-blocks", "--init-blocks", "--block-size",
                 "--dense-len", "--ignore-eos", "--json", "--chat / --no-chat", "--top-p"):
        assert flag in out


def test_generate_json_on_tiny_model(make_tiny):
    res = run("generate", "--model", str(make_tiny("llama")), "-p", "hello there", "-p", "a longer second prompt",
              "--max-new-tokens", "5", "--ignore-eos", "--json", "--device", "cpu")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert len(lines) == 2
    for obj in lines:
        assert set(obj) == {"text", "token_ids", "finish_reason", "stats"} and len(obj["token_ids"]) == 5
        assert obj["stats"]["new_tokens"] == 5 and obj["stats"]["kv_read_fraction"] == 1.0


def test_generate_text_output_and_stdin(make_tiny):
    res = run("generate", "--model", str(make_tiny("llama")), "--no-chat", "--max-new-tokens", "3",
              "--ignore-eos", "--method", "sparse", stdin="piped prompt text")
    assert res.returncode == 0, res.stderr
    assert "prompt " in res.stdout and "decode" in res.stdout and "KV blocks read/step" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "-f", "/no/such/file"], "cannot read --prompt-file /no/such/file: no such file or directory"),
    (["generate", "-p", "x", "--model", "/no/such/dir"], "model path not found"),
    (["generate", "-p", "x", "--topk-blocks", "-3"], "--topk-blocks must be >= 0"),
    (["generate", "-p", "x", "--local-blocks", "0"], "--local-blocks must be >= 1"),
    (["generate", "-p", "x", "--block-size", "40"], "must divide --block-size"),
    (["generate", "-p", "x", "--method", "nope"], "nope"),
    (["generate", "-p", "x", "--preset", "nope"], "nope"),
    (["generate", "-p", "  "], "empty prompt"),
    (["generate", "-p", "x", "--method", "dense", "--offload"], "--offload is not supported for method 'dense'"),
    (["generate", "-p", "x", "--method", "sparse", "--forecast", "f.safetensors"],
     "--forecast applies to the sparda methods only"),
    (["selection-report", "--lengths", "abc"], "expected comma-separated int values"),
    (["selection-report", "--lengths", "4096", "--queries", "0"], "--queries must be >= 1"),
    (["selection-report", "--lengths", "100"], "length 100 is outside [2048, 8192]"),
    (["generate", "-p", "x", "--method", "sparse-offload", "--no-offload"], "sparse-offload always offloads"),
    (["generate", "-p", "x", "--model", ""], "empty --model"),
    (["train-forecast", "--lr", "-1", "--out", "/tmp/sparda-test-never.safetensors"], "--lr must be > 0"),
    (["eval", "--tasks", "passkey", "--lengths", "99999", "--out", "/tmp/sparda-test-eval-never-created"],
     "leaves no room for an answer in the model's context of 8192 tokens"),
    (["eval", "--samples", "0", "--out", "/tmp/sparda-test-eval-never-created"], "--samples >= 1"),
    (["generate", "--method", "sparse", "--topp-mass", "1.5", "-p", "x"], "--topp-mass must be a number in (0, 1]"),
    (["eval", "--tasks", "ppl-decode", "--lengths", "512", "--decode-tokens", "512", "--out",
      "/tmp/sparda-test-eval-never-created"], "--decode-tokens must be at least 1 and below the shortest --lengths"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    res = run(*args)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr


def test_too_long_prompt_names_both_lengths(make_tiny):
    res = run("generate", "--model", str(make_tiny("llama")), "--no-chat", "-p", "word " * 5000, "--device", "cpu")
    assert res.returncode == 2 and "exceeds the model's context of 4096 tokens" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (["generate", "--bogus"], "No such option '--bogus'"),
    (["gen"], "No such command 'gen'"),
    (["generate", "--max-new-tokens", "many"], "'many' is not a valid integer"),
    (["eval"], "Missing option '--out'"),
])
def test_usage_errors_are_one_line(args, message):
    res = run(*args)
    assert res.returncode == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_generate_streams_text_in_prompt_order_equal_to_json(make_tiny):
    base = ("generate", "--model", str(make_tiny("llama")), "-p", "first prompt", "-p", "a second, longer prompt",
            "--max-new-tokens", "6", "--ignore-eos", "--method", "dense", "--device", "cpu")
    streamed, as_json = run(*base), run(*base, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0, streamed.stderr + as_json.stderr
    # text-mode pipes read "\r" and "\r\n" as "\n" (a random model emits carriage returns); JSON keeps them
    texts = [json.loads(line)["text"].replace("\r\n", "\n").replace("\r", "\n") for line in as_json.stdout.splitlines()]
    parts = re.split(r"\n\[prompt [^\n]*\]\n", streamed.stdout)  # text, stats line, text, stats line
    assert parts == [*texts, ""]


def test_stats_line_says_when_an_offloaded_run_fetched_nothing():
    from sparda.cli import stats_line

    base = {"prompt_tokens": 31, "new_tokens": 2, "prefill_ms": 3.0, "decode_tok_s": 4.9, "kv_cache_bytes": 2**20,
            "kv_read_fraction": 1.0}
    none = stats_line({**base, "offload": {"hits": 0, "misses": 0, "hit_rate": 0.0, "bytes_per_token": 0.0}})
    assert "no block fetched" in none and "hit rate" not in none
    some = stats_line({**base, "offload": {"hits": 3, "misses": 1, "hit_rate": 0.75, "bytes_per_token": 2**20}})
    assert "offload hit rate 75.0%, 1.00 MiB copied/token" in some
    assert "offload" not in stats_line(base)


@pytest.mark.parametrize("model, message", [("/no/such/dir", "model path not found: /no/such/dir"),
                                            ("nosuch/model", "is not in the local Hugging Face cache"),
                                            ("EMPTY", "has no config.json")])
def test_a_bad_model_is_one_line_before_loading(tmp_path, model, message):
    model = str(tmp_path) if model == "EMPTY" else model
    res = run("generate", "-p", "x", "--model", model, "--device", "cpu")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr


def test_a_positional_prompt_is_the_prompt(make_tiny):
    """``generate WORDS...``: the words joined by spaces are one prompt, as ``-p``; ``--json``
    carries the finish reason."""
    base = ("generate", "--model", str(make_tiny("llama")), "--max-new-tokens", "4", "--ignore-eos", "--json",
            "--method", "dense", "--device", "cpu")
    positional, flag = run(*base, "hello", "there"), run(*base, "-p", "hello there")
    assert positional.returncode == 0 and flag.returncode == 0, positional.stderr + flag.stderr
    got, want = json.loads(positional.stdout), json.loads(flag.stdout)
    assert got["token_ids"] == want["token_ids"] and got["stats"]["prompt_tokens"] == want["stats"]["prompt_tokens"]
    assert got["finish_reason"] == "length"


def test_serve_max_model_len_past_the_context_is_refused_before_loading(make_tiny):
    """``serve --max-model-len`` above the config's ``max_position_embeddings``: one line naming
    both, exit 2, before the model loads (no "loading" line) and before a port is bound."""
    model = make_tiny("llama")
    limit = json.loads((model / "config.json").read_text())["max_position_embeddings"]
    res = run("serve", "--model", str(model), "--device", "cpu", "--port", "0", "--max-model-len", str(limit + 1))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert lines[0] == (f"error: --max-model-len {limit + 1} exceeds the model's context of {limit} tokens; "
                        f"use at most {limit}"), res.stderr


@pytest.mark.parametrize("args, message", [
    (["serve", "--max-model-len", "0"], "--max-model-len must be an integer >= 2, got 0"),
    (["serve", "--port", "70000"], "--port must be an integer in [0, 65535], got 70000"),
    (["serve", "--max-batch", "two"], "--max-batch must be an integer >= 1, got two"),
    (["serve", "--drain-timeout", "nan"], "--drain-timeout must be a number >= 0, got nan"),
])
def test_out_of_range_options_name_the_range(args, message):
    res = run(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and message in lines[0] and "Traceback" not in res.stderr, res.stderr
