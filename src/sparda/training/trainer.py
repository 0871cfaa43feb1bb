"""Train the Forecast with the base model frozen (design §5).

Each step packs ``batch_size`` sequences of ``seq_len`` tokens, runs the frozen model
layer by layer with *dense* attention (a documented simplification of design §5's
teacher-selected sparse attention: the bundled model's contexts are short enough), and
for every layer ``l`` computes the restricted KL between the fine-grained teacher of
layer ``l`` and the student ``F_{l-1}`` (``W^C_0`` for layer 0), with an immediate
backward per layer so memory stays flat in the number of layers. Query tokens for the
loss are a seeded random subset (``queries`` per step) of the positions past
``dense_len`` (where selection happens).
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from sparda.attention.forecast import Forecast, model_identity, model_name, q_init, save_forecast
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.io import atomic_output, check_output_file
from sparda.kernels import reference as ref
from sparda.training.data import Batches, load_texts, pack
from sparda.training.loss import free_selection, restricted_kl, restriction, student_distribution
from sparda.training.teacher import teacher_distribution


def layer_loss(forecast: Forecast, layer: int, h_prev, q, k, cos, sin, q_idx, cfg: SelectionConfig):
    """Loss and selection recall (vs the query-based ``sparse`` free top-k) of one layer.

    Args:
        forecast: the Forecast being trained; ``layer``: the scored layer (its Forecast
            is ``F_{layer-1}``, or ``W^C_0`` for layer 0).
        h_prev: ``[B, T, d_model]`` attention input of layer ``layer - 1`` (of layer 0 for 0).
        q: ``[B, H_kv, G, T, d]`` and k: ``[B, H_kv, T, d]`` post-RoPE, of ``layer``.
        cos, sin: ``[B, 1, T, d]`` query RoPE tables.
        q_idx: ``[Tq]`` int64 query positions (same for every row).
    Returns:
        ``(loss, hits, total)``: restricted KL (fp32 scalar with grad, design §5) and the
        free-top-k block counts (host ints) behind recall (design §8).
    """
    b = q.shape[0]
    q_pos = q_idx.view(1, -1).expand(b, -1)
    ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()
    teacher = teacher_distribution(q[..., q_idx, :], k, q_pos, cfg)
    entries = restriction(teacher, q_pos, k.shape[-2], cfg)
    f = forecast.project(layer, h_prev[:, q_idx].float(), cos[:, :, q_idx].float(), sin[:, :, q_idx].float())
    student = student_distribution(f, ck, q_pos, cfg, layer)
    loss = restricted_kl(teacher, student, entries)
    with torch.no_grad():
        num_blocks = -(-k.shape[-2] // cfg.block_size)
        sparse = ref.query_group_scores(q[..., q_idx, :], ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
        target = free_selection(ref.pool_to_blocks(sparse, num_blocks, cfg), q_pos, cfg)
        chosen = free_selection(ref.pool_to_blocks(student, num_blocks, cfg), q_pos, cfg)
        hits, total = (chosen & target).sum().item(), target.sum().item()
    return loss, hits, total


def train_forecast(model=None, data=None, *, seq_len: int = 4096, steps: int = 200, batch_size: int = 1,
                   lr: float = 5e-4, out: str | Path = "forecast.safetensors", resume: bool = False,
                   device=None, save_every: int = 50, queries: int = 256, seed: int = 0,
                   preset: str = "small", init: str = "q", betas=(0.9, 0.95), eps: float = 1e-6,
                   weight_decay: float = 0.01, clip: float = 0.5, progress: bool = True,
                   selection: SelectionConfig | None = None) -> dict:
    """Train Forecast weights for ``model`` and save them to ``out`` (design §5).

    Args:
        model: model directory / .gguf / ``None`` (bundled). data: paths or ``None`` (bundled split).
        seq_len: tokens per sequence; must exceed the preset's ``dense_len``.
        steps, batch_size, lr, betas, eps, weight_decay, clip: AdamW (constant lr) + grad clip.
        out: safetensors path; ``out.state.pt`` holds optimizer state for ``resume``.
        save_every: checkpoint period in steps. queries: loss query tokens per step.
        init: ``q`` (from the scored layer's query weights, :func:`q_init`) or ``random``.
        device: ``cpu`` (fp32) or ``cuda`` (frozen model in bf16, Forecast and loss in fp32).
        selection: a :class:`SelectionConfig` replacing ``preset`` (tests use tiny budgets).
    Returns: ``{"step", "first_loss", "loss", "recall", "seconds"}`` (``first_loss``: the loss of
        this run's first step, as the progress bar showed it; ``loss``, ``recall``: means of the
        last 20 steps).
    Raises: SpardaError for bad arguments, an ``out`` that cannot be written (checked before the
        model loads), data shorter than ``seq_len``, unreadable files. The weights and the
        checkpoint state are written atomically (:mod:`sparda.io`): no half-written file stays.
    """
    from tqdm import tqdm

    from sparda.engine.llm import resolve_device
    from sparda.model.loader import context_length, load_model

    cfg = selection or SelectionConfig.from_preset(preset)
    if seq_len <= cfg.dense_len:
        raise SpardaError(f"--seq-len {seq_len} must exceed the preset's dense_len {cfg.dense_len}")
    if steps < 1 or batch_size < 1 or queries < 1 or save_every < 1:
        raise SpardaError("--steps, --batch-size, --queries and --save-every must be >= 1")
    if not lr > 0:
        raise SpardaError(f"--lr must be > 0, got {lr}")
    if init not in ("q", "random"):
        raise SpardaError(f"unknown init {init!r}; choose q or random")
    out = check_output_file(out, "--out", "forecast.safetensors")
    state_path = out.with_name(out.name + ".state.pt")
    if resume and not state_path.is_file():
        raise SpardaError(f"--resume: no checkpoint state at {state_path}")
    check_output_file(state_path, "--out (checkpoint state)")
    dev = resolve_device(device)
    context = context_length(model)
    if context is not None and seq_len > context:
        raise SpardaError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens; lower --seq-len")
    texts, description = load_texts(data)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    net, tokenizer, model_dir = load_model(model, dev, dtype)
    net.requires_grad_(False)
    batches = Batches(pack(texts, tokenizer, seq_len), batch_size, seed)
    forecast = Forecast.for_shape(net.shape)
    if init == "q":
        q_init(forecast, net)
    forecast = forecast.to(dev)
    opt = torch.optim.AdamW(forecast.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    step = 0
    if resume:
        state = torch.load(state_path, map_location=dev, weights_only=False)
        forecast.load_state_dict(state["forecast"])
        opt.load_state_dict(state["optimizer"])
        step, batches.gen, batches.order = state["step"], state["data_gen"], state["data_order"]
    identity = {**model_identity(net.config, net.shape), "model_name": model_name(model_dir) or str(model)}
    gen = torch.Generator().manual_seed(seed + step)
    history: list[tuple[float, float]] = []
    start = time.time()

    def save() -> None:
        loss_avg = sum(x for x, _ in history[-20:]) / max(len(history[-20:]), 1)
        rec_avg = sum(y for _, y in history[-20:]) / max(len(history[-20:]), 1)
        save_forecast(forecast, out, identity, preset=preset, step=step, data=description,
                      seq_len=seq_len, batch_size=batch_size, lr=lr, queries=queries, init=init,
                      train_loss=f"{loss_avg:.4f}", train_recall_vs_sparse=f"{rec_avg:.4f}")
        with atomic_output(state_path) as tmp:
            torch.save({"forecast": forecast.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "data_gen": batches.gen, "data_order": batches.order}, tmp)

    bar = tqdm(total=steps, initial=step, disable=not progress, desc="train-forecast", dynamic_ncols=True)
    try:  # the bar ends its line before any error message is printed
        while step < steps:
            ids = batches.next().to(dev)
            low = max(cfg.dense_len, cfg.budget_blocks * cfg.block_size)
            q_idx = torch.randperm(seq_len - low, generator=gen)[:queries].sort().values.add(low).to(dev)
            opt.zero_grad(set_to_none=True)
            total_loss, hits, total = 0.0, 0, 0
            h_prev = None
            with torch.no_grad():
                layers = net.dense_layers(ids)
                for layer, h, q, k, cos, sin in layers:
                    with torch.enable_grad():
                        loss, hit, tot = layer_loss(forecast, layer, h if layer == 0 else h_prev, q, k, cos, sin,
                                                    q_idx, cfg)
                        loss.backward()
                    total_loss += loss.item()
                    hits, total = hits + hit, total + tot
                    h_prev = h
            torch.nn.utils.clip_grad_norm_(forecast.parameters(), clip)
            opt.step()
            step += 1
            history.append((total_loss, hits / max(total, 1)))
            run_recall = sum(y for _, y in history[-20:]) / len(history[-20:])
            bar.set_postfix(loss=f"{total_loss:.3f}", recall=f"{run_recall:.3f}")
            bar.update(1)
            if not math.isfinite(total_loss):
                raise SpardaError(f"training diverged at step {step} (loss {total_loss}); lower --lr")
            if step % save_every == 0 or step == steps:
                save()
    finally:
        bar.close()
    tail = history[-20:] or [(float("nan"), float("nan"))]
    return {"step": step, "first_loss": (history or tail)[0][0],
            "loss": sum(x for x, _ in tail) / len(tail),
            "recall": sum(y for _, y in tail) / len(tail), "seconds": round(time.time() - start, 1)}
