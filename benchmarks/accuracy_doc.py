"""Regenerate docs/results/accuracy.md from a benchmarks/eval_gpu.py output directory.

Usage (from the repository root, after copying the GPU run's OUT back here):

    python3 benchmarks/accuracy_doc.py OUT [--doc docs/results/accuracy.md]

Writes the page atomically and copies the plots to docs/results/accuracy/gpu/{main,budget}/.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.errors import SpardaError  # noqa: E402
from sparda.eval.accuracy_doc import write_doc  # noqa: E402

#: Where the page lives: with the other measured results, plots beside it in accuracy/gpu/.
DEFAULT_DOC = Path(__file__).resolve().parents[1] / "docs" / "results" / "accuracy.md"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the eval_gpu.py output directory (holds main/, budget/, calls.json)")
    p.add_argument("--doc", default=str(DEFAULT_DOC))
    args = p.parse_args(argv)
    try:
        print(f"wrote {write_doc(Path(args.out), Path(args.doc))}")
    except SpardaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
