#!/usr/bin/env bash
# The bundled passkey demo through the CLI on a GPU: `sparda` with its CUDA defaults
# (KV cache offloaded to pinned host memory, uva transfer engine, lookahead prefetch),
# then `sparda generate --method sparda --offload` on the same prompt, with JSON stats.
#
# Usage: bash benchmarks/passkey_gpu.sh MODEL OUT_DIR [extra sparda options, e.g. --device cpu]
# (MODEL: the bundled GGUF file or any model path sparda accepts; outputs are written under OUT_DIR.)
set -uo pipefail
MODEL=${1:?usage: passkey_gpu.sh MODEL.gguf OUT_DIR}
OUT=${2:?usage: passkey_gpu.sh MODEL.gguf OUT_DIR}
shift 2
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
SPARDA="python3 -m sparda.cli"
{ date -u +%FT%TZ; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; } | tee "$OUT/device.txt"

echo "== sparda demo (defaults: sparda, offload on CUDA), dense prefill"
/usr/bin/time -f "%e s wall" $SPARDA demo --model "$MODEL" --dense-prefill "$@" 2>&1 | tee "$OUT/demo-sparda.txt"

python3 - "$MODEL" "$OUT/prompt.txt" <<'PY'
import sys
from sparda.data import heldout_text
from sparda.eval.tasks.passkey import make_passkey
from sparda.model.loader import load_tokenizer, resolve_model_dir
sample = make_passkey(load_tokenizer(resolve_model_dir(sys.argv[1])), heldout_text(), 7000, 0.5, 0)
open(sys.argv[2], "w").write(sample.prompt)
print("expected pass key:", sample.answer)
PY

echo "== sparda generate --method sparda --offload (same prompt), dense prefill"
/usr/bin/time -f "%e s wall" $SPARDA generate --model "$MODEL" --method sparda --offload --dense-prefill \
  -f "$OUT/prompt.txt" --max-new-tokens 24 --json "$@" 2>&1 | tee "$OUT/generate-sparda-offload.txt"
