"""``sparda train-forecast``: the Forecast trained against the frozen model (design §5)."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from sparda.attention.forecast import Forecast, model_identity, model_name, q_init, save_forecast
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.io import check_output_file
from sparda.training import checkpoint
from sparda.training.data import Batches, load_texts, pack
from sparda.training.frozen import FROZEN_ATTENTION, frozen_attention
from sparda.training.step import StepTotals, first_query_position, query_positions, sequence_loss

#: steps averaged in the reported loss and recall
TAIL_STEPS = 20


class ForecastTrainer:
    """The optimisation of one Forecast against one frozen model (design §5).

    Args:
        net: the frozen :class:`~sparda.model.llama.CausalLM`. forecast: fp32, on its device.
        lr, betas, eps, weight_decay, clip: AdamW (constant lr) and grad-norm clip.
        chunk: query tokens per loss chunk. reduce: ``(forecast, totals) -> totals`` over ranks, or ``None``.
    """

    def __init__(self, net, forecast: Forecast, cfg: SelectionConfig, *, seed: int = 0, queries: int = 256,
                 frozen: str = "dense", lr: float = 5e-4, betas=(0.9, 0.95), eps: float = 1e-6,
                 weight_decay: float = 0.01, clip: float = 0.5, chunk: int | None = None, reduce=None) -> None:
        self.net, self.forecast, self.cfg = net, forecast, cfg
        self.seed, self.queries, self.chunk, self.clip, self.reduce = seed, queries, chunk, clip, reduce
        self.attention = frozen_attention(frozen, cfg, net.shape)
        self.optimizer = torch.optim.AdamW(forecast.parameters(), lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay)

    def step(self, step: int, sequences: list[torch.Tensor], positions: list[int], global_batch: int) -> StepTotals:
        """One optimiser step over this rank's ``sequences`` (each ``[T]`` int64); ``positions`` index
        the global batch. Returns the :class:`StepTotals` summed over ranks."""
        self.optimizer.zero_grad(set_to_none=True)
        totals = StepTotals()
        for ids, position in zip(sequences, positions):
            q_idx = query_positions(self.seed, step, position, ids.numel(), self.queries, self.cfg).to(ids.device)
            totals.add(sequence_loss(self.net, self.forecast, ids, q_idx, self.cfg, self.attention,
                                     scale=1.0 / global_batch, chunk=self.chunk))
        if self.reduce is not None:
            totals = self.reduce(self.forecast, totals)
        torch.nn.utils.clip_grad_norm_(self.forecast.parameters(), self.clip)
        self.optimizer.step()
        return totals


def check_arguments(seq_len: int, steps: int, batch_size: int, queries: int, save_every: int, lr: float,
                    init: str, frozen: str, cfg: SelectionConfig) -> None:
    """Refuse a bad training argument (SpardaError naming the option)."""
    low = first_query_position(cfg)
    if seq_len <= low:
        raise SpardaError(f"--seq-len {seq_len} must exceed {low} tokens (the preset's dense_len "
                          f"{cfg.dense_len} and budget {cfg.budget_blocks * cfg.block_size}), where selection starts")
    if steps < 1 or batch_size < 1 or queries < 1 or save_every < 1:
        raise SpardaError("--steps, --batch-size, --queries and --save-every must be >= 1")
    if not lr > 0:
        raise SpardaError(f"--lr must be > 0, got {lr}")
    if init not in ("q", "random"):
        raise SpardaError(f"unknown init {init!r}; choose q or random")
    if frozen not in FROZEN_ATTENTION:
        raise SpardaError(f"unknown --frozen-attention {frozen!r}; choose dense or sparse")


def preflight(model, data, *, seq_len: int, steps: int, batch_size: int, queries: int, save_every: int,
              lr: float, init: str, frozen_attention: str, preset: str, selection: SelectionConfig | None,
              out, resume: bool, text_column: str, ranks: int = 1):
    """:func:`train_forecast`'s checks before loading the model (SpardaError): ``(cfg, out,
    state_file, texts, description)``."""
    cfg = selection or SelectionConfig.from_preset(preset)
    check_arguments(seq_len, steps, batch_size, queries, save_every, lr, init, frozen_attention, cfg)
    if batch_size % ranks:
        raise SpardaError(f"--batch-size {batch_size} must be a multiple of the {ranks} processes "
                          "(it is the global batch)")
    out = check_output_file(out, "--out", "forecast.safetensors")
    state_file = checkpoint.state_path(out)
    if resume and not state_file.is_file():
        raise SpardaError(f"--resume: no checkpoint state at {state_file}")
    check_output_file(state_file, "--out (checkpoint state)")
    _check_model(model, seq_len, frozen_attention)
    texts, description = load_texts(data, text_column)
    return cfg, out, state_file, texts, description


def _check_model(model, seq_len: int, frozen: str) -> None:
    """Refuse (SpardaError) ``seq_len`` over the context, or sparse frozen attention with sliding windows."""
    from sparda.model.llama import ModelShape
    from sparda.model.loader import load_config, resolve_model_dir

    config = load_config(resolve_model_dir(model))
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and seq_len > context:
        raise SpardaError(f"--seq-len {seq_len} exceeds the model's context of {context} tokens; lower --seq-len")
    windowed = ModelShape.from_config(config).windowed_layers()
    if frozen == "sparse" and windowed:
        raise SpardaError("--frozen-attention sparse does not apply to sliding-window layers "
                          f"(layers {windowed}); use --frozen-attention dense")


def _tail_means(history: list) -> tuple[float, float]:
    tail = history[-TAIL_STEPS:] or [(float("nan"), float("nan"))]
    return sum(x for x, _ in tail) / len(tail), sum(y for _, y in tail) / len(tail)


def train_forecast(model=None, data=None, *, seq_len: int = 4096, steps: int = 200, batch_size: int = 1,
                   lr: float = 5e-4, out: str | Path = "forecast.safetensors", resume: bool = False,
                   device=None, save_every: int = 50, queries: int = 256, seed: int = 0,
                   preset: str = "small", init: str = "q", betas=(0.9, 0.95), eps: float = 1e-6,
                   weight_decay: float = 0.01, clip: float = 0.5, progress: bool = True,
                   selection: SelectionConfig | None = None, frozen_attention: str = "dense",
                   text_column: str = "text", chunk: int | None = None, dist=None, lookahead: int = 1) -> dict:
    """Train Forecast weights for ``model`` and save them to ``out`` (design §5, docs/forecast.md).

    Args:
        model: directory, .gguf or ``None`` (bundled). data: paths (:mod:`~sparda.training.sources`)
            or ``None`` (bundled split). init: ``q`` or ``random``. frozen_attention: ``dense``/``sparse``.
        seq_len: tokens, above ``max(dense_len, budget tokens)``. steps: total optimiser steps.
        batch_size: sequences per step. queries: loss query tokens per sequence.
        out: safetensors path; ``OUT.state.pt`` is the checkpoint. save_every: steps.
        device: ``cpu`` (fp32) or ``cuda`` (frozen model bf16, Forecast and loss fp32).
        dist: a :class:`~sparda.training.distributed.Distributed`, or ``None``.
        lookahead: 1 (the Forecast of design §4) or 2 (the two-ahead heads of design §6.2,
            student of layer ``l >= 2`` fed layer ``l - 2``'s input).
    Returns:
        ``{"step", "first_loss", "loss", "recall", "seconds", "tokens_per_s"}`` (last-20-step means).
    Raises:
        SpardaError: bad arguments, data or checkpoint; :class:`~sparda.training.checkpoint.Interrupted`
            after SIGINT, once the checkpoint is written.
    """
    from tqdm import tqdm

    from sparda.config import resolve_device
    from sparda.model.loader import load_model

    if lookahead not in (1, 2):
        raise SpardaError(f"--lookahead must be 1 or 2, got {lookahead}")
    cfg, out, state_file, texts, description = preflight(
        model, data, seq_len=seq_len, steps=steps, batch_size=batch_size, queries=queries, save_every=save_every,
        lr=lr, init=init, frozen_attention=frozen_attention, preset=preset, selection=selection, out=out,
        resume=resume, text_column=text_column, ranks=dist.world_size if dist is not None else 1)
    rank0 = dist is None or dist.rank == 0
    dev = dist.device if dist is not None else resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    net, tokenizer, model_dir = load_model(model, dev, dtype)
    net.requires_grad_(False)
    packed = pack(texts, tokenizer, seq_len)
    batches = Batches(len(packed), batch_size, seed)
    if lookahead == 2 and net.shape.num_layers < 3:
        raise SpardaError(f"--lookahead 2 needs a model of at least 3 layers, got {net.shape.num_layers}")
    forecast = Forecast.for_shape(net.shape, ahead=lookahead)
    if init == "q":
        q_init(forecast, net)
    forecast = forecast.to(dev)
    if dist is not None:
        dist.broadcast_module(forecast)
    trainer = ForecastTrainer(net, forecast, cfg, seed=seed, queries=queries, frozen=frozen_attention, lr=lr,
                              betas=betas, eps=eps, weight_decay=weight_decay, clip=clip, chunk=chunk,
                              reduce=dist.reduce if dist is not None else None)
    run = {"seq_len": seq_len, "batch_size": batch_size, "seed": seed, "queries": queries, "preset": preset,
           "frozen_attention": frozen_attention, "data": description, "init": init, "lookahead": lookahead}
    step, history = 0, []
    if resume:
        state = checkpoint.load_state(state_file, dev)
        checkpoint.check_resumable(run, state["run"])
        forecast.load_state_dict(state["forecast"])
        trainer.optimizer.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["data"])
        step, history = state["step"], [tuple(x) for x in state["history"]]
    identity = {**model_identity(net.config, net.shape), "model_name": model_name(model_dir) or str(model)}
    start_step, first_loss, tokens, start = step, None, 0, time.time()

    def save() -> None:
        if not rank0:
            return
        loss_avg, rec_avg = _tail_means(history)
        save_forecast(forecast, out, identity, preset=preset, step=step, data=description,
                      seq_len=seq_len, batch_size=batch_size, lr=lr, queries=queries, init=init,
                      frozen_attention=frozen_attention,
                      train_loss=f"{loss_avg:.4f}", train_recall_vs_sparse=f"{rec_avg:.4f}")
        checkpoint.save_state(state_file, forecast, trainer.optimizer, batches, step, history, run)

    bar = tqdm(total=steps, initial=step, disable=not (progress and rank0), desc="train-forecast",
               dynamic_ncols=True, unit="step")
    try:  # the bar ends its line before any error message is printed
        with checkpoint.stop_on_sigint() as stop:
            while step < steps:
                picked = batches.next()
                mine = range(len(picked)) if dist is None else dist.my_slice(len(picked))
                sequences = [packed[picked[i]].to(dev) for i in mine]
                totals = trainer.step(step, sequences, list(mine), len(picked))
                step += 1
                loss = totals.loss / max(totals.sequences, 1)
                first_loss = loss if first_loss is None else first_loss
                tokens += totals.tokens
                history.append((loss, totals.hits / max(totals.total, 1)))
                _, run_recall = _tail_means(history)
                bar.set_postfix(loss=f"{loss:.3f}", recall=f"{run_recall:.3f}",
                                tok_s=f"{tokens / max(time.time() - start, 1e-9):,.0f}")
                bar.update(1)
                if not math.isfinite(loss):
                    raise SpardaError(f"training diverged at step {step} (loss {loss}); lower --lr")
                stopping = stop.is_set() if dist is None else dist.any_flag(stop.is_set())
                if step % save_every == 0 or step == steps or stopping:
                    save()
                if stopping:
                    raise checkpoint.Interrupted(
                        f"interrupted at step {step}: checkpoint written to {out} and {state_file.name}; "
                        "rerun the same command with --resume to continue")
    finally:
        bar.close()
    loss_avg, rec_avg = _tail_means(history)
    seconds = time.time() - start
    return {"step": step, "first_loss": first_loss if first_loss is not None else loss_avg,
            "loss": loss_avg, "recall": rec_avg, "seconds": round(seconds, 1),
            "tokens_per_s": round(tokens / seconds, 1) if step > start_step and seconds > 0 else 0.0}
