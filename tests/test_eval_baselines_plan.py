"""The ``baselines`` plan of ``benchmarks/bench_eval.py run`` (issue #13: the seeds' selectors in
``OUT/baselines``) and its place in docs/results/accuracy.md (sparda.eval.accuracy_doc): the plan
asks main's prompts, the estimate counts it, and the page puts its records in main's
tables, paired against dense and sparda, only where the directory exists."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest

from sparda.errors import SpardaError
from sparda.eval.accuracy_doc import render
from sparda.eval.report import aggregate
from sparda.eval.runner import EvalPlan

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
FIVE = ("streaming", "h2o", "quest", "snapkv", "shallow")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_baselines_plan_runs_after_main_on_its_prompts_and_joins_the_page(make_tiny, tmp_path, capsys):
    """CPU, tiny model: the plan runs last into OUT/baselines, its records ask the prompts of
    main's (same answers and depths per sample) and the page pairs them with main's dense."""
    bench_eval = _script("bench_eval")
    out = tmp_path / "run"
    small = ["--model", str(make_tiny("llama")), "--device", "cpu", "--tasks", "passkey", "--methods", "dense",
             "--lengths", "300", "--ppl-lengths", "300", "--samples", "2", "--ppl-windows", "1",
             "--batch-size", "2", "--sweep-methods", "dense", "--sweep-lengths", "300", "--budgets", "50",
             "--sweep-ppl-windows", "1", "--baseline-methods", "streaming,h2o", "--commit", "abc1234",
             "--plans", "main,ppl,baselines"]
    assert bench_eval.main(["run", str(out), *small]) == 0
    calls = json.loads((out / "calls.json").read_text())
    assert list(calls[0]["plans"])[-2:] == ["baselines", "baselines-ppl"]
    assert all(p["complete"] for p in calls[0]["plans"].values())
    assert "== baselines: complete" in capsys.readouterr().out
    main = [json.loads(line) for line in (out / "main" / "results.jsonl").read_text().splitlines()]
    base = [json.loads(line) for line in (out / "baselines" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["key"] for r in base) == sorted(f"{m}|{t}|300|{i}" for m in ("h2o", "streaming")
                                                    for t, n in (("passkey", 2), ("ppl", 1)) for i in range(n))
    assert not any(r["method"] in ("streaming", "h2o") for r in main)
    dense = {r["sample"]: r for r in main if r["task"] == "passkey"}
    for r in base:
        if r["task"] == "passkey":  # the same prompt as main's sample of that index
            assert (r["answers"], r["depth"], r["prompt_tokens"]) == \
                   (dense[r["sample"]]["answers"], dense[r["sample"]]["depth"], dense[r["sample"]]["prompt_tokens"])
    page = tmp_path / "docs" / "results" / "accuracy.md"
    assert bench_eval.main(["doc", str(out), "--doc", str(page)]) == 0
    text = page.read_text()
    assert "| streaming − dense |" in text and "| h2o − dense |" in text and "| streaming | 300 | " in text


def test_baselines_plan_asks_mains_prompts_and_is_estimated(tmp_path):
    bench_eval = _script("bench_eval")
    args = bench_eval.parse_args(["run", str(tmp_path / "run"), "--device", "cpu"])
    named = dict(bench_eval.plans(args))
    assert list(named)[-3:] == ["baselines", "baselines-ppl", "selectors"]  # after kvquant, before selectors
    main, ppl, base, base_ppl = named["main"], named["ppl"], named["baselines"], named["baselines-ppl"]
    assert base.methods == base_ppl.methods == FIVE and not set(FIVE) & set(main.methods)
    assert base.out == base_ppl.out == str(tmp_path / "run" / "baselines") != main.out
    for mine, theirs in ((base, main), (base_ppl, ppl)):
        assert (mine.tasks, mine.lengths, mine.samples, mine.ppl_windows) == \
               (theirs.tasks, theirs.lengths, theirs.samples, theirs.ppl_windows)
        assert mine.fingerprint() == theirs.fingerprint()  # the same prompts and windows
    assert base.samples == 30 and "selection" in base.tasks
    only = bench_eval.plans(bench_eval.parse_args(["run", str(tmp_path / "run"), "--plans", "baselines"]))
    assert [name for name, _ in only] == ["baselines", "baselines-ppl"]

    est = bench_eval.estimate(args)
    assert sum(est["plans"].values()) == pytest.approx(est["seconds"], abs=len(est["plans"]))
    without = bench_eval.estimate(bench_eval.parse_args(["run", str(tmp_path / "run"), "--device", "cpu",
                                                     "--baseline-methods", ""]))
    assert "baselines" not in without["plans"] and "baselines" not in dict(
        bench_eval.plans(bench_eval.parse_args(["run", str(tmp_path / "run"), "--baseline-methods", ""])))
    gen_tasks = [t for t in main.tasks if t != "selection"]
    assert est["prefills"] - without["prefills"] == len(FIVE) * len(gen_tasks) * len(main.lengths) * 30
    assert est["ppl_prefills"] - without["ppl_prefills"] == len(FIVE) * len(ppl.lengths) * ppl.ppl_windows
    for name in FIVE:  # every baseline has calibrated factors, not the default 1
        assert name in bench_eval.PREFILL_FACTOR and name in bench_eval.PPL_FACTOR and name in bench_eval.DECODE_FACTOR
    assert est["plans"]["baselines"] > 0 and est["plans"]["baselines-ppl"] > 0
    # ppl: a method that prefills densely (snapkv) costs dense prefill, one that selects in
    # prefill (streaming) block-sparse prefill; each window also pays the dense reference
    gpu = bench_eval.GPU_S
    for name, per_ktok in (("snapkv", gpu["dense_prefill_per_ktok"]), ("streaming", gpu["sparse_prefill_per_ktok"])):
        one = bench_eval.estimate(bench_eval.parse_args(["run", str(tmp_path / "run"), "--baseline-methods", name]))
        want = sum(ppl.ppl_windows * n / 1000 * (per_ktok * bench_eval.PPL_FACTOR[name] + gpu["dense_prefill_per_ktok"])
                   for n in ppl.lengths)
        assert one["plans"]["baselines-ppl"] == pytest.approx(want, abs=0.05), (name, one["plans"])


PLAN = dict(depths=[0.0, 0.5, 1.0], model=None, preset="small", device="cuda", dtype=None, text=None, seed=0,
            overrides={}, ppl_windows=3, sparse_prefill=None, kv_dtype="bf16", dense_heads="auto")


def _records(rng, methods, lengths=(2048, 4096), samples=6):
    """Synthetic records of ``methods``: passkey / niah-single scores in {0, 1}, ppl windows,
    one selection record per length."""
    out = []
    for m in methods:
        for task in ("passkey", "niah-single"):
            for n in lengths:
                for i in range(samples):
                    out.append(dict(key=f"{m}|{task}|{n}|{i}", label=m, method=m, budget_pct=None, task=task,
                                    length=n, sample=i, depth=PLAN["depths"][i % 3], score=float(rng.random() < 0.6),
                                    kv_read_fraction=rng.random(), kv_bytes_read_per_token=1e6 * rng.random(),
                                    host_bytes_copied_per_token=None, hit_rate=rng.random(),
                                    hit_rate_source="overlap", prefill_ms=100 * rng.random()))
        for n in lengths:
            for i in range(PLAN["ppl_windows"]):
                out.append(dict(key=f"{m}|ppl|{n}|{i}", label=m, method=m, budget_pct=None, task="ppl", length=n,
                                sample=i, depth=None, ppl=10 + rng.random(), dense_ppl=10.0,
                                top1_agreement=rng.random(), kl=rng.random(), score=None))
            out.append(dict(key=f"{m}|selection|{n}|0", label=m, method=m, budget_pct=None, task="selection",
                            length=n, sample=0, depth=None, recall_vs_sparse=rng.random(),
                            recall_vs_oracle=rng.random(), mass=rng.random(), score=None))
    return out


def _write(directory: Path, records, **plan):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fields = {**PLAN, **plan}
    (directory / "plan.json").write_text(json.dumps({**fields, "fingerprint": plan.get("fingerprint", "f0")}))


def _row(text: str, start: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(start)]
    assert rows, f"no row starting {start!r}"
    return rows[0]


def test_page_joins_the_baselines_into_mains_tables(tmp_path):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    main = _records(rng, ("dense", "sparse", "sparda"))
    base = _records(rng, ("streaming", "h2o"))
    out = tmp_path / "run"
    _write(out / "main", main)
    before = render(out, tmp_path / "docA")
    assert "streaming" not in before and "h2o" not in before, seed

    _write(out / "baselines", base)
    page = render(out, tmp_path / "docB")
    assert "`baselines`" in page, seed
    for m in ("streaming", "h2o"):
        # accuracy per task: the same cells as the report of the baselines' records alone
        mine = aggregate(base)["mean_accuracy"][m]
        assert _row(page, f"| {m} | ").split("|")[4].strip() == \
            f"{100 * mine['mean']:.0f} [{100 * mine['low']:.0f}, {100 * mine['high']:.0f}]", seed
        ppl = [r["kl"] for r in base if r["label"] == m and r["task"] == "ppl" and r["length"] == 4096]
        assert any(line.startswith(f"| {m} | 4096 | ") and f"| {sum(ppl) / len(ppl):.3g} [" in line
                   for line in page.splitlines()), seed  # the ppl / KL row
        for ref in ("sparda", "dense"):
            # independent reference: mean over prompts of the score differences
            diffs = [a["score"] - b["score"] for a in base if a["label"] == m and a["task"] not in ("ppl", "selection")
                     for b in main if b["label"] == ref and (b["task"], b["length"], b["sample"]) ==
                     (a["task"], a["length"], a["sample"])]
            cell = _row(page, f"| {m} − {ref} | ").split("|")[2].strip()
            assert cell.startswith(f"{100 * sum(diffs) / len(diffs):+.1f} ["), (seed, m, ref, cell)
    # the selection table row of a baseline: its own mean recall
    recall = [r["recall_vs_sparse"] for r in base if r["label"] == "h2o" and r["task"] == "selection" and
              r["length"] == 4096][0]
    sel = [line for line in page.splitlines() if line.startswith("| h2o | 4096 | ") and line.count("%") == 3]
    assert sel and sel[0].split("|")[3].strip() == f"{100 * recall:.0f} %", (seed, sel)
    # the KV-reads table has a row per baseline
    kv = [r["kv_read_fraction"] for r in base if r["label"] == "streaming" and r.get("kv_read_fraction") is not None]
    assert f"| streaming | {100 * sum(kv) / len(kv):.0f} % |" in page, seed
    # main's own section is the same table with two more methods: every main row survives
    assert "| sparda − sparse |" in page and "| sparda − sparse |" in before, seed
    assert (tmp_path / "docB" / "accuracy" / "gpu" / "main" / "accuracy_vs_length.png").stat().st_size > 1000


def test_page_refuses_baselines_of_other_prompts_and_notes_other_assets(tmp_path):
    rng = random.Random(0)
    out = tmp_path / "run"
    _write(out / "main", _records(rng, ("dense", "sparda")))
    _write(out / "baselines", _records(rng, ("quest",)), seed=1)
    with pytest.raises(SpardaError, match="seed"):
        render(out, tmp_path / "doc")
    _write(out / "baselines", _records(rng, ("quest",)), fingerprint="f1")
    assert "plan fingerprints differ" in render(out, tmp_path / "doc")
    _write(out / "baselines", _records(rng, ("quest",)))
    assert "plan fingerprints differ" not in render(out, tmp_path / "doc")
    # a field newer than main's plan.json: absent there means its default
    _write(out / "baselines", _records(rng, ("quest",)), decode_tokens=EvalPlan.decode_tokens)
    assert "| quest − sparda |" in render(out, tmp_path / "doc")
    _write(out / "baselines", _records(rng, ("quest",)), decode_tokens=EvalPlan.decode_tokens + 1)
    with pytest.raises(SpardaError, match="decode_tokens"):
        render(out, tmp_path / "doc")


def test_workers_run_the_directories_at_once_with_the_same_records(make_tiny, tmp_path, capsys):
    """``--workers 2``: main (+ ppl) and baselines (+ ppl) in two child processes give the
    records of one process running them in order (same keys, completions, scores), one
    ``calls.json`` entry naming every plan, each worker's log; a worker that fails makes
    the call's exit status non-zero and its plans say so."""
    bench_eval = _script("bench_eval")
    small = ["--model", str(make_tiny("llama")), "--device", "cpu", "--tasks", "passkey", "--methods", "dense,sparse",
             "--lengths", "300", "--ppl-lengths", "300", "--samples", "2", "--ppl-windows", "1",
             "--batch-size", "2", "--baseline-methods", "streaming", "--commit", "abc1234",
             "--plans", "main,ppl,baselines"]
    together, alone = tmp_path / "together", tmp_path / "alone"
    assert bench_eval.main(["run", str(together), *small, "--workers", "2"]) == 0
    assert bench_eval.main(["run", str(alone), *small]) == 0
    calls = json.loads((together / "calls.json").read_text())
    assert len(calls) == 1 and list(calls[0]["plans"]) == ["main", "ppl", "baselines", "baselines-ppl"]
    assert all(p["complete"] for p in calls[0]["plans"].values()) and "--workers 2" in calls[0]["command"]
    assert (together / "worker-1.log").is_file() and (together / "worker-2.log").is_file()
    assert not list(together.glob(".worker-*"))
    for sub in ("main", "baselines"):
        got, want = ({json.loads(line)["key"]: json.loads(line)
                      for line in (d / sub / "results.jsonl").read_text().splitlines()} for d in (together, alone))
        assert sorted(got) == sorted(want) and len(got) > 2
        for key, rec in want.items():
            assert (got[key]["score"], got[key].get("completion")) == (rec["score"], rec.get("completion")), key
    for first, second in (("main", "ppl"), ("baselines", "baselines-ppl")):  # records each plan added
        lines = len((together / first.split("-")[0] / "results.jsonl").read_text().splitlines())
        assert calls[0]["plans"][first]["new"] > 0 and calls[0]["plans"][second]["new"] > 0
        assert calls[0]["plans"][first]["new"] + calls[0]["plans"][second]["new"] == lines
    bad = [*small, "--model", str(tmp_path / "missing"), "--workers", "2"]
    assert bench_eval.main(["run", str(tmp_path / "bad"), *bad]) == 2
    plans = json.loads((tmp_path / "bad" / "calls.json").read_text())[0]["plans"]
    assert all(str(p).startswith("failed (exit 2") for p in plans.values()), plans
    # a worker failing on its second plan (ppl below 256 tokens) keeps its first plan's progress
    late = [*small, "--ppl-lengths", "100", "--workers", "2"]
    assert bench_eval.main(["run", str(tmp_path / "late"), *late]) == 2
    plans = json.loads((tmp_path / "late" / "calls.json").read_text())[0]["plans"]
    assert plans["main"]["complete"] and plans["main"]["new"] > 0, plans
    assert str(plans["ppl"]).startswith("failed (exit 2"), plans
    # no time left: nothing runs, nothing fails, no worker report is left behind
    assert bench_eval.main(["run", str(tmp_path / "none"), *small, "--workers", "2", "--time-budget-s", "0.01"]) == 0
    plans = json.loads((tmp_path / "none" / "calls.json").read_text())[0]["plans"]
    assert set(plans.values()) == {"not started (time budget)"} and not list((tmp_path / "none").glob(".worker-*"))
