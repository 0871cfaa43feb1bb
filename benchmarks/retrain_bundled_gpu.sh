#!/usr/bin/env bash
# Retrain the bundled model's Forecast on one GPU with the shipped recipe (docs/forecast.md
# "The shipped weights"), once with dense and once with block-sparse frozen attention, the
# two runs side by side on the same GPU (a 135M model leaves it mostly idle), each stopped
# by a wall-clock limit (SIGINT: the trainer checkpoints and exits); then the held-out
# selection recall of the shipped weights and of both retrained ones (`selection-report`).
#
# Usage: bash benchmarks/retrain_bundled_gpu.sh MODEL.gguf OUT_DIR [WALL_S=300]
set -uo pipefail
MODEL=${1:?usage: retrain_bundled_gpu.sh MODEL.gguf OUT_DIR [WALL_S]}
OUT=${2:?usage: retrain_bundled_gpu.sh MODEL.gguf OUT_DIR [WALL_S]}
WALL=${3:-300}
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
SPARDA="python3 -m sparda.cli"
{ date -u +%FT%TZ; python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"; } | tee "$OUT/device.txt"

for fa in dense sparse; do
  timeout -s INT "$WALL" $SPARDA train-forecast --model "$MODEL" --seq-len 8192 --batch-size 2 \
      --steps 3000 --queries 512 --save-every 25 --device cuda --frozen-attention "$fa" \
      --out "$OUT/forecast-$fa.safetensors" > "$OUT/train-$fa.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/train-*.log

for w in shipped dense sparse; do
  opt=(); [ "$w" = shipped ] || opt=(--forecast "$OUT/forecast-$w.safetensors")
  $SPARDA selection-report --model "$MODEL" --methods sparse,sparda --device cuda --json "${opt[@]}" \
      > "$OUT/report-$w.json" 2> "$OUT/report-$w.err" || tail -n 5 "$OUT/report-$w.err"
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for w in ("shipped", "dense", "sparse"):
    try:
        r = json.loads((out / f"report-{w}.json").read_text())
    except Exception as e:  # report failed: say so in the table
        print(f"{w:<8} report failed: {e}")
        continue
    print(w, json.dumps(r.get("sparda", r))[:400])
PY
