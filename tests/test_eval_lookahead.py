"""``sparda eval --lookahead``: offloaded ``sparda`` at lookahead 1 and 2 on the same prompts
(design §6.2), on a tiny random Llama with random Forecast files (tests/test_forecast2.py)."""

from __future__ import annotations

import pytest

from sparda.errors import SpardaError
from test_forecast2 import SMALL, tiny, weights  # noqa: F401 - fixtures

pytestmark = pytest.mark.usefixtures("one_thread")


def _plan(tmp_path, tiny, weights, **extra):
    from sparda.eval.runner import EvalPlan

    text = tmp_path / "haystack.txt"
    text.write_text("It was a fine morning in Highbury. Emma walked to the village and met Harriet.\n" * 60)
    options = dict(text=str(text), tasks=("passkey",), methods=("dense", "sparda"), lengths=(400,), samples=2,
                   ppl_windows=1, out=str(tmp_path / "out"), model=str(tiny), device="cpu", overrides=dict(SMALL),
                   lookaheads=(1, 2), forecast=weights[0], forecast2=weights[1], batch_size=2)
    return EvalPlan(**{**options, **extra})


def test_lookahead_two_copies_early_and_answers_as_lookahead_one(tmp_path, tiny, weights):
    """Each sample of ``sparda@la2`` gives the completion of ``sparda@la1`` (the selection is the
    one-layer Forecast's either way) with early copies that turn misses into hits; the report
    pairs the two, and a plain ``sparda`` label stays on the device on the CPU."""
    from sparda.eval.runner import load_results, run_eval

    run_eval(_plan(tmp_path, tiny, weights), progress=False)
    records = load_results(tmp_path / "out" / "results.jsonl")
    by = {(r["label"], r["sample"]): r for r in records}
    assert {label for label, _ in by} == {"dense", "sparda", "sparda@la1", "sparda@la2"}
    for sample in range(2):
        one, two, plain = (by[(lab, sample)] for lab in ("sparda@la1", "sparda@la2", "sparda"))
        assert (one["lookahead"], two["lookahead"], plain["lookahead"]) == (1, 2, None)
        assert one["offload"] and two["offload"] and not plain["offload"]
        assert two["completion"] == one["completion"]
        assert one["early_copies"] == 0 and two["early_copies"] > 0, (one, two)
        assert two["hit_rate"] > one["hit_rate"], (one, two)  # early copies turn misses into hits
    summary = (tmp_path / "out" / "summary.json").read_text()
    assert "sparda@la2" in summary
    report = (tmp_path / "out" / "report.md").read_text()
    assert "sparda@la2 − sparda@la1" in report or "sparda@la2 - sparda@la1" in report, report


@pytest.mark.parametrize("extra, message", [
    (dict(lookaheads=(3,)), "--lookahead takes 1 and/or 2"),
    (dict(methods=("dense", "sparse")), "--lookahead runs method sparda offloaded"),
    (dict(lookaheads=(1,)), "--forecast2 gives the two-ahead Forecast of --lookahead 2"),
    (dict(forecast="/nonexistent/f.safetensors"), "--forecast file not found: /nonexistent/f.safetensors"),
])
def test_bad_lookahead_options_fail_before_anything_is_written(tmp_path, tiny, weights, extra, message):
    from sparda.eval.runner import run_eval

    with pytest.raises(SpardaError, match=message.replace("-", "\\-").replace(".", "\\.")):
        run_eval(_plan(tmp_path, tiny, weights, **extra), progress=False)
    assert not (tmp_path / "out").exists()
