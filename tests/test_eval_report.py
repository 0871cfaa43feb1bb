"""The eval report's statistics: Wilson intervals on every accuracy, paired differences
on the same prompts, budget sweep with the effective budget (design §8)."""

from __future__ import annotations

import numpy as np
import pytest

from sparda.eval.report import aggregate, markdown, paired_difference
from sparda.eval.stats import bootstrap_mean


def _records(rng):
    """dense, sparse and sparda on 2 tasks x 2 lengths x 12 prompts with random 0/1 scores
    (sparda's correlated with sparse's), plus two ppl windows."""
    out, scores = [], {}
    for task in ("passkey", "vt"):
        for length in (1024, 2048):
            for sample in range(12):
                base = rng.random() < 0.6
                s = {"dense": float(base or rng.random() < 0.3), "sparse": float(base and rng.random() < 0.8)}
                s["sparda"] = s["sparse"] if rng.random() < 0.8 else 1.0 - s["sparse"]
                for label, score in s.items():
                    scores[(label, task, length, sample)] = score
                    out.append(dict(label=label, method=label, budget_pct=None, task=task, length=length,
                                    sample=sample, depth=0.5 if task == "passkey" else None, score=score,
                                    kv_read_fraction=0.3, kv_bytes_read_per_token=1e6, hit_rate=0.8,
                                    hit_rate_source="overlap" if label != "dense" else None, prefill_ms=1.0))
    for label in ("dense", "sparse"):
        for sample, agree in enumerate((0.9, 0.95)):
            out.append(dict(label=label, method=label, budget_pct=None, task="ppl", length=2048, sample=sample,
                            ppl=20.0, dense_ppl=19.0, top1_agreement=1.0 if label == "dense" else agree,
                            kl=0.0 if label == "dense" else 1 - agree, score=agree))
    return out, scores


def test_accuracy_cells_carry_wilson_intervals():
    scipy_stats = pytest.importorskip("scipy.stats")
    records, scores = _records(np.random.default_rng(int(np.random.randint(2**31))))
    agg = aggregate(records)
    for label in ("dense", "sparse", "sparda"):
        k = sum(v for (lab, task, _, _), v in scores.items() if lab == label and task == "passkey")
        ci = scipy_stats.binomtest(int(k), 24).proportion_ci(method="wilson")
        cell = agg["accuracy"][label]["passkey"]
        assert (cell["mean"], cell["n"]) == (pytest.approx(k / 24), 24)
        assert (cell["low"], cell["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
        k = sum(v for (lab, task, n, _), v in scores.items() if lab == label and task == "vt" and n == 1024)
        ci = scipy_stats.binomtest(int(k), 12).proportion_ci(method="wilson")
        cell = agg["by_length"][label]["vt"]["1024"]
        assert (cell["low"], cell["high"]) == pytest.approx((ci.low, ci.high), abs=1e-9)
        total = sum(v for (lab, *_), v in scores.items() if lab == label)
        ci = scipy_stats.binomtest(int(total), 48).proportion_ci(method="wilson")
        assert (agg["mean_accuracy"][label]["low"], agg["mean_accuracy"][label]["high"]) == \
            pytest.approx((ci.low, ci.high), abs=1e-9)  # equal cells: mean of task means = pooled mean
    text = markdown(records, agg)
    cell = agg["accuracy"]["sparse"]["passkey"]
    assert f"{100 * cell['mean']:.0f} [{100 * cell['low']:.0f}, {100 * cell['high']:.0f}]" in text
    assert "Wilson" in text and "| sparda − sparse |" in text and "| sparse − dense |" in text


def test_paired_differences_pair_the_same_prompts():
    records, scores = _records(np.random.default_rng(int(np.random.randint(2**31))))
    agg = aggregate(records)
    rows = {(p["a"], p["b"], p["scope"]): p for p in agg["paired"]}
    assert ("sparda", "sparse", "all") in rows and ("sparda", "dense", "vt") in rows and ("dense", "sparse", "all") not in rows
    keys = sorted({k[1:] for k in scores})
    diffs = [scores[("sparda", *k)] - scores[("sparse", *k)] for k in keys]
    want = bootstrap_mean(diffs, [k[:2] for k in keys], seed=0)
    got = rows[("sparda", "sparse", "all")]
    assert (got["diff"], got["low"], got["high"], got["n"]) == (pytest.approx(want[0]), pytest.approx(want[1]),
                                                                pytest.approx(want[2]), 48)
    sub = [k for k in keys if k[1] == 2048]
    d = paired_difference(records, "sparse", "dense", length=2048)
    assert d["n"] == 24 and d["diff"] == pytest.approx(
        np.mean([scores[("sparse", *k)] - scores[("dense", *k)] for k in sub]))
    # prompts scored by one method only are not paired
    partial = [r for r in records if not (r["label"] == "sparse" and r["task"] == "vt")]
    assert paired_difference(partial, "sparda", "sparse")["n"] == 24
    assert paired_difference(partial, "sparda", "sparse", task="vt") is None


def test_ppl_intervals_and_budget_sweep():
    records, _ = _records(np.random.default_rng(int(np.random.randint(2**31))))
    for budget, topk, agree in ((5, 0, 0.7), (50, 27, 0.97)):
        records.append(dict(label=f"sparse@{budget:g}%", method="sparse", budget_pct=budget, task="ppl",
                            length=4096, sample=0, topk_blocks=topk, budget_blocks=5 + topk, context_blocks=64,
                            ppl=21.0, dense_ppl=19.0, top1_agreement=agree, kl=1 - agree, score=agree))
        records.append(dict(label=f"sparse@{budget:g}%", method="sparse", budget_pct=budget, task="passkey",
                            length=4096, sample=0, topk_blocks=topk, budget_blocks=5 + topk, context_blocks=64,
                            score=1.0))
    agg = aggregate(records)
    m = agg["ppl"]["sparse"]["2048"]
    assert m["top1_agreement"] == pytest.approx(0.925) and m["n"] == 2
    assert m["agreement_low"] >= 0.9 - 1e-12 and m["agreement_high"] <= 0.95 + 1e-12
    sweep = agg["budgets"]["sparse"]["4096"]
    assert sweep["5"]["effective_pct"] == pytest.approx(100 * 5 / 64)  # the init + local floor
    assert sweep["50"]["effective_pct"] == pytest.approx(100 * 32 / 64)
    assert sweep["50"]["top1_agreement"] == pytest.approx(0.97) and sweep["5"]["accuracy"]["n"] == 1
    text = markdown(records, agg)
    assert "| sparse | 4096 | 5 | 7.8 |" in text


def test_prefill_time_is_per_prompt():
    """A batched prefill's time (design §3.8) is divided among the prompts it ran; records
    without ``prefill_batch`` (older runs, one prompt per forward) count whole."""
    rng = np.random.default_rng(int(np.random.randint(2**31)))
    records, _ = _records(rng)
    sparse = [r for r in records if r["label"] == "sparse" and r["task"] != "ppl"]
    want = []
    for r in sparse:
        r["prefill_ms"] = float(rng.uniform(10, 100))
        if rng.random() < 0.5:
            r["prefill_batch"] = int(rng.integers(1, 17))
        want.append(r["prefill_ms"] / r.get("prefill_batch", 1))
    agg = aggregate(records)
    assert agg["efficiency"]["sparse"]["prefill_ms"] == pytest.approx(float(np.mean(want)), rel=1e-12)
    assert agg["efficiency"]["dense"]["prefill_ms"] == pytest.approx(1.0)
    assert "prefill ms / prompt" in markdown(records, agg)
