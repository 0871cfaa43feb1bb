"""Calibration of dense retrieval heads, ``sparda calibrate-heads`` (design §3.7).

Teacher-forced needle prompts from the training split, one dense forward each; per
retrieval query, layer and KV head, ``mass`` is the group's mean attention on the needle
tokens and ``lost = mass - seen``, ``seen`` its part inside the head's own §3.2-3.4
selection. The rule that picks heads from the mean ``lost``: design §3.7, :func:`choose_heads`.
"""

from __future__ import annotations

import json
import math
import random
import shlex
from pathlib import Path

import torch

from sparda.errors import SpardaError
from sparda.io import atomic_write, check_output_file
from sparda.kernels import reference as ref

#: default tasks whose needles calibrate the heads
TASKS = ("passkey", "niah-single")


def needle_positions(offsets: list[tuple[int, int]], text: str, needle: str) -> list[int]:
    """Token indices whose ``offsets[i] = (start, end)`` overlap an occurrence of ``needle`` in ``text``."""
    spans, at = [], text.find(needle)
    while at >= 0:
        spans.append((at, at + len(needle)))
        at = text.find(needle, at + 1)
    return [i for i, (a, b) in enumerate(offsets) if b > a and any(a < e and b > s for s, e in spans)]


def prompt_depths(count: int, seed: int) -> list[float]:
    """``count`` needle depths in [0.1, 0.9], stratified and shuffled by ``seed``."""
    rng = random.Random(f"calibrate-heads-{seed}")
    depths = [round(0.1 + 0.8 * (i + rng.random()) / count, 3) for i in range(count)]
    rng.shuffle(depths)
    return depths


def build_prompt(tokenizer, task: str, haystack: str, length: int, depth: float, seed: int):
    """One teacher-forced needle sequence: ``(ids, needle, answer_start)``, the chat-wrapped prompt
    plus answer tokens, the prompt indices spelling the answer, the answer's first index.

    Raises:
        SpardaError: the answer does not occur in the prompt.
    """
    from sparda.eval.tasks import make_sample

    sample = make_sample(task, tokenizer, haystack, length, depth, seed)
    answer = sample.answers[0]
    text = sample.prompt
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    needle = needle_positions(enc["offset_mapping"], text, answer)
    if not needle:
        raise SpardaError(f"task {task!r} has no needle in its prompt; use passkey or niah-* tasks")
    prompt_ids = list(enc["input_ids"])
    return prompt_ids + tokenizer.encode(answer, add_special_tokens=False), needle, len(prompt_ids)


def head_losses(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, needle: torch.Tensor, cfg):
    """Needle mass and the part the compressed-key selection loses, per KV head.

    Args:
        q: ``[1, H, G, Q, d]``, k: ``[1, H, T, d]`` post-RoPE. q_pos: ``[1, Q]`` int64.
        needle: ``[M]`` int64 token positions.
    Returns:
        ``(mass, lost)``, ``[H, Q]`` fp32 each (fractions of the group's attention).
    """
    t = k.shape[-2]
    logits = torch.einsum("bhgqd,bhtd->bhgqt", q.float(), k.float()) / math.sqrt(q.shape[-1])
    visible = torch.arange(t, device=k.device).view(1, -1) <= q_pos.view(-1, 1)  # [Q, T]
    probs = torch.softmax(logits.masked_fill(~visible, -math.inf), -1).mean(2)[0]  # [H, Q, T]
    on_needle = probs[..., needle]  # [H, Q, M]
    ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()
    num_blocks = -(-t // cfg.block_size)
    scores = ref.pool_to_blocks(ref.query_group_scores(q, ck, q_pos, cfg.kernel_size, cfg.kernel_stride),
                                num_blocks, cfg)
    keep = ref.select_blocks(scores, q_pos, cfg)[0][..., needle // cfg.block_size]  # [H, Q, M]
    mass = on_needle.sum(-1)
    return mass, mass - (on_needle * keep).sum(-1)


def choose_heads(lost: list[tuple[float, int, int]], coverage: float, max_heads: int,
                 min_share: float) -> list[tuple[int, int]]:
    """Smallest prefix of ``lost`` (``(loss, layer, head)``, descending) reaching ``coverage`` of the
    total, at most ``max_heads``, without heads under ``min_share`` of the first (design §3.7)."""
    total = sum(x for x, _, _ in lost)
    chosen, acc = [], 0.0
    for value, layer, head in lost[:max_heads]:
        if total <= 0 or value <= 0 or value < min_share * lost[0][0] or acc >= coverage * total:
            break
        chosen.append((layer, head))
        acc += value
    return chosen


@torch.no_grad()
def calibrate_heads(model=None, *, prompts: int = 12, lengths=(4096, 6144), tasks=TASKS, seed: int = 0,
                    coverage: float = 0.9, max_heads: int | None = None, min_share: float = 0.03,
                    preset: str = "small", device=None, out: str | None = None, llm=None,
                    texts: list[str] | None = None) -> dict:
    """Score every (layer, KV head) and write the chosen heads as JSON (design §3.7).

    Args:
        prompts: needle prompts (>= 1). lengths: ``(shortest, longest)`` tokens, within
            ``[dense_len, max_positions - 64]``. tasks: needle tasks of :mod:`sparda.eval.tasks`.
        coverage, max_heads, min_share: :func:`choose_heads` (``max_heads=None``: ``ceil(0.03 L H_kv)``).
        out: JSON path; ``None``: ``sparda_dense_heads.json`` in the model directory.
    Returns:
        The JSON written (``heads`` ``[[layer, head], ...]``, ``ranking``, ...) plus ``path``.
    Raises:
        SpardaError: bad counts, lengths, tasks or output path (before the model runs).
    """
    from sparda.attention.dense_heads import CALIBRATION_FILE, FORMAT
    from sparda.attention.forecast import model_identity, model_name
    from sparda.engine.llm import LLM

    if prompts < 1:
        raise SpardaError(f"--prompts must be >= 1, got {prompts}")
    if not 0 < coverage <= 1:
        raise SpardaError(f"--coverage must lie in (0, 1], got {coverage}")
    if max_heads is not None and max_heads < 1:
        raise SpardaError(f"--max-heads must be >= 1, got {max_heads}")
    if not 0 <= min_share <= 1:
        raise SpardaError(f"--min-share must lie in [0, 1], got {min_share}")
    lengths = sorted(int(n) for n in lengths)
    if len(lengths) not in (1, 2):
        raise SpardaError(f"--lengths takes one or two values (shortest,longest), got {lengths}")
    from sparda.eval.tasks import TASKS as KNOWN

    bad = [t for t in tasks if t not in KNOWN or not (t.startswith("passkey") or t.startswith("niah"))]
    if not tasks or bad:
        raise SpardaError(f"--tasks must be needle tasks (passkey, passkey-synth, niah-*), got {', '.join(bad) or 'none'}")
    if out is not None:
        check_output_file(out, "--out", CALIBRATION_FILE)
    llm = llm or LLM(model, method="dense", preset=preset, device=device,
                     dtype="float32" if device in (None, "cpu") else None)
    net, cfg, shape = llm.model, llm.config.selection, llm.shape
    lo, hi = lengths[0], lengths[-1]
    if not (cfg.dense_len <= lo and max(cfg.budget_tokens, cfg.dense_len) < lo and hi + 64 <= shape.max_positions):
        raise SpardaError(f"--lengths {lo},{hi} must lie in ({max(cfg.budget_tokens, cfg.dense_len - 1)}, "
                          f"{shape.max_positions - 64}] (shorter prompts are dense; longer exceed the context)")
    path = Path(out) if out is not None else Path(llm.model_dir) / CALIBRATION_FILE
    if out is None:
        check_output_file(path, "the calibration file", CALIBRATION_FILE)
    if texts is None:
        from sparda.data import TRAIN_TEXTS, train_texts

        texts, names = train_texts(), list(TRAIN_TEXTS)
    else:
        names = [f"text {i}" for i in range(len(texts))]
    depths = prompt_depths(prompts, seed)
    lost_sum = torch.zeros(shape.num_layers, shape.num_kv_heads)
    mass_sum = torch.zeros_like(lost_sum)
    count, used = 0, []
    for i in range(prompts):
        task, text = tasks[i % len(tasks)], texts[i % len(texts)]
        length = lo if prompts == 1 else round(lo + (hi - lo) * i / (prompts - 1))
        ids, needle, start = build_prompt(llm.tokenizer, task, text, length, depths[i], seed + i)
        q_idx = torch.arange(start, len(ids) - 1, device=llm.device)  # decode steps writing answer tokens 2..
        if not len(q_idx):
            continue
        needle_t = torch.tensor(needle, device=llm.device)
        x = torch.tensor([ids], device=llm.device)
        for layer, _, q, k, _, _ in net.dense_layers(x):
            mass, lost = head_losses(q[..., q_idx, :], k, q_idx.view(1, -1), needle_t, cfg)
            lost_sum[layer] += lost.sum(-1).cpu()
            mass_sum[layer] += mass.sum(-1).cpu()
        count += len(q_idx)
        used.append({"task": task, "text": names[i % len(names)], "tokens": len(ids), "depth": depths[i],
                     "seed": seed + i, "needle_tokens": len(needle), "queries": len(q_idx)})
    lost_mean, mass_mean = lost_sum / max(count, 1), mass_sum / max(count, 1)
    ranked = sorted(((float(lost_mean[l, h]), l, h) for l in range(shape.num_layers)
                     for h in range(shape.num_kv_heads)), key=lambda r: (-r[0], r[1], r[2]))
    cap = max_heads or max(1, math.ceil(0.03 * shape.num_layers * shape.num_kv_heads))
    heads = choose_heads(ranked, coverage, cap, min_share)
    total = sum(r[0] for r in ranked)
    identity = model_identity(llm.model.config, shape)
    command = ["sparda", "calibrate-heads", "--prompts", str(prompts), "--lengths", ",".join(map(str, lengths)),
               "--tasks", ",".join(tasks), "--seed", str(seed), "--coverage", str(coverage),
               "--min-share", str(min_share), "--preset", preset]
    command += ["--max-heads", str(max_heads)] if max_heads else []
    result = {"format": FORMAT, "heads": [[l, h] for l, h in heads],
              "ranking": [{"layer": l, "head": h, "lost": round(v, 5), "mass": round(float(mass_mean[l, h]), 5)}
                          for v, l, h in ranked[:12]],
              "total_lost": round(total, 5),
              "covered": round(sum(float(lost_mean[l, h]) for l, h in heads) / total, 4) if total > 0 else 0.0,
              "max_heads": cap, "coverage": coverage, "min_share": min_share,
              "model": {"name": model_name(llm.model_dir), **identity}, "preset": preset,
              "selection": {"block_size": cfg.block_size, "kernel_size": cfg.kernel_size,
                            "kernel_stride": cfg.kernel_stride, "budget_blocks": cfg.budget_blocks},
              "retrieval_queries": count, "prompts": used, "command": shlex.join(command)}
    atomic_write(path, json.dumps(result, indent=1) + "\n")
    return {**result, "path": str(path)}


def format_calibration(result: dict) -> str:
    """Plain-text summary: the ranking, the chosen heads and where they went."""
    lines = [f"dense-head calibration ({len(result['prompts'])} prompts, {result['retrieval_queries']} retrieval "
             f"queries, preset {result['preset']}, budget {result['selection']['budget_blocks']} blocks); needle "
             "mass lost to the compressed-key selection, mean per query:"]
    for row in result["ranking"]:
        lines.append(f"  layer {row['layer']:>2} head {row['head']}: lost {row['lost']:.4f} of mass {row['mass']:.4f}")
    chosen = ",".join(f"{l}:{h}" for l, h in result["heads"]) or "none"
    lines.append(f"dense heads = {chosen} ({100 * result['covered']:.0f} % of the lost mass {result['total_lost']:.4f}; "
                 f"written to {result['path']})")
    return "\n".join(lines)
