"""The seed fixture (tests/conftest.py) records each test's seed and prints it on failure (C10),
and shared fixtures draw from the session seed, so the printed command replays them too."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
import pytest
import torch

@pytest.fixture(scope="module")
def shared():
    return float(torch.rand(()))

def test_passes(fresh_seed):  # runs first and moves the random state before ``shared`` is built
    assert torch.initial_seed() == fresh_seed
    torch.rand(7)

def test_fails(fresh_seed, shared):
    assert torch.initial_seed() == fresh_seed
    assert False, f"on purpose: shared {shared!r} own {float(torch.rand(()))!r}"
'''


def _pytest(tmp_path: Path, seed: str, session: str, *args) -> str:
    env = dict(os.environ, SPARDA_TEST_SEED=seed, SPARDA_SESSION_SEED=session)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rN", "-p", "no:cacheprovider", "test_probe.py", *args],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed, on purpose
    return run.stdout


def test_failed_test_prints_its_seed_and_replays_it(tmp_path, fresh_seed):
    """One run under ``SPARDA_TEST_SEED`` and ``SPARDA_SESSION_SEED``: both probe tests are
    seeded with the first, only the failed one prints both with its replay command, and the
    replay of that test alone draws the same module fixture and the same values (while
    another session seed draws another fixture)."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    seed, session = str(fresh_seed + 1), str((fresh_seed * 7 + 3) % 2**31)
    out = _pytest(tmp_path, seed, session)
    found = re.findall(r"seed=(\d+) session seed=(\d+)\s+\(replay: SPARDA_SESSION_SEED=(\d+) SPARDA_TEST_SEED=(\d+) "
                       r"python3 -m pytest '([^']+)'\)", out)
    assert found == [(seed, session, session, seed, "test_probe.py::test_fails")], out
    assert "1 failed, 1 passed" in out
    values = r"on purpose: shared ([0-9.e-]+) own ([0-9.e-]+)"  # the message, not the source line
    drawn = re.findall(values, out)
    alone = re.findall(values, _pytest(tmp_path, seed, session, "-k", "test_fails"))
    assert len(drawn) == 1 and alone == drawn, (drawn, alone)
    other = re.findall(values, _pytest(tmp_path, seed, str(int(session) + 1)))
    assert len(other) == 1 and other[0][0] != drawn[0][0] and other[0][1] == drawn[0][1], (other, drawn)
