"""Benchmark report (docs/bench.md), each file written atomically: ``report.md`` (header,
issue #20's verdicts, per model x context the decode table with :func:`~sparda.bench.records.derived`
columns and speed-ups, points, the memory-capped comparison, the paper's table) and the
plots ``throughput.png``, ``speedup.png``, ``capped.png``, ``breakdown.png``, ``roofline.png``
(each when it has data).
"""

from __future__ import annotations

from pathlib import Path

from sparda.bench.criteria import ISSUE20, check_issue20, judged
from sparda.bench.records import (DEFAULT_SLOT_FACTOR, capped_best, derived, method_label, ok, record_field,
                                  selection_kind, speedups, timing_describes_tpot, variant_parts)
from sparda.io import atomic_output, atomic_write

#: the paper's decode throughput (tok/s), H100, MiniCPM4.1-8B, 128K context: batch -> (sparda, sparse-offload)
PAPER_DECODE = {4: (240.2, 167.8), 16: (705.3, 447.9), 64: (1000.1, 788.9)}
#: H200 / H100 HBM bandwidth (4.8 / 3.35 TB/s, rounded as issue #20 does): the paper's H100 tok/s scaled to an H200
HBM_RATIO_H200_H100 = 1.4
#: the shape and context of the paper's table, and of ours beside it
PAPER_SHAPE = ("minicpm-8b", 131072)
#: plots written when there is something to draw, in this order
PLOTS = ("throughput.png", "speedup.png", "capped.png", "breakdown.png", "roofline.png")


def _same_steps(rec: dict) -> bool:
    """An offloaded record whose copy timing describes its TPOT's steps (its waits are shown)."""
    return rec.get("kv") == "host" and timing_describes_tpot(rec)


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _g(value) -> str:
    return "-" if value is None else f"{value:g}"


def _points_table(recs: list[dict]) -> list[str]:
    """Every point's status, prefill and memory (the decode numbers are in :func:`_decode_table`)."""
    lines = ["| method | KV | batch | status | selection | prefill tok/s | TTFT ms | selection ms | PCIe MiB/token "
             "| peak GPU GiB | peak host GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        gpu, host = r.get("peak_gpu_bytes"), r.get("peak_host_bytes")
        lines.append("| " + " | ".join([
            method_label(r), r.get("kv") or "-", str(r["batch"]), r["status"], r.get("selection_source") or "-",
            _fmt(r.get("prefill_tok_s")), _fmt(r.get("ttft_ms")), _fmt(r.get("selection_ms"), 2),
            "-" if r.get("pcie_bytes_per_token") is None else f"{r['pcie_bytes_per_token'] / 2**20:.2f}",
            "-" if gpu is None else f"{gpu / 2**30:.1f}", "-" if host is None else f"{host / 2**30:.1f}"]) + " |")
    return lines


#: the decode table's columns: (header, function of (record, derived columns) -> text)
DECODE_COLUMNS = (
    ("method", lambda r, d: method_label(r)),
    ("B", lambda r, d: str(r["batch"])),
    ("tok/s", lambda r, d: _fmt(r.get("decode_tok_s"))),
    ("TPOT ms", lambda r, d: _fmt(r.get("tpot_ms"), 2)),
    ("kernel ms", lambda r, d: _fmt(r.get("gpu_kernel_ms"), 2)),
    ("TPOT / kernel", lambda r, d: _fmt(d["tpot_per_kernel"], 2)),
    ("kernels/step", lambda r, d: _fmt(r.get("kernels_per_step"), 0)),
    ("launches/layer", lambda r, d: _fmt(d["launches_per_layer"])),
    ("roofline ms", lambda r, d: _fmt(r.get("roofline_tpot_ms"), 2)),
    ("roof ×", lambda r, d: _fmt(d["roof_x"], 2)),
    ("bound", lambda r, d: r.get("roofline_bound") or "-"),
    ("copy ms", lambda r, d: _fmt(r.get("copy_ms"), 2) if r.get("kv") == "host" else "-"),
    ("exposed ms", lambda r, d: _fmt(r.get("exposed_wait_ms"), 2) if _same_steps(r) else "-"),
    ("exposed % TPOT", lambda r, d: _fmt(d["exposed_pct"]) if r.get("kv") == "host" else "-"),
    ("transfer exposed ms", lambda r, d: _fmt(r.get("exposed_transfer_ms"), 2) if _same_steps(r) else "-"),
    ("timed step ms", lambda r, d: _fmt(r.get("timed_step_ms"), 2) if r.get("kv") == "host" else "-"),
    ("PCIe GB/s overlapped", lambda r, d: _fmt(d["pcie_gbps_overlapped"])),
    ("compute alone ms", lambda r, d: _fmt(r.get("compute_alone_ms"), 2)),
    ("transfer alone ms", lambda r, d: _fmt(r.get("transfer_alone_ms"), 2)),
    ("overlap eff.", lambda r, d: _fmt(d["overlap_efficiency"], 2)),
    ("hit rate", lambda r, d: _fmt(r.get("hit_rate"), 3)),
    ("target hit rate", lambda r, d: _g(r.get("target_hit_rate"))),
    ("GPU cap GB", lambda r, d: _g(r.get("gpu_mem_cap_gb"))),
    ("parity (steps)", lambda r, d: "-" if r.get("graph_tokens_equal") is None
     else f"{r['graph_tokens_equal']} ({r.get('parity_steps', '?')})"),
)

DECODE_LEGEND = ("Decode columns: `kernel ms` = summed GPU kernel time per step over both streams (above TPOT "
                 "where the copy overlaps compute); `launches/layer` = kernels per step / layers (embedding, final "
                 "norm and LM head counted in); `roof ×` = TPOT / roofline; `bound` = the roofline's larger term "
                 "(`hbm`: weights + KV reads, `pcie`: the misses); `exposed % TPOT` = the compute stream's wait for "
                 "the lookahead (selection chain and copy) / TPOT; `transfer exposed ms` = the part of that wait "
                 "after the copy's inputs were ready (the issue's exposed-transfer criterion); `timed step ms` = the wall time per "
                 "step of the timestamped run those waits come from; `PCIe GB/s overlapped` = missed bytes per step / copy ms (the copy timed inside "
                 "the real step); `overlap eff.` = (compute + transfer − TPOT) / min(compute, transfer), compute "
                 "and transfer each measured alone in the same run; `target hit rate`: synthetic selection "
                 "(`--hit-rate`) instead of the trace; `parity`: greedy tokens of that many replayed CUDA-graph "
                 "steps equal an eager run. `-`: not measured by that run.")


def _order(r: dict) -> tuple:
    """Trace/native points first, then synthetic hit rates, then capped points; by batch within each."""
    h = r.get("target_hit_rate")
    return (r.get("gpu_mem_cap_gb") or 0.0, h is not None, h or 0.0, r["batch"])


def _decode_table(recs: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(h for h, _ in DECODE_COLUMNS) + " |", "|" + "---|" * len(DECODE_COLUMNS)]
    for r in sorted(ok(recs), key=_order):
        d = derived(r)
        lines.append("| " + " | ".join(f(r, d) for _, f in DECODE_COLUMNS) + " |")
    return lines


def _speedup_table(pairs: list[dict]) -> list[str]:
    lines = ["| selection | B | sparda tok/s | sparse-offload tok/s | speed-up |", "|---|---|---|---|---|"]
    for p in pairs:
        sel = f"H = {p['target_hit_rate']:g}" if p["target_hit_rate"] is not None else (p["selection"] or "-")
        if p.get("gpu_mem_cap_gb") is not None:
            sel += f", cap {p['gpu_mem_cap_gb']:g} GB"
        if record_field(p, "kv_dtype") != "bf16":
            sel += f", KV {record_field(p, 'kv_dtype')}"
        sel += "".join(f", {part}" for part in variant_parts(p))
        lines.append(f"| {sel} | {p['batch']} | {p['fast_tok_s']:.1f} | {p['slow_tok_s']:.1f} | "
                     f"{p['speedup']:.2f}× |")
    return lines


def _groups(records: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["context"]), []).append(r)
    return groups


def _done_when(records: list[dict], device) -> list[str]:
    lines = ["## Done when (issue #20), from these records", ""]
    if device and "H200" not in str(device):
        lines += [f"Measured on {device}: the thresholds are issue #20's for an H200, so these verdicts only "
                  "say how far this device is from them.", ""]
    lines += ["| criterion | measured | verdict |", "|---|---|---|"]
    for v in check_issue20(records):
        verdict = f"**{v.verdict}**" if v.verdict != "NOT MEASURED" else v.verdict
        lines.append(f"| {v.criterion} | {v.measured} | {verdict} |")
    left_out = len(ok(records)) - len(ok(judged(records)))
    return lines + ["", "Thresholds: `sparda.bench.criteria.ISSUE20`. NOT MEASURED: no record (or only part of "
                    "the points) covers the criterion. Only bf16 KV caches count, of offloaded methods only "
                    f"records at the default slot factor ({DEFAULT_SLOT_FACTOR:g}; records from before spare "
                    "slots count as 1), and only records without early attention (the defaults): the others "
                    f"are ablations, labelled in the tables ({left_out} of the {len(ok(records))} measured "
                    "points here are left out of the verdicts).", ""]


def _capped_section(records: list[dict]) -> list[str]:
    best = capped_best(records)
    if not best:
        return []
    lines = ["## Memory-capped comparison (best decode tok/s per method under the GPU cap)", "",
             "| model | context | GPU cap GB | method | KV | best tok/s | at batch | selection |",
             "|---|---|---|---|---|---|---|---|"]
    for (model, ctx, cap), by_method in best.items():
        for method, r in sorted(by_method.items(), key=lambda kv: -kv[1]["decode_tok_s"]):
            lines.append(f"| {model} | {ctx:,} | {cap:g} | {method} | {r.get('kv') or '-'} | "
                         f"{r['decode_tok_s']:.1f} | {r['batch']} | {r.get('selection_source') or '-'} |")
    return lines + [""]


def _ours(records: list[dict]) -> dict[int, dict[str, float]]:
    """Our best tok/s per batch and method at the paper's shape (trace selection, no cap, bf16 KV)."""
    model, ctx = PAPER_SHAPE
    best: dict[int, dict[str, float]] = {}
    for r in ok(records):
        if (r["model"], r["context"]) != (model, ctx) or r.get("gpu_mem_cap_gb") is not None \
                or selection_kind(r) != "trace" or r["method"] not in ("sparda", "sparse-offload") \
                or record_field(r, "kv_dtype") != "bf16":  # the paper's cache
            continue
        at = best.setdefault(r["batch"], {})
        at[r["method"]] = max(at.get(r["method"], 0.0), r["decode_tok_s"])
    return best


def _paper_section(records: list[dict]) -> list[str]:
    ours, k = _ours(records), HBM_RATIO_H200_H100
    lines = [f"## The paper's decode table beside ours ({PAPER_SHAPE[0]} shape, {PAPER_SHAPE[1]:,} tokens, tok/s)", "",
             f"The paper ran MiniCPM4.1-8B on an H100; `× {k}` scales its numbers by the H200/H100 HBM bandwidth "
             f"ratio ({k}, as issue #20 does): an estimate of the paper on our GPU, not a measurement. Ours: "
             "trace-replayed selection, random weights of the same shape, no GPU cap, the best run of each point.",
             "", f"| batch | paper sparda (H100) | paper sparse-offload (H100) | paper speed-up | paper sparda × {k} "
             f"| paper sparse-offload × {k} | our sparda | our sparse-offload | our speed-up | our sparda / "
             f"(paper × {k}) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for b in sorted(set(PAPER_DECODE) | set(ours)):
        ps, po = PAPER_DECODE.get(b, (None, None))
        os_, oo = ours.get(b, {}).get("sparda"), ours.get(b, {}).get("sparse-offload")
        cells = [_fmt(ps), _fmt(po), f"{ps / po:.2f}×" if ps and po else "-",
                 _fmt(ps * k if ps else None), _fmt(po * k if po else None), _fmt(os_), _fmt(oo),
                 f"{os_ / oo:.2f}×" if os_ and oo else "-", f"{os_ / (ps * k):.2f}" if os_ and ps else "-"]
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return lines + [""]


def render_markdown(records: list[dict], env: dict, plots: list[str] | None = None) -> str:
    """The report as markdown text (module doc): ``records`` (missing fields ``-``), ``env`` (its
    ``runs``: the files merged), ``plots`` (names to list; ``None``: the three every sweep writes)."""
    lines = [f"# sparda bench — {env.get('device') or 'device unknown'}, {env.get('date') or 'date unknown'}", "",
             f"Commit `{env.get('commit')}`, torch {env.get('torch')}. Measured bandwidths: HBM "
             f"{env.get('hbm_gbps')} GB/s (device copy), PCIe {env.get('pcie_gbps')} GB/s (pinned host→device).",
             ""]
    if env.get("runs"):
        lines += ["Merged from (for a point measured more than once, the newest record is kept):", ""]
        lines += [f"* `{r['file']}`: {r['records']} records, {r.get('date') or 'date unknown'}, commit "
                  f"`{r.get('commit') or '-'}`" for r in env["runs"]]
        lines += [""]
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
    lines += _done_when(records, env.get("device"))
    lines += [DECODE_LEGEND, ""]
    for (model, context), recs in _groups(records).items():
        pre = {r.get("prefill_tokens") for r in recs if r.get("prefill_tokens")}
        lines += [f"## {model}, context {context:,} tokens", ""]
        if ok(recs):
            lines += ["### Decode", ""] + _decode_table(recs) + [""]
        pairs = speedups(recs)
        if pairs:
            lines += ["### `sparda` over `sparse-offload` (same point, same storage, diff and copy engine)", ""]
            lines += _speedup_table(pairs) + [""]
        lines += [f"### Points: status, prefill (timed on {', '.join(map(str, sorted(pre))) or '-'} tokens), memory",
                  ""] + _points_table(recs) + [""]
        bad = [r for r in recs if r["status"] not in ("ok",) and r.get("error")]
        if bad:
            lines += ["Not run / failed: " + "; ".join(f"{r['method']} B{r['batch']}: {r['status']} ({r['error']})"
                                                      for r in bad[:12]), ""]
    lines += _capped_section(records)
    lines += _paper_section(records)
    shown = list(plots) if plots is not None else ["throughput.png", "breakdown.png", "roofline.png"]
    lines += ["Plots: " + (", ".join(f"`{p}`" for p in shown) if shown else "none") + ".", ""]
    return "\n".join(lines)


def _save(fig, path: Path) -> None:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=110, bbox_inches="tight")


def _panels(plt, n: int, width: float = 5.0):
    fig, axes = plt.subplots(1, n, figsize=(width * n, 4), squeeze=False)
    return fig, axes[0]


def _throughput(plt, recs: list[dict], out: Path) -> Path | None:
    groups = _groups([r for r in recs if r.get("target_hit_rate") is None and r.get("gpu_mem_cap_gb") is None])
    if not groups:
        return None
    fig, axes = _panels(plt, len(groups))
    for ax, ((model, ctx), rs) in zip(axes, groups.items()):
        for method in dict.fromkeys(r["method"] for r in rs):
            pts = sorted((r["batch"], r["decode_tok_s"]) for r in rs if r["method"] == method)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set(xscale="log", xlabel="batch", ylabel="decode tok/s", title=f"{model}, {ctx:,} tokens")
        batches = sorted({r["batch"] for r in rs})
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    return _finish(plt, fig, out / "throughput.png")


def _speedup_plot(plt, recs: list[dict], out: Path) -> Path | None:
    pairs = [p for p in speedups(recs) if p["target_hit_rate"] is not None and p["gpu_mem_cap_gb"] is None]
    groups: dict[tuple, list[dict]] = {}
    for p in pairs:
        groups.setdefault((p["model"], p["context"]), []).append(p)
    if not groups:
        return None
    need = ISSUE20["speedup_h07"]
    fig, axes = _panels(plt, len(groups))
    for ax, ((model, ctx), ps) in zip(axes, groups.items()):
        for b in sorted({p["batch"] for p in ps}):
            pts = sorted((p["target_hit_rate"], p["speedup"]) for p in ps if p["batch"] == b)
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"B{b}")
        ax.axhline(need["min_speedup"], color="k", linestyle="--", linewidth=0.8,
                   label=f"issue #20: {need['min_speedup']:g}× at H = {need['target_hit_rate']:g}")
        ax.axhline(1.0, color="grey", linestyle=":", linewidth=0.8)
        rates = [p["target_hit_rate"] for p in ps]
        ax.set_xlim(min(rates + [0.5]) - 0.05, max(rates + [0.9]) + 0.05)
        ax.set(xlabel="target step-to-step hit rate H", ylabel="sparda / sparse-offload tok/s",
               title=f"{model}, {ctx:,} tokens")
        ax.legend(fontsize=7)
    return _finish(plt, fig, out / "speedup.png")


def _capped_plot(plt, recs: list[dict], out: Path) -> Path | None:
    best = capped_best(recs)
    if not best:
        return None
    fig, axes = _panels(plt, len(best))
    for ax, ((model, ctx, cap), by_method) in zip(axes, best.items()):
        names = list(by_method)
        vals = [by_method[m]["decode_tok_s"] for m in names]
        labels = [f"{m}\n({by_method[m].get('kv') or '?'} KV)" for m in names]
        bars = ax.bar(labels, vals, color=["C0" if by_method[m].get("kv") == "host" else "C1" for m in names])
        for bar, m in zip(bars, names):
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"B{by_method[m]['batch']}",
                    ha="center", va="bottom", fontsize=8)
        ax.set(ylabel="best decode tok/s", title=f"{model}, {ctx:,} tokens, GPU cap {cap:g} GB")
        ax.tick_params(axis="x", labelsize=7)
    return _finish(plt, fig, out / "capped.png")


def _breakdown(plt, recs: list[dict], out: Path) -> Path | None:
    from sparda.bench.timing import COMPONENTS

    groups = _groups([r for r in recs if r.get("breakdown_ms")])
    if not groups:
        return None
    fig, axes = _panels(plt, len(groups))
    for ax, ((model, ctx), rs) in zip(axes, groups.items()):
        best = {}
        for r in rs:
            if r["batch"] >= best.get(r["method"], {}).get("batch", 0):
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
    return _finish(plt, fig, out / "breakdown.png")


def _roofline(plt, recs: list[dict], out: Path) -> Path | None:
    pts = [r for r in recs if r.get("roofline_tpot_ms") is not None and r.get("tpot_ms") is not None]
    if not pts:
        return None
    fig, ax = plt.subplots(figsize=(5, 5))
    for method in dict.fromkeys(r["method"] for r in pts):
        xy = [(r["roofline_tpot_ms"], r["tpot_ms"]) for r in pts if r["method"] == method]
        ax.scatter([p[0] for p in xy], [p[1] for p in xy], label=method, s=14)
    top = max(max(r["tpot_ms"], r["roofline_tpot_ms"]) for r in pts)
    ax.plot([0, top], [0, top], "k--", linewidth=0.8, label="measured = roofline")
    ax.set(xlabel="roofline TPOT ms", ylabel="measured TPOT ms", title="measured vs roofline")
    ax.legend(fontsize=7)
    return _finish(plt, fig, out / "roofline.png")


def _finish(plt, fig, path: Path) -> Path:
    try:
        _save(fig, path)
    finally:
        plt.close(fig)
    return path


def plot(records: list[dict], out: Path) -> list[Path]:
    """Write the plots of :data:`PLOTS` that have data (module doc); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs, out = ok(records), Path(out)
    paths = [_throughput(plt, recs, out), _speedup_plot(plt, recs, out), _capped_plot(plt, recs, out),
             _breakdown(plt, recs, out), _roofline(plt, recs, out)]
    return [p for p in paths if p is not None]


def write_report(records: list[dict], env: dict, out: Path) -> Path:
    """Write ``report.md`` and the plots into ``out``; returns the report's path. Raises SpardaError
    if a file cannot be written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        plots = [p.name for p in plot(records, out)]
    except ImportError:  # pragma: no cover - matplotlib missing on a bare GPU box
        env, plots = {**env, "plots": "matplotlib not installed: no plots"}, []
    path = out / "report.md"
    atomic_write(path, render_markdown(records, env, plots=plots))
    return path
