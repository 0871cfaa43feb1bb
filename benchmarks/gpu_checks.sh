#!/usr/bin/env bash
# GPU checks of the CUDA paths that the CPU tests run only as twins or under the Triton
# interpreter, and an old-vs-new timing of the default decode step; one part per device call
# (each under 600 s). Records and logs go to $OUT/PART/.
# Usage (repository root on the device):
#   bash benchmarks/gpu_checks.sh kernels        # paged host store + grow (bf16 CUDA path), decode
#                                                # buckets (parity, timing), mixed's fused hot-pool slot diff,
#                                                # the engine's step timer (CUDA events), the quantiser's
#                                                # CUDA step (pytest)
#   bash benchmarks/gpu_checks.sh speed OLD_SRC  # `sparda bench` B16 128K offloaded sparda (bf16, mixed):
#                                                # OLD_SRC (the src/ of an earlier commit) then this tree
#   bash benchmarks/gpu_checks.sh lookahead      # lookahead 1 vs 2 at hit 0.7 and the trace (design §6.2;
#                                                # the trace point replays the recorded predictions)
#   bash benchmarks/gpu_checks.sh new OLD_SRC    # kernels without paged-host, then speed, in one call:
#                                                # a speed point that would start past DEADLINE_S (450) is skipped
# OLD_SRC: e.g. `git archive COMMIT src | tar -x -C .stage-old` here, carried as .stage-old (ignored).
set -uo pipefail
PART=${1:?part}; OUT=${OUT:-/tmp/out}/$PART; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 SPARDA_COMMIT=${SPARDA_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
run() {  # NAME LIMIT_S CMD...: the command's output to NAME.log, its last lines and exit status shown
  local name=$1 limit=$2; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  echo "== $name rc $rc"; tail -n 6 "$OUT/$name.log"
}
bench() {  # SRC NAME KV_DTYPE: one B16 point at 128K, trace replay (the bench's default)
  if [ $SECONDS -gt "${DEADLINE_S:-100000}" ]; then echo "== $2 skipped at ${SECONDS}s"; return; fi
  run "$2" 140 env PYTHONPATH="$1" python3 -m sparda.cli bench --models minicpm-8b --methods sparda \
    --contexts 131072 --batches 16 --kv-dtype "$3" --decode-steps 12 --repeats 3 --prefill-tokens 8192 \
    --out "$OUT/$2"
}
case $PART in
  kernels|new)
    [ "$PART" = kernels ] && run paged-host 200 env PYTHONPATH=src python3 benchmarks/check_paged_host.py
    run buckets 200 env PYTHONPATH=src python3 benchmarks/check_buckets.py --quick --out "$OUT/buckets"
    [ -f benchmarks/check_mixed.py ] && run mixed 180 env PYTHONPATH=src python3 benchmarks/check_mixed.py \
      --out "$OUT/mixed"
    run step-timer 90 env PYTHONPATH=src python3 benchmarks/check_step_timer.py --out "$OUT/step-timer"
    run quant-step 60 env PYTHONPATH=src python3 -m pytest -q -p no:cacheprovider tests/test_kv_quant.py \
      -k correctly_rounded  # the quantiser's step on CUDA, correctly rounded like the kernels' div_rn
    if [ "$PART" = new ]; then
      OLD=${2:?the src/ folder of the earlier commit}; DEADLINE_S=${DEADLINE_S:-450}
      bench "$OLD" old-bf16 bf16; bench src new-bf16 bf16
      bench "$OLD" old-mixed mixed; bench src new-mixed mixed
    fi ;;
  speed)
    OLD=${2:?the src/ folder of the earlier commit}
    bench "$OLD" old-bf16 bf16; bench src new-bf16 bf16
    bench "$OLD" old-mixed mixed; bench src new-mixed mixed ;;
  lookahead)
    run lookahead 560 env PYTHONPATH=src python3 -m sparda.cli bench --models minicpm-8b --methods sparda \
      --contexts 131072 --batches 16 --lookahead 1,2 --hit-rate 0.7 --decode-steps 12 --repeats 3 \
      --prefill-tokens 8192 --time-budget-s 500 --out "$OUT/lookahead" ;;
  *) echo "unknown part $PART (kernels | new OLD_SRC | speed OLD_SRC | lookahead)"; exit 2 ;;
esac
