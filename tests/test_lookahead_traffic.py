"""benchmarks/lookahead_traffic.py: the early copies' traffic counted on the CPU (design §6.2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import lookahead_traffic  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_counts_of_each_prediction(tmp_path, capsys, fresh_seed):
    """Lookahead 1 copies nothing early; a perfect prediction (recall 1) moves about the blocks that
    lookahead 1 copies, only earlier (its evictions spare the last selection, so not exactly those);
    a modelled one at recall 0.5 copies more than both; the recorded one replays the shipped trace."""
    code = lookahead_traffic.main(["--model", "tiny", "--context", "2048", "--batch", "2", "--steps", "14",
                                   "--warmup", "4", "--recalls", "0.5,1", "--out", str(tmp_path), "--seed", str(fresh_seed)])
    assert code == 0
    rows = {(r["selection"], r["predictions"]): r for r in json.loads((tmp_path / "results.json").read_text())["records"]}
    assert len(rows) == 7 and "| trace | lookahead 2 recorded |" in capsys.readouterr().out
    for sel in ("trace", "hit 0.7"):
        one, perfect, half = (rows[(sel, p)] for p in ("lookahead 1", "lookahead 2 modelled 1",
                                                        "lookahead 2 modelled 0.5"))
        assert one["early"] == 0 and one["misses"] > 0 and perfect["early"] > 0
        assert perfect["blocks_copied"] == pytest.approx(one["blocks_copied"], rel=0.15), (sel, one, perfect)
        assert half["blocks_copied"] > max(one["blocks_copied"], perfect["blocks_copied"]), (sel, half)
    assert rows[("trace", "lookahead 2 recorded")]["early"] > 0


@pytest.mark.parametrize("args, message", [(["--recalls", "0.5,2"], "--recalls"),
                                           (["--steps", "4", "--warmup", "4"], "--warmup"),
                                           (["--trace", "/nonexistent/t.npz"], "trace file not found"),
                                           (["--model", "nosuch"], "unknown bench model")])
def test_bad_options_exit_2(args, message, capsys):
    assert lookahead_traffic.main(["--model", "tiny", *args]) == 2
    assert message in capsys.readouterr().err
