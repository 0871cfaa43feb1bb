"""How much neighbouring query tokens share their prefill selection (CPU, bundled model).

The block-sparse prefill attention kernel walks, per tile of ``T`` consecutive query tokens
(64 rows: ``T = 64 / G``), the union of the tile's selected blocks, so its cost follows the
overlap of neighbouring tokens' selections. Random weights (the 8B-shape benchmarks) give
nearly disjoint top-k sets; this script measures the overlap of real selections: the bundled
SmolLM2-135M on held-out Emma, block-sparse prefill (``small`` preset geometry, the dense
fallback lowered so every token past the first blocks selects), for ``sparda`` (shipped
Forecast), ``sparse`` (query-based) and ``sparda-random`` (an untrained Forecast).

Per method, over layers >= 1 and all KV heads: ``keep``, the fraction of a token's top-k
(non-forced) blocks that the previous token also chose (the decode hit rate's prefill
analogue), and ``union_T`` for T = 1, 4, 16: blocks in the union over T consecutive
tokens / blocks one token selects.

Usage: ``PYTHONPATH=src python3 benchmarks/prefill_overlap.py OUT.json [--tokens 4096]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def _stats(masks: list[torch.Tensor], q_pos: torch.Tensor, cfg) -> dict:
    """``masks``: per layer ``[1, H, Tq, N]`` bool over query positions ``q_pos [Tq]``."""
    from sparda.kernels.reference import forced_blocks

    keep, union = [], {1: [], 4: [], 16: []}
    for mask in masks:
        m = mask[0]  # [H, Tq, N]
        forced = forced_blocks(q_pos.view(1, -1), m.shape[-1], cfg)[0]  # [1, Tq, N]
        top = m & ~forced
        k = top.sum(-1).float()  # [H, Tq]
        both = (top[:, 1:] & top[:, :-1]).sum(-1).float()
        ok = k[:, 1:] > 0
        keep.append(float((both[ok] / k[:, 1:][ok]).mean()))
        per_token = m.sum(-1).float().mean()
        for t in union:
            n = m.shape[1] // t * t
            tiles = m[:, :n].reshape(m.shape[0], n // t, t, -1).any(2)
            union[t].append(float(tiles.sum(-1).float().mean() / per_token))
    return {"keep": round(sum(keep) / len(keep), 4),
            **{f"union_{t}": round(sum(v) / len(v), 3) for t, v in union.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=4096)
    args = ap.parse_args()
    from sparda.attention.forecast import load_forecast, shipped_path
    from sparda.data import heldout_text
    from sparda.engine.llm import LLM
    from sparda.model.loader import load_model, shipped_name

    model, tokenizer, model_dir = load_model(None, torch.device("cpu"), torch.float32)
    forecast = load_forecast(shipped_path(shipped_name(model_dir)), model.config, model.shape)[0]
    ids = tokenizer.encode(heldout_text())[:args.tokens]
    import datetime
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip() or "unknown"
    report = {"device": "cpu", "date": datetime.date.today().isoformat(), "commit": commit,
              "command": "PYTHONPATH=src python3 benchmarks/prefill_overlap.py OUT.json --tokens " + str(args.tokens),
              "model": "SmolLM2-135M-Instruct (bundled)", "text": "emma (held out)", "tokens": len(ids)}
    for method in ("sparda", "sparse", "sparda-random"):
        llm = LLM.from_model(model, tokenizer, method=method, preset="small", dense_len=0, prefill_chunk_tokens=0,
                             forecast=forecast if method == "sparda" else None)
        seen = []
        select = llm.method.select

        def capture(layer, q, h, cache, step, first=0, _select=select):
            mask = _select(layer, q, h, cache, step, first)
            if step.phase == "prefill" and layer > 0:
                seen.append((mask.cpu(), step.q_pos[0, first:].cpu()))
            return mask

        llm.method.select = capture
        cache = llm.new_cache(1, len(ids) + 8)
        with torch.no_grad():
            llm.prefill(cache, 0, ids)
        cfg = llm.config.selection
        start = cfg.budget_blocks * cfg.block_size  # earlier tokens select every valid block
        masks = [m[:, :, int((p < start).sum()):] for m, p in seen]
        pos = seen[0][1][seen[0][1] >= start]
        report[method] = {"layers": len(masks), "topk_blocks": cfg.topk_blocks, **_stats(masks, pos, cfg)}
        print(method, report[method], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
