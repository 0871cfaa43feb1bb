"""Calibration of ``shallow``, ``sparda calibrate-shallow`` (design §7; the rule:
docs/baselines.md, Calibration of ``shallow``): the IoU of shallow layers' attention-mass
free top-k with the deep layers' ``sparse`` free top-k, and the number of fused layers ``N``
with the best mean IoU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sparda.errors import SpardaError
from sparda.io import atomic_write, check_output_file, read_text
from sparda.eval.selection import eval_window
from sparda.kernels import reference as ref

#: candidate numbers of dense shallow layers (the seed blog: 2 to 4)
CANDIDATES = (2, 3, 4)


def _iou(a: torch.Tensor, b: torch.Tensor) -> float:
    union = (a | b).sum().item()
    return (a & b).sum().item() / union if union else 1.0


@torch.no_grad()
def calibrate_shallow(model=None, text: str | None = None, *, length: int = 4096, queries: int = 64,
                      candidates=CANDIDATES, preset: str = "small", device=None, out: str | None = None,
                      llm=None) -> dict:
    """Measure the IoUs and write the chosen ``shallow_layers`` as JSON.

    Args:
        model: directory / .gguf / ``None``; ignored if ``llm`` is given. text: file or ``None`` (Emma).
        length: window tokens (``>= dense_len``, within the context). queries: positions scored.
        candidates: numbers of shallow layers (each ``1 .. L-1``). out: JSON path, or
            ``None`` for ``sparda_shallow.json`` in the model directory.
    Returns:
        ``{"shallow_layers", "fused_iou", "per_layer", "deep_layers", ..., "path"}``.
    Raises:
        SpardaError: bad arguments, text too short or unreadable, unwritable output.
    """
    from sparda.engine.llm import LLM
    from sparda.attention.baselines.shallow import CALIBRATION_FILE

    if queries < 1:
        raise SpardaError(f"--queries must be >= 1, got {queries}")
    body = read_text(text, "--text") if text is not None else None
    if out is not None:
        check_output_file(out, "--out", CALIBRATION_FILE)
    llm = llm or LLM(model, method="dense", preset=preset, device=device,
                     dtype="float32" if device in (None, "cpu") else None)
    net, cfg, shape = llm.model, llm.config.selection, llm.shape
    candidates = sorted(set(int(c) for c in candidates))
    if not candidates or candidates[0] < 1 or candidates[-1] >= shape.num_layers:
        raise SpardaError(f"--candidates must lie in 1..{shape.num_layers - 1} (a deep layer must remain), "
                          f"got {candidates}")
    if not cfg.dense_len <= length <= shape.max_positions:
        raise SpardaError(f"--length {length} is outside [{cfg.dense_len}, {shape.max_positions}] "
                          "(shorter contexts are dense; longer ones exceed the model's context)")
    path = Path(out) if out is not None else Path(llm.model_dir) / CALIBRATION_FILE
    if out is None:
        check_output_file(path, "the calibration file", CALIBRATION_FILE)
    if body is None:
        from sparda.data import heldout_text

        body, source = heldout_text(), "held-out Emma"
    else:
        source = text
    ids_all = llm.tokenizer.encode(body, add_special_tokens=False)
    if len(ids_all) < length:
        raise SpardaError(f"the text has {len(ids_all)} tokens, fewer than --length {length}; "
                          "pass a longer --text or a smaller --length")
    ids, q_idx = eval_window(ids_all, length, queries, llm.device)
    q_pos = q_idx.view(1, -1)
    num_blocks = -(-length // cfg.block_size)
    forced = ref.forced_blocks(q_pos, num_blocks, cfg)
    kv_len = torch.tensor([length], device=llm.device)
    top = max(candidates)
    masses, shallow_sets, deep_sets = [], [], {}
    for layer, _, q, k, _, _ in net.dense_layers(ids):
        qs = q[..., q_idx, :]
        if layer < top:
            mass = ref.block_attention_mass(qs, k, q_pos, kv_len, cfg.block_size) / shape.group_size
            masses.append(mass)
            shallow_sets.append(ref.select_blocks(mass, q_pos, cfg) & ~forced)
        else:
            ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()
            scores = ref.pool_to_blocks(ref.query_group_scores(qs, ck, q_pos, cfg.kernel_size, cfg.kernel_stride),
                                        num_blocks, cfg)
            deep_sets[layer] = ref.select_blocks(scores, q_pos, cfg) & ~forced
    deep = sorted(deep_sets)
    per_layer = []
    for s, sel in enumerate(shallow_sets):
        by_deep = {str(l): round(_iou(sel, deep_sets[l]), 4) for l in deep}
        per_layer.append({"layer": s, "mean_iou": round(sum(by_deep.values()) / len(deep), 4),
                          "iou_by_deep_layer": by_deep})
    fused = {}
    for n in candidates:
        sel = ref.select_blocks(torch.stack(masses[:n]).mean(0), q_pos, cfg) & ~forced
        fused[str(n)] = round(sum(_iou(sel, deep_sets[l]) for l in deep) / len(deep), 4)
    best = max(candidates, key=lambda n: (fused[str(n)], -n))
    result = {"format": "sparda-shallow-v1", "shallow_layers": best, "fused_iou": fused, "per_layer": per_layer,
              "deep_layers": [deep[0], deep[-1]], "text": source, "length": length, "queries": int(q_idx.numel()),
              "budget_blocks": cfg.budget_blocks, "preset": preset}
    atomic_write(path, json.dumps(result, indent=1) + "\n")
    return {**result, "path": str(path)}


def format_calibration(result: dict) -> str:
    """Plain-text summary: IoU per shallow layer, per fused ``N``, and the choice."""
    lo, hi = result["deep_layers"]
    lines = [f"shallow calibration ({result['text']}, {result['length']} tokens, {result['queries']} queries, "
             f"budget {result['budget_blocks']} blocks); IoU of free top-k vs deep layers {lo}..{hi} (query-based)"]
    for row in result["per_layer"]:
        lines.append(f"  layer {row['layer']:>2}: mean IoU {row['mean_iou']:.3f}")
    for n, value in result["fused_iou"].items():
        lines.append(f"  layers 0..{int(n) - 1} fused: mean IoU {value:.3f}")
    lines.append(f"shallow_layers = {result['shallow_layers']} (written to {result['path']})")
    return "\n".join(lines)
