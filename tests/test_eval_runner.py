"""``sparda eval`` runner: resumable, atomic, identical to an uninterrupted run (design §8)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparda.cli import main
from sparda.engine.llm import LLM
from sparda.eval.runner import EvalPlan, load_results, run_eval

VOLATILE = {"prefill_ms", "decode_tok_s", "seconds"}


TEXT = ("It was a fine morning in Highbury. Emma walked to the village and met Harriet.\n" * 30 +
        "Mr. Knightley called upon them, and they spoke of the weather and of Frank Churchill.\n" * 30)


def _plan(model_dir, out):
    text = out.parent / "haystack.txt"
    text.write_text(TEXT)
    return EvalPlan(text=str(text), tasks=("passkey", "niah-single", "ppl"), methods=("dense", "sparse"), lengths=(400,),
                    samples=2, ppl_windows=1, out=str(out), model=str(model_dir), device="cpu",
                    depths=(0.3, 0.8), overrides=dict(dense_len=0, topk_blocks=1, local_blocks=1,
                                                      block_size=32))


def _counting(monkeypatch):
    calls = {"generate": 0, "logits": 0}
    generate, logits = LLM.generate, LLM.logits

    def counted_generate(self, *a, **k):
        calls["generate"] += 1
        return generate(self, *a, **k)

    def counted_logits(self, *a, **k):
        calls["logits"] += 1
        return logits(self, *a, **k)

    monkeypatch.setattr(LLM, "generate", counted_generate)
    monkeypatch.setattr(LLM, "logits", counted_logits)
    return calls


def _stable(records):
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in records), key=lambda r: r["key"])


def test_interrupted_run_resumes_without_recomputing(make_tiny, tmp_path, monkeypatch):
    model_dir = make_tiny("llama")
    calls = _counting(monkeypatch)
    # 2 tasks x 2 samples x 2 methods = 8 generations, + ppl: 2 records from 2 prefills (dense ref + sparse)
    full = run_eval(_plan(model_dir, tmp_path / "full"), progress=False)
    assert calls == {"generate": 8, "logits": 2}
    assert set(full) == {"dense", "sparse"} and set(full["dense"]) == {"passkey", "niah-single"}
    ppl = {r["label"]: r for r in load_results(tmp_path / "full" / "results.jsonl") if r["task"] == "ppl"}
    assert ppl["dense"]["kl"] == pytest.approx(0, abs=1e-9) and ppl["dense"]["top1_agreement"] == 1.0
    assert ppl["dense"]["ppl"] == pytest.approx(ppl["sparse"]["dense_ppl"])
    assert ppl["sparse"]["kl"] > 0  # a 3-of-13-block budget really changes the logits
    assert ppl["sparse"]["positions"] == 200

    calls.update(generate=0, logits=0)
    out = tmp_path / "resumed"
    run_eval(_plan(model_dir, out), max_new_items=3, progress=False)  # "killed" after 3 samples
    assert calls == {"generate": 3, "logits": 0}
    first = load_results(out / "results.jsonl")
    assert len(first) == 3
    with open(out / "results.jsonl", "a") as handle:  # a torn line, as if killed mid-write
        handle.write('{"key": "dense|passk')

    calls.update(generate=0, logits=0)
    resumed = run_eval(_plan(model_dir, out), progress=False)
    assert calls == {"generate": 5, "logits": 2}  # nothing finished was recomputed
    records = load_results(out / "results.jsonl")
    assert len(records) == 10 and len({r["key"] for r in records}) == 10
    assert _stable(records) == _stable(load_results(tmp_path / "full" / "results.jsonl"))
    assert resumed == full
    summary = json.loads((out / "summary.json").read_text())
    assert summary == full
    assert (out / "report.md").read_text().count("| sparse |") >= 2
    assert (out / "accuracy_vs_length.png").stat().st_size > 1000
    # a second rerun does nothing at all
    calls.update(generate=0, logits=0)
    run_eval(_plan(model_dir, out), progress=False)
    assert calls == {"generate": 0, "logits": 0}


def test_changed_plan_in_same_dir_is_refused(make_tiny, tmp_path):
    plan = _plan(make_tiny("llama"), tmp_path)
    run_eval(plan, max_new_items=1, progress=False)
    plan.seed = 5
    with pytest.raises(Exception, match="different plan"):
        run_eval(plan, progress=False)


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["eval", "--methods", "dense,bogus", "--out", str(tmp_path), "--quick"])
    assert result.exit_code == 2
    assert "unknown method(s) bogus" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["eval", "--tasks", "passkey,nope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown task(s) nope" in result.output


def test_selection_task_reports_recall(make_tiny, tmp_path):
    plan = _plan(make_tiny("llama"), tmp_path / "sel")
    plan.tasks, plan.methods = ("selection",), ("dense", "sparse", "oracle")
    run_eval(plan, progress=False)
    sel = {r["label"]: r for r in load_results(tmp_path / "sel" / "results.jsonl")}
    assert sel["dense"]["score"] is None
    assert sel["sparse"]["recall_vs_sparse"] == pytest.approx(1.0)
    assert sel["oracle"]["recall_vs_oracle"] == pytest.approx(1.0)
    assert 0 < sel["sparse"]["mass"] <= 1 + 1e-6
    assert "Selection quality" in (tmp_path / "sel" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--budgets", "150"], "--budgets are percentages in (0, 100], got 150"),
    (["--text", "/no/such/text.txt"], "cannot read --text /no/such/text.txt: no such file or directory"),
    (["--dense-prefill", "--tasks", "passkey,ppl"], "run ppl without --dense-prefill"),
])
def test_late_errors_write_nothing(tmp_path, args, message):
    out = tmp_path / "never"
    result = CliRunner().invoke(main, ["eval", "--quick", "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_dense_prefill_plan_prefills_densely(make_tiny, tmp_path):
    """With dense_prefill, a block-sparse method's prefill logits are dense's; without, they differ."""
    import torch

    from sparda.eval.runner import MethodSpec, _Models

    plan = _plan(make_tiny("llama"), tmp_path / "dp")
    ids = torch.randint(0, 1000, (300,)).tolist()
    for dense_prefill in (True, False):
        plan.dense_prefill = dense_prefill
        models = _Models(plan)
        sparse, _, _ = models.get(MethodSpec("sparse"), 300)
        got, want = sparse.logits(ids), models.base.logits(ids)
        assert torch.allclose(got, want, atol=1e-5) == dense_prefill


def test_dense_prefill_default_tasks_leave_out_ppl(tmp_path):
    from sparda.eval.runner import PPL, plan_from_options

    plan = plan_from_options(quick=True, dense_prefill=True, out=str(tmp_path / "q"))
    assert plan.tasks and PPL not in plan.tasks and plan.dense_prefill
    assert PPL in plan_from_options(quick=True, out=str(tmp_path / "q")).tasks
