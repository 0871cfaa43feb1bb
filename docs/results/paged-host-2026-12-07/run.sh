#!/usr/bin/env bash
# The paged host store on the GPU, in one call (issue "serving at GPU scale", Deliver 1):
#  * the compiled CUDA checks: tests/kernels/test_paged_transfer.py (uva gather/store through the
#    block table, page read/write kernels), the adaptive-budget CUDA test, and
#    benchmarks/check_paged_host.py (scattered pages against the identity table, bit for bit);
#  * `sparda bench`, offloaded sparda, MiniCPM-8B shape, 128K, B4 and B16, shipped trace replay,
#    128K prefill: the commit before the paged store (OLD_SRC) against this one, old, new, old, new.
# Usage (repository root on the device): bash docs/results/paged-host-2026-12-07/run.sh OLD_SRC
set -uo pipefail
OLD=${1:?old src}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/device.txt"
TRITON_INTERPRET=0 PYTHONPATH=src timeout 200 python3 -m pytest -q -p no:cacheprovider -x \
  tests/kernels/test_paged_transfer.py "tests/kernels/test_selection_adaptive.py::test_cuda_bf16_selection_and_graph_replay" \
  > "$OUT/cuda-tests.log" 2>&1; echo "cuda tests: rc $?"; tail -3 "$OUT/cuda-tests.log"
PYTHONPATH=src timeout 150 python3 benchmarks/check_paged_host.py > "$OUT/check-paged.log" 2>&1
echo "check_paged_host: rc $?"; tail -14 "$OUT/check-paged.log"
for rep in 1 2; do
  for v in old new; do
    src=$([ $v = old ] && echo "$OLD" || echo src)
    if [ $SECONDS -gt ${DEADLINE_S:-420} ]; then echo "bench $v $rep: skipped at ${SECONDS}s"; continue; fi
    PYTHONPATH=$src timeout 170 python3 -m sparda.cli bench --models minicpm-8b --contexts 131072 \
      --batches 4,16 --methods sparda --decode-steps 12 --repeats 3 --prefill-tokens 131072 \
      --out "$OUT/bench-$v-$rep" > "$OUT/bench-$v-$rep.log" 2>&1
    echo "bench $v $rep: rc $? at ${SECONDS}s"; grep -E "tok/s" "$OUT/bench-$v-$rep.log" | tail -3
  done
done
