#!/usr/bin/env bash
# `sparda serve` under load on one GPU (issue "serving at GPU scale", Deliver 6), one part per
# device call (each call runs at most 600 s). MiniCPM-8B shape, random weights, bundled tokenizer.
# Usage (repository root on the device): bash docs/results/serve-load-2026-12-07/run.sh PART SITE TOK
#   PART: sat | sat-sparda | sat-gpu | so | overhead | mem | diag | chunk; SITE: the wheels installed; TOK: the bundled tokenizer folder
# SITE holds, from wheels (pip install --no-deps --target SITE): fastapi, starlette, pydantic(-core),
# uvicorn, h11, annotated-doc/-types, typing-inspection, opentelemetry-api, prometheus-client, gguf,
# wonderwords, and the load generator's openai client with httpx2, httpcore2, truststore, jiter, distro.
set -uo pipefail
# Records go to a work folder, packed at the end into $OUT/PART.tgz (a device call returns few files).
PART=${1:?part}; SITE=${2:?site}; TOK=${3:?tokenizer folder}; RET=${OUT:-/tmp/out}; OUT=/tmp/serve-$PART
mkdir -p "$OUT" "$RET"; trap 'tar czf "$RET/$PART.tgz" -C "$(dirname "$OUT")" "$(basename "$OUT")"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$SITE:src SPARDA_COMMIT=${SPARDA_COMMIT:-unknown}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt"
free -g > "$OUT/free.txt"
load() { timeout ${LIMIT:-560} python3 benchmarks/bench_serve.py load "$@" --tokenizer "$TOK" --start-timeout 300; echo "load rc $?"; }
case $PART in
  # saturation: closed loop, more clients than rows, the 8K-128K mix
  sat-sparda) load "$OUT/sat-sparda" --configs sparda --rates "" --concurrency 32 --duration 120 --drain 60 ;;
  sat) LIMIT=240 load "$OUT/sat-sparda" --configs sparda --rates "" --concurrency 32 --duration 90 --drain 40
       LIMIT=240 load "$OUT/sat-sparse" --configs sparse --rates "" --concurrency 32 --duration 90 --drain 40 ;;
  sat-gpu) LIMIT=270 load "$OUT/sat-sparse" --configs sparse --rates "" --concurrency 32 --duration 100 --drain 45
           LIMIT=270 load "$OUT/sat-so" --configs sparse-offload --rates "" --concurrency 32 --duration 100 --drain 45 ;;
  so) LIMIT=285 load "$OUT/sat-so" --configs sparse-offload --rates "" --concurrency 32 --duration 100 --drain 45 ;;
  # memory: 8K prompts in a host budget of ~9 rows reserved whole at 128K (--max-model-len 132096)
  mem) LIMIT=200 load "$OUT/mem" --configs sparda --rates "" --concurrency 40 --max-batch 32 --host-memory-gib 36 \
         --max-model-len 132096 --prompt-tokens 8192,8192 --output-tokens 256,1024 --duration 60 --drain 40 ;;
  # engine overhead (issue #42): 16 requests all at 128K on 16 rows, then the bench at B16; both replay the
  # shipped trace (server: --replay-trace, bench: its default trace); the ratio goes into the server's record
  overhead) LIMIT=330 load "$OUT/ovh" --configs sparda --rates "" --concurrency 16 --max-batch 16 \
              --prompt-tokens 131072,131072 --output-tokens 1024,1024 --duration 150 --drain 60 --replay-trace --replay-keys order
            timeout 200 python3 -m sparda.cli bench --models minicpm-8b --contexts 131072 --batches 16 \
              --methods sparda --decode-steps 12 --repeats 3 --prefill-tokens 8192 \
              --out "$OUT/ovh-bench" > "$OUT/ovh-bench.log" 2>&1
            echo "bench rc $?"; grep -E "tok/s" "$OUT/ovh-bench.log" | tail -4
            python3 - "$OUT/ovh/serve_load.json" "$OUT/ovh-bench/results.json" <<'PY'
import json, sys
serve, bench = sys.argv[1:3]
doc = json.load(open(serve))
rec = doc["records"][0]
b = next((r for r in json.load(open(bench)) if r.get("status") == "ok" and r["method"] == "sparda"
          and r["batch"] == 16), {})
# the floor compares equal traffic: hit_rate_peak_10s (the server's window) against the bench's
rec.update(bench_decode_tok_s=b.get("decode_tok_s"), bench_hit_rate=b.get("hit_rate"),
           bench_selection=b.get("selection_source"))
# the server's decode rate: its best 10 s of generation, when all 16 rows decode
rec["decode_vs_bench"] = (round(rec["gen_tok_s_peak_10s"] / b["decode_tok_s"], 4)
                          if b.get("decode_tok_s") else None)
json.dump(doc, open(serve, "w"), indent=1)
print(json.dumps({k: rec.get(k) for k in ("selection", "gen_tok_s_peak_10s", "hit_rate", "hit_rate_peak_10s",
                                         "decode_step_ms_peak_10s", "decode_step_ms",
                                         "bench_decode_tok_s",
                                         "bench_hit_rate", "bench_selection", "decode_vs_bench")}))
PY
            # the host side alone on this machine's CPU (a GIL-free fake device step of bench's TPOT)
            step=$(python3 -c "import json,sys; b=[r for r in json.load(open(sys.argv[1])) if r.get('status')=='ok']; print(b[0]['tpot_ms'] if b else 9.3)" "$OUT/ovh-bench/results.json" 2>/dev/null || echo 9.3)
            timeout 90 python3 benchmarks/serve_host_overhead.py --step-ms "$step" --streams 16 --out "$OUT/host" \
              2>&1 | tail -3
            ;;
  # where the server's time goes (step-time fields), sparda against sparse-offload on the saturation mix:
  # short windows, open requests expected; read prefill_busy_tok_s, decode_step_ms, prefill_share
  diag) for m in sparda sparse-offload; do
          LIMIT=190 load "$OUT/diag-$m" --configs $m --rates "" --concurrency 32 --duration 70 --drain 5
        done
        python3 - "$OUT"/diag-*/serve_load.json <<'PY'
import json, sys
for path in sys.argv[1:]:
    for r in json.load(open(path))["records"]:
        print({k: r.get(k) for k in ("method", "prefill_busy_tok_s", "decode_step_ms", "prefill_share",
                                     "ttft_p50_ms", "output_tok_s", "completed", "peak_running", "hit_rate")})
PY
        ;;
  # chunked prefill (issue #42): Poisson arrivals of the 8K-128K mix at about half the saturation rate
  # (0.255 req/s, first pass), so that prompts keep arriving while earlier requests decode; the floor
  # reads tpot_p99_ms / tpot_p50_ms of the completed requests
  chunk) LIMIT=480 load "$OUT/chunk" --configs sparda --rates 0.12 --concurrency "" --duration 240 --drain 150
         python3 - "$OUT/chunk/serve_load.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["records"]:
    print({k: r.get(k) for k in ("method", "rate", "completed", "lost", "tpot_p50_ms", "tpot_p99_ms", "ttft_p50_ms",
                                 "ttft_p99_ms", "output_tok_s", "decode_step_ms", "prefill_share", "peak_running")})
    if r.get("tpot_p50_ms"):
        print("tpot p99 / p50", round(r["tpot_p99_ms"] / r["tpot_p50_ms"], 3))
PY
         ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
