"""Forecast training at 8B shape on one GPU: throughput and peak memory (issue #16, docs/forecast.md).

Usage (on a CUDA machine, from the repository root):

    python3 benchmarks/train_gpu.py OUT [--models llama-8b,minicpm-8b] [--seq-lens 16384,32768,65536]
        [--frozen dense,sparse] [--steps 2] [--queries 256] [--budget-s 420]

For each model shape (random bf16 weights, :mod:`sparda.bench.models`; speed and memory, not
quality), each sequence length and each frozen attention (``dense``, or ``sparse``: the
teacher-selected block-sparse attention of design §5), it runs the trainer's own step
(:class:`sparda.training.trainer.ForecastTrainer`: the frozen model layer by layer, the
chunked teacher and student, one backward per layer, AdamW) on random token ids: one
warm-up step (Triton compilation, first allocations), then ``--steps`` timed ones. Each
point records the median step time, tokens/s (one sequence of ``seq_len`` tokens per step;
gradient accumulation over more sequences scales the time linearly), the peak GPU memory
(``torch.cuda.max_memory_allocated`` and ``max_memory_reserved``) and the weights' share.

Fail-soft: a point that runs out of memory is recorded as ``oom``, another failure as
``error`` with its message, and points after ``--budget-s`` seconds as ``skipped``; the
rest still run. Writes ``OUT/train_gpu.json`` (points + device, torch version, date) and
prints a table. On a machine without CUDA it runs on the CPU (``--models tiny`` for a smoke
test of the script).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.attention.forecast import Forecast  # noqa: E402
from sparda.bench.models import build_model, selection_config  # noqa: E402
from sparda.io import atomic_write  # noqa: E402
from sparda.training.trainer import ForecastTrainer  # noqa: E402


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _gib(n) -> float | None:
    return None if n is None else round(n / 2**30, 2)


def run_point(net, forecast, cfg, seq_len: int, frozen: str, steps: int, queries: int, seed: int) -> dict:
    """Time ``1 + steps`` training steps on one random sequence of ``seq_len`` tokens."""
    device = next(net.parameters()).device
    trainer = ForecastTrainer(net, forecast, cfg, seed=seed, queries=queries, frozen=frozen)
    gen = torch.Generator().manual_seed(seed)
    times, totals = [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(1 + steps):
        ids = torch.randint(0, net.config.vocab_size, (seq_len,), generator=gen).to(device)
        _sync(device)
        start = time.perf_counter()
        totals = trainer.step(step, [ids], [0], 1)
        _sync(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times[1:])
    row = {"status": "ok", "step_s": round(step_s, 3), "warmup_s": round(times[0], 2),
           "tokens_per_s": round(seq_len / step_s, 1), "loss": round(totals.loss, 4),
           "recall": round(totals.hits / max(totals.total, 1), 4)}
    if device.type == "cuda":
        row["peak_allocated_gib"] = _gib(torch.cuda.max_memory_allocated(device))
        row["peak_reserved_gib"] = _gib(torch.cuda.max_memory_reserved(device))
    del trainer
    return row


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="output directory (train_gpu.json)")
    parser.add_argument("--models", default="llama-8b,minicpm-8b")
    parser.add_argument("--seq-lens", default="16384,32768,65536")
    parser.add_argument("--frozen", default="dense,sparse")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up)")
    parser.add_argument("--queries", type=int, default=256, help="loss query tokens per sequence")
    parser.add_argument("--budget-s", type=float, default=420.0, help="points starting after this are skipped")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lens = [int(v) for v in args.seq_lens.split(",") if v.strip()]
    modes = [m.strip() for m in args.frozen.split(",") if m.strip()]
    begin = time.time()
    rows: list[dict] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        base = {"model": name}
        try:
            net = build_model(name, device, dtype, max_positions=max(lens), seed=args.seed)
            with torch.device(device):
                forecast = Forecast.for_shape(net.shape)  # fp32, as training keeps it
            cfg = selection_config(name)
            weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        except Exception as exc:  # fail-soft: the next model still runs
            rows.extend({**base, "seq_len": n, "frozen": m, "status": "error",
                         "error": f"build: {str(exc).splitlines()[0]}"} for n in lens for m in modes)
            _free(device)
            continue
        for seq_len in lens:
            for mode in modes:
                row = {**base, "seq_len": seq_len, "frozen": mode, "weights_gib": _gib(weights)}
                if time.time() - begin > args.budget_s:
                    row["status"] = "skipped"
                else:
                    try:
                        row.update(run_point(net, forecast, cfg, seq_len, mode, args.steps, args.queries, args.seed))
                    except torch.cuda.OutOfMemoryError as exc:
                        row.update(status="oom", error=str(exc).splitlines()[0])
                    except Exception as exc:  # noqa: BLE001 - fail-soft per point
                        row.update(status="error", error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
                    forecast.zero_grad(set_to_none=True)
                    _free(device)
                rows.append(row)
                print(json.dumps(row), flush=True)
        del net, forecast
        _free(device)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "date": datetime.date.today().isoformat(), "dtype": str(dtype),
            "steps": args.steps, "queries": args.queries, "seconds": round(time.time() - begin, 1)}
    atomic_write(out / "train_gpu.json", json.dumps({"meta": meta, "points": rows}, indent=1))
    print(f"\n{'model':<12}{'seq':>7} {'frozen':<7}{'status':<8}{'step s':>8}{'tok/s':>10}{'peak GiB':>10}")
    for r in rows:
        print(f"{r['model']:<12}{r['seq_len']:>7} {r['frozen']:<7}{r['status']:<8}{r.get('step_s', ''):>8}"
              f"{r.get('tokens_per_s', ''):>10}{r.get('peak_allocated_gib') or '':>10}")
    return rows


if __name__ == "__main__":
    main()
