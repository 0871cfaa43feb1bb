"""``sparda eval``: every task x method x length x sample, resumable (design §8).

Each finished sample is appended (one JSON line, flushed and fsynced) to
``DIR/results.jsonl``; a rerun with the same plan skips every key already there, so an
interrupted run resumes where it stopped. The tables, plots and ``summary.json`` are
rebuilt from that file at the end (:mod:`sparda.eval.report`), each written atomically.
Every check (tasks, methods, lengths, budgets, device, dtype, ``--text``, ``--out``)
runs before anything is written; ``DIR`` and its ``plan.json`` appear only with the
first finished sample, so a run that fails at its start never locks its ``--out``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from sparda.errors import SpardaError
from sparda.io import atomic_write, check_output_dir, read_text

#: default needle depths, cycled over samples
DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: the pseudo-task that measures perplexity / agreement / KL against dense
PPL = "ppl"
#: the pseudo-task that reports selection recall through :mod:`sparda.eval.selection`
SELECTION = "selection"
QUICK = dict(tasks=("passkey", "niah-single", PPL), lengths=(2560,), samples=2, ppl_windows=1,
             methods=("dense", "sparse", "oracle", "sparda"))
FULL = dict(tasks=("passkey", "niah-single", "niah-multikey", "vt", "cwe", PPL), lengths=(4096, 7680),
            samples=4, ppl_windows=2)


@dataclass
class EvalPlan:
    """What ``sparda eval`` runs.

    Attributes:
        tasks: names from :data:`sparda.eval.tasks.TASKS`, plus ``ppl``.
        methods: registered attention method names (``dense`` is the reference for ``ppl``).
        lengths: prompt lengths in tokens.
        samples: samples per task x length (``ppl``: ``ppl_windows`` windows instead).
        ppl_windows: held-out text windows per length for ``ppl``.
        out: output directory.
        budgets: KV budgets in % of the context for the non-dense methods; empty = preset.
        depths: needle depths (0-1), cycled over sample indices.
        model, preset, device, dtype: as for :class:`sparda.LLM`; ``overrides`` are extra
            selection fields (``dense_len``, ``block_size``...).
        text: haystack / perplexity text file; ``None`` = the held-out novel.
        seed: base seed of every generator.
        sparse_prefill: whether block-sparse methods select in the prefill of the generation
            tasks (``None``: the preset's default, :func:`sparda.config.resolve_sparse_prefill`:
            dense prefill at ``small``, block-sparse at ``paper``). ``ppl`` scores prefill
            logits, so it always runs block-sparse prefill (dense prefill would make them
            dense's).
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
        return hashlib.sha1(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class MethodSpec:
    """One evaluated configuration: a method and an optional budget (% of context)."""

    method: str
    budget_pct: float | None = None

    @property
    def label(self) -> str:
        return self.method if self.budget_pct is None else f"{self.method}@{self.budget_pct:g}%"


def method_specs(plan: EvalPlan) -> list[MethodSpec]:
    """Dense once; every other method once per budget (or once at the preset budget).

    Raises SpardaError for a method name the registry does not have."""
    from sparda.attention.registry import METHOD_CLASSES

    unknown = [m for m in plan.methods if m not in METHOD_CLASSES]
    if unknown:
        raise SpardaError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(METHOD_CLASSES)}")
    specs = []
    for m in plan.methods:
        budgets = [None] if m == "dense" or not plan.budgets else plan.budgets
        specs += [MethodSpec(m, b) for b in budgets]
    return specs


def load_results(path: Path) -> list[dict]:
    """Records of a results file; a torn last line (killed mid-write) is dropped and the
    file rewritten without it, so later appends start on a clean line."""
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
        self.base = LLM(plan.model, method="dense", preset=plan.preset, device=plan.device, dtype=plan.dtype,
                        **plan.overrides)
        self._cache: dict = {}

    def get(self, spec: MethodSpec, length: int, sparse_prefill: bool | None = None):
        """``(llm, tracker, topk_blocks)`` for ``spec`` at ``length`` tokens; ``sparse_prefill``
        replaces the plan's prefill mode (``ppl``). ``tracker`` is a
        :class:`~sparda.eval.metrics.HitRateTracker` for on-device block-sparse methods and
        ``None`` for offloaded ones (their decode bypasses ``select``; the runtime counts
        their hits, :func:`~sparda.eval.metrics.runtime_hit_rate`)."""
        from sparda.attention.registry import build_method
        from sparda.config import SelectionConfig, SpardaConfig
        from sparda.engine.llm import default_offload
        from sparda.eval.metrics import HitRateTracker, budget_topk

        sparse_prefill = self.plan.prefill_is_sparse if sparse_prefill is None else sparse_prefill
        key = (spec, length if spec.budget_pct is not None else None, sparse_prefill)
        if key not in self._cache:
            overrides = dict(self.plan.overrides)
            base_sel = SelectionConfig.from_preset(self.plan.preset, **overrides)
            if spec.budget_pct is not None:
                overrides["topk_blocks"] = budget_topk(spec.budget_pct, length, base_sel)
            selection = SelectionConfig.from_preset(self.plan.preset, **overrides)
            config = SpardaConfig(method=spec.method, selection=selection, sparse_prefill=sparse_prefill,
                                  offload=default_offload(spec.method, self.base.device))  # as `sparda generate`
            llm = copy.copy(self.base)
            llm.config = config
            llm.method = build_method(config, llm.shape, model=llm.model, model_dir=llm.model_dir)
            offloaded = bool(config.offload) or getattr(llm.method, "offloaded", False)
            tracker = None if offloaded else HitRateTracker(llm.method)
            self._cache[key] = (llm, tracker, selection.topk_blocks)
        return self._cache[key]


def _haystack(plan: EvalPlan) -> str:
    if plan.text is None:
        from sparda.data import heldout_text

        return heldout_text()
    text = read_text(plan.text, "--text")
    if not text.strip():
        raise SpardaError(f"--text file {plan.text} is empty; pass a file with some text")
    return text


def _task_record(models: _Models, spec: MethodSpec, sample, length: int, index: int, seed: int) -> dict:
    from sparda.eval.metrics import exact_match, runtime_hit_rate, score

    llm, tracker, topk = models.get(spec, length)
    start = time.perf_counter()
    out = llm.generate([sample.prompt], max_new_tokens=sample.max_new_tokens, chat=True)[0]
    stats = out.stats
    # offloaded methods: the runtime's own slot hits; on-device ones: step-to-step overlap
    hit_rate = runtime_hit_rate(stats["offload"]) if "offload" in stats else tracker.take() if tracker else None
    return dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, topk_blocks=topk,
                task=sample.task, length=length, sample=index, depth=sample.depth, seed=seed,
                score=score(sample, out.text), exact=exact_match(sample.answers, out.text),
                answers=list(sample.answers), completion=out.text[:400],
                prompt_tokens=stats["prompt_tokens"], new_tokens=stats["new_tokens"],
                prefill_ms=stats["prefill_ms"], decode_tok_s=stats["decode_tok_s"],
                kv_read_fraction=stats["kv_read_fraction"],
                kv_bytes_read_per_token=stats["kv_cache_bytes"] * stats["kv_read_fraction"],
                hit_rate=hit_rate, seconds=round(time.perf_counter() - start, 2),
                prefill="block-sparse" if llm.config.sparse_prefill and spec.method != "dense" else "dense",
                offload=bool(llm.config.offload) or getattr(llm.method, "offloaded", False))


def _ppl_records(models: _Models, specs: list[MethodSpec], todo: list[MethodSpec], text_ids: list[int],
                 length: int, index: int, seed: int):
    """Yield the logit metrics of each spec in ``todo`` against dense on one window of ``length`` tokens;
    positions in the second half of the window are scored (where sparsity can act)."""
    from sparda.eval.metrics import compare_logits, perplexity

    if len(text_ids) < length + 1:
        raise SpardaError(f"the perplexity text has {len(text_ids)} tokens, fewer than {length + 1}; "
                          "use a longer --text or shorter --lengths")
    offset = random.Random(f"ppl-{seed}-{length}").randint(0, len(text_ids) - length - 1)
    ids = text_ids[offset:offset + length + 1]
    first = length // 2
    targets = torch.tensor(ids[first + 1:], device=models.base.device)
    reference = models.base.logits(ids[:-1])[first:]
    for spec in todo:
        llm, _, topk = models.get(spec, length, sparse_prefill=True)  # ppl scores block-sparse prefill
        start = time.perf_counter()
        logits = reference if spec.method == "dense" else llm.logits(ids[:-1])[first:]
        m = compare_logits(logits, reference, targets)
        n = m["positions"]
        yield (dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, topk_blocks=topk,
                            task=PPL, length=length, sample=index, depth=None, seed=seed, positions=n,
                            ppl=perplexity(m["nll_sum"], n), dense_ppl=perplexity(m["ref_nll_sum"], n),
                            top1_agreement=m["agree_sum"] / n, kl=m["kl_sum"] / n,
                            score=m["agree_sum"] / n, seconds=round(time.perf_counter() - start, 2),
                            prefill="dense" if spec.method == "dense" else "block-sparse"))
        del logits


def _selection_records(models: _Models, specs: list[MethodSpec], todo: list[MethodSpec], length: int,
                       index: int, seed: int) -> list[dict]:
    """Selection recall (vs sparse and oracle top-k) and attention mass covered, from
    :func:`sparda.eval.selection.selection_report`, for the methods it knows (preset budget);
    the others get a record with ``score=None``."""
    from sparda.eval.selection import KNOWN, selection_report

    names = sorted({s.method for s in todo if s.method in KNOWN})
    rep = selection_report(llm=models.base, text=models.plan.text, methods=names, lengths=(length,),
                           queries=16, preset=models.plan.preset) if names else {}
    records = []
    for spec in todo:
        m = rep.get(spec.method, {}) if spec.budget_pct is None else {}
        records.append(dict(label=spec.label, method=spec.method, budget_pct=spec.budget_pct, task=SELECTION,
                            length=length, sample=index, depth=None, seed=seed,
                            recall_vs_sparse=m.get("mean_recall_vs_sparse"),
                            recall_vs_oracle=m.get("mean_recall_vs_oracle"), mass=m.get("mean_mass"),
                            score=m.get("mean_recall_vs_oracle")))
    return records


def _items(plan: EvalPlan, specs: list[MethodSpec]):
    """Work in the order that balances partial results: sample index outermost."""
    for index in range(max(plan.samples, plan.ppl_windows if PPL in plan.tasks else 0)):
        for length in plan.lengths:
            for task in plan.tasks:
                limit = plan.ppl_windows if task == PPL else 1 if task == SELECTION else plan.samples
                if index < limit:
                    yield index, length, task


def _check_device_and_lengths(plan: EvalPlan) -> None:
    """Fail before anything is written: an unusable ``--device`` or ``--dtype``, or ``--lengths``
    that leave no room for an answer in the model's context (read from its config, no weights
    loaded)."""
    from sparda.engine.llm import resolve_device, resolve_dtype
    from sparda.model.loader import context_length

    resolve_dtype(plan.dtype, resolve_device(plan.device))
    context = context_length(plan.model)
    if context is not None and max(plan.lengths) + 32 > context:
        raise SpardaError(f"--lengths {max(plan.lengths)} leaves no room for an answer in the model's context of "
                          f"{context} tokens; use lengths up to {context - 32}")


def _check_plan_file(out: Path, plan: EvalPlan) -> None:
    """Refuse an ``--out`` that holds results of another plan (``plan.json`` of a different
    fingerprint); an absent or unreadable file, or one beside no results, counts as none."""
    plan_path = out / "plan.json"
    if not plan_path.is_file() or not (out / "results.jsonl").exists():
        return
    try:
        old = json.loads(plan_path.read_text(encoding="utf-8")).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        old = None
    if old != plan.fingerprint():
        raise SpardaError(f"{out} holds results of a different plan (seed, depths, model, preset, text "
                          "or the prefill mode differ); use a new --out directory")


def _write_plan_file(out: Path, plan: EvalPlan) -> None:
    """Create ``out`` and write ``plan.json`` (just before the first result is journaled)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "plan.json", json.dumps({**asdict(plan), "fingerprint": plan.fingerprint()}, indent=1))


def _key(label: str, task: str, length: int, index: int) -> str:
    return f"{label}|{task}|{length}|{index}"


def run_eval(plan: EvalPlan, *, max_new_items: int | None = None, progress: bool = True) -> dict:
    """Run (or resume) ``plan``; write ``results.jsonl``, tables, plots, ``summary.json``.

    Args:
        plan: what to run.
        max_new_items: stop after computing this many new records (tests; ``None`` = all).
        progress: show a tqdm bar on stderr.
    Returns:
        The summary, ``{label: {task: mean score 0-1}}`` (also ``DIR/summary.json``).
    Raises:
        SpardaError: unknown task or method, bad lengths, a DIR from a different plan.
    """
    from tqdm import tqdm

    from sparda.eval import report
    from sparda.eval.tasks import TASKS, make_sample

    unknown = [t for t in plan.tasks if t not in (PPL, SELECTION) and t not in TASKS]
    if unknown:
        raise SpardaError(f"unknown task(s) {', '.join(unknown)}; choose from {', '.join([*TASKS, PPL, SELECTION])}")
    if not plan.lengths or min(plan.lengths) < 256 or plan.samples < 1 or plan.ppl_windows < 1:
        raise SpardaError("need --lengths of at least 256 tokens, --samples >= 1 and --ppl-windows >= 1")
    bad = [b for b in plan.budgets if not 0 < b <= 100]
    if bad:
        raise SpardaError(f"--budgets are percentages in (0, 100], got {bad[0]:g}")
    from sparda.config import resolve_sparse_prefill

    resolve_sparse_prefill(plan.preset, plan.sparse_prefill)  # a bad preset or value fails before any write
    haystack = _haystack(plan)  # an unreadable --text fails here, before anything is written
    _check_device_and_lengths(plan)
    out = check_output_dir(plan.out, "--out")
    specs = method_specs(plan)
    _check_plan_file(out, plan)
    journal = _Journal(out / "results.jsonl")
    items = list(_items(plan, specs))
    total = sum(len(specs) for _ in items)
    done = sum(_key(s.label, t, n, i) in journal.done for i, n, t in items for s in specs)
    bar = tqdm(total=total, initial=done, desc="sparda eval", unit="sample", disable=not progress)
    models, text_ids, new = None, None, 0
    try:
        for index, length, task in items:
            todo = [s for s in specs if _key(s.label, task, length, index) not in journal.done]
            if not todo:
                continue
            if models is None:
                models = _Models(plan)
            seed = plan.seed * 1_000_003 + index
            if task == PPL:
                if text_ids is None:
                    text_ids = models.base.tokenizer.encode(haystack, add_special_tokens=False)
                records = _ppl_records(models, specs, todo, text_ids, length, index, seed)
            elif task == SELECTION:
                records = iter(_selection_records(models, specs, todo, length, index, seed))
            else:
                depth = plan.depths[index % len(plan.depths)]
                sample = make_sample(task, models.base.tokenizer, haystack, length, depth, seed)
                records = (_task_record(models, spec, sample, length, index, seed) for spec in todo)
            for record in records:  # lazily computed: each is journaled as soon as it exists
                if not journal.records or not (out / "plan.json").is_file():
                    _write_plan_file(out, plan)  # the first result: only now is anything written
                journal.add({"key": _key(record["label"], task, length, index), **record})
                bar.update(1)
                new += 1
                if max_new_items is not None and new >= max_new_items:
                    return report.write_report(out, journal.records)
    finally:
        bar.close()
    return report.write_report(out, journal.records)


def plan_from_options(tasks=None, methods=None, lengths=None, samples=None, budgets=None, depths=None,
                      ppl_windows=None, out=None, quick=False, text=None, model=None, preset="small",
                      device="cpu", dtype=None, seed=0, sparse_prefill=None) -> EvalPlan:
    """An :class:`EvalPlan` from CLI options: unset ones come from the ``--quick`` or full
    defaults; methods default to every registered one. Raises SpardaError on bad values."""
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
                    dtype=dtype, text=text, seed=seed, sparse_prefill=sparse_prefill)
