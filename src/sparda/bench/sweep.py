"""The benchmark sweep: models x methods x contexts x batches, one record per point (docs/bench.md).

Status ``ok``, ``oom`` (then larger batches of that model, method and context are ``oom``
untried), ``error`` or ``skipped`` (time budget); ``results.json`` is rewritten atomically
after every point, ``report.md`` and plots at the end.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparda.bench import point as pt
from sparda.bench.models import build_model, check_models_fit, model_spec, random_forecast, selection_config
from sparda.bench.roofline import measure_bandwidth
from sparda.bench.traces import SHIPPED_TRACE, load_traces, reuse_stats
from sparda.config import DEFAULT_SLOT_FACTOR, build_config, resolve_device, resolve_dtype
from sparda.errors import SpardaError
from sparda.io import atomic_write, check_output_dir

SWEEP_METHODS = ("dense", "sparse", "sparse-offload", "infinigen", "sparda-no-prefetch", "sparda")
#: the seeds' selectors (issue #13): accepted by ``--methods``, not in the default sweep
BASELINE_METHODS = ("streaming", "h2o", "quest", "snapkv", "shallow")
REQUIRED_KEYS = ("model", "method", "context", "batch", "status", "prefill_tok_s", "decode_tok_s", "tpot_ms",
                 "roofline_tpot_ms", "selection_ms", "exposed_wait_ms", "hit_rate", "pcie_bytes_per_token")


@dataclass
class SweepConfig:
    """What to sweep and how long to measure (docs/bench.md).

    Attributes:
        models, methods, contexts (tokens), batches: the grid.
        decode_steps, repeats, warmup_steps, breakdown_steps: steps per timed repeat, timed
            repeats (median), untimed steps first, steps of the instrumented run.
        prefill_tokens: prefill is timed on ``min(context, prefill_tokens)`` tokens.
        out: output directory. device, dtype: as :class:`~sparda.LLM`. transfer: offload copy engine.
        gpu_mem_gb: GPU memory cap; host_mem_gb: host KV cap (GB). trace: file, ``None`` (shipped)
            or ``"none"`` (native). time_budget_s: seconds, later points ``skipped``.
        eager: no CUDA graphs (docs/cuda_graphs.md). profile_steps, timing_steps, parity_steps,
            overlap_steps: steps of the profiler, copy-timing, graph-parity and overlap runs
            (``None``: ``decode_steps * repeats``; 0: off).
        hit_rates: synthetic step-to-step reuses also run by offloaded methods (``target_hit_rate``).
        slot_factor: of offloaded methods (design §6).
        kv_dtype: ``bf16``, ``int8``/``int4`` (docs/kv_quant.md) or ``mixed`` (design §6.1,
            offloaded methods only; others ``skipped``).
        lookaheads: offloaded ``sparda`` runs once per value, 1 and/or 2 (design §6.2; the other
            methods once). lookahead_recall: the modelled two-ahead prediction's recall of a
            replayed selection (:func:`~sparda.bench.traces.two_ahead_ids`; docs/bench.md);
            ``None``: a trace's recorded predictions where it has them, else
            :data:`~sparda.bench.traces.LOOKAHEAD2_RECALL`.
    """

    models: list = field(default_factory=lambda: ["llama-8b"])
    methods: list = field(default_factory=lambda: list(SWEEP_METHODS))
    contexts: list = field(default_factory=lambda: [32768])
    batches: list = field(default_factory=lambda: [1, 4, 8, 16, 32, 64])
    decode_steps: int = 16
    repeats: int = 3
    warmup_steps: int = 3
    breakdown_steps: int = 4
    prefill_tokens: int = 16384
    out: str = "bench-out"
    device: str | None = None
    dtype: str | None = None
    gpu_mem_gb: float | None = None
    host_mem_gb: float | None = None
    trace: str | None = None
    transfer: str = "auto"
    time_budget_s: float | None = None
    eager: bool = False
    profile_steps: int = 3
    timing_steps: int | None = None
    parity_steps: int = 0
    hit_rates: list = field(default_factory=list)
    overlap_steps: int | None = None
    kv_dtype: str = "bf16"
    slot_factor: float = DEFAULT_SLOT_FACTOR
    lookaheads: list = field(default_factory=lambda: [1])
    lookahead_recall: float | None = None

    def __post_init__(self) -> None:
        checked = build_config(method="sparse-offload", device="cpu", kv_dtype=self.kv_dtype,
                               slot_factor=self.slot_factor).cache  # the one check of these options
        self.kv_dtype, self.slot_factor = checked.kv_dtype, checked.slot_factor
        for m in self.models:
            model_spec(m)
        bad = [m for m in self.methods if m not in SWEEP_METHODS + BASELINE_METHODS]
        if bad:
            raise SpardaError(f"unknown bench method(s) {', '.join(bad)}; choose from "
                              f"{', '.join(SWEEP_METHODS + BASELINE_METHODS)}")
        if self.kv_dtype == "mixed" and not any(m in pt.HOST_KV for m in self.methods):
            raise SpardaError(f"--kv-dtype mixed needs an offloaded method ({', '.join(sorted(pt.HOST_KV))}) "
                              f"in --methods, got {','.join(self.methods)}")
        if min(self.contexts, default=0) < 1 or min(self.batches, default=0) < 1:
            raise SpardaError("contexts and batches must be positive integers")
        if any(not 0.0 <= h <= 1.0 for h in self.hit_rates):
            raise SpardaError(f"--hit-rate values must lie in [0, 1], got {self.hit_rates}")
        if not self.lookaheads or any(la not in (1, 2) for la in self.lookaheads):
            raise SpardaError(f"--lookahead takes 1, 2 or 1,2, got {','.join(map(str, self.lookaheads)) or 'nothing'}")
        if 2 in self.lookaheads and "sparda" not in self.methods:
            raise SpardaError("--lookahead 2 applies to offloaded sparda only; add sparda to --methods")
        if self.lookahead_recall is not None and not 0.0 <= self.lookahead_recall <= 1.0:
            raise SpardaError(f"--lookahead-recall must lie in [0, 1], got {self.lookahead_recall}")
        if self.decode_steps < 1 or self.repeats < 1 or self.warmup_steps < 0 or self.breakdown_steps < 0:
            raise SpardaError("decode-steps and repeats must be >= 1, warm-up and breakdown steps >= 0")

    @property
    def host_limit_bytes(self) -> float | None:
        """The host-memory cap in bytes, or None (90 % of the free memory)."""
        return None if self.host_mem_gb is None else self.host_mem_gb * 2**30


def quick_config(out: str, **overrides) -> SweepConfig:
    """The ``--quick`` CPU sweep: ``tiny`` model, contexts 1K/2K, batches 1-2, few steps."""
    base = dict(models=["tiny"], contexts=[1024, 2048], batches=[1, 2], decode_steps=2, repeats=2,
                warmup_steps=1, breakdown_steps=1, prefill_tokens=512, out=out, device="cpu")
    base.update({k: v for k, v in overrides.items() if v is not None})
    return SweepConfig(**base)


def write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (temp file + rename)."""
    atomic_write(path, json.dumps(obj, indent=1, default=str))


def environment(device: torch.device) -> dict:
    """Device name, date, git commit, torch version: the header of a report."""
    import datetime
    import subprocess

    try:
        root = Path(__file__).resolve().parents[3]
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        commit += "+dirty" if dirty and commit != "unknown" else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": commit,
            "torch": torch.__version__, "cpu_threads": torch.get_num_threads()}


#: the ``error`` of an on-device method's points under ``kv_dtype`` ``mixed``
MIXED_SKIP = "kv_dtype mixed needs an offloaded cache; this method keeps it on the device"


def _blank(model, method, context, batch, status, error=None, kv_dtype: str = "bf16") -> dict:
    rec = {k: None for k in REQUIRED_KEYS}
    rec.update(model=model, method=method, context=context, batch=batch, status=status, error=error,
               kv_dtype=kv_dtype)
    return rec


def run_sweep(cfg: SweepConfig, log=print) -> list[dict]:
    """Run the sweep, writing ``results.json`` after every point, ``report.md`` and plots; returns
    the records. Raises SpardaError for a bad device, dtype or trace file."""
    from sparda.bench.report import write_report

    out = check_output_dir(cfg.out, "--out")
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    check_models_fit(cfg.models, device, dtype, None if cfg.gpu_mem_gb is None or device.type != "cuda"
                     else cfg.gpu_mem_gb * 2**30)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.gpu_mem_gb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.gpu_mem_gb * 2**30 / total),
                                                  device.index if device.index is not None else torch.cuda.current_device())
    t0 = time.perf_counter()
    env = environment(device)
    env.update(measure_bandwidth(device))
    traces = None
    if cfg.trace != "none":
        traces = load_traces(cfg.trace or SHIPPED_TRACE)
        env["trace"] = {"file": str(cfg.trace or SHIPPED_TRACE.name),
                        **{k: {**reuse_stats(v), "steps": int(v.ids.shape[0]), "rows": int(v.ids.shape[1]),
                               "model": v.meta.get("model"), "text": v.meta.get("text")}
                           for k, v in traces.items()}}
    env["config"] = dataclasses.asdict(cfg)
    log(f"bench on {env['device']}: HBM {env['hbm_gbps']} GB/s, PCIe {env['pcie_gbps']} GB/s")
    records: list[dict] = []
    write_json(out / "env.json", env)

    def save() -> None:
        write_json(out / "results.json", records)

    for model_name in cfg.models:
        if cfg.time_budget_s and time.perf_counter() - t0 > cfg.time_budget_s:
            records += [_blank(model_name, m, c, b, "skipped", "time budget", cfg.kv_dtype) for c in cfg.contexts
                        for m in cfg.methods for b in cfg.batches]
            continue
        selection = selection_config(model_name)
        try:
            model = build_model(model_name, device, dtype, max(cfg.contexts) + 1024)
        except SpardaError as exc:
            records += [_blank(model_name, m, c, b, "oom", str(exc), cfg.kv_dtype) for c in cfg.contexts
                        for m in cfg.methods for b in cfg.batches]
            save()
            continue
        forecast = random_forecast(model)
        forecast2 = random_forecast(model, ahead=2) if 2 in cfg.lookaheads else None
        runs = [(m, la) for m in cfg.methods for la in (cfg.lookaheads if m == "sparda" else [1])]
        for context in cfg.contexts:
            for method, lookahead in runs:
                if cfg.kv_dtype == "mixed" and method not in pt.HOST_KV:
                    for b in sorted(cfg.batches):
                        records.append(_blank(model_name, method, context, b, "skipped", MIXED_SKIP, cfg.kv_dtype))
                        log(_line(records[-1]))
                    save()
                    continue
                llm = pt.make_llm(model, method, selection, forecast, cfg.transfer, cuda_graphs=not cfg.eager,
                                  kv_dtype=cfg.kv_dtype, slot_factor=cfg.slot_factor, lookahead=lookahead,
                                  forecast2=forecast2)
                prefill = _prefill(llm, min(context, cfg.prefill_tokens), cfg, t0, log)
                failed = None
                rates = cfg.hit_rates if method in pt.HOST_KV else []
                for batch in sorted(cfg.batches):
                    base = {**_blank(model_name, method, context, batch, "ok", kv_dtype=cfg.kv_dtype), **prefill,
                            "device": env["device"], "dtype": str(dtype).replace("torch.", ""),
                            "decode_steps": cfg.decode_steps, "repeats": cfg.repeats,
                            "hbm_gbps": env["hbm_gbps"], "pcie_gbps": env["pcie_gbps"],
                            "slot_factor": cfg.slot_factor if method in pt.HOST_KV else None,
                            "lookahead": lookahead if method == "sparda" else None}
                    if cfg.time_budget_s and time.perf_counter() - t0 > cfg.time_budget_s:
                        base.update(status="skipped", error="time budget")
                    elif failed is not None:
                        base.update(status="oom", error=f"batch {failed} was out of memory")
                    else:
                        try:
                            base.update(pt.decode_point(llm, model_name, batch, context, cfg, env, traces,
                                                        deadline=_deadline(cfg, t0), hit_rates=rates))
                        except pt.TimeBudgetExceeded:
                            _cleanup(device)
                            base.update(status="skipped", error="time budget (ran out inside the point)")
                        except Exception as exc:  # noqa: BLE001 - every failure becomes a record
                            _cleanup(device)
                            oom = pt.is_oom(exc)
                            base.update(status="oom" if oom else "error", error=f"{type(exc).__name__}: "
                                        f"{str(exc).splitlines()[0][:200] if str(exc) else ''}")
                            failed = batch if oom else None
                    subs = [{**base, **sub} for sub in base.pop("hit_rate_points", [])]
                    for rec in [base, *subs]:
                        records.append(rec)
                        log(_line(rec))
                    save()
                del llm
                _cleanup(device)
        del model, forecast, forecast2
        _cleanup(device)
    save()
    write_report(records, env, out)
    return records


def _deadline(cfg: SweepConfig, t0: float) -> float | None:
    """The ``time.perf_counter()`` value at which ``--time-budget-s`` runs out, or None."""
    return t0 + cfg.time_budget_s if cfg.time_budget_s else None


def _prefill(llm, tokens: int, cfg: SweepConfig, t0: float, log) -> dict:
    """Prefill fields of a record (``None`` with ``prefill_error`` if it failed)."""
    if cfg.time_budget_s and time.perf_counter() - t0 > cfg.time_budget_s:
        return {"prefill_tokens": tokens, "ttft_ms": None, "prefill_tok_s": None}
    try:
        return pt.measure_prefill(llm, tokens)
    except Exception as exc:  # noqa: BLE001 - a failed prefill must not stop the decode points
        _cleanup(llm.device)
        log(f"prefill {llm.config.method} {tokens}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        return {"prefill_tokens": tokens, "ttft_ms": None, "prefill_tok_s": None,
                "prefill_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}


def _cleanup(device: torch.device) -> None:
    pt.release_memory(device)


def _line(rec: dict) -> str:
    method = rec["method"] if rec.get("kv_dtype", "bf16") == "bf16" else f"{rec['method']} {rec['kv_dtype']}"
    method += " lookahead 2" if rec.get("lookahead") == 2 else ""
    head = f"{rec['model']} {method:<18} ctx {rec['context']:>6} B {rec['batch']:>3}: {rec['status']}"
    if rec["status"] != "ok":
        return f"{head} ({rec.get('error')})"
    hit = "-" if rec["hit_rate"] is None else f"{rec['hit_rate']:.3f}"
    if rec.get("target_hit_rate") is not None:
        hit += f" (target {rec['target_hit_rate']})"
    exposed = "-" if rec.get("exposed_wait_ms") is None else f"{rec['exposed_wait_ms']:.2f} ms"
    return (f"{head} {rec['decode_tok_s']:.1f} tok/s, TPOT {rec['tpot_ms']:.2f} ms "
            f"(roofline {rec['roofline_tpot_ms']:.2f}), hit {hit}, exposed {exposed}")


def _ints(text: str, name: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError as exc:
        raise SpardaError(f"--{name} must be comma-separated integers, got {text!r}") from exc


def config_from_options(quick: bool = False, **opts) -> SweepConfig:
    """A :class:`SweepConfig` from CLI strings (comma lists); ``quick`` starts from
    :func:`quick_config` and applies only the options given. Raises SpardaError on bad input."""
    given = {k: v for k, v in opts.items() if v is not None}
    for key in ("models", "methods"):
        if key in given:
            given[key] = [x.strip() for x in given[key].split(",") if x.strip()]
    for key in ("contexts", "batches", "lookaheads"):
        if key in given:
            given[key] = _ints(given[key], "lookahead" if key == "lookaheads" else key)
    if "hit_rates" in given:
        try:
            given["hit_rates"] = [float(x) for x in str(given["hit_rates"]).split(",") if x.strip()]
        except ValueError as exc:
            raise SpardaError(f"--hit-rate must be comma-separated numbers in [0, 1], got {given['hit_rates']!r}") from exc
    if quick:
        return quick_config(given.pop("out", "bench-quick"), **given)
    return SweepConfig(**given)
