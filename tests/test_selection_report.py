"""``sparda selection-report`` (design §8) on a tiny random model."""

from __future__ import annotations

import json

import torch

from sparda.attention.forecast import Forecast, model_identity, save_forecast
from sparda.eval.selection import selection_report


def _setup(make_tiny, tmp_path):
    from sparda.data import bundled_text
    from sparda.model.loader import load_config
    from sparda.model.llama import ModelShape

    model = make_tiny("llama")
    config = load_config(model)
    shape = ModelShape.from_config(config)
    weights = tmp_path / "f.safetensors"
    save_forecast(Forecast.for_shape(shape), weights, model_identity(config, shape), dtype=torch.float32)
    text = tmp_path / "t.txt"
    text.write_text(bundled_text("northangerabbey")[:40000])
    return model, weights, text


def test_report_values(make_tiny, tmp_path):
    from sparda.engine.llm import LLM

    model, weights, text = _setup(make_tiny, tmp_path)
    llm = LLM(str(model), method="dense", device="cpu", dense_len=64, topk_blocks=3, local_blocks=1,
              block_size=32)
    report = selection_report(llm=llm, text=str(text), methods=["sparse", "oracle", "sparda", "sparda-random",
                                                                  "infinigen"],
                              lengths=[300], queries=12, preset="small", forecast=str(weights))
    assert report["sparse"]["mean_recall_vs_sparse"] == 1.0
    assert report["oracle"]["mean_recall_vs_oracle"] == 1.0
    assert abs(report["sparse"]["mean_recall_vs_oracle"] - report["oracle"]["mean_recall_vs_sparse"]) < 0.2
    for name in ("sparda", "sparda-random", "infinigen"):
        rows = report[name]["per_layer"]
        assert len(rows) == 3 and all(0 <= r["recall_vs_sparse"] <= 1 and 0 < r["mass"] <= 1 for r in rows)
    # the oracle's selection covers at least as much true attention mass as sparse's
    assert report["oracle"]["mean_mass"] >= report["sparse"]["mean_mass"] - 1e-6


def test_cli_json(make_tiny, tmp_path):
    from click.testing import CliRunner

    from sparda.cli import main

    model, weights, text = _setup(make_tiny, tmp_path)
    result = CliRunner().invoke(main, ["selection-report", "--model", str(model), "--text", str(text),
                                       "--methods", "sparse,sparda,infinigen", "--lengths", "2200",
                                       "--queries", "4", "--forecast", str(weights), "--device", "cpu",
                                       "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["sparse"]["mean_recall_vs_sparse"] == 1.0
    assert 0 <= data["sparda"]["mean_recall_vs_sparse"] <= 1
    bad = CliRunner().invoke(main, ["selection-report", "--model", str(model), "--methods", "nope",
                                    "--lengths", "2200", "--device", "cpu"])
    assert bad.exit_code == 2 and "unknown selector" in bad.output
