#!/bin/bash
# One device call of the 2026-12-05 GPU session (see docs/results/accuracy/records/eval-gpu-2026-12-04/README.md).
# usage (repository root): COMMIT=sha bash docs/results/accuracy/records/eval-gpu-2026-12-04/gpu-calls-2026-12-05.sh MODE BUDGET_S
#   MODE first: join the GGUF, check h2o's kernel, eval; next: eval (resumes /tmp/ev), then the batched-prefill check
set -u
T0=$(date +%s)
MODE=$1; BUDGET=$2
G=/tmp/stage/SmolLM2-135M-Instruct.Q4_1.gguf
if [ "$MODE" = first ]; then
  cat /tmp/stage/part.aa .stage2/part.ab > $G
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c - || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 4
fi
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
PLANS=main,ppl,baselines
if [ "$MODE" = first ]; then
  timeout 120 python3 benchmarks/bench_prefill.py h2o --out $OUT/h2o_prefill.json > $OUT/h2o_prefill.log 2>&1
  RC=$?; tail -25 $OUT/h2o_prefill.log; echo "h2o check rc=$RC"
  [ $RC -ne 0 ] && PLANS=main,ppl && touch /tmp/ev_h2o_failed
fi
[ -f /tmp/ev_h2o_failed ] && PLANS=main,ppl
if [ ! -d /tmp/ev ] && [ -f runs/ev.tgz ]; then tar -xzf runs/ev.tgz -C /tmp; fi
LEFT=$((BUDGET - ($(date +%s) - T0)))
echo "eval plans=$PLANS budget=$LEFT s"
timeout $((LEFT + 45)) python3 benchmarks/bench_eval.py run /tmp/ev --model $G --plans $PLANS --workers 2 \
   --time-budget-s $LEFT --commit ${COMMIT:?set COMMIT to the short sha of the tree} > $OUT/eval-$MODE.log 2>&1
echo "eval rc=$? after $(( $(date +%s) - T0 )) s"; tail -30 $OUT/eval-$MODE.log
tar -czf $OUT/ev.tgz -C /tmp ev
if [ "$MODE" = next ] && [ $(( $(date +%s) - T0 )) -lt 330 ]; then
  timeout $((585 - ($(date +%s) - T0))) python3 benchmarks/bench_prefill.py batch --model $G --new-tokens 16 --out $OUT/prefill-batch > $OUT/prefill-batch.log 2>&1
  echo "prefill check rc=$?"; tail -30 $OUT/prefill-batch.log
fi
echo "call total $(( $(date +%s) - T0 )) s"
