"""Our own decoder forward for the Llama family (llama, mistral, qwen2, qwen3).

RMSNorm, RoPE (every scaling type transformers implements), GQA, gated MLP (SwiGLU, or
transformers' ``hidden_act``), tied embeddings, QKV/O/MLP biases and Qwen3's per-head q/k
norms. Module names follow the Hugging Face checkpoint keys, so ``load_state_dict`` takes a checkpoint as is. Sliding-window
layers (mistral, qwen2, qwen3) are read by :mod:`sparda.model.attention_config`; fields
sparda does not implement are refused there.

The model never knows which attention method runs: each layer projects Q/K/V, appends
K/V to the cache and hands the rest to ``method.attend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from sparda.errors import SpardaError
from sparda.kernels.reference import apply_rope
from sparda.model.attention_config import check_supported, sliding_windows


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry every method and cache needs.

    Attributes: ``num_layers``; ``num_q_heads`` (H_q); ``num_kv_heads`` (H_kv);
    ``head_dim`` (d); ``hidden_size`` (d_model); ``max_positions`` (tokens);
    ``sliding_windows``: per-layer window in tokens, ``None`` = full attention (empty:
    every layer full).
    """

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    max_positions: int
    sliding_windows: tuple[int | None, ...] = ()

    def window(self, layer: int) -> int | None:
        """Sliding window of ``layer`` in tokens (query at ``p`` sees keys ``p - W < i <= p``),
        or ``None`` for full causal attention."""
        return self.sliding_windows[layer] if self.sliding_windows else None

    def windowed_layers(self) -> list[int]:
        """Layers whose window is shorter than the context (where it changes attention)."""
        return [i for i, w in enumerate(self.sliding_windows) if w is not None and w < self.max_positions]

    @property
    def group_size(self) -> int:
        """``G = H_q / H_kv`` query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config) -> "ModelShape":
        """Read the shape from a transformers config."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_q_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            max_positions=config.max_position_embeddings,
            sliding_windows=sliding_windows(config),
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32: ``x / sqrt(mean(x^2) + eps) * weight``."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., dim]`` -> same shape; normalised in fp32, cast back to ``x``'s dtype,
        then scaled by ``weight`` (result in the promoted dtype of ``weight`` and ``x``)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables. Frequencies come from transformers' ``ROPE_INIT_FUNCTIONS`` for scaled
    types (linear, dynamic, yarn, longrope, llama3) and the base formula otherwise
    (``inv_freq_i = theta^(-2i/d)``, RoFormer, Su et al. 2021).

    Raises:
        SpardaError: an unsupported ``rope_type`` in the model config.
    """

    def __init__(self, config, head_dim: int) -> None:
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        else:
            raise SpardaError(f"unsupported rope_type {rope_type!r} in the model config")
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [B, T]`` int64 -> ``(cos, sin)``, each ``[B, 1, T, d]`` in ``dtype``."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * self.scaling).to(dtype).unsqueeze(1),
                (emb.sin() * self.scaling).to(dtype).unsqueeze(1))


class Attention(nn.Module):
    """Q/K/V/O projections of one layer (checkpoint names ``self_attn.*``)."""

    def __init__(self, config, shape: ModelShape, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        d, hq, hk = shape.head_dim, shape.num_q_heads, shape.num_kv_heads
        self.shape = shape
        self.q_proj = nn.Linear(shape.hidden_size, hq * d, bias=bias)
        self.k_proj = nn.Linear(shape.hidden_size, hk * d, bias=bias)
        self.v_proj = nn.Linear(shape.hidden_size, hk * d, bias=bias)
        # transformers: llama and qwen3 give o_proj a bias iff attention_bias; mistral, qwen2 never
        o_bias = getattr(config, "model_type", None) in ("llama", "qwen3") and bool(getattr(config, "attention_bias", False))
        self.o_proj = nn.Linear(hq * d, shape.hidden_size, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``h [B, T, d_model]`` -> ``q [B, H_kv, G, T, d]``, ``k, v [B, H_kv, T, d]`` (RoPE applied)."""
        b, t, _ = h.shape
        s = self.shape
        q = self.q_proj(h).view(b, t, s.num_q_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q.view(b, s.num_kv_heads, s.group_size, t, s.head_dim), k, v


class MLP(nn.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, ``act`` = transformers' ``ACT2FN[hidden_act]``
    (``silu``: SwiGLU); biases where the checkpoint has them (llama ``mlp_bias``)."""

    def __init__(self, hidden: int, inner: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj = nn.Linear(hidden, inner, bias=bias)
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)
        self.act = ACT2FN[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., hidden]`` -> ``[..., hidden]`` in the weights' dtype (via ``[..., inner]``)."""
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm decoder block: attention then MLP, each with a residual."""

    def __init__(self, config, shape: ModelShape, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, shape, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, config.rms_norm_eps)
        mlp_bias = getattr(config, "model_type", None) == "llama" and bool(getattr(config, "mlp_bias", False))
        self.mlp = MLP(shape.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"), mlp_bias)


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm (checkpoint prefix ``model.``)."""

    def __init__(self, config, shape: ModelShape, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, shape, bias, qk_norm) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, config.rms_norm_eps)


@dataclass
class StepInfo:
    """Per-forward metadata handed to the cache and the attention method.

    Attributes:
        phase: ``"prefill"`` or ``"decode"``.
        rows: ``[B]`` int64 cache rows this forward writes (prefill: one row, or several in a
            batched prefill; decode: ``arange(B)``, the cache's first ``B`` rows, design §3.13).
        q_pos: ``[B, Tq]`` int64 absolute positions of the query tokens.
        kv_len: ``[B]`` int64 valid keys per row after this step's append.
        cos, sin: RoPE tables ``[B, 1, Tq, d]`` for the query positions.
        max_kv_len: host int (tokens): how many cached tokens every layer's views expose.
            Prefill: the prompt length. Decode: the cache capacity (static shapes, so that a
            CUDA graph of the step replays at every length; per-row ``kv_len`` masks the
            rest, docs/cuda_graphs.md).
        live_len: host int (tokens): ``max(kv_len)``, the longest row's real length. Only
            host-side decisions read it (the dense fallback of design §3.6), never a shape;
            defaults to ``max_kv_len``.
        row: host int, prefill only: ``rows[0]``, the one row a prefill writes. Caches read
            it instead of ``rows`` so that a prefill's appends do not sync with the device
            once per layer; computed from ``rows`` (one sync) when not given. ``None`` in a
            batched prefill.
        row_lengths: batched prefill only (:meth:`sparda.LLM.prefill_batch`, design §3.8):
            ``((cache row, tokens), ...)`` host ints, one per batch row in order; the prompts
            are right-padded to ``Tq``, and each row's real tokens are its first ``tokens``.
            Caches write only those. A real query sees only keys at or before its position
            (causal), all real; a padded query also sees what the row holds past its length,
            and its output is dropped. ``None`` otherwise.
    """

    phase: str
    rows: torch.Tensor
    q_pos: torch.Tensor
    kv_len: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    max_kv_len: int | None = None
    live_len: int | None = None
    #: fused decode (:mod:`sparda.model.fused`): target layer -> Forecast queries ``[B, H_kv, d]``
    #: of this step, rotated, from the stacked QKV(+F) GEMM; empty otherwise
    projections: dict = field(default_factory=dict)
    row: int | None = None
    row_lengths: tuple[tuple[int, int], ...] | None = None

    @property
    def batch(self) -> int:
        """Rows of this forward (host int, no sync)."""
        return self.rows.shape[0]

    @property
    def cache_rows(self):
        """How a cache indexes this step's rows: in decode ``slice(0, batch)`` (the cache's
        first rows: views, no copy, design §3.13), otherwise :attr:`rows`."""
        return slice(0, self.rows.shape[0]) if self.phase == "decode" else self.rows

    def prefill_spans(self, tokens: int) -> list[tuple[int, int, int, int]]:
        """``(batch index, cache row, start, end)`` of each row a prefill step of ``tokens``
        query tokens writes, tokens ``start .. end - 1``: the one row of a prefill (a chunk
        ending at ``max_kv_len``), or each row's real tokens of a batched prefill
        (:attr:`row_lengths`, from 0)."""
        if self.row_lengths is None:
            return [(0, self.row, self.max_kv_len - tokens, self.max_kv_len)]
        return [(i, row, 0, n) for i, (row, n) in enumerate(self.row_lengths)]

    def __post_init__(self) -> None:
        if self.max_kv_len is None:  # one device sync; the engine passes it to avoid that
            self.max_kv_len = int(self.kv_len.max().item())
        if self.live_len is None:
            self.live_len = self.max_kv_len
        if self.row is None and self.phase == "prefill" and self.row_lengths is None:  # one sync
            self.row = int(self.rows[0])


class CausalLM(nn.Module):
    """A Llama-family causal LM whose attention is delegated to an attention method.

    Raises:
        SpardaError: ``num_attention_heads`` not a multiple of ``num_key_value_heads``, an
            unsupported ``rope_type``, or a config field sparda does not implement
            (:func:`sparda.model.attention_config.check_supported`).
    """

    def __init__(self, config, bias: bool = False, qk_norm: bool = False, rotary: bool = True) -> None:
        super().__init__()
        check_supported(config)
        self.config = config
        self.shape = ModelShape.from_config(config)
        if self.shape.num_q_heads % self.shape.num_kv_heads:
            raise SpardaError("num_attention_heads must be a multiple of num_key_value_heads")
        self.model = Backbone(config, self.shape, bias, qk_norm)
        self.lm_head = nn.Linear(self.shape.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, self.shape.head_dim) if rotary else None
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_state_dict(cls, config, state: dict[str, torch.Tensor]) -> "CausalLM":
        """Build the model and load a Hugging Face checkpoint state dict.

        QKV bias and q/k norms are detected from the checkpoint keys. Raises
        SpardaError if a weight is missing or has the wrong shape.
        """
        bias = "model.layers.0.self_attn.q_proj.bias" in state
        qk_norm = "model.layers.0.self_attn.q_norm.weight" in state
        with torch.device("meta"):
            model = cls(config, bias=bias, qk_norm=qk_norm, rotary=False)
        state = dict(state)
        if "lm_head.weight" not in state and getattr(config, "tie_word_embeddings", False):
            state["lm_head.weight"] = state.get("model.embed_tokens.weight")
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise SpardaError(f"checkpoint does not match the config: {str(exc).splitlines()[0]}") from exc
        if getattr(config, "tie_word_embeddings", False):
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rotary = Rotary(config, model.shape.head_dim)
        return model.eval()

    def dense_layers(self, ids: torch.Tensor, attention=None):
        """Run the model densely (no cache, no method) over ``ids [B, T]`` from position 0.

        Yields ``(layer, h, q, k, cos, sin)`` per layer before its attention: ``h [B, T, d_model]``
        the attention input, ``q [B, H_kv, G, T, d]``, ``k [B, H_kv, T, d]`` (RoPE applied),
        ``cos, sin [B, 1, T, d]``. Used by Forecast training and the selection report.
        ``attention(layer, q, k, v) -> [B, H_kv, G, T, d]`` replaces dense causal attention
        when given (Forecast training's block-sparse frozen model, design §5).
        """
        b, t = ids.shape
        s = self.shape
        pos = torch.arange(t, device=ids.device).expand(b, t)
        cos, sin = self.rotary(pos, next(self.parameters()).dtype)
        x = self.model.embed_tokens(ids)
        for index, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.project(h, cos, sin)
            yield index, h, q, k, cos, sin
            if attention is not None:
                out = attention(index, q, k, v).reshape(b, s.num_q_heads, t, s.head_dim)
            else:
                out = self._dense_attention(index, q, k, v)
            x = x + layer.self_attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))

    def _dense_attention(self, index: int, q, k, v) -> torch.Tensor:
        """Causal (or sliding-window) SDPA of layer ``index``: ``[B, H_q, T, d]``."""
        b, _, _, t, _ = q.shape
        s = self.shape
        window = s.window(index)
        if window is not None and window < t:  # key i visible to query p iff p - W < i <= p
            p = torch.arange(t, device=q.device)
            mask = (p.view(1, -1) <= p.view(-1, 1)) & (p.view(1, -1) > p.view(-1, 1) - window)
            extra = {"attn_mask": mask}
        else:
            extra = {"is_causal": True}
        return torch.nn.functional.scaled_dot_product_attention(
            q.reshape(b, s.num_q_heads, t, s.head_dim), k, v, enable_gqa=True, **extra)

    def forward(self, input_ids: torch.Tensor, step: StepInfo, cache, method,
                all_logits: bool = False) -> torch.Tensor:
        """Run the decoder over ``input_ids [B, Tq]`` at positions ``step.q_pos``.

        Appends this step's K/V to ``cache`` (rows ``step.rows``) and attends with
        ``method``. Returns logits ``[B, Tq, V]`` if ``all_logits`` else ``[B, 1, V]``
        (last position; a batched prefill: each row's last real token, ``step.row_lengths``),
        in fp32.
        """
        x = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            q, k, v = layer.self_attn.project(h, step.cos, step.sin)
            cache.append(index, k, v, step)
            out = method.attend(index, q, h, cache, step)  # [B, H_kv, G, Tq, d]
            b, _, _, t, _ = out.shape
            out = out.reshape(b, self.shape.num_q_heads, t, self.shape.head_dim).transpose(1, 2)
            x = x + layer.self_attn.o_proj(out.reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        if not all_logits:
            if step.row_lengths is not None:  # batched prefill: each row's last real token
                last = torch.tensor([n - 1 for _, n in step.row_lengths], device=x.device)
                x = x[torch.arange(x.shape[0], device=x.device), last].unsqueeze(1)
            else:
                x = x[:, -1:]
        return self.lm_head(self.model.norm(x)).float()
