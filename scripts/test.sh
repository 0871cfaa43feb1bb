#!/usr/bin/env bash
# Set up, then run the test suite (slow tests excluded; `pytest -m slow` runs them), one
# pytest-xdist worker per logical CPU (SPARDA_TEST_WORKERS=N to choose; 0 runs in this process).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
python3 -m pytest -q -n "${SPARDA_TEST_WORKERS:-logical}" "$@"
