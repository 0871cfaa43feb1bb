"""Pass key at 7,680 tokens with and without dense retrieval heads (design §3.7; CPU, fp32).

Rebuilds ``sparda eval`` passkey prompts (held-out Emma, task ``passkey``, the seeds and
depths of ``--prompts``; below, the three failing prompts of design §3.7) and generates
greedily with each ``--methods`` entry under
``--dense-heads`` none and auto (the shipped calibration), printing per prompt whether the
answer holds the key and the fraction of KV blocks read per decode step.

    PYTHONPATH=src python3 benchmarks/passkey_dense_heads.py --prompts 1:0.25,16:0.25,21:0.25
    PYTHONPATH=src python3 benchmarks/passkey_dense_heads.py --budget-pct 5 \\
        --prompts 2:0.5,7:0.5,12:0.5,27:0.5,8:0.75,13:0.75

One batch of prompts per (method, setting); about 2-3 minutes per batch of six on two cores.
"""

from __future__ import annotations

import argparse
import json

from sparda.data import heldout_text
from sparda.engine.llm import LLM
from sparda.eval.metrics import budget_topk
from sparda.eval.tasks import make_sample


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", required=True, help="SEED:DEPTH,... of task passkey")
    ap.add_argument("--length", type=int, default=7680)
    ap.add_argument("--methods", default="sparse,sparda")
    ap.add_argument("--settings", default="none,auto", help="--dense-heads values to compare")
    ap.add_argument("--budget-pct", type=float, default=None, help="KV budget in %% of the context [default: preset]")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()
    pairs = [(int(s), float(d)) for s, d in (p.split(":") for p in args.prompts.split(","))]
    rows = []
    for method in args.methods.split(","):
        for setting in args.settings.split(";" if ";" in args.settings else ","):
            extra = {}
            if args.budget_pct is not None:
                from sparda.config import SelectionConfig

                extra["topk_blocks"] = budget_topk(args.budget_pct, args.length, SelectionConfig.from_preset("small"))
            llm = LLM(method=method, device="cpu", dtype="float32", dense_heads=setting, **extra)
            samples = [make_sample("passkey", llm.tokenizer, heldout_text(), args.length, d, s) for s, d in pairs]
            outs = llm.generate([s.prompt for s in samples], max_new_tokens=16, chat=True)
            for (seed, depth), sample, out in zip(pairs, samples, outs):
                row = {"method": method, "dense_heads": setting, "heads": [list(h) for h in llm.config.dense_heads],
                       "seed": seed, "depth": depth, "right": sample.answers[0] in out.text,
                       "kv_read": out.stats["kv_read_fraction"], "text": out.text.strip()[:40]}
                rows.append(row)
                print(json.dumps(row), flush=True)
            right = sum(r["right"] for r in rows[-len(pairs):])
            read = sum(r["kv_read"] for r in rows[-len(pairs):]) / len(pairs)
            print(f"# {method} dense_heads={setting} {llm.config.dense_heads}: {right}/{len(pairs)} right, "
                  f"KV read per step {100 * read:.1f} %", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
