"""Tables, plots and ``summary.json`` from the records of ``sparda eval`` (design §8).

Everything here is rebuilt from ``results.jsonl`` alone, so it can run on a partial
(still running or interrupted) evaluation. Every file is written atomically.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from sparda.io import atomic_output, atomic_write

PPL = "ppl"
SELECTION = "selection"


def _mean(values) -> float | None:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


def _group(records, *fields) -> dict:
    groups = defaultdict(list)
    for r in records:
        groups[tuple(r.get(f) for f in fields)].append(r)
    return groups


def _labels(records) -> list[str]:
    """Labels in a stable order: dense first, then by method and budget."""
    specs = {(r["label"], r["method"], r.get("budget_pct")) for r in records}
    return [s[0] for s in sorted(specs, key=lambda s: (s[1] != "dense", s[1], s[2] or 1e9))]


def aggregate(records: list[dict]) -> dict:
    """Aggregates of the records.

    Returns a dict with ``summary`` (label -> task -> mean score 0-1, ppl excluded),
    ``by_length`` (label -> task -> length -> [mean, n]), ``by_depth`` (label -> length ->
    depth -> mean over needle tasks), ``ppl`` (label -> length -> means of ppl, dense_ppl,
    top1_agreement, kl, n), ``efficiency`` (label -> mean kv_read_fraction,
    kv_bytes_read_per_token, hit_rate, prefill_ms) and ``budgets`` (method -> budget % ->
    mean task score, mean top-1 agreement).
    """
    tasks = [r for r in records if r["task"] not in (PPL, SELECTION)]
    ppl = [r for r in records if r["task"] == PPL]
    out: dict = {"summary": {}, "by_length": {}, "by_depth": {}, "ppl": {}, "efficiency": {}, "budgets": {},
                 "selection": {}}
    for (label, length), rs in sorted(_group([r for r in records if r["task"] == SELECTION], "label", "length").items()):
        out["selection"].setdefault(label, {})[str(length)] = {
            k: _mean(r[k] for r in rs) for k in ("recall_vs_sparse", "recall_vs_oracle", "mass")}
    for (label, task), rs in sorted(_group(tasks, "label", "task").items()):
        out["summary"].setdefault(label, {})[task] = _mean(r["score"] for r in rs)
    for (label, task, length), rs in sorted(_group(tasks, "label", "task", "length").items()):
        out["by_length"].setdefault(label, {}).setdefault(task, {})[str(length)] = [_mean(r["score"] for r in rs), len(rs)]
    needle = [r for r in tasks if r.get("depth") is not None]
    for (label, length, depth), rs in sorted(_group(needle, "label", "length", "depth").items()):
        out["by_depth"].setdefault(label, {}).setdefault(str(length), {})[str(depth)] = _mean(r["score"] for r in rs)
    for (label, length), rs in sorted(_group(ppl, "label", "length").items()):
        out["ppl"].setdefault(label, {})[str(length)] = {
            k: _mean(r[k] for r in rs) for k in ("ppl", "dense_ppl", "top1_agreement", "kl")} | {"n": len(rs)}
    for (label,), rs in _group(tasks, "label").items():
        out["efficiency"][label] = {k: _mean(r.get(k) for r in rs)
                                    for k in ("kv_read_fraction", "kv_bytes_read_per_token", "hit_rate", "prefill_ms")}
    for (method, budget), rs in _group(records, "method", "budget_pct").items():
        if budget is not None:
            out["budgets"].setdefault(method, {})[str(budget)] = {
                "score": _mean(r["score"] for r in rs if r["task"] not in (PPL, SELECTION)),
                "top1_agreement": _mean(r["top1_agreement"] for r in rs if r["task"] == PPL)}
    return out


def _fmt(value, pct: bool = True) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.0f}" if pct else f"{value:.3g}"


def markdown(records: list[dict], agg: dict) -> str:
    """The markdown report: accuracy (%) per task, per length, per depth; perplexity /
    agreement / KL against dense; efficiency; budget sweep."""
    labels = _labels(records)
    tasks = sorted({r["task"] for r in records if r["task"] not in (PPL, SELECTION)})
    lengths = sorted({r["length"] for r in records})
    lines = [f"{len(records)} records. Scores in % (contains / fraction of expected items found).", ""]
    if tasks:
        lines += ["### Accuracy per task (mean over lengths and depths)", "",
                  "| method | " + " | ".join(tasks) + " | mean |", "|---" * (len(tasks) + 2) + "|"]
        for label in labels:
            row = agg["summary"].get(label, {})
            lines.append(f"| {label} | " + " | ".join(_fmt(row.get(t)) for t in tasks) + f" | {_fmt(_mean(row.values()))} |")
        cols = [(t, n) for t in tasks for n in lengths]
        lines += ["", "### Accuracy per task and length (tokens); n = samples per cell", "",
                  "| method | " + " | ".join(f"{t} @{n}" for t, n in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for label in labels:
            cells = []
            for t, n in cols:
                mean, count = agg["by_length"].get(label, {}).get(t, {}).get(str(n), [None, 0])
                cells.append(f"{_fmt(mean)} (n={count})" if count else "–")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    depths = sorted({float(d) for v in agg["by_depth"].values() for dd in v.values() for d in dd})
    if depths:
        lines += ["", "### Needle tasks: accuracy by depth (rows) and length", "",
                  "| method | length | " + " | ".join(f"{d:.0%}" for d in depths) + " |", "|---" * (len(depths) + 2) + "|"]
        for label in labels:
            for length, row in agg["by_depth"].get(label, {}).items():
                lines.append(f"| {label} | {length} | " + " | ".join(_fmt(row.get(str(d))) for d in depths) + " |")
    if agg["ppl"]:
        lines += ["", "### Perplexity and agreement with dense (held-out text, second half of each window)", "",
                  "| method | length | ppl | dense ppl | top-1 agreement | KL(dense‖method) nats | windows |",
                  "|---|---|---|---|---|---|---|"]
        for label in labels:
            for length, m in agg["ppl"].get(label, {}).items():
                lines.append(f"| {label} | {length} | {_fmt(m['ppl'], False)} | {_fmt(m['dense_ppl'], False)} | "
                             f"{_fmt(m['top1_agreement'])} % | {_fmt(m['kl'], False)} | {m['n']} |")
    if agg["selection"]:
        lines += ["", "### Selection quality (free top-k recall, attention mass covered; sparda.eval.selection)", "",
                  "| method | length | recall vs sparse | recall vs oracle | attention mass |", "|---|---|---|---|---|"]
        for label in labels:
            for length, m in agg["selection"].get(label, {}).items():
                lines.append(f"| {label} | {length} | {_fmt(m['recall_vs_sparse'])} % | "
                             f"{_fmt(m['recall_vs_oracle'])} % | {_fmt(m['mass'])} % |")
    if agg["efficiency"]:
        lines += ["", "### KV reads in decode (task samples)", "",
                  "| method | KV blocks read / step | KV MiB read / token | block hit rate | prefill ms |",
                  "|---|---|---|---|---|"]
        for label in labels:
            e = agg["efficiency"].get(label)
            if e:
                mib = None if e["kv_bytes_read_per_token"] is None else e["kv_bytes_read_per_token"] / 2**20
                hit = "–" if e["hit_rate"] is None else f"{_fmt(e['hit_rate'])} %"
                prefill = "–" if e["prefill_ms"] is None else f"{e['prefill_ms']:.0f}"
                lines.append(f"| {label} | {_fmt(e['kv_read_fraction'])} % | {_fmt(mib, False)} | {hit} | {prefill} |")
        lines += ["", "Block hit rate: offloaded methods, the runtime's share of selected blocks already in a "
                  "GPU slot; on-device methods, the share of a step's selected blocks that the previous "
                  "step also selected."]
    if agg["budgets"]:
        lines += ["", "### Budget sweep (budget = init + local + top-k blocks, % of the context)", "",
                  "| method | budget % | task score % | top-1 agreement % |", "|---|---|---|---|"]
        for method, rows in sorted(agg["budgets"].items()):
            for budget, m in sorted(rows.items(), key=lambda kv: float(kv[0])):
                lines.append(f"| {method} | {float(budget):g} | {_fmt(m['score'])} | {_fmt(m['top1_agreement'])} |")
    return "\n".join(lines) + "\n"


def _save(fig, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight")


def plots(out: Path, records: list[dict], agg: dict) -> list[str]:
    """Write ``accuracy_vs_length.png``, ``depth_heatmap.png``, ``accuracy_vs_budget.png``
    (each only when its data exist); returns the file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, written = _labels(records), []
    tasks = sorted({r["task"] for r in records if r["task"] not in (PPL, SELECTION)})
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for label in labels:
                pts = sorted((int(n), v[0]) for n, v in agg["by_length"].get(label, {}).get(task, {}).items())
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=label)
            ax.set(title=task, xlabel="context tokens", ylim=(-5, 105))
        axes[0][0].set_ylabel("accuracy %")
        axes[0][-1].legend(fontsize=7)
        _save(fig, out / "accuracy_vs_length.png")
        plt.close(fig)
        written.append("accuracy_vs_length.png")
    heat = [label for label in labels if agg["by_depth"].get(label)]
    if heat:
        fig, axes = plt.subplots(1, len(heat), figsize=(3 * len(heat), 3), squeeze=False)
        for ax, label in zip(axes[0], heat):
            rows = agg["by_depth"][label]
            lens = sorted(rows, key=int)
            depths = sorted({d for r in rows.values() for d in r}, key=float)
            grid = [[100 * (rows[n].get(d) if rows[n].get(d) is not None else math.nan) for n in lens] for d in depths]
            im = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
            ax.set(title=label, xticks=range(len(lens)), xticklabels=lens, yticks=range(len(depths)),
                   yticklabels=[f"{float(d):.0%}" for d in depths], xlabel="context tokens")
        axes[0][0].set_ylabel("needle depth")
        fig.colorbar(im, ax=axes[0].tolist(), label="accuracy %")
        _save(fig, out / "depth_heatmap.png")
        plt.close(fig)
        written.append("depth_heatmap.png")
    if agg["budgets"]:
        fig, ax = plt.subplots(figsize=(4.5, 3))
        for method, rows in sorted(agg["budgets"].items()):
            for key, style in (("score", "-o"), ("top1_agreement", "--s")):
                pts = sorted((float(b), m[key]) for b, m in rows.items() if m[key] is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style,
                            label=f"{method} {'tasks' if key == 'score' else 'top-1 agr.'}")
        ax.set(xlabel="KV budget, % of context", ylabel="%", ylim=(-5, 105))
        ax.legend(fontsize=7)
        _save(fig, out / "accuracy_vs_budget.png")
        plt.close(fig)
        written.append("accuracy_vs_budget.png")
    return written


def write_report(out: Path, records: list[dict]) -> dict:
    """Write ``summary.json``, ``results.json``, ``report.md`` and the plots into ``out``;
    returns the summary (label -> task -> mean score 0-1)."""
    out = Path(out)
    agg = aggregate(records)
    atomic_write(out / "results.json", json.dumps(agg, indent=1))
    atomic_write(out / "summary.json", json.dumps(agg["summary"], indent=1))
    names = plots(out, records, agg)
    body = markdown(records, agg) + "".join(f"\n![{n}]({n})\n" for n in names)
    prefill = {r.get("prefill") for r in records
               if r.get("prefill") and r.get("method") != "dense" and r.get("task") != "ppl"}
    regime = (f"Prefill of block-sparse methods in the generation tasks: {', '.join(sorted(prefill))} "
              "(ppl always scores block-sparse prefill logits).\n\n" if prefill else "")
    atomic_write(out / "report.md", "# sparda eval\n\n" + regime + body)
    return agg["summary"]
