"""The decode benchmark report of several sweep runs: merged records, markdown and plots.

Usage (from the repository root):

    python3 benchmarks/decode_report.py RUN_DIR_OR_JSON... --out DIR

Each input is a sweep's output directory (every ``*.json`` list of records in it, its
``env.json`` for the date and commit), a directory of such directories (the
``results.json`` of each subdirectory: ``benchmarks/decode_sweep_gpu.py OUT`` writes one
per part) or a ``results.json``-like file. A point measured
more than once (same model, method, context, batch, selection, target hit rate, GPU cap,
CUDA graphs, KV place, dtype, device) keeps its newest record: the record's own ``date``,
else its run's ``env.json`` date, then the later input on the command line, then the
newer file. Writes ``DIR/results.json`` (the merged records), ``DIR/report.md`` (issue
#20's Done-when verdicts, per-context decode tables, speed-ups, the capped comparison, the
paper's table beside ours) and the plots (``sparda.bench.report``), each atomically.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench.records import dedup, load_runs, merged_env  # noqa: E402
from sparda.errors import SpardaError  # noqa: E402
from sparda.io import atomic_write, check_output_dir  # noqa: E402


def build(inputs, out) -> tuple[Path, int, int]:
    """Merge ``inputs`` and write the report into ``out``; returns ``(report path, kept, dropped)``.

    Raises:
        SpardaError: a bad input (see :func:`sparda.bench.records.load_runs`) or output path,
            checked before anything is written.
    """
    from sparda.bench.report import write_report

    out = check_output_dir(out, "--out")
    entries, runs = load_runs(inputs)
    records, dropped = dedup(entries)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "results.json", json.dumps(records, indent=1, default=str))
    return write_report(records, merged_env(runs), out), len(records), dropped


@click.command(help=__doc__.split("\n")[0])
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", required=True, help="Output directory for results.json, report.md and the plots.")
def main(inputs, out) -> None:
    try:
        path, kept, dropped = build(inputs, out)
    except SpardaError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exc.exit_code)
    click.echo(f"wrote {path} ({kept} points; {dropped} older duplicates dropped)")


if __name__ == "__main__":
    main()
