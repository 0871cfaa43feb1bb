"""Forecast training benchmarks: one entry point, one subcommand per measurement (docs/forecast.md).

Run from the repository root::

    python3 benchmarks/bench_train.py throughput OUT [--models ...] [--seq-lens ...]  # step time, memory at 8B
    python3 benchmarks/bench_train.py retrain-bundled MODEL.gguf OUT_DIR [WALL_S]  # the shipped recipe, 2 runs

``python3 benchmarks/bench_train.py SUBCOMMAND --help`` describes each one. Outputs:
``OUT/train_gpu.json`` (``throughput``); the retrained Forecasts, training logs and
selection reports under ``OUT_DIR`` (``retrain-bundled``).

The subcommands replace the former scripts ``train_gpu.py`` (now ``throughput``) and
``retrain_bundled_gpu.sh`` (``retrain-bundled``), with the same measurements and output files.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.attention.forecast import Forecast  # noqa: E402
from sparda.bench.models import build_model, selection_config  # noqa: E402
from sparda.io import atomic_write  # noqa: E402
from sparda.training.trainer import ForecastTrainer  # noqa: E402

THROUGHPUT_DOC = """\
Forecast training at 8B shape on one GPU: throughput and peak memory (issue #16, docs/forecast.md).

Usage (on a CUDA machine, from the repository root):

    python3 benchmarks/bench_train.py throughput OUT [--models llama-8b,minicpm-8b] [--seq-lens 16384,32768,65536]
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

RETRAIN_DOC = """\
Retrain the bundled model's Forecast on one GPU with the shipped recipe (docs/forecast.md
"The shipped weights"), once with dense and once with block-sparse frozen attention, the
two runs side by side on the same GPU (a 135M model leaves it mostly idle), each stopped
by a wall-clock limit (SIGINT: the trainer checkpoints and exits); then the held-out
selection recall of the shipped weights and of both retrained ones (``selection-report``).

    python3 benchmarks/bench_train.py retrain-bundled MODEL.gguf OUT_DIR [WALL_S=300]

Each run is ``sparda train-forecast --seq-len 8192 --batch-size 2 --steps 3000 --queries 512
--save-every 25 --frozen-attention {dense,sparse}``. Writes ``OUT_DIR/device.txt``,
``OUT_DIR/forecast-{dense,sparse}.safetensors`` and ``train-{dense,sparse}.log`` (their last
lines are printed), ``OUT_DIR/report-{shipped,dense,sparse}.json`` (``sparda
selection-report --methods sparse,sparda --json``; stderr in ``report-*.err``), and prints
each report's ``sparda`` entry.
"""


# --------------------------------------------------------------------------- throughput
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


def throughput(args) -> list[dict]:
    """The ``throughput`` points of ``args`` (see :data:`THROUGHPUT_DOC`); writes ``OUT/train_gpu.json``."""
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


# ---------------------------------------------------------------------- retrain-bundled
def _tail(path: Path, lines: int) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.is_file() else []


def retrain_bundled(args) -> int:
    """The ``retrain-bundled`` run of ``args`` (see :data:`RETRAIN_DOC`); returns 0."""
    from sparda.bench.harness import sparda_cli, write_device_txt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_device_txt(out)
    cli, env = sparda_cli()
    runs = []
    for frozen in ("dense", "sparse"):  # side by side, each stopped by SIGINT after WALL_S
        log = open(out / f"train-{frozen}.log", "w")
        cmd = [*cli, "train-forecast", "--model", args.model, "--seq-len", "8192", "--batch-size", "2",
               "--steps", "3000", "--queries", "512", "--save-every", "25", "--device", args.device,
               "--frozen-attention", frozen, "--out", str(out / f"forecast-{frozen}.safetensors")]
        runs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log))
    deadline = time.monotonic() + args.wall_s
    for proc, log in runs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # the trainer checkpoints and exits
            proc.wait()
        log.close()
    for frozen in ("dense", "sparse"):
        print(f"==> {out / f'train-{frozen}.log'} <==", *_tail(out / f"train-{frozen}.log", 3), sep="\n")
    for weights in ("shipped", "dense", "sparse"):
        opt = [] if weights == "shipped" else ["--forecast", str(out / f"forecast-{weights}.safetensors")]
        err = out / f"report-{weights}.err"
        with open(out / f"report-{weights}.json", "w") as stdout, open(err, "w") as stderr:
            status = subprocess.run([*cli, "selection-report", "--model", args.model, "--methods", "sparse,sparda",
                                     "--device", args.device, "--json", *opt], stdout=stdout, stderr=stderr,
                                    env=env).returncode
        if status:
            print(*_tail(err, 5), sep="\n")
    for weights in ("shipped", "dense", "sparse"):
        try:
            report = json.loads((out / f"report-{weights}.json").read_text())
        except Exception as exc:  # report failed: say so in the table
            print(f"{weights:<8} report failed: {exc}")
            continue
        print(weights, json.dumps(report.get("sparda", report))[:400])
    return 0


# ---------------------------------------------------------------------------- commands
def cmd_throughput(args) -> int:
    throughput(args)
    return 0


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_train.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = sub.add_parser("throughput", help="Forecast training step time and peak memory at 8B shapes",
                       description=THROUGHPUT_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="OUT", help="output directory (train_gpu.json)")
    p.add_argument("--models", default="llama-8b,minicpm-8b", help="model shapes [llama-8b,minicpm-8b]")
    p.add_argument("--seq-lens", default="16384,32768,65536", help="sequence lengths [16384,32768,65536]")
    p.add_argument("--frozen", default="dense,sparse", help="frozen attentions [dense,sparse]")
    p.add_argument("--steps", type=int, default=2, help="timed steps per point (after one warm-up) [2]")
    p.add_argument("--queries", type=int, default=256, help="loss query tokens per sequence [256]")
    p.add_argument("--budget-s", type=float, default=420.0, help="points starting after this are skipped [420]")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_throughput)

    p = sub.add_parser("retrain-bundled", help="retrain the bundled Forecast (dense and sparse), report recall",
                       description=RETRAIN_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="the bundled GGUF file (or any model path sparda accepts)")
    p.add_argument("out", metavar="OUT_DIR", help="directory for the weights, logs and reports")
    p.add_argument("wall_s", metavar="WALL_S", type=float, nargs="?", default=300.0,
                   help="wall-clock seconds of the two training runs [300]")
    p.add_argument("--device", default="cuda", help="device of the training runs and reports [cuda]")
    p.set_defaults(func=retrain_bundled)
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
