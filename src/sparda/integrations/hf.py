"""sparda attention inside a transformers model: ``enable(model, method=...)``, then the
user's own ``model.generate(...)`` (or ``model(...)``) attends with sparda's methods.

How it plugs in (transformers 5, ``modeling_utils.AttentionInterface`` and
``cache_utils.Cache``):

* ``"sparda"`` is registered in transformers' ``AttentionInterface`` (and, as "no mask",
  in ``AttentionMaskInterface``) and set as the model's ``attn_implementation``.
* A :class:`SpardaCache` (a transformers ``Cache`` whose layers write into sparda's
  :class:`~sparda.cache.device.DeviceKVCache`, which keeps the compressed keys of
  design §3.1) replaces the empty ``DynamicCache`` that ``generate`` creates, in a forward
  pre-hook on the model; a plain ``model(ids)`` call gets one too.
* A forward pre-hook on each layer's ``self_attn`` hands the attention input ``h`` and
  the RoPE tables to the method (the Forecast reads ``h``, design §4).
* The registered attention function calls the sparda method's own ``attend`` (the same
  selection, dense fallback and Forecast code that :class:`sparda.LLM` runs), so greedy
  tokens equal ``sparda.LLM`` on the same model and budget.

Limits of this round: one sequence per call (batch 1), no beam search, assisted
decoding or chunked prefill (each forward after the prompt is one token), on-device
methods only (the offloaded ones need :class:`sparda.LLM`).
"""

from __future__ import annotations

import torch

from sparda.errors import SpardaError

#: the name registered in transformers' attention and mask interfaces
ATTN_IMPLEMENTATION = "sparda"
#: tokens added to the cache capacity each time it grows (it also at least doubles)
GROW_TOKENS = 1024


class Session:
    """The sparda state of one enabled model: config, method, cache and the current step.

    Built by :func:`enable`; ``model._sparda`` points to it. Not for direct use.
    """

    def __init__(self, model, config, method, shape) -> None:
        self.model, self.config, self.method, self.shape = model, config, method, shape
        self.kv = None          # DeviceKVCache of the current sequence
        self.length = 0         # tokens stored (host int: no device sync)
        self.step = None        # StepInfo of the running forward
        self.h: dict[int, torch.Tensor] = {}
        self.hooks: list = []
        self.previous_attn = None

    # ------------------------------------------------------------------ cache
    def start(self) -> None:
        """Forget the previous sequence (a new prompt is coming)."""
        self.kv, self.length, self.step = None, 0, None
        self.method.reset()

    def _ensure_capacity(self, tokens: int, like: torch.Tensor) -> None:
        from sparda.cache.device import DeviceKVCache

        if self.kv is not None and tokens <= self.kv.capacity:
            return
        old = self.kv
        capacity = max(tokens + GROW_TOKENS, 2 * old.capacity if old is not None else 0)
        capacity = min(capacity, max(self.shape.max_positions, tokens))
        s = self.shape
        new = DeviceKVCache(s.num_layers, 1, s.num_kv_heads, s.head_dim, capacity, self.config.selection,
                            like.dtype, like.device)
        if old is not None:  # copy what is stored; compressed keys are complete windows only
            for layer in range(s.num_layers):
                new.k[layer][:, :, :old.capacity] = old.k[layer]
                new.v[layer][:, :, :old.capacity] = old.v[layer]
                new.ck[layer][:, :, :old.ck[layer].shape[2]] = old.ck[layer]
            new.lengths.copy_(old.lengths)
            new.counters = old.counters  # the sequence's decode counters go on
        self.kv = new

    def begin_step(self, tokens: int, batch: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Plan one forward of ``tokens`` query tokens (called at layer 0's attention).

        ``cos, sin [B, T, d]``: transformers' RoPE tables for the query positions.
        Raises SpardaError: batch > 1, or several tokens after the prompt.
        """
        from sparda.model.llama import StepInfo

        if batch != 1:
            raise SpardaError(f"sparda.hf runs one sequence per call, got a batch of {batch} (beam search and "
                              "num_return_sequences > 1 count too); loop over the prompts, or use "
                              "sparda.LLM.generate for batches")
        if self.length and tokens != 1:
            raise SpardaError(f"sparda.hf decodes one token per forward after the prompt, got {tokens} "
                              "(chunked prefill, assisted decoding and beam search are not supported)")
        end = self.length + tokens
        if end > self.shape.max_positions:
            raise SpardaError(f"{end} tokens exceed the model's context of {self.shape.max_positions} tokens")
        self._ensure_capacity(end, cos)
        device = cos.device
        q_pos = torch.arange(self.length, end, device=device).unsqueeze(0)
        self.step = StepInfo(phase="decode" if self.length else "prefill", rows=torch.zeros(1, dtype=torch.long,
                             device=device), q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=cos.unsqueeze(1),
                             sin=sin.unsqueeze(1), max_kv_len=end, row=0)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one layer's post-RoPE ``k, v [1, H_kv, Tq, d]`` into the sparda cache."""
        self.kv.append(layer, k, v, self.step)
        if layer == self.shape.num_layers - 1:
            self.length = self.step.max_kv_len

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """``q [1, H_q, Tq, d]`` (transformers' layout) -> ``[1, Tq, H_q, d]`` via ``method.attend``."""
        s = self.shape
        b, _, t, d = q.shape
        out = self.method.attend(layer, q.view(b, s.num_kv_heads, s.group_size, t, d), self.h.pop(layer),
                                 self.kv, self.step)
        return out.reshape(b, s.num_q_heads, t, d).transpose(1, 2).contiguous()


def _cache_classes():
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SpardaLayer(CacheLayerMixin):
        """One layer's view of the session's sparda KV cache (transformers ``CacheLayerMixin``)."""

        is_sliding = False
        is_compileable = False
        is_croppable = False

        def __init__(self, session: Session, layer: int) -> None:
            super().__init__()
            self.session, self.layer = session, layer
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            """Append ``key_states, value_states [1, H_kv, Tq, d]``; returns them unchanged
            (the sparda attention reads its own cache)."""
            self.session.append(self.layer, key_states, value_states)
            return key_states, value_states

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.session.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.session.length

        def get_max_length(self) -> int:
            return -1

        def reset(self) -> None:
            self.session.start()

        def crop(self, tokens_to_remove: int) -> None:
            raise SpardaError("sparda.hf cannot crop its cache (assisted decoding is not supported)")

        def reorder_cache(self, beam_idx) -> None:
            raise SpardaError("sparda.hf does not support beam search; use num_beams=1")

        def batch_repeat_interleave(self, repeats: int) -> None:
            if repeats != 1:
                raise SpardaError("sparda.hf runs one sequence per call (num_return_sequences=1, num_beams=1)")

        def batch_select_indices(self, indices) -> None:
            raise SpardaError("sparda.hf runs one sequence per call")

    class SpardaCache(Cache):
        """A transformers ``Cache`` backed by sparda's KV cache (K/V + compressed keys).

        Made by :func:`enable`'s hook for each new sequence; ``generate`` passes it back in.
        """

        def __init__(self, session: Session) -> None:
            super().__init__(layers=[SpardaLayer(session, i) for i in range(session.shape.num_layers)])
            self.session = session
            session.start()

    return SpardaCache


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The function registered as ``attn_implementation="sparda"``.

    ``query [B, H_q, Tq, d]`` post-RoPE; ``key``/``value`` are ignored (the sparda cache
    holds them). Returns ``([B, Tq, H_q, d], None)`` as transformers' attention functions do.
    Raises SpardaError: a model not enabled with :func:`enable`, or a non-default scale.
    """
    session = getattr(module, "_sparda", None)
    if session is None or session.step is None:
        raise SpardaError("attn_implementation 'sparda' needs sparda.hf.enable(model, ...) first")
    if scaling is not None and abs(scaling - query.shape[-1] ** -0.5) > 1e-6 * scaling:
        raise SpardaError(f"sparda attends with scale 1/sqrt(head_dim), the model asks for {scaling}")
    return session.attend(module.layer_idx, query), None


def _check_no_padding(attention_mask) -> None:
    """Refuse a prompt's ``attention_mask [B, T]`` that masks tokens (checked once per
    sequence, at its prefill). sparda attends to every cached token at consecutive positions,
    so a masked token would be attended to anyway while transformers shifts the later tokens'
    RoPE positions. generate() also builds such a mask by itself when the prompt contains
    ``pad_token_id``. Raises SpardaError naming the count and the fix."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return
    masked = int((attention_mask == 0).sum())
    if masked:
        raise SpardaError(f"sparda.hf attends to every token, but the attention_mask masks {masked} of "
                          f"{attention_mask.shape[-1]} (padding, or generate() masking a prompt token equal to "
                          "pad_token_id); pass unpadded prompts one at a time with "
                          "attention_mask=torch.ones_like(input_ids)")


def _no_mask(*args, **kwargs):
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


#: :class:`sparda.LLM` options that steer only LLM's own runner (CUDA graphs, fused kernels,
#: prefill batching and chunking, offload copies): accepted by :func:`enable`, no effect there
RUNNER_OPTIONS = ("cuda_graphs", "fused_decode", "prefill_chunk_tokens", "prefill_batch_tokens", "offload_timing",
                  "slot_factor", "transfer", "cpu_threads")


def enable(model, method: str | None = None, *, preset: str = "small", forecast=None,
           sparse_prefill: bool | None = None, dense_prefill: bool | None = None, dense_heads="auto",
           **overrides):
    """Make a transformers causal LM attend with a sparda method, in place.

    Afterwards ``model.generate(...)`` and ``model(input_ids)`` run sparda's ``method``
    (its selection rule, dense fallback and Forecast: design §3-§4) over a sparda KV cache.
    It takes :class:`sparda.LLM`'s options with LLM's defaults, so by default it gives
    ``LLM(model_dir)``'s greedy tokens.

    Args:
        model: a transformers ``*ForCausalLM`` of a supported architecture (llama,
            mistral, qwen2, qwen3), whose modules are named as the checkpoint
            (``model.model.layers[i].self_attn``).
        method: an on-device sparda method: ``dense``, ``sparse``, ``oracle``, ``sparda``,
            ``sparda-random``, ``infinigen``. Default as :class:`sparda.LLM`: ``sparda``
            where Forecast weights exist for the model (or ``forecast`` is given), else
            ``sparse``.
        preset, **overrides: the selection budget, as for :class:`sparda.LLM`
            (``topk_blocks``, ``local_blocks``, ``init_blocks``, ``block_size``,
            ``kernel_size``, ``kernel_stride``, ``dense_len``; ``topp_mass``, ``min_blocks``:
            design §3.12), and LLM's method options
            (``quest_page_size``, ...). LLM's runner options (:data:`RUNNER_OPTIONS`) are
            accepted and change nothing here; ``offload=False``, ``kv_dtype="bf16"`` and the
            model's own ``device`` / ``dtype`` are accepted, other values refused.
        forecast: Forecast weights file for ``sparda`` (default: shipped weights for the
            bundled model, found from ``model.name_or_path``).
        sparse_prefill: select blocks in prefill too (default: the preset's,
            :func:`sparda.config.resolve_sparse_prefill`: dense prefill at ``small``,
            block-sparse at ``paper``); ``dense_prefill`` is its inverse.
        dense_heads: ``(layer, kv_head)`` pairs that decode densely (design §3.7):
            ``"auto"`` (LLM's default: the stored calibration of the model, if any),
            ``"none"``, ``"L:H,..."`` or pairs.
    Returns:
        ``model``.
    Raises:
        SpardaError: unsupported architecture or config field, an offloaded or unknown
            method, a method with per-row decode state (``h2o``, ``quest``, ``snapkv``,
            ``shallow``: use :class:`sparda.LLM`), bad budget, missing Forecast weights,
            bad dense heads, an option sparda.hf cannot honour.
    """
    import dataclasses

    from sparda.attention.dense_heads import resolve_dense_heads
    from sparda.attention.forecast import default_forecast_available, model_identity
    from sparda.attention.registry import ALWAYS_OFFLOADED, build_method
    from sparda.config import build_config
    from sparda.model.llama import ModelShape
    from sparda.model.loader import SUPPORTED_ARCHITECTURES
    from sparda.model.attention_config import check_supported

    config = model.config
    if getattr(config, "model_type", None) not in SUPPORTED_ARCHITECTURES:
        raise SpardaError(f"unsupported architecture {getattr(config, 'model_type', None)!r}; sparda supports "
                          f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    model_dir = getattr(model, "name_or_path", None) or None
    if method is None:
        method = "sparda" if forecast is not None or default_forecast_available(model_dir) else "sparse"
    if method in ALWAYS_OFFLOADED or overrides.get("offload"):
        raise SpardaError(f"sparda.hf runs on-device methods; {method!r} offloads its KV cache: use sparda.LLM")
    param = next(model.parameters())
    sconfig = build_config(  # the one check of LLM's options (sparda.config), before anything is built
        method=method, preset=preset, forecast=forecast, sparse_prefill=sparse_prefill, dense_prefill=dense_prefill,
        dense_heads=dense_heads, cuda_available=param.device.type == "cuda",
        **{"device": str(param.device), **overrides, "offload": False})
    _check_llm_only_options(model, overrides)
    check_supported(config)
    if getattr(model, "_sparda", None) is not None:
        disable(model)
    shape = ModelShape.from_config(config)
    built = build_method(sconfig, shape, model=model, model_dir=model_dir)
    if getattr(built, "state", None) is not None:  # RowState: h2o, quest, snapkv, shallow
        raise SpardaError(f"sparda.hf runs the selectors without per-row decode state (dense, sparse, oracle, "
                          f"sparda, sparda-random, infinigen); {method!r} keeps state across decode steps: "
                          "use sparda.LLM")
    heads = resolve_dense_heads(sconfig.dense_heads, method=built, shape=shape, model_dir=model_dir,
                                identity=model_identity(config, shape), option="dense_heads")
    sconfig = built.config = dataclasses.replace(sconfig, dense_heads=heads)  # as LLM: the method reads them
    session = Session(model, sconfig, built, shape)
    _register()
    session.previous_attn = config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache_cls = _cache_classes()
    layers = model.model.layers

    def before_model(module, args, kwargs):
        name = "past_key_values" if "past_key_values" in kwargs else "cache"
        cache = kwargs.get(name)
        if not isinstance(cache, cache_cls):
            if cache is not None and cache.get_seq_length():
                raise SpardaError("the model was given a cache filled without sparda; let generate() make one")
            _check_no_padding(kwargs.get("attention_mask"))
            kwargs[name] = cache_cls(session)
            kwargs["use_cache"] = True
        return args, kwargs

    def before_attention(index):
        def hook(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            if index == 0:
                session.begin_step(h.shape[1], h.shape[0], cos, sin)
            session.h[index] = h
            return None
        return hook

    session.hooks.append(model.register_forward_pre_hook(before_model, with_kwargs=True))
    for index, layer in enumerate(layers):
        layer.self_attn._sparda = session
        session.hooks.append(layer.self_attn.register_forward_pre_hook(before_attention(index), with_kwargs=True))
    model._sparda = session
    return model


def _check_llm_only_options(model, overrides: dict) -> None:
    """Take :class:`sparda.LLM`'s options that mean nothing or one thing here out of
    ``overrides``; refuse values sparda.hf cannot honour (one line, naming the fix)."""
    import torch

    for key in RUNNER_OPTIONS:
        overrides.pop(key, None)
    overrides.pop("offload", None)  # False (True was refused)
    kv_dtype = overrides.pop("kv_dtype", None)
    if kv_dtype not in (None, "bf16"):
        raise SpardaError(f"sparda.hf keeps the KV cache in the model's dtype; kv_dtype {kv_dtype!r} needs sparda.LLM")
    for key in ("kv_hot_blocks", "kv_hot_steps"):
        if overrides.pop(key, None) is not None:
            raise SpardaError(f"{key} applies to kv_dtype 'mixed', which needs sparda.LLM")
    param = next(model.parameters(), None)
    device, dtype = overrides.pop("device", None), overrides.pop("dtype", None)
    if param is not None and device is not None and torch.device(device).type != param.device.type:
        raise SpardaError(f"sparda.hf runs where the model is ({param.device}), not on {device}; move the model "
                          "with model.to(...) first")
    if param is not None and dtype is not None:
        wanted = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if wanted != param.dtype:
            raise SpardaError(f"sparda.hf runs in the model's dtype ({param.dtype}), not {dtype}; load the model "
                              "in that dtype first")


def disable(model):
    """Undo :func:`enable`: remove the hooks and restore the previous attention. Returns ``model``."""
    session = getattr(model, "_sparda", None)
    if session is None:
        return model
    for hook in session.hooks:
        hook.remove()
    for layer in model.model.layers:
        layer.self_attn._sparda = None
    model._sparda = None
    model.set_attn_implementation(session.previous_attn or "sdpa")
    return model


def _session(model) -> Session:
    session = getattr(model, "_sparda", None)
    if session is None:
        raise SpardaError("the model is not enabled; call sparda.hf.enable(model, ...) first")
    return session


def method_of(model):
    """The sparda attention method an enabled model runs."""
    return _session(model).method


def cache_of(model):
    """The KV cache of the enabled model's current sequence (its ``counters`` and
    ``read_fraction()``, :class:`~sparda.cache.base.KVCache`), ``None`` before the first forward."""
    return _session(model).kv


__all__ = ["enable", "disable", "method_of", "cache_of", "ATTN_IMPLEMENTATION", "RUNNER_OPTIONS"]
