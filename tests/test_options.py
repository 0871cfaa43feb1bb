"""Every option is checked in one place (sparda.config.build_config): a bad value gets the same
one-line message from ``LLM(...)``, ``sparda generate`` and ``sparda serve``, with the option
named as each caller spells it (keyword in the API, flag on the command line)."""

from __future__ import annotations

import re

import pytest
import torch
from click.testing import CliRunner

from sparda import LLM, SpardaError
from sparda.cli import main
from sparda.config import spell

#: (keywords of LLM(...), the same on the command line, a fragment every message holds)
BAD = [
    (dict(kv_dtype="fp8"), ["--kv-dtype", "fp8"], "unknown kv_dtype 'fp8'"),
    (dict(kv_dtype=""), ["--kv-dtype", ""], "unknown kv_dtype ''"),
    (dict(transfer=""), ["--transfer", ""], "unknown transfer ''"),
    (dict(method="dense", transfer="bogus"), ["--method", "dense", "--transfer", "bogus"], "unknown transfer 'bogus'"),
    (dict(method="dense", transfer="sync"), ["--method", "dense", "--transfer", "sync"], "applies to an offloaded"),
    (dict(method="sparse-offload", transfer="uva", device="cpu"),
     ["--method", "sparse-offload", "--transfer", "uva", "--device", "cpu"], "needs a CUDA device"),
    (dict(slot_factor=0.5), ["--slot-factor", "0.5"], "must be a number >= 1"),
    (dict(prefill_chunk_tokens=-1), ["--prefill-chunk", "-1"], "must be an integer >= 0"),
    (dict(local_blocks=0), ["--local-blocks", "0"], "must be >= 1"),
    (dict(block_size=40), ["--block-size", "40"], "must divide"),
    (dict(method="dense", offload=True), ["--method", "dense", "--offload"], "not supported for method 'dense'"),
    (dict(method="sparse-offload", offload=False), ["--method", "sparse-offload", "--no-offload"], "always offloads"),
    (dict(kv_hot_blocks=8), ["--kv-hot-blocks", "8"], "mixed only"),
    (dict(method="sparse", kv_dtype="mixed"), ["--method", "sparse", "--kv-dtype", "mixed"], "on the device"),
    (dict(method="sparse-offload", kv_dtype="mixed", kv_hot_steps=0),
     ["--method", "sparse-offload", "--kv-dtype", "mixed", "--kv-hot-steps", "0"], "must be an integer >= 1"),
    (dict(dense_heads="x"), ["--dense-heads", "x"], "is not LAYER:KV_HEAD"),
    (dict(dense_heads="1:\u00b2"), ["--dense-heads", "1:\u00b2"], "is not LAYER:KV_HEAD"),
    (dict(device="tpu"), ["--device", "tpu"], "invalid device 'tpu'"),
    (dict(dtype="int3"), ["--dtype", "int3"], "unknown dtype 'int3'"),
    (dict(method="magic"), ["--method", "magic"], "unknown method 'magic'"),
    (dict(preset="huge"), ["--preset", "huge"], "unknown preset 'huge'"),
    (dict(method="dense", forecast="f.safetensors"), ["--method", "dense", "--forecast", "f.safetensors"],
     "sparda methods only"),
    (dict(method="shallow", offload=True, shallow_select_once=True),
     ["--method", "shallow", "--offload", "--shallow-select-once"], "does not run offloaded"),
    (dict(cuda_graph_sizes="1,x"), ["--cuda-graph-sizes", "1,x"], "must be auto or a comma list of integers >= 1"),
    (dict(cuda_graph_sizes="0,4"), ["--cuda-graph-sizes", "0,4"],
     "got '0,4'; e.g. cuda_graph_sizes=auto or cuda_graph_sizes=1,2,4,8,16"),
    (dict(cuda_graph_sizes=""), ["--cuda-graph-sizes", ""], "must be auto or a comma list of integers >= 1"),
    (dict(cuda_graph_sizes="autos"), ["--cuda-graph-sizes", "autos"], "got 'autos'"),
    # str.isdigit() holds for superscripts that int() refuses: still one line, not a ValueError
    (dict(cuda_graph_sizes="2,\u00b2"), ["--cuda-graph-sizes", "2,\u00b2"], "got '2,\u00b2'"),
]

_FLAG = re.compile(r"(?<![\w-])--[a-z]")


def _cli(command: str, args: list[str]) -> tuple[int, str]:
    extra = ["-p", "x"] if command == "generate" else ["--port", "0"]
    res = CliRunner().invoke(main, [command, *extra, *args])
    return res.exit_code, res.stderr if hasattr(res, "stderr") else res.output


@pytest.mark.parametrize("api,cli,fragment", BAD, ids=[f"{i}-{'-'.join(c[-2:])}" for i, (_, c, _) in enumerate(BAD)])
def test_a_bad_option_gets_one_message_from_the_api_the_cli_and_the_server(api, cli, fragment):
    with pytest.raises(SpardaError) as caught:
        LLM(**api)  # checked before the model loads: no model needed
    api_message = str(caught.value)
    assert "\n" not in api_message and fragment in api_message
    assert not _FLAG.search(api_message), api_message  # keywords, not flags, in the API
    for command in ("generate", "serve"):
        code, err = _cli(command, cli)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, (command, err)
        cli_message = lines[0][len("error: "):]
        assert cli_message == spell(api_message, "cli"), (command, cli_message, api_message)


def test_spelling_round_trips():
    raw = ("kv_hot_blocks must be at least local_blocks (4); use --kv-dtype mixed, drop --no-offload, "
           "lower --max-new-tokens or set --topk-blocks 8")
    api, cli = spell(raw, "api"), spell(raw, "cli")
    assert api == ("kv_hot_blocks must be at least local_blocks (4); use kv_dtype=mixed, drop offload=False, "
                   "lower max_new_tokens or set topk_blocks=8")
    assert cli == ("--kv-hot-blocks must be at least --local-blocks (4); use --kv-dtype mixed, drop --no-offload, "
                   "lower --max-new-tokens or set --topk-blocks 8")
    assert spell(api, "cli") == cli and spell(cli, "api") == api


def test_a_budget_that_covers_the_whole_context_is_refused(make_tiny, fresh_seed):
    """The tiny model's context is 4096 tokens = 64 blocks of 64: a budget of 64 blocks or more
    can never select (every request dense), one block fewer can."""
    path = make_tiny("llama")
    topk = int(torch.randint(59, 10**9, ()))
    with pytest.raises(SpardaError, match=rf"top-k {topk}\) covers the model's whole context of 4096 tokens \(64 "
                                          r"blocks of 64\), so every request would attend densely; use topk_blocks=58"):
        LLM(path, method="sparse", device="cpu", topk_blocks=topk)
    assert LLM(path, method="sparse", device="cpu", topk_blocks=58).config.selection.budget_blocks == 63


@pytest.mark.parametrize("content,fragment", [
    (b"\xff" * 64, "not a readable safetensors file"),
    (None, "not sparda Forecast weights (no sparda format tag"),
])
def test_a_bad_forecast_file_names_the_fix(tmp_path, content, fragment):
    from safetensors.torch import save_file

    path = tmp_path / "f.safetensors"
    if content is None:
        save_file({"w": torch.zeros(2)}, str(path), metadata={"foo": "bar"})  # a foreign safetensors file
    else:
        path.write_bytes(content)
    with pytest.raises(SpardaError) as caught:
        LLM(method="sparda", device="cpu", forecast=str(path))
    message = str(caught.value)
    assert fragment in message and "sparda train-forecast" in message and "\n" not in message


def test_cpu_threads_leave_busy_cores_alone(monkeypatch):
    import os

    from sparda.config import build_config, cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for load, want in ((0.2, 4), (1.4, 3), (2.6, 1), (9.0, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert cpu_threads() == want
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads() == 3
    assert build_config(method="dense", device="cpu", cpu_threads=2).runtime.cpu_threads == 2
    assert build_config(method="dense", device="cpu").runtime.cpu_threads == 3


def test_a_budget_without_scored_blocks_is_said(caplog):
    from sparda.config import _note, build_config

    _note.cache_clear()
    with caplog.at_level("WARNING", logger="sparda"):
        build_config(method="sparse", device="cpu", topk_blocks=0)
        build_config(method="sparse", device="cpu", topk_blocks=0)
        build_config(method="streaming", device="cpu", topk_blocks=0)
    notes = [r.getMessage() for r in caplog.records if "no scored block" in r.getMessage()]
    assert notes == ["note: topk_blocks 0 leaves method sparse no scored block: it reads the sinks and the local "
                     "window only (--method streaming does the same without scoring)"]
