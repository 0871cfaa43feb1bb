"""benchmarks/bench_eval.py ``run`` and ``doc`` on a tiny model on the CPU: the
plans run (the KV-dtype plan ``kvquant`` too), resume across calls under a time budget,
``--plans`` selects some, and the page is regenerated with the run's commands, device,
commit, criteria and intervals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eval_gpu_resumes_and_regenerates_the_page(make_tiny, tmp_path, monkeypatch, capsys):
    from sparda.eval import runner

    bench_eval = _script("bench_eval")
    out = tmp_path / "run"
    small = ["--model", str(make_tiny("llama")), "--device", "cpu", "--tasks", "passkey,niah-single",
             "--methods", "dense,sparse", "--lengths", "300", "--ppl-lengths", "300",
             "--samples", "2", "--ppl-windows", "2", "--batch-size", "2", "--sweep-methods", "dense,sparse",
             "--sweep-lengths", "300", "--budgets", "10,50", "--sweep-ppl-windows", "1", "--commit", "abc1234",
             "--kv-dtypes", "bf16,int8", "--kv-methods", "dense,sparse", "--kv-lengths", "300",
             "--kv-ppl-lengths", "300", "--decode-tokens", "8",
             "--baseline-methods", "",  # the baselines plan: tests/test_eval_baselines_plan.py
             "--selector-methods", ""]  # the selectors plan: tests/test_eval_selectors_plan.py
    estimate = bench_eval.estimate(bench_eval.parse_args(["run", str(out), *small]))
    # main: 2 tasks x 2 methods x 2; sweep: 2 passkeys x (dense + sparse at 2 budgets);
    # kvquant, per dtype: 2 passkeys and 2 ppl-decode windows x 2 methods
    assert estimate["prefills"] == 2 * 2 * 2 + 2 * 3 + 2 * (2 * 2 + 2 * 2)
    assert estimate["decode_steps"] == 2 * 2 * 8 and set(estimate["plans"]) == {
        "main", "ppl", "budget", "kvquant-bf16", "kvquant-bf16-decode", "kvquant-int8", "kvquant-int8-decode"}
    kv_only = bench_eval.estimate(bench_eval.parse_args(["run", str(out), *small, "--plans", "kvquant"]))
    assert set(kv_only["plans"]) == {name for name in estimate["plans"] if name.startswith("kvquant")}
    assert kv_only["seconds"] <= estimate["seconds"]
    assert bench_eval.main(["run", str(out), *small, "--plans", "kvq", "--estimate"]) == 2  # selects nothing
    ticks = iter(range(10**6))
    monkeypatch.setattr(runner, "_now", lambda: float(next(ticks)))  # each runner clock read: 1 s
    assert bench_eval.main(["run", str(out), *small, "--time-budget-s", "6"]) == 0  # a first, short call
    monkeypatch.undo()
    calls = json.loads((out / "calls.json").read_text())
    assert calls[0]["plans"]["main"]["complete"] is False and calls[0]["plans"]["budget"] == "not started (time budget)"
    assert "INCOMPLETE" in capsys.readouterr().out
    assert bench_eval.main(["run", str(out), *small]) == 0  # the second call finishes
    calls = json.loads((out / "calls.json").read_text())
    assert len(calls) == 2 and all(p["complete"] for p in calls[1]["plans"].values())
    main = [json.loads(line) for line in (out / "main" / "results.jsonl").read_text().splitlines()]
    assert len(main) == len({r["key"] for r in main}) == 2 * 2 * 2 + 2 * 2  # tasks + ppl windows
    for kv in ("bf16", "int8"):  # passkey and ppl-decode of both methods, in the dtype's own directory
        records = [json.loads(line) for line in (out / f"kv-{kv}" / "results.jsonl").read_text().splitlines()]
        assert sorted((r["task"], r["label"]) for r in records) == sorted(
            [(t, m) for t in ("passkey", "ppl-decode") for m in ("dense", "sparse")] * 2)
        assert json.loads((out / f"kv-{kv}" / "plan.json").read_text())["kv_dtype"] == kv
    printed = capsys.readouterr().out
    assert "== main: complete" in printed and "\nsparse " in printed and "== kv-int8: complete" in printed

    page = tmp_path / "docs" / "results" / "accuracy.md"
    assert bench_eval.main(["doc", str(out), "--doc", str(page)]) == 0
    text = page.read_text()
    assert "`abc1234`" in text and "python3 benchmarks/bench_eval.py run" in text and "CPU" in text
    assert "## Issue #12 criteria" in text and "`sparda` mean task accuracy ≥ `sparse` − 2 points" in text
    assert "Wilson" in text and "#### Paired differences" in text and "#### Budget sweep" in text
    assert (page.parent / "accuracy" / "gpu" / "main" / "accuracy_vs_length.png").stat().st_size > 1000
    assert "## KV-cache dtype" in text and "| sparse | int8 | 300 |" in text  # the tables of both dtypes
    assert "no sparda `ppl-decode` windows under both bf16 and int8" in text  # sparda was not run here
    assert bench_eval.main(["doc", str(tmp_path / "nothing"), "--doc", str(page)]) == 2
    # without --doc the page goes where the committed one lives, with the other results
    assert bench_eval.DEFAULT_DOC == ROOT / "docs" / "results" / "accuracy.md" and bench_eval.DEFAULT_DOC.is_file()
