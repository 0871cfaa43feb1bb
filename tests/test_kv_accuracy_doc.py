"""docs/results/accuracy.md's KV-cache dtype section (issue #14) from ``OUT/kv-<dtype>`` records:
the criterion (sparda's int8 decode KL over its bf16 KL, ratio of means on the same
windows), passkey cells with Wilson intervals, and "not run" without the directories."""

from __future__ import annotations

import json
import random

import pytest

from sparda.eval.accuracy_doc import kv_section


def _write(out, kv, records):
    path = out / f"kv-{kv}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _passkey(label, length, sample, score):
    return dict(key=f"{label}|passkey|{length}|{sample}", label=label, method=label, budget_pct=None,
                task="passkey", length=length, sample=sample, depth=0.5, score=score)


def _decode(label, length, sample, kl, top1=0.9):
    return dict(key=f"{label}|ppl-decode|{length}|{sample}", label=label, method=label, budget_pct=None,
                task="ppl-decode", length=length, sample=sample, depth=None, kl=kl, top1_agreement=top1,
                score=top1, ppl=20.0 + kl, dense_ppl=20.0, positions=512)


@pytest.mark.parametrize("factor", [1.05, 1.35])
def test_kv_section_criterion_is_the_ratio_of_mean_kl_on_shared_windows(tmp_path, factor):
    rng = random.Random(random.randrange(2**31))
    windows, lengths = 16, (4096, 7680)
    base = {(n, i): rng.uniform(0.001, 0.1) for n in lengths for i in range(windows)}
    for kv, scale in (("bf16", 1.0), ("int8", factor), ("int4", 3.0)):
        records = [_passkey(m, 7680, i, float(i < 18)) for m in ("dense", "sparda") for i in range(30)]
        records += [_decode("sparda", n, i, base[n, i] * scale * rng.uniform(0.5, 1.5)) for n, i in base]
        records += [_decode("dense", n, i, 1e-4 * scale) for n, i in base]
        _write(tmp_path, kv, records)
    text = "\n".join(kv_section(tmp_path))
    int8 = {(r["length"], r["sample"]): r["kl"] for r in map(json.loads, (tmp_path / "kv-int8" / "results.jsonl")
                                                               .read_text().splitlines()) if r["label"] == "sparda"
            and r["task"] == "ppl-decode"}
    bf16 = {(r["length"], r["sample"]): r["kl"] for r in map(json.loads, (tmp_path / "kv-bf16" / "results.jsonl")
                                                               .read_text().splitlines()) if r["label"] == "sparda"
            and r["task"] == "ppl-decode"}
    for n in lengths:
        ratio = sum(int8[n, i] for i in range(windows)) / sum(bf16[n, i] for i in range(windows))
        row = next(line for line in text.splitlines() if line.startswith(f"| `sparda` int8 decode KL") and f"@{n} " in line)
        assert f"int8 / bf16 = {ratio:.3f} [" in row and "(n=16 windows)" in row
        assert row.endswith("| yes |" if ratio <= 1.2 else "| **no** |")
    assert "| dense | 60.0 [42.3, 75.4] (n=30) | 60.0 [42.3, 75.4] (n=30) | 60.0 [42.3, 75.4] (n=30) |" in text
    assert "| sparda | bf16 | 4096 |" in text and "1 (reference)" in text and "| dense | int4 | 7680 |" in text
    assert "not run" not in text


def test_kv_section_says_not_run_without_the_directories(tmp_path):
    text = "\n".join(kv_section(tmp_path))
    assert "| `sparda` int8 decode KL to dense within 1.2x of bf16's | not run | – |" in text
    assert "Not run" in text and "###" not in text
    _write(tmp_path, "bf16", [_decode("sparda", 4096, 0, 0.01)])  # int8 missing: no ratio to take
    text = "\n".join(kv_section(tmp_path))
    assert "no sparda `ppl-decode` windows under both bf16 and int8 | – |" in text
    assert "| sparda | bf16 | 4096 |" in text
