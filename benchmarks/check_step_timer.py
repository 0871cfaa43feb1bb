"""GPU check of the engine's step timer (``engine/step_timer.py``, design §3.9): on CUDA its
prefill and decode seconds come from event pairs read once the device has passed them, with no
host synchronisation; the CPU tests run that path only with stand-in events.

A server-like engine (chunked prefill) over a random 4-layer Llama (``bench.harness.random_llama``,
bf16), offloaded ``sparda`` and on-GPU ``sparse``, serves requests that join while others decode;
around each ``engine.step()`` the host times the step with a device synchronisation of its own
(the reference, outside the engine). Checks, per method:

* ``decode_steps_total`` equals the steps that decoded, ``decode_rows_total`` the tokens after
  each request's first, ``prefill_tokens_run_total`` the prompt tokens;
* prefill + decode seconds lie within the synchronised wall time of the steps and cover at
  least half of it (the rest: scheduling, sampling outside the two parts);
* ``/metrics``-style reads between steps never block: ``metrics()`` returns in < 50 ms while a
  step's work may still run.

Prints one line per method and a markdown table last, writes ``OUT/check_step_timer.json``;
exits 1 if a check fails. About a minute on an H100::

    python3 benchmarks/check_step_timer.py --out /tmp/step-timer
    python3 benchmarks/check_step_timer.py --device cpu --out /tmp/st      # the script's own smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench.harness import NoText, device_line, git_commit, random_llama  # noqa: E402
from sparda.bench.models import random_forecast  # noqa: E402
from sparda.engine.engine import Engine  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.engine.sampling_params import SamplingParams  # noqa: E402

METHODS = [("sparda", {"offload": True}), ("sparse", {})]
SMALL = dict(init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=256)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def check(method: str, options: dict, device: str, seed: int) -> dict:
    """One method's run and checks (module docstring)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = random_llama(dtype, device)
    forecast = random_forecast(model) if method == "sparda" else None
    llm = LLM.from_model(model, NoText(), method=method, preset="small", forecast=forecast,
                         prefill_chunk_tokens=256, **SMALL, **(options if device == "cuda" else {}))
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, 2000, (int(n),), generator=gen).tolist()
               for n in torch.randint(300, 1500, (6,), generator=gen)]
    max_tokens = torch.randint(8, 40, (6,), generator=gen).tolist()
    engine = Engine(llm, max_batch=4, max_model_len=1600, max_prefill_tokens=260)
    pending, wall, reads, step = list(zip(prompts, max_tokens)), 0.0, [], 0
    while pending or engine.has_work():
        if pending and step % 3 == 0:
            ids, m = pending.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True))
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        wall += time.perf_counter() - start
        t = time.perf_counter()
        engine.metrics()
        reads.append(time.perf_counter() - t)
        step += 1
    sync(device)
    m = engine.metrics()
    busy = m["prefill_seconds_total"] + m["decode_seconds_total"]
    want_rows = sum(n - 1 for n in max_tokens)
    checks = {
        "prefill_tokens": m["prefill_tokens_run_total"] == sum(map(len, prompts)),
        "decode_rows": m["decode_rows_total"] == want_rows,
        "decode_steps": m["decode_steps_total"] == sum(m["decode_steps_by_bucket"].values()),
        "busy_within_wall": 0.5 * wall <= busy <= wall * 1.01,
        "metrics_reads_fast": max(reads) < 0.05,
    }
    return {"method": method, "options": options, "steps": step, "wall_s": round(wall, 4),
            "prefill_s": round(m["prefill_seconds_total"], 4), "decode_s": round(m["decode_seconds_total"], 4),
            "busy_over_wall": round(busy / wall, 4), "decode_steps": m["decode_steps_total"],
            "decode_rows": m["decode_rows_total"], "want_decode_rows": want_rows,
            "prefill_tokens": m["prefill_tokens_run_total"], "max_metrics_read_ms": round(max(reads) * 1e3, 2),
            "checks": checks, "ok": all(checks.values())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_step_timer: no CUDA device; pass --device cpu for the smoke run", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for method, options in METHODS:
        result = check(method, options, args.device, args.seed)
        print(json.dumps(result), flush=True)
        results.append(result)
    record = {"device": device_line(), "date": datetime.date.today().isoformat(),
              "commit": git_commit(), "results": results}
    (args.out / "check_step_timer.json").write_text(json.dumps(record, indent=1))
    print(f"\n{record['device']}, commit {record['commit']}\n")
    print("| method | steps | wall s (synced) | prefill s | decode s | busy / wall | decode rows (want) | "
          "slowest metrics() ms | ok |")
    print("|---|---:|---:|---:|---:|---:|---|---:|---|")
    for r in results:
        print(f"| {r['method']} | {r['steps']} | {r['wall_s']} | {r['prefill_s']} | {r['decode_s']} | "
              f"{r['busy_over_wall']} | {r['decode_rows']} ({r['want_decode_rows']}) | {r['max_metrics_read_ms']} | "
              f"{'yes' if r['ok'] else 'NO: ' + ', '.join(k for k, v in r['checks'].items() if not v)} |")
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
