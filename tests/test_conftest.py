"""The seed fixture (tests/conftest.py) records each test's seed and prints it on failure (C10)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PROBE = '''
import torch

def test_fails(fresh_seed):
    assert torch.initial_seed() == fresh_seed
    assert False, "on purpose"

def test_passes(fresh_seed):
    assert torch.initial_seed() == fresh_seed
'''


def _pytest(tmp_path: Path, seed: str) -> str:
    env = dict(os.environ, SPARDA_TEST_SEED=seed)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_probe.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr  # one test failed, on purpose
    return run.stdout


def test_failed_test_prints_its_seed_and_replays_it(tmp_path, fresh_seed):
    """One run under ``SPARDA_TEST_SEED``: both probe tests are seeded with it, and only the
    failed one prints it with its replay command."""
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE)
    seed = str(fresh_seed + 1)
    out = _pytest(tmp_path, seed)
    found = re.findall(r"seed=(\d+)\s+\(replay: SPARDA_TEST_SEED=(\d+) python3 -m pytest '([^']+)'\)", out)
    assert found == [(seed, seed, "test_probe.py::test_fails")], out
    assert "1 failed, 1 passed" in out
