"""The user-facing engine: ``LLM(...).generate(prompts)`` in the style of vLLM."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from sparda.attention.dense_heads import parse_dense_heads, resolve_dense_heads
from sparda.attention.forecast import default_forecast_available, model_identity
from sparda.attention.registry import (ALWAYS_OFFLOADED, FORECAST_METHODS, build_method, check_kv_dtype_cache,
                                       check_offload)
from sparda.cache.device import DeviceKVCache
from sparda.cache.hot import check_hot
from sparda.cache.offload import DEFAULT_SLOT_FACTOR, OffloadKVCache, check_slot_factor
from sparda.config import METHOD_OPTIONS, SelectionConfig, SpardaConfig, resolve_sparse_prefill
from sparda.engine.graph_runner import DecodeRunner
from sparda.engine.sampler import sample
from sparda.engine.validate import check_request
from sparda.errors import SpardaError
from sparda.kernels.quant import check_kv_dtype, token_bytes
from sparda.model.llama import StepInfo
from sparda.model.loader import load_model

#: prompt tokens per prefill chunk by default (``LLM(prefill_chunk_tokens=...)``, ``--prefill-chunk``)
DEFAULT_PREFILL_CHUNK_TOKENS = 8192
#: padded prompt tokens per batched prefill forward by default (``LLM(prefill_batch_tokens=...)``,
#: design §3.8): bounds the activations of one forward of several prompts, as the chunk size
#: does for one prompt (the larger of the two bounds a prefill's peak; cf. vLLM's
#: ``max_num_batched_tokens``)
DEFAULT_PREFILL_BATCH_TOKENS = 16384

#: ``generate``'s KV-cache capacity is a multiple of this many tokens (:meth:`LLM.cache_capacity`)
CAPACITY_ROUND = 512

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class Completion:
    """One prompt's result.

    Attributes:
        text: the decoded completion (special tokens skipped).
        token_ids: generated token ids (EOS included if it was produced).
        stats: ``prompt_tokens``, ``new_tokens``, ``prefill_ms`` (wall time of the prefill
            forward that ran this prompt, with the ``prefill_batch - 1`` others batched with
            it, design §3.8; first token sampled), ``decode_tok_s`` (over the call's decode
            wall time, the CUDA-graph capture included), ``cache_alloc_ms`` (allocating the
            call's KV cache, shared by its prompts; an offloaded cache page-locks its host
            store here), ``graph_capture_ms`` (capturing the call's decode graphs, part of
            the decode time; 0 without graphs), ``kv_cache_bytes`` (this sequence's K and V, all layers, host or device; offloaded
            runs report host and device bytes under ``offload``), ``kv_read_fraction``
            (fraction of KV blocks read per decode step, 1.0 for dense).
    """

    text: str
    token_ids: list[int]
    stats: dict = field(default_factory=dict)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA if available else CPU. Raises SpardaError for an unusable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise SpardaError(f"invalid device {device!r}; use cpu or cuda[:N]") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpardaError("CUDA was requested but is not available; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> bf16 on CUDA, fp32 on CPU. Raises SpardaError for an unknown name."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise SpardaError(f"unknown dtype {dtype!r}; choose one of float32, bfloat16, float16")
    return _DTYPES[dtype]


def _token_count(value, name: str, zero: str, example: str) -> int:
    """``value`` as an int >= 0 (``None``: 0). Raises SpardaError naming ``name``, what 0
    means (``zero``) and an ``example`` otherwise."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpardaError(f"{name} must be an integer >= 0 ({zero}), got {value!r}; use e.g. {example}")
    return value


def check_prefill_chunk(value) -> int:
    """``prefill_chunk_tokens`` as an int >= 0 (0 or ``None``: the whole prompt in one chunk).

    Raises:
        SpardaError: not an integer, or negative.
    """
    return _token_count(value, "prefill_chunk_tokens", "0: no chunking", "--prefill-chunk 8192")


def check_prefill_batch(value) -> int:
    """``prefill_batch_tokens`` as an int >= 0 (0 or ``None``: one prompt per prefill forward).

    Raises:
        SpardaError: not an integer, or negative.
    """
    return _token_count(value, "prefill_batch_tokens", "0: one prompt per prefill",
                        f"prefill_batch_tokens={DEFAULT_PREFILL_BATCH_TOKENS}")


def default_offload(method: str, device: torch.device) -> bool:
    """Whether ``method`` offloads its KV cache when ``--offload`` is not given.

    ``sparda`` offloads where CUDA is present (design §6: the lookahead prefetch is the point
    of the method); on the CPU there is no side stream to hide copies behind, and every
    other method keeps its cache on the device unless asked (``sparse-offload`` and
    ``sparda-no-prefetch`` always offload, by definition).
    """
    return method == "sparda" and device.type == "cuda"


def _check_kv_hot(kv_dtype: str, hot: tuple, selection: SelectionConfig) -> dict:
    """``kv_hot_blocks`` / ``kv_hot_steps`` validated: the :class:`OffloadKVCache` keywords
    for ``kv_dtype`` ``mixed`` (``{}`` otherwise). Raises SpardaError for bad values, or
    for either given with another ``kv_dtype``."""
    if kv_dtype != "mixed":
        if any(v is not None for v in hot):
            raise SpardaError(f"--kv-hot-blocks / --kv-hot-steps apply to --kv-dtype mixed only, not {kv_dtype}; "
                              "drop them or add --kv-dtype mixed")
        return {}
    blocks, steps = check_hot(*hot, selection)
    return {"hot_blocks": blocks, "hot_steps": steps}


class LLM:
    """Load a Llama-family model and generate with a chosen attention method.

    Args:
        model: Hugging Face model directory, ``ORG/NAME`` in the local Hugging Face cache
            (offline), ``.gguf`` file, or ``None`` for the bundled
            SmolLM2-135M-Instruct.
        method: attention method (``dense``, ``sparse``, ``oracle``, ``sparda``, ...); ``None``:
            ``sparda`` if Forecast weights are given or shipped for the model, else ``sparse``.
        preset: selection preset, ``small`` or ``paper`` (design §3).
        device, dtype: defaults: CUDA + bf16 if available, else CPU + fp32.
        **overrides: selection fields (``topk_blocks``, ``local_blocks``, ``init_blocks``,
            ``block_size``, ``kernel_size``, ``kernel_stride``, ``dense_len``) and
            ``forecast`` (path of Forecast weights, sparda methods only) / ``sparse_prefill``
            (block-sparse methods select in prefill too; default: the preset's,
            :data:`sparda.config.SPARSE_PREFILL`: off at ``small``, on at ``paper``) /
            ``dense_prefill`` (its inverse, kept for compatibility) / ``offload``
            (``None``: on for ``sparda`` on CUDA, off otherwise) / ``transfer``
            (offload copy engine: ``auto``, ``uva``, ``copy``, ``sync``; docs/offload.md) /
            ``kv_dtype`` (``bf16``, the default: K/V in the model dtype; ``int8`` / ``int4``: K/V
            quantised per token and head on append, dequantised on read; ``mixed``: offloaded
            caches only, every block in int4 on the host plus bf16 copies of the hot blocks,
            design §6.1; docs/kv_quant.md) / ``kv_hot_blocks`` (``mixed``: bf16 pool blocks per
            layer, row and KV head, default the budget ``init + local + topk``) /
            ``kv_hot_steps`` (``mixed``: decode steps a block stays hot unselected, default 4) /
            ``cuda_graphs`` (default True: on CUDA every decode step replays a captured CUDA
            graph; False runs the same static-shape step eagerly; docs/cuda_graphs.md) /
            ``offload_timing`` (default False: also time the offload copies, adding
            ``copy_ms``, ``exposed_wait_ms``, ``hidden_fraction`` to ``stats["offload"]``) /
            ``early_attention`` (default False: an offloaded layer with a pending prefetch
            attends to its resident blocks before waiting for the copy, then to the copied
            ones; the same result up to summation order; measured slower on the H200, 2-25 %
            fewer tok/s; design §6) /
            ``slot_factor`` (default 1.5: an offloaded layer keeps ``ceil(1.5 W)`` GPU slots per KV
            head for a selection of ``W`` blocks; the spare ones hold blocks that left the
            selection, so one that returns is not copied again; 1 keeps ``W`` slots, the
            widest selection with the dense-fallback prefix, already more than the budget
            at both presets; design §6) /
            ``fused_decode`` (default True: on CUDA a decode step runs the fused kernels of
            :mod:`sparda.model.fused`; False runs the model's plain modules) /
            ``dense_heads`` (default ``"auto"``: the calibrated retrieval heads stored for the
            model, if any (the bundled model ships three), read every visible block in decode;
            ``None``/``"none"`` turns them off, ``"L:H,..."`` or ``[(layer, kv_head), ...]`` lists
            them; block-sparse methods, the heads' layers kept on the device when the cache is
            offloaded; design §3.7) /
            ``prefill_chunk_tokens`` (default :data:`DEFAULT_PREFILL_CHUNK_TOKENS`: prompts are
            prefilled that many tokens at a time, so activations are one chunk's; ``0`` or
            ``None`` = the whole prompt at once; same logits either way) /
            ``prefill_batch_tokens`` (default :data:`DEFAULT_PREFILL_BATCH_TOKENS`: ``generate``
            prefills up to that many padded prompt tokens in one forward, prompts right-padded
            to the longest, for methods whose prefill allows it (design §3.8); it bounds that
            forward's activations as ``prefill_chunk_tokens`` does one prompt's, so lower both
            where memory is tight; ``0`` = one prompt per forward; same logits either way, up
            to summation order) /
            the method options of :class:`~sparda.config.SpardaConfig` (``quest_page_size``,
            ``snapkv_window``, ``shallow_layers``, ``shallow_select_once``).
    Raises:
        SpardaError: bad method, preset, budget, path or architecture.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, method: str | None = None,
                 preset: str = "small", device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, **overrides) -> None:
        forecast = overrides.pop("forecast", None)
        dense_heads = parse_dense_heads(overrides.pop("dense_heads", "auto"))  # malformed: before the model loads
        #: replay decode steps as CUDA graphs on CUDA (docs/cuda_graphs.md)
        self.cuda_graphs = bool(overrides.pop("cuda_graphs", True))
        #: time offload copies (copy_ms, exposed_wait_ms in stats["offload"]); off by default
        self.offload_timing = bool(overrides.pop("offload_timing", False))
        #: offloaded decode attends to resident blocks before the prefetch wait (design §6)
        self.early_attention = bool(overrides.pop("early_attention", False))
        #: offloaded layers' GPU slots per selected block (design §6; checked before the model loads)
        self.slot_factor = check_slot_factor(overrides.pop("slot_factor", DEFAULT_SLOT_FACTOR))
        #: on CUDA, decode through the fused kernels (sparda.model.fused); False: the plain modules
        self.fused_decode = bool(overrides.pop("fused_decode", True))
        #: prompt tokens per prefill chunk (0: the whole prompt at once)
        self.prefill_chunk_tokens = check_prefill_chunk(overrides.pop("prefill_chunk_tokens",
                                                                      DEFAULT_PREFILL_CHUNK_TOKENS))
        #: padded prompt tokens per batched prefill forward (0: one prompt per forward, design §3.8)
        self.prefill_batch_tokens = check_prefill_batch(overrides.pop("prefill_batch_tokens",
                                                                      DEFAULT_PREFILL_BATCH_TOKENS))
        prefill = (overrides.pop("sparse_prefill", None), overrides.pop("dense_prefill", None))
        offload = overrides.pop("offload", None)
        #: offload transfer engine: auto, uva, copy or sync (design §6)
        self.transfer = overrides.pop("transfer", None) or "auto"
        #: KV-cache storage: bf16 (the model dtype), int8 or int4 (docs/kv_quant.md)
        self.kv_dtype = check_kv_dtype(overrides.pop("kv_dtype", None))
        hot = (overrides.pop("kv_hot_blocks", None), overrides.pop("kv_hot_steps", None))
        options = {key: overrides.pop(key) for key in METHOD_OPTIONS if key in overrides}
        selection = SelectionConfig.from_preset(preset, **overrides)
        self.kv_hot = _check_kv_hot(self.kv_dtype, hot, selection)
        self.config = SpardaConfig(method=method or "sparda", selection=selection, forecast_path=forecast,
                                   sparse_prefill=resolve_sparse_prefill(preset, *prefill),
                                   offload=offload, **options)
        if offload is False and self.config.method in ALWAYS_OFFLOADED:
            raise SpardaError(f"{self.config.method} always offloads its KV cache; drop --no-offload, or use "
                              f"--method {self.config.method.split('-')[0]} for a cache on the device")
        if forecast is not None and self.config.method not in FORECAST_METHODS:
            raise SpardaError(f"--forecast applies to the sparda methods only, not {self.config.method!r}; "
                              "drop --forecast or pick --method sparda")
        check_offload(self.config.method, offload, self.config.shallow_select_once)  # before the model loads
        self.device = resolve_device(device)
        check_kv_dtype_cache(self.kv_dtype, self.config.method, offload, self.device.type == "cuda")
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, self.tokenizer, self.model_dir = load_model(model, self.device, self.dtype)
        self.shape = self.model.shape
        if method is None and forecast is None and not default_forecast_available(self.model_dir):
            # sparda is the default where Forecast weights exist (the bundled model); else sparse
            self.config = dataclasses.replace(self.config, method="sparse")
        if offload is None:
            self.config = dataclasses.replace(self.config, offload=default_offload(self.config.method, self.device))
        check_kv_dtype_cache(self.kv_dtype, self.config.method, self.config.offload, self.device.type == "cuda")
        self.method = build_method(self.config, self.shape, model=self.model,
                                   model_dir=self.model_dir)
        self._set_dense_heads(dense_heads, model_identity(self.model.config, self.shape))

    def _set_dense_heads(self, value, identity: dict | None) -> None:
        """Resolve ``dense_heads`` (design §3.7) for the built method and store the pairs in
        :attr:`config` (which the method reads). Raises SpardaError as
        :func:`~sparda.attention.dense_heads.resolve_dense_heads`."""
        heads = resolve_dense_heads(value, method=self.method, shape=self.shape, model_dir=self.model_dir,
                                    identity=identity)
        if heads != self.config.dense_heads:
            self.config = dataclasses.replace(self.config, dense_heads=heads)
            self.method.config = self.config

    @classmethod
    def from_model(cls, model, tokenizer=None, *, method: str = "sparse", preset: str = "small",
                   forecast=None, **overrides) -> "LLM":
        """An LLM around an in-memory :class:`~sparda.model.llama.CausalLM` (benchmarks, tests).

        Device and dtype are the model's. ``forecast`` (a :class:`Forecast`) is handed to the
        ``sparda*`` methods; ``overrides`` are selection fields plus ``offload``/``transfer``/``kv_dtype``/
        ``sparse_prefill``/``dense_prefill``/``prefill_chunk_tokens``/``prefill_batch_tokens``/``dense_heads`` as in :class:`LLM`, except that ``offload``
        defaults to off on every device (the caller builds the model and decides where its
        cache lives) and ``sparse_prefill`` to on at every preset (benchmarks time the
        block-sparse prefill). Raises SpardaError for a bad method, preset or budget.
        """
        llm = cls.__new__(cls)
        dense_heads = parse_dense_heads(overrides.pop("dense_heads", None))
        llm.cuda_graphs = bool(overrides.pop("cuda_graphs", True))
        llm.offload_timing = bool(overrides.pop("offload_timing", False))
        llm.early_attention = bool(overrides.pop("early_attention", False))
        llm.slot_factor = check_slot_factor(overrides.pop("slot_factor", DEFAULT_SLOT_FACTOR))
        llm.fused_decode = bool(overrides.pop("fused_decode", True))
        llm.prefill_chunk_tokens = check_prefill_chunk(overrides.pop("prefill_chunk_tokens",
                                                                     DEFAULT_PREFILL_CHUNK_TOKENS))
        llm.prefill_batch_tokens = check_prefill_batch(overrides.pop("prefill_batch_tokens",
                                                                     DEFAULT_PREFILL_BATCH_TOKENS))
        offload = overrides.pop("offload", None)
        llm.transfer = overrides.pop("transfer", None) or "auto"
        llm.kv_dtype = check_kv_dtype(overrides.pop("kv_dtype", None))
        hot = (overrides.pop("kv_hot_blocks", None), overrides.pop("kv_hot_steps", None))
        prefill = (overrides.pop("sparse_prefill", None), overrides.pop("dense_prefill", None))
        sparse_prefill = True if prefill == (None, None) else resolve_sparse_prefill(preset, *prefill)
        options = {key: overrides.pop(key) for key in METHOD_OPTIONS if key in overrides}
        selection = SelectionConfig.from_preset(preset, **overrides)
        llm.kv_hot = _check_kv_hot(llm.kv_dtype, hot, selection)
        check_kv_dtype_cache(llm.kv_dtype, method, bool(offload), False)
        llm.config = SpardaConfig(method=method, selection=selection, offload=offload, sparse_prefill=sparse_prefill,
                                  **options)
        param = next(model.parameters())
        llm.device, llm.dtype = param.device, param.dtype
        llm.model, llm.tokenizer, llm.model_dir, llm.shape = model.eval(), tokenizer, None, model.shape
        extra = {"forecast": forecast} if method.startswith("sparda") and forecast is not None else {}
        llm.method = build_method(llm.config, llm.shape, model=model, model_dir=None, **extra)
        llm._set_dense_heads(dense_heads, None)
        return llm

    # ----------------------------------------------------------------- prompts
    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        """Token ids of ``prompt``, wrapped in the tokenizer's chat template if ``chat``."""
        if chat and getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def _check_length(self, num_prompt: int, max_new_tokens: int) -> None:
        limit = self.shape.max_positions
        if num_prompt + max_new_tokens > limit:
            raise SpardaError(
                f"prompt of {num_prompt} tokens plus {max_new_tokens} new tokens exceeds the model's "
                f"context of {limit} tokens; shorten the prompt or lower --max-new-tokens")
        if num_prompt == 0:
            raise SpardaError("empty prompt; pass some text")
        self._note_dense_fallback(num_prompt + max_new_tokens - 1)

    def _note_dense_fallback(self, num_tokens: int) -> None:
        """Say once per LLM and cause, on stderr (logger ``sparda``), that a block-sparse
        method will attend densely to a request of ``num_tokens`` processed tokens."""
        reason = None if self.config.method == "dense" else self.config.selection.dense_reason(num_tokens)
        noted = self.__dict__.setdefault("_dense_noted", set())
        cause = reason and ("--dense-len" if "--dense-len" in reason else "--topk-blocks")
        if reason and cause not in noted:
            noted.add(cause)
            logging.getLogger("sparda").warning(
                f"note: {self.config.method} falls back to dense attention (design §3.6): {reason}")

    def _step(self, phase: str, rows: torch.Tensor, q_pos: torch.Tensor,
              max_kv_len: int | None = None, live_len: int | None = None, row: int | None = None) -> StepInfo:
        cos, sin = self.model.rotary(q_pos, self.dtype)
        return StepInfo(phase=phase, rows=rows, q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=cos, sin=sin,
                        max_kv_len=max_kv_len, live_len=live_len, row=row)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache: K and V of every layer and KV head, in
        ``kv_dtype`` (quantised: the packed data plus the fp32 scales, docs/kv_quant.md).
        ``mixed``: the cache's resident layers in the model dtype, the offloaded ones in int4
        (the bf16 hot pool is a fixed number of blocks per row, not counted per token)."""
        s = self.shape
        kv_dtype = getattr(self, "kv_dtype", "bf16")
        if kv_dtype != "mixed":
            return 2 * s.num_layers * s.num_kv_heads * token_bytes(s.head_dim, kv_dtype, self.dtype)
        full = len({layer for layer in self._cache_resident_layers() if 0 <= layer < s.num_layers})
        return 2 * s.num_kv_heads * (full * token_bytes(s.head_dim, "bf16", self.dtype)
                                     + (s.num_layers - full) * token_bytes(s.head_dim, "mixed", self.dtype))

    def _cache_resident_layers(self):
        """The layers an offloaded cache keeps whole on the device (the method's choice)."""
        method = self.method
        if hasattr(method, "cache_resident_layers"):
            return method.cache_resident_layers()
        return getattr(method, "resident_layers", ())

    def cache_capacity(self, tokens: int) -> int:
        """The KV-cache capacity ``generate`` allocates for ``tokens`` tokens per row: rounded up
        to a multiple of :data:`CAPACITY_ROUND` tokens (not past the model's context unless
        ``tokens`` is). Decode views span the capacity, and the Triton decode kernels are
        specialised on its block count, so calls of similar lengths share compiled kernels
        instead of compiling a new specialisation per exact length; the rows' own lengths
        mask the rest (same tokens in fp32; on CUDA a wider block list can split a bf16
        decode sum differently, docs/cuda_graphs.md)."""
        rounded = -(-tokens // CAPACITY_ROUND) * CAPACITY_ROUND
        return max(tokens, min(rounded, self.shape.max_positions))

    def new_cache(self, batch: int, capacity: int):
        """An empty KV cache for ``batch`` rows of ``capacity`` tokens (``kv_dtype`` storage)."""
        s = self.shape
        kv_dtype = getattr(self, "kv_dtype", "bf16")
        if self.config.offload or getattr(self.method, "offloaded", False):
            return OffloadKVCache(s.num_layers, batch, s.num_kv_heads, s.head_dim, capacity,
                                  self.config.selection, self.dtype, self.device, engine=self.transfer,
                                  resident_layers=self._cache_resident_layers(),
                                  timing=self.offload_timing, kv_dtype=kv_dtype,
                                  early_attention=getattr(self, "early_attention", False),
                                  slot_factor=getattr(self, "slot_factor", DEFAULT_SLOT_FACTOR),
                                  **(getattr(self, "kv_hot", None) or {}))
        return DeviceKVCache(s.num_layers, batch, s.num_kv_heads, s.head_dim, capacity,
                             self.config.selection, self.dtype, self.device, kv_dtype=kv_dtype)

    @torch.inference_mode()
    def prefill(self, cache, row: int, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run one prompt into cache row ``row``; returns logits ``[T or 1, V]`` fp32.

        The prompt runs :attr:`prefill_chunk_tokens` tokens at a time (chunked prefill):
        chunk ``[start, end)`` appends its K/V and attends to every key ``< end`` of its
        layer, so the logits equal an unchunked prefill's while activations stay one
        chunk's; offloaded caches write each chunk to host memory (on CUDA on a side
        stream, :meth:`~sparda.cache.offload.OffloadKVCache.chunked_prefill`)."""
        self.method.bind(cache)  # its decode counters (AttentionMethod.stats)
        rows = torch.tensor([row], device=self.device)
        chunk = getattr(self, "prefill_chunk_tokens", 0) or len(ids)
        session = getattr(cache, "chunked_prefill", None)
        outs = []
        with session() if session is not None else contextlib.nullcontext():
            for start in range(0, len(ids), chunk):
                end = min(len(ids), start + chunk)
                x = torch.tensor([ids[start:end]], device=self.device)
                q_pos = torch.arange(start, end, device=self.device).unsqueeze(0)
                step = self._step("prefill", rows, q_pos, end, row=row)
                outs.append(self.model(x, step, cache, self.method, all_logits=all_logits)[0])
                if not all_logits:
                    outs = outs[-1:]
        return torch.cat(outs) if all_logits else outs[-1]

    def prefill_groups(self, cache, prompts: list[list[int]]) -> list[list[int]]:
        """Indices of ``prompts`` grouped for :meth:`prefill_batch`, in order: consecutive
        prompts share a forward while the group's padded tokens (size x longest) stay within
        :attr:`prefill_batch_tokens` (design §3.8). A prompt longer than one prefill chunk,
        a method or cache without batched prefill, or ``prefill_batch_tokens = 0`` gives
        groups of one."""
        budget = getattr(self, "prefill_batch_tokens", 0)
        chunk = getattr(self, "prefill_chunk_tokens", 0)
        batched = budget and self.method.batched_prefill and getattr(cache, "batched_prefill", False)
        groups: list[list[int]] = []
        longest = 0  # of the last group, 0 if it cannot take more prompts
        for index, ids in enumerate(prompts):
            fits = batched and (not chunk or len(ids) <= chunk)
            if fits and longest and (len(groups[-1]) + 1) * max(longest, len(ids)) <= budget:
                groups[-1].append(index)
                longest = max(longest, len(ids))
            else:
                groups.append([index])
                longest = len(ids) if fits else 0
        return groups

    @torch.inference_mode()
    def prefill_batch(self, cache, rows: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Run several prompts into cache rows ``rows`` through one forward (design §3.8);
        returns each prompt's last-token logits ``[B, V]`` fp32.

        The prompts are right-padded to the longest; the cache writes each row's real
        tokens only, and causality keeps the padding out of every real query, so each row
        gets the logits and cache state of its :meth:`prefill` alone (up to floating-point
        summation order). One prompt runs :meth:`prefill` itself.

        Raises:
            SpardaError: rows not one distinct row per prompt, an empty prompt, a method or
                cache without batched prefill
                (:attr:`~sparda.attention.base.AttentionMethod.batched_prefill`), or a
                longest prompt over one prefill chunk (:attr:`prefill_chunk_tokens`).
        """
        if len(rows) != len(prompts) or len(set(rows)) != len(rows):
            raise SpardaError(f"prefill_batch needs one distinct cache row per prompt, got rows {rows} for "
                              f"{len(prompts)} prompts")
        if any(not ids for ids in prompts):
            raise SpardaError("empty prompt; pass some text")
        if len(prompts) == 1:
            return self.prefill(cache, rows[0], prompts[0])[-1:]
        if not (self.method.batched_prefill and getattr(cache, "batched_prefill", False)):
            raise SpardaError(f"method {self.config.method} has no batched prefill; prefill its prompts one at a time")
        longest = max(len(ids) for ids in prompts)
        chunk = getattr(self, "prefill_chunk_tokens", 0)
        if chunk and longest > chunk:
            raise SpardaError(f"a prompt of {longest} tokens exceeds one prefill chunk ({chunk}); prefill it alone")
        order = sorted(range(len(rows)), key=rows.__getitem__)  # ascending rows: a cache's whole-batch view
        rows, prompts = [rows[i] for i in order], [prompts[i] for i in order]
        self.method.bind(cache)
        x = torch.tensor([ids + [0] * (longest - len(ids)) for ids in prompts], device=self.device)
        q_pos = torch.arange(longest, device=self.device).expand(len(prompts), longest)
        cos, sin = self.model.rotary(q_pos, self.dtype)
        step = StepInfo(phase="prefill", rows=torch.tensor(rows, device=self.device), q_pos=q_pos,
                        kv_len=q_pos[:, -1] + 1, cos=cos, sin=sin, max_kv_len=longest,
                        row_lengths=tuple(zip(rows, (len(ids) for ids in prompts))))
        session = getattr(cache, "chunked_prefill", None)
        with session() if session is not None else contextlib.nullcontext():
            logits = self.model(x, step, cache, self.method)[:, 0]
        return logits[torch.tensor(order, device=logits.device).argsort()]  # the callers' order

    def _decode_step(self, cache, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                     live_len: int) -> torch.Tensor:
        """The static-shape decode step (docs/cuda_graphs.md): views span the cache's
        capacity, per-row lengths mask the rest; ``live_len`` (host int) only steers
        host-side branches. ``tokens, positions, rows [B]`` int64 -> logits ``[B, V]`` fp32."""
        self.method.bind(cache)
        step = self._step("decode", rows, positions.view(-1, 1), cache.capacity, live_len)
        fused = self._fused_decoder()
        if fused is not None:
            return fused.forward(tokens.view(-1, 1), step, cache, self.method)[:, -1]
        return self.model(tokens.view(-1, 1), step, cache, self.method)[:, -1]

    def _fused_decoder(self):
        """The :class:`~sparda.model.fused.FusedDecoder` of this model and method on CUDA
        (built once, stacking the weights outside inference mode), or ``None``: CPU, no
        Triton, ``fused_decode=False`` or a model the fused step does not cover. Every
        ``kv_dtype`` is fused (a quantised cache is quantised inside the RoPE + append kernel)."""
        fused = self.__dict__.get("_fused")
        if fused is None and self.__dict__.get("_fused_checked") is None:
            self._fused_checked = True
            from sparda import kernels
            from sparda.model.fused import FusedDecoder

            if (getattr(self, "fused_decode", True) and self.device.type == "cuda" and kernels.HAS_TRITON
                    and FusedDecoder.supports(self.model)):
                with torch.inference_mode(False), torch.no_grad():
                    fused = self._fused = FusedDecoder(self.model, self.method)
        return fused

    def runner(self, cache) -> DecodeRunner:
        """The :class:`~sparda.engine.graph_runner.DecodeRunner` of ``cache`` (made once per cache)."""
        run = getattr(cache, "decode_runner", None)
        if run is None:
            run = cache.decode_runner = DecodeRunner(self, cache, self.cuda_graphs)
        return run

    @torch.inference_mode()
    def decode(self, cache, tokens: torch.Tensor, positions: torch.Tensor,
               max_position: int | None = None) -> torch.Tensor:
        """One decode step for every row: ``tokens [B]`` at ``positions [B]`` -> logits ``[B, V]``.

        On CUDA the step replays the cache's captured CUDA graph (after one eager warm-up
        step per graph key; docs/cuda_graphs.md). ``max_position`` (host int,
        ``max(positions)``) avoids a device sync if given. Returns a fresh fp32 tensor."""
        if max_position is None:
            max_position = int(positions.max().item())
        run = self.runner(cache)
        run.load(tokens, positions)
        return run.step(max_position + 1).clone()

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits ``[T, V]`` (fp32) at every position of ``ids``, with this method
        in prefill (used for perplexity and agreement)."""
        cache = self.new_cache(1, len(ids))
        self.method.bind(cache)
        self.method.reset()
        return self.prefill(cache, 0, ids, all_logits=True)

    # --------------------------------------------------------------- generate
    @torch.inference_mode()
    def generate(self, prompts: str | list[str], sampling_params=None, *, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_p: float = 1.0, chat: bool = True, ignore_eos: bool = False,
                 seed: int = 0, prompt_token_ids: list[list[int]] | None = None) -> list[Completion]:
        """Generate a completion for each prompt (prompts of different lengths batch together).

        Args:
            prompts: one string or a list. ``prompt_token_ids`` replaces them if given.
            sampling_params: a :class:`~sparda.engine.sampling_params.SamplingParams` (for
                all prompts) or a list (one per prompt): runs the request engine
                (:meth:`generate_requests`) and returns ``RequestOutput`` objects; the
                keyword options below are then ignored, except ``chat`` and ``prompt_token_ids``.
            max_new_tokens: tokens to generate at most per prompt.
            temperature, top_p: sampling; ``temperature=0`` is greedy.
            chat: wrap each prompt in the tokenizer's chat template.
            ignore_eos: keep generating past EOS.
            seed: seed of the sampling generator.
        Returns:
            One :class:`Completion` per prompt, in order.
        Raises:
            SpardaError: empty, non-string or too-long prompts, token ids outside the vocabulary,
                bad sampling parameters (:func:`sparda.engine.validate.check_request`).
        """
        if sampling_params is not None:
            return self.generate_requests(prompts, sampling_params, chat=chat, prompt_token_ids=prompt_token_ids)
        check_request(prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                      seed=seed, prompt_token_ids=prompt_token_ids, vocab_size=self.model.config.vocab_size)
        if prompt_token_ids is None:
            prompts = [prompts] if isinstance(prompts, str) else list(prompts)
            if any(not p or not p.strip() for p in prompts):
                raise SpardaError("empty prompt; pass some text")
            prompt_token_ids = [self.encode(p, chat) for p in prompts]
        for ids in prompt_token_ids:
            self._check_length(len(ids), max_new_tokens)
        batch = len(prompt_token_ids)
        capacity = self.cache_capacity(max(len(ids) for ids in prompt_token_ids) + max_new_tokens)
        start = time.perf_counter()
        cache = self.new_cache(batch, capacity)
        self._sync()
        cache_alloc_ms = (time.perf_counter() - start) * 1e3
        self.method.bind(cache)
        self.method.reset()
        gen = torch.Generator(device=self.device).manual_seed(seed)
        eos = set() if ignore_eos else self._eos_ids()

        first, prefill_ms, group_size = [], [0.0] * batch, [1] * batch
        for group in self.prefill_groups(cache, prompt_token_ids):  # design §3.8
            start = time.perf_counter()
            logits = self.prefill_batch(cache, group, [prompt_token_ids[row] for row in group])
            first += [sample(logits[i:i + 1], temperature, top_p, gen) for i in range(len(group))]
            self._sync()
            for row in group:  # each row waited for its group's forward
                prefill_ms[row] = (time.perf_counter() - start) * 1e3
                group_size[row] = len(group)
        tokens = torch.cat(first)
        positions = torch.tensor([len(ids) for ids in prompt_token_ids], device=self.device)
        max_position = max(len(ids) for ids in prompt_token_ids)
        history = torch.empty(batch, max_new_tokens, dtype=torch.long, device=self.device)
        history[:, 0] = tokens
        eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=self.device)
        run = self.runner(cache)
        run.load(tokens, positions)
        start = time.perf_counter()
        steps = 0
        done = self._all_done(history, 1, eos_ids, max_new_tokens)
        while not done:
            logits = run.step(max_position + 1)
            nxt = sample(logits, temperature, top_p, gen)
            steps += 1
            history[:, steps] = nxt
            run.tokens.copy_(nxt)
            run.positions.add_(1)
            max_position += 1
            if steps + 1 >= max_new_tokens:
                break
            if len(eos_ids) and steps % self.eos_check_every == 0:  # one host sync per few steps
                done = self._all_done(history, steps + 1, eos_ids, max_new_tokens)
        self._sync()
        decode_s = time.perf_counter() - start
        out = [self._cut(row, eos, max_new_tokens) for row in history[:, :steps + 1].tolist()]
        per_token = self.kv_bytes_per_token()  # whichever memory holds them (offload: see stats["offload"])
        step_rate = steps / decode_s if steps and decode_s > 0 else 0.0
        results = []
        for b, ids in enumerate(prompt_token_ids):
            text = self.tokenizer.decode(out[b], skip_special_tokens=True)
            decoded = len(out[b]) - 1
            results.append(Completion(text=text, token_ids=out[b], stats={
                "prompt_tokens": len(ids),
                "new_tokens": len(out[b]),
                "prefill_ms": round(prefill_ms[b], 3),
                "prefill_batch": group_size[b],
                # this sequence's tokens over its own decode time (steps while it ran)
                "decode_tok_s": round(step_rate, 3) if decoded else 0.0,
                "cache_alloc_ms": round(cache_alloc_ms, 3),
                "graph_capture_ms": round(run.capture_s * 1e3, 3),
                "kv_cache_bytes": int(per_token * (len(ids) + len(out[b]) - 1)),  # the last token is never cached
                "kv_read_fraction": round(self.method.read_fraction(b), 4),
                "cuda_graph": run.use_graphs and run.replays > 0,
            }))
            if hasattr(cache, "offload_stats"):
                results[-1].stats["offload"] = cache.offload_stats(max(decoded, 1), row=b)
        return results

    #: decode steps between two host checks for EOS (each check is one device sync)
    eos_check_every = 8

    @staticmethod
    def _all_done(history: torch.Tensor, filled: int, eos_ids: torch.Tensor, max_new_tokens: int) -> bool:
        """True if every row has produced an EOS in ``history[:, :filled]`` or is full (syncs)."""
        if filled >= max_new_tokens:
            return True
        if not len(eos_ids):
            return False
        return bool(torch.isin(history[:, :filled], eos_ids).any(-1).all().item())

    @staticmethod
    def _cut(row: list[int], eos: set[int], max_new_tokens: int) -> list[int]:
        """A row's tokens up to and including its first EOS, at most ``max_new_tokens``."""
        for i, tok in enumerate(row[:max_new_tokens]):
            if tok in eos:
                return row[:i + 1]
        return row[:max_new_tokens]

    # ------------------------------------------------------ request engine
    def generate_requests(self, prompts, sampling_params, *, chat: bool = True,
                          prompt_token_ids: list[list[int]] | None = None, max_batch: int | None = None):
        """Run prompts as requests of the continuous-batching engine (docs/serving.md).

        Args:
            prompts: a string or a list (chat template applied if ``chat``);
                ``prompt_token_ids`` replaces them if given.
            sampling_params: one :class:`~sparda.engine.sampling_params.SamplingParams`
                for all, or a list of one per prompt.
            max_batch: rows decoding together (default: one per prompt).
        Returns:
            One :class:`~sparda.engine.sequence.RequestOutput` per prompt, in order
            (``text``, ``token_ids``, ``finish_reason``, ``logprobs``, ``stats``).
        Raises:
            SpardaError: empty prompts, bad parameters, a request longer than the context.
        """
        from sparda.engine.offline import generate_requests, request_inputs

        ids, params = request_inputs(self, prompts, sampling_params, chat, prompt_token_ids)
        return generate_requests(self, ids, params, max_batch)

    def generate_stream(self, prompts, sampling_params=None, *, chat: bool = True,
                        prompt_token_ids: list[list[int]] | None = None, max_batch: int | None = None):
        """Like :meth:`generate_requests`, but an iterator of ``(index, Delta)`` as tokens come.

        ``index`` is the prompt's position in ``prompts``; each
        :class:`~sparda.engine.sequence.Delta` has the new ``text`` and ``token_ids``, and on
        a request's last delta ``finish_reason`` and the full ``output``. A request's
        deltas' texts concatenate to its final text. Arguments are checked before the
        first token (SpardaError).
        """
        from sparda.engine.offline import request_inputs, run_requests
        from sparda.engine.sampling_params import SamplingParams

        ids, params = request_inputs(self, prompts, sampling_params or SamplingParams(), chat, prompt_token_ids)
        return run_requests(self, ids, params, max_batch)

    def chat(self, messages, sampling_params=None, *, max_batch: int | None = None):
        """Answer conversations through the tokenizer's chat template (no system prompt added).

        Args:
            messages: one conversation, a list of ``{"role": "system"|"user"|"assistant",
                "content": str}``, or a list of conversations.
            sampling_params: as :meth:`generate_requests` (default: greedy, 64 tokens).
        Returns:
            One :class:`~sparda.engine.sequence.RequestOutput` per conversation.
        Raises:
            SpardaError: malformed messages, a tokenizer without a chat template.
        """
        from sparda.engine.chat import chat_token_ids
        from sparda.engine.sampling_params import SamplingParams

        single = not isinstance(messages, (list, tuple)) or not messages or isinstance(messages[0], dict)
        ids = [chat_token_ids(self.tokenizer, conv) for conv in ([messages] if single else messages)]
        return self.generate_requests(None, sampling_params or SamplingParams(), prompt_token_ids=ids,
                                      max_batch=max_batch)

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.config, getattr(self.tokenizer, "generation_config", None)):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
