"""``sparda eval``: every task x method x length x sample, batched and resumable (design §8).

Each finished sample is one fsynced JSON line of ``DIR/results.jsonl``; a rerun of the same
plan skips what is there, a time budget stops between batches (``DIR/progress.json``), and
the report is rebuilt from that file (:mod:`sparda.eval.report`). Every check runs before
``DIR`` is written (docs/results/accuracy.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sparda.errors import SpardaError
from sparda.eval.records import PPL, PPL_DECODE, SELECTION  # noqa: F401 (re-exported)
from sparda.io import atomic_write, check_output_dir, read_text

#: the clock of the time budget (seconds; a module attribute so tests can replace it)
_now = time.perf_counter
#: default needle depths, cycled over samples
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)

#: tokens each ``ppl-decode`` window feeds through decode by default (the last of the window)
DECODE_TOKENS = 256
#: samples per generate call when ``batch_size`` is not given: CUDA, CPU
DEFAULT_BATCH = {"cuda": 16, "cpu": 4}
#: tokens a task's prompt may exceed its length by (chat template, answer instructions)
PROMPT_SLACK = 256
QUICK = dict(tasks=("passkey", "niah-single", PPL), lengths=(2560,), samples=2, ppl_windows=1,
             methods=("dense", "sparse", "oracle", "sparda"))
FULL = dict(tasks=("passkey", "niah-single", "niah-multikey", "vt", "cwe", PPL), lengths=(4096, 7680),
            samples=4, ppl_windows=2)


@dataclass
class EvalPlan:
    """What ``sparda eval`` runs; the fields that change a sample's content form :meth:`fingerprint`.

    Attributes:
        tasks: :data:`sparda.eval.tasks.TASKS` names, ``ppl``, ``ppl-decode``, ``selection``.
        methods: registered method names (the ``ppl`` reference, dense unquantised, always runs).
        lengths: prompt lengths, tokens. samples: per task x length. ppl_windows: windows per length.
        decode_tokens: tokens of each ``ppl-decode`` window fed one decode step at a time.
        budgets: KV budgets, % of the context (empty: preset). depths: needle depths 0-1, cycled.
        model, preset, device, dtype, overrides: as :class:`sparda.LLM` (``overrides``: selection fields).
        text: haystack / perplexity text; ``None``: the held-out novel. seed: base seed.
        sparse_prefill: prefill mode of the generation tasks and ``ppl-decode`` (``None``: the
            preset's, design §3.6); ``ppl`` always prefills block-sparsely.
        batch_size: samples per generate call (``None``: :data:`DEFAULT_BATCH`); not fingerprinted.
        kv_dtype: ``bf16``, ``int8`` or ``int4`` (docs/kv_quant.md), not the reference's.
        dense_heads: design §3.7 (default ``auto``: the calibration file's digest is fingerprinted).
        topp_masses: mass-adaptive decode budgets (design §3.12): each method of
            :data:`~sparda.config.ADAPTIVE_METHODS` also runs at each (``METHOD@pP`` labels).
        min_blocks: their floor (``None``: the forced blocks).
        lookaheads: ``sparda`` also runs offloaded at each lookahead (1 or 2, design §6.2;
            ``sparda@laN`` labels). forecast, forecast2: weight files of the ``sparda`` methods'
            Forecast and two-ahead Forecast (``None``: the shipped ones).
    """

    tasks: tuple[str, ...]
    methods: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    out: str
    budgets: tuple[float, ...] = ()
    depths: tuple[float, ...] = DEPTHS
    ppl_windows: int = 2
    model: str | None = None
    preset: str = "small"
    device: str | None = "cpu"
    dtype: str | None = None
    text: str | None = None
    seed: int = 0
    overrides: dict = field(default_factory=dict)
    sparse_prefill: bool | None = None
    batch_size: int | None = None
    kv_dtype: str = "bf16"
    dense_heads: str = "auto"
    decode_tokens: int = DECODE_TOKENS
    topp_masses: tuple[float, ...] = ()
    min_blocks: int | None = None
    lookaheads: tuple[int, ...] = ()
    forecast: str | None = None
    forecast2: str | None = None

    def resolved_batch_size(self) -> int:
        """:attr:`batch_size`, or the default of the device (:data:`DEFAULT_BATCH`)."""
        if self.batch_size is not None:
            return self.batch_size
        from sparda.config import resolve_device

        return DEFAULT_BATCH["cuda" if resolve_device(self.device).type == "cuda" else "cpu"]

    @property
    def prefill_is_sparse(self) -> bool:
        """The resolved :attr:`sparse_prefill` (raises SpardaError for an unknown preset)."""
        from sparda.config import resolve_sparse_prefill

        return resolve_sparse_prefill(self.preset, self.sparse_prefill)

    def fingerprint(self) -> str:
        """Hash of everything that changes a sample's content (not the lists of what to run)."""
        keys = dict(depths=list(self.depths), model=self.model, preset=self.preset, dtype=self.dtype,
                    text=self.text, seed=self.seed, overrides=self.overrides, ppl_windows=self.ppl_windows)
        if not self.prefill_is_sparse:  # a key only for dense prefill, as older run directories had
            keys["dense_prefill"] = True
        if self.kv_dtype != "bf16":  # likewise only for a quantised KV cache
            keys["kv_dtype"] = self.kv_dtype
        if self.dense_heads != "auto":
            keys["dense_heads_setting"] = self.dense_heads
        if self.decode_tokens != DECODE_TOKENS:
            keys["decode_tokens"] = self.decode_tokens
        if self.min_blocks is not None:
            keys["min_blocks"] = self.min_blocks
        for name in ("forecast", "forecast2"):  # given weight files, by content
            if getattr(self, name) is not None:
                from sparda.model.loader import file_digest

                keys[f"{name}_file"] = file_digest(Path(getattr(self, name)))
        keys.update(self.asset_digests())  # only where the model has them, as older directories
        return hashlib.sha1(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]

    def asset_digests(self) -> dict[str, str]:
        """Digests of the default per-model files that exist: Forecast weights (``forecast``) and the
        dense-heads calibration (``dense_heads``). Raises SpardaError if the model cannot be resolved."""
        from sparda.attention.dense_heads import calibration_sources
        from sparda.attention.forecast import shipped_path
        from sparda.model.loader import file_digest, resolve_model_dir, shipped_name

        model_dir = resolve_model_dir(self.model)
        out = {}
        weights = shipped_path(shipped_name(model_dir))
        if weights is not None:
            out["forecast"] = file_digest(weights)
        heads = next((p for p in calibration_sources(model_dir) if p.is_file()), None)
        if heads is not None and self.dense_heads == "auto":  # read only under auto
            out["dense_heads"] = file_digest(heads)
        return out


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated configuration: a method, an optional budget (% of context), an optional
    top-p mass (design §3.12) and an optional lookahead of offloaded ``sparda`` (design §6.2)."""

    method: str
    budget_pct: float | None = None
    topp_mass: float | None = None
    lookahead: int | None = None

    @property
    def label(self) -> str:
        label = self.method if self.budget_pct is None else f"{self.method}@{self.budget_pct:g}%"
        label = label if self.topp_mass is None else f"{label}@p{self.topp_mass:g}"
        return label if self.lookahead is None else f"{label}@la{self.lookahead}"

    def selection_options(self, plan: "EvalPlan") -> dict:
        """The LLM options of this spec beyond the method: top-p, a lookahead (offloaded), and the
        plan's Forecast weight files for the ``sparda`` methods."""
        out = {}
        if self.topp_mass is not None:
            out.update(topp_mass=self.topp_mass, min_blocks=plan.min_blocks)
        if self.lookahead is not None:
            out.update(lookahead=self.lookahead, offload=True)
            if self.lookahead == 2 and plan.forecast2 is not None:
                out["forecast2"] = plan.forecast2
        if plan.forecast is not None and self.method.startswith("sparda"):
            out["forecast"] = plan.forecast
        return out


def method_specs(plan: EvalPlan) -> list[MethodSpec]:
    """Dense once; every other method once per budget (or at the preset budget), the
    :data:`~sparda.config.ADAPTIVE_METHODS` also at each top-p mass, ``sparda`` also at each
    lookahead. Raises SpardaError for an unknown method."""
    from sparda.attention.registry import METHOD_CLASSES
    from sparda.config import ADAPTIVE_METHODS

    unknown = [m for m in plan.methods if m not in METHOD_CLASSES]
    if unknown:
        raise SpardaError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(METHOD_CLASSES)}")
    specs = []
    for m in plan.methods:
        budgets = [None] if m == "dense" or not plan.budgets else plan.budgets
        masses = [None, *plan.topp_masses] if m in ADAPTIVE_METHODS else [None]
        specs += [MethodSpec(m, b, p) for b in budgets for p in masses]
        if m == "sparda":
            specs += [MethodSpec(m, b, None, n) for b in budgets for n in plan.lookaheads]
    return specs


def load_results(path: Path) -> list[dict]:
    """Records of a results file; a torn last line is dropped and the file rewritten without it."""
    if not path.exists():
        return []
    raw = path.read_text(encoding="utf-8")
    records, clean = [], True
    for line in raw.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            clean = False
    if not clean or (raw and not raw.endswith("\n")):
        atomic_write(path, "".join(json.dumps(r) + "\n" for r in records))
    return records


class _Journal:
    """Append-only results file: one JSON line per finished sample, fsynced."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records = load_results(path)
        self.done = {r["key"] for r in self.records}

    def add(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        self.records.append(record)
        self.done.add(record["key"])


class _Models:
    """One loaded model; one method object per (spec, length), sharing the weights."""

    def __init__(self, plan: EvalPlan) -> None:
        from sparda.engine.llm import LLM

        self.plan = plan
        # mixed is an offloaded cache's storage: the dense base (and the ppl reference) keep bf16,
        # each offloaded method's copy gets mixed in get()
        self.base = LLM(plan.model, method="dense", preset=plan.preset, device=plan.device, dtype=plan.dtype,
                        kv_dtype="bf16" if plan.kv_dtype == "mixed" else plan.kv_dtype, **plan.overrides)
        # one prefill forward per generate call where the method allows it (design §3.8): room for
        # the batch's prompts (the chat template adds a few dozen tokens to the task's length)
        wanted = plan.resolved_batch_size() * (max(plan.lengths) + PROMPT_SLACK)
        budget = self.base.config.runtime.prefill_batch_tokens
        self.base = self.base.derive(prefill_batch_tokens=max(budget, min(wanted, prefill_tokens_that_fit(self.base))))
        self._cache: dict = {}
        self._reference = None

    @property
    def reference(self):
        """The ``ppl``/``ppl-decode`` reference: dense attention over an unquantised KV cache (model dtype)."""
        if self.plan.kv_dtype == "bf16":
            return self.base
        if self._reference is None:
            self._reference = self.base.derive(kv_dtype="bf16")
        return self._reference

    def get(self, spec: MethodSpec, length: int, sparse_prefill: bool | None = None):
        """``(llm, tracker, topk_blocks)`` for ``spec`` at ``length`` tokens; ``tracker`` a
        :class:`~sparda.eval.metrics.HitRateTracker` for on-device block-sparse methods, else ``None``."""
        from sparda.config import SelectionConfig
        from sparda.eval.metrics import HitRateTracker, budget_topk

        sparse_prefill = self.plan.prefill_is_sparse if sparse_prefill is None else sparse_prefill
        key = (spec, length if spec.budget_pct is not None else None, sparse_prefill)
        if key not in self._cache:
            overrides = dict(self.plan.overrides)
            base_sel = SelectionConfig.from_preset(self.plan.preset, **overrides)
            if spec.budget_pct is not None:
                overrides["topk_blocks"] = budget_topk(spec.budget_pct, length, base_sel)
            # as `sparda generate --method M` (offload default, dense heads, design §3.7)
            options = dict(method=spec.method, sparse_prefill=sparse_prefill, kv_dtype=self.plan.kv_dtype,
                           dense_heads=self.plan.dense_heads, offload=None, **overrides)
            options.update(spec.selection_options(self.plan))
            llm = self.base.derive(**options)
            selection = llm.config.selection
            offloaded = llm.model_runner.offloaded
            tracker = None if offloaded else HitRateTracker(llm.method)
            self._cache[key] = (llm, tracker, selection.topk_blocks)
        return self._cache[key]


#: share of the device memory free after the model loads that a batched prefill's
#: activations may take (the rest: the KV caches of the batch, the ppl reference's logits)
PREFILL_MEMORY_SHARE = 0.25


def prefill_tokens_that_fit(llm) -> int:
    """Padded prompt tokens whose prefill activations fit :data:`PREFILL_MEMORY_SHARE` of the free
    CUDA memory, at ``dtype`` bytes x (8 x hidden + 3 x intermediate) per token; unbounded off
    CUDA (design §3.8)."""
    import torch

    if llm.device.type != "cuda":
        return 1 << 62
    config = llm.model.config
    hidden = config.hidden_size
    per_token = torch.finfo(llm.dtype).bits // 8 * (8 * hidden + 3 * getattr(config, "intermediate_size", 4 * hidden))
    free, _ = torch.cuda.mem_get_info(llm.device)
    return max(1, int(free * PREFILL_MEMORY_SHARE) // per_token)


def _haystack(plan: EvalPlan) -> str:
    if plan.text is None:
        from sparda.data import heldout_text

        return heldout_text()
    text = read_text(plan.text, "--text")
    if not text.strip():
        raise SpardaError(f"--text file {plan.text} is empty; pass a file with some text")
    return text


def _units(plan: EvalPlan):
    """``(indices, length, task)`` in run order: chunks of ``batch_size`` sample indices
    outermost (so a partial run has every cell about equally far), then length, then task."""
    size = plan.resolved_batch_size()
    count = max(plan.samples, plan.ppl_windows if {PPL, PPL_DECODE} & set(plan.tasks) else 0)
    for lo in range(0, count, size):
        for length in plan.lengths:
            for task in plan.tasks:
                limit = plan.ppl_windows if task in (PPL, PPL_DECODE) else 1 if task == SELECTION else plan.samples
                indices = [i for i in range(lo, min(lo + size, count)) if i < limit]
                if indices:
                    yield indices, length, task


def _check_device_and_lengths(plan: EvalPlan) -> None:
    """Fail before anything is written: an unusable device or dtype, ``mixed`` with an on-device
    cache, or lengths that leave no room for an answer (model config only)."""
    from sparda.config import build_config
    from sparda.model.loader import context_length

    for spec in method_specs(plan):  # the one check of every option, per method (mixed: offloaded only)
        build_config(method=spec.method, preset=plan.preset, device=plan.device, dtype=plan.dtype,
                     kv_dtype=plan.kv_dtype, **plan.overrides, **spec.selection_options(plan))
    context = context_length(plan.model)
    if context is not None and max(plan.lengths) + 32 > context:
        raise SpardaError(f"--lengths {max(plan.lengths)} leaves no room for an answer in the model's context of "
                          f"{context} tokens; use lengths up to {context - 32}")


def _check_plan_file(out: Path, plan: EvalPlan) -> None:
    """Refuse an ``--out`` whose ``plan.json`` has another fingerprint beside results."""
    plan_path = out / "plan.json"
    if not plan_path.is_file() or not (out / "results.jsonl").exists():
        return
    try:
        old = json.loads(plan_path.read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        old = None
    if old != plan.fingerprint():
        raise SpardaError(f"{out} holds results of a different plan (seed, depths, model, preset, text, "
                          "the prefill mode or the model's Forecast weights / dense-heads calibration "
                          "differ); use a new --out directory")


def _write_plan_file(out: Path, plan: EvalPlan) -> None:
    """Create ``out`` and write ``plan.json`` (just before the first result is journaled)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "plan.json", json.dumps({**asdict(plan), "fingerprint": plan.fingerprint()}, indent=1))


def _key(label: str, task: str, length: int, index: int) -> str:
    return f"{label}|{task}|{length}|{index}"


def _work(plan: EvalPlan, specs: list[MethodSpec], journal: _Journal, state: dict, haystack: str):
    """Yield ``(kind, compute)`` units for what ``journal`` lacks, in run order; ``compute()`` yields
    records lazily; units of one ``kind`` take about as long. The model loads at the first unit."""
    from sparda.eval.records import ppl_decode_records, ppl_records, selection_records, task_records
    from sparda.eval.tasks import make_sample

    def models():
        if state.get("models") is None:
            state["models"] = _Models(plan)
        return state["models"]

    def seed_of(index: int) -> int:
        return plan.seed * 1_000_003 + index

    def text_ids():
        if state.get("text_ids") is None:
            state["text_ids"] = models().base.tokenizer.encode(haystack, add_special_tokens=False)
        return state["text_ids"]

    for indices, length, task in _units(plan):
        todo = {i: [s for s in specs if _key(s.label, task, length, i) not in journal.done] for i in indices}
        if task == PPL:
            for i in indices:
                if todo[i]:
                    yield (PPL, length), (lambda i=i, length=length:
                                          ppl_records(models(), todo[i], text_ids(), length, i, seed_of(i)))
            continue
        if task == PPL_DECODE:  # one batch of windows through every spec that misses some
            if any(todo.values()):
                yield (PPL_DECODE, length), (lambda todo=todo, length=length: ppl_decode_records(
                    models(), todo, text_ids(), length, {i: seed_of(i) for i in todo}, plan.decode_tokens))
            continue
        if task == SELECTION:
            for i in indices:
                if todo[i]:
                    yield (SELECTION, length), (lambda i=i, length=length:
                                                selection_records(models(), todo[i], length, i, seed_of(i)))
            continue
        samples: dict[int, object] = {}

        def batch_of(wanted, task=task, length=length, samples=samples):
            for i in wanted:
                if i not in samples:
                    depth = plan.depths[i % len(plan.depths)]
                    samples[i] = make_sample(task, models().base.tokenizer, haystack, length, depth, seed_of(i))
            return [(i, seed_of(i), samples[i]) for i in wanted]

        for spec in specs:
            wanted = [i for i in indices if spec in todo[i]]
            if wanted:
                yield (spec.label, task, length), (lambda spec=spec, wanted=wanted, length=length:
                                                   task_records(models(), spec, batch_of(wanted), length))


def _write_progress(out: Path, planned: int, done: int, stopped: str | None, elapsed_s: float) -> dict:
    """Write and return ``DIR/progress.json``: records done / planned, complete, why it stopped early."""
    progress = dict(planned=planned, done=done, complete=done >= planned, stopped=stopped,
                    elapsed_s=round(elapsed_s, 1))
    atomic_write(out / "progress.json", json.dumps(progress, indent=1))
    return progress


def run_eval(plan: EvalPlan, *, max_new_items: int | None = None, progress: bool = True,
             time_budget_s: float | None = None) -> dict:
    """Run (or resume) ``plan``; write ``results.jsonl``, tables, plots and ``summary.json``.

    Args:
        max_new_items: stop after this many new records (``None``: all). progress: tqdm on stderr.
        time_budget_s: wall seconds from this call's start after which no unit starts that is
            predicted not to finish; ``None``: no limit.
    Returns:
        The summary ``{label: {task: mean score 0-1}}``.
    Raises:
        SpardaError: an unknown task or method, bad lengths, batch size or time budget, or a
            ``DIR`` from another plan.
    """
    from tqdm import tqdm

    from sparda.eval import report
    from sparda.eval.tasks import TASKS

    started = _now()
    unknown = [t for t in plan.tasks if t not in (PPL, PPL_DECODE, SELECTION) and t not in TASKS]
    if unknown:
        raise SpardaError(f"unknown task(s) {', '.join(unknown)}; "
                          f"choose from {', '.join([*TASKS, PPL, PPL_DECODE, SELECTION])}")
    if not plan.lengths or min(plan.lengths) < 256 or plan.samples < 1 or plan.ppl_windows < 1:
        raise SpardaError("need --lengths of at least 256 tokens, --samples >= 1 and --ppl-windows >= 1")
    if PPL_DECODE in plan.tasks and not 1 <= plan.decode_tokens < min(plan.lengths):
        raise SpardaError(f"--decode-tokens must be at least 1 and below the shortest --lengths "
                          f"({min(plan.lengths)}), got {plan.decode_tokens}")
    bad = [b for b in plan.budgets if not 0 < b <= 100]
    if bad:
        raise SpardaError(f"--budgets are percentages in (0, 100], got {bad[0]:g}")
    if plan.min_blocks is not None and not plan.topp_masses:
        raise SpardaError("--min-blocks applies with --topp-mass only; add e.g. --topp-mass 0.9")
    if any(n not in (1, 2) or isinstance(n, bool) for n in plan.lookaheads):
        raise SpardaError(f"--lookahead takes 1 and/or 2 (layers ahead a copy starts), got "
                          f"{','.join(map(str, plan.lookaheads))}")
    if plan.lookaheads and "sparda" not in plan.methods:
        raise SpardaError("--lookahead runs method sparda offloaded at each lookahead; add sparda to --methods")
    if plan.forecast2 is not None and 2 not in plan.lookaheads:
        raise SpardaError("--forecast2 gives the two-ahead Forecast of --lookahead 2; add --lookahead 2 or drop it")
    for name in ("forecast", "forecast2"):
        path = getattr(plan, name)
        if path is not None and not Path(path).is_file():
            raise SpardaError(f"--{name} file not found: {path}; pass a .safetensors file of Forecast weights")
    if plan.batch_size is not None and plan.batch_size < 1:
        raise SpardaError(f"--batch-size must be at least 1, got {plan.batch_size}")
    if time_budget_s is not None and not time_budget_s > 0:
        raise SpardaError(f"--time-budget-s must be a positive number of seconds, got {time_budget_s:g}")
    from sparda.config import resolve_sparse_prefill

    resolve_sparse_prefill(plan.preset, plan.sparse_prefill)  # a bad preset or value fails before any write
    haystack = _haystack(plan)  # an unreadable --text fails here, before anything is written
    _check_device_and_lengths(plan)
    out = check_output_dir(plan.out, "--out")
    specs = method_specs(plan)
    _check_plan_file(out, plan)
    journal = _Journal(out / "results.jsonl")
    keys = {_key(s.label, t, n, i) for idx, n, t in _units(plan) for i in idx for s in specs}
    done = len(keys & journal.done)
    bar = tqdm(total=len(keys), initial=done, desc="sparda eval", unit="sample", disable=not progress)
    state: dict = {}
    last: dict = {}  # unit kind -> seconds it took last time
    new, stopped = 0, None
    try:
        for kind, compute in _work(plan, specs, journal, state, haystack):
            if time_budget_s is not None:
                predicted = last.get(kind, max(last.values())) if last else 0.0
                if _now() - started + predicted > time_budget_s:
                    stopped = "time budget"
                    break
            unit_start = _now()
            for record in compute():
                if not journal.records or not (out / "plan.json").is_file():
                    _write_plan_file(out, plan)  # the first result: only now is anything written
                journal.add({"key": _key(record["label"], record["task"], record["length"], record["sample"]),
                             **record})
                bar.update(1)
                new += 1
                if max_new_items is not None and new >= max_new_items:
                    stopped = "max_new_items"
                    break
            last[kind] = _now() - unit_start
            if stopped:
                break
    finally:
        bar.close()
    if not journal.records:  # nothing computed and nothing there before: write nothing
        return {}
    _write_progress(out, len(keys), len(keys & journal.done), stopped, _now() - started)
    return report.write_report(out, journal.records)


def plan_from_options(tasks=None, methods=None, lengths=None, samples=None, budgets=None, depths=None,
                      ppl_windows=None, out=None, quick=False, text=None, model=None, preset="small",
                      device="cpu", dtype=None, seed=0, sparse_prefill=None, batch_size=None,
                      kv_dtype=None, dense_heads=None, decode_tokens=None, topp_mass=None,
                      min_blocks=None, lookahead=None, forecast=None, forecast2=None) -> EvalPlan:
    """An :class:`EvalPlan` from CLI options (``--quick`` or full defaults). Raises SpardaError on bad values."""
    from sparda.attention.registry import METHOD_CLASSES

    base = QUICK if quick else FULL
    if methods is None:
        methods = tuple(m for m in base.get("methods", METHOD_CLASSES) if m in METHOD_CLASSES)
    if depths and any(not 0 <= d <= 1 for d in depths):
        raise SpardaError("--depths must lie in [0, 1]")
    return EvalPlan(tasks=tuple(tasks or base["tasks"]), methods=tuple(methods),
                    lengths=tuple(lengths or base["lengths"]), samples=base["samples"] if samples is None else samples, out=out,
                    budgets=tuple(budgets or ()), depths=tuple(depths or DEPTHS),
                    ppl_windows=base["ppl_windows"] if ppl_windows is None else ppl_windows, model=model, preset=preset, device=device,
                    dtype=dtype, text=text, seed=seed, sparse_prefill=sparse_prefill, batch_size=batch_size,
                    kv_dtype=kv_dtype or "bf16", dense_heads=_dense_heads_setting(dense_heads),
                    decode_tokens=DECODE_TOKENS if decode_tokens is None else decode_tokens,
                    topp_masses=tuple(topp_mass or ()), min_blocks=min_blocks,
                    lookaheads=tuple(dict.fromkeys(lookahead or ())), forecast=forecast, forecast2=forecast2)


def _dense_heads_setting(value) -> str:
    """``auto`` (``None``), ``none`` or a normalised ``L:H,...``. Raises SpardaError if malformed."""
    from sparda.attention.dense_heads import parse_dense_heads

    heads = parse_dense_heads("auto" if value is None else value)
    if heads == "auto":
        return "auto"
    return ",".join(f"{lay}:{h}" for lay, h in heads) or "none"
