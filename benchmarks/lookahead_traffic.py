"""What the early copies of ``--lookahead 2`` move over PCIe, counted on the CPU (design §6.2).

The copy counts of an offloaded cache depend only on the blocks it is asked for, not on the
model: this script drives an :class:`~sparda.cache.offload.OffloadKVCache` of a bench model's
shape (a 4-wide head dimension, so that the host store stays small) through design §6's decode
order with replayed selections (``fetch`` of layer ``l + 1`` and, at lookahead 2, ``warm`` of
layer ``l + 2`` during layer ``l``), and reports per decoded token the blocks copied by the
one-layer fetches (misses) and early (early copies), for:

* ``lookahead 1``: the shipped trace's selection (``traces.replay_masks``);
* ``lookahead 2 modelled R``: its early copies get ``traces.two_ahead_ids`` at each recall ``R`` of
  ``--recalls`` (``1``: a perfect prediction, the bound of what copying earlier can do);
* ``lookahead 2 recorded``: its early copies replay the trace's recorded two-ahead predictions
  (``replay_masks(..., early=True)``);

and each again at ``--hit-rate`` on a synthetic selection (modelled predictions only). Bytes per
token are the counts times the model's real bytes per copied block (one KV head's K and V, at the
model's head dimension and ``--kv-dtype``), as ``Prefetcher.stats`` counts them. No timing: see docs/bench.md for the GPU run.

    PYTHONPATH=src python benchmarks/lookahead_traffic.py --model minicpm-8b --context 131072 \\
        --batch 4 --steps 40 --out docs/results/lookahead-traffic-2026-12-08
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sparda.bench.models import model_spec, selection_config
from sparda.bench.traces import (LOOKAHEAD2_RECALL, NO_PREDICTIONS, SHIPPED_TRACE, load_traces, replay_ids,
                                 replay_masks, synthetic_masks, trace_for, two_ahead_ids)
from sparda.cache.offload import OffloadKVCache
from sparda.errors import SpardaError
from sparda.kernels import quant

HEAD_DIM = 4  # the cache's own; bytes are counted at the model's


def run(cache: OffloadKVCache, sel: torch.Tensor, early: torch.Tensor | None, context: int, warmup: int) -> dict:
    """Drive ``cache`` through ``sel.shape[0]`` decode steps; counts after ``warmup`` steps, per token."""
    layers, batch = sel.shape[1], sel.shape[2]
    pref = cache.prefetcher
    for layer in cache.offloaded:
        cache.slot_map[layer].fill_(-1)
    start = {}
    for i in range(sel.shape[0]):
        if i == warmup:
            start = {k: int(getattr(pref, k).sum()) for k in ("hits", "misses", "early")}
        pos = torch.full((batch,), context + i, dtype=torch.long)
        cache.lengths[:] = context + i
        cache.fetch(0, sel[i, 0], pos)
        for layer in range(layers):
            if layer + 1 < layers:
                cache.fetch(layer + 1, sel[i, layer + 1], pos, prefetch=True)
            if early is not None and layer + 2 < layers:
                cache.warm(layer + 2, early[i, layer + 2], pos)
    tokens = batch * (sel.shape[0] - warmup)
    got = {k: (int(getattr(pref, k).sum()) - start[k]) / tokens for k in ("hits", "misses", "early")}
    got["hit_rate"] = got["hits"] / max(got["hits"] + got["misses"], 1e-9)
    return got


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="minicpm-8b")
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=40, help="decode steps, the first --warmup not counted")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--recalls", default=f"{LOOKAHEAD2_RECALL},1", help="comma list in [0, 1]")
    ap.add_argument("--hit-rate", type=float, default=0.7)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic selection and the modelled predictions")
    ap.add_argument("--trace", default=str(SHIPPED_TRACE))
    ap.add_argument("--out", default=None, help="directory for results.json")
    args = ap.parse_args(argv)
    try:
        recalls = [float(x) for x in args.recalls.split(",")]
    except ValueError:
        recalls = [-1.0]
    if any(not 0.0 <= r <= 1.0 for r in recalls):
        print(f"--recalls takes numbers in [0, 1], got {args.recalls!r}", file=sys.stderr)
        return 2
    if args.warmup >= args.steps:
        print(f"--warmup ({args.warmup}) must be below --steps ({args.steps})", file=sys.stderr)
        return 2
    try:
        spec, cfg = model_spec(args.model), selection_config(args.model)
        trace = trace_for(load_traces(args.trace), "sparda")
    except SpardaError as exc:
        print(exc, file=sys.stderr)
        return 2
    if trace.early is None:
        print(f"{args.trace}: {NO_PREDICTIONS}", file=sys.stderr)
        return 2
    layers, heads, batch, ctx = spec.layers, spec.kv_heads, args.batch, args.context
    # layer 0 stays whole on the device, as the offloaded methods keep it (OffloadDecodeMixin.resident_layers)
    cache = OffloadKVCache(layers, batch, heads, HEAD_DIM, ctx + args.steps + 1, cfg, torch.float32, "cpu",
                           resident_layers=(0,))
    width, blocks = cache.select_width, cache.num_blocks
    start = [ctx] * batch
    # a miss or early copy is one block of one KV head, K and V (as Prefetcher.stats counts bytes)
    block_bytes = 2 * cfg.block_size * quant.token_bytes(spec.head_dim, args.kv_dtype, torch.bfloat16)
    rows = []
    t0 = time.perf_counter()
    for source in ("trace", f"hit {args.hit_rate}"):
        if source == "trace":
            sel = replay_ids(replay_masks(trace, layers, heads, cfg, start, args.steps, blocks), width)
            recorded = replay_ids(replay_masks(trace, layers, heads, cfg, start, args.steps, blocks, early=True), width)
        else:
            masks = synthetic_masks(layers, heads, cfg, start, args.steps, blocks, args.hit_rate, args.seed)
            sel = replay_ids(masks, width)
            recorded = None
        runs = [("lookahead 1", None)] + [(f"lookahead 2 modelled {r:g}", two_ahead_ids(sel, cfg, start, r, args.seed))
                                          for r in recalls]
        if recorded is not None:
            runs.append(("lookahead 2 recorded", recorded))
        for label, early in runs:
            got = run(cache, sel, early, ctx, args.warmup)
            copied = got["misses"] + got["early"]
            rows.append({"selection": source, "predictions": label, **{k: round(v, 2) for k, v in got.items()},
                         "blocks_copied": round(copied, 2), "pcie_mb_per_token": round(copied * block_bytes / 1e6, 2)})
    env = {"model": args.model, "context": ctx, "batch": batch, "steps": args.steps, "warmup": args.warmup,
           "kv_dtype": args.kv_dtype, "seed": args.seed, "block_bytes": block_bytes, "slots": cache.slots,
           "select_width": width, "trace": Path(args.trace).name, "seconds": round(time.perf_counter() - t0, 1),
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"env": env, "records": rows}, indent=1) + "\n")
    print("| selection | early copies from | hit rate | misses / token | early / token | PCIe MB / token |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['selection']} | {r['predictions']} | {r['hit_rate']:.3f} | {r['misses']:.1f} | {r['early']:.1f} "
              f"| {r['pcie_mb_per_token']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
