"""The full `sparda eval` of issue #12 on one GPU, resumable across calls (docs/results/accuracy.md).

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/eval_gpu.py OUT [--time-budget-s 550] [--commit SHA] [--model GGUF]

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
   directory so that ``OUT/main`` stays as it is; ``benchmarks/accuracy_doc.py`` puts them
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
``python3 benchmarks/accuracy_doc.py OUT`` then regenerates ``docs/results/accuracy.md``.
Options after ``OUT`` shrink the plans (CPU smoke runs, tests); ``--plans`` runs only some
(``--plans kvquant`` adds the KV-dtype directories to an ``OUT`` whose other plans are
done, ``--plans baselines`` the seeds' selectors, ``--plans selectors`` the selectors without
dense heads); ``--estimate`` prints the work of the plans and a run-time estimate, in all and per
plan, without loading a model.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.errors import SpardaError  # noqa: E402
from sparda.eval.runner import EvalPlan, run_eval  # noqa: E402
from sparda.io import atomic_write  # noqa: E402

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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    args = p.parse_args(argv)
    if args.workers < 1:
        p.error(f"--workers must be >= 1, got {args.workers}")
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
    (``--ppl-windows`` windows, ``--decode-tokens`` decoded), for ``--kv-methods``. Raises
    SpardaError for an unknown dtype."""
    from sparda.kernels.quant import check_kv_dtype

    out = Path(args.out)
    plans = []
    for kv in args.kv_dtypes:
        common = dict(methods=args.kv_methods, samples=args.samples, out=str(out / f"kv-{check_kv_dtype(kv)}"),
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
    if given:
        return given
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


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


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
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
                      command="python3 benchmarks/eval_gpu.py " + " ".join(argv), plans=done))
    atomic_write(calls_path, json.dumps(calls, indent=1))
    print(_summary_table(out))
    complete = all(isinstance(p, dict) and p.get("complete") for p in done.values())
    print(f"{'all plans complete' if complete else 'not complete: copy OUT back and run the same command again'}; "
          f"{calls[-1]['wall_s']:.0f} s this call", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
