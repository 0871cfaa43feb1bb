"""GPU check of the decode batch buckets (design §3.13): a decode step runs the cache's first
``b`` rows, one CUDA graph per bucket.

1. **parity**: per method (and KV dtype, lookahead 2 too), an engine of 8 rows with the
   automatic buckets (``--cuda-graph-sizes auto``) serves 12 requests that join and finish at
   different times, so the bucket moves up and down; its greedy tokens with replayed CUDA
   graphs must equal the same engine's eager tokens (same buckets, same kernels).
   Informational: how many tokens also equal the default engine's, whose one bucket is all 8
   rows (bf16 GEMMs of other row counts may round differently). Random 4-layer Llama
   (``bench.harness.random_llama``), bf16.
2. **timing**: the replayed decode step of ``b`` rows of a ``B``-row cache against the
   full-batch step, at the MiniCPM-8B shape (random weights, ``bench.models``), offloaded
   ``sparda`` at 128K tokens per row. Every row reads one shared host copy of the context
   (the block table maps every row to the same pages: the step's work is a full cache's,
   its host memory one row's), row 0 filled through the prefill path, the others copied
   from it on the device.

Prints one line per check, a markdown table last, and writes ``OUT/check_buckets.json``;
exits 1 if a parity check fails. Its timing is what design §3.13 weighs against the default
single bucket's bit-identity. About 3-4 minutes on an H100 (``--quick``: under 2)::

    python3 benchmarks/check_buckets.py --out /tmp/buckets             # CUDA
    python3 benchmarks/check_buckets.py --quick --out /tmp/buckets     # 32K, B 8 and 16
    python3 benchmarks/check_buckets.py --device cpu --out /tmp/b      # the script's own smoke run
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench import point as pt  # noqa: E402
from sparda.bench.harness import NoText, device_line, git_commit, random_llama  # noqa: E402
from sparda.bench.models import build_model, random_forecast, selection_config  # noqa: E402
from sparda.engine.engine import Engine  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.engine.sampling_params import SamplingParams  # noqa: E402

#: (method, options) of the parity check
PARITY = [("dense", {}), ("sparse", {}), ("sparse", {"kv_dtype": "int8"}), ("sparda", {"offload": True}),
          ("sparda", {"offload": True, "kv_dtype": "int4"}), ("sparse-offload", {}),
          ("sparse-offload", {"kv_dtype": "mixed"}), ("sparda-no-prefetch", {}),
          ("sparda", {"offload": True, "lookahead": 2}),
          ("sparda", {"offload": True, "kv_dtype": "mixed", "lookahead": 2})]  # mixed's fused bookkeeping, §6.1
QUICK_PARITY = [PARITY[0], PARITY[1], PARITY[3], PARITY[6], PARITY[8]]
#: a small budget (7 blocks of 64): prompts of 500+ tokens leave the dense fallback
SMALL = dict(init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=256)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------ parity
def _serve(llm, prompts, max_tokens, rows: int):
    """Run the requests through an engine of ``rows`` rows, one joining per step: their token
    ids, the bucket of every decode step and the engine's decode runner."""
    engine = Engine(llm, max_batch=rows, max_model_len=max(map(len, prompts)) + max(max_tokens) + 1)
    runner = engine.runner.runner(engine.cache)
    pending, seqs, outputs, buckets = list(zip(prompts, max_tokens)), [], {}, []
    while pending or engine.has_work():
        if pending:
            ids, m = pending.pop(0)
            seqs.append(engine.add_request(ids, SamplingParams(max_tokens=m, ignore_eos=True)))
        steps = sum(runner.bucket_steps.values())
        for delta in engine.step():
            if delta.output is not None:
                outputs[delta.request_id] = delta.output.token_ids
        if sum(runner.bucket_steps.values()) > steps:
            buckets.append(runner.last_bucket)
    return [outputs[s.request_id] for s in seqs], buckets, runner


def parity(method: str, options: dict, model, forecast, device, rows: int = 8, count: int = 12) -> dict:
    """Graph replay against eager steps of the same automatic buckets (must be equal), and
    against the default engine, one bucket of all rows (reported)."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(500, 1000, (count,), generator=gen).tolist()
    prompts = [torch.randint(10, 2000, (n,), generator=gen).tolist() for n in lengths]
    # the first rows decode longest, the later ones come and go: buckets 8 -> 4 -> 2 -> 1
    max_tokens = [48, 40, 32] + torch.randint(3, 16, (count - 3,), generator=gen).tolist()
    if torch.device(device).type != "cuda":  # the CPU smoke run: fewer steps
        max_tokens = [m // 3 + 1 for m in max_tokens]
    kw = dict(SMALL, **options)
    if options.get("lookahead") == 2:
        kw["forecast2"] = random_forecast(model, ahead=2)
    graphed = LLM.from_model(model, NoText(), method=method, forecast=forecast, cuda_graphs=True,
                             cuda_graph_sizes="auto", **kw)
    eager = graphed.derive(cuda_graphs=False)
    full = graphed.derive(cuda_graph_sizes=None)  # the default: every step runs all rows
    start = time.perf_counter()
    got, buckets, runner = _serve(graphed, prompts, max_tokens, rows)
    want, eager_buckets, _ = _serve(eager, prompts, max_tokens, rows)
    ref, _, _ = _serve(full, prompts, max_tokens, rows)
    same = sum(a == b for x, y in zip(got, want) for a, b in zip(x, y))
    full_same = sum(a == b for x, y in zip(got, ref) for a, b in zip(x, y))
    total = sum(map(len, want))
    rec = {"method": method, **options, "tokens": total, "graph_equals_eager": got == want,
           "graph_eager_equal_tokens": same, "full_batch_equal_tokens": full_same,
           "buckets_used": sorted(set(buckets)), "buckets_match": buckets == eager_buckets,
           "graphs_captured": runner.captures, "graph_replays": runner.replays,
           "graph_capture_ms": round(runner.capture_s * 1e3, 1), "wall_s": round(time.perf_counter() - start, 1)}
    ok = rec["graph_equals_eager"] and rec["buckets_match"] and (runner.replays > 0 or not runner.use_graphs)
    rec["ok"] = bool(ok)
    print("parity", json.dumps(rec), flush=True)
    return rec


# ------------------------------------------------------------------------ timing
def _replicate_row0(cache) -> None:
    """Every row's device state := row 0's (compressed keys, rings, K/V, slots, lengths)."""
    for name in ("ck", "ring", "k", "v", "k_full", "v_full", "k_slots", "v_slots"):
        bufs = getattr(cache, name, None)
        if bufs is None:
            continue
        for buf in (bufs.values() if isinstance(bufs, dict) else bufs):
            for t in ((buf.data, buf.scale) if hasattr(buf, "scale") else (buf,)):
                t[1:].copy_(t[:1].expand_as(t[1:]))
    cache.lengths[1:] = cache.lengths[0]


def timing(model_name: str, method: str, context: int, batch: int, sizes, steps: int, device) -> list[dict]:
    """Replayed step time of each bucket of ``sizes`` on one cache of ``batch`` rows."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = build_model(model_name, device, dtype, max_positions=context + 4096)
    sel = selection_config(model_name)
    fields = {f: getattr(sel, f) for f in ("block_size", "kernel_size", "kernel_stride", "init_blocks",
                                           "local_blocks", "topk_blocks", "dense_len")}
    llm = LLM.from_model(model, NoText(), method=method, forecast=random_forecast(model),
                         offload=True if method == "sparda" else None, **fields)
    capacity = context + steps * len(sizes) * 2 + 64
    blocks = -(-capacity // sel.block_size)
    start = time.perf_counter()
    llm.method.reset()
    cache = llm.new_cache(batch, capacity, host_blocks=blocks)
    if cache.offload:
        for row in range(batch):  # one shared host copy of the context
            cache.assign_blocks(row, list(range(blocks)))
    with torch.inference_mode():
        pt.fill_cache(cache, llm.shape, 1, context, llm.device, llm.dtype)
        _replicate_row0(cache)
        pt.prime_method(llm.method, cache, context)
    sync(device)
    fill_s = time.perf_counter() - start
    runner = llm.runner(cache)
    positions = torch.full((batch,), context, dtype=torch.long, device=llm.device)
    tokens = torch.randint(0, llm.model.config.vocab_size, (batch,), device=llm.device)
    out, done = [], [0]  # row 0 runs in every bucket: the longest row is context + done

    for b in sizes:
        def step():
            runner.load(tokens[:b], positions[:b])
            logits = runner.step(context + done[0] + 1, b)
            positions[:b] += 1
            done[0] += 1
            return logits

        for _ in range(3):  # warm-up (eager, Triton compiles), capture, one replay
            step()
        sync(device)
        if cache.offload:
            cache.prefetcher.reset()
        times = []
        for _ in range(steps):
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        rec = {"model": model_name, "method": method, "context": context, "cache_rows": batch, "bucket": b,
               "step_ms": round(statistics.median(times), 3), "step_ms_min": round(min(times), 3),
               "tok_s": round(b / statistics.median(times) * 1e3, 1), "graphed": runner.use_graphs,
               "fill_s": round(fill_s, 1)}
        if cache.offload:
            stats = cache.offload_stats(steps * b)
            rec.update(hit_rate=stats["hit_rate"], bytes_per_token=stats["bytes_per_token"])
        print("timing", json.dumps(rec), flush=True)
        out.append(rec)
    del cache, runner, llm, model
    pt.release_memory(torch.device(device))
    return out


def table(records: list[dict], running=(1, 2, 4, 8, 16)) -> str:
    """Markdown: per running requests, its bucket's step against the full-batch steps."""
    by = {(r["cache_rows"], r["bucket"]): r["step_ms"] for r in records}
    rows = sorted({r["cache_rows"] for r in records})
    fulls = sorted({b for b in {r["bucket"] for r in records} if b in (16, 32)} | {max(rows)})
    head = "| running | bucket step ms | " + " | ".join(f"full B{f} ms | speedup vs B{f}" for f in fulls) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(fulls))]
    cache_rows = max(rows)
    for n in running:
        if (cache_rows, n) not in by:
            continue
        ms = by[(cache_rows, n)]
        cells = []
        for f in fulls:
            full = by.get((cache_rows, f))
            cells += [f"{full:.2f}" if full else "-", f"{full / ms:.2f}x" if full and n <= f else "-"]
        lines.append(f"| {n} | {ms:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (check_buckets.json)")
    ap.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run, tiny model)")
    ap.add_argument("--quick", action="store_true", help="32K context, cache of 16 rows, fewer parity methods")
    ap.add_argument("--context", type=int, default=None, help="tokens per row of the timing [131072; quick 32768]")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per bucket [20; quick 10]")
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print("check_buckets needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    torch.manual_seed(0)
    small = random_llama(torch.bfloat16 if cuda else torch.float32, args.device)
    forecast = random_forecast(small)
    checks = [parity(m, o, small, forecast, args.device, count=12 if cuda else 7)
              for m, o in (PARITY if cuda and not args.quick else QUICK_PARITY)]
    del small, forecast
    if cuda:
        model_name, context = "minicpm-8b", args.context or (32768 if args.quick else 131072)
        batch, steps = (16, args.steps or 10) if args.quick else (32, args.steps or 20)
    else:
        model_name, context, batch, steps = "tiny", args.context or 1024, 8, args.steps or 3
    sizes = [n for n in (1, 2, 4, 8, 16, 32) if n <= batch]
    times = timing(model_name, "sparda", context, batch, sizes, steps, args.device)
    ok = all(c["ok"] for c in checks)
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "device": device_line(),
              "commit": git_commit(), "quick": args.quick, "parity": checks, "timing": times, "ok": ok,
              "wall_s": round(time.perf_counter() - began, 1)}
    (out / "check_buckets.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nparity: {'OK' if ok else 'FAILED'} ({sum(c['ok'] for c in checks)}/{len(checks)}); "
          f"wall {result['wall_s']} s; {out / 'check_buckets.json'}")
    print(f"\ndecode step per bucket, {model_name} offloaded sparda, {context} tokens per row, "
          f"cache of {batch} rows ({device_line()}):\n")
    print(table(times))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
