"""The fused decode step on CUDA (design §6 step order): few kernels per layer.

:class:`FusedDecoder` runs the same decoder as :meth:`CausalLM.forward` for a decode step
(one token per row, the cache's first ``b`` rows: design §3.13), with

* one GEMM for Q, K, V and the method's extra heads (the Forecast ``F_l`` scoring layer
  ``l+1``, and ``W^C_0`` at layer 0: design §4) on weights stacked once;
* one kernel for RoPE of q, k and the Forecast heads + the KV append + the compressed-key
  update (:func:`sparda.kernels.rope_append`, through the cache's ``rope_append``);
  a quantised cache (``kv_dtype`` int8/int4) gets each token quantised in the same kernel
  (docs/kv_quant.md), the compressed keys still from the full-precision keys;
* residual add + RMSNorm fused (:func:`sparda.kernels.add_rmsnorm`), gate and up as one
  GEMM with SiLU * mul fused (:func:`sparda.kernels.silu_mul`).

The attention method still decides what is read (``method.attend``); the Forecast
queries of this step arrive precomputed in ``step.projections`` (target layer ->
``[B, H_kv, d]``), so the method launches no projection of its own.

Stacking: the stacked tensors own the storage and the model's ``q/k/v_proj`` (and
``gate/up_proj``) weights, and the method's extra heads, become views into them, so no
weight is held twice. Building a second decoder on the same model (another method)
re-stacks; the first notices (its weights are no longer the model's) and re-stacks in
turn on its next capture. Models with per-head q/k norms (Qwen3) keep the unfused step.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from sparda import kernels


def _stack(mods_weights: list[tuple[nn.Module, str]]) -> torch.Tensor:
    """Concatenate the named parameters along dim 0 and rebind each to a view of the result."""
    tensors = [getattr(m, name) for m, name in mods_weights]
    stacked = torch.cat([t.detach() for t in tensors], 0)
    start = 0
    for (mod, name), t in zip(mods_weights, tensors):
        n = t.shape[0]
        setattr(mod, name, nn.Parameter(stacked[start:start + n], requires_grad=False))
        start += n
    return stacked


class FusedDecoder:
    """Fused CUDA decode step of one model and method (module doc).

    Args:
        model: the :class:`~sparda.model.llama.CausalLM` (on CUDA).
        method: the attention method; ``method.stacked_heads(layer)`` (optional) returns
            ``[(target_layer, nn.Linear), ...]``, extra bias-free heads of ``H_kv * d``
            outputs read from layer ``layer``'s attention input.
    """

    def __init__(self, model, method) -> None:
        self.model = model
        self.method = method
        self.shape = model.shape
        self._build()

    @staticmethod
    def supports(model) -> bool:
        """Whether the fused step computes this model exactly (no per-head q/k norms)."""
        return all(layer.self_attn.q_norm is None for layer in model.model.layers)

    def _build(self) -> None:
        with torch.inference_mode(False), torch.no_grad():  # weights are ordinary tensors
            self._stack_layers()

    def _stack_layers(self) -> None:
        layers = self.model.model.layers
        heads = getattr(self.method, "stacked_heads", None)
        self.targets: list[list[int]] = []
        self.qkv_w, self.qkv_b, self.gate_up_w, self.gate_up_b = [], [], [], []
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            extra = list(heads(index)) if heads is not None else []
            dtype = attn.q_proj.weight.dtype
            if any(lin.weight.dtype != dtype or lin.bias is not None for _, lin in extra):
                extra = []  # mismatched heads stay separate (the method projects them itself)
            self.targets.append([t for t, _ in extra])
            parts = [(attn.q_proj, "weight"), (attn.k_proj, "weight"), (attn.v_proj, "weight")]
            self.qkv_w.append(_stack(parts + [(lin, "weight") for _, lin in extra]))
            if attn.q_proj.bias is not None:
                zeros = attn.q_proj.bias.new_zeros(sum(lin.weight.shape[0] for _, lin in extra))
                self.qkv_b.append(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias, zeros]))
            else:
                self.qkv_b.append(None)
            mlp = layer.mlp
            if getattr(mlp.act, "__class__", None).__name__ in ("SiLU", "SiLUActivation"):
                self.gate_up_w.append(_stack([(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")]))
                self.gate_up_b.append(None if mlp.gate_proj.bias is None else _stack(
                    [(mlp.gate_proj, "bias"), (mlp.up_proj, "bias")]))
            else:
                self.gate_up_w.append(None)
                self.gate_up_b.append(None)

    def _current(self) -> bool:
        """True while the model's weights are still views of this decoder's stacks."""
        first, last = self.model.model.layers[0], self.model.model.layers[-1]
        return (first.self_attn.q_proj.weight.data_ptr() == self.qkv_w[0].data_ptr()
                and last.self_attn.q_proj.weight.data_ptr() == self.qkv_w[-1].data_ptr())

    def forward(self, input_ids: torch.Tensor, step, cache, method) -> torch.Tensor:
        """Logits ``[b, 1, V]`` fp32 of one decode step: ``input_ids [b, 1]`` at ``step.q_pos``
        (the cache's first ``b`` rows, in order; design §3.13). Appends to ``cache`` and attends
        with ``method``."""
        if not self._current():
            self._build()
        s = self.shape
        model = self.model
        layers = model.model.layers
        b = input_ids.shape[0]
        x = model.model.embed_tokens(input_ids[:, 0]).contiguous()  # [B, d_model], the residual stream
        h = kernels.add_rmsnorm(x, None, layers[0].input_layernorm.weight, layers[0].input_layernorm.eps)
        step.projections = {}
        for index, layer in enumerate(layers):
            attn = layer.self_attn
            qkv = F.linear(h, self.qkv_w[index], self.qkv_b[index])
            targets = self.targets[index]
            q, f = cache.rope_append(index, qkv, step, s.group_size, len(targets))
            for i, target in enumerate(targets):
                step.projections[target] = f[:, i]
            out = method.attend(index, q.view(b, s.num_kv_heads, s.group_size, 1, s.head_dim),
                                h.view(b, 1, -1), cache, step)
            a = attn.o_proj(out.reshape(b, s.num_q_heads * s.head_dim))
            norm = layer.post_attention_layernorm
            h2 = kernels.add_rmsnorm(x, a, norm.weight, norm.eps)
            mlp = layer.mlp
            if self.gate_up_w[index] is not None:
                gu = F.linear(h2, self.gate_up_w[index], self.gate_up_b[index])
                m = mlp.down_proj(kernels.silu_mul(gu))
            else:
                m = mlp(h2)
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else model.model.norm
            h = kernels.add_rmsnorm(x, m, norm.weight, norm.eps)
        return model.lm_head(h).float().view(b, 1, -1)
