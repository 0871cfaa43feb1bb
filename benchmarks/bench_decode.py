"""Decode benchmarks: one entry point, one subcommand per measurement (docs/bench.md).

Run from the repository root (the GPU subcommands on a CUDA machine)::

    python3 benchmarks/bench_decode.py sweep OUT BUDGET_S PART [PART ...]   # the decode grid, by parts
    python3 benchmarks/bench_decode.py graphs {parity,bundled,sweep} OUT ... # CUDA graphs vs eager
    python3 benchmarks/bench_decode.py fused {kernels,parity,profile} OUT ...  # the fused decode step
    python3 benchmarks/bench_decode.py profile OUT [CONTEXT [BATCH [METHOD ...]]]  # kernels of a step
    python3 benchmarks/bench_decode.py report RUN_DIR_OR_JSON... --out DIR  # merged report + plots

``python3 benchmarks/bench_decode.py SUBCOMMAND --help`` describes each one: what it
measures, its arguments and the files it writes (JSON records and markdown, the formats of
the result pages under docs/results/benchmarks/). The single-point harness is ``sparda bench``
(:mod:`sparda.bench`); these subcommands drive it (``sweep``, ``graphs sweep``) or measure
what it does not (kernel parity, profiles, the merged report).

The subcommands replace the former scripts ``decode_sweep_gpu.py`` (``sweep``),
``cuda_graphs_gpu.py`` (``graphs``), ``fused_decode_gpu.py`` (``fused``),
``profile_decode_gpu.py`` (``profile``) and ``decode_report.py`` (``report``), with the
same measurements and output files.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda import kernels  # noqa: E402
from sparda.bench import point as pt  # noqa: E402
from sparda.bench.harness import NoText, prefill_selection_check, random_llama  # noqa: E402
from sparda.bench.models import build_model, random_forecast, selection_config  # noqa: E402
from sparda.bench.sweep import BASELINE_METHODS, SWEEP_METHODS, SweepConfig, run_sweep  # noqa: E402
from sparda.bench.traces import SHIPPED_TRACE, Replayer, load_traces, replay_masks, trace_for  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.kernels import reference as ref  # noqa: E402
from sparda.kernels import twins  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: smoke runs of the parts that allow it
T0 = time.perf_counter()


def log(line: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {line}", flush=True)


def _random_model(dtype):
    """The random 4-layer model of the parity checks (:func:`sparda.bench.harness.random_llama`)."""
    return random_llama(dtype, DEV)


SWEEP_DOC = """\
Decode measurements on the GPU for the fused-decode issue (design §6):
parts of the decode grid, each a sweep of ``sparda.bench.sweep.run_sweep`` or a check.

    python3 benchmarks/bench_decode.py sweep OUT BUDGET_S PART [PART ...]
    python3 benchmarks/bench_decode.py sweep --smoke OUT 600 quick  # CPU, tiny model (SMOKE=1 too)

Parts run in the order given until ``BUDGET_S`` seconds are spent (a part that starts
gets the time left as its sweep's ``--time-budget-s``); each writes JSON into ``OUT``
(a sweep's records ``OUT/<sweep>.json``, a check's rows ``OUT/<part>.json`` or
``OUT/<part>-check.json``), and a short table is printed last:

* ``check``: registered pinned host memory (``cache.pinned.pinned_zeros``: pinned,
  async copies, UVA gather equal to plain indexing, freed and re-registered 3 times,
  host memory back after each), and the lookahead on its selection stream: offloaded
  ``sparda`` generates the same greedy tokens as ``sparda-no-prefetch`` (same
  selection, synchronous fetch) and as itself eager, random 4-layer model, bf16 + fp32.
  ``quick``: the same, one round, bf16 only, plus an int8 cache's token agreement.
* ``hitrate``: MiniCPM-8B shape, 128K, B4 and B16, ``sparda`` and ``sparse-offload``:
  the trace plus synthetic selections of hit rate 0.5, 0.7, 0.8, 0.9 on one filled
  cache each, with compute-alone / transfer-alone timing (overlap efficiency).
* ``b128``: MiniCPM-8B shape, 128K, every method at B4, B8, B16, B24 (the largest batch
  <= 96 GiB of pinned host KV), greedy parity of 64 replayed steps vs eager.
  ``b128sparda``: offloaded ``sparda`` and ``dense`` alone at the same points.
* ``cap80``: the GPU capped at 80 GiB (``set_per_process_memory_fraction``): on-GPU
  ``sparse`` at B8..B16 and offloaded ``sparda`` at B16, B24, MiniCPM-8B shape, 128K.
* ``grid``: the rest of the grid (Llama-3-8B and MiniCPM-8B shapes, 32K / 64K / 128K,
  B1..B24, every method), shortest contexts first, no parity.
* ``grid-long``: Llama-3-8B shape at 128K and 64K (B1, B4) and MiniCPM-8B shape at 128K B1,
  every method, under the current defaults.
* ``baselines``: the seeds' selectors beside ``sparse`` and offloaded ``sparda``, MiniCPM-8B
  shape, 128K, B4 and B16, parity 16; ``quest``: that method alone at the same points.
* ``tune``: inside the replayed step of offloaded ``sparda`` (MiniCPM-8B shape, trace; 128K
  B16 and 32K B24), TPOT for each UVA gather grid (CTAs x warps) and side-stream priority
  (high / normal); every configuration replays the same
  steps from empty slots (``bench.point.restart``), the first one again at the end to show
  the drift.
* ``kvquant``: quantised KV caches (issue #14, docs/kv_quant.md). First the fused RoPE +
  append kernel alone against the unfused append (PyTorch RoPE + quantise) on the same
  projection rows, MiniCPM4.1-8B's attention shape, bf16 and fp32: codes and scales that
  differ, and by how many codes (a correct kernel: none); then the fused decode step
  against the unfused one (random 4-layer model, offloaded ``sparda``, greedy-token
  agreement over 3 x 64 tokens) with unquantised, int8 and int4 caches, bf16 and fp32:
  the unquantised cache is the control (the stacked GEMMs round differently from the
  separate projections in bf16, so bf16 tokens drift without any quantiser), then
  MiniCPM-8B shape, 128K, ``sparda`` and ``sparse-offload``: bf16 at its largest batch,
  int8 at that batch and at its own largest, int4 (``sparda`` only) at its largest, each
  largest batch computed from the per-token bytes for <= 96 GiB of pinned host KV
  (printed); no overlap runs (~6 min of GPU time). Checks the issue's criterion: int8
  runs at >= 1.8x the batch of bf16 and its best decode tok/s exceeds bf16's best.
* ``kvmixed``: ``--kv-dtype mixed`` (int4 host store + bf16 hot pool): first the cold-slot
  dequantisation kernel against its twin and both timed (``cold_slots_check``), then offloaded
  ``sparda`` at 128K, mixed at bf16's largest batch and at its own, int4 at mixed's largest.
* ``tune-synth``: as ``tune`` where the copy slows down inside the step:
  synthetic selections of hit rate 0.9 at 128K B16 and 0.7 at 128K B4, grids 64 / 32 / 128 x 8,
  64 / 128 x 4, 16 x 8, priority high and normal, 48 timed steps each.
* ``recheck``: ``hitrate`` under the current defaults, then offloaded ``sparda`` at 64K and 32K
  B24 (parity 16).
* ``spare``: spare GPU slots (``slot_factor``, design §6), MiniCPM-8B shape, trace: offloaded
  ``sparda`` and ``sparse-offload`` at 128K B4 / B16 / B24 with ``slot_factor`` 1 (the
  buffer holds exactly the widest selection, the behaviour before spare slots) and 1.5
  (the default), parity 16, overlap timed; ``sparda`` with 2 at B16 / B24; then ``sparda``
  at 32K B24 with 1 and 1.5.

Each sweep's own report and plots go to ``/tmp/sweeps/<sweep>``, its records to
``OUT/<sweep>.json`` and the environment to ``OUT/env.json``. ``--smoke`` (or ``SMOKE=1``):
every part on the CPU with the tiny model at 2K, batches 1-2 (a test of this command, no
numbers). ``bench_decode.py report OUT --out DIR`` merges the parts' records into one report.
"""

GRAPHS_DOC = """\
CUDA-graph decode on the GPU: parity with eager, speed-up, and the 128K sweep (docs/cuda_graphs.md).

    python3 benchmarks/bench_decode.py graphs parity OUT          # random model, every method, bf16 + fp32
    python3 benchmarks/bench_decode.py graphs bundled OUT GGUF    # bundled model, ~7K-token passkey prompt
    python3 benchmarks/bench_decode.py graphs sweep OUT [BUDGET_S [NAME ...]]  # MiniCPM-8B shape, 128K

Each part writes ``OUT/<part>.json`` and prints a short table. ``parity`` generates with
``cuda_graphs=True`` and ``False`` from the same prompts and checks that the greedy tokens
are equal (a prompt below ``dense_len`` crosses the dense fallback mid-generation, so
two graphs are captured); it also checks that the device timestamps of the offload
timing and the profiler's kernel count work inside a replayed graph. On the CPU ``parity``
runs in fp32 as a smoke test of the command (no graphs, no profile).
"""

FUSED_DOC = """\
Fused decode on the GPU: the kernels in bf16 against their twins, parity, and a profile.

    python3 benchmarks/bench_decode.py fused kernels OUT    # bf16/fp32 kernels vs PyTorch twins (real tl.dot)
    python3 benchmarks/bench_decode.py fused parity OUT     # every method: fused graphs vs fused eager vs unfused
    python3 benchmarks/bench_decode.py fused profile OUT [CONTEXT BATCH METHOD...]  # kernels by name

Each part writes ``OUT/<part>.json`` (``profile``: ``OUT/profile-b<BATCH>.json``) and prints
a short table. ``kernels`` checks, on CUDA tensors with compiled kernels (the interpreter
runs fp32 dots only): RoPE + append (offload partial slot + ring + pinned host store, and
the full device cache), the slot diff, add + RMSNorm, SiLU * mul, and the bf16 ``tl.dot``
paths of decode selection, decode attention (full cache and slots) and prefill attention.
Needs CUDA.
"""

PROFILE_DOC = """\
Where a decode step's GPU time goes: kernels grouped by name, per method (fused-decode work).

    python3 benchmarks/bench_decode.py profile OUT [CONTEXT [BATCH [METHOD ...]]]
    python3 benchmarks/bench_decode.py profile OUT 131072 24 sparda --kv-dtype int8   # a quantised cache

Builds the ``sparda bench`` setup of one point (MiniCPM-8B shape, random weights, bf16, KV
filled directly, the shipped trace replayed by offloaded methods, CUDA graphs on), runs a
few decode steps, then profiles 3 replayed steps with ``torch.profiler`` and writes
``OUT/profile-<method>-b<B>.json`` (``-<kv_dtype>`` appended for ``--kv-dtype`` int8 / int4,
docs/kv_quant.md; the ``KV_DTYPE`` environment variable sets the default): every kernel
name with its launches and GPU time per step, and the time of each set-up phase. Prints
the top kernels per method. Needs CUDA.
"""

REPORT_DOC = """\
The decode benchmark report of several sweep runs: merged records, markdown and plots.

    python3 benchmarks/bench_decode.py report RUN_DIR_OR_JSON... --out DIR

Each input is a sweep's output directory (every ``*.json`` list of records in it, its
``env.json`` for the date and commit), a directory of such directories (the
``results.json`` of each subdirectory: ``bench_decode.py sweep OUT`` writes one per part)
or a ``results.json``-like file. A point measured more than once (same model, method,
context, batch, selection, target hit rate, GPU cap, CUDA graphs, KV place, dtype, device)
keeps its newest record: the record's own ``date``, else its run's ``env.json`` date, then
the later input on the command line, then the newer file. Writes ``DIR/results.json`` (the
merged records), ``DIR/report.md`` (issue #20's Done-when verdicts, per-context decode
tables, speed-ups, the capped comparison, the paper's table beside ours) and the plots
(``sparda.bench.report``), each atomically. Runs on the CPU.
"""


# ------------------------------------------------------------------------------- graphs
#: the methods of the graphs and fused parity checks: (method, offload)
GRAPH_METHODS = [("dense", None), ("sparse", None), ("oracle", None), ("infinigen", None), ("sparda", False),
                 ("sparda", True), ("sparse-offload", None), ("sparda-no-prefetch", None)]


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _generate(llm, prompts, new_tokens):
    _sync()
    start = time.perf_counter()
    out = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=new_tokens, ignore_eos=True)
    _sync()
    return out, time.perf_counter() - start


def graphs_parity(out_dir: Path) -> list[dict]:
    rows = []
    budget = dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=512)
    gen = torch.Generator().manual_seed(0)
    cases = {"batch": [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (1500, 2300, 700)],
             "crossing": [torch.randint(0, 2048, (450,), generator=gen).tolist()]}
    for dtype in ((torch.bfloat16, torch.float32) if DEV == "cuda" else (torch.float32,)):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        for method, offload in GRAPH_METHODS:
            for case, prompts in cases.items():
                res = {}
                for graphs in (False, True):
                    llm = LLM.from_model(model, NoText(), method=method, forecast=forecast, offload=offload,
                                         cuda_graphs=graphs, **budget)
                    _generate(llm, prompts, 8)  # compile the kernels
                    res[graphs] = _generate(llm, prompts, 128)
                (eager, t_e), (graph, t_g) = res[False], res[True]
                same = all(a.token_ids == b.token_ids for a, b in zip(eager, graph))
                rows.append({"dtype": str(dtype).replace("torch.", ""), "method": method, "offload": offload,
                             "case": case, "tokens_equal": same, "cuda_graph": graph[0].stats["cuda_graph"],
                             "eager_tok_s": eager[0].stats["decode_tok_s"],
                             "graph_tok_s": graph[0].stats["decode_tok_s"],
                             "speedup": round(graph[0].stats["decode_tok_s"] / max(eager[0].stats["decode_tok_s"], 1e-9), 2)})
                print(rows[-1], flush=True)
    # offload timing (device timestamps) and the profiler inside replayed graphs
    model = _random_model(torch.bfloat16)
    llm = LLM.from_model(model, NoText(), method="sparda", forecast=random_forecast(model), offload=True,
                         offload_timing=True, **budget)
    out, _ = _generate(llm, cases["batch"], 64)
    timing = out[0].stats["offload"]
    cache = llm.new_cache(2, 3000)
    run = llm.runner(cache)
    llm.prefill(cache, 0, cases["batch"][0])
    llm.prefill(cache, 1, cases["batch"][1])
    run.load(torch.zeros(2, dtype=torch.long, device=DEV), torch.tensor([1500, 2300], device=DEV))
    for _ in range(3):
        run.step(2301)
    prof = pt.profile_kernels(lambda: run.step(2301), 3) if DEV == "cuda" else None
    extra = {"offload_timing": timing, "graph_profile": prof, "graph_replays": run.replays}
    print(extra, flush=True)
    (out_dir / "parity.json").write_text(json.dumps({"rows": rows, **extra}, indent=1))
    return rows


def graphs_bundled(out_dir: Path, gguf: str) -> list[dict]:
    from sparda.data import heldout_text
    from sparda.eval.tasks.passkey import make_passkey

    rows = []
    for method, extra in (("sparda", {}), ("dense", {})):
        res = {}
        for graphs in (False, True):
            llm = LLM(gguf, method=method, device=DEV, dense_prefill=True, cuda_graphs=graphs, **extra)
            sample = make_passkey(llm.tokenizer, heldout_text(), 7000, 0.5, 0)
            ids = llm.encode(sample.prompt)
            llm.generate(None, prompt_token_ids=[ids], max_new_tokens=8, ignore_eos=True)
            res[graphs] = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=128, ignore_eos=True)[0]
        e, g = res[False], res[True]
        rows.append({"method": method, "offload": bool(llm.config.offload), "prompt_tokens": len(ids),
                     "new_tokens": 128, "tokens_equal": e.token_ids == g.token_ids,
                     "answer": g.text[:40], "expected": sample.answer,
                     "eager_tok_s": e.stats["decode_tok_s"], "graph_tok_s": g.stats["decode_tok_s"],
                     "speedup": round(g.stats["decode_tok_s"] / e.stats["decode_tok_s"], 2),
                     "cuda_graph": g.stats["cuda_graph"], "offload_stats": g.stats.get("offload")})
        print(rows[-1], flush=True)
    (out_dir / "bundled.json").write_text(json.dumps(rows, indent=1))
    return rows


#: (name, methods, batches, parity steps): every method at B4 and B8, the offloaded pair at B16
#: and at B24 (host memory: 24 rows x 4.2 GB of offloaded KV at 128K)
GRAPH_ALL = ["sparse-offload", "dense", "sparse", "sparda-no-prefetch", "infinigen", "sparda"]
GRAPH_SWEEPS = [("b4", GRAPH_ALL, [4], 64), ("b16", ["sparda", "sparse-offload"], [16], 64),
          ("b24", ["sparda", "sparse-offload"], [24], 16), ("b8", GRAPH_ALL, [8], 64)]


def graphs_sweep(out_dir: Path, budget_s: float, names=None) -> list[dict]:
    from sparda.bench.sweep import SweepConfig, run_sweep

    t0 = time.perf_counter()
    records = []
    for name, methods, batches, parity_steps in GRAPH_SWEEPS:
        if names and name not in names:
            continue
        left = budget_s - (time.perf_counter() - t0)
        if left < 30:
            break
        cfg = SweepConfig(models=["minicpm-8b"], contexts=[131072], batches=batches, methods=methods,
                          decode_steps=16, repeats=3, warmup_steps=3, breakdown_steps=0, prefill_tokens=16384,
                          out=str(out_dir / f"sweep-{name}"), time_budget_s=left, parity_steps=parity_steps)
        records += run_sweep(cfg, log=lambda line: print(f"[{time.perf_counter() - t0:6.0f} s] {line}", flush=True))
    (out_dir / "sweep.json").write_text(json.dumps(records, indent=1))
    return records


# -------------------------------------------------------------------------------- fused
def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def fused_kernels(out_dir: Path) -> list[dict]:
    from sparda.kernels.norm import add_rmsnorm_triton, silu_mul_triton
    from sparda.kernels.rope_append import rope_append_triton
    from sparda.kernels.slot_diff import slot_diff_triton

    rows = []
    cfg = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                          topk_blocks=8, dense_len=1024)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        for g, d in ((16, 128), (4, 128), (3, 64), (1, 64)):
            b, hk, nf, cap = 4, 2, 2, 4096
            qkv = torch.randn(b, (hk * g + (2 + nf) * hk) * d, device=DEV, generator=gen).to(dtype)
            pos = torch.tensor([31, 1000, 2047 + 16, 4000], device=DEV)
            theta = pos.view(-1, 1).float() * (1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
            emb = torch.cat([theta, theta], -1)
            cos, sin = emb.cos().to(dtype).view(b, 1, 1, d), emb.sin().to(dtype).view(b, 1, 1, d)
            slots = 24
            for layout in ("slots", "full"):
                if layout == "slots":
                    kd = torch.randn(b, hk, slots + 1, cfg.block_size, d, device=DEV, generator=gen).to(dtype)
                    ring = torch.randn(b, hk, cfg.kernel_size, d, device=DEV, generator=gen).to(dtype)
                    host = tuple(torch.zeros(b, hk, cap // cfg.block_size, cfg.block_size, d, dtype=dtype,
                                             pin_memory=True) for _ in range(2))
                    extra = dict(slot=slots, ring=ring, host=host)
                else:
                    kd = torch.randn(b, hk, cap, d, device=DEV, generator=gen).to(dtype)
                    extra = {}
                vd = torch.randn(kd.shape, device=DEV, generator=gen).to(dtype)
                ck = torch.randn(b, hk, ref.num_compressed(cap, 32, 16), d, device=DEV, generator=gen).to(dtype)
                outs = []
                for fn in (rope_append_triton, twins.rope_append_reference):
                    state = {k: v.clone() for k, v in dict(kd=kd, vd=vd, ck=ck).items()}
                    ex = dict(extra)
                    if "ring" in ex:
                        ex["ring"] = ring.clone()
                        ex["host"] = tuple(h.clone().pin_memory() for h in host)
                    q = torch.empty(b, hk * g, d, device=DEV, dtype=dtype)
                    f = torch.empty(b, nf, hk, d, device=DEV, dtype=dtype)
                    fn(qkv, cos, sin, pos, q, f, state["kd"], state["vd"], state["ck"], num_kv_heads=hk, group=g,
                       num_f=nf, block_size=cfg.block_size, kernel=32, stride=16, **ex)
                    torch.cuda.synchronize()
                    outs.append((q, f, state, ex))
                (q1, f1, s1, e1), (q2, f2, s2, e2) = outs
                errs = {"q": _rel(q1, q2), "f": _rel(f1, f2), "k": _rel(s1["kd"], s2["kd"]),
                        "v": _rel(s1["vd"], s2["vd"]), "ck": _rel(s1["ck"], s2["ck"])}
                if layout == "slots":
                    errs.update(ring=_rel(e1["ring"], e2["ring"]), host_k=_rel(e1["host"][0], e2["host"][0]))
                rows.append({"kernel": f"rope_append/{layout}", "dtype": name, "G": g, "d": d,
                             "max_rel_err": max(errs.values()), **{k: round(v, 8) for k, v in errs.items()}})
        # add + rmsnorm, silu * mul
        x = torch.randn(8, 4096, device=DEV, generator=gen).to(dtype)
        delta = torch.randn(8, 4096, device=DEV, generator=gen).to(dtype)
        w = torch.randn(4096, device=DEV, generator=gen).to(dtype)
        a, b_ = x.clone(), x.clone()
        o1 = add_rmsnorm_triton(a, delta, w, 1e-5, torch.empty_like(x))
        o2 = twins.add_rmsnorm_reference(b_, delta, w, 1e-5, torch.empty_like(x))
        rows.append({"kernel": "add_rmsnorm", "dtype": name, "max_rel_err": max(_rel(o1, o2), _rel(a, b_)),
                     "exact_residual": bool(torch.equal(a, b_))})
        gu = torch.randn(8, 2 * 16384, device=DEV, generator=gen).to(dtype)
        m1 = silu_mul_triton(gu, torch.empty(8, 16384, device=DEV, dtype=dtype))
        m2 = twins.silu_mul_reference(gu, torch.empty(8, 16384, device=DEV, dtype=dtype))
        rows.append({"kernel": "silu_mul", "dtype": name, "max_rel_err": _rel(m1, m2)})
    # slot diff (integers: must be exact); w < s: spare slots (slot_factor, design §6) with the
    # compact (block, slot) list attention reads
    for b, h, s, n, w in ((4, 2, 96, 2048, 96), (16, 8, 128, 1024, 128), (3, 3, 7, 40, 7), (4, 2, 192, 2048, 128),
                          (16, 2, 48, 1024, 32)):
        ok = True
        for trial in range(20):
            pos = torch.randint(64 * 4, n * 64, (b,), device=DEV, generator=gen)
            slot_map = torch.full((b, h, s), -1, dtype=torch.long, device=DEV)
            ids = torch.full((b, h, w), -1, dtype=torch.int32, device=DEV)
            for i in range(b):
                cur = int(pos[i]) // 64
                for j in range(h):
                    held = torch.randperm(cur, device=DEV, generator=gen)[:int(torch.randint(0, s + 1, (1,)))]
                    slot_map[i, j, torch.randperm(s, device=DEV, generator=gen)[:held.numel()]] = held
                    k = int(torch.randint(0, min(w - 1, cur) + 1, (1,)))
                    pool = torch.unique(torch.cat([held, torch.randperm(cur, device=DEV, generator=gen)[:s]]))
                    chosen = torch.sort(torch.cat([pool[torch.randperm(pool.numel(), device=DEV, generator=gen)[:k]],
                                                   torch.tensor([cur], device=DEV)])).values
                    ids[i, j, :chosen.numel()] = chosen.int()
            res = []
            for fn in (slot_diff_triton, twins.slot_diff_reference):
                sm, load = slot_map.clone(), torch.empty_like(slot_map)
                attn = torch.empty(b, h, s + 1, dtype=torch.int32, device=DEV)
                cnt = tuple(torch.zeros(b, dtype=torch.long, device=DEV) for _ in range(4))
                compact = tuple(torch.empty(b, h, min(w, s) + 1, dtype=torch.int32, device=DEV) for _ in range(2)) \
                    if w < s else None
                fn(ids, sm, pos, 64, n, load, attn, cnt, compact)
                res.append((load, sm, attn, *cnt, *(compact or ())))
            ok &= all(torch.equal(x, y) for x, y in zip(*res))
        rows.append({"kernel": "slot_diff", "dtype": "int", "B": b, "H": h, "S": s, "W": w, "exact": bool(ok),
                     "max_rel_err": 0.0 if ok else 1.0})
    # the bf16 tl.dot paths of the older kernels (review C8)
    for g in (16, 4, 1):
        b, hk, d, t = 4, 2, 128, 8192
        k = torch.randn(b, hk, t, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, hk, g, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kv_len = torch.tensor([t, t - 5, 3000, 777], device=DEV)
        ck = ref.compress_keys(k, 32, 16)
        sel = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                              topk_blocks=16, dense_len=1024)
        ids_t = kernels.select_decode_blocks(q, ck, kv_len - 1, t // 64, sel)
        ids_r = twins.select_decode_reference(q, ck, kv_len - 1, t // 64, sel)
        same = float((twins.ids_to_block_mask(ids_t, t // 64) == twins.ids_to_block_mask(ids_r, t // 64)).float().mean())
        rows.append({"kernel": "select_decode(query, bf16 dot)", "dtype": "bfloat16", "G": g,
                     "mask_agreement": round(same, 5), "max_rel_err": 1 - same})
        o1 = kernels.decode_attention(q, k, v, ids_r, kv_len, 64)
        o2 = twins.decode_attention_reference(q, k, v, ids_r, kv_len, 64)
        rows.append({"kernel": "decode_attention (bf16 dot)", "dtype": "bfloat16", "G": g, "max_rel_err": _rel(o1, o2)})
        qp = torch.randn(1, hk, g, 2048, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kp, vp = k[:1, :, :2048].contiguous(), v[:1, :, :2048].contiguous()
        qpos = torch.arange(2048, device=DEV).view(1, -1)
        o1 = kernels.prefill_attention(qp, kp, vp, None, qpos, torch.tensor([2048], device=DEV), 64)
        o2 = ref.block_sparse_attention(qp.float(), kp.float(), vp.float(), None, qpos,
                                        torch.tensor([2048], device=DEV), 64)
        rows.append({"kernel": "prefill_attention (bf16 dot)", "dtype": "bfloat16", "G": g, "max_rel_err": _rel(o1, o2)})
    # decode selection in bf16 for the other group sizes and the Forecast's mode (one head, raw
    # dot, the next layer's compressed keys cut at the window complete before this token)
    for mode in ("forecast", 3, 8):
        b, hk, d, t = 4, 2, 128, 8192
        k = torch.randn(b, hk, t, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kv_len = torch.tensor([t, t - 5, 3000, 777], device=DEV)
        ck = ref.compress_keys(k, 32, 16)
        sel = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                              topk_blocks=16, dense_len=1024)
        if mode == "forecast":
            q = torch.randn(b, hk, d, device=DEV, generator=gen, dtype=torch.bfloat16)
            ck_len = torch.clamp((kv_len - 1 - 32) // 16 + 1, min=0)  # windows complete at q_pos - 1
        else:
            q = torch.randn(b, hk, mode, d, device=DEV, generator=gen, dtype=torch.bfloat16)
            ck_len = None
        ids_t = kernels.select_decode_blocks(q, ck, kv_len - 1, t // 64, sel, ck_len=ck_len)
        ids_r = twins.select_decode_reference(q, ck, kv_len - 1, t // 64, sel, ck_len=ck_len)
        same = float((twins.ids_to_block_mask(ids_t, t // 64) == twins.ids_to_block_mask(ids_r, t // 64)).float().mean())
        rows.append({"kernel": f"select_decode({'forecast' if mode == 'forecast' else 'query'}, bf16 dot)",
                     "dtype": "bfloat16", "G": 1 if mode == "forecast" else mode, "mask_agreement": round(same, 5),
                     "max_rel_err": 1 - same})
    for r in rows:
        print(r, flush=True)
    (out_dir / "kernels.json").write_text(json.dumps(rows, indent=1))
    return rows


def fused_parity(out_dir: Path) -> list[dict]:
    from sparda.bench.models import random_forecast
    from sparda.engine.llm import LLM

    rows = []
    budget = dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=512)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (1500, 2300, 700, 450)]
    for dtype in (torch.bfloat16, torch.float32):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        for method, offload in GRAPH_METHODS:
            res = {}
            for name, kw in (("fused", {}), ("fused_eager", {"cuda_graphs": False}),
                             ("unfused", {"fused_decode": False})):
                llm = LLM.from_model(model, NoText(), method=method, forecast=forecast, offload=offload,
                                     **budget, **kw)
                _generate(llm, prompts, 8)
                res[name] = _generate(llm, prompts, 128)
                del llm
            (f, t_f), (e, _), (u, t_u) = res["fused"], res["fused_eager"], res["unfused"]
            agree = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(f, u))
            total = sum(len(a.token_ids) for a in f)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "method": method, "offload": offload,
                         "graph_eq_eager": all(a.token_ids == b.token_ids for a, b in zip(f, e)),
                         "fused_eq_unfused": all(a.token_ids == b.token_ids for a, b in zip(f, u)),
                         "token_agreement": round(agree / total, 4),
                         "fused_tok_s": f[0].stats["decode_tok_s"], "unfused_tok_s": u[0].stats["decode_tok_s"]})
            print(rows[-1], flush=True)
    (out_dir / "parity.json").write_text(json.dumps(rows, indent=1))
    return rows


def fused_profile(out_dir: Path, context: int, batch: int, methods: list[str]) -> list[dict]:
    from sparda.bench.models import build_model, random_forecast
    from sparda.bench.traces import SHIPPED_TRACE, load_traces

    model = build_model("minicpm-8b", DEV, torch.bfloat16, context + 1024)
    forecast = random_forecast(model)
    traces = load_traces(SHIPPED_TRACE)
    recs = []
    for method in methods:
        rec = profile_point(model, forecast, method, batch, context, traces)
        recs.append(rec)
        print(f"\n== {method} B{batch} {context}: TPOT {rec['tpot_ms']} ms, {rec['kernels_per_step']:.0f} kernels, "
              f"{rec['gpu_kernel_ms']} ms kernel time; phases {rec['phases']}", flush=True)
        for k in rec["kernels"][:22]:
            print(f"  {k['us_per_step']:9.1f} us {k['per_step']:7.1f}x  {k['name'][:90]}")
    (out_dir / f"profile-b{batch}.json").write_text(json.dumps(recs, indent=1))
    return recs


# ------------------------------------------------------------------------------ profile
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
    if cache.offload:
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


# -------------------------------------------------------------------------------- sweep
def check(out: Path, budget: float, quick: bool = False) -> list[dict]:
    from sparda.bench.models import random_forecast
    from sparda.cache import pinned
    from sparda.cache.host import available_host_bytes
    from sparda.cache.pinned import pinned_zeros
    from sparda.cache.host import HostChunk
    from sparda.cache.transfer import SyncEngine, make_engine
    from sparda.engine.llm import LLM

    rows = []
    free0 = available_host_bytes()
    for rep in range((1 if quick else 3) if DEV == "cuda" else 0):  # allocate, use, free: reusing (the pool) and re-registering (after release) must work
        k = pinned_zeros((2, 1024, 64, 128), torch.bfloat16)  # 33.5 MB: [H, pages, 64, 128], 2 rows x 512 blocks
        v = pinned_zeros(k.shape, torch.bfloat16)
        big = pinned_zeros((3, 1 << 28), torch.bfloat16)  # 1.5 GiB, one registration
        k.copy_(torch.randn(k.shape, dtype=torch.bfloat16))
        v.copy_(torch.randn(k.shape, dtype=torch.bfloat16))
        dev = torch.randn(1 << 20, device=DEV, dtype=torch.bfloat16)
        host = big[0, : 1 << 20]
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        table = torch.arange(1024, dtype=torch.int32, device=DEV).view(2, 512).flip(-1)  # not the identity
        chunk = HostChunk(0, 1024, k, v, table)
        load = torch.randint(-1, 512, (2, 2, 40), device=DEV)
        got_k = torch.zeros(2, 2, 41, 64, 128, device=DEV, dtype=torch.bfloat16)
        got_v, ref_k, ref_v = torch.zeros_like(got_k), torch.zeros_like(got_k), torch.zeros_like(got_k)
        make_engine("uva", torch.device(DEV)).gather(chunk, got_k, got_v, load)
        SyncEngine().gather(chunk, ref_k, ref_v, load)
        torch.cuda.synchronize()
        row = {"check": f"pinned_zeros round {rep}", "pinned": bool(k.is_pinned() and big.is_pinned()),
               "async_copy_equal": bool(torch.equal(host.to(DEV), dev)),
               "uva_gather_equal": bool(torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v))}
        del k, v, big, host, chunk
        gc.collect()
        if rep == 1:  # round 2 registers afresh
            pinned.POOL.release()
        row["host_free_gib_after_free"] = round((available_host_bytes() or 0) / 2**30, 1)
        row["host_free_gib_before"] = round((free0 or 0) / 2**30, 1)
        rows.append(row)
        log(row)

    for row in prefill_selection_check(DEV) if DEV == "cuda" and not quick else []:  # the prefill selection kernel on the GPU
        rows.append({"check": "prefill selection bf16 vs twin", **row})

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (1500, 2300, 700)]
    budget_sel = dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=512)
    for dtype in ((torch.bfloat16,) if quick else (torch.bfloat16, torch.float32)) if DEV == "cuda" else (torch.float32,):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        toks = {}
        runs = [("sparda", "sparda", True, "bf16"), ("sparda-eager", "sparda", False, "bf16"),
                ("sparda-no-prefetch", "sparda-no-prefetch", True, "bf16")]
        if quick:
            runs.append(("sparda-int8", "sparda", True, "int8"))
        for name, method, graphs, kv in runs:
            llm = LLM.from_model(model, method=method, preset="small", forecast=forecast, offload=True,
                                 cuda_graphs=graphs, kv_dtype=kv, **budget_sel)
            llm.tokenizer = NoText()
            out_ = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=64, ignore_eos=True)
            toks[name] = [o.token_ids for o in out_]
        row = {"check": f"lookahead on the selection stream ({str(dtype).replace('torch.', '')})",
               "equal_to_no_prefetch": toks["sparda"] == toks["sparda-no-prefetch"],
               "graph_equal_eager": toks["sparda"] == toks["sparda-eager"],
               "mismatches_vs_no_prefetch": sum(a != b for x, y in zip(toks["sparda"], toks["sparda-no-prefetch"])
                                                for a, b in zip(x, y))}
        if "sparda-int8" in toks:
            same = [a == b for x, y in zip(toks["sparda"], toks["sparda-int8"]) for a, b in zip(x, y)]
            row["int8_token_agreement"] = round(sum(same) / len(same), 3)
        rows.append(row)
        log(row)
        del model, forecast
    (out / "check.json").write_text(json.dumps(rows, indent=1))
    return rows


#: ``SMOKE=1`` or ``sweep --smoke``: every part on the CPU with the tiny model at 2K (a test of
#: this script, no numbers)
SMOKE = bool(int(os.environ.get("SMOKE", "0")))


def _sweep(out: Path, budget: float, **kw) -> list[dict]:
    """One sweep; its report and plots go to ``/tmp/sweeps/<name>`` (the device returns at most
    8 files), its records to ``OUT/<name>.json`` and the environment to ``OUT/env.json``."""
    work = Path("/tmp/sweeps") / out.name
    base = dict(out=str(work), models=["minicpm-8b"], contexts=[131072], decode_steps=16, repeats=3, warmup_steps=3,
                breakdown_steps=0, prefill_tokens=2048, time_budget_s=budget, profile_steps=3)
    # timing_steps / overlap_steps unset: the copy timing and overlap runs cover the TPOT's 3 x 16 steps
    base.update(kw)
    if SMOKE:
        base.update(models=["tiny"], contexts=[2048], batches=[1, 2], decode_steps=2, repeats=1, device="cpu",
                    prefill_tokens=256, gpu_mem_gb=None, parity_steps=0, timing_steps=2, overlap_steps=2)
    recs = run_sweep(SweepConfig(**base), log=log)
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / f"{out.name}.json").write_text(json.dumps(recs, indent=1))
    (out.parent / "env.json").write_text((work / "env.json").read_text())
    return recs


ALL = ["sparda", "sparse-offload", "dense", "sparse", "sparda-no-prefetch", "infinigen"]
assert sorted(ALL) == sorted(SWEEP_METHODS)


def baselines(out: Path, budget: float, methods=("sparda", "sparse", *BASELINE_METHODS),
              name: str = "baselines") -> list[dict]:
    """The seeds' selectors (issue #13) beside ``sparse`` and offloaded ``sparda``: MiniCPM-8B
    shape, 128K, B4 and B16, on the GPU (their KV cache stays on the device), parity 16."""
    return _sweep(out / name, budget, methods=list(methods), batches=[4, 16], parity_steps=16)


def hitrate(out: Path, budget: float) -> list[dict]:
    return _sweep(out / "hitrate", budget, methods=["sparda", "sparse-offload"], batches=[4, 16],
                  hit_rates=[0.5, 0.7, 0.8, 0.9])


def b128(out: Path, budget: float) -> list[dict]:
    return _sweep(out / "b128", budget, methods=ALL, batches=[4, 8, 16, 24], parity_steps=64)


def b128sparda(out: Path, budget: float) -> list[dict]:
    """Offloaded sparda again (overlap timed on the steps its TPOT covers) and dense (its decode
    kernel): B4..B24, parity 64."""
    return _sweep(out / "b128sparda", budget, methods=["sparda", "dense"], batches=[4, 8, 16, 24],
                  parity_steps=64)


def cap80(out: Path, budget: float) -> list[dict]:
    recs = _sweep(out / "cap80-sparse", budget / 2, methods=["sparse"], batches=[8, 12, 14, 16], gpu_mem_gb=80)
    return recs + _sweep(out / "cap80-sparda", budget / 2, methods=["sparda"], batches=[16, 24], gpu_mem_gb=80)


def grid(out: Path, budget: float) -> list[dict]:
    recs = []
    done = lambda: (out / "grid.json").write_text(json.dumps(recs, indent=1))  # noqa: E731
    for ctx in (32768, 65536, 131072):
        for model in ("minicpm-8b", "llama-8b"):
            left = budget - (time.perf_counter() - T0)
            if left < 60:
                done()
                return recs
            batches = [1, 4, 8, 16, 24] if model == "minicpm-8b" or ctx <= 32768 else [1, 4]
            if model == "minicpm-8b" and ctx == 131072:
                batches = [1]  # B4..B24 are the b128 part
            recs += _sweep(Path("/tmp/sweeps/grid") / f"{model}-{ctx // 1024}k", left, models=[model],
                           contexts=[ctx], methods=ALL, batches=batches, repeats=2)
            done()
    return recs


def grid_long(out: Path, budget: float) -> list[dict]:
    """The long-context corner of ``grid`` under the current defaults: Llama-3-8B shape at 128K
    and 64K, B1 and B4, every method, then MiniCPM-8B shape at 128K B1."""
    recs = []
    for model, ctx, batches in (("llama-8b", 131072, [1, 4]), ("llama-8b", 65536, [1, 4]),
                                ("minicpm-8b", 131072, [1])):
        left = budget - (time.perf_counter() - T0)
        if left < 60:
            break
        recs += _sweep(out / f"grid-{model}-{ctx // 1024}k", left, models=[model], contexts=[ctx], methods=ALL,
                       batches=batches, repeats=2)
    return recs


def tune(out: Path, budget: float) -> list[dict]:
    """The gather grid and side-stream priority on trace points (128K B16, 32K B24)."""
    configs = [(ctas, warps, prio) for ctas, warps in ((32, 8), (16, 8), (64, 8), (32, 4)) for prio in (-1, 0)]
    return _tune(out / "tune.json", budget, [(131072, 16, None), (32768, 24, None)], configs, warm=3, timed=12)


def tune_synth(out: Path, budget: float) -> list[dict]:
    """The gather grid (CTAs x warps) and side-stream priority where the copy slows down inside the
    step (the 02b page): synthetic selections of hit rate 0.9 at 128K B16 and 0.7 at 128K B4, 48
    timed steps."""
    configs = [(ctas, warps, prio) for ctas, warps in ((64, 8), (32, 8), (128, 8), (64, 4), (128, 4), (16, 8))
               for prio in (-1, 0)]
    return _tune(out / "tune-synth.json", budget, [(131072, 16, 0.9), (131072, 4, 0.7)], configs, warm=6, timed=48)


def _tune(path: Path, budget: float, points, configs, warm: int, timed: int) -> list[dict]:
    """TPOT of offloaded ``sparda`` (MiniCPM-8B shape) for each configuration ``(ctas, warps,
    priority)`` at each point ``(context, batch, hit_rate)`` (``None``: the shipped trace),
    every configuration replaying the same steps from empty slots, the first one again at the
    end (the drift); rows to ``path``."""
    from sparda.bench import point as pt
    from sparda.bench.models import build_model, random_forecast, selection_config
    from sparda.bench.traces import (SHIPPED_TRACE, Replayer, load_traces, replay_masks, synthetic_masks,
                                     trace_for)
    from sparda.engine.graph_runner import DecodeRunner

    if SMOKE:
        points, configs, timed = [(2048, 2, points[0][2])], configs[:2], 2
    rows = []
    start = time.perf_counter()  # budget is what is left for this part, not since T0
    traces = load_traces(SHIPPED_TRACE)
    for context, batch, hit_rate in points:
        name = "tiny" if SMOKE else "minicpm-8b"
        model = build_model(name, DEV, torch.bfloat16 if DEV == "cuda" else torch.float32, context + 1024)
        selection = selection_config(name)
        llm = pt.make_llm(model, "sparda", selection, random_forecast(model))
        steps = warm + timed
        cache = llm.new_cache(batch, context + steps + 2)
        pt.fill_cache(cache, model.shape, batch, context, llm.device, llm.dtype)
        if hit_rate is None:
            masks = replay_masks(trace_for(traces, "sparda"), model.shape.num_layers, model.shape.num_kv_heads,
                                 selection, [context] * batch, steps, cache.num_blocks)
        else:
            masks = synthetic_masks(model.shape.num_layers, model.shape.num_kv_heads, selection, [context] * batch,
                                    steps, cache.num_blocks, hit_rate)
        replayer = Replayer(masks.to(llm.device))
        replayer.install(cache)
        state = {"i": 0}
        for ctas, warps, prio in configs + configs[:1]:
            if time.perf_counter() - start > budget - 30:
                break
            cache.engine.num_ctas, cache.engine.num_warps = ctas, warps
            if DEV == "cuda":
                cache.prefetcher.stream = torch.cuda.Stream(device=llm.device, priority=prio)
                cache.prefetcher.select_stream = torch.cuda.Stream(device=llm.device, priority=prio)
            runner = DecodeRunner(llm.model_runner, cache)
            runner.load(torch.zeros(batch, dtype=torch.long, device=llm.device),
                        torch.full((batch,), context, device=llm.device))
            def step():
                i = state["i"]
                replayer.step = i
                runner.positions.fill_(context + i)
                runner.step(context + i + 1)
                state["i"] = i + 1

            pt.restart(state, cache)
            for _ in range(warm):
                step()
            pt.sync(llm.device)
            t = time.perf_counter()
            for _ in range(timed):
                step()
            pt.sync(llm.device)
            rows.append({"part": path.stem, "model": name, "context": context, "batch": batch,
                         "target_hit_rate": hit_rate, "num_ctas": ctas,
                         "num_warps": warps, "stream_priority": prio,
                         "tpot_ms": round((time.perf_counter() - t) / timed * 1e3, 3)})
            log(rows[-1])
            del runner
        del cache, llm, model
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    path.write_text(json.dumps(rows, indent=1))
    return [{"check": r} for r in rows]


#: pinned host memory the KV of a kvquant point may take (issue #14: batch at 128K within 96 GiB)
KVQUANT_HOST_GIB = 96.0
#: the kvquant sweeps' step counts (the cache capacity, hence the largest batch, depends on them)
KVQUANT_STEPS = dict(decode_steps=16, repeats=3, warmup_steps=3, breakdown_steps=0, profile_steps=3,
                     overlap_steps=0, parity_steps=0)


def kvquant_batches(model: str = "minicpm-8b", context: int = 131072) -> dict:
    """Largest batch per KV dtype of the offloaded methods at ``model``'s shape and ``context``
    whose host KV (:func:`sparda.bench.point.kv_need_bytes`: 31 offloaded layers, whole
    blocks, codes + fp32 scales) fits in :data:`KVQUANT_HOST_GIB`, plus the bytes per token."""
    from sparda.bench import point as pt
    from sparda.bench.models import model_spec, selection_config
    from sparda.kernels.quant import token_bytes
    from sparda.model.llama import ModelShape

    spec = model_spec(model)
    shape = ModelShape(spec.layers, spec.q_heads, spec.kv_heads, spec.head_dim, spec.hidden, context)
    sel = selection_config(model)
    cap = pt.point_capacity(context, SweepConfig(**KVQUANT_STEPS))
    out = {"model": model, "context": context, "capacity": cap, "host_limit_gib": KVQUANT_HOST_GIB}
    for kv in ("bf16", "int8", "int4", "mixed"):
        batch = pt.largest_batch("sparda", shape, sel, kv, torch.bfloat16, cap, KVQUANT_HOST_GIB * 2**30)
        row = pt.kv_need_bytes("sparda", shape, sel, kv, torch.bfloat16, 1, cap)[1]
        out[kv] = {"largest_batch": batch, "host_gib_per_row": round(row / 2**30, 4),
                   "host_gib_at_largest": round(batch * row / 2**30, 2),
                   "kv_bytes_per_token": 2 * shape.num_layers * shape.num_kv_heads
                   * token_bytes(shape.head_dim, kv, torch.bfloat16)}
    return out


def _codes(buf) -> torch.Tensor:
    """The integer codes ``[..., d]`` int16 of a :class:`~sparda.kernels.quant.QuantizedKV`
    (int4 unpacked: element ``2i`` from the low nibble)."""
    x = buf.data
    if buf.kv_dtype == "int4":
        x = torch.stack([x & 15, x >> 4], -1).flatten(-2)
    return x.to(torch.int16)


def kvquant_codes_check(quick: bool = False) -> list[dict]:
    """The fused RoPE + append kernel (``DeviceKVCache.rope_append``: Triton on CUDA)
    against the unfused append (``apply_rope`` in the model dtype, then
    ``DeviceKVCache.append``: quantised by PyTorch) fed the **same** stacked projection
    rows: no GEMM in between, so any difference is the kernel's. MiniCPM4.1-8B's attention
    shape (2 KV heads, G = 16, d = 128, one Forecast head), B = 8, 16 decode steps from
    lengths around 200 across block boundaries, keys with a per-channel offset and one
    outlier channel; bf16 and fp32, int8 and int4. Reports the fraction of decoded codes
    that differ, the largest code difference, whether the ``(step, lo)`` scales and the
    rotated queries are equal. A correct kernel in bf16: 0 codes, equal scales and queries
    (its RoPE rounds to bf16 after each operation, as PyTorch; tests/kernels/test_rope_append.py
    checks the same under the interpreter, made to round to nearest even as the GPU does).
    In fp32 the compiler may contract the RoPE into an FMA, so a key may differ by an ulp
    and a code by one, rarely; more than one code, or any difference in bf16, is a defect."""
    from sparda.cache.device import DeviceKVCache
    from sparda.config import SelectionConfig
    from sparda.kernels.reference import apply_rope
    from sparda.model.llama import StepInfo

    b, hk, g, d, nf, steps = (8, 2, 16, 128, 1, 16) if not quick else (2, 2, 4, 64, 1, 6)
    cfg = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, local_blocks=2)
    cap = 512
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for kv in ("int8", "int4"):
            gen = torch.Generator().manual_seed(7)
            lengths = torch.randint(180, 260, (b,), generator=gen)
            fused_c, ref_c = (DeviceKVCache(1, b, hk, d, cap, cfg, dtype, DEV, kv_dtype=kv) for _ in range(2))
            for row in range(b):  # the same random prefill (unfused append) into both
                n = int(lengths[row])
                kk, vv = (torch.randn(1, hk, n, d, generator=gen).to(DEV, dtype) for _ in range(2))
                step = StepInfo("prefill", torch.tensor([row], device=DEV), torch.arange(n, device=DEV).view(1, -1),
                                torch.tensor([n], device=DEV), None, None, n)
                for c in (fused_c, ref_c):
                    c.append(0, kk, vv, step)
            offset = torch.randn(d, generator=gen) * 2
            offset[5] = 40.0  # an outlier channel
            q_equal = True
            for i in range(steps):
                pos = (lengths + i).to(DEV)
                qkv = torch.randn(b, (hk * g + (2 + nf) * hk) * d, generator=gen) * 3
                k_at = hk * g * d
                qkv[:, k_at:k_at + hk * d] += offset.repeat(hk)
                theta = pos.view(-1, 1).float().cpu() * (1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d))
                emb = torch.cat([theta, theta], -1)
                qkv = qkv.to(DEV, dtype)
                cos, sin = (t.view(b, 1, 1, d).to(DEV, dtype) for t in (emb.cos(), emb.sin()))
                step = StepInfo("decode", torch.arange(b, device=DEV), pos.view(-1, 1), pos + 1, cos, sin, cap)
                parts = qkv.view(b, hk * g + (2 + nf) * hk, 1, d)
                q = apply_rope(parts[:, :hk * g], cos, sin)[:, :, 0]
                k = apply_rope(parts[:, hk * g:hk * g + hk], cos, sin)
                ref_c.append(0, k, parts[:, hk * g + hk:hk * g + 2 * hk], step)
                q_out, _ = fused_c.rope_append(0, qkv, step, g, nf)
                q_equal &= bool(torch.equal(q_out, q))
            row = {"check": f"fused RoPE + {kv} append kernel == unfused append, same inputs "
                            f"({str(dtype).replace('torch.', '')}, G={g}, d={d})"}
            for name, got, want in (("k", fused_c.k[0], ref_c.k[0]), ("v", fused_c.v[0], ref_c.v[0])):
                diff = (_codes(got).int() - _codes(want).int()).abs()
                row[f"{name}_codes_differing"] = round(diff.gt(0).float().mean().item(), 6)
                row[f"{name}_max_code_diff"] = int(diff.max())
                row[f"{name}_scales_equal"] = bool(torch.equal(got.scale, want.scale))
            row["queries_equal"] = q_equal
            row["equal"] = q_equal and all(row[f"{n}_max_code_diff"] == 0 and row[f"{n}_scales_equal"]
                                           for n in ("k", "v"))
            rows.append(row)
            log(row)
    return rows


def kvquant_check(quick: bool = False) -> list[dict]:
    """Fused vs unfused decode: offloaded ``sparda`` on the random 4-layer model, greedy
    tokens of each (the fused step's RoPE + append kernel quantises each token; the
    unfused step quantises in PyTorch), with an unquantised cache as the control, bf16 and
    fp32 (fp32 only off CUDA). The GEMMs differ (stacked vs separate projections), so a
    bf16 value near a rounding boundary of the quantiser may land one code apart:
    agreement is reported, not required; compare it with the control's. In fp32 the
    unquantised fused step gave the unfused tokens on the H200
    (design §6)."""
    from sparda.bench.models import random_forecast
    from sparda.engine.llm import LLM
    from sparda.model.fused import FusedDecoder


    gen = torch.Generator().manual_seed(1)
    lengths, new, sel = (((1500, 2300, 700), 64, dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4,
                                                       dense_len=512)) if not quick else
                         ((300, 420, 150), 12, dict(block_size=16, init_blocks=1, local_blocks=2, topk_blocks=4,
                                                    dense_len=128)))
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in lengths]
    rows = []
    for dtype in (torch.bfloat16, torch.float32) if DEV == "cuda" else (torch.float32,):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        for kv in ("bf16", "int8", "int4"):  # bf16: the unquantised cache (the model dtype), the control
            toks, used = {}, {}
            for fused in (True, False):
                llm = LLM.from_model(model, method="sparda", preset="small", forecast=forecast, offload=True,
                                     kv_dtype=kv, fused_decode=fused, **sel)
                if fused and DEV != "cuda":  # the CUDA choice, on the CPU (kernel twins)
                    llm.model_runner._fused_checked, llm.model_runner._fused = True, FusedDecoder(model, llm.method)
                llm.tokenizer = NoText()
                out_ = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=new, ignore_eos=True)
                toks[fused] = [o.token_ids for o in out_]
                used[fused] = llm.model_runner.fused_decoder() is not None
            same = [a == b for x, y in zip(toks[True], toks[False]) for a, b in zip(x, y)]
            first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                     for x, y in zip(toks[True], toks[False])]
            row = {"check": f"fused == unfused decode, sparda offloaded, KV {kv if kv != 'bf16' else 'unquantised'} "
                            f"({str(dtype).replace('torch.', '')})",
                   "fused_step_used": used[True] and not used[False], "tokens_equal": all(same),
                   "token_agreement": round(sum(same) / len(same), 4), "first_mismatch_per_prompt": first}
            rows.append(row)
            log(row)
        del model, forecast
    return rows


def kvquant_verdict(recs: list[dict], batches: dict) -> dict:
    """Issue #14's criterion from the ``sparda`` records: int8's largest measured batch >= 1.8x
    bf16's and int8's best decode tok/s > bf16's best (``None`` where a dtype has no ok point)."""
    ok = [r for r in recs if r.get("status") == "ok" and r["method"] == "sparda"]
    dtypes = ("bf16", "int8", "int4")
    best = {kv: max((r["decode_tok_s"] for r in ok if r.get("kv_dtype") == kv), default=None) for kv in dtypes}
    top = {kv: max((r["batch"] for r in ok if r.get("kv_dtype") == kv), default=None) for kv in dtypes}
    ratio = top["int8"] / top["bf16"] if top["int8"] and top["bf16"] else None
    faster = best["int8"] > best["bf16"] if best["int8"] and best["bf16"] else None
    verdict = "NOT MEASURED" if ratio is None or faster is None else (
        "PASS" if ratio >= 1.8 and faster else "FAIL")
    return {"check": "issue #14: int8 sparda at >= 1.8x the batch of bf16 at 128K, best tok/s above bf16's",
            "largest_batch_by_bytes": {kv: batches[kv]["largest_batch"] for kv in dtypes},
            "largest_ok_batch": top, "best_decode_tok_s": best,
            "batch_ratio_int8_bf16": None if ratio is None else round(ratio, 3), "int8_faster": faster,
            "verdict": verdict if not SMOKE else f"{verdict} (SMOKE: tiny model, batches 1-2, not a measurement)"}


def kvquant(out: Path, budget: float) -> list[dict]:
    t0 = time.perf_counter()
    rows = kvquant_codes_check(quick=SMOKE) + kvquant_check(quick=SMOKE)
    batches = kvquant_batches()
    for kv in ("bf16", "int8", "int4"):
        b = batches[kv]
        log(f"kvquant: {kv}: {b['kv_bytes_per_token']:,} B of KV per token, {b['host_gib_per_row']:.3f} GiB of host "
            f"KV per 128K row -> largest batch {b['largest_batch']} ({b['host_gib_at_largest']} GiB <= "
            f"{KVQUANT_HOST_GIB:g} GiB)")
    rows.append({"check": "kvquant largest batches by bytes", **batches})
    top = {kv: batches[kv]["largest_batch"] for kv in ("bf16", "int8", "int4")}
    plan = [("bf16", ["sparda", "sparse-offload"], [top["bf16"]]),
            ("int8", ["sparda", "sparse-offload"], sorted({top["bf16"], top["int8"]})),
            ("int4", ["sparda"], [top["int4"]])]
    recs = []
    for kv, methods, batch_list in plan:
        left = budget - (time.perf_counter() - t0)
        if left < 45:
            log(f"kvquant {kv}: skipped (budget)")
            continue
        recs += _sweep(out / f"kvquant-{kv}", left, methods=methods, batches=batch_list, kv_dtype=kv,
                       host_mem_gb=KVQUANT_HOST_GIB, **KVQUANT_STEPS)
    rows.append(kvquant_verdict(recs, batches))
    log(rows[-1])
    (out / "kvquant-check.json").write_text(json.dumps(rows, indent=1))
    return rows + recs


def cold_slots_check(batch: int = 24, heads: int = 2, d: int = 128, block: int = 64) -> dict:
    """The mixed fetch's dequantisation of staged cold blocks (``kernels.dequantize_cold_slots``)
    on the GPU: the Triton launch and the PyTorch twin on the same bf16 slots, each against
    float64 (largest error in bf16 ulps of max(|value|, |lo|): about 0.5, one rounding to bf16,
    whether or not the multiply-add is fused; untouched slots equal), and both timed at the
    MiniCPM-8B shape's staging buffer (``S`` slots of the default slot factor at 128K) with
    ``cold_fraction`` of the slots receiving a cold block: ms per layer and x31 layers."""
    from sparda.bench.models import selection_config
    from sparda.cache.offload import spare_slot_count
    from sparda.kernels import quant, twins
    from sparda.bench.timing import cuda_ms
    from sparda.kernels.cold_slots import dequantize_cold_triton

    slots = spare_slot_count(131072, selection_config("minicpm-8b"), 1.5)
    gen = torch.Generator(device=DEV).manual_seed(5)
    staged = [quant.QuantizedKV.quantize(torch.randn(batch, heads, slots, block, d, device=DEV, generator=gen),
                                         "int4") for _ in range(2)]
    row = {"check": "cold slots kernel vs twin", "batch": batch, "kv_heads": heads, "slots": slots}
    for frac in (0.05, 0.3, 1.0):
        cold = torch.randint(0, 2048, (batch, heads, slots), device=DEV, generator=gen)
        cold[torch.rand(batch, heads, slots, device=DEV, generator=gen) >= frac] = -1
        base = [torch.randn(batch, heads, slots + 1, block, d, device=DEV, generator=gen).bfloat16() for _ in range(2)]
        got, ref = [x.clone() for x in base], [x.clone() for x in base]
        dequantize_cold_triton(staged[0], staged[1], got[0][:, :, :slots], got[1][:, :, :slots], cold)
        twins.dequantize_cold_reference(staged[0], staged[1], ref[0][:, :, :slots], ref[1][:, :, :slots], cold)
        take = (cold >= 0)

        def ulps(out, st) -> float:
            """Largest error against float64 in bf16 ulps of max(|value|, |lo|): ``q * step + lo``
            in fp32 cancels near 0, where an ulp of the value itself would be no scale."""
            exact = quant.dequantize(st.data, st.scale.double(), "int4", torch.float64)
            size = torch.maximum(exact.abs(), st.scale[..., 1:].double().abs())[take]
            ulp = torch.exp2(torch.floor(torch.log2(size.clamp_min(1e-30))) - 7)
            return float(((out[:, :, :slots][take].double() - exact[take]).abs() / ulp).max())

        errs = {name: max(ulps(o, st) for o, st in zip(outs, staged)) for name, outs in (("triton", got), ("twin", ref))}
        same = all(torch.equal(g[:, :, :slots][~take], b[:, :, :slots][~take]) and torch.equal(g[:, :, slots], b[:, :, slots])
                   for g, b in zip(got, base))
        k_dst, v_dst = got[0][:, :, :slots], got[1][:, :, :slots]
        tri = cuda_ms(lambda: dequantize_cold_triton(staged[0], staged[1], k_dst, v_dst, cold), reps=20)
        twin = cuda_ms(lambda: twins.dequantize_cold_reference(staged[0], staged[1], k_dst, v_dst, cold), reps=20)
        row[f"cold {frac}"] = {"triton_max_ulps": round(errs["triton"], 3), "twin_max_ulps": round(errs["twin"], 3),
                               "untouched_equal": same, "triton_ms": round(tri, 4),
                               "twin_ms": round(twin, 4), "triton_ms_x31": round(31 * tri, 3),
                               "twin_ms_x31": round(31 * twin, 3)}
    return row


def kvmixed(out: Path, budget: float) -> list[dict]:
    """``--kv-dtype mixed`` (issue #14, design §6.1) on the GPU: MiniCPM-8B shape, 128K,
    offloaded ``sparda``: mixed at bf16's
    largest batch (the same rows as bf16 and int4 there) and at its own largest batch by bytes
    (int4 store + bf16 hot pool <= :data:`KVQUANT_HOST_GIB`), int4 at mixed's largest for
    comparison; records carry ``pool_misses`` in their offload stats."""
    t0 = time.perf_counter()
    batches = kvquant_batches()
    rows = [{"check": "kvmixed largest batches by bytes", **batches}]
    log(rows[-1])
    if DEV == "cuda":
        rows.append(cold_slots_check())
        log(rows[-1])
    top_bf16, top_mixed = batches["bf16"]["largest_batch"], batches["mixed"]["largest_batch"]
    plan = [("mixed", sorted({top_bf16, top_mixed})), ("int4", [top_mixed])]
    recs = []
    for kv, batch_list in plan:
        left = budget - (time.perf_counter() - t0)
        if left < 45:
            log(f"kvmixed {kv}: skipped (budget)")
            continue
        recs += _sweep(out / f"kvmixed-{kv}", left, methods=["sparda"], batches=batch_list, kv_dtype=kv,
                       host_mem_gb=KVQUANT_HOST_GIB, **KVQUANT_STEPS)
    (out / "kvmixed-check.json").write_text(json.dumps(rows, indent=1))
    return rows + recs


def spare(out: Path, budget: float) -> list[dict]:
    """Spare slots off (``slot_factor`` 1) and on (1.5): the same points, one sweep each."""
    recs = []
    plan = [("spare-1.0-128k", 1.0, dict(methods=["sparda", "sparse-offload"], batches=[4, 16, 24])),
            ("spare-1.5-128k", 1.5, dict(methods=["sparda", "sparse-offload"], batches=[4, 16, 24])),
            ("spare-2.0-128k", 2.0, dict(methods=["sparda"], batches=[16, 24])),
            ("spare-1.0-32k", 1.0, dict(methods=["sparda"], batches=[24], contexts=[32768])),
            ("spare-1.5-32k", 1.5, dict(methods=["sparda"], batches=[24], contexts=[32768]))]
    for name, factor, kw in plan:
        left = budget - (time.perf_counter() - T0)
        if left < 60:
            log(f"{name}: skipped (budget)")
            break
        recs += _sweep(out / name, left, slot_factor=factor, parity_steps=16, **kw)
    return recs


def recheck(out: Path, budget: float) -> list[dict]:
    """Under the defaults (spare slots 1.5, the exposed wait split into selection and transfer):
    the ``hitrate`` points, then offloaded ``sparda`` at 64K and 32K B24 (the roofline FAIL of the
    01b page and the balanced point)."""
    t0 = time.perf_counter()
    recs = hitrate(out, budget - 100)
    left = budget - (time.perf_counter() - t0)
    if left < 60:
        log("recheck 64K/32K: skipped (budget)")
        return recs
    return recs + _sweep(out / "recheck-b24", left, methods=["sparda"], batches=[24], contexts=[65536, 32768],
                         parity_steps=16)


PARTS = {"check": check, "recheck": recheck, "tune": tune, "quick": lambda out, budget: check(out, budget, quick=True),
         "hitrate": hitrate, "baselines": baselines, "quest": lambda out, budget: baselines(out, budget, ["quest"], "quest"), "b128": b128, "b128sparda": b128sparda, "cap80": cap80, "grid": grid, "grid-long": grid_long,
         "kvquant": kvquant, "kvmixed": kvmixed, "spare": spare, "tune-synth": tune_synth}


# ------------------------------------------------------------------------------- report
def build(inputs, out) -> tuple[Path, int, int]:
    """Merge ``inputs`` and write the report into ``out``; returns ``(report path, kept, dropped)``.

    Raises:
        SpardaError: a bad input (see :func:`sparda.bench.records.load_runs`) or output path,
            checked before anything is written.
    """
    from sparda.bench.records import dedup, load_runs, merged_env
    from sparda.bench.report import write_report
    from sparda.io import atomic_write, check_output_dir

    out = check_output_dir(out, "--out")
    entries, runs = load_runs(inputs)
    records, dropped = dedup(entries)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.json", json.dumps(records, indent=1, default=str))
    return write_report(records, merged_env(runs), out), len(records), dropped


# ---------------------------------------------------------------------------- commands
def cmd_sweep(args) -> int:
    global SMOKE
    SMOKE = SMOKE or args.smoke
    out_dir, budget_s = Path(args.out), args.budget_s
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = []
    for part in args.parts:
        left = budget_s - (time.perf_counter() - T0)
        if left < 45:
            log(f"{part}: skipped (budget)")
            continue
        t = time.perf_counter()
        recs = PARTS[part](out_dir, left)
        summary.append((part, recs, time.perf_counter() - t))
    for part, recs, sec in summary:
        print(f"== {part} ({sec:.0f} s)")
        for r in recs:
            if "check" in r:
                print(r)
                continue
            method = r["method"] if r.get("kv_dtype", "bf16") == "bf16" else f"{r['method']} {r['kv_dtype']}"
            if r.get("slot_factor") not in (None, 1.5):
                method += f" x{r['slot_factor']:g}"
            print(f"{r['model']:<10} {r['context'] // 1024:>4}K {method:<18} B{r['batch']:<3} "
                  f"{r['status']:<7} {r.get('decode_tok_s') or 0:>8.1f} tok/s  TPOT {r.get('tpot_ms') or 0:>7.2f}"
                  f"  kern {r.get('gpu_kernel_ms') or 0:>6.2f}  n {r.get('kernels_per_step') or 0:>5.0f}"
                  f"  H* {r.get('target_hit_rate')}  hit {r.get('hit_rate')}  exp {r.get('exposed_wait_ms')} xfer {r.get('exposed_transfer_ms')}"
                  f" / {r.get('timed_step_ms')} tl {len(r.get('lookahead_timeline_us') or [])}"
                  f"  C {r.get('compute_alone_ms')}  T {r.get('transfer_alone_ms')}"
                  f"  eff {r.get('overlap_efficiency')}  par {r.get('graph_tokens_equal')}")
    return 0


def cmd_graphs(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "parity":
        graphs_parity(out)
    elif args.part == "bundled":
        graphs_bundled(out, args.gguf)
    else:
        recs = graphs_sweep(out, args.budget_s, args.names)
        for r in recs:
            print(r["method"], r["batch"], r["status"], r.get("decode_tok_s"), r.get("tpot_ms"),
                  r.get("gpu_kernel_ms"), r.get("kernels_per_step"), r.get("graph_tokens_equal"))
    return 0


def cmd_fused(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if args.part == "kernels":
        fused_kernels(out)
    elif args.part == "parity":
        fused_parity(out)
    else:
        fused_profile(out, args.context, args.batch, args.methods or ["sparda", "sparse-offload", "dense"])
    print(f"[{args.part}: {time.perf_counter() - t0:.0f} s]")
    return 0


def cmd_profile(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    context, batch, kv_dtype = args.context, args.batch, args.kv_dtype
    methods = args.methods or ["sparda", "sparse-offload", "dense"]
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
    return 0


def cmd_report(args) -> int:
    from sparda.errors import SpardaError

    try:
        path, kept, dropped = build(args.inputs, args.out)
    except SpardaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"wrote {path} ({kept} points; {dropped} older duplicates dropped)")
    return 0


def _doc_parser(sub, name: str, doc: str, short: str, **kw) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=short, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                          **kw)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_decode.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = _doc_parser(sub, "sweep", SWEEP_DOC, "parts of the decode grid (sweeps and checks) within a time budget")
    p.add_argument("out", metavar="OUT", help="output directory")
    p.add_argument("budget_s", metavar="BUDGET_S", type=float, help="seconds for all the parts together")
    p.add_argument("parts", nargs="+", metavar="PART", choices=list(PARTS), help=f"one of: {', '.join(PARTS)}")
    p.add_argument("--smoke", action="store_true", help="every part on the CPU with the tiny model (as SMOKE=1)")
    p.set_defaults(func=cmd_sweep)

    p = _doc_parser(sub, "graphs", GRAPHS_DOC, "CUDA graphs vs eager: parity, speed-up, the 128K sweep")
    parts = p.add_subparsers(dest="part", required=True, metavar="PART")
    q = parts.add_parser("parity", help="random model, every method, bf16 + fp32: graph tokens == eager tokens")
    q.add_argument("out", metavar="OUT", help="output directory (parity.json)")
    q = parts.add_parser("bundled", help="the bundled model on a ~7K-token passkey prompt, sparda and dense")
    q.add_argument("out", metavar="OUT", help="output directory (bundled.json)")
    q.add_argument("gguf", metavar="GGUF", help="the bundled model (GGUF file or any model path sparda accepts)")
    q = parts.add_parser("sweep", help="MiniCPM-8B shape, 128K: every method at B4 / B8, offloaded at B16 / B24")
    q.add_argument("out", metavar="OUT", help="output directory (sweep.json, sweep-<name>/)")
    q.add_argument("budget_s", metavar="BUDGET_S", type=float, nargs="?", default=480.0,
                   help="seconds for all sweeps [480]")
    q.add_argument("names", nargs="*", metavar="NAME",
                   help=f"only these sweeps, of {', '.join(s[0] for s in GRAPH_SWEEPS)} [all]")
    p.set_defaults(func=cmd_graphs)

    p = _doc_parser(sub, "fused", FUSED_DOC, "the fused decode step: kernels vs twins, parity, profile (CUDA)")
    parts = p.add_subparsers(dest="part", required=True, metavar="PART")
    q = parts.add_parser("kernels", help="bf16/fp32 kernels vs PyTorch twins (real tl.dot)")
    q.add_argument("out", metavar="OUT", help="output directory (kernels.json)")
    q = parts.add_parser("parity", help="every method: fused graphs vs fused eager vs unfused")
    q.add_argument("out", metavar="OUT", help="output directory (parity.json)")
    q = parts.add_parser("profile", help="kernels by name of a replayed step, per method")
    q.add_argument("out", metavar="OUT", help="output directory (profile-b<BATCH>.json)")
    q.add_argument("context", metavar="CONTEXT", type=int, nargs="?", default=131072, help="tokens [131072]")
    q.add_argument("batch", metavar="BATCH", type=int, nargs="?", default=4, help="rows [4]")
    q.add_argument("methods", nargs="*", metavar="METHOD", help="[sparda sparse-offload dense]")
    p.set_defaults(func=cmd_fused, needs_cuda=True)

    p = _doc_parser(sub, "profile", PROFILE_DOC, "GPU time of a replayed decode step by kernel name (CUDA)")
    p.add_argument("out", metavar="OUT", help="output directory (profile-<method>-b<B>[-<kv_dtype>].json)")
    p.add_argument("context", metavar="CONTEXT", type=int, nargs="?", default=131072, help="tokens [131072]")
    p.add_argument("batch", metavar="BATCH", type=int, nargs="?", default=4, help="rows [4]")
    p.add_argument("methods", nargs="*", metavar="METHOD", help="[sparda sparse-offload dense]")
    p.add_argument("--kv-dtype", default=os.environ.get("KV_DTYPE", "bf16"),
                   help="KV cache dtype: bf16, int8, int4 (docs/kv_quant.md) [$KV_DTYPE or bf16]")
    p.set_defaults(func=cmd_profile, needs_cuda=True)

    p = _doc_parser(sub, "report", REPORT_DOC, "merge sweep records into one report: markdown, plots (CPU)")
    p.add_argument("inputs", nargs="+", metavar="RUN_DIR_OR_JSON", help="sweep outputs to merge")
    p.add_argument("--out", required=True, help="output directory for results.json, report.md and the plots")
    p.set_defaults(func=cmd_report)
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if getattr(args, "needs_cuda", False) and not torch.cuda.is_available():
        ap.error(f"{args.command} needs a CUDA GPU")
    unknown = [n for n in getattr(args, "names", None) or () if n not in [s[0] for s in GRAPH_SWEEPS]]
    if unknown:
        ap.error(f"graphs sweep: unknown NAME {', '.join(unknown)}; choose from "
                 f"{', '.join(s[0] for s in GRAPH_SWEEPS)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
