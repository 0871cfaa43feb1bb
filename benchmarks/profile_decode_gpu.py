"""Where a decode step's GPU time goes: kernels grouped by name, per method (fused-decode work).

Usage (on a CUDA machine, from the repository root):

    python3 benchmarks/profile_decode_gpu.py OUT [CONTEXT [BATCH [METHOD ...]]]
    KV_DTYPE=int8 python3 benchmarks/profile_decode_gpu.py OUT 131072 24 sparda   # a quantised cache

Builds the ``sparda bench`` setup of one point (MiniCPM-8B shape, random weights, bf16, KV
filled directly, the shipped trace replayed by offloaded methods, CUDA graphs on), runs a
few decode steps, then profiles 3 replayed steps with ``torch.profiler`` and writes
``OUT/profile-<method>-b<B>.json`` (``-<kv_dtype>`` appended for ``KV_DTYPE`` int8 / int4,
docs/kv_quant.md): every kernel name with its launches and GPU time per
step, and the time of each set-up phase. Prints the top kernels per method.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench import point as pt  # noqa: E402
from sparda.bench.models import build_model, random_forecast, selection_config  # noqa: E402
from sparda.bench.traces import SHIPPED_TRACE, Replayer, load_traces, replay_masks, trace_for  # noqa: E402


def profile_point(model, forecast, method: str, batch: int, context: int, traces, kv_dtype: str = "bf16") -> dict:
    phases = {}
    t = time.perf_counter()
    selection = selection_config("minicpm-8b")
    llm = pt.make_llm(model, method, selection, forecast, kv_dtype=kv_dtype)
    steps = 24
    cache = llm.new_cache(batch, context + steps + 2)
    torch.cuda.synchronize()
    phases["new_cache_s"] = time.perf_counter() - t
    t = time.perf_counter()
    pt.fill_cache(cache, model.shape, batch, context, llm.device, llm.dtype)
    torch.cuda.synchronize()
    phases["fill_s"] = time.perf_counter() - t
    t = time.perf_counter()
    replayer = None
    if hasattr(cache, "fetch"):
        trace = trace_for(traces, method)
        masks = replay_masks(trace, model.shape.num_layers, model.shape.num_kv_heads, selection,
                             [context] * batch, steps, cache.num_blocks).to(llm.device)
        replayer = Replayer(masks)
        replayer.install(cache)
    phases["trace_s"] = time.perf_counter() - t
    runner = llm.runner(cache)
    runner.load(torch.zeros(batch, dtype=torch.long, device=llm.device),
                torch.full((batch,), context, device=llm.device))
    state = {"i": 0}

    def step():
        i = state["i"]
        if replayer is not None:
            replayer.step = i
        runner.positions.fill_(context + i)
        runner.step(context + i + 1)
        state["i"] = i + 1

    t = time.perf_counter()
    for _ in range(6):
        step()
    torch.cuda.synchronize()
    phases["warm_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(8):
        step()
    torch.cuda.synchronize()
    tpot = (time.perf_counter() - t) / 8 * 1e3
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    by_name = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        by_name[ev.name][0] += 1
        by_name[ev.name][1] += ev.time_range.elapsed_us()
    kernels = sorted(({"name": k[:120], "per_step": v[0] / 3, "us_per_step": round(v[1] / 3, 1)}
                      for k, v in by_name.items()), key=lambda r: -r["us_per_step"])
    rec = {"method": method, "batch": batch, "context": context, "kv_dtype": kv_dtype, "tpot_ms": round(tpot, 3),
           "kernels_per_step": sum(k["per_step"] for k in kernels),
           "gpu_kernel_ms": round(sum(k["us_per_step"] for k in kernels) / 1e3, 3),
           "phases": {k: round(v, 2) for k, v in phases.items()}, "kernels": kernels}
    del runner, cache, replayer, llm
    pt.release_memory(torch.device("cuda"))
    return rec


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 131072
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    methods = sys.argv[4:] or ["sparda", "sparse-offload", "dense"]
    kv_dtype = os.environ.get("KV_DTYPE", "bf16")
    suffix = "" if kv_dtype == "bf16" else f"-{kv_dtype}"
    t = time.perf_counter()
    model = build_model("minicpm-8b", "cuda", torch.bfloat16, context + 1024)
    forecast = random_forecast(model)
    traces = load_traces(SHIPPED_TRACE)
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    for method in methods:
        rec = profile_point(model, forecast, method, batch, context, traces, kv_dtype)
        (out / f"profile-{method}-b{batch}{suffix}.json").write_text(json.dumps(rec, indent=1))
        print(f"\n== {method} B{batch} {context} KV {kv_dtype}: TPOT {rec['tpot_ms']} ms, {rec['kernels_per_step']:.0f} kernels, "
              f"{rec['gpu_kernel_ms']} ms kernel time; phases {rec['phases']}", flush=True)
        for k in rec["kernels"][:28]:
            print(f"  {k['us_per_step']:9.1f} us {k['per_step']:7.1f}x  {k['name'][:90]}")


if __name__ == "__main__":
    main()
