#!/usr/bin/env bash
# Set up, then run the test suite (slow tests excluded; `pytest -m slow` runs them).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
python3 -m pytest -q "$@"
