"""Kernel tests run on the CPU through the Triton interpreter.

``TRITON_INTERPRET`` must be set before Triton is first imported, so it is set here,
at collection time. Every test module also calls ``pytest.importorskip("triton")``.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

try:
    import sparda  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "src"))


from sparda.kernels._common import patch_interpreter_for_numpy  # noqa: E402

patch_interpreter_for_numpy()


@pytest.fixture(autouse=True)
def poisoned_empty(monkeypatch):
    """Make ``torch.empty``/``empty_like`` return NaN (floats) or -7777 (ints) so that any
    element a kernel forgets to write shows up in the comparison."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(77 if t.dtype in (torch.uint8, torch.int8) else -7777)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poison(real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    yield


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any() or out.shape != ref.shape:
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


@pytest.fixture
def rel_err():
    """``rel_err(out, ref)``: ``||out - ref|| / ||ref||`` in float64; any NaN gives inf."""
    return _rel_err


@pytest.fixture(scope="module")
def tiny_model(make_tiny):
    """The random tiny Llama (tests/conftest.py ``make_tiny``) as a loaded model, fp32 on the CPU."""
    from sparda.engine.llm import LLM

    return LLM(str(make_tiny("llama")), method="dense", device="cpu").model
