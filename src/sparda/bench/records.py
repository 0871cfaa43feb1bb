"""Bench records: load several runs, keep the newest of each point, derive the report's columns.

Derived columns (:func:`derived`), per decode step; ``None`` where an input is missing:
``launches_per_layer = kernels_per_step / num_layers``; ``roof_x = tpot_ms /
roofline_tpot_ms`` (docs/bench.md); ``tpot_per_kernel = tpot_ms / gpu_kernel_ms``;
``exposed_pct = 100 * exposed_wait_ms / tpot_ms``; ``exposed_transfer_pct = 100 *
exposed_transfer_ms / tpot_ms`` (both ``None`` unless :func:`timing_describes_tpot`);
``overlap_efficiency = (compute + transfer - tpot) / min(compute, transfer)``;
``pcie_gbps_overlapped = missed_bytes_per_step / copy_ms`` (GB/s, 1e9 bytes/s).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from sparda.errors import SpardaError

#: the offloaded cache's default slot factor (:data:`sparda.config.DEFAULT_SLOT_FACTOR`;
#: a copy, so that reading records needs no torch; a test keeps them equal)
DEFAULT_SLOT_FACTOR = 1.5

#: fields that say which point a record measured; records equal on all of them are one point
POINT_FIELDS = ("model", "method", "context", "batch", "selection_source", "target_hit_rate", "gpu_mem_cap_gb",
                "cuda_graph", "kv", "dtype", "device", "kv_dtype", "slot_factor", "early_attention", "lookahead",
                "lookahead_recall", "lookahead_predictions")
#: the value of a field that older records do not carry, or a function of the record giving it
#: (``kv_dtype``: they all ran bf16 caches; ``early_attention``: an experiment of earlier
#: records, measured slower and removed (design §6), off where absent; ``slot_factor``: an offloaded record (``kv == "host"``)
#: written before spare slots had exactly the widest selection's slots, 1.0, design §6; on-device
#: records have none)
FIELD_DEFAULTS = {"kv_dtype": "bf16", "early_attention": False,
                  "slot_factor": lambda rec: 1.0 if rec.get("kv") == "host" else None,
                  "lookahead": lambda rec: 1 if rec.get("method") == "sparda" else None,
                  "lookahead_predictions": lambda rec: "modelled" if rec.get("lookahead") == 2 else None}
#: a record list's items carry at least these
RECORD_FIELDS = ("model", "method", "context", "batch", "status")


def is_record_list(obj) -> bool:
    """True if ``obj`` is a non-empty list of sweep records (dicts with :data:`RECORD_FIELDS`)."""
    return (isinstance(obj, list) and bool(obj)
            and all(isinstance(r, dict) and all(k in r for k in RECORD_FIELDS) for r in obj))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpardaError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpardaError(f"{path} is not valid JSON ({exc}); pass a run directory or a results.json file") from exc


def _env_of(folder: Path) -> dict:
    env = folder / "env.json"
    if not env.is_file():
        return {}
    obj = _read_json(env)
    return obj if isinstance(obj, dict) else {}


def load_runs(paths) -> tuple[list[dict], list[dict]]:
    """Read the record lists of run directories or record files, oldest first.

    Args:
        paths: directories (their record-list ``*.json`` and subdirectories' ``results.json``)
            or record files; an ``env.json`` beside gives date, commit and bandwidths.
    Returns:
        ``(entries, runs)``: per record ``record``, ``rank`` (larger = newer) and ``file``; per
        file ``file``, ``records``, ``date``, ``commit``, ``env``.
    Raises:
        SpardaError: a missing path, a non-JSON file, a named file that is not a record list,
            or no records.
    """
    paths = [Path(p).expanduser() for p in paths]
    if not paths:
        raise SpardaError("no input given; pass one or more run directories (or results.json files)")
    for p in paths:
        if not p.exists():
            raise SpardaError(f"{p} does not exist; pass a run directory or a results.json file")
    entries, runs = [], []
    for arg_index, p in enumerate(paths):
        if p.is_dir():
            files = sorted((f for f in p.glob("*.json") if f.name != "env.json"),
                           key=lambda f: (os.stat(f).st_mtime, f.name))
            files += sorted(p.glob("*/results.json"), key=lambda f: (os.stat(f).st_mtime, str(f)))
            found = [(f, obj) for f in files if is_record_list(obj := _read_json(f))]
        else:
            obj = _read_json(p)
            if not is_record_list(obj):
                raise SpardaError(f"{p} is not a list of bench records (each with {', '.join(RECORD_FIELDS)}); "
                                  "pass a sweep's results.json")
            found = [(p, obj)]
        for f, recs in found:
            env = _env_of(f.parent)
            mtime = os.stat(f).st_mtime
            runs.append({"file": str(f), "records": len(recs), "date": env.get("date"), "commit": env.get("commit"),
                         "env": env})
            for i, rec in enumerate(recs):
                date = str(rec.get("date") or env.get("date") or "")
                entries.append({"record": rec, "rank": (date, arg_index, mtime, f.name, i), "file": str(f)})
    if not entries:
        raise SpardaError(f"no bench records in {', '.join(map(str, paths))}; a run directory holds results.json")
    return entries, runs


def record_field(rec: dict, key: str):
    """``rec[key]``, or its :data:`FIELD_DEFAULTS` value (else ``None``) when missing."""
    value = rec.get(key)
    if value is not None:
        return value
    default = FIELD_DEFAULTS.get(key)
    return default(rec) if callable(default) else default


def point_key(rec: dict) -> tuple:
    """The point a record measured: its :data:`POINT_FIELDS` values (:func:`record_field`)."""
    return tuple(json.dumps(record_field(rec, k), sort_keys=True) for k in POINT_FIELDS)


def method_label(rec: dict) -> str:
    """The record's method, with its KV dtype when quantised (``sparda int8``) and the
    :func:`variant_parts` of its cache (``sparda slots ×1``, ``sparda early attention``)."""
    kv = record_field(rec, "kv_dtype")
    return " ".join([rec["method"]] + ([] if kv == "bf16" else [kv]) + variant_parts(rec))


def variant_parts(rec: dict) -> list[str]:
    """An offloaded point's slot factor unless :data:`DEFAULT_SLOT_FACTOR`, ``early attention`` and
    ``lookahead 2`` (design §6.2; ``lookahead 2 recorded`` when its early copies replayed a trace's
    recorded predictions)."""
    parts = []
    slots = record_field(rec, "slot_factor")
    if slots is not None and slots != DEFAULT_SLOT_FACTOR:
        parts.append(f"slots ×{slots:g}")
    if record_field(rec, "early_attention"):
        parts.append("early attention")
    if record_field(rec, "lookahead") == 2:
        parts.append("lookahead 2" + (" recorded" if record_field(rec, "lookahead_predictions") == "recorded" else ""))
    return parts


def dedup(entries: list[dict]) -> tuple[list[dict], int]:
    """Keep the newest record of each point; a ``skipped`` record never replaces another status.
    Returns ``(records, dropped)``, oldest first."""
    def order(e):
        return (e["record"].get("status") != "skipped", e["rank"])

    newest: dict[tuple, dict] = {}
    for e in entries:
        key = point_key(e["record"])
        if key not in newest or order(e) >= order(newest[key]):
            newest[key] = e
    kept = sorted(newest.values(), key=lambda e: e["rank"])
    return [e["record"] for e in kept], len(entries) - len(kept)


def merged_env(runs: list[dict]) -> dict:
    """One report header for several runs: the newest run's env, plus ``runs`` (every file read)."""
    envs = [r["env"] for r in runs if r["env"]]
    newest = max(envs, key=lambda e: str(e.get("date") or ""), default={})
    env = dict(newest)
    devices = sorted({str(e.get("device")) for e in envs if e.get("device")})
    if len(devices) > 1:
        env["device"] = " / ".join(devices)
    commits = list(dict.fromkeys(str(e.get("commit")) for e in envs if e.get("commit")))
    if len(commits) > 1:
        env["commit"] = ", ".join(commits)
    env["runs"] = [{k: r[k] for k in ("file", "records", "date", "commit")} for r in runs]
    return env


def num_layers(rec: dict) -> int | None:
    """The model's layer count: the record's ``num_layers``, else the bench shape's (bench/models.py)."""
    if rec.get("num_layers"):
        return int(rec["num_layers"])
    from sparda.bench.models import MODEL_SPECS

    spec = MODEL_SPECS.get(rec.get("model"))
    return spec.layers if spec else None


def _ratio(num, den, scale: float = 1.0):
    if num is None or den is None or den <= 0:
        return None
    return scale * num / den


def overlap_efficiency(compute_ms, transfer_ms, step_ms) -> float | None:
    """``(compute + transfer - step) / min(compute, transfer)``; None if an input is missing or 0."""
    if compute_ms is None or transfer_ms is None or step_ms is None or min(compute_ms, transfer_ms) <= 0:
        return None
    return (compute_ms + transfer_ms - step_ms) / min(compute_ms, transfer_ms)


def timing_describes_tpot(rec: dict, tolerance: float = 0.1) -> bool:
    """Whether the copy-timing run's missed bytes per step are within ``tolerance`` (relative) of
    the TPOT run's (true when not recorded)."""
    timed, missed = rec.get("timed_missed_bytes_per_step"), rec.get("missed_bytes_per_step")
    if timed is None or missed is None:
        return True
    return abs(timed - missed) <= tolerance * max(missed, 1.0)


def derived(rec: dict) -> dict:
    """The computed columns of one record (module doc)."""
    tpot = rec.get("tpot_ms")
    eff = rec.get("overlap_efficiency")
    if eff is None:
        eff = overlap_efficiency(rec.get("compute_alone_ms"), rec.get("transfer_alone_ms"), tpot)
    pcie = rec.get("pcie_gbps_overlapped")
    if pcie is None and rec.get("missed_bytes_per_step"):
        pcie = _ratio(rec.get("missed_bytes_per_step"), rec.get("copy_ms"), 1e-6)
    layers = num_layers(rec)
    same_steps = timing_describes_tpot(rec)
    return {"num_layers": layers,
            "launches_per_layer": _ratio(rec.get("kernels_per_step"), layers),
            "roof_x": _ratio(tpot, rec.get("roofline_tpot_ms")),
            "tpot_per_kernel": _ratio(tpot, rec.get("gpu_kernel_ms")),
            "exposed_pct": _ratio(rec.get("exposed_wait_ms"), tpot, 100.0) if same_steps else None,
            "exposed_transfer_pct": _ratio(rec.get("exposed_transfer_ms", rec.get("exposed_wait_ms")), tpot, 100.0)
            if same_steps else None,
            "overlap_efficiency": eff, "pcie_gbps_overlapped": pcie}


def selection_kind(rec: dict) -> str | None:
    """``trace``, ``synthetic`` or ``native`` (the part of ``selection_source`` before ``:``)."""
    src = rec.get("selection_source")
    return None if src is None else str(src).split(":")[0]


def point_label(rec: dict) -> str:
    """A short name of a point, e.g. ``minicpm-8b 128K B4 trace`` or ``... B16 H=0.7 cap 80 GB``."""
    ctx = rec.get("context")
    ctx_s = f"{ctx // 1024}K" if isinstance(ctx, int) and ctx % 1024 == 0 else str(ctx)
    sel = f"H={rec['target_hit_rate']:g}" if rec.get("target_hit_rate") is not None else (selection_kind(rec) or "")
    parts = [rec.get("model"), ctx_s, f"B{rec.get('batch')}", sel]
    if rec.get("gpu_mem_cap_gb") is not None:
        parts.append(f"cap {rec['gpu_mem_cap_gb']:g} GB")
    if rec.get("cuda_graph") is False:
        parts.append("eager")
    if record_field(rec, "kv_dtype") != "bf16":
        parts.append(f"KV {record_field(rec, 'kv_dtype')}")
    parts += variant_parts(rec)
    return " ".join(str(p) for p in parts if p)


def ok(records: list[dict]) -> list[dict]:
    """The records that measured (``status == "ok"`` and a decode tok/s)."""
    return [r for r in records if r.get("status") == "ok" and r.get("decode_tok_s") is not None]


def speedups(records: list[dict], fast: str = "sparda", slow: str = "sparse-offload") -> list[dict]:
    """``fast``'s decode tok/s over ``slow``'s at the same point (model, context, batch, selection
    kind, ``target_hit_rate``, GPU cap, CUDA graphs, dtypes, slot factor, early attention): per
    pair its fields, ``fast_tok_s``, ``slow_tok_s``, ``speedup``, ``label``."""
    fields = ("model", "context", "batch", "target_hit_rate", "gpu_mem_cap_gb", "cuda_graph", "dtype", "kv_dtype",
              "slot_factor", "early_attention")

    def key(r):
        return tuple(json.dumps(record_field(r, k)) for k in fields) + (selection_kind(r),)

    slow_by = {key(r): r for r in ok(records) if r["method"] == slow}
    out = []
    for r in ok(records):
        other = slow_by.get(key(r)) if r["method"] == fast else None
        if other is None or not other["decode_tok_s"]:
            continue
        out.append({**{k: record_field(r, k) for k in fields}, "selection": selection_kind(r),
                    "fast_tok_s": r["decode_tok_s"], "slow_tok_s": other["decode_tok_s"],
                    "speedup": r["decode_tok_s"] / other["decode_tok_s"], "label": point_label(r)})
    h = lambda p: -1.0 if p["target_hit_rate"] is None else p["target_hit_rate"]  # noqa: E731
    return sorted(out, key=lambda p: (str(p["model"]), p["context"], h(p), p["batch"]))


def capped_best(records: list[dict]) -> dict[tuple, dict[str, dict]]:
    """``{(model, context, gpu_mem_cap_gb): {method: record}}``: each method's best decode tok/s
    under a GPU memory cap."""
    best: dict[tuple, dict[str, dict]] = {}
    for r in ok(records):
        if r.get("gpu_mem_cap_gb") is None:
            continue
        group = best.setdefault((r["model"], r["context"], r["gpu_mem_cap_gb"]), {})
        if r["method"] not in group or r["decode_tok_s"] > group[r["method"]]["decode_tok_s"]:
            group[r["method"]] = r
    return best
