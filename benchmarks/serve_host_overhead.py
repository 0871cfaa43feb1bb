"""What `sparda serve`'s host side adds to each decode step, without a GPU (docs/bench.md).

The server runs as usual (FastAPI + uvicorn, the engine on its thread, streaming SSE) on the
bundled model, except that the model's decode step is a wait of ``--step-ms`` that releases the
GIL, as the host's wait on a GPU step does, and sampling costs nothing, as a greedy argmax on the
device does. ``--streams`` clients in another process stream ``--max-tokens`` tokens each.
Reported over the window in which every stream runs:

* ``tok_s``: tokens the clients received per second; ``ideal_tok_s = streams / step``;
* ``ratio = tok_s / ideal_tok_s``: the share of a device-bound step's speed the server keeps;
* ``host_gap_ms``: median host time between two full-batch decode steps (the engine's
  bookkeeping, detokenisation and delivery, and waits for the GIL while the event loop streams).

    python benchmarks/serve_host_overhead.py --step-ms 9.3 --streams 16 --out OUT
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


def serve(port: int, step_ms: float, streams: int, gaps_file: str) -> None:
    """The server process: the engine's decode is a GIL-free wait, its sampling free."""
    import threading

    import torch

    import sparda.engine.engine as engine_module
    from sparda import LLM
    from sparda.engine.engine import Engine
    from sparda.server.app import bind_socket
    from sparda.server.app import serve as run_server

    torch.set_num_threads(1)
    llm = LLM(None, method="sparse", device="cpu", cuda_graphs=False)
    engine = Engine(llm, max_batch=streams, max_model_len=2048)
    last, gaps = [], []

    def decode(cache, tokens, positions, max_position=None):
        start = time.perf_counter()
        if last and tokens.shape[0] == streams:
            gaps.append(start - last[-1])
        time.sleep(step_ms / 1e3)
        last.append(time.perf_counter())
        return torch.zeros(tokens.shape[0], 1)

    engine.runner.decode = decode
    engine_module.sample_requests = lambda logits, params, generators: [(1000, None)] * len(params)

    def dump() -> None:
        while True:
            time.sleep(0.5)
            Path(gaps_file).write_text(json.dumps(gaps[-5000:]))

    threading.Thread(target=dump, daemon=True).start()
    run_server(engine, "host-overhead", bind_socket("127.0.0.1", port), log_level="warning")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(step_ms: float, streams: int, max_tokens: int, timeout_s: float = 300.0) -> dict:
    """Start the server process, stream from ``streams`` clients, return the record."""
    import openai

    port = _free_port()
    gaps_file = f"/tmp/sparda-host-overhead-{os.getpid()}-{port}.json"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(step_ms),
                             "--streams", str(streams), "--gaps-file", gaps_file],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=timeout_s)
        deadline = time.perf_counter() + timeout_s
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.perf_counter() > deadline:
                    raise RuntimeError(f"the server did not start: {proc.stderr.read()[-2000:]}")
                time.sleep(0.5)

        def one(i: int) -> list[float]:
            stamps = []
            for chunk in client.completions.create(model="host-overhead", prompt=list(range(100 + i, 164 + i)),
                                                   max_tokens=max_tokens, temperature=0, stream=True,
                                                   extra_body={"ignore_eos": True}):
                if chunk.choices and chunk.choices[0].text is not None:
                    stamps.append(time.perf_counter())
            return stamps

        with cf.ThreadPoolExecutor(streams) as pool:
            got = list(pool.map(one, range(streams)))
        time.sleep(0.6)  # the gaps file is rewritten every 0.5 s
        gaps = json.loads(Path(gaps_file).read_text()) if Path(gaps_file).exists() else []
    finally:
        proc.terminate()
        proc.wait(30)
        Path(gaps_file).unlink(missing_ok=True)
    lo, hi = max(s[0] for s in got), min(s[-1] for s in got)
    tokens = sum(sum(lo <= t <= hi for t in s) for s in got)
    tok_s = tokens / (hi - lo) if hi > lo else 0.0
    ideal = streams / (step_ms / 1e3)
    return {"step_ms": step_ms, "streams": streams, "max_tokens": max_tokens, "tok_s": round(tok_s, 1),
            "ideal_tok_s": round(ideal, 1), "ratio": round(tok_s / ideal, 4),
            "host_gap_ms": round(statistics.median(gaps) * 1e3, 3) if gaps else None,
            "full_steps": len(gaps), "window_s": round(hi - lo, 2), "tokens": [len(s) for s in got]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step-ms", type=float, default=9.3, help="the device step to emulate [9.3: sparda bench B16, "
                    "128K, H100]")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument("--out", default=None, help="directory for results.json")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gaps-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.step_ms, args.streams, args.gaps_file)
        return 0
    if args.step_ms <= 0 or args.streams < 1 or args.max_tokens < 2:
        print("--step-ms must be > 0, --streams >= 1 and --max-tokens >= 2", file=sys.stderr)
        return 2
    rec = {**measure(args.step_ms, args.streams, args.max_tokens), "cpus": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("SPARDA_COMMIT", "unknown")}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps({"records": [rec]}, indent=1) + "\n")
    print("| step ms | streams | tok/s | ideal | ratio | host gap ms |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| {rec['step_ms']} | {rec['streams']} | {rec['tok_s']} | {rec['ideal_tok_s']} | {rec['ratio']} "
          f"| {rec['host_gap_ms']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
