"""The ``selectors`` plan of ``benchmarks/bench_eval.py run`` (the block-sparse selectors rerun with
``dense_heads none`` on main's prompts, ``OUT/selectors``) and its section of
docs/results/accuracy.md (:func:`sparda.eval.accuracy_doc.selectors_section`): the plan's records
ran without dense heads while main's used the calibration, the estimate counts it, and the
page judges issue #12's mean-accuracy criteria in both configurations from the records,
saying "not run" / incomplete / not comparable instead of inventing numbers."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import pytest

from sparda.eval.accuracy_doc import render, selectors_section
from test_eval_baselines_plan import _script  # noqa: E402 - the benchmarks/ script loader

pytestmark = pytest.mark.usefixtures("one_thread")

FIVE = ("sparse", "oracle", "sparda", "sparda-random", "infinigen")


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_selectors_plan_runs_without_dense_heads_on_mains_prompts(make_tiny, tmp_path, capsys):
    """CPU, tiny model with a dense-heads calibration beside it (head 0 of layer 0): main's
    sparse decodes with that head dense (``auto``), the selectors plan, run last, with none,
    on the prompts of main's samples; the page shows both configurations."""
    bench_eval = _script("bench_eval")
    model = tmp_path / "tiny"
    shutil.copytree(make_tiny("llama"), model)
    (model / "sparda_dense_heads.json").write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": [[0, 0]]}))
    out = tmp_path / "run"
    small = ["--model", str(model), "--device", "cpu", "--tasks", "passkey", "--methods", "dense,sparse",
             "--lengths", "300", "--samples", "2", "--batch-size", "2", "--baseline-methods", "",
             "--selector-methods", "sparse,sparda-random", "--commit", "abc1234", "--plans", "main,selectors"]
    assert bench_eval.main(["run", str(out), *small]) == 0
    calls = json.loads((out / "calls.json").read_text())
    assert list(calls[0]["plans"]) == ["main", "selectors"] and all(p["complete"] for p in calls[0]["plans"].values())
    assert "== selectors: complete" in capsys.readouterr().out
    plan = json.loads((out / "selectors" / "plan.json").read_text())
    assert plan["dense_heads"] == "none" and json.loads((out / "main" / "plan.json").read_text())["dense_heads"] == "auto"
    main, mine = _jsonl(out / "main" / "results.jsonl"), _jsonl(out / "selectors" / "results.jsonl")
    assert sorted(r["key"] for r in mine) == sorted(f"{m}|passkey|300|{i}" for m in ("sparse", "sparda-random")
                                                    for i in range(2))  # no ppl
    assert {r["dense_heads"] for r in mine} == {"none"}
    assert {r["dense_heads"] for r in main if r["label"] == "sparse" and r["task"] == "passkey"} == {"0:0"}
    dense = {r["sample"]: r for r in main if r["label"] == "dense" and r["task"] == "passkey"}
    assert {r["dense_heads"] for r in dense.values()} == {"none"}  # dense reads every block anyway
    for r in mine:  # the prompt of main's sample of that index
        assert (r["answers"], r["depth"], r["prompt_tokens"]) == \
               (dense[r["sample"]]["answers"], dense[r["sample"]]["depth"], dense[r["sample"]]["prompt_tokens"])
    page = tmp_path / "docs" / "results" / "accuracy.md"
    assert bench_eval.main(["doc", str(out), "--doc", str(page)]) == 0
    text = page.read_text()
    assert "## Selectors without dense heads (`selectors`)" in text and "| sparda-random | " in text
    assert "Commit(s): `selectors` `abc1234`, `main` `abc1234`." in text


def test_selectors_plan_mirrors_main_and_is_estimated(tmp_path):
    bench_eval = _script("bench_eval")
    args = bench_eval.parse_args(["run", str(tmp_path / "run"), "--device", "cpu"])
    named = dict(bench_eval.plans(args))
    assert list(named)[-1] == "selectors"  # after the baselines
    main, sel = named["main"], named["selectors"]
    assert sel.methods == FIVE and sel.dense_heads == "none" and main.dense_heads == "auto"
    assert sel.out == str(tmp_path / "run" / "selectors")
    assert sel.tasks == tuple(t for t in main.tasks if t != "selection") and "selection" in main.tasks
    assert (sel.lengths, sel.samples, sel.seed, sel.depths, sel.text, sel.model, sel.preset) == \
           (main.lengths, main.samples, main.seed, main.depths, main.text, main.model, main.preset)
    assert [n for n, _ in bench_eval.plans(bench_eval.parse_args(["run", str(tmp_path / "r"), "--plans", "selectors"]))] == \
           ["selectors"]
    est = bench_eval.estimate(args)
    without = bench_eval.estimate(bench_eval.parse_args(["run", str(tmp_path / "run"), "--device", "cpu",
                                                     "--selector-methods", ""]))
    assert "selectors" not in without["plans"] and 0 < est["plans"]["selectors"] < 550  # one GPU call
    assert est["prefills"] - without["prefills"] == len(FIVE) * len(sel.tasks) * len(sel.lengths) * 30
    assert est["ppl_prefills"] == without["ppl_prefills"]


# ---- the page's section, from synthetic records -------------------------------------------------

PLAN = dict(depths=[0.0, 0.5, 1.0], model=None, preset="small", device="cuda", dtype=None, text=None, seed=0,
            overrides={}, ppl_windows=3, sparse_prefill=None, kv_dtype="bf16", dense_heads="auto")
TASKS, LENGTHS, SAMPLES = ("passkey", "niah-single"), (2048, 4096), 30
PROMPTS = [(t, n, i) for t in TASKS for n in LENGTHS for i in range(SAMPLES)]


def _rec(label, task, length, sample, score, heads="none", kv=0.2):
    return dict(key=f"{label}|{task}|{length}|{sample}", label=label, method=label, budget_pct=None, task=task,
                length=length, sample=sample, depth=PLAN["depths"][sample % 3], score=float(score),
                kv_read_fraction=kv, dense_heads=heads)


def _write(directory: Path, records, complete=True, **plan):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (directory / "plan.json").write_text(json.dumps({**PLAN, **plan, "fingerprint": "f"}))
    (directory / "progress.json").write_text(json.dumps(dict(planned=len(records) + (0 if complete else 7),
                                                             done=len(records), complete=complete)))


def _wilson(p, n, z=1.959963984540054):
    centre, half = p + z * z / (2 * n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def _acc_cell(scores: dict) -> str:
    """Mean over tasks of the task means, Wilson interval on the pooled count (independent of report.py)."""
    by_task = {t: [s for (tt, _, _), s in scores.items() if tt == t] for t in TASKS}
    mean = sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)
    n = sum(len(v) for v in by_task.values())
    low, high = _wilson(mean, n)
    return f"{100 * mean:.1f} [{100 * low:.1f}, {100 * high:.1f}] (n={n})"


def _scores(rng, p=0.5):
    return {k: float(rng.random() < p) for k in PROMPTS}


def _minus(rng, scores, k):
    """``scores`` with ``k`` of its ones set to 0: exactly ``k / len`` below, prompt by prompt."""
    ones = [key for key, s in scores.items() if s == 1.0]
    drop = set(rng.sample(ones, k))
    return {key: 0.0 if key in drop else s for key, s in scores.items()}


def _setup(out: Path, rng, k_none: int, complete=True, **selectors_plan):
    """main (auto): sparda barely above infinigen (one prompt); selectors (none): sparda
    above infinigen by exactly ``k_none`` prompts. Returns the score dicts."""
    sparda_auto = _scores(rng, 0.6)
    auto = dict(dense=_scores(rng, 0.8), sparse=_scores(rng, 0.6), sparda=sparda_auto,
                infinigen=_minus(rng, sparda_auto, 1))
    sparda_none = _scores(rng, 0.55)
    none = dict(sparse=_scores(rng, 0.55), sparda=sparda_none, infinigen=_minus(rng, sparda_none, k_none))
    _write(out / "main", [_rec(m, *k, s, heads="none" if m == "dense" else "7:2,18:2", kv=0.4)
                          for m, sc in auto.items() for k, s in sc.items()])
    _write(out / "selectors", [_rec(m, *k, s) for m, sc in none.items() for k, s in sc.items()], complete=complete,
           **{"dense_heads": "none", **selectors_plan})
    return auto, none


def _row(text, *starts):
    rows = [line for line in text.splitlines() if all(s in line for s in starts)]
    assert len(rows) == 1, (starts, rows)
    return [c.strip() for c in rows[0].strip("|").split("|")]


@pytest.mark.parametrize("k_none", [9, 11, 13, 15])
def test_section_judges_both_configurations_from_the_records(tmp_path, fresh_seed, k_none):
    rng = random.Random(fresh_seed)
    out = tmp_path / "run"
    auto, none = _setup(out, rng, k_none)
    page = render(out, tmp_path / "doc")
    section = page[page.index("## Selectors without dense heads"):page.index("## KV-cache dtype")]
    assert "not run" not in section and "incomplete" not in section, fresh_seed
    for m in ("sparse", "sparda", "infinigen"):  # the mean accuracy table
        cells = _row(section, f"| {m} | ")
        assert cells[1] == _acc_cell(auto[m]) and cells[2] == _acc_cell(none[m]), (fresh_seed, m, cells)
        diff = sum(none[m][k] - auto[m][k] for k in PROMPTS) / len(PROMPTS)
        assert cells[3].startswith(f"{100 * diff:+.1f} [") and cells[3].endswith(f"(n={len(PROMPTS)})"), fresh_seed
        assert cells[4] == "40 % / 20 %", (fresh_seed, cells)
    assert _row(section, "| dense (reference) | ")[1] == _acc_cell(auto["dense"]), fresh_seed
    # the criterion, in each configuration: judged on the paired difference of its own records
    gap = 100 * k_none / len(PROMPTS)
    name = "`sparda` mean task accuracy ≥ `infinigen` + 10 points"
    auto_row = _row(section, name, "dense heads `auto`")
    none_row = _row(section, name, "dense heads `none`")
    assert auto_row[2] == f"sparda {_acc_cell(auto['sparda'])} vs infinigen {_acc_cell(auto['infinigen'])}"
    assert auto_row[3].startswith(f"{100 / len(PROMPTS):+.1f} [") and auto_row[4] == "**no**", fresh_seed
    assert none_row[2] == f"sparda {_acc_cell(none['sparda'])} vs infinigen {_acc_cell(none['infinigen'])}"
    assert none_row[3].startswith(f"{gap:+.1f} ["), (fresh_seed, none_row)
    assert none_row[4] == ("yes" if gap >= 10 else "**no**"), (fresh_seed, k_none, none_row)
    # the headline table carries the same verdicts, each configuration labelled
    head = page[page.index("## Issue #12 criteria"):page.index("## Tasks")]
    assert _row(head, name, "dense heads `none`")[-1] == none_row[4]
    assert _row(head, name, "dense heads `auto`")[-1] == "**no**"
    sparse_gap = sum(none["sparda"][k] - none["sparse"][k] for k in PROMPTS) / len(PROMPTS)
    assert _row(section, "`sparda` mean task accuracy ≥ `sparse` − 2 points", "`none`")[4] == \
        ("yes" if 100 * sparse_gap >= -2 else "**no**"), fresh_seed


def test_section_says_not_run_incomplete_or_not_comparable(tmp_path, fresh_seed):
    rng = random.Random(fresh_seed)
    out = tmp_path / "run"
    _setup(out, rng, 15)
    main = [json.loads(line) for line in (out / "main" / "results.jsonl").read_text().splitlines()]
    shutil.rmtree(out / "selectors")
    text = "\n".join(selectors_section(out, main))
    assert "Not run: this output has no `selectors/` records" in text
    none = _row(text, "`infinigen` + 10 points", "dense heads `none`")
    assert none[2:] == ["not run (`python3 benchmarks/bench_eval.py run OUT --plans selectors`)", "–", "–"]
    assert _row(text, "`infinigen` + 10 points", "dense heads `auto`")[4] == "**no**"
    assert "| sparda | " not in text  # no numbers for the missing configuration

    _setup(out, rng, 15, complete=False)  # the same numbers that pass, but the run is not finished
    text = "\n".join(selectors_section(out, main))
    assert "**`selectors` is incomplete**" in text and "| sparda | " in text
    assert _row(text, "`infinigen` + 10 points", "dense heads `none`")[4] == "– (run incomplete)"

    for change, why in ((dict(seed=1), "other seed"), (dict(dense_heads="auto"), "`dense_heads auto`")):
        _setup(out, rng, 15, **change)
        text = "\n".join(selectors_section(out, main))
        assert why in text and "| sparda | " not in text, change
        assert _row(text, "`infinigen` + 10 points", "dense heads `none`")[2].startswith("not comparable"), change
    _setup(out, rng, 15)
    with open(out / "selectors" / "results.jsonl", "a") as fh:  # a record that decoded with a dense head
        fh.write(json.dumps(_rec("oracle", "passkey", 2048, 0, 1.0, heads="3:1")) + "\n")
    assert "ran with dense heads 3:1" in "\n".join(selectors_section(out, main))
    (out / "main" / "plan.json").unlink()
    assert "cannot read" in "\n".join(selectors_section(out, main))


@pytest.mark.parametrize("k", [3, 11, 14])
def test_dense_ceiling_note_when_the_reference_is_at_dense(tmp_path, fresh_seed, k):
    """The page says that "sparda ≥ infinigen + 10" cannot be met with the defaults exactly
    when dense − infinigen, paired on the same prompts, is below 10 points (dense reads
    every block, so no selector is expected above it), with that difference."""
    from sparda.eval.accuracy_doc import dense_ceiling_notes

    rng = random.Random(fresh_seed)
    dense = _scores(rng, 0.7)
    scores = dict(dense=dense, infinigen=_minus(rng, dense, k), sparda=_scores(rng, 0.6), sparse=_scores(rng, 0.6))
    main = [_rec(m, *key, s) for m, sc in scores.items() for key, s in sc.items()]
    notes = dense_ceiling_notes(main)
    gap = 100 * k / len(PROMPTS)
    if gap >= 10:
        assert notes == [], (fresh_seed, k)
        return
    assert len(notes) == 1, (fresh_seed, notes)
    assert notes[0].startswith(f"With the defaults, `dense` − `infinigen` = {gap:+.1f} [") and \
        "cannot be met in this configuration" in notes[0], (fresh_seed, notes)
    _write(tmp_path / "run" / "main", main)
    assert notes[0] in render(tmp_path / "run", tmp_path / "doc")


def test_calls_table_and_full_eval_timing():
    """Plans a call advanced (done counts that grew since the last report) and the full
    eval's calls, seconds and verdict against two calls of 600 s."""
    from sparda.eval.accuracy_doc import advanced_plans, full_eval_timing

    def call(wall, **plans):
        return dict(wall_s=wall, plans={n: (p if isinstance(p, str) else dict(done=p[0], complete=p[1]))
                                        for n, p in plans.items()})

    calls = [call(500, main=(100, False), selectors=(5, False)),
             call(590, main=(200, True), ppl=(4, True), baselines=(50, True), **{"baselines-ppl": (3, True)}),
             call(40, main=(200, True), selectors=(9, True), **{"baselines-ppl": "not started (time budget)"})]
    advanced = advanced_plans(calls)
    assert advanced == [{"main": 100, "selectors": 5}, {"main": 200, "ppl": 4, "baselines": 50, "baselines-ppl": 3},
                        {"selectors": 9}]
    text = full_eval_timing(calls, advanced)
    assert "2 call(s), 1090 s of wall time in all (500 + 590), complete" in text and text.endswith(": met.")
    slow = [call(500, main=(100, False)), call(601, main=(200, True), ppl=(4, True), baselines=(50, True),
                                                 **{"baselines-ppl": (3, True)})]
    assert full_eval_timing(slow, advanced_plans(slow)).endswith("**not met**.")
    three = calls[:1] + [call(300, main=(200, True)), calls[1]]
    assert "3 call(s)" in full_eval_timing(three, advanced_plans(three)) and \
        full_eval_timing(three, advanced_plans(three)).endswith("**not met**.")
    unfinished = calls[:1]
    assert "INCOMPLETE" in full_eval_timing(unfinished, advanced_plans(unfinished))
    assert full_eval_timing([call(10, selectors=(3, True))], [{"selectors": 3}]) is None
    no_baselines = [call(100, main=(200, True), ppl=(4, True))]
    assert "INCOMPLETE" in full_eval_timing(no_baselines, advanced_plans(no_baselines))
    # entries with the records each call added ("new"): a narrower call that lowered "done"
    # does not make the next call, which added nothing, look like progress
    narrow = [dict(wall_s=300, plans={"main": dict(done=813, complete=False, new=813)}),
              dict(wall_s=20, plans={"main": dict(done=4878, complete=True, new=0)})]
    assert advanced_plans(narrow) == [{"main": 813}, {}]
    assert advanced_plans([dict(wall_s=1, plans=None), dict(plans={"main": "not started (time budget)"})]) == [{}, {}]
