"""Load test of ``sparda serve`` on loopback: latency, TTFT and throughput vs concurrency.

Run from the repository root (CPU is fine; the bundled model by default)::

    python3 benchmarks/bench_serve.py [--requests 64] [--concurrency 1,2,4,8] [-- SERVE OPTIONS]

For each point it starts ``sparda serve`` as a subprocess on 127.0.0.1 (a free port),
sends the same ``--requests`` streamed completions (prompts cut from held-out *Emma*,
``--prompt-tokens`` long, ``--max-tokens`` new tokens each, greedy, EOS ignored so every
request generates exactly ``--max-tokens``) through the ``openai`` client with at most
``--concurrency`` in flight, then stops the server with SIGINT. Points:

* ``one-at-a-time``: ``--max-batch 1`` and concurrency 1 (no batching at all);
* ``continuous``: ``--max-batch`` = concurrency, for each ``--concurrency`` value.

``python3 benchmarks/bench_serve.py stall OUT [--prompt-tokens 65536]`` (CUDA) measures instead
how long running streams wait while long prompts are admitted (:func:`stall`);
``python3 benchmarks/bench_serve.py load OUT`` runs the serving sweep (Poisson and closed-loop
load over a random-weight 8B shape, one server per method; ``load --help``, serve_load.py), and
``python3 benchmarks/bench_serve.py agree OUT`` compares greedy tokens under load with each
request alone (``agree --help``).

Per point: requests completed and lost, wall time, requests/s, generated tokens/s,
p50/p99 latency and time to first token (ms). The last line is the tokens/s ratio of the
largest concurrency to one-at-a-time. Prints a Markdown table and a JSON line (each
point's JSON also goes to stderr as it finishes). Options after ``--`` go to ``sparda
serve`` (e.g. ``-- --method dense``); the server runs this checkout's ``src/``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve_load  # noqa: E402 - beside this file: the sweep, agreement, and the helpers shared here
from serve_load import measured_commit, percentile  # noqa: E402


def make_prompts(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """``count`` token-id windows of held-out Emma, lengths drawn uniformly in [lo, hi]."""
    from transformers import AutoTokenizer

    from sparda.data import heldout_text
    from sparda.model.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    ids = tokenizer.encode(heldout_text(), add_special_tokens=False)
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(ids) - n)
        out.append(ids[start:start + n])
    return out


def start_server(args, max_batch: int):
    """``sparda serve`` on a free loopback port; returns (process, base url)."""
    from sparda.bench.harness import sparda_cli

    cli, env = sparda_cli()
    cmd = [*cli, "serve", "--port", "0", "--max-batch", str(max_batch),
           "--max-model-len", str(args.max_model_len), "--device", "cpu", *args.serve_args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    for line in proc.stderr:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", line)
        if found:
            threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
            return proc, found.group(1)
    raise SystemExit(f"sparda serve exited with {proc.wait()}")


def run_point(args, prompts, max_batch: int, concurrency: int, label: str) -> dict:
    """Send every prompt with ``concurrency`` in flight; the point's figures."""
    import openai

    proc, url = start_server(args, max_batch)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        name = client.models.list().data[0].id

        def one(ids):
            start = time.perf_counter()
            first, tokens, finish = None, 0, None
            for chunk in client.completions.create(model=name, prompt=ids, max_tokens=args.max_tokens,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and first is None:
                    first = time.perf_counter()
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
            end = time.perf_counter()
            return {"latency_ms": (end - start) * 1e3, "ttft_ms": ((first or end) - start) * 1e3,
                    "tokens": tokens, "ok": finish == "length" and tokens == args.max_tokens}

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, prompts))
        wall = time.perf_counter() - start
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    ok = [r for r in results if r["ok"]]
    latency = [r["latency_ms"] for r in ok]
    ttft = [r["ttft_ms"] for r in ok]
    return {"point": label, "max_batch": max_batch, "concurrency": concurrency, "requests": len(prompts),
            "completed": len(ok), "lost": len(prompts) - len(ok), "wall_s": round(wall, 2),
            "requests_per_s": round(len(ok) / wall, 3),
            "tokens_per_s": round(sum(r["tokens"] for r in ok) / wall, 2),
            "latency_p50_ms": round(statistics.median(latency), 1) if ok else None,
            "latency_p99_ms": round(percentile(latency, 0.99), 1) if ok else None,
            "ttft_p50_ms": round(statistics.median(ttft), 1) if ok else None,
            "ttft_p99_ms": round(percentile(ttft, 0.99), 1) if ok else None}


def stall(argv: list[str]) -> None:
    """Chunked prefill across steps (design §3.9) against whole-prompt admission, in the
    server's engine (in process, no HTTP): a random-weight 8B shape, offloaded ``sparda``
    (paper preset, random Forecast); ``--streams`` requests of 8K tokens decode, then
    ``--long`` prompts of ``--prompt-tokens`` arrive at once. Per configuration: the
    running streams' step time (TPOT) before the arrival (p50) and while the long prompts
    are prefilled (p50, p99, max, steps), the long prompts' TTFT, and whether their
    greedy tokens equal those of the first configuration with the same chunks (``None`` for
    that first one: nothing to compare with). Writes
    ``OUT/serve_stall.json``; prints a Markdown table last. The first configuration runs
    twice; its first run (kernel compilation, page-locking) is not recorded."""
    import datetime

    import torch

    from sparda import LLM
    from sparda.bench.harness import NoText
    from sparda.bench.models import build_model, random_forecast
    from sparda.engine.engine import Engine
    from sparda.engine.sampling_params import SamplingParams

    parser = argparse.ArgumentParser(prog="bench_serve.py stall", description=stall.__doc__)
    parser.add_argument("out", type=Path)
    parser.add_argument("--model", default="minicpm-8b", help="bench model shape [minicpm-8b]")
    parser.add_argument("--prompt-tokens", type=int, default=65536, help="long prompt length [65536]")
    parser.add_argument("--long", type=int, default=2, help="long prompts arriving [2]")
    parser.add_argument("--streams", type=int, default=4, help="running 8K streams [4]")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run [cuda]")
    parser.add_argument("--method", default="sparda", help="sparda (offloaded) or another method [sparda]")
    parser.add_argument("--stream-tokens", type=int, default=8192, help="running streams' prompt length [8192]")
    parser.add_argument("--configs", default="whole:8192:16384,chunk:8192:8192,chunk:2048:2048",
                        help="mode:prefill_chunk:max_num_batched_tokens,... [%(default)s]")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = args.device == "cuda"
    model = build_model(args.model, args.device, torch.bfloat16 if cuda else torch.float32, max_positions=131072)
    extra = {"forecast": random_forecast(model), "offload": cuda} if args.method == "sparda" else {}
    base = LLM.from_model(model, NoText(), method=args.method, preset="paper", **extra)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rng = random.Random(0)
    short = [[rng.randrange(10, min(60000, model.config.vocab_size)) for _ in range(args.stream_tokens)] for _ in range(args.streams)]
    long = [[rng.randrange(10, min(60000, model.config.vocab_size)) for _ in range(args.prompt_tokens)] for _ in range(args.long)]
    records, first_tokens = [], {}
    specs = args.configs.split(",")
    for n, spec in enumerate([specs[0], *specs]):  # the first one twice: a warm-up (compiles, pins), dropped
        mode, chunk, budget = spec.split(":")
        llm = base.derive(prefill_chunk_tokens=int(chunk))
        engine = Engine(llm, max_batch=args.streams + args.long, max_model_len=args.prompt_tokens + 1024,
                        max_prefill_tokens=int(budget), chunked_prefill=mode == "chunk")
        streams = [engine.add_request(ids, SamplingParams(max_tokens=1000, ignore_eos=True)) for ids in short]
        while not all(s.output_ids for s in streams):
            engine.step()
        def timed_step():
            sync()
            t0 = time.perf_counter()
            engine.step()
            sync()
            return (time.perf_counter() - t0) * 1e3
        calm = [timed_step() for _ in range(30)]
        arrive = time.perf_counter()
        longs = [engine.add_request(ids, SamplingParams(max_tokens=16, ignore_eos=True)) for ids in long]
        busy, ttft = [], {}
        while not all(s.output_ids for s in longs):
            busy.append(timed_step())
            for i, s in enumerate(longs):
                if s.output_ids and i not in ttft:
                    ttft[i] = (time.perf_counter() - arrive) * 1e3
        while engine.has_work() and not all(s.status.value == "finished" for s in longs):
            engine.step()
        tokens = [list(s.output_ids) for s in longs]
        same = first_tokens[chunk] == tokens if chunk in first_tokens else None  # None: the first at this chunk
        first_tokens.setdefault(chunk, tokens)
        for s in streams:
            engine.abort(s.request_id)
        while engine.has_work():
            engine.step()
        q = lambda v, p: round(percentile(v, p / 100), 2)  # noqa: E731
        rec = {"mode": mode, "prefill_chunk": int(chunk), "max_num_batched_tokens": int(budget),
               "tpot_calm_p50_ms": q(calm, 50), "tpot_prefill_p50_ms": q(busy, 50), "tpot_prefill_p99_ms": q(busy, 99),
               "tpot_prefill_max_ms": round(max(busy), 2), "prefill_steps": len(busy),
               "ttft_long_ms": [round(ttft[i], 1) for i in sorted(ttft)], "tokens_equal_first_same_chunk": same}
        if n == 0:
            first_tokens.clear()
        else:
            records.append(rec)
        print(json.dumps(rec), file=sys.stderr, flush=True)
        del engine, llm
        if cuda:
            torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name() if cuda else "cpu", "date": datetime.date.today().isoformat(),
            "model": args.model, "method": args.method + (" (offloaded, random Forecast)" if extra.get("offload") else "") + ", paper preset",
            "streams": args.streams, "stream_prompt_tokens": args.stream_tokens, "long": args.long,
            "long_prompt_tokens": args.prompt_tokens,
            "commit": measured_commit()}
    (args.out / "serve_stall.json").write_text(json.dumps({**meta, "records": records}, indent=1))
    print(f"{meta['device']}, {args.model}, {meta['method']}, {args.streams} streams of {args.stream_tokens} decoding, {args.long} prompts of "
          f"{args.prompt_tokens} arrive\n")
    print("| mode | chunk | budget | TPOT calm p50 | TPOT during prefill p50 / p99 / max | steps | TTFT long ms | same tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in records:
        print(f"| {r['mode']} | {r['prefill_chunk']} | {r['max_num_batched_tokens']} | {r['tpot_calm_p50_ms']} | "
              f"{r['tpot_prefill_p50_ms']} / {r['tpot_prefill_p99_ms']} / {r['tpot_prefill_max_ms']} | "
              f"{r['prefill_steps']} | {r['ttft_long_ms']} | {r['tokens_equal_first_same_chunk']} |")


def main() -> None:
    if sys.argv[1:2] == ["stall"]:
        stall(sys.argv[2:])
        return
    if sys.argv[1:2] in (["load"], ["agree"], ["_serve"]):  # serve_load.py: the sweep, its server child, agreement
        {"load": serve_load.main, "agree": serve_load.agree, "_serve": serve_load.serve_child}[sys.argv[1]](sys.argv[2:])
        return
    parser = argparse.ArgumentParser(prog="bench_serve.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64, help="Completions sent per point [64].")
    parser.add_argument("--concurrency", default="8", help="Comma list of in-flight requests (= --max-batch).")
    parser.add_argument("--prompt-tokens", default="64,256", help="min,max prompt length in tokens.")
    parser.add_argument("--max-tokens", type=int, default=32, help="New tokens per request [32].")
    parser.add_argument("--max-model-len", type=int, default=320,
                        help="The server's --max-model-len; at least the longest prompt + --max-tokens [320].")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the prompt windows [0].")
    parser.add_argument("--no-baseline", action="store_true", help="Skip the one-at-a-time point.")
    parser.add_argument("serve_args", nargs="*", help="Extra `sparda serve` options after `--` (e.g. --method dense).")
    args = parser.parse_args()
    lo, hi = (int(v) for v in args.prompt_tokens.split(","))
    if hi + args.max_tokens > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is below the longest prompt {hi} + --max-tokens "
                         f"{args.max_tokens}")
    prompts = make_prompts(args.requests, lo, hi, args.seed)
    points = []
    if not args.no_baseline:
        points.append(run_point(args, prompts, 1, 1, "one-at-a-time"))
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    for c in (int(v) for v in args.concurrency.split(",")):
        points.append(run_point(args, prompts, c, c, "continuous"))
        print(json.dumps(points[-1]), file=sys.stderr, flush=True)
    print(f"{args.requests} requests, prompts {lo}-{hi} tokens, {args.max_tokens} new tokens each, "
          f"--max-model-len {args.max_model_len}, {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d')}\n")
    print("| point | max batch | concurrency | completed / lost | wall s | req/s | tok/s | "
          "latency p50 / p99 ms | TTFT p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in points:
        print(f"| {p['point']} | {p['max_batch']} | {p['concurrency']} | {p['completed']} / {p['lost']} | "
              f"{p['wall_s']} | {p['requests_per_s']} | {p['tokens_per_s']} | {p['latency_p50_ms']} / "
              f"{p['latency_p99_ms']} | {p['ttft_p50_ms']} / {p['ttft_p99_ms']} |")
    summary = {"points": points}
    if not args.no_baseline and len(points) > 1:
        summary["continuous_vs_one_at_a_time_tok_s"] = round(points[-1]["tokens_per_s"] / points[0]["tokens_per_s"], 2)
        print(f"\ncontinuous batching (concurrency {points[-1]['concurrency']}) vs one at a time: "
              f"{summary['continuous_vs_one_at_a_time_tok_s']}x tokens/s")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
