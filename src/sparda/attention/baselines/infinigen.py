"""``infinigen``: lookahead selection through a partial, skewed copy of the next layer's
query weights (InfiniGen, Lee et al., OSDI 2024), on the §3 block-selection rule.

InfiniGen skews ``W_q``/``W_k`` of each head with an orthogonal matrix from an SVD so
that a few columns carry most of the energy, keeps a ``partial_ratio`` of those columns,
and in layer ``l`` multiplies layer ``l``'s attention input by the partial query weights
of layer ``l+1`` to score layer ``l+1``'s keys on the same columns.

RoPE models: a general orthogonal skew of the head dimension does not commute with the
position rotation, so the skewed keys could not be read from the (post-RoPE) cache. The
only skews that commute are rotations inside each RoPE plane ``(i, i + d/2)``, which
leave a plane's energy unchanged; so here "skewing" ranks RoPE planes by the energy
the SVD of the head's weights assigns them (``sum_k S_k^2 U_ik^2``, i.e. the squared row
norms, of the group-mean ``W_q`` times those of ``W_k``) and keeps the top
``round(partial_ratio * d / 2)`` planes, scoring in that partial space:
``softmax(q_p . K~_p / sqrt(d))`` per query head (RoPE applied on the kept planes),
summed over the ``G`` heads of a group, max-pooled onto blocks, then the §3.4 rule.
Layer ``l+1``'s compressed keys are scored as they stood before the query's token (the
lookahead rule of ``sparda``, :func:`sparda.kernels.reference.lookahead_pos`), in prefill
and decode alike. Layer 0 (no predecessor) uses its own input with its own partial
weights. No training.
"""

from __future__ import annotations

import torch

from sparda.attention.base import BlockSparseMethod
from sparda.errors import SpardaError
from sparda.kernels import reference as ref

#: Fraction of head-dimension columns kept (InfiniGen's default partial-weight ratio).
PARTIAL_RATIO = 0.2


def partial_columns(wq: torch.Tensor, wk: torch.Tensor, num_kv_heads: int, head_dim: int,
                    ratio: float = PARTIAL_RATIO) -> torch.Tensor:
    """Kept columns per KV head: ``[H_kv, 2 * P]`` int64 (``P`` RoPE planes, both halves).

    ``P = max(1, round(ratio * d / 2))`` planes ranked by ``sqrt(E_q * E_k)`` summed over
    the plane, with ``E`` the squared row norms (module docstring; InfiniGen, OSDI 2024).

    Args:
        wq: ``[H_q * d, d_model]`` query weights; wk: ``[H_kv * d, d_model]`` key weights.
        ratio: fraction of the ``d`` columns to keep (at least one plane).
    """
    half = head_dim // 2
    planes = max(1, round(ratio * head_dim / 2))
    q_energy = wq.float().view(num_kv_heads, -1, head_dim, wq.shape[-1]).pow(2).sum(-1).mean(1)  # [H, d]
    k_energy = wk.float().view(num_kv_heads, head_dim, wk.shape[-1]).pow(2).sum(-1)
    energy = (q_energy * k_energy).sqrt()
    plane_energy = energy[:, :half] + energy[:, half:]
    top = plane_energy.topk(planes, dim=-1).indices.sort(-1).values
    return torch.cat([top, top + half], dim=-1)


class InfiniGenAttention(BlockSparseMethod):
    """Method ``infinigen``: partial lookahead query of layer ``l+1`` from layer ``l``'s input.

    Raises:
        SpardaError: no ``model`` given (its q/k weights are needed), or ``partial_ratio``
            outside ``(0, 1]``.
    """

    name = "infinigen"
    batched_prefill = True  # per-query prefill (design §3.8)

    def __init__(self, config, shape, model=None, model_dir=None, partial_ratio: float = PARTIAL_RATIO) -> None:
        super().__init__(config, shape, model=model, model_dir=model_dir)
        if model is None:
            raise SpardaError("method infinigen needs the model's query/key weights")
        if not 0 < partial_ratio <= 1:
            raise SpardaError(f"partial_ratio must be in (0, 1], got {partial_ratio}")
        s = shape
        self.columns, self.weights = [], []
        for layer in model.model.layers:
            attn = layer.self_attn
            cols = partial_columns(attn.q_proj.weight, attn.k_proj.weight, s.num_kv_heads, s.head_dim, partial_ratio)
            wq = attn.q_proj.weight.detach().view(s.num_kv_heads, s.group_size, s.head_dim, s.hidden_size)
            index = cols.view(s.num_kv_heads, 1, -1, 1).expand(-1, s.group_size, -1, s.hidden_size)
            self.columns.append(cols)  # [H, c]
            self.weights.append(wq.gather(2, index))  # [H, G, c, d_model]
        self._queries: dict[int, torch.Tensor] = {}

    def reset(self) -> None:
        """Clear the stored partial queries (before each prefill)."""
        super().reset()
        self._queries.clear()

    def partial_query(self, target: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Partial RoPE'd queries of layer ``target`` from ``h [B, T, d_model]``: ``[B, H, G, T, c]``.

        ``c = 2 * P`` kept columns; ``cos, sin [B, 1, T, d]`` the query RoPE tables; computed
        in the model weights' dtype.
        """
        w = self.weights[target]
        q = torch.einsum("btm,hgcm->bhgtc", h.to(w.dtype), w)
        cols = self.columns[target]  # [H, c]; first half are planes i, second i + d/2
        c = cols.shape[-1] // 2
        cs = cos[:, 0][:, None, None].expand(-1, cols.shape[0], 1, -1, -1)  # [B,H,1,T,d]
        sn = sin[:, 0][:, None, None].expand(-1, cols.shape[0], 1, -1, -1)
        idx = cols.view(1, -1, 1, 1, cols.shape[-1]).expand(cs.shape[0], -1, 1, cs.shape[3], -1)
        cs, sn = cs.gather(-1, idx).to(q.dtype), sn.gather(-1, idx).to(q.dtype)
        rotated = torch.cat([-q[..., c:], q[..., :c]], dim=-1)
        return q * cs + rotated * sn

    def scores(self, target: int, qp: torch.Tensor, ck: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Compressed scores ``[B, H, Tq, C]`` fp32 of partial queries ``qp [B, H, G, Tq, c]``
        against the kept columns of ``ck [B, H, C, d]`` (design §3.2 on the partial space).

        ``softmax(q_p . K~_p / sqrt(d))`` per query head (full ``d`` in the scale), summed over
        the group, over the compressed keys the lookahead rule lets a query at ``q_pos
        [B, Tq]`` (int64 positions) see (:func:`~sparda.kernels.reference.lookahead_pos`:
        for ``target >= 1`` the windows complete before its token, as ``sparda``; layer 0
        scores its own keys after the append). Not yet pooled onto blocks.
        """
        cfg = self.selection
        cols = self.columns[target]
        ckp = ck.gather(-1, cols.view(1, cols.shape[0], 1, -1).expand(ck.shape[0], -1, ck.shape[2], -1))
        # scale by the full head dim, as the model's own softmax does
        sc = ref.query_group_scores(qp * (qp.shape[-1] / self.shape.head_dim) ** 0.5, ckp,
                                    ref.lookahead_pos(q_pos, target), cfg.kernel_size, cfg.kernel_stride)
        return sc

    def before_layer(self, layer, q, h, cache, step):
        """Store layer ``layer+1``'s partial queries ``[B, H, G, Tq, c]`` from this layer's
        input ``h [B, Tq, d_model]`` (and layer 0's own at layer 0); nothing under the dense
        fallback."""
        if not self.needs_selection(step):
            return
        if layer == 0:
            self._queries[0] = self.partial_query(0, h, step.cos, step.sin)
        if layer + 1 < self.shape.num_layers:
            self._queries[layer + 1] = self.partial_query(layer + 1, h, step.cos, step.sin)

    def block_scores(self, layer, q, h, cache, step, k, ck, chunk):
        """Block scores ``[B, H, Tq_chunk, N]`` fp32: :meth:`scores` max-pooled onto
        ``N = ceil(T / block_size)`` blocks (design §3.3); ``q`` is unused. Raises KeyError
        if :meth:`before_layer` stored no partial queries for ``layer``."""
        sc = self.scores(layer, self._queries[layer][..., chunk, :], ck, step.q_pos[:, chunk])
        return ref.pool_to_blocks(sc, -(-k.shape[-2] // self.selection.block_size), self.selection)

    def select(self, layer, q, h, cache, step, first=0):
        """Block mask ``[B, H, Tq - first, N]`` bool (design §3.4); drops the stored queries."""
        mask = super().select(layer, q, h, cache, step, first)
        self._queries.pop(layer, None)
        return mask
