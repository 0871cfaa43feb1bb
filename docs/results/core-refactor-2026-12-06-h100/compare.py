"""Summarise run.sh's output folder: greedy-token agreement and old/new bench numbers."""

import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
rows = []
try:
    old, new = (json.loads((out / f"tokens-{v}.json").read_text()) for v in ("old", "new"))
    for method in ("sparda", "sparse", "dense"):
        same = sum(a == b for a, b in zip(old[method], new[method]))
        rows.append(f"tokens {method:7s} {same}/{len(old[method])} prompts identical")
except Exception as exc:  # noqa: BLE001 - report what is there
    rows.append(f"tokens: {exc}")
summary = {}
for path in sorted(out.glob("bench-*-*/results.json")):
    version, rep = path.parent.name.split("-")[1:]
    data = json.loads(path.read_text())
    for rec in data.get("records", data) if isinstance(data, dict) else data:
        if rec.get("status") == "ok":
            key = (rec["batch"], version)
            summary.setdefault(key, []).append((rec.get("decode_tok_s"), rec.get("prefill_tok_s")))
for (batch, version), vals in sorted(summary.items()):
    rows.append(f"B{batch:<3d} {version}: tok/s {[v[0] for v in vals]}  prefill tok/s {[v[1] for v in vals]}")
(out / "summary.txt").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
