"""Device ops per decode step and layer of offloaded ``sparda`` for each ``--kv-dtype``, counted
on the CPU the way CUDA would launch them (:mod:`sparda.bench.op_count`: a Triton kernel or
UVA copy is one op, twin or not; other ATen ops one each, views and allocations none).

Random ``tiny`` model (``sparda.bench.models``, fp32), the fused decode step of CUDA forced,
prompts past the dense fallback so decode selects. Prints, per kv_dtype, the ops of each
layer's iteration of the decode loop (layer ``l``'s attention plus the lookahead for
``l + 1``), the steady-state offloaded layer (the widest middle one) and, with
``--breakdown``, which ops that layer issues.

    python3 benchmarks/count_ops.py                      # bf16, int8, mixed
    python3 benchmarks/count_ops.py --kv-dtypes mixed --breakdown
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench import point as pt  # noqa: E402
from sparda.bench.models import build_model, random_forecast, selection_config  # noqa: E402
from sparda.bench.op_count import decode_op_counts, force_fused  # noqa: E402


def middle_layers(counter) -> list[int]:
    """The layers that both attend over offloaded slots and fetch for the next one: not the
    first (resident) or the last (nothing ahead)."""
    layers = sorted(k for k in counter.per_layer() if isinstance(k, int))
    return layers[1:-1] or layers


def measure(kv_dtype: str, model, forecast, sel, batch: int, prompt: int, steps: int, fused: bool):
    llm = pt.make_llm(model, "sparda", sel, forecast, kv_dtype=kv_dtype, cuda_graphs=False)
    runner = llm.model_runner
    if fused:
        force_fused(runner)
    prompts = [torch.randint(10, 500, (prompt + 7 * r,)).tolist() for r in range(batch)]
    return decode_op_counts(runner, prompts, warmup=3, steps=steps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtypes", default="bf16,int8,mixed", help="comma list [default: bf16,int8,mixed]")
    p.add_argument("--batch", type=int, default=2, help="cache rows [default: 2]")
    p.add_argument("--prompt", type=int, default=400, help="prompt tokens of row 0 (past dense_len 256) [400]")
    p.add_argument("--steps", type=int, default=2, help="counted decode steps (after 3 warm-up steps) [2]")
    p.add_argument("--unfused", action="store_true", help="count the unfused modules' step instead")
    p.add_argument("--breakdown", action="store_true", help="list the ops of a middle layer")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = build_model("tiny", "cpu", torch.float32, 4096)
    forecast, sel = random_forecast(model), selection_config("tiny")
    for kv in args.kv_dtypes.split(","):
        counters = measure(kv, model, forecast, sel, args.batch, args.prompt, args.steps, not args.unfused)
        first = counters[0]
        layers = middle_layers(first)
        per = {k: max(c.per_layer().get(k, 0) for c in counters) for k in first.per_layer()}
        row = " ".join(f"{k}={v}" for k, v in per.items())
        worst = max(per[layer] for layer in layers)
        print(f"{kv:6s} ops/step={max(c.total for c in counters)} ops/offloaded layer={worst}  ({row})")
        if args.breakdown:
            for name, n in first.breakdown(layers[0]).items():
                print(f"    {n:4d} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
