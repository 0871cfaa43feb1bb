"""One Forecast training step (design §5): the frozen model layer by layer, each layer's loss
backpropagated at once, a chunk of query tokens at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from sparda.config import SelectionConfig
from sparda.kernels import reference as ref
from sparda.training.frozen import query_chunk
from sparda.training.loss import free_selection, restricted_kl, restriction, student_distribution
from sparda.training.teacher import fine_keys, teacher_distribution


def first_query_position(cfg: SelectionConfig) -> int:
    """First loss query position, ``max(dense_len, budget tokens)`` (design §3.6, §5)."""
    return max(cfg.dense_len, cfg.budget_blocks * cfg.block_size)


def query_positions(seed: int, step: int, sequence: int, seq_len: int, queries: int,
                    cfg: SelectionConfig) -> torch.Tensor:
    """Loss query positions of global ``sequence`` of ``step``: sorted int64, ``[min(queries,
    seq_len - low)]`` in ``[low, seq_len)``, seeded by ``(seed, step, sequence)``."""
    low = first_query_position(cfg)
    state = np.random.SeedSequence([seed, step, sequence]).generate_state(2)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randperm(seq_len - low, generator=gen)[:queries].sort().values.add(low)


@dataclass
class StepTotals:
    """One rank's step sums: ``loss`` (design §5), ``hits``/``total`` (recall, design §8),
    ``sequences``, ``tokens``."""

    loss: float = 0.0
    hits: int = 0
    total: int = 0
    sequences: int = 0
    tokens: int = 0

    def add(self, other: "StepTotals") -> None:
        """Accumulate ``other`` into this one."""
        self.loss += other.loss
        self.hits += other.hits
        self.total += other.total
        self.sequences += other.sequences
        self.tokens += other.tokens

    def as_tensor(self) -> torch.Tensor:
        """``[5]`` float64."""
        return torch.tensor([self.loss, self.hits, self.total, self.sequences, self.tokens], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "StepTotals":
        """Inverse of :meth:`as_tensor`."""
        v = t.tolist()
        return cls(v[0], int(round(v[1])), int(round(v[2])), int(round(v[3])), int(round(v[4])))


def layer_loss(forecast, layer: int, h_prev: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor, q_idx: torch.Tensor, cfg: SelectionConfig,
               scale: float = 1.0, chunk: int | None = None) -> tuple[float, int, int]:
    """Restricted KL of one layer for one sequence, backpropagated into ``forecast`` (design §5).

    Args:
        h_prev: ``[1, Tq, d_model]`` attention input of layer ``layer - forecast.ahead`` (0 for
            layer 0) at the query tokens. q: ``[1, H_kv, G, T, d]``, k: ``[1, H_kv, T, d]`` post-RoPE.
        cos, sin: ``[1, 1, Tq, d]``. q_idx: ``[Tq]`` int64. scale: loss factor. chunk: tokens.
    Returns:
        ``(loss, hits, total)``: host float before ``scale``, free top-k counts (design §8).
    """
    num_tokens = k.shape[-2]
    heads = k.shape[1]
    rows_total = heads * q_idx.numel()
    num_blocks = -(-num_tokens // cfg.block_size)
    fine = fine_keys(k)
    ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()
    step = chunk or query_chunk(1, heads * q.shape[2], num_tokens)
    loss_sum, hits, total = 0.0, 0, 0
    for start in range(0, q_idx.numel(), step):
        rows = slice(start, start + step)
        idx = q_idx[rows]
        q_pos = idx.view(1, -1)
        qc = q[..., idx, :]
        teacher = teacher_distribution(qc, k, q_pos, cfg, fine_keys=fine)
        entries = restriction(teacher, q_pos, num_tokens, cfg)
        with torch.enable_grad():
            f = forecast.project(layer, h_prev[:, rows].float(), cos[:, :, rows].float(), sin[:, :, rows].float())
            student = student_distribution(f, ck, q_pos, cfg, layer, forecast.ahead)
            loss = restricted_kl(teacher, student, entries, reduction="sum") / rows_total
            (loss * scale).backward()
        loss_sum += loss.item()
        with torch.no_grad():
            sparse = ref.query_group_scores(qc, ck, q_pos, cfg.kernel_size, cfg.kernel_stride)
            target = free_selection(ref.pool_to_blocks(sparse, num_blocks, cfg), q_pos, cfg)
            chosen = free_selection(ref.pool_to_blocks(student.detach(), num_blocks, cfg), q_pos, cfg)
            hits += int((chosen & target).sum().item())
            total += int(target.sum().item())
    return loss_sum, hits, total


def sequence_loss(net, forecast, ids: torch.Tensor, q_idx: torch.Tensor, cfg: SelectionConfig,
                  attention=None, scale: float = 1.0, chunk: int | None = None) -> StepTotals:
    """Frozen ``net`` over ``ids [T]`` int64, the loss of every layer ``forecast`` scores
    (:meth:`~sparda.attention.forecast.Forecast.targets`) backpropagated (design §5, §6.2); this
    sequence's :class:`StepTotals`."""
    totals = StepTotals(sequences=1, tokens=ids.numel())
    inputs: dict[int, torch.Tensor] = {}  # layer -> attention input at q_idx, the last ``ahead`` layers
    targets = forecast.targets()
    with torch.no_grad():
        for layer, h, q, k, cos, sin in net.dense_layers(ids.view(1, -1), attention):
            inputs[layer] = h[:, q_idx]
            inputs.pop(layer - forecast.ahead - 1, None)
            if layer in targets:
                loss, hits, total = layer_loss(forecast, layer, inputs[forecast.source_layer(layer)], q, k,
                                               cos[:, :, q_idx], sin[:, :, q_idx], q_idx, cfg, scale, chunk)
                totals.add(StepTotals(loss, hits, total))
    return totals
