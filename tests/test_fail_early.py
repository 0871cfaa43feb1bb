"""Fail before work, never half-write, one clear line (REVIEW §1: U3, U4, U7, U8, U9, U11).

Each command must refuse bad arguments and output paths before it loads a model or
trains; the Python API raises one SpardaError naming the argument; files appear whole
or not at all.
"""

from __future__ import annotations

import errno
import math

import pytest
import torch
from click.testing import CliRunner

from sparda import io as sio
from sparda.cli import main
from sparda.config import SelectionConfig
from sparda.errors import SpardaError

CFG = SelectionConfig(block_size=32, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=2,
                      topk_blocks=3, dense_len=64)


def cli(*args):
    result = CliRunner().invoke(main, list(args))
    assert "Traceback" not in result.output and "[Errno" not in result.output, result.output
    return result


def _read_only(monkeypatch):
    """Make every write probe fail as on a read-only mount (no such mount on a CI box)."""
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")
    monkeypatch.setattr(sio.tempfile, "mkstemp", refuse)


def _no_model_load(monkeypatch):
    from sparda.model import loader

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking"))


# ---------------------------------------------------------------------------------- U3


@pytest.mark.parametrize("kind", ["directory", "read-only"])
def test_train_forecast_checks_out_before_loading(tmp_path, monkeypatch, kind):
    """U3: --out a directory or on a read-only file system failed only after training."""
    from sparda.training.trainer import train_forecast

    _no_model_load(monkeypatch)
    out = tmp_path / "f.safetensors"
    if kind == "directory":
        out.mkdir()
        message = "is a directory; pass a file path such as"
    else:
        _read_only(monkeypatch)
        message = "cannot write --out .*no file can be created in .*(the file system is read-only)"
    with pytest.raises(SpardaError, match=message):
        train_forecast(None, None, seq_len=2560, steps=1, out=out, device="cpu", progress=False)


def test_failed_weight_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """U3: a 6.6 MB *.tmp stayed behind when the final rename failed."""
    import safetensors.torch

    from sparda.attention.forecast import Forecast, save_forecast

    def half_write(tensors, filename, metadata=None):
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", half_write)
    forecast = Forecast(2, 32, 2, 16)
    with pytest.raises(SpardaError, match="cannot write .*f.safetensors: no space left on the device"):
        save_forecast(forecast, tmp_path / "f.safetensors", {})
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "r.json"
    sio.atomic_write(path, "old")
    with pytest.raises(RuntimeError):
        with sio.atomic_output(path) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]


def _train(make_tiny, tmp_path, steps, **extra):
    from sparda.data import bundled_text
    from sparda.training.trainer import train_forecast

    tmp_path.mkdir(exist_ok=True)
    text = tmp_path / "train.txt"
    text.write_text(bundled_text("persuasion")[:6000])
    return train_forecast(str(make_tiny("llama")), [str(text)], seq_len=256, steps=steps, out=tmp_path / "f.st",
                          device="cpu", queries=32, init="random", seed=7, selection=CFG, **extra)


def test_train_forecast_first_loss_is_the_first_steps_loss(make_tiny, tmp_path):
    """U11: the summary's first_loss was the mean of the first 5 steps (== loss for short runs)."""
    one = _train(make_tiny, tmp_path / "a", 1, progress=False)
    three = _train(make_tiny, tmp_path / "b", 3, lr=5e-2, progress=False)
    assert three["first_loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert three["first_loss"] != pytest.approx(three["loss"], rel=1e-3)


def test_train_forecast_error_starts_on_its_own_line(make_tiny, tmp_path, monkeypatch, capsys):
    """U3: the `error:` text was glued to the progress bar, which was never closed."""
    from sparda.training import trainer

    def full_disk(*args, **kwargs):
        raise SpardaError("cannot write f.st: no space left on the device")

    monkeypatch.setattr(trainer, "save_forecast", full_disk)
    try:
        _train(make_tiny, tmp_path, 1, progress=True)
    except SpardaError:  # read while the error is alive, as the CLI prints it
        err = capsys.readouterr().err
    else:
        pytest.fail("no error")
    assert "train-forecast" in err and err.endswith("\n")


# ---------------------------------------------------------------------------------- U4


def test_failed_eval_writes_nothing_and_the_corrected_rerun_runs(make_tiny, tmp_path):
    """U4: a failed start left plan.json, and the corrected rerun was refused as another plan."""
    from sparda.eval.runner import EvalPlan, run_eval

    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("Too short a haystack.")
    out = tmp_path / "run"
    plan = EvalPlan(tasks=("passkey",), methods=("dense",), lengths=(400,), samples=1, ppl_windows=1,
                    out=str(out), model=str(make_tiny("llama")), device="cpu", text=str(tiny_text))
    with pytest.raises(SpardaError, match="haystack has"):
        run_eval(plan, progress=False)
    assert not out.exists()
    good = tmp_path / "good.txt"
    good.write_text("Emma walked to Highbury and met Harriet by the church.\n" * 80)
    plan.text = str(good)
    run_eval(plan, max_new_items=1, progress=False)
    assert (out / "plan.json").is_file() and (out / "results.jsonl").is_file()


@pytest.mark.parametrize("args, message", [
    (["--dtype", "int4"], "unknown dtype 'int4'"),
    (["--text", "BAD"], "--text BAD is not UTF-8 text"),
])
def test_eval_bad_option_leaves_no_plan(tmp_path, monkeypatch, args, message):
    (tmp_path / "BAD").write_bytes(b"caf\xe9 au lait\n" * 50)
    monkeypatch.chdir(tmp_path)
    result = cli("eval", "--quick", "--tasks", "passkey", "--out", "D", *args)
    assert result.exit_code == 2 and message in result.output
    assert not (tmp_path / "D").exists()


def test_eval_read_only_out_is_one_line(tmp_path, monkeypatch):
    _read_only(monkeypatch)
    result = cli("eval", "--quick", "--out", str(tmp_path / "D"))
    assert result.exit_code == 2 and "the file system is read-only" in result.output


# --------------------------------------------------------------------------- U7, U8


@pytest.fixture(scope="module")
def tiny_llm(make_tiny):
    from sparda import LLM

    return LLM(str(make_tiny("llama")), method="sparse", device="cpu")


@pytest.mark.parametrize("prompts, kwargs, names", [
    ([], {}, "prompts is empty"),
    ([[{"role": "user", "content": "hi"}]], {}, "prompts[0] is a chat message list"),
    ([{"role": "user", "content": "hi"}], {}, "prompts[0] is a chat message list"),
    (["hi", 3], {}, "prompts[1] must be a string"),
    (None, {"prompt_token_ids": [[5, 49152]]}, "prompt_token_ids[0][1] = 49152"),
    (None, {"prompt_token_ids": [[-1]]}, "prompt_token_ids[0][0] = -1"),
    (None, {"prompt_token_ids": [[]]}, "prompt_token_ids[0] is empty"),
    (["hi"], {"max_new_tokens": 2.5}, "max_new_tokens"),
    (["hi"], {"max_new_tokens": 0}, "max_new_tokens"),
    (["hi"], {"temperature": math.nan}, "temperature"),
    (["hi"], {"temperature": -0.5}, "temperature"),
    (["hi"], {"top_p": 0.0}, "top_p"),
    (["hi"], {"top_p": 1.5}, "top_p"),
    (["hi"], {"top_p": math.nan}, "top_p"),
    (["hi"], {"seed": 1.5}, "seed"),
])
def test_generate_bad_request_is_one_sparda_error(tiny_llm, prompts, kwargs, names):
    """U8: these raised ValueError, IndexError, AttributeError, TypeError or RuntimeError."""
    with pytest.raises(SpardaError) as info:
        tiny_llm.generate(prompts, **kwargs)
    assert names in str(info.value) and "\n" not in str(info.value)


def test_cli_seed_reaches_sampling(tiny_llm, make_tiny):
    """U7: the CLI always sampled with seed 0."""
    import json

    def run(seed):
        result = cli("generate", "--model", str(make_tiny("llama")), "--method", "sparse", "--device", "cpu",
                     "-p", "Tell me a joke.", "--temperature", "1.0", "--max-new-tokens", "8", "--ignore-eos",
                     "--json", "--seed", str(seed))
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout.splitlines()[-1])["token_ids"]

    seed = int(torch.randint(0, 2**31, ()))
    want = tiny_llm.generate(["Tell me a joke."], temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=seed)
    assert run(seed) == want[0].token_ids
    assert run(seed + 1) != want[0].token_ids


# ---------------------------------------------------------------------------------- U9


@pytest.mark.parametrize("args, message", [
    (["generate", "-p", "hi", "--temperature", "nan"], "--temperature must be a finite number"),
    (["generate", "-p", "hi", "--max-new-tokens", "0"], "error: --max-new-tokens must be a whole number >= 1, got 0"),
    (["generate", "-p", "   "], "empty prompt"),
    (["generate", "-p", "hi", "--method", "infinigen", "--offload"], "--offload is not supported for method "
                                                                      "'infinigen'"),
    (["generate", "-p", "hi", "--method", "shallow", "--offload", "--shallow-select-once"],
     "--shallow-select-once does not run offloaded"),
    (["demo", "--context-tokens", "100000"], "--context-tokens 100000 does not fit the model's context of 4096"),
    (["demo", "--depth", "1.5"], "--depth must lie in [0, 1]"),
])
def test_model_free_checks_come_before_the_model_load(make_tiny, monkeypatch, args, message):
    """U8/U9: these were checked only after the model load (a traceback for nan); the demo's
    context error suggested --max-new-tokens."""
    _no_model_load(monkeypatch)
    result = cli(*args, "--model", str(make_tiny("llama")))
    assert result.exit_code == 2 and message in result.output
    assert "loading" not in result.output and "--max-new-tokens 0" not in result.output.replace(message, "")
    assert "lower --max-new-tokens" not in result.output


def test_non_utf8_prompt_file_is_named(tmp_path):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9\n")
    result = cli("generate", "-f", str(bad))
    assert result.exit_code == 2 and f"--prompt-file {bad} is not UTF-8 text" in result.output


def test_unchecked_os_errors_print_no_errno():
    """The CLI's last-resort handler names the file and the reason, never `[Errno N]`."""
    @main.command("raise-oserror", hidden=True)
    def raise_oserror():
        raise PermissionError(errno.EACCES, "Permission denied", "/root/secret")

    try:
        result = cli("raise-oserror")
    finally:
        main.commands.pop("raise-oserror")
    assert result.exit_code == 2 and result.output == "error: /root/secret: permission denied\n"


# --------------------------------------------------------------------------------- U11


@pytest.mark.parametrize("override, cause", [({"topk_blocks": -(-(300 + 2) // 64), "dense_len": 0}, "covers all"),
                                             ({"topk_blocks": 0}, "fewer than dense_len 2048")])
def test_dense_fallback_is_said_once(make_tiny, caplog, override, cause):
    """U11: a budget of 0 blocks (on a short request) or one covering every block silently ran dense.
    The covering top-k is the blocks of 64 of the longest request (< 300 prompt + 2 new tokens),
    well under the model's 4096-token context, which a budget may not cover (check_budget)."""
    from sparda import LLM

    llm = LLM(str(make_tiny("llama")), method="sparse", device="cpu", **override)
    ids = torch.randint(100, 20000, (int(torch.randint(100, 300, ())),)).tolist()
    with caplog.at_level("WARNING", logger="sparda"):
        for _ in range(2):
            out = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=2, ignore_eos=True)[0]
    notes = [r.getMessage() for r in caplog.records if "falls back to dense" in r.getMessage()]
    assert len(notes) == 1 and cause in notes[0], notes
    assert out.stats["kv_read_fraction"] == 1.0  # it really was dense


def test_selection_is_not_reported_as_dense(make_tiny, caplog):
    from sparda import LLM

    llm = LLM(str(make_tiny("llama")), method="sparse", device="cpu", topk_blocks=1, local_blocks=2,
              block_size=32, kernel_size=32, kernel_stride=16, dense_len=0)
    ids = torch.randint(100, 20000, (int(torch.randint(200, 300, ())),)).tolist()
    with caplog.at_level("WARNING", logger="sparda"):
        out = llm.generate([None], prompt_token_ids=[ids], max_new_tokens=2, ignore_eos=True)[0]
    assert not [r for r in caplog.records if "falls back to dense" in r.getMessage()]
    assert out.stats["kv_read_fraction"] < 1.0


def test_dense_fallback_note_names_the_option_as_the_caller_spells_it(make_tiny, caplog):
    """The note names keywords through the API (topk_blocks) and flags through the CLI (--dense-len)."""
    from click.testing import CliRunner

    from sparda import LLM
    from sparda.cli import main

    model = str(make_tiny("llama"))
    llm = LLM(model, method="sparse", device="cpu", topk_blocks=0)
    with caplog.at_level("WARNING", logger="sparda"):
        llm.generate([None], prompt_token_ids=[[5] * 40], max_new_tokens=2)
    api = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert len(api) == 1 and "lower dense_len" in api[0] and "--" not in api[0], api
    caplog.clear()
    with caplog.at_level("WARNING", logger="sparda"):
        result = CliRunner().invoke(main, ["generate", "--model", model, "--method", "sparse", "--device", "cpu",
                                           "--topk-blocks", "0", "--no-chat", "-p", "hello there", "--max-new-tokens", "2"])
    cli = [r.getMessage() for r in caplog.records if "falls back" in r.getMessage()]
    assert result.exit_code == 0, result.output
    assert len(cli) == 1 and "lower --dense-len" in cli[0], cli


@pytest.mark.parametrize("kwargs, start", [({"max_new_tokens": 0}, "max_new_tokens must be a whole number"),
                                           ({"top_p": 2.0}, "top_p must be a number in (0, 1]")])
def test_api_errors_name_the_keyword_once(make_tiny, kwargs, start):
    from sparda import LLM

    llm = LLM(str(make_tiny("llama")), method="dense", device="cpu")
    with pytest.raises(SpardaError) as info:
        llm.generate(["hi"], **kwargs)
    assert str(info.value).startswith(start) and "--" not in str(info.value), str(info.value)


@pytest.mark.parametrize("flag", ["--forecast", "--forecast2"])
def test_a_missing_forecast_file_is_refused_before_loading(tmp_path, monkeypatch, flag):
    """A --forecast / --forecast2 path that is no file: one error line naming it and the flag,
    exit 2, before the model loads (and the API names the keyword)."""
    _no_model_load(monkeypatch)
    missing = tmp_path / "nope.safetensors"
    extra = ["--offload", "--lookahead", "2"] if flag == "--forecast2" else []
    result = cli("generate", "-p", "x", "--device", "cpu", "--method", "sparda", *extra, flag, str(missing))
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert f"Forecast weights not found: {missing}" in errors[0] and f"drop {flag}" in errors[0], result.output
    assert "loading" not in result.output, result.output
    from sparda.config import build_config

    with pytest.raises(SpardaError, match="Forecast weights not found") as info:
        build_config(method="sparda", device="cpu", offload=True, lookahead=2, **{flag[2:]: str(missing)})
    assert info.value.option == flag[2:]
