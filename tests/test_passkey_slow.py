"""Passkey retrieval on the bundled model and real text (slow: run with `pytest -m slow`)."""

import pytest

from sparda import LLM
from sparda.data import heldout_text
from sparda.eval.tasks.passkey import make_passkey, passkey_correct

pytestmark = pytest.mark.slow
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)


def _score(method: str) -> int:
    llm = LLM(None, method=method, device="cpu")
    hay = heldout_text()
    samples = [make_passkey(llm.tokenizer, hay, 7000, depth, seed=100 + i) for i, depth in enumerate(DEPTHS)]
    outs = llm.generate([s.prompt for s in samples], max_new_tokens=24)
    return sum(passkey_correct(s, o.text) for s, o in zip(samples, outs))


def test_sparse_answers_as_many_passkeys_as_dense():
    dense = _score("dense")
    assert dense >= 4
    assert _score("sparse") >= dense


def test_demo_defaults_answer():
    """U5: `sparda demo` with its defaults (sparda, dense prefill on the `small` preset)
    answered "11" and exited 0. About 90 s on a 2-core CPU."""
    from click.testing import CliRunner

    from sparda.cli import main

    result = CliRunner().invoke(main, ["demo", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "expected: 60494 (correct)" in result.output, result.output
    assert "method: sparda | prefill: dense | decode: sparda" in result.output
