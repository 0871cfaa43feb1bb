"""benchmarks/serve_host_overhead.py: the server with a GIL-free fake device step (docs/bench.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serve_host_overhead  # noqa: E402

pytest.importorskip("openai")
pytest.importorskip("uvicorn")


def test_every_stream_gets_its_tokens_no_faster_than_the_device_step():
    """Four streams of 40 tokens over a 20 ms step: each client gets all 40 tokens, the server
    decodes them in full-batch steps, and never faster than the device step allows (4 / 20 ms);
    the host gap between steps is positive and shorter than a second."""
    rec = serve_host_overhead.measure(step_ms=20.0, streams=4, max_tokens=40, timeout_s=120)
    assert rec["tokens"] == [40] * 4, rec
    assert rec["ideal_tok_s"] == 200.0 and 0.0 < rec["tok_s"] <= 200.0 * 1.05, rec
    assert rec["full_steps"] >= 30 and 0.0 < rec["host_gap_ms"] < 1000.0, rec


def test_bad_options_exit_2(capsys):
    assert serve_host_overhead.main(["--streams", "0"]) == 2
    assert "--streams" in capsys.readouterr().err
