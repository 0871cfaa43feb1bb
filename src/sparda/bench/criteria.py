"""Issue #20's "Done when", checked against ``ok`` bench records: per criterion of
:data:`ISSUE20` a :class:`Verdict`, ``PASS``, ``FAIL`` (naming the worst point) or
``NOT MEASURED``.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparda.bench.records import (DEFAULT_SLOT_FACTOR, capped_best, derived, ok, point_label, record_field,
                                  selection_kind, speedups)

#: issue #20's "Done when" (H200, one run per context): wording and thresholds, one entry per criterion
ISSUE20 = {
    "floor_b4": dict(
        text="MiniCPM-8B shape, 128K, trace-replayed selection: offloaded `sparda` ≥ 336 tok/s at B4 "
             "(the paper's 240.2 on an H100 × the H200's 1.4× HBM bandwidth)",
        model="minicpm-8b", context=131072, batch=4, min_tok_s=336.0),
    "floor_b16": dict(
        text="MiniCPM-8B shape, 128K, trace-replayed selection: offloaded `sparda` ≥ 990 tok/s at B16 "
             "(the paper's 705.3 on an H100 × 1.4)",
        model="minicpm-8b", context=131072, batch=16, min_tok_s=990.0),
    "never_slower": dict(
        text="`sparda` never slower than `sparse-offload` (same model, context, batch and selection source)",
        min_speedup=1.0),
    "speedup_h07": dict(
        text="at H = 0.7 (synthetic selection, `--hit-rate`), `sparda` ≥ 1.5× `sparse-offload` at B4 and at B16",
        target_hit_rate=0.7, batches=(4, 16), min_speedup=1.5),
    "sparda_roofline": dict(
        text="every `sparda` point at B ≥ 4 within 2× of its roofline", method="sparda", min_batch=4, max_roof_x=2.0),
    "dense_roofline": dict(
        text="`dense` within 1.5× of its own roofline (B ≥ 4)", method="dense", min_batch=4, max_roof_x=1.5),
    "launches": dict(
        text="offloaded `sparda` ≤ 20 kernel launches per layer per step", method="sparda",
        max_launches_per_layer=20.0),
    "exposed": dict(
        text="exposed transfer wait ≤ 10 % of TPOT (offloaded `sparda`)", method="sparda", max_exposed_pct=10.0),
    "overlap": dict(
        text="overlap efficiency = (compute + transfer − step) / min(compute, transfer), each measured alone, "
             "≥ 0.8 (offloaded `sparda`)", method="sparda", min_overlap_efficiency=0.8),
    "capped": dict(
        text="under the 80 GB GPU cap, `sparda`'s best decode tok/s at 128K exceeds on-GPU `sparse`'s best",
        max_cap_gb=80.0, context=131072, fast="sparda", slow="sparse"),
}

PASS, FAIL, NOT_MEASURED = "PASS", "FAIL", "NOT MEASURED"


@dataclass(frozen=True)
class Verdict:
    """One criterion's outcome: ``key`` (of :data:`ISSUE20`), its wording, the measured value(s), the verdict."""

    key: str
    criterion: str
    measured: str
    verdict: str


def _verdict(values: list[tuple[float, str]], good, missing: list[str] = ()) -> tuple[str, str]:
    """``(verdict, failing values)`` of ``values`` ((value, label) pairs) under ``good(value)``;
    ``missing``: the labels not measured (NOT MEASURED unless one fails)."""
    bad = [v for v in values if not good(v[0])]
    verdict = FAIL if bad else (NOT_MEASURED if missing or not values else PASS)
    return verdict, bad


def _fmt_points(values, fmt, limit: int = 4) -> str:
    shown = ", ".join(f"{fmt(v)} ({label})" for v, label in values[:limit])
    return shown + (f", … ({len(values)} in all)" if len(values) > limit else "")


def _floor(key: str, crit: dict, records: list[dict]) -> Verdict:
    pts = [r for r in ok(records) if r["method"] == "sparda" and r.get("kv", "host") == "host"
           and r["model"] == crit["model"] and r["context"] == crit["context"] and r["batch"] == crit["batch"]
           and selection_kind(r) == "trace" and r.get("gpu_mem_cap_gb") is None]
    if not pts:
        return Verdict(key, crit["text"], "no record", NOT_MEASURED)
    best = max(pts, key=lambda r: r["decode_tok_s"])
    tok = best["decode_tok_s"]
    measured = (f"{tok:.1f} tok/s ({point_label(best)}; bound: {best.get('roofline_bound') or '-'}, "
                f"roofline {_num(best.get('roofline_tpot_ms'), 2)} ms)")
    return Verdict(key, crit["text"], measured, PASS if tok >= crit["min_tok_s"] else FAIL)


def _num(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def _never_slower(key: str, crit: dict, records: list[dict]) -> Verdict:
    pairs = speedups(records)
    if not pairs:
        return Verdict(key, crit["text"], "no sparda / sparse-offload pair", NOT_MEASURED)
    worst = min(pairs, key=lambda p: p["speedup"])
    slower = [p for p in pairs if p["speedup"] < crit["min_speedup"]]
    if slower:
        measured = "slower at " + _fmt_points([(p["speedup"], p["label"]) for p in slower], lambda v: f"{v:.2f}×")
    else:
        measured = f"lowest {worst['speedup']:.2f}× ({worst['label']}) over {len(pairs)} pairs"
    return Verdict(key, crit["text"], measured, FAIL if slower else PASS)


def _speedup_at(key: str, crit: dict, records: list[dict]) -> Verdict:
    pairs = [p for p in speedups(records) if p["target_hit_rate"] is not None
             and abs(p["target_hit_rate"] - crit["target_hit_rate"]) < 1e-9 and p["gpu_mem_cap_gb"] is None]
    parts, values, missing = [], [], []
    for b in crit["batches"]:
        at = [p for p in pairs if p["batch"] == b]
        if not at:
            missing.append(f"B{b}")
            parts.append(f"B{b}: not measured")
            continue
        for p in at:
            values.append((p["speedup"], p["label"]))
            parts.append(f"B{b}: {p['speedup']:.2f}× ({p['fast_tok_s']:.1f} / {p['slow_tok_s']:.1f} tok/s, "
                         f"{p['label']})")
    verdict, _ = _verdict(values, lambda v: v >= crit["min_speedup"], missing)
    return Verdict(key, crit["text"], "; ".join(parts), verdict)


def _every(key: str, crit: dict, records: list[dict], column: str, limit: float, at_most: bool, fmt,
           what: str) -> Verdict:
    """Every ``crit["method"]`` point (B ≥ ``min_batch`` if given) has ``column`` ≤ ``limit``
    (``at_most``) or ≥ ``limit``; the measured text names the worst point."""
    pts = [r for r in ok(records) if r["method"] == crit["method"] and r["batch"] >= crit.get("min_batch", 0)]
    values = [(d[column], point_label(r)) for r in pts if (d := derived(r))[column] is not None]
    if not values:
        return Verdict(key, crit["text"], f"no `{crit['method']}` record with {what}", NOT_MEASURED)
    verdict, bad = _verdict(values, (lambda v: v <= limit) if at_most else (lambda v: v >= limit))
    order = sorted(values, key=lambda v: -v[0] if at_most else v[0])  # worst first
    if bad:
        measured = "fails at " + _fmt_points([v for v in order if v in bad], fmt)
    else:
        measured = f"worst {fmt(order[0][0])} ({order[0][1]}) over {len(values)} points"
    if len(values) < len(pts):
        measured += f"; {len(pts) - len(values)} points without {what}"
    return Verdict(key, crit["text"], measured, verdict)


def _capped(key: str, crit: dict, records: list[dict]) -> Verdict:
    groups = {k: v for k, v in capped_best(records).items() if k[1] == crit["context"] and k[2] <= crit["max_cap_gb"]}
    if not groups:
        return Verdict(key, crit["text"], f"no record with a GPU cap ≤ {crit['max_cap_gb']:g} GB at "
                       f"{crit['context'] // 1024}K", NOT_MEASURED)
    parts, values, missing = [], [], []
    for (model, _ctx, cap), best in sorted(groups.items(), key=lambda kv: (str(kv[0][0]), kv[0][2])):
        fast, slow = best.get(crit["fast"]), best.get(crit["slow"])
        if fast is None or slow is None:
            missing.append(model)
            parts.append(f"{model} cap {cap:g} GB: " + ", ".join(
                f"`{m}` not measured" for m, r in ((crit["fast"], fast), (crit["slow"], slow)) if r is None))
            continue
        values.append((fast["decode_tok_s"] - slow["decode_tok_s"], model))
        parts.append(f"{model} cap {cap:g} GB: `{crit['fast']}` {fast['decode_tok_s']:.1f} tok/s at "
                     f"B{fast['batch']} vs `{crit['slow']}` {slow['decode_tok_s']:.1f} at B{slow['batch']}")
    verdict, _ = _verdict(values, lambda v: v > 0, missing)
    return Verdict(key, crit["text"], "; ".join(parts), verdict)


def judged(records: list[dict], slot_factor: float | None = DEFAULT_SLOT_FACTOR,
           early_attention: bool | None = False) -> list[dict]:
    """The records the verdicts judge: bf16 KV (no ``kv_dtype``: bf16), offloaded methods at
    ``slot_factor`` (missing: 1.0) and every method with ``early_attention`` as given (missing:
    off); ``None``: any."""
    return [r for r in records if record_field(r, "kv_dtype") == "bf16"
            and (slot_factor is None or r.get("kv") != "host" or record_field(r, "slot_factor") == slot_factor)
            and (early_attention is None or bool(record_field(r, "early_attention")) == early_attention)]


def check_issue20(records: list[dict], criteria: dict | None = None,
                  slot_factor: float | None = DEFAULT_SLOT_FACTOR, early_attention: bool | None = False) -> list[Verdict]:
    """The verdict of each :data:`ISSUE20` criterion (or of ``criteria``, same keys) on the
    :func:`judged` part of ``records`` (``slot_factor``, ``early_attention``: as there)."""
    c = ISSUE20 if criteria is None else criteria
    records = judged(records, slot_factor, early_attention)
    return [
        _floor("floor_b4", c["floor_b4"], records),
        _floor("floor_b16", c["floor_b16"], records),
        _never_slower("never_slower", c["never_slower"], records),
        _speedup_at("speedup_h07", c["speedup_h07"], records),
        _every("sparda_roofline", c["sparda_roofline"], records, "roof_x", c["sparda_roofline"]["max_roof_x"], True,
               lambda v: f"{v:.2f}×", "a roofline"),
        _every("dense_roofline", c["dense_roofline"], records, "roof_x", c["dense_roofline"]["max_roof_x"], True,
               lambda v: f"{v:.2f}×", "a roofline"),
        _every("launches", c["launches"], records, "launches_per_layer", c["launches"]["max_launches_per_layer"],
               True, lambda v: f"{v:.1f}", "a kernel count"),
        _every("exposed", c["exposed"], records, "exposed_transfer_pct", c["exposed"]["max_exposed_pct"], True,
               lambda v: f"{v:.1f} %", "a copy timing of the TPOT's steps"),
        _every("overlap", c["overlap"], records, "overlap_efficiency", c["overlap"]["min_overlap_efficiency"], False,
               lambda v: f"{v:.2f}", "compute and transfer measured alone"),
        _capped("capped", c["capped"], records),
    ]
