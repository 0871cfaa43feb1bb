"""Tables, plots and ``summary.json`` from ``results.jsonl`` alone (design §8), so a partial
run reports too; files written atomically.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from sparda.eval.stats import bootstrap_mean, wilson_interval
from sparda.io import atomic_output, atomic_write

PPL = "ppl"
PPL_DECODE = "ppl-decode"
SELECTION = "selection"
#: pseudo-tasks whose records are not generation-task scores
NOT_TASKS = (PPL, PPL_DECODE, SELECTION)


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


def _acc(scores) -> dict | None:
    """Mean score with its 95 % Wilson interval (:func:`~sparda.eval.stats.wilson_interval`):
    ``{"mean", "n", "low", "high"}``, or ``None`` for no scores."""
    scores = [v for v in scores if v is not None]
    if not scores:
        return None
    mean = sum(scores) / len(scores)
    low, high = wilson_interval(min(1.0, max(0.0, mean)), len(scores))
    return {"mean": mean, "n": len(scores), "low": low, "high": high}


def _boot(values) -> tuple[float | None, float | None]:
    """Percentile bootstrap 95 % interval of the mean of ``values`` (seed 0), or ``(None, None)``
    for fewer than two values."""
    values = [v for v in values if v is not None]
    if len(values) < 2:
        return None, None
    _, low, high = bootstrap_mean(values, seed=0)
    return low, high


def _comparisons(labels: list[str]) -> list[tuple[str, str]]:
    """The paired comparisons of a report: ``sparda`` vs ``sparse`` (each budget too), each
    of the seeds' selectors (:data:`sparda.eval.selection.BASELINES`) vs ``sparda`` at the
    same budget, ``sparda@la2`` vs ``sparda@la1`` (else ``sparda``), then every label vs ``dense``."""
    from sparda.eval.selection import BASELINES

    pairs = [(a, a.replace("sparda", "sparse", 1)) for a in labels
             if a.split("@")[0] == "sparda" and a.replace("sparda", "sparse", 1) in labels]
    for a in labels:
        method, at, budget = a.partition("@")
        if method in BASELINES and "sparda" + at + budget in labels:
            pairs.append((a, "sparda" + at + budget))
    for a in labels:  # a lookahead against lookahead 1 (or plain sparda) at the same budget
        head, at, tail = a.rpartition("@la")
        if at and tail != "1":
            base = next((b for b in (f"{head}@la1", head) if b in labels), None)
            if base is not None:
                pairs.append((a, base))
    if "dense" in labels:
        pairs += [(a, "dense") for a in labels if a != "dense"]
    return pairs


def paired_difference(records: list[dict], a: str, b: str, task: str | None = None,
                      length: int | None = None) -> dict | None:
    """Score of ``a`` minus ``b`` on the same prompts (optionally one ``task`` / ``length``) with a
    bootstrap 95 % interval stratified by (task, length) (design §8): ``{"diff", "low", "high",
    "n"}`` in score units 0-1, or ``None`` without pairs."""
    scores: dict = {}
    for r in records:
        if r["task"] in NOT_TASKS or r.get("score") is None or r["label"] not in (a, b):
            continue
        if (task is not None and r["task"] != task) or (length is not None and r["length"] != length):
            continue
        scores.setdefault((r["task"], r["length"], r["sample"]), {})[r["label"]] = r["score"]
    pairs = sorted((k, v[a] - v[b]) for k, v in scores.items() if a in v and b in v)
    if not pairs:
        return None
    diff, low, high = bootstrap_mean([d for _, d in pairs], [k[:2] for k, _ in pairs], seed=0)
    return {"diff": diff, "low": low, "high": high, "n": len(pairs)}


def _logit_metrics(records: list[dict]) -> dict:
    """label -> length -> means of ppl, dense_ppl, top1_agreement, kl over the windows of
    ``ppl`` or ``ppl-decode`` records, bootstrap 95 % intervals of agreement and KL, ``n``."""
    out: dict = {}
    for (label, length), rs in sorted(_group(records, "label", "length").items()):
        m = {k: _mean(r[k] for r in rs) for k in ("ppl", "dense_ppl", "top1_agreement", "kl")} | {"n": len(rs)}
        m["agreement_low"], m["agreement_high"] = _boot(r["top1_agreement"] for r in rs)
        m["kl_low"], m["kl_high"] = _boot(r["kl"] for r in rs)
        out.setdefault(label, {})[str(length)] = m
    return out


def aggregate(records: list[dict]) -> dict:
    """Aggregates of the records: ``summary`` (label -> task -> mean 0-1), ``accuracy``,
    ``mean_accuracy``, ``by_length``, ``by_depth`` (``{"mean", "n", "low", "high"}``, Wilson
    95 %), ``ppl``, ``ppl_decode`` (means with bootstrap 95 % of agreement and KL), ``selection``,
    ``efficiency``, ``budgets`` and ``paired`` (:func:`paired_difference` rows)."""
    tasks = [r for r in records if r["task"] not in NOT_TASKS]
    out: dict = {"summary": {}, "accuracy": {}, "mean_accuracy": {}, "by_length": {}, "by_depth": {}, "ppl": {},
                 "efficiency": {}, "budgets": {}, "selection": {}, "paired": []}
    for (label, length), rs in sorted(_group([r for r in records if r["task"] == SELECTION], "label", "length").items()):
        out["selection"].setdefault(label, {})[str(length)] = {
            k: _mean(r[k] for r in rs) for k in ("recall_vs_sparse", "recall_vs_oracle", "mass")}
    for (label, task), rs in sorted(_group(tasks, "label", "task").items()):
        out["summary"].setdefault(label, {})[task] = _mean(r["score"] for r in rs)
        out["accuracy"].setdefault(label, {})[task] = _acc(r["score"] for r in rs)
    for label, row in out["accuracy"].items():
        cells = [c for c in row.values() if c is not None]
        if cells:
            mean = sum(c["mean"] for c in cells) / len(cells)
            n = sum(c["n"] for c in cells)
            low, high = wilson_interval(mean, n)
            out["mean_accuracy"][label] = {"mean": mean, "n": n, "low": low, "high": high}
    for (label, task, length), rs in sorted(_group(tasks, "label", "task", "length").items()):
        out["by_length"].setdefault(label, {}).setdefault(task, {})[str(length)] = _acc(r["score"] for r in rs)
    needle = [r for r in tasks if r.get("depth") is not None]
    for (label, length, depth), rs in sorted(_group(needle, "label", "length", "depth").items()):
        out["by_depth"].setdefault(label, {}).setdefault(str(length), {})[str(depth)] = _acc(r["score"] for r in rs)
    out["ppl"] = _logit_metrics([r for r in records if r["task"] == PPL])
    decode = _logit_metrics([r for r in records if r["task"] == PPL_DECODE])
    if decode:  # only where the task ran: results.json of older runs keeps its keys
        out["ppl_decode"] = decode
    for (label,), rs in _group(tasks, "label").items():
        e = {k: _mean(r.get(k) for r in rs) for k in
             ("kv_read_fraction", "kv_bytes_read_per_token", "host_bytes_copied_per_token", "hit_rate")}
        # a batched prefill's forward (design §3.8) shared by prefill_batch prompts (older records: 1)
        e["prefill_ms"] = _mean(None if r.get("prefill_ms") is None else r["prefill_ms"] / r.get("prefill_batch", 1)
                                for r in rs)
        e["hit_rate_source"] = ", ".join(sorted({r["hit_rate_source"] for r in rs if r.get("hit_rate_source")})) or None
        out["efficiency"][label] = e
    for (method, length, budget), rs in _group(records, "method", "length", "budget_pct").items():
        if budget is None:
            continue
        effective = [r["budget_blocks"] / r["context_blocks"] for r in rs
                     if r.get("budget_blocks") is not None and r.get("context_blocks")]
        pp = [r for r in rs if r["task"] == PPL]
        out["budgets"].setdefault(method, {}).setdefault(str(length), {})[str(budget)] = {
            "effective_pct": 100 * _mean(effective) if effective else None,
            "accuracy": _acc(r["score"] for r in rs if r["task"] not in NOT_TASKS),
            "tasks": sorted({r["task"] for r in rs if r["task"] not in NOT_TASKS}),
            "top1_agreement": _mean(r["top1_agreement"] for r in pp), "kl": _mean(r["kl"] for r in pp),
            "ppl": _mean(r["ppl"] for r in pp), "windows": len(pp)}
    labels = _labels(records)
    lengths = sorted({r["length"] for r in tasks})
    for a, b in _comparisons([lab for lab in labels if lab in out["summary"]]):
        scopes = [("all", {})] + [(str(n), {"length": n}) for n in lengths] + \
                 [(t, {"task": t}) for t in sorted({r["task"] for r in tasks})]
        for scope, where in scopes:
            d = paired_difference(tasks, a, b, **where)
            if d is not None:
                out["paired"].append({"a": a, "b": b, "scope": scope, **d})
    return out


def _fmt(value, pct: bool = True) -> str:
    if value is None:
        return "–"
    return f"{100 * value:.0f}" if pct else f"{value:.3g}"


def _cell(acc: dict | None, n: bool = False) -> str:
    """``mean [low, high]`` in % (Wilson 95 %), optionally with ``(n=...)``."""
    if not acc:
        return "–"
    text = f"{100 * acc['mean']:.0f} [{100 * acc['low']:.0f}, {100 * acc['high']:.0f}]"
    return f"{text} (n={acc['n']})" if n else text


def _diff_cell(d: dict | None) -> str:
    """A paired difference in points: ``+d [low, high]``."""
    if not d:
        return "–"
    return f"{100 * d['diff']:+.1f} [{100 * d['low']:+.1f}, {100 * d['high']:+.1f}]"


def _ci(low, high, pct: bool = True) -> str:
    return "" if low is None else f" [{_fmt(low, pct)}, {_fmt(high, pct)}]"


def markdown(records: list[dict], agg: dict) -> str:
    """The markdown report: accuracy (%) per task, length and depth with Wilson 95 %, paired
    differences, perplexity / agreement / KL against dense, selection, efficiency, budgets."""
    labels = _labels(records)
    tasks = sorted({r["task"] for r in records if r["task"] not in NOT_TASKS})
    lengths = sorted({r["length"] for r in records if r["task"] not in NOT_TASKS})
    lines = [f"{len(records)} records. Scores in % (contains / fraction of expected items found); "
             "[low, high] is the 95 % Wilson interval (Wilson 1927; for fraction scores the mean score "
             "is taken as the proportion).", ""]
    if tasks:
        lines += ["### Accuracy per task (mean over lengths and depths)", "",
                  "KV MiB read / token: `kv_bytes_read_per_token`, the K/V bytes a decode step reads "
                  "(mean over the task samples).", "",
                  "| method | " + " | ".join(tasks) + " | mean | n | KV MiB read / token |",
                  "|---" * (len(tasks) + 4) + "|"]
        for label in labels:
            row = agg["accuracy"].get(label, {})
            mean = agg["mean_accuracy"].get(label)
            read = agg["efficiency"].get(label, {}).get("kv_bytes_read_per_token")
            lines.append(f"| {label} | " + " | ".join(_cell(row.get(t)) for t in tasks) +
                         f" | {_cell(mean)} | {mean['n'] if mean else 0} | "
                         f"{'–' if read is None else _fmt(read / 2**20, False)} |")
        lines += ["", "### Accuracy per task and length (tokens); n = samples per cell", "",
                  "| task | length | " + " | ".join(labels) + " | n |", "|---" * (len(labels) + 3) + "|"]
        for t in tasks:
            for n in lengths:
                cells = [agg["by_length"].get(label, {}).get(t, {}).get(str(n)) for label in labels]
                if any(cells):
                    counts = "/".join(str(c) for c in sorted({c["n"] for c in cells if c}))
                    lines.append(f"| {t} | {n} | " + " | ".join(_cell(c) for c in cells) + f" | {counts} |")
    depths = sorted({float(d) for v in agg["by_depth"].values() for dd in v.values() for d in dd})
    if depths:
        lines += ["", "### Needle tasks: accuracy by depth (columns) and length", "",
                  "| method | length | " + " | ".join(f"{d:.0%}" for d in depths) + " | n per depth |",
                  "|---" * (len(depths) + 3) + "|"]
        for label in labels:
            for length, row in agg["by_depth"].get(label, {}).items():
                counts = sorted({c["n"] for c in row.values() if c})
                lines.append(f"| {label} | {length} | " + " | ".join(_cell(row.get(str(d))) for d in depths) +
                             f" | {'/'.join(map(str, counts))} |")
    if agg["paired"]:
        by = {(p["a"], p["b"], p["scope"]): p for p in agg["paired"]}
        pairs = list(dict.fromkeys((p["a"], p["b"]) for p in agg["paired"]))
        lines += ["", "### Paired differences on the same prompts (points; paired bootstrap 95 % interval)", "",
                  "A minus B on the prompts both scored, resampled by prompt within each task x length cell "
                  "(10,000 resamples, seed 0). An interval that excludes 0 is a difference these samples resolve.",
                  "", "| A − B | all tasks | " + " | ".join(f"@{n}" for n in lengths) + " | pairs |",
                  "|---" * (len(lengths) + 3) + "|"]
        for a, b in pairs:
            total = by.get((a, b, "all"))
            lines.append(f"| {a} − {b} | {_diff_cell(total)} | " +
                         " | ".join(_diff_cell(by.get((a, b, str(n)))) for n in lengths) +
                         f" | {total['n'] if total else 0} |")
        lines += ["", "| A − B | " + " | ".join(tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        for a, b in pairs:
            lines.append(f"| {a} − {b} | " + " | ".join(_diff_cell(by.get((a, b, t))) for t in tasks) + " |")
    for key, title in (("ppl", "Perplexity and agreement with dense (held-out text, second half of each window)"),
                       ("ppl_decode", "Decode-time perplexity and agreement with dense (`ppl-decode`: the last "
                                      "tokens of each window fed one decode step at a time)")):
        if agg.get(key):
            lines += ["", f"### {title}", "", "Intervals: percentile bootstrap 95 % over windows (seed 0).", "",
                      "| method | length | ppl | dense ppl | top-1 agreement % | KL(dense‖method) nats | windows |",
                      "|---|---|---|---|---|---|---|"]
            for label in labels:
                for length, m in agg[key].get(label, {}).items():
                    lines.append(f"| {label} | {length} | {_fmt(m['ppl'], False)} | {_fmt(m['dense_ppl'], False)} | "
                                 f"{_fmt(m['top1_agreement'])}{_ci(m.get('agreement_low'), m.get('agreement_high'))} | "
                                 f"{_fmt(m['kl'], False)}{_ci(m.get('kl_low'), m.get('kl_high'), False)} | {m['n']} |")
    if agg["selection"]:
        lines += ["", "### Selection quality (free top-k recall, attention mass covered; sparda.eval.selection)", "",
                  "| method | length | recall vs sparse | recall vs oracle | attention mass |", "|---|---|---|---|---|"]
        for label in labels:
            for length, m in agg["selection"].get(label, {}).items():
                lines.append(f"| {label} | {length} | {_fmt(m['recall_vs_sparse'])} % | "
                             f"{_fmt(m['recall_vs_oracle'])} % | {_fmt(m['mass'])} % |")
    if agg["efficiency"]:
        lines += ["", "### KV reads in decode (task samples)", "",
                  "| method | KV blocks read / step | KV MiB read / token | host MiB copied / token | block hit rate "
                  "| hit rate measured by | prefill ms / prompt |", "|---|---|---|---|---|---|---|"]
        for label in labels:
            e = agg["efficiency"].get(label)
            if e:
                mib = None if e["kv_bytes_read_per_token"] is None else e["kv_bytes_read_per_token"] / 2**20
                host = e.get("host_bytes_copied_per_token")
                host = "–" if host is None else _fmt(host / 2**20, False)
                hit = "–" if e["hit_rate"] is None else f"{_fmt(e['hit_rate'])} %"
                prefill = "–" if e["prefill_ms"] is None else f"{e['prefill_ms']:.0f}"
                lines.append(f"| {label} | {_fmt(e['kv_read_fraction'])} % | {_fmt(mib, False)} | {host} | {hit} | "
                             f"{e.get('hit_rate_source') or '–'} | {prefill} |")
        lines += ["", "Block hit rate: `runtime` (offloaded methods), the offload runtime's share of selected "
                  "blocks already in a GPU slot; `overlap` (on-device methods), the share of a step's selected "
                  "blocks that the same row's previous step also selected, over the row's own decode steps."]
    if agg["budgets"]:
        lines += ["", "### Budget sweep (budget = init + local + top-k blocks, % of the context)", "",
                  "Asked: the `--budgets` value; effective: the blocks actually attended (init and local windows "
                  "are a floor).", "",
                  "| method | length | budget % asked | effective % | task accuracy % | top-1 agreement % | KL nats "
                  "| ppl |", "|---|---|---|---|---|---|---|---|"]
        for method, by_len in sorted(agg["budgets"].items()):
            for length, rows in sorted(by_len.items(), key=lambda kv: int(kv[0])):
                for budget, m in sorted(rows.items(), key=lambda kv: float(kv[0])):
                    eff = "–" if m["effective_pct"] is None else f"{m['effective_pct']:.1f}"
                    acc = _cell(m["accuracy"], n=True)
                    if m["accuracy"]:
                        acc += f" ({', '.join(m['tasks'])})"
                    lines.append(f"| {method} | {length} | {float(budget):g} | {eff} | {acc} | "
                                 f"{_fmt(m['top1_agreement'])} | {_fmt(m['kl'], False)} | {_fmt(m['ppl'], False)} |")
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
    tasks = sorted({r["task"] for r in records if r["task"] not in NOT_TASKS})
    if tasks:
        fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for label in labels:
                pts = sorted((int(n), v) for n, v in agg["by_length"].get(label, {}).get(task, {}).items() if v)
                if pts:  # Wilson 95 % intervals as error bars
                    means = [100 * v["mean"] for _, v in pts]
                    err = [[m - 100 * v["low"] for m, (_, v) in zip(means, pts)],
                           [100 * v["high"] - m for m, (_, v) in zip(means, pts)]]
                    ax.errorbar([p[0] for p in pts], means, yerr=err, marker="o", capsize=2, label=label)
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
            grid = [[100 * rows[n][d]["mean"] if rows[n].get(d) else math.nan for n in lens] for d in depths]
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
        for method, by_len in sorted(agg["budgets"].items()):
            for length, rows in sorted(by_len.items(), key=lambda kv: int(kv[0])):
                for key, style in (("accuracy", "-o"), ("top1_agreement", "--s")):
                    pts = sorted((m["effective_pct"] or float(b), m[key]["mean"] if key == "accuracy" else m[key])
                                 for b, m in rows.items() if m[key] is not None)
                    if pts:
                        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], style,
                                label=f"{method} @{length} {'tasks' if key == 'accuracy' else 'top-1 agr.'}")
        ax.set(xlabel="KV budget (effective), % of context", ylabel="%", ylim=(-5, 105))
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
    status = ""
    try:
        progress = json.loads((out / "progress.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        progress = None
    if isinstance(progress, dict) and not progress.get("complete", True):
        status = (f"**Incomplete** ({progress.get('stopped')}): {progress.get('done')} of {progress.get('planned')} "
                  "records of the last plan; rerun the same command to resume.\n\n")
    atomic_write(out / "report.md", "# sparda eval\n\n" + status + regime + body)
    return agg["summary"]
