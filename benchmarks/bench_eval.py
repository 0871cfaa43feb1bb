"""Accuracy evaluation: one entry point, one subcommand per measurement (docs/results/accuracy.md).

Run from the repository root::

    python3 benchmarks/bench_eval.py run OUT [--time-budget-s 550] [--model GGUF] [--plans ...]  # the full eval (GPU)
    python3 benchmarks/bench_eval.py doc OUT [--doc docs/results/accuracy.md]  # regenerate docs/results/accuracy.md from OUT
    python3 benchmarks/bench_eval.py dense-heads --prompts SEED:DEPTH,...  # passkey with/without dense heads (CPU)
    python3 benchmarks/bench_eval.py needle-probe --seed S --depth D       # where selection loses a pass key (CPU)
    python3 benchmarks/bench_eval.py passkey-demo MODEL OUT_DIR [-- EXTRA]  # the CLI passkey demo on a GPU

``python3 benchmarks/bench_eval.py SUBCOMMAND --help`` describes each one. Outputs: the
resumable ``OUT/<plan dir>/results.jsonl``, ``results.json``, ``progress.json`` and
``OUT/calls.json`` (``run``), the page and its plots (``doc``), JSON rows with ``--json``
(``dense-heads``), text logs under ``OUT_DIR`` (``passkey-demo``).

The subcommands replace the former scripts ``eval_gpu.py`` (now ``run``),
``accuracy_doc.py`` (``doc``), ``passkey_dense_heads.py`` (``dense-heads``),
``passkey_needle_probe.py`` (``needle-probe``) and ``passkey_gpu.sh`` (``passkey-demo``),
with the same measurements and output files.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
import types
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.errors import SpardaError  # noqa: E402
from sparda.eval.runner import EvalPlan, run_eval  # noqa: E402
from sparda.io import atomic_write  # noqa: E402

RUN_DOC = """\
The full `sparda eval` of issue #12 on one GPU, resumable across calls (docs/results/accuracy.md).

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/bench_eval.py run OUT [--time-budget-s 550] [--commit SHA] [--model GGUF]

The plans run in order, all resumable (``results.jsonl`` per finished sample), sharing
one time budget measured from the start of this call:

1. ``OUT/main``: every generation task plus ``selection`` at 2,048 / 4,096 / 7,680 tokens,
   30 samples per cell (needle depths 0-100 %), methods dense, sparse, oracle, sparda,
   sparda-random, infinigen, batches of 16 prompts;
2. ``OUT/main`` too: ``ppl`` (perplexity / top-1 agreement / KL against dense) on 16
   held-out windows at 4,096 and 7,680 tokens (at 2,048 every query falls under the
   ``small`` preset's dense fallback, so ppl would equal dense's);
3. ``OUT/budget``: the budget sweep, ``passkey`` (30 samples) and ``ppl`` (8 windows)
   at 7,680 tokens for sparse, sparda, oracle and infinigen at 5, 10, 17, 25 and 50 % of
   the context (dense once, as the reference);
4. ``kvquant`` (issue #14), ``OUT/kv-<dtype>`` for KV-cache dtypes bf16, int8 and int4:
   ``passkey`` (30 samples) at 7,680 tokens and ``ppl-decode`` (16 windows, their last 512
   tokens fed through decode, against dense over an unquantised cache) at 4,096 and 7,680
   tokens, for sparda and dense (:func:`kvquant_plans`); ``--kv-dtypes mixed --kv-methods sparda``
   adds ``OUT/kv-mixed`` (offloaded methods only: ``sparda`` offloads on CUDA by default; a
   method whose cache stays on the device is refused before anything runs);
5. ``OUT/baselines``: the seeds' selectors of issue #13 (docs/baselines.md: streaming, h2o,
   quest, snapkv, shallow) on the tasks, lengths, samples and ppl windows of plans 1 and 2
   (the same prompts: the plans share seed, depths, text and model), in their own
   directory so that ``OUT/main`` stays as it is; ``bench_eval.py doc`` puts them
   in main's tables, paired against main's dense and sparda (:func:`baseline_plans`);
6. ``OUT/selectors``: the block-sparse selectors sparse, oracle, sparda, sparda-random and
   infinigen once more on plan 1's generation tasks, lengths and samples (the same prompts),
   with ``dense_heads="none"``: plan 1 runs every method with the calibrated dense heads of
   design §3.7 (``auto``), which read their whole KV in decode and lift every selector; this
   plan measures the selectors alone (:func:`selector_plans`; ``ppl`` and ``selection`` are
   left out: dense heads act in decode only, and both score prefill / the bare selection).

``--workers N`` runs the plans of up to ``N`` output directories at once, each directory's
plans in order in a child process (:func:`run_workers`): one prompt's prefill leaves the GPU
mostly idle while the CPU dispatches its kernels (about 45 ms per prompt on the H200 for
the bundled model, whatever its length), so a second process fills it; the records are the
same, their timings those of processes sharing the GPU.

Each call appends its device, date, commit and wall time to ``OUT/calls.json`` and
prints a short table. When the budget runs out the plans stop between batches; copy
``OUT`` back, and the next call with the same ``OUT`` continues where this one stopped.
``python3 benchmarks/bench_eval.py doc OUT`` then regenerates ``docs/results/accuracy.md``.
Options after ``OUT`` shrink the plans (CPU smoke runs, tests); ``--plans`` runs only some
(``--plans kvquant`` adds the KV-dtype directories to an ``OUT`` whose other plans are
done, ``--plans baselines`` the seeds' selectors, ``--plans selectors`` the selectors without
dense heads); ``--estimate`` prints the work of the plans and a run-time estimate, in all and per
plan, without loading a model.
"""

#: Where the ``doc`` page lives: with the other measured results, plots beside it in accuracy/gpu/.
DEFAULT_DOC = Path(__file__).resolve().parents[1] / "docs" / "results" / "accuracy.md"

DOC_DOC = """\
Regenerate docs/results/accuracy.md from a ``bench_eval.py run`` output directory.

Usage (from the repository root, after copying the GPU run's OUT back here):

    python3 benchmarks/bench_eval.py doc OUT [--doc docs/results/accuracy.md]

Writes the page atomically and copies the plots to docs/results/accuracy/gpu/{main,budget}/.
"""

DENSE_HEADS_DOC = """\
Pass key at 7,680 tokens with and without dense retrieval heads (design §3.7; CPU, fp32).

Rebuilds ``sparda eval`` passkey prompts (held-out Emma, task ``passkey``, the seeds and
depths of ``--prompts``; below, the three failing prompts of design §3.7) and generates
greedily with each ``--methods`` entry under
``--dense-heads`` none and auto (the shipped calibration), printing per prompt whether the
answer holds the key and the fraction of KV blocks read per decode step.

    python3 benchmarks/bench_eval.py dense-heads --prompts 1:0.25,16:0.25,21:0.25
    python3 benchmarks/bench_eval.py dense-heads --budget-pct 5 \\
        --prompts 2:0.5,7:0.5,12:0.5,27:0.5,8:0.75,13:0.75

One batch of prompts per (method, setting); about 2-3 minutes per batch of six on two cores.
"""

NEEDLE_PROBE_DOC = """\
Where block selection loses a pass key: per decode step, layer and KV head (CPU, fp32).

Rebuilds one ``sparda eval`` passkey prompt (task ``passkey``, its seed and depth, as
``runs/eval-gpu/*/results.jsonl`` record them), generates greedily with ``--method`` and,
at every decode step and every (layer, KV head) whose exact attention puts at least
``--min-mass`` of the query group's mass on a block holding a pass-key token, prints

* ``mass``: that block's share of the group's exact attention (the step's own query over
  every cached key: what dense attention would read there);
* ``rank oracle`` / ``rank ck``: the block's rank among the top-k candidates (neither sink
  nor local) under exact attention mass and under ``sparse``'s compressed-key score
  (group-summed softmax over the mean-pooled keys, max-pooled onto blocks, design §3.2-3.3);
* ``sel``: whether the method's own selection held it.

With ``--check`` (``sparse`` only), every decode selection is also rebuilt from the cached
keys by an independent float64 brute force (window means, softmax, block max over
overlapping windows, sinks + local + top-k with ties to the lower block) and compared
with the runtime's mask. ``--dense-heads L:H,...`` makes those (layer, KV head) pairs read
every block in decode (the causal test: does the answer come back?).

    python3 benchmarks/bench_eval.py needle-probe --seed 1 --depth 0.25 --check
    python3 benchmarks/bench_eval.py needle-probe --seed 1 --depth 0.25 --dense-heads 7:2,18:2

About 45 s per prompt at 7,680 tokens on two CPU cores.
"""

PASSKEY_DEMO_DOC = """\
The bundled passkey demo through the CLI on a GPU: ``sparda demo`` with its CUDA defaults
(KV cache offloaded to pinned host memory, uva transfer engine, lookahead prefetch, dense
prefill), then ``sparda generate --method sparda --offload --dense-prefill --json`` on the
same ~7K-token passkey prompt (held-out Emma, depth 0.5, seed 0), with JSON stats.

    python3 benchmarks/bench_eval.py passkey-demo MODEL OUT_DIR [-- EXTRA sparda options, e.g. --device cpu]

MODEL: the bundled GGUF file or any model path sparda accepts. Writes ``OUT_DIR/device.txt``
(date, torch, device), ``OUT_DIR/demo-sparda.txt`` and ``OUT_DIR/generate-sparda-offload.txt``
(each command's output and its wall time, ``<s> s wall``) and ``OUT_DIR/prompt.txt``; prints
the expected pass key. Exit status: non-zero if either command failed.
"""


# ---------------------------------------------------------------------------------- run
TASKS = ("passkey", "passkey-synth", "niah-single", "niah-multikey", "niah-multivalue", "niah-multiquery",
         "vt", "cwe", "fwe")
METHODS = ("dense", "sparse", "oracle", "sparda", "sparda-random", "infinigen")
SWEEP_METHODS = ("dense", "sparse", "sparda", "oracle", "infinigen")
BUDGETS = (5.0, 10.0, 17.0, 25.0, 50.0)
KV_DTYPES = ("bf16", "int8", "int4")
KV_METHODS = ("dense", "sparda")
#: the seeds' selectors (issue #13, docs/baselines.md), plan 5
BASELINE_METHODS = ("streaming", "h2o", "quest", "snapkv", "shallow")
#: the block-sparse selectors of plan 1, rerun without dense heads (plan 6); dense is left
#: out: it reads every block, so plan 1's dense records are its reference on the same prompts
SELECTOR_METHODS = ("sparse", "oracle", "sparda", "sparda-random", "infinigen")


def _csv(kind):
    return lambda text: tuple(kind(v) for v in text.split(",") if v.strip())


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """``run``'s arguments."""
    p.add_argument("out", help="output directory (reuse it to resume)")
    p.add_argument("--time-budget-s", type=float, default=550.0, help="start no batch after this [550]")
    p.add_argument("--commit", default=None, help="commit of the code (recorded; default: git, if present)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None, help="default: bf16 on CUDA, fp32 on the CPU")
    p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--tasks", type=_csv(str), default=TASKS + ("selection",))
    p.add_argument("--methods", type=_csv(str), default=METHODS)
    p.add_argument("--lengths", type=_csv(int), default=(2048, 4096, 7680))
    p.add_argument("--ppl-lengths", type=_csv(int), default=(4096, 7680))
    p.add_argument("--samples", type=int, default=30)
    p.add_argument("--ppl-windows", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--sweep-methods", type=_csv(str), default=SWEEP_METHODS)
    p.add_argument("--sweep-lengths", type=_csv(int), default=(7680,))
    p.add_argument("--budgets", type=_csv(float), default=BUDGETS)
    p.add_argument("--sweep-ppl-windows", type=int, default=8)
    p.add_argument("--kv-dtypes", type=_csv(str), default=KV_DTYPES, help="kvquant: KV-cache dtypes [bf16,int8,int4]")
    p.add_argument("--kv-methods", type=_csv(str), default=KV_METHODS, help="kvquant: methods [dense,sparda]")
    p.add_argument("--kv-lengths", type=_csv(int), default=(7680,), help="kvquant: passkey lengths [7680]")
    p.add_argument("--kv-ppl-lengths", type=_csv(int), default=(4096, 7680), help="kvquant: ppl-decode lengths")
    p.add_argument("--decode-tokens", type=int, default=512, help="kvquant: tokens of each window fed through decode")
    p.add_argument("--baseline-methods", type=_csv(str), default=BASELINE_METHODS,
                   help="baselines: methods ('' = no baselines plan) [streaming,h2o,quest,snapkv,shallow]")
    p.add_argument("--selector-methods", type=_csv(str), default=SELECTOR_METHODS,
                   help="selectors: methods run with dense_heads none ('' = no selectors plan) "
                        "[sparse,oracle,sparda,sparda-random,infinigen]")
    p.add_argument("--plans", type=_csv(str), default=None,
                   help="run only these plans (main, ppl, budget, kvquant, baselines, selectors, or a full name "
                        "such as kvquant-int8) "
                        "[default: all]")
    p.add_argument("--estimate", action="store_true", help="print the plans' work and a time estimate, run nothing")
    p.add_argument("--workers", type=int, default=1,
                   help="run the plans of different output directories in this many processes at once [1]")
    p.add_argument("--worker-report", default=None, help=argparse.SUPPRESS)  # a worker's plans' progress (JSON)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # a worker's: epoch seconds


def parse_args(argv=None) -> argparse.Namespace:
    """The command line of any subcommand (``bench_eval.py run OUT ...``); ``run``'s options
    checked (``--workers`` >= 1)."""
    args = parser().parse_args(argv)
    if args.command == "run" and args.workers < 1:
        args.parser.error(f"--workers must be >= 1, got {args.workers}")
    return args


def plans(args) -> list[tuple[str, EvalPlan]]:
    """The plans of this run, named (those ``--plans`` selects)."""
    out = Path(args.out)
    common = dict(model=args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                  ppl_windows=args.ppl_windows)
    gen = tuple(t for t in args.tasks if t != "ppl")
    return selected(args, [
        ("main", EvalPlan(tasks=gen, methods=args.methods, lengths=args.lengths, samples=args.samples,
                          out=str(out / "main"), **common)),
        ("ppl", EvalPlan(tasks=("ppl",), methods=args.methods, lengths=args.ppl_lengths, samples=args.samples,
                         out=str(out / "main"), **common)),
        ("budget", EvalPlan(tasks=("passkey", "ppl"), methods=args.sweep_methods, lengths=args.sweep_lengths,
                            samples=args.samples, budgets=args.budgets, out=str(out / "budget"),
                            **{**common, "ppl_windows": args.sweep_ppl_windows})),
    ] + kvquant_plans(args) + baseline_plans(args, common, gen) + selector_plans(args, common, gen))


def selected(args, named: list[tuple[str, EvalPlan]]) -> list[tuple[str, EvalPlan]]:
    """The plans of ``named`` that ``--plans`` asks for (a plan's full name, or its first
    ``-`` part: ``kvquant`` selects ``kvquant-int8-decode``); all without ``--plans``.
    Raises SpardaError for a name that selects nothing."""
    if args.plans is None:
        return named
    unknown = [n for n in args.plans if not any(n in (name, name.split("-")[0]) for name, _ in named)]
    if unknown:
        raise SpardaError(f"--plans {','.join(unknown)} selects no plan; choose from "
                          f"{', '.join(dict.fromkeys(name.split('-')[0] for name, _ in named))}")
    return [(name, plan) for name, plan in named if {name, name.split("-")[0]} & set(args.plans)]


def kvquant_plans(args) -> list[tuple[str, EvalPlan]]:
    """Issue #14's accuracy per KV-cache dtype: for each of ``--kv-dtypes`` the directory
    ``OUT/kv-<dtype>`` (the dtype is part of a plan's fingerprint) holds two plans, ``passkey``
    at ``--kv-lengths`` (``--samples``) and ``ppl-decode`` at ``--kv-ppl-lengths``
    (``--ppl-windows`` windows, ``--decode-tokens`` decoded), for ``--kv-methods``."""
    out = Path(args.out)
    plans = []
    for kv in args.kv_dtypes:
        common = dict(methods=args.kv_methods, samples=args.samples, out=str(out / f"kv-{kv}"),
                      model=args.model, device=args.device, dtype=args.dtype, batch_size=args.batch_size,
                      ppl_windows=args.ppl_windows, kv_dtype=kv, decode_tokens=args.decode_tokens)
        plans += [(f"kvquant-{kv}", EvalPlan(tasks=("passkey",), lengths=args.kv_lengths, **common)),
                  (f"kvquant-{kv}-decode", EvalPlan(tasks=("ppl-decode",), lengths=args.kv_ppl_lengths, **common))]
    return plans


def baseline_plans(args, common: dict, gen: tuple[str, ...]) -> list[tuple[str, EvalPlan]]:
    """Plan 5 (``OUT/baselines``): ``--baseline-methods`` on main's generation tasks and
    lengths (``baselines``), then on ``ppl`` at main's ppl lengths (``baselines-ppl``), with
    main's ``common`` settings; no plan for no methods."""
    if not args.baseline_methods:
        return []
    shared = dict(methods=args.baseline_methods, samples=args.samples, out=str(Path(args.out) / "baselines"), **common)
    return [("baselines", EvalPlan(tasks=gen, lengths=args.lengths, **shared)),
            ("baselines-ppl", EvalPlan(tasks=("ppl",), lengths=args.ppl_lengths, **shared))]


def selector_plans(args, common: dict, gen: tuple[str, ...]) -> list[tuple[str, EvalPlan]]:
    """Plan 6 (``OUT/selectors``): ``--selector-methods`` on main's generation tasks
    (``selection`` excepted), lengths and samples with main's ``common`` settings and
    ``dense_heads="none"`` (:func:`sparda.eval.runner._dense_heads_setting`'s spelling of no
    dense heads), so every decode step reads only the selected blocks; no plan for no methods.
    The selection report and ``ppl`` are not rerun: they do not depend on dense heads."""
    if not args.selector_methods:
        return []
    tasks = tuple(t for t in gen if t != "selection")
    return [("selectors", EvalPlan(tasks=tasks, methods=args.selector_methods, lengths=args.lengths,
                                   samples=args.samples, out=str(Path(args.out) / "selectors"),
                                   dense_heads="none", **common))]


def _commit(given: str | None) -> str:
    from sparda.bench.harness import git_commit

    return git_commit(given)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


#: seconds per unit of work on one H200 for the bundled model in bf16, from the H200
#: records of this model shape (design §8: dense
#: prefill of 6,000 tokens 44 ms, block-sparse `sparse` prefill 1.28 s, i.e. 0.0075 and
#: 0.21 s per 1,000 tokens; graph decode steps of 5.9 ms
#: dense and 10.3 ms offloaded sparda at 7K, taken as 12 ms for a batch of 16), plus a
#: guessed 0.5 s per batch for the graph capture, its eager warm-up step and the pinned
#: host cache of offloaded sparda.
GPU_S = dict(dense_prefill_per_ktok=0.0075, sparse_prefill_per_ktok=0.21, decode_step=0.012, capture=0.5)
#: prefill time of a method relative to dense prefill, measured on the CPU (2026-12-01,
#: bundled model, 4,096 tokens, `sparda eval --tasks passkey,ppl --samples 4`): dense
#: prefill of the generation tasks sparse 1.1, oracle 1.0, sparda 1.3, sparda-random 1.5,
#: infinigen 2.1 x dense; block-sparse ppl prefill oracle 1.4 x sparse, the others 0.8-1.0
PREFILL_FACTOR = {"dense": 1.0, "sparse": 1.1, "oracle": 1.0, "sparda": 1.3, "sparda-random": 1.5,
                  "infinigen": 2.1}
PPL_FACTOR = {"sparse": 1.0, "oracle": 1.4, "sparda": 0.9, "sparda-random": 0.8, "infinigen": 0.8}
#: decode step time under a quantised KV cache relative to bf16: a guess (docs/kv_quant.md measured
#: +12-13 % of kernel time for offloaded sparda; on-device dense dequantises every viewed token per
#: layer and step, ~2 ms more per step at 7.7K x 16 rows)
KV_DECODE_FACTOR = {"bf16": 1.0, "int8": 1.5, "int4": 1.5}
#: the seeds' selectors (plan 5), measured on the CPU (2026-12-02, bundled model, 4,096
#: tokens, one process, dense / sparse / each method interleaved over 2 rounds of one
#: passkey prompt with 16 new tokens and one ppl window, the faster round of each; the
#: shared 2-core machine was loaded by other jobs, so ratios within ~20 % are noise): the
#: dense prefill of the generation tasks is dense's (0.78-0.84 x, taken as 1) except h2o's,
#: 4.7 x (its T x T attention-mass pass, quadratic in the prompt); decode steps 0.74
#: (snapkv) to 1.4 (h2o) x sparse's (:data:`DECODE_FACTOR`); ppl: streaming and quest
#: prefill block-sparsely (1.0 and 0.95 x sparse), h2o, snapkv and shallow densely
#: (:data:`DENSE_PPL`; 3.9, 0.9, 0.9 x dense, so their factors count against dense prefill)
PREFILL_FACTOR.update({"streaming": 1.0, "h2o": 4.7, "quest": 1.0, "snapkv": 1.0, "shallow": 1.0})
PPL_FACTOR.update({"streaming": 1.0, "quest": 0.95, "h2o": 3.9, "snapkv": 0.9, "shallow": 0.9})
DECODE_FACTOR = {"streaming": 1.1, "h2o": 1.4, "quest": 0.9, "snapkv": 0.75, "shallow": 0.9}
#: methods whose ppl prefill is dense by design (they select for decode only)
DENSE_PPL = frozenset({"h2o", "snapkv", "shallow"})
#: decode tokens per sample (answer budgets of the task generators; EOS usually stops earlier)
NEW_TOKENS = {"passkey": 16, "passkey-synth": 16, "niah-single": 24, "niah-multikey": 24, "niah-multivalue": 72,
              "niah-multiquery": 40, "vt": 48, "cwe": 96, "fwe": 40}


def estimate(args) -> dict:
    """Work of the plans (prompts prefilled, decode steps of batches, ppl prefills, ppl-decode
    steps) and the seconds :data:`GPU_S` predicts for them, in all and per plan (``plans``):
    an upper-end figure (every batch decodes its full answer budget; model loads not counted)."""
    seconds, work, per_plan = 0.0, {"prefills": 0, "batches": 0, "ppl_prefills": 0, "decode_steps": 0}, {}
    for name, plan in plans(args):
        before = seconds
        specs = [(m, b) for m in plan.methods for b in ([None] if m == "dense" or not plan.budgets else plan.budgets)]
        step = GPU_S["decode_step"] * KV_DECODE_FACTOR.get(plan.kv_dtype, 1.0)
        for length in plan.lengths:
            ktok = length / 1000
            for task in plan.tasks:
                if task == "ppl-decode":  # per batch of windows: the dense reference, then each spec
                    batches = -(-plan.ppl_windows // plan.batch_size)
                    seconds += plan.ppl_windows * GPU_S["dense_prefill_per_ktok"] * ktok
                    work["ppl_prefills"] += plan.ppl_windows
                    for method, _ in specs:
                        prefix = (length - plan.decode_tokens) / 1000
                        seconds += plan.ppl_windows * GPU_S["dense_prefill_per_ktok"] * prefix * PREFILL_FACTOR.get(method, 1)
                        seconds += batches * (plan.decode_tokens * step + GPU_S["capture"])
                        work["prefills"] += plan.ppl_windows
                        work["batches"] += batches
                        work["decode_steps"] += batches * plan.decode_tokens
                elif task == "ppl":
                    for method, _ in specs:
                        dense = method == "dense" or method in DENSE_PPL
                        cost = GPU_S["dense_prefill_per_ktok" if dense else "sparse_prefill_per_ktok"]
                        seconds += plan.ppl_windows * cost * ktok * PPL_FACTOR.get(method, 1.0)
                        work["ppl_prefills"] += plan.ppl_windows
                    seconds += plan.ppl_windows * GPU_S["dense_prefill_per_ktok"] * ktok  # the dense reference
                elif task == "selection":
                    seconds += 5.0
                else:
                    batches = -(-plan.samples // plan.batch_size)
                    for method, _ in specs:
                        seconds += plan.samples * GPU_S["dense_prefill_per_ktok"] * ktok * PREFILL_FACTOR.get(method, 1)
                        own = step * DECODE_FACTOR.get(method, 1.0)
                        seconds += batches * (NEW_TOKENS.get(task, 32) * own + GPU_S["capture"])
                        work["prefills"] += plan.samples
                        work["batches"] += batches
        per_plan[name] = round(seconds - before, 1)
    return {**work, "seconds": round(seconds), "plans": per_plan}


def _load_results(sub: Path) -> tuple[dict, str] | None:
    """``sub``'s ``results.json`` and its completion line from ``progress.json`` (``None``
    when the plan has written no results there yet)."""
    res, prog = sub / "results.json", sub / "progress.json"
    if not res.is_file():
        return None
    progress = json.loads(prog.read_text()) if prog.is_file() else {}
    return json.loads(res.read_text()), (f"== {sub.name}: {'complete' if progress.get('complete') else 'INCOMPLETE'} "
                                         f"({progress.get('done')} of {progress.get('planned')} records of its last plan)")


def _summary_table(out: Path) -> str:
    """A short table: mean task accuracy [Wilson 95 %] and passkey at the longest length per
    method, KL against dense per ppl length, and how complete each directory is."""
    lines = []
    for sub in ("main", "budget", "baselines", "selectors"):
        loaded = _load_results(out / sub)
        if loaded is None:
            continue
        agg, status = loaded
        lines.append(status)
        lengths = sorted({int(n) for row in agg["by_length"].values() for t in row.values() for n in t})
        ppl_lengths = sorted({int(n) for row in agg["ppl"].values() for n in row})
        longest = str(max(lengths)) if lengths else None
        head = f"{'method':<16} {'mean task acc %':>18}"
        if longest:
            head += f" {'passkey@' + longest:>18}"
        head += "".join(f" {'KL@' + str(n):>9}" for n in ppl_lengths)
        lines.append(head)
        for label, m in agg["mean_accuracy"].items():
            row = f"{label:<16} {100 * m['mean']:5.1f} [{100 * m['low']:4.1f},{100 * m['high']:5.1f}]"
            pk = agg["by_length"].get(label, {}).get("passkey", {}).get(longest) if longest else None
            cell = f"{100 * pk['mean']:5.1f} (n={pk['n']})" if pk else "-"
            row += f" {cell:>18}"
            for n in ppl_lengths:
                kl = agg["ppl"].get(label, {}).get(str(n), {}).get("kl")
                cell = "-" if kl is None else f"{kl:.4f}"
                row += f" {cell:>9}"
            lines.append(row)
    return "\n".join(lines + _kv_summary_lines(out))


def _kv_summary_lines(out: Path) -> list[str]:
    """The ``kvquant`` directories' rows: passkey accuracy and decode KL / top-1 agreement
    against dense per method, one block per KV dtype."""
    lines = []
    for sub in sorted(out.glob("kv-*")):
        loaded = _load_results(sub)
        if loaded is None:
            continue
        agg, status = loaded
        lines.append(status)
        decode = agg.get("ppl_decode", {})
        lengths = sorted({int(n) for row in decode.values() for n in row})
        pk_lengths = sorted({int(n) for row in agg["by_length"].values() for n in row.get("passkey", {})})
        lines.append(f"{'method':<16}" + "".join(f" {'passkey@' + str(n):>18}" for n in pk_lengths) +
                     "".join(f" {'dKL@' + str(n):>10} {'top1@' + str(n):>10}" for n in lengths))
        for label in sorted(set(agg["by_length"]) | set(decode)):
            row = f"{label:<16}"
            for n in pk_lengths:
                pk = agg["by_length"].get(label, {}).get("passkey", {}).get(str(n))
                cell = f"{100 * pk['mean']:5.1f} (n={pk['n']})" if pk else "-"
                row += f" {cell:>18}"
            for n in lengths:
                m = decode.get(label, {}).get(str(n))
                kl, top1 = ("-", "-") if m is None else (f"{m['kl']:.5f}", f"{100 * m['top1_agreement']:.1f}")
                row += f" {kl:>10} {top1:>10}"
            lines.append(row)
    return lines


def _journal_lines(plan: EvalPlan) -> int:
    """Records in ``plan``'s journal (``DIR/results.jsonl``), 0 without one."""
    path = Path(plan.out) / "results.jsonl"
    if not path.is_file():
        return 0
    with open(path, "rb") as handle:
        return sum(1 for _ in handle)


def run_in_order(args, named: list[tuple[str, EvalPlan]], started: float, report=None) -> dict:
    """Run ``named`` one after another in this process within the time budget; returns
    ``{name: progress dict with "new" (records this call added to the journal), or "not
    started (time budget)"}``; ``report(done)`` is called after each plan (a worker's
    report to its parent). Raises SpardaError."""
    done = {}
    for name, plan in named:
        left = args.time_budget_s - (time.perf_counter() - started)
        spent = any(isinstance(p, dict) and p.get("stopped") == "time budget" for p in done.values())
        if left <= 0 or spent:
            done[name] = "not started (time budget)"
            continue
        print(f"== {name}: {plan.out} ({left:.0f} s left)", file=sys.stderr, flush=True)
        before = _journal_lines(plan)
        run_eval(plan, time_budget_s=left)
        progress = Path(plan.out) / "progress.json"
        if not progress.is_file():  # the budget ran out before its first record
            done[name] = "not started (time budget)"
        else:
            done[name] = {**json.loads(progress.read_text()), "new": _journal_lines(plan) - before}
        if report is not None:
            report(done)
    return done


def run_workers(args, argv: list[str], named: list[tuple[str, EvalPlan]], started: float) -> tuple[dict, int]:
    """``--workers N``: the plans grouped by output directory (plans sharing one run in
    order, as they share its journal), up to ``N`` groups at once, each in a child process
    of this script (``--plans`` its group, ``--workers 1``, the call's deadline; its output
    in ``OUT/worker-<i>.log``). No group starts once the budget is spent or a group stopped
    on it. The GPU is mostly idle while one process dispatches a prompt's prefill kernels,
    so two processes nearly halve the wall time; records are the same (greedy decoding),
    their timings those of processes sharing the GPU. The children are stopped if this
    process is interrupted.

    Returns ``({name: progress, "not started (time budget)" or "failed (...)"}, exit
    status)``: the status is the first non-zero status of a child (its log's last lines
    are printed), else 0; a failed child's plans that finished keep their progress."""
    groups: dict[str, list[str]] = {}
    for name, plan in named:
        groups.setdefault(plan.out, []).append(name)
    pending, running, done, status = list(groups.values()), [], {}, 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.time() + args.time_budget_s - (time.perf_counter() - started)
    index = 0
    try:
        while pending or running:
            spent = any(isinstance(p, dict) and p.get("stopped") == "time budget" for p in done.values())
            while pending and len(running) < args.workers:
                names = pending.pop(0)
                if deadline - time.time() <= 0 or spent:
                    done.update({n: "not started (time budget)" for n in names})
                    continue
                index += 1
                report, log = out / f".worker-{index}.json", out / f"worker-{index}.log"
                report.unlink(missing_ok=True)
                cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--plans", ",".join(names),
                       "--time-budget-s", f"{deadline - time.time():.1f}", "--deadline", f"{deadline:.3f}",
                       "--workers", "1", "--worker-report", str(report)]
                print(f"== worker {index}: {', '.join(names)} ({deadline - time.time():.0f} s left; log {log})",
                      file=sys.stderr, flush=True)
                with open(log, "w") as handle:
                    proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT)
                running.append((proc, names, report, log))
            time.sleep(0.2)
            for item in [r for r in running if r[0].poll() is not None]:
                running.remove(item)
                proc, names, report, log = item
                got = json.loads(report.read_text()) if report.is_file() else {}
                report.unlink(missing_ok=True)
                done.update({n: got.get(n, f"failed (exit {proc.returncode}, {log})") for n in names})
                if proc.returncode:
                    status = status or proc.returncode
                    tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-5:]
                    print(f"worker {', '.join(names)} exited {proc.returncode}:\n  " + "\n  ".join(tail),
                          file=sys.stderr)
    finally:
        for proc, _, report, _ in running:  # interrupted: no orphans writing into OUT
            proc.terminate()
            proc.wait()
            report.unlink(missing_ok=True)
    return {name: done[name] for name, _ in named if name in done}, status


# --------------------------------------------------------------------------- needle-probe
def key_token_positions(tokenizer, ids: list[int], key: str) -> list[int]:
    """Prompt positions (tokens) of the tokens that spell an occurrence of ``key``."""
    pieces = [tokenizer.decode([t]) for t in ids]
    text = "".join(pieces)
    spans, i = [], text.find(key)
    while i >= 0:
        spans.append((i, i + len(key)))
        i = text.find(key, i + 1)
    out, start = [], 0
    for p, piece in enumerate(pieces):
        end = start + len(piece)
        if any(start < b and end > a for a, b in spans):
            out.append(p)
        start = end
    return out


def brute_force_selection(q: torch.Tensor, k: torch.Tensor, t: int, cfg) -> set[int]:
    """``sparse``'s decode selection for one KV head, in float64 from the cached keys.

    Args:
        q: ``[G, d]`` the step's queries of the group (post-RoPE); k: ``[T, d]`` post-RoPE
            keys, ``T >= t + 1``; t: the query's position (tokens); cfg: SelectionConfig.
    Returns:
        The selected block ids.
    """
    q, k = q.double(), k[:t + 1].double()
    bs, ker, st = cfg.block_size, cfg.kernel_size, cfg.kernel_stride
    windows = list(range((t + 1 - ker) // st + 1)) if t + 1 >= ker else []
    ck = torch.stack([k[j * st:j * st + ker].mean(0) for j in windows]) if windows else k[:0]
    p = torch.softmax(q @ ck.T / math.sqrt(q.shape[-1]), -1).sum(0) if windows else k.new_zeros(0)
    cur = t // bs
    score = []
    for b in range(cur + 1):
        hits = [float(p[j]) for j in windows if j * st < (b + 1) * bs and j * st + ker > b * bs]
        score.append(max(hits) if hits else -math.inf)
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    free = sorted((b for b in range(cur + 1) if b not in forced), key=lambda b: (-score[b], b))
    return forced | set(free[:cfg.topk_blocks])


# ---------------------------------------------------------------------------- commands
def cmd_run(args, argv: list[str]) -> int:
    if args.estimate:
        try:
            print(json.dumps(estimate(args), indent=1))
        except SpardaError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    started, start_utc = time.perf_counter(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.deadline is not None:  # a worker: the parent's deadline, its own start-up counted
        args.time_budget_s = min(args.time_budget_s, args.deadline - time.time())
    out = Path(args.out)
    status = 0
    report = None
    if args.worker_report:  # a child of run_workers: its parent records the call
        report = lambda done: atomic_write(Path(args.worker_report), json.dumps(done))  # noqa: E731
    try:
        named = plans(args)
        if args.workers > 1 and len({plan.out for _, plan in named}) > 1:
            done, status = run_workers(args, argv, named, started)
        else:
            done = run_in_order(args, named, started, report)
    except SpardaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if report is not None:
        report(done)
        return 0
    import torch

    out.mkdir(parents=True, exist_ok=True)
    calls_path = out / "calls.json"
    calls = json.loads(calls_path.read_text()) if calls_path.is_file() else []
    calls.append(dict(started_utc=start_utc, wall_s=round(time.perf_counter() - started, 1), commit=_commit(args.commit),
                      device=_device_name(args.device), torch=torch.__version__, argv=argv,
                      command="python3 benchmarks/bench_eval.py " + " ".join(argv), plans=done))
    atomic_write(calls_path, json.dumps(calls, indent=1))
    print(_summary_table(out))
    complete = all(isinstance(p, dict) and p.get("complete") for p in done.values())
    print(f"{'all plans complete' if complete else 'not complete: copy OUT back and run the same command again'}; "
          f"{calls[-1]['wall_s']:.0f} s this call", file=sys.stderr)
    return status


def cmd_doc(args, argv=None) -> int:
    from sparda.eval.accuracy_doc import write_doc

    try:
        print(f"wrote {write_doc(Path(args.out), Path(args.doc))}")
    except SpardaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def cmd_passkey_demo(args, argv=None) -> int:
    from sparda.bench.harness import run_logged, sparda_cli, write_device_txt
    from sparda.data import heldout_text
    from sparda.eval.tasks.passkey import make_passkey
    from sparda.model.loader import load_tokenizer, resolve_model_dir

    extra = args.extra[1:] if args.extra[:1] == ["--"] else args.extra
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_device_txt(out)
    cli, env = sparda_cli()
    print("== sparda demo (defaults: sparda, offload on CUDA), dense prefill", flush=True)
    demo = run_logged([*cli, "demo", "--model", args.model, "--dense-prefill", *extra], out / "demo-sparda.txt", env)
    sample = make_passkey(load_tokenizer(resolve_model_dir(args.model)), heldout_text(), 7000, 0.5, 0)
    (out / "prompt.txt").write_text(sample.prompt, encoding="utf-8")
    print("expected pass key:", sample.answer)
    print("== sparda generate --method sparda --offload (same prompt), dense prefill", flush=True)
    gen = run_logged([*cli, "generate", "--model", args.model, "--method", "sparda", "--offload", "--dense-prefill",
                      "-f", str(out / "prompt.txt"), "--max-new-tokens", "24", "--json", *extra],
                     out / "generate-sparda-offload.txt", env)
    return demo or gen


def cmd_dense_heads(args, argv=None) -> int:
    from sparda.data import heldout_text
    from sparda.engine.llm import LLM
    from sparda.eval.metrics import budget_topk
    from sparda.eval.tasks import make_sample

    pairs = [(int(s), float(d)) for s, d in (p.split(":") for p in args.prompts.split(","))]
    rows = []
    for method in args.methods.split(","):
        for setting in args.settings.split(";" if ";" in args.settings else ","):
            extra = {}
            if args.budget_pct is not None:
                from sparda.config import SelectionConfig

                extra["topk_blocks"] = budget_topk(args.budget_pct, args.length, SelectionConfig.from_preset("small"))
            llm = LLM(method=method, device="cpu", dtype="float32", dense_heads=setting, **extra)
            samples = [make_sample("passkey", llm.tokenizer, heldout_text(), args.length, d, s) for s, d in pairs]
            outs = llm.generate([s.prompt for s in samples], max_new_tokens=16, chat=True)
            for (seed, depth), sample, out in zip(pairs, samples, outs):
                row = {"method": method, "dense_heads": setting, "heads": [list(h) for h in llm.config.dense_heads],
                       "seed": seed, "depth": depth, "right": sample.answers[0] in out.text,
                       "kv_read": out.stats["kv_read_fraction"], "text": out.text.strip()[:40]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            right = sum(r["right"] for r in rows[-len(pairs):])
            read = sum(r["kv_read"] for r in rows[-len(pairs):]) / len(pairs)
            print(f"# {method} dense_heads={setting} {llm.config.dense_heads}: {right}/{len(pairs)} right, "
                  f"KV read per step {100 * read:.1f} %", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)
    return 0


def cmd_needle_probe(args, argv=None) -> int:
    from sparda.data import heldout_text
    from sparda.engine.llm import LLM
    from sparda.eval.tasks import make_sample
    from sparda.kernels import reference as ref

    llm = LLM(method=args.method, device="cpu", dtype="float32", dense_heads="none")  # the probe forces its own
    cfg = llm.method.selection
    sample = make_sample("passkey", llm.tokenizer, heldout_text(), args.length, args.depth, args.seed)
    ids = llm.encode(sample.prompt, True)
    key = sample.answers[0]
    positions = key_token_positions(llm.tokenizer, ids, key)
    needle = sorted({p // cfg.block_size for p in positions})
    dense_heads = [tuple(map(int, p.split(":"))) for p in args.dense_heads.split(",") if p]
    print(f"seed {args.seed} depth {args.depth}: {len(ids)} prompt tokens, key {key} at tokens {positions} "
          f"(blocks {needle}); {cfg.init_blocks} sink + {cfg.local_blocks} local + {cfg.topk_blocks} top-k "
          f"blocks of {cfg.block_size}, compressed keys {cfg.kernel_size}/{cfg.kernel_stride}")
    rows, state = [], {"step": -1, "checked": 0, "differ": 0}
    select = llm.method.select

    def probed_select(self, layer, q, h, cache, step, first=0):
        mask = select(layer, q, h, cache, step, first)
        if step.phase != "decode":
            return mask
        state["step"] += layer == 0
        for lay, head in dense_heads:
            if lay == layer:
                mask[:, head] = True  # the attention applies causality and kv_len
        t = int(step.q_pos[0, -1])
        k, _, ck = cache.view(layer, step.rows, step.max_kv_len)
        k, qq = k[:, :, :t + 1], q[..., -1:, :]
        ck = ck[:, :, :ref.num_compressed(t + 1, cfg.kernel_size, cfg.kernel_stride)]
        nb = t // cfg.block_size + 1
        mass = ref.block_attention_mass(qq, k, step.q_pos[:, -1:], step.kv_len[:1], cfg.block_size)[0, :, 0]
        cs = ref.pool_to_blocks(ref.query_group_scores(qq, ck, step.q_pos[:, -1:], cfg.kernel_size,
                                                       cfg.kernel_stride), nb, cfg)[0, :, 0]
        free = torch.arange(cfg.init_blocks, nb - cfg.local_blocks)
        group = q.shape[2]
        for head in range(k.shape[1]):
            if args.check and args.method == "sparse" and (layer, head) not in dense_heads:
                want = brute_force_selection(q[0, head, :, -1], k[0, head], t, cfg)
                got = set(torch.nonzero(mask[0, head, -1, :nb]).flatten().tolist())
                state["checked"] += 1
                state["differ"] += want != got
            for b in needle:
                share = float(mass[head, b]) / group
                if share >= args.min_mass and b in free:
                    rank_o = int((mass[head, free] > mass[head, b]).sum()) + 1
                    rank_c = int((cs[head, free] > cs[head, b]).sum()) + 1
                    rows.append((state["step"], layer, head, b, share, rank_o, rank_c, bool(mask[0, head, -1, b])))
        return mask

    llm.method.select = types.MethodType(probed_select, llm.method)
    out = llm.generate([sample.prompt], max_new_tokens=args.max_new_tokens, chat=True)[0]
    print(f"{args.method} answers {out.text!r}: {'right' if key in out.text else 'WRONG'}")
    print("step layer head block   mass  rank oracle  rank ck  sel")
    for st, layer, head, b, share, rank_o, rank_c, sel in rows:
        print(f"{st:4d}  L{layer:<3d}  h{head}  {b:5d}  {100 * share:5.1f}%  {rank_o:11d}  {rank_c:7d}  "
              f"{'yes' if sel else 'MISSED'}")
    missed: dict[tuple[int, int], list[float]] = {}
    for _, layer, head, _, share, _, _, sel in rows:
        if not sel:
            missed.setdefault((layer, head), []).append(share)
    print("missed (layer, KV head): steps, largest mass -- "
          + ", ".join(f"L{lay}h{head}: {len(v)}, {100 * max(v):.1f}%" for (lay, head), v in sorted(missed.items())))
    if args.check and args.method == "sparse":
        print(f"float64 brute force: {state['differ']} of {state['checked']} decode selections differ")
    return 0


def _doc_parser(sub, name: str, doc: str, short: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=short, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func, parser=p)
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_eval.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    _run_arguments(_doc_parser(sub, "run", RUN_DOC, "the full sparda eval, resumable, within a time budget",
                               cmd_run))

    p = _doc_parser(sub, "doc", DOC_DOC, "regenerate docs/results/accuracy.md from a run's OUT", cmd_doc)
    p.add_argument("out", metavar="OUT", help="the `run` output directory (holds main/, budget/, calls.json)")
    p.add_argument("--doc", default=str(DEFAULT_DOC), help="the page to write [docs/results/accuracy.md]")

    p = _doc_parser(sub, "dense-heads", DENSE_HEADS_DOC, "passkey with and without dense retrieval heads (CPU)",
                    cmd_dense_heads)
    p.add_argument("--prompts", required=True, help="SEED:DEPTH,... of task passkey")
    p.add_argument("--length", type=int, default=7680, help="prompt tokens [7680]")
    p.add_argument("--methods", default="sparse,sparda", help="[sparse,sparda]")
    p.add_argument("--settings", default="none,auto", help="--dense-heads values to compare [none,auto]")
    p.add_argument("--budget-pct", type=float, default=None, help="KV budget in %% of the context [default: preset]")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")

    p = _doc_parser(sub, "needle-probe", NEEDLE_PROBE_DOC, "where block selection loses a pass key (CPU)",
                    cmd_needle_probe)
    p.add_argument("--seed", type=int, required=True, help="the passkey sample's seed")
    p.add_argument("--depth", type=float, required=True, help="the needle's depth (0-1)")
    p.add_argument("--length", type=int, default=7680, help="prompt tokens [7680]")
    p.add_argument("--method", default="sparse", choices=("sparse", "oracle"))
    p.add_argument("--min-mass", type=float, default=0.02, help="smallest block share of the group's mass shown")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--check", action="store_true", help="float64 brute force of every decode selection")
    p.add_argument("--dense-heads", default="", help="L:H,... pairs that read every block in decode")

    p = _doc_parser(sub, "passkey-demo", PASSKEY_DEMO_DOC, "the CLI passkey demo and offloaded generate, logged",
                    cmd_passkey_demo)
    p.add_argument("model", metavar="MODEL", help="the bundled GGUF file or any model path sparda accepts")
    p.add_argument("out", metavar="OUT_DIR", help="directory for the logs")
    p.add_argument("extra", nargs=argparse.REMAINDER, metavar="EXTRA",
                   help="more options for both sparda commands, after --")
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    return args.func(args, argv)


if __name__ == "__main__":
    sys.exit(main())
