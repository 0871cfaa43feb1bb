"""Validated configuration: the block-sparse selection budget and the attention method.

The selection fields follow design §3 (InfLLM-V2-style block selection):
``block_size`` tokens per KV block, compressed keys of ``kernel_size`` tokens every
``kernel_stride`` tokens, ``init_blocks`` attention-sink blocks, ``local_blocks``
most recent blocks (current partial block included) and ``topk_blocks`` scored blocks;
optionally a mass-adaptive decode budget, ``topp_mass`` and ``min_blocks`` (design §3.12).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from dataclasses import dataclass, field

from sparda.errors import SpardaError

#: Attention methods the runtime knows (see ``sparda.attention.registry``).
METHODS = (
    "dense",
    "sparse",
    "oracle",
    "sparda",
    "sparda-random",
    "infinigen",
    "sparse-offload",
    "sparda-no-prefetch",
    "streaming",
    "h2o",
    "quest",
    "snapkv",
    "shallow",
)

#: KV-cache storage types (docs/kv_quant.md): ``bf16`` = the model dtype (no quantisation),
#: ``int8`` / ``int4`` = quantised per token and head (:mod:`sparda.kernels.quant`), ``mixed`` =
#: offloaded caches only: every block in int4 on the host plus a bounded pool of bf16 copies of
#: the hot blocks (:mod:`sparda.cache.hot`, design §6.1).
KV_DTYPES = ("bf16", "int8", "int4", "mixed")

#: the error for ``kv_dtype`` ``mixed`` without a host store (``what``: the cache or method)
MIXED_ON_DEVICE = ("--kv-dtype mixed keeps hot KV blocks in bf16 and the rest in int4 in the host store of an "
                   "offloaded cache, but {what} keeps its KV cache on the device; add --offload (sparse, sparda), "
                   "use --method sparse-offload or sparda-no-prefetch, or pick --kv-dtype int4")

#: Named selection presets, design §3.
PRESETS: dict[str, dict[str, int]] = {
    "paper": dict(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1,
                  local_blocks=33, topk_blocks=62, dense_len=8192),
    "small": dict(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1,
                  local_blocks=4, topk_blocks=16, dense_len=2048),
}

#: Whether a preset prefills block-sparsely by default (design §3.6: selection above
#: ``dense_len``). ``small`` prefills densely and selects in decode only: at its 1,344-token
#: budget, block-sparse prefill loses the 7K pass key on the bundled 135M model whichever
#: selector picks, the oracle included (design §3.6). ``paper`` keeps block-sparse
#: prefill. ``sparse_prefill=True`` / ``--sparse-prefill`` turns it on at any preset.
SPARSE_PREFILL: dict[str, bool] = {"paper": True, "small": False}


def resolve_sparse_prefill(preset: str, sparse_prefill: bool | None = None,
                           dense_prefill: bool | None = None) -> bool:
    """Whether block-sparse methods select in prefill: ``sparse_prefill`` if given, else
    ``not dense_prefill`` if given (the inverse alias), else the preset's default
    (:data:`SPARSE_PREFILL`).

    Raises:
        SpardaError: a non-bool value, both given and contradicting each other, or an
            unknown preset.
    """
    for name, value in (("sparse_prefill", sparse_prefill), ("dense_prefill", dense_prefill)):
        if value is not None and not isinstance(value, bool):
            raise SpardaError(f"{name} must be True or False, got {value!r}")
    if sparse_prefill is not None and dense_prefill is not None and sparse_prefill == dense_prefill:
        raise SpardaError(f"sparse_prefill={sparse_prefill} and dense_prefill={dense_prefill} contradict "
                          "each other; pass only one of them")
    if sparse_prefill is not None:
        return sparse_prefill
    if dense_prefill is not None:
        return not dense_prefill
    if preset not in SPARSE_PREFILL:
        raise SpardaError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    return SPARSE_PREFILL[preset]


@dataclass(frozen=True)
class SelectionConfig:
    """Block-selection budget (design §3). All lengths are in tokens, counts in blocks.

    ``topp_mass`` (``None``: fixed top-k) and ``min_blocks`` (``None``: the forced blocks)
    make the decode budget mass-adaptive (design §3.12); ``budget_blocks`` stays its maximum.

    Raises:
        SpardaError: on any invalid field (negative counts, ``local_blocks < 1``,
            a compression stride that does not divide the block size, a local window
            that does not hold the window a decoded token completes: ``local_blocks <
            min_local_blocks``, design §4, ``topp_mass`` outside ``(0, 1]``, ``min_blocks``
            without ``topp_mass`` or outside ``[init + local, budget_blocks]``, ...).
    """

    block_size: int = 64
    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    local_blocks: int = 4
    topk_blocks: int = 16
    dense_len: int = 2048
    topp_mass: float | None = None
    min_blocks: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_size", "kernel_size", "kernel_stride"):
            if getattr(self, name) < 1:
                raise SpardaError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("init_blocks", "topk_blocks", "dense_len"):
            if getattr(self, name) < 0:
                raise SpardaError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.local_blocks < 1:
            raise SpardaError(
                f"local_blocks must be >= 1 (the current block is always attended), got {self.local_blocks}"
            )
        if self.block_size % self.kernel_stride:
            raise SpardaError(
                f"kernel_stride {self.kernel_stride} must divide block_size {self.block_size}; "
                "pick e.g. --block-size 64 with stride 16"
            )
        if self.kernel_size < self.kernel_stride:
            raise SpardaError(
                f"kernel_size {self.kernel_size} must be >= kernel_stride {self.kernel_stride}"
            )
        need = self.min_local_blocks
        if self.local_blocks < need:
            raise SpardaError(
                f"local_blocks {self.local_blocks} is too small: the compressed key ({self.kernel_size} tokens, "
                f"stride {self.kernel_stride}) that a decoded token completes can start {need - 1} block(s) of "
                f"{self.block_size} before that token's block and must lie in the local window (design §4); "
                f"use --local-blocks {need} or more"
            )
        self._check_adaptive()

    def _check_adaptive(self) -> None:
        p, low = self.topp_mass, self.min_blocks
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise SpardaError(f"topp_mass must be a number in (0, 1] (the block mass to cover), got {p!r}")
        if low is None:
            return
        if p is None:
            raise SpardaError(f"min_blocks={low} applies with topp_mass only; add e.g. --topp-mass 0.9 or drop "
                              "--min-blocks")
        forced = self.init_blocks + self.local_blocks
        if isinstance(low, bool) or not isinstance(low, int) or not forced <= low <= self.budget_blocks:
            raise SpardaError(f"min_blocks must be an integer from {forced} (init_blocks + local_blocks) to "
                              f"{self.budget_blocks} (the budget), got {low!r}")

    @property
    def adaptive(self) -> bool:
        """Whether decode takes a mass-adaptive number of scored blocks (design §3.12)."""
        return self.topp_mass is not None

    @property
    def min_scored_blocks(self) -> int:
        """Scored blocks decode takes at least under ``topp_mass``: ``min_blocks - init - local``
        (0 when ``min_blocks`` is unset), design §3.12."""
        return 0 if self.min_blocks is None else self.min_blocks - self.init_blocks - self.local_blocks

    @property
    def min_local_blocks(self) -> int:
        """Smallest ``local_blocks`` that holds every window a decoded token completes (design §4).

        The token at ``t = j*s + k - 1`` completes compressed key ``j`` (tokens ``[j*s, t]``),
        which the lookahead does not score (:func:`sparda.kernels.reference.lookahead_pos`).
        With ``s | B_s``, ``j*s mod B_s`` takes every multiple of ``s`` below ``B_s``, so the key
        starts up to ``(B_s - s + k - 1) // B_s`` blocks before ``t``'s block; the local window
        (``t``'s block and the ``local_blocks - 1`` before it) covers it iff
        ``local_blocks >= 1 + (B_s - s + k - 1) // B_s`` (2 at both presets).
        """
        return 1 + (self.block_size - self.kernel_stride + self.kernel_size - 1) // self.block_size

    @property
    def budget_blocks(self) -> int:
        """Blocks attended per KV head: ``init + local + topk``."""
        return self.init_blocks + self.local_blocks + self.topk_blocks

    @property
    def budget_tokens(self) -> int:
        """Tokens attended per KV head at most: ``budget_blocks * block_size``."""
        return self.budget_blocks * self.block_size

    def dense_reason(self, num_tokens: int) -> str | None:
        """Why a sequence of ``num_tokens`` tokens (positions ``0 .. num_tokens - 1``) falls
        wholly under the dense fallback of design §3.6, or ``None`` if blocks get selected.

        The fallback holds at the last position iff it holds everywhere before it: fewer
        tokens than ``dense_len``, or a budget that covers every valid block.
        """
        blocks = -(-num_tokens // self.block_size)
        if num_tokens < self.dense_len:
            return (f"{num_tokens} tokens are fewer than dense_len {self.dense_len} "
                    "(lower --dense-len to select blocks)")
        if blocks <= self.budget_blocks:
            return (f"the budget of {self.budget_blocks} blocks (init {self.init_blocks} + local "
                    f"{self.local_blocks} + top-k {self.topk_blocks}) covers all {blocks} blocks of "
                    f"{num_tokens} tokens (lower --topk-blocks to select blocks)")
        return None

    @classmethod
    def from_preset(cls, preset: str = "small", **overrides: int | None) -> "SelectionConfig":
        """Build from a named preset (``small`` or ``paper``) plus per-field overrides.

        ``None`` overrides are ignored. Raises SpardaError for an unknown preset or field.
        """
        if preset not in PRESETS:
            raise SpardaError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        values = dict(PRESETS[preset])
        for key, value in overrides.items():
            if key not in fields:
                raise SpardaError(f"unknown selection field {key!r}; known: {', '.join(sorted(fields))}")
            if value is not None:
                values[key] = value if key == "topp_mass" else int(value)
        return cls(**values)


#: methods with an offloaded variant under ``offload=True`` (design §6)
OFFLOADABLE = ("sparse", "sparda", "shallow")
#: methods whose KV cache always lives in host memory (design §6); ``offload=False`` is refused
ALWAYS_OFFLOADED = ("sparse-offload", "sparda-no-prefetch")
#: methods that read trained Forecast weights (``forecast=``)
FORECAST_METHODS = ("sparda", "sparda-no-prefetch")
#: methods that select scored blocks (``topk_blocks`` must be >= 1 for them, design §3)
SCORED_METHODS = ("sparse", "oracle", "sparda", "sparda-random", "infinigen", "sparse-offload",
                  "sparda-no-prefetch", "h2o", "quest", "snapkv", "shallow")
#: methods whose decode budget can be mass-adaptive (``topp_mass``, design §3.12): their block
#: scores are Forecast logits or group-summed softmax mass
ADAPTIVE_METHODS = ("sparse", "oracle", "sparda", "sparda-random", "sparse-offload", "sparda-no-prefetch")
#: offload copy engines (design §6); ``auto``: ``uva`` on CUDA with Triton, else ``sync``
TRANSFERS = ("auto", "uva", "copy", "sync")
#: :class:`SpardaConfig` fields that tune one method (``LLM(..., shallow_layers=3)``)
METHOD_OPTIONS = ("quest_page_size", "snapkv_window", "shallow_layers", "shallow_select_once")

DEFAULT_SLOT_FACTOR = 1.5
#: default share of the GPU's memory for weights, activations and the KV pool
#: (``--gpu-memory-utilization``, design §3.11)
GPU_SHARE = 0.9
#: default share of the host memory available at start-up for the KV pool's host side (design §3.11)
HOST_SHARE = 0.9
#: how a paged KV cache admits requests (``--kv-admission``, design §3.11): ``grow`` takes a
#: request's prompt blocks and one more block as decode reaches it, preempting (recompute) the
#: newest request when the pool runs out; ``reserve`` takes prompt + ``max_tokens`` up front
KV_ADMISSIONS = ("grow", "reserve")
DEFAULT_KV_ADMISSION = "grow"
#: ``cuda_graph_sizes`` that turns the decode batch buckets on (design §3.13): 1, 2, 4 and the
#: multiples of 8 up to the cache's rows; the default is one bucket of all rows
AUTO_BUCKETS = "auto"
DEFAULT_HOT_STEPS = 4
#: prompt tokens per prefill chunk by default (design §3.8)
DEFAULT_PREFILL_CHUNK_TOKENS = 8192
#: padded prompt tokens per batched prefill forward by default (design §3.8; cf. vLLM's
#: ``max_num_batched_tokens``)
DEFAULT_PREFILL_BATCH_TOKENS = 16384

#: every option ``LLM(...)`` takes -> its command-line flag (errors name the one the caller used)
OPTION_FLAGS = {
    "method": "--method", "preset": "--preset", "device": "--device", "dtype": "--dtype",
    "block_size": "--block-size", "kernel_size": "--kernel-size", "kernel_stride": "--kernel-stride",
    "init_blocks": "--init-blocks", "local_blocks": "--local-blocks", "topk_blocks": "--topk-blocks",
    "dense_len": "--dense-len", "forecast": "--forecast", "sparse_prefill": "--sparse-prefill",
    "lookahead": "--lookahead", "forecast2": "--forecast2",
    "dense_prefill": "--dense-prefill", "offload": "--offload", "transfer": "--transfer",
    "kv_dtype": "--kv-dtype", "kv_hot_blocks": "--kv-hot-blocks", "kv_hot_steps": "--kv-hot-steps",
    "slot_factor": "--slot-factor", "offload_timing": "--offload-timing", "cuda_graphs": "--eager",
    "fused_decode": "--fused-decode", "prefill_chunk_tokens": "--prefill-chunk",
    "prefill_batch_tokens": "--prefill-batch", "dense_heads": "--dense-heads",
    "quest_page_size": "--quest-page-size", "snapkv_window": "--snapkv-window",
    "shallow_layers": "--shallow-layers", "shallow_select_once": "--shallow-select-once",
    "max_new_tokens": "--max-new-tokens", "temperature": "--temperature", "top_p": "--top-p",
    "seed": "--seed", "max_batch": "--max-batch", "max_model_len": "--max-model-len",
    "max_waiting": "--max-waiting", "cpu_threads": "--cpu-threads", "topp_mass": "--topp-mass",
    "min_blocks": "--min-blocks", "cuda_graph_sizes": "--cuda-graph-sizes",
}
_FLAG_KEYS = {flag: key for key, flag in OPTION_FLAGS.items()}
_FLAG_KEYS.update({"--no-offload": "offload", "--eager": "cuda_graphs"})
_FLAG_VALUES = {"--offload": "offload=True", "--no-offload": "offload=False", "--eager": "cuda_graphs=False",
                "--sparse-prefill": "sparse_prefill=True", "--dense-prefill": "sparse_prefill=False",
                "--shallow-select-once": "shallow_select_once=True", "--offload-timing": "offload_timing=True"}


#: words that follow a flag as its value in messages (``--kv-dtype mixed`` -> ``kv_dtype=mixed``)
_VALUE_WORDS = (*METHODS, *KV_DTYPES, *PRESETS, "auto", "uva", "copy", "sync", "none", "cpu", "cuda", "float32",
                "bfloat16", "float16")


def spell(message: str, style: str) -> str:
    """``message`` with every option named as a caller of ``style`` spells it: ``"cli"``
    (``--kv-dtype``), or ``"api"`` (``kv_dtype``, ``offload=False``). Messages are written with
    either spelling; this is the one place that translates them."""
    if style == "cli":
        for flag, keyword in _FLAG_VALUES.items():
            message = re.sub(rf"(?<![\w-]){re.escape(keyword)}(?![\w])", flag, message)
        every = "|".join(sorted(OPTION_FLAGS, key=len, reverse=True))
        message = re.sub(rf"(?<![\w.\-])({every})=(?=[\w.])", lambda m: OPTION_FLAGS[m.group(1)] + " ", message)
        message = re.sub(rf"'({every})'", lambda m: OPTION_FLAGS[m.group(1)], message)
        keys = "|".join(sorted((k for k in OPTION_FLAGS if "_" in k), key=len, reverse=True))
        return re.sub(rf"(?<![\w.\-=])({keys})(?![\w(=])", lambda m: OPTION_FLAGS[m.group(1)], message)

    def api(match):
        flag, value = match.group(1), match.group(2)
        if flag in _FLAG_VALUES:
            return _FLAG_VALUES[flag] + (match.group(0)[len(flag):] if value is None else f" {value}")
        key = _FLAG_KEYS[flag]
        if value is not None:
            return f"{key}={value}"
        return key if "_" in key else f"'{key}'"  # a bare word would read as prose

    flags = "|".join(sorted(map(re.escape, _FLAG_KEYS), key=len, reverse=True))
    words = "|".join(sorted(map(re.escape, _VALUE_WORDS), key=len, reverse=True))
    value = rf"\d[\w.:,]*|(?:{words})(?![\w-])"
    return re.sub(rf"(?<![\w-])({flags})(?![\w-])(?: ({value}))?", api, message)


class OptionError(SpardaError):
    """A bad option value: ``option`` (its keyword) and the one-line message."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


@functools.lru_cache(maxsize=None)
def _note(message: str) -> None:
    """Say ``message`` once per process on stderr (logger ``sparda``)."""
    logging.getLogger("sparda").warning(message)


def _fail(option: str, message: str):
    raise OptionError(option, message)


def _flag(key: str, value) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    _fail(key, f"{key} must be True or False, got {value!r}")


def _count(key: str, value, minimum: int, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(key, f"{key} must be an integer >= {minimum} ({what}), got {value!r}")
    return value


@dataclass(frozen=True)
class CacheConfig:
    """Where and how the KV cache is kept (design §6, §6.1).

    Attributes:
        kv_dtype: ``bf16`` (the model dtype), ``int8``/``int4`` (per token and head), or
            ``mixed`` (offloaded only: int4 host store plus bf16 copies of hot blocks).
        offload: the KV cache in host memory, blocks prefetched into GPU slots.
        transfer: the copy engine, one of :data:`TRANSFERS`.
        slot_factor: GPU slots per block of the widest selection (>= 1).
        hot_blocks, hot_steps: ``mixed`` only: bf16 pool blocks per layer, row and KV head
            (default the budget) and decode steps a block stays hot unselected.
        timing: time the offload copies (``copy_ms``, ``exposed_wait_ms`` in stats).
    """

    kv_dtype: str = "bf16"
    offload: bool = False
    transfer: str = "auto"
    slot_factor: float = DEFAULT_SLOT_FACTOR
    hot_blocks: int | None = None
    hot_steps: int | None = None
    timing: bool = False

    @property
    def hot(self) -> dict:
        """The ``mixed`` store's keywords (``{}`` for other dtypes)."""
        return {"hot_blocks": self.hot_blocks, "hot_steps": self.hot_steps} if self.kv_dtype == "mixed" else {}


@dataclass(frozen=True)
class RuntimeConfig:
    """How the model runs (design §3.8, §6; docs/cuda_graphs.md).

    Attributes:
        device, dtype: resolved ``torch.device`` / ``torch.dtype`` names (``"cuda:0"``, ``"bfloat16"``).
        cuda_graphs: on CUDA decode steps replay captured CUDA graphs.
        fused_decode: on CUDA decode runs the fused kernels of :mod:`sparda.model.fused`.
        prefill_chunk_tokens: prompt tokens per prefill chunk (0: the whole prompt).
        prefill_batch_tokens: padded prompt tokens per batched prefill forward (0: one prompt).
        cpu_threads: torch CPU threads on the CPU (:func:`cpu_threads`); ``None`` off the CPU.
        cuda_graph_sizes: decode batch buckets (design §3.13): a decode step runs the cache's
            first ``b`` rows, ``b`` the smallest bucket holding every decoding row
            (:mod:`sparda.engine.buckets` caps them to the cache's rows, which are always one).
            ``None`` (the default): one bucket of all rows, every step runs every row;
            ``"auto"``: 1, 2, 4 and the multiples of 8; or ascending sizes.
    """

    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True
    fused_decode: bool = True
    prefill_chunk_tokens: int = DEFAULT_PREFILL_CHUNK_TOKENS
    prefill_batch_tokens: int = DEFAULT_PREFILL_BATCH_TOKENS
    cpu_threads: int | None = None
    cuda_graph_sizes: tuple[int, ...] | str | None = None


@dataclass(frozen=True)
class SpardaConfig:
    """Every option of a run: the method and its selection budget, the KV cache, the runtime.

    Built and checked once by :func:`build_config` (``LLM(...)``, the CLI, the server and the
    integrations all go through it); the parts below it only read it.

    Attributes:
        method: one of :data:`METHODS`.
        selection: the block budget, :class:`SelectionConfig`.
        forecast_path: Forecast weights (``sparda`` methods); ``None``: the shipped ones.
        lookahead: 1, or 2: offloaded ``sparda`` also starts layer ``l+2``'s copy in layer ``l``
            from a two-ahead Forecast (design §6.2).
        forecast2_path: two-ahead Forecast weights (``lookahead=2``); ``None``: the shipped ones.
        sparse_prefill: block-sparse methods select per query token in prefill too (design §3.6).
        cache: :class:`CacheConfig`. runtime: :class:`RuntimeConfig`.
        quest_page_size, snapkv_window, shallow_layers, shallow_select_once: method options
            (docs/baselines.md).
        dense_heads: ``(layer, kv_head)`` pairs that read every visible block in decode
            (design §3.7); ``"auto"`` until the model is known.
    Raises:
        SpardaError: an unknown method or an invalid method option.
    """

    method: str = "dense"
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    forecast_path: str | None = None
    lookahead: int = 1
    forecast2_path: str | None = None
    sparse_prefill: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    quest_page_size: int = 16
    snapkv_window: int = 32
    shallow_layers: int | None = None
    shallow_select_once: bool = False
    dense_heads: tuple[tuple[int, int], ...] | str = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            _fail("method", f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        page = self.quest_page_size
        if self.method == "quest" and (not isinstance(page, int) or page < 1 or self.selection.block_size % page):
            _fail("quest_page_size", f"quest_page_size {page!r} must be a positive divisor of block_size "
                                     f"{self.selection.block_size}; e.g. 16")
        if isinstance(self.snapkv_window, bool) or not isinstance(self.snapkv_window, int) or self.snapkv_window < 1:
            _fail("snapkv_window", f"snapkv_window must be an integer >= 1, got {self.snapkv_window!r}")
        _count("shallow_layers", self.shallow_layers, 1, "dense layers")
        self._check_lookahead()
        if self.dense_heads != "auto" and (not isinstance(self.dense_heads, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) and x >= 0 for x in p)
                for p in self.dense_heads)):
            _fail("dense_heads", f"dense_heads must be a tuple of (layer, kv_head) pairs of integers >= 0, "
                                 f"got {self.dense_heads!r}")

    def _check_lookahead(self) -> None:
        """``lookahead`` is 1 or 2; 2 needs offloaded ``sparda`` (its early copies warm GPU slots,
        design §6.2); ``forecast2_path`` needs 2."""
        if self.lookahead not in (1, 2) or isinstance(self.lookahead, bool):
            _fail("lookahead", f"'lookahead' must be 1 or 2 (layers ahead a layer's copy starts), got {self.lookahead!r}")
        if self.lookahead == 2 and not (self.method == "sparda" and self.cache.offload):
            where = "without --offload" if self.method == "sparda" else f"of method {self.method}"
            _fail("lookahead", f"lookahead=2 starts copies into the GPU slots of an offloaded sparda cache, but the "
                               f"cache {where} has none to warm; use --method sparda --offload, or drop --lookahead")
        if self.forecast2_path is not None and self.lookahead != 2:
            _fail("forecast2", "--forecast2 gives the two-ahead Forecast of lookahead=2; add --lookahead 2 or drop "
                               "--forecast2")

    @property
    def offload(self) -> bool:
        """Whether the KV cache lives in host memory (:attr:`CacheConfig.offload`)."""
        return self.cache.offload


_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                "float16": "float16", "fp16": "float16"}


def _device(value, cuda_available: bool) -> str:
    if value is None:
        return "cuda" if cuda_available else "cpu"
    text = str(value)
    kind = text.split(":")[0]
    if kind not in ("cpu", "cuda") or (":" in text and not text.split(":", 1)[1].isdigit()):
        _fail("device", f"invalid device {value!r}; use --device cpu or --device cuda (cuda:N)")
    if kind == "cuda" and not cuda_available:
        _fail("device", "CUDA was requested but is not available; use --device cpu")
    return text


def _dtype(value, device: str) -> str:
    if value is None:
        return "bfloat16" if device.startswith("cuda") else "float32"
    name = str(value).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        _fail("dtype", f"unknown dtype {value!r}; choose one of float32, bfloat16, float16")
    return _DTYPE_NAMES[name]


def _graph_sizes(value) -> tuple[int, ...] | str | None:
    """``cuda_graph_sizes`` (design §3.13): ``None`` stays ``None`` (one bucket of all rows),
    ``"auto"`` stays ``"auto"`` (:func:`sparda.engine.buckets.auto_sizes`), a comma list
    ``"1,2,4"`` or integers become ascending unique bucket sizes."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() == AUTO_BUCKETS:
        return AUTO_BUCKETS
    items = value.split(",") if isinstance(value, str) else value
    try:
        sizes = [int(item) if isinstance(item, str) and item.strip().isdigit() else item for item in items]
    except (TypeError, ValueError):  # ValueError: digits int() refuses ("²" is isdigit())
        sizes = None
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        _fail("cuda_graph_sizes", f"cuda_graph_sizes must be auto or a comma list of integers >= 1 (decode batch "
                                  f"buckets, design §3.13), got {value!r}; e.g. --cuda-graph-sizes auto or "
                                  f"--cuda-graph-sizes 1,2,4,8,16")
    return tuple(sorted(set(sizes)))


def build_config(*, method: str | None = "sparda", preset: str = "small", device=None, dtype=None,
                 cuda_available: bool | None = None, defaults: str = "user", **options) -> SpardaConfig:
    """Check every option once and build the :class:`SpardaConfig` (no model is loaded).

    Args:
        method, preset, device, dtype: as ``LLM(...)``; ``device=None``: CUDA if available.
        cuda_available: whether CUDA can be used (``None``: ask torch).
        defaults: ``"user"`` (``LLM``, CLI, server) or ``"bench"`` (:meth:`LLM.from_model`:
            offload off and block-sparse prefill on unless asked).
        **options: the keywords of ``LLM(...)`` (:data:`OPTION_FLAGS`); ``None`` means the default.
    Raises:
        OptionError: an unknown option or a bad value, one line naming the option and the fix.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    known = set(OPTION_FLAGS) - {"max_new_tokens", "temperature", "top_p", "seed", "max_batch",
                                 "max_model_len", "max_waiting"}
    unknown = sorted(set(options) - known)
    if unknown:
        _fail(unknown[0], f"unknown option {unknown[0]!r}; known: {', '.join(sorted(known - {'method'}))}")
    if preset not in PRESETS:
        _fail("preset", f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    method = method or "sparda"
    if method not in METHODS:
        _fail("method", f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    get = options.get
    dev = _device(device, cuda_available)
    cuda = dev.startswith("cuda")
    sel = {f.name: get(f.name) for f in dataclasses.fields(SelectionConfig)}
    for key, value in sel.items():
        if key != "topp_mass" and value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            _fail(key, f"{key} must be an integer, got {value!r}")
    if sel["topp_mass"] is not None and method not in ADAPTIVE_METHODS:
        _fail("topp_mass", f"topp_mass applies to methods {', '.join(ADAPTIVE_METHODS)}, not {method!r} (its block "
                           "scores are no attention mass); drop --topp-mass")
    selection = SelectionConfig.from_preset(preset, **sel)
    if method in SCORED_METHODS and selection.topk_blocks < 1:  # allowed (the eval's smallest budgets), but said
        _note(f"note: topk_blocks 0 leaves method {method} no scored block: it reads the sinks and the local window "
              "only (--method streaming does the same without scoring)")
    sparse_prefill = resolve_sparse_prefill(preset, _flag("sparse_prefill", get("sparse_prefill")),
                                            _flag("dense_prefill", get("dense_prefill")))
    if defaults == "bench" and get("sparse_prefill") is None and get("dense_prefill") is None:
        sparse_prefill = True
    forecast = get("forecast")
    if forecast is not None and method not in FORECAST_METHODS:
        _fail("forecast", f"--forecast applies to the sparda methods only, not {method!r}; drop --forecast or "
                          "pick --method sparda")
    for key in ("forecast", "forecast2"):  # a path (not weights in memory) must exist before any loading
        path = get(key)
        if isinstance(path, (str, os.PathLike)) and not os.path.isfile(path):
            _fail(key, f"Forecast weights not found: {os.fspath(path)}; train them with `sparda train-forecast` or "
                       f"drop --{key}")
    offload = _flag("offload", get("offload"))
    if offload is False and method in ALWAYS_OFFLOADED:
        _fail("offload", f"{method} always offloads its KV cache; drop --no-offload, or use --method "
                         f"{method.split('-')[0]} for a cache on the device")
    if offload and method not in OFFLOADABLE and method not in ALWAYS_OFFLOADED:
        _fail("offload", f"--offload is not supported for method {method!r}; use it with sparse, sparda or "
                         "shallow, or the always-offloaded sparse-offload / sparda-no-prefetch")
    if offload and method == "shallow" and get("shallow_select_once"):
        _fail("shallow_select_once", "--shallow-select-once does not run offloaded: it reads every block written "
                                     "since the prompt's local window, more than the offloaded cache's GPU slots "
                                     "hold as decode goes on; drop --offload or --shallow-select-once")
    if offload is None:  # design §6: the lookahead prefetch is the point of sparda where CUDA has a side stream
        offload = method == "sparda" and cuda and defaults == "user"
    offloaded = offload or method in ALWAYS_OFFLOADED
    kv_dtype = "bf16" if get("kv_dtype") is None else get("kv_dtype")
    if kv_dtype not in KV_DTYPES:
        _fail("kv_dtype", f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    if kv_dtype == "mixed" and not offloaded:
        _fail("kv_dtype", MIXED_ON_DEVICE.format(what=f"method {method}" + (
            " without --offload" if method in OFFLOADABLE else "")))
    hot_blocks, hot_steps = get("kv_hot_blocks"), get("kv_hot_steps")
    if kv_dtype != "mixed" and (hot_blocks is not None or hot_steps is not None):
        _fail("kv_hot_blocks" if hot_blocks is not None else "kv_hot_steps",
              f"--kv-hot-blocks / --kv-hot-steps apply to --kv-dtype mixed only, not {kv_dtype}; drop them or "
              "add --kv-dtype mixed")
    if kv_dtype == "mixed":
        hot_blocks = selection.budget_blocks if hot_blocks is None else hot_blocks
        hot_steps = DEFAULT_HOT_STEPS if hot_steps is None else hot_steps
        if isinstance(hot_blocks, bool) or not isinstance(hot_blocks, int) or hot_blocks < selection.local_blocks:
            _fail("kv_hot_blocks", f"kv_hot_blocks must be an integer of at least local_blocks "
                                   f"({selection.local_blocks}: the local window stays hot), got {get('kv_hot_blocks')!r}; e.g. "
                                   f"--kv-hot-blocks {selection.budget_blocks}")
        _count("kv_hot_steps", hot_steps, 1, "decode steps")
    transfer = "auto" if get("transfer") is None else get("transfer")
    if transfer not in TRANSFERS:
        _fail("transfer", f"unknown transfer {transfer!r}; choose one of {', '.join(TRANSFERS)}")
    if transfer != "auto" and not offloaded:
        _fail("transfer", f"--transfer {transfer} applies to an offloaded KV cache, but method {method} keeps it "
                          "on the device; drop --transfer or add --offload")
    if transfer in ("uva", "copy") and not cuda:
        _fail("transfer", f"--transfer {transfer} needs a CUDA device; use --transfer sync on {dev}")
    slot_factor = DEFAULT_SLOT_FACTOR if get("slot_factor") is None else get("slot_factor")
    if isinstance(slot_factor, bool) or not isinstance(slot_factor, (int, float)) or not 1 <= slot_factor < float("inf"):
        _fail("slot_factor", f"slot_factor must be a number >= 1 (GPU slots per selected block), got {slot_factor!r}")
    chunk = _count("prefill_chunk_tokens", get("prefill_chunk_tokens"), 0, "0: the whole prompt at once")
    batch = _count("prefill_batch_tokens", get("prefill_batch_tokens"), 0, "0: one prompt per prefill forward")
    threads = _count("cpu_threads", get("cpu_threads"), 1, "torch threads on the CPU")
    method_options = {key: get(key) for key in METHOD_OPTIONS if get(key) is not None}
    if "shallow_select_once" in method_options:
        _flag("shallow_select_once", method_options["shallow_select_once"])
    dense_heads = get("dense_heads")
    from_options = dense_heads if isinstance(dense_heads, (tuple, str)) or dense_heads is None else tuple(dense_heads)
    lookahead = 1 if get("lookahead") is None else get("lookahead")
    forecast2 = get("forecast2")
    return SpardaConfig(
        method=method, selection=selection, forecast_path=None if forecast is None else str(forecast),
        lookahead=lookahead, forecast2_path=None if forecast2 is None else str(forecast2),
        sparse_prefill=sparse_prefill,
        cache=CacheConfig(kv_dtype=kv_dtype, offload=bool(offload), transfer=transfer, slot_factor=float(slot_factor),
                          hot_blocks=hot_blocks if kv_dtype == "mixed" else None,
                          hot_steps=hot_steps if kv_dtype == "mixed" else None,
                          timing=bool(_flag("offload_timing", get("offload_timing")))),
        runtime=RuntimeConfig(device=dev, dtype=_dtype(dtype, dev),
                              cuda_graphs=_flag("cuda_graphs", get("cuda_graphs")) is not False,
                              fused_decode=_flag("fused_decode", get("fused_decode")) is not False,
                              prefill_chunk_tokens=DEFAULT_PREFILL_CHUNK_TOKENS if chunk is None else chunk,
                              prefill_batch_tokens=DEFAULT_PREFILL_BATCH_TOKENS if batch is None else batch,
                              cpu_threads=None if cuda else (threads or cpu_threads()),
                              cuda_graph_sizes=_graph_sizes(get("cuda_graph_sizes"))),
        dense_heads=_dense_heads_value(from_options, defaults), **method_options)


def _dense_heads_value(value, defaults: str):
    """``dense_heads`` as given, checked for form: ``"auto"``, or a tuple of pairs (resolved
    against the model later, design §3.7)."""
    if value is None:
        return "auto" if defaults == "user" else ()
    try:
        return parse_dense_heads(value, option="dense_heads")
    except SpardaError as exc:
        raise OptionError("dense_heads", str(exc)) from None


def parse_dense_heads(value, option: str = "--dense-heads") -> tuple[tuple[int, int], ...] | str:
    """Normalise a ``dense_heads`` setting.

    Args:
        value: ``None`` / ``"none"`` / ``""`` (no dense heads), ``"auto"``, a string
            ``"L:H,L:H,..."`` or an iterable of ``(layer, kv_head)`` int pairs.
        option: the option named in messages (``--dense-heads`` on the command line).
    Returns:
        ``"auto"``, or a sorted tuple of unique ``(layer, kv_head)`` pairs (empty for none).
    Raises:
        SpardaError: a malformed entry or a negative index (one line, with an example).
    """
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "none"):
            return ()
        if text == "auto":
            return "auto"
        pairs = []
        for item in text.split(","):
            parts = item.strip().split(":")
            if len(parts) != 2 or not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
                raise SpardaError(f"{option}: {item.strip()!r} is not LAYER:KV_HEAD; use auto, none or e.g. 7:2,18:2")
            pairs.append((int(parts[0]), int(parts[1])))
        return tuple(sorted(set(pairs)))
    try:
        pairs = [tuple(p) for p in value]
    except TypeError:
        raise SpardaError(f"{option} must be 'auto', 'none', 'L:H,...' or (layer, kv_head) pairs, "
                          f"got {value!r}") from None
    for p in pairs:
        if len(p) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
            raise SpardaError(f"{option}: {p!r} is not a (layer, kv_head) pair of integers >= 0; e.g. (7, 2)")
    return tuple(sorted(set(pairs)))


def resolve_device(device=None):
    """``device`` as a ``torch.device`` (``None``: CUDA if available, else CPU).

    Raises:
        OptionError: an unknown device, or CUDA where none is available.
    """
    import torch

    return torch.device(_device(device, torch.cuda.is_available()))


def resolve_dtype(dtype, device):
    """``dtype`` as a ``torch.dtype`` (``None``: bf16 on CUDA, fp32 on the CPU).

    Raises:
        OptionError: an unknown dtype name.
    """
    import torch

    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, _dtype(dtype, str(device)))


def check_budget(config: SpardaConfig, context_tokens: int) -> None:
    """Refuse a block budget that can never select for a model of ``context_tokens`` tokens:
    one that covers every block of the whole context, so that every request would attend
    densely (design §3.6).

    Raises:
        OptionError: naming the budget, the context and the largest ``topk_blocks`` that selects.
    """
    sel = config.selection
    blocks = -(-context_tokens // sel.block_size)
    if config.method == "dense" or sel.budget_blocks < blocks:
        return
    most = blocks - 1 - sel.init_blocks - sel.local_blocks
    fix = f"use --topk-blocks {most} or fewer" if most >= 1 else "lower --local-blocks"
    _fail("topk_blocks", f"the budget of {sel.budget_blocks} blocks (init {sel.init_blocks} + local {sel.local_blocks} + "
                         f"top-k {sel.topk_blocks}) covers the model's whole context of {context_tokens} tokens "
                         f"({blocks} blocks of {sel.block_size}), so every request would attend densely; {fix}, "
                         "or --method dense")


def cpu_threads() -> int:
    """Torch threads for a CPU run when ``cpu_threads`` is not given: the cores this process
    may use less those already busy (the 1-minute load average), at least 1. Threads beyond
    the idle cores spin-wait on each other: on a busy 2-core machine two threads decoded 14x
    slower than one. ``OMP_NUM_THREADS``, where set, is kept."""
    import os

    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0
    return max(1, min(cores, cores - busy))
