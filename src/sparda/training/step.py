"""One training step of the Forecast (design §5): the frozen model layer by layer, the
loss of every layer backpropagated at once, gradients accumulated over sequences.

Memory is flat in the number of layers and bounded at long context:

* the frozen model runs one sequence at a time (:meth:`CausalLM.dense_layers`, no grad),
  holding the activations of one layer; only the Forecast's parameters get gradients;
* of the previous layer only the attention input at the loss's query tokens is kept
  (what the student ``F_{l-1}`` reads);
* the teacher's fine keys are computed once per layer, and the teacher, the restriction,
  the student and its backward run a chunk of query tokens at a time
  (:func:`sparda.training.frozen.query_chunk`: the ``[H_q, chunk, T]`` fp32 scores stay
  under 1 GiB), each chunk's loss backpropagated before the next.

The loss query tokens of sequence ``j`` of step ``s`` are drawn from a generator seeded
by ``(seed, s, j)`` alone (:func:`query_positions`), so a resumed run and a run split over
data-parallel ranks draw exactly the same ones.
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
    """The first position the loss queries: ``max(dense_len, budget tokens)``, where
    selection starts (design §3.6)."""
    return max(cfg.dense_len, cfg.budget_blocks * cfg.block_size)


def query_positions(seed: int, step: int, sequence: int, seq_len: int, queries: int,
                    cfg: SelectionConfig) -> torch.Tensor:
    """The loss query tokens of global sequence ``sequence`` of ``step``: ``[min(queries,
    seq_len - low)]`` sorted int64 positions in ``[low, seq_len)``, ``low`` =
    :func:`first_query_position`, drawn without replacement from a generator seeded by
    ``(seed, step, sequence)``."""
    low = first_query_position(cfg)
    state = np.random.SeedSequence([seed, step, sequence]).generate_state(2)
    gen = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    return torch.randperm(seq_len - low, generator=gen)[:queries].sort().values.add(low)


@dataclass
class StepTotals:
    """What one rank's sequences of a step add up to (host numbers).

    Attributes: ``loss`` (sum over sequences of the per-sequence loss, itself summed over
    layers, design §5); ``hits``, ``total`` (free top-k blocks of ``sparse`` that the
    Forecast also picks, and all of them: recall, design §8); ``sequences``; ``tokens``.
    """

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
        """``[5]`` float64 (for an all-reduce across ranks)."""
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
        forecast: the :class:`~sparda.attention.forecast.Forecast` being trained; the
            scored ``layer``'s student is ``F_{layer-1}`` (``W^C_0`` for layer 0).
        h_prev: ``[1, Tq, d_model]`` attention input of layer ``layer - 1`` (of layer 0 for
            layer 0) at the query tokens only.
        q: ``[1, H_kv, G, T, d]``, k: ``[1, H_kv, T, d]`` post-RoPE, of ``layer``.
        cos, sin: ``[1, 1, Tq, d]`` query RoPE tables at the query tokens.
        q_idx: ``[Tq]`` int64 query positions. scale: factor on the backpropagated loss
            (``1 / global batch`` for gradient accumulation). chunk: query tokens per chunk.
    Returns:
        ``(loss, hits, total)``: the layer's loss (host float, mean over KV heads and query
        tokens, before ``scale``) and the free-top-k block counts behind recall (design §8).
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
            student = student_distribution(f, ck, q_pos, cfg, layer)
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
    """Run the frozen ``net`` over one sequence layer by layer and backpropagate every layer's
    loss into ``forecast`` (design §5).

    Args:
        net: the frozen :class:`~sparda.model.llama.CausalLM`. ids: ``[T]`` int64 token ids.
        q_idx: ``[Tq]`` int64 loss query positions (on ``ids``' device).
        attention: the frozen model's attention hook (:func:`sparda.training.frozen.frozen_attention`;
            ``None``: dense). scale, chunk: as :func:`layer_loss`.
    Returns: this sequence's :class:`StepTotals` (loss summed over layers).
    """
    totals = StepTotals(sequences=1, tokens=ids.numel())
    h_prev = None
    with torch.no_grad():
        for layer, h, q, k, cos, sin in net.dense_layers(ids.view(1, -1), attention):
            h_here = h[:, q_idx]
            loss, hits, total = layer_loss(forecast, layer, h_here if layer == 0 else h_prev, q, k,
                                           cos[:, :, q_idx], sin[:, :, q_idx], q_idx, cfg, scale, chunk)
            totals.add(StepTotals(loss, hits, total))
            h_prev = h_here
    return totals
