"""Benchmark report: a markdown table (with device, date, commit) and matplotlib plots.

Files written to the output directory (each atomically):

* ``report.md``: header (device, date, commit, bandwidths, trace and its reuse), one
  table per model and context, the paper's decode table for comparison;
* ``throughput.png``: decode tok/s vs batch, one line per method, one panel per model x context;
* ``breakdown.png``: per-component decode ms/step (stacked bars) at each method's largest
  batch that ran;
* ``roofline.png``: measured TPOT vs roofline TPOT of every ``ok`` point.
"""

from __future__ import annotations

from pathlib import Path

from sparda.bench.timing import COMPONENTS
from sparda.io import atomic_output, atomic_write

#: the paper's decode throughput (tok/s), H100, MiniCPM4.1-8B, 128K context: batch -> (sparda, sparse-offload)
PAPER_DECODE = {4: (240.2, 167.8), 16: (705.3, 447.9), 64: (1000.1, 788.9)}


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _table(recs: list[dict]) -> list[str]:
    lines = ["| method | KV | batch | status | prefill tok/s | TTFT ms | decode tok/s | TPOT ms | roofline ms "
             "| % roofline | selection ms | exposed wait ms | hit rate | PCIe MiB/token | peak GPU GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        ok = r["status"] == "ok"
        frac = r.get("roofline_fraction")
        gpu = r.get("peak_gpu_bytes")
        lines.append("| " + " | ".join([
            r["method"], r.get("kv") or "-", str(r["batch"]), r["status"] if ok else f"{r['status']}",
            _fmt(r.get("prefill_tok_s")), _fmt(r.get("ttft_ms")), _fmt(r.get("decode_tok_s")),
            _fmt(r.get("tpot_ms"), 2), _fmt(r.get("roofline_tpot_ms"), 2),
            "-" if frac is None else f"{100 * frac:.0f}", _fmt(r.get("selection_ms"), 2),
            _fmt(r.get("exposed_wait_ms"), 2), _fmt(r.get("hit_rate"), 3),
            "-" if r.get("pcie_bytes_per_token") is None else f"{r['pcie_bytes_per_token'] / 2**20:.2f}",
            "-" if gpu is None else f"{gpu / 2**30:.1f}"]) + " |")
    return lines


def _groups(records: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["context"]), []).append(r)
    return groups


def render_markdown(records: list[dict], env: dict) -> str:
    """The report as markdown text."""
    lines = [f"# sparda bench — {env.get('device')}, {env.get('date')}", "",
             f"Commit `{env.get('commit')}`, torch {env.get('torch')}. Measured bandwidths: HBM "
             f"{env.get('hbm_gbps')} GB/s (device copy), PCIe {env.get('pcie_gbps')} GB/s (pinned host→device).",
             ""]
    trace = env.get("trace")
    if trace:
        parts = [f"{k}: step-to-step reuse {v['reuse']:.3f} (top-k {v['topk_reuse']:.3f})"
                 for k, v in trace.items() if isinstance(v, dict)]
        lines += [f"Offloaded methods replay the selection trace `{trace.get('file')}` (real SmolLM2-135M on "
                  f"held-out Emma, scaled to the benchmarked shape; docs/bench.md): " + "; ".join(parts) + ".", ""]
    else:
        lines += ["Offloaded methods select natively on random K/V (no trace): hit rates are pessimistic.", ""]
    lines += ["Decode points fill the KV cache directly with random K/V (no prefill); prefill is timed "
              "separately on `prefill_tokens` random tokens. Times are medians over repeats after warm-up; "
              "`selection ms` comes from a separate instrumented run.", ""]
    for (model, context), recs in _groups(records).items():
        pre = {r.get("prefill_tokens") for r in recs if r.get("prefill_tokens")}
        lines += [f"## {model}, context {context:,} tokens (prefill timed on {', '.join(map(str, pre)) or '-'} "
                  "tokens)", ""] + _table(recs) + [""]
        bad = [r for r in recs if r["status"] not in ("ok",) and r.get("error")]
        if bad:
            lines += ["Not run / failed: " + "; ".join(f"{r['method']} B{r['batch']}: {r['status']} ({r['error']})"
                                                      for r in bad[:12]), ""]
    lines += ["## The paper's decode table (H100, MiniCPM4.1-8B, 128K context, tok/s)", "",
              "| batch | sparda | sparse-offload | speed-up |", "|---|---|---|---|"]
    lines += [f"| {b} | {s} | {o} | {s / o:.2f}x |" for b, (s, o) in PAPER_DECODE.items()]
    lines += ["", "Plots: `throughput.png`, `breakdown.png`, `roofline.png`.", ""]
    return "\n".join(lines)


def _save(fig, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=110, bbox_inches="tight")


def plot(records: list[dict], out: Path) -> list[Path]:
    """Write the three plots (module doc); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r["status"] == "ok"]
    groups = _groups(ok)
    paths = []
    if not groups:
        return paths
    n = len(groups)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, ((model, ctx), recs) in zip(axes[0], groups.items()):
        for method in dict.fromkeys(r["method"] for r in recs):
            pts = sorted((r["batch"], r["decode_tok_s"]) for r in recs if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set(xscale="log", xlabel="batch", ylabel="decode tok/s", title=f"{model}, {ctx:,} tokens")
        ax.legend(fontsize=7)
    _save(fig, out / "throughput.png")
    plt.close(fig)
    paths.append(out / "throughput.png")

    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, ((model, ctx), recs) in zip(axes[0], groups.items()):
        best = {}
        for r in recs:
            if r.get("breakdown_ms") and r["batch"] >= best.get(r["method"], {}).get("batch", 0):
                best[r["method"]] = r
        names = list(best)
        bottom = [0.0] * len(names)
        for comp in COMPONENTS:
            vals = [best[m]["breakdown_ms"].get(comp, 0.0) for m in names]
            ax.bar(names, vals, bottom=bottom, label=comp)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(ylabel="ms / decode step", title=f"{model}, {ctx:,} tokens (largest batch run)")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
        ax.legend(fontsize=6)
    _save(fig, out / "breakdown.png")
    plt.close(fig)
    paths.append(out / "breakdown.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    for method in dict.fromkeys(r["method"] for r in ok):
        pts = [(r["roofline_tpot_ms"], r["tpot_ms"]) for r in ok if r["method"] == method]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], label=method, s=14)
    top = max(max(r["tpot_ms"], r["roofline_tpot_ms"]) for r in ok)
    ax.plot([0, top], [0, top], "k--", linewidth=0.8, label="measured = roofline")
    ax.set(xlabel="roofline TPOT ms", ylabel="measured TPOT ms", title="measured vs roofline")
    ax.legend(fontsize=7)
    _save(fig, out / "roofline.png")
    plt.close(fig)
    paths.append(out / "roofline.png")
    return paths


def write_report(records: list[dict], env: dict, out: Path) -> Path:
    """Write ``report.md`` and the plots into ``out``; returns the report's path."""
    out = Path(out)
    try:
        plot(records, out)
    except ImportError:  # pragma: no cover - matplotlib missing on a bare GPU box
        env = {**env, "plots": "matplotlib not installed: no plots"}
    path = out / "report.md"
    atomic_write(path, render_markdown(records, env))
    return path
