"""What attention a transformers config asks for: per-layer sliding windows, and refusals.

transformers 5 reads sliding windows differently per architecture (its
``modeling_<arch>.py`` and ``configuration_<arch>.py``):

* ``mistral``: ``sliding_window`` (tokens, or null) applies to *every* layer;
  ``layer_types`` is ignored (transformers warns and points to Ministral).
* ``qwen2`` / ``qwen3``: ``sliding_window`` counts only if ``use_sliding_window``; layer
  ``i`` is windowed iff ``layer_types[i] == "sliding_attention"``, and ``layer_types``
  defaults to "sliding from layer ``max_window_layers`` on".
* ``llama``: no sliding window.

A windowed layer's query at position ``p`` sees keys ``i`` with ``p - W < i <= p``
(transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).

Config fields that change attention (or the logits) in other model families, and
that sparda does not implement, are refused by :func:`check_supported`, so that a
config never computes silently wrong.
"""

from __future__ import annotations

from sparda.errors import SpardaError

#: fields sparda does not implement -> the values under which they change nothing
_NEUTRAL = {
    "attn_logit_softcapping": (None,),
    "final_logit_softcapping": (None,),
    "attention_chunk_size": (None,),
    "no_rope_layers": (None,),
    "no_rope_layer_interval": (None, 0),
    "use_qk_norm": (None, False),
    "query_pre_attn_scalar": (None,),
    "attention_multiplier": (None, 1, 1.0),
    "embedding_multiplier": (None, 1, 1.0),
    "residual_multiplier": (None, 1, 1.0),
    "logits_scaling": (None, 1, 1.0),
    "scale_emb": (None, 1, 1.0),
    "scale_depth": (None, 1, 1.0),
    "partial_rotary_factor": (None, 1, 1.0),
    "use_bidirectional_attention": (None, False),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _refuse(field: str, value, why: str) -> SpardaError:
    return SpardaError(f"config field {field}={value!r} is not supported: {why}")


def sliding_windows(config) -> tuple[int | None, ...]:
    """Per-layer sliding window in tokens (``None`` = full causal attention), as
    transformers 5 reads the config of a llama, mistral, qwen2 or qwen3 model.

    Args:
        config: a transformers config (``model_type``, ``num_hidden_layers``, and the
            window fields named in this module's docstring).
    Returns:
        ``num_hidden_layers`` entries.
    Raises:
        SpardaError: a window that is not a positive int; ``layer_types`` of the wrong
            length or with a type other than full/sliding attention; a layer marked
            ``sliding_attention`` while ``sliding_window`` is null; a llama config that
            sets ``sliding_window``, or a mistral config whose ``layer_types`` mixes types
            (transformers would ignore both fields).
    """
    num_layers = config.num_hidden_layers
    model_type = getattr(config, "model_type", None)
    window = getattr(config, "sliding_window", None)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise _refuse("sliding_window", window, "it must be a positive number of tokens or null")
    layer_types = getattr(config, "layer_types", None)
    if model_type == "llama":
        if window is not None:
            raise _refuse("sliding_window", window, "transformers' llama ignores it; use model_type mistral "
                          "for a windowed model, or remove the field if it was trained with full attention")
        return (None,) * num_layers
    if model_type == "mistral":
        if layer_types is not None and len(set(layer_types)) > 1:
            raise _refuse("layer_types", "mixed", "transformers' Mistral applies sliding_window to every layer "
                          "and ignores layer_types; a per-layer pattern needs another architecture")
        return (window,) * num_layers
    if layer_types is None:  # qwen2/qwen3 configs fill it in; a hand-made config may not
        return (window,) * num_layers if getattr(config, "use_sliding_window", False) else (None,) * num_layers
    if len(layer_types) != num_layers:
        raise _refuse("layer_types", f"{len(layer_types)} entries",
                      f"it needs one entry per layer ({num_layers})")
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise _refuse("layer_types", unknown[0], "sparda implements full_attention and sliding_attention")
    if "sliding_attention" in layer_types and window is None:
        raise _refuse("layer_types", "sliding_attention", "sliding_window is null (or use_sliding_window is "
                      "false); set sliding_window and use_sliding_window, or mark the layers full_attention")
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def check_supported(config) -> None:
    """Refuse config fields that change attention or logits and that sparda does not
    implement (logit soft-capping, chunked attention, NoPE layers, µP multipliers,
    partial RoPE, bidirectional attention), and check the sliding-window fields.

    Raises:
        SpardaError: one line naming the field and its value.
    """
    for field, neutral in _NEUTRAL.items():
        value = getattr(config, field, None)
        if field == "no_rope_layers" and value is not None and all(v == 1 for v in value):
            continue  # 1 = this layer uses RoPE (SmolLM3's convention): nothing changes
        if value not in neutral:
            raise _refuse(field, value, "sparda does not implement it (its forward would differ from "
                          "the model's)")
    rope = getattr(config, "rope_parameters", None) or {}
    if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) not in (None, 1, 1.0):
        raise _refuse("rope_parameters.partial_rotary_factor", rope["partial_rotary_factor"],
                      "sparda rotates the whole head")
    sliding_windows(config)
