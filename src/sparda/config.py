"""Validated configuration: the block-sparse selection budget and the attention method.

The selection fields follow design §3 (InfLLM-V2-style block selection):
``block_size`` tokens per KV block, compressed keys of ``kernel_size`` tokens every
``kernel_stride`` tokens, ``init_blocks`` attention-sink blocks, ``local_blocks``
most recent blocks (current partial block included) and ``topk_blocks`` scored blocks.
"""

from __future__ import annotations

import dataclasses
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

    Raises:
        SpardaError: on any invalid field (negative counts, ``local_blocks < 1``,
            a compression stride that does not divide the block size, a local window
            that does not hold the window a decoded token completes: ``local_blocks <
            min_local_blocks``, design §4, ...).
    """

    block_size: int = 64
    kernel_size: int = 32
    kernel_stride: int = 16
    init_blocks: int = 1
    local_blocks: int = 4
    topk_blocks: int = 16
    dense_len: int = 2048

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
                values[key] = int(value)
        return cls(**values)


@dataclass(frozen=True)
class SpardaConfig:
    """Which attention method runs and with which selection budget.

    Attributes:
        method: one of :data:`METHODS`.
        selection: the block budget, :class:`SelectionConfig`.
        forecast_path: safetensors file of Forecast weights (method ``sparda``);
            ``None`` uses the shipped weights for the bundled model, if any.
        sparse_prefill: when True (design §3), block-sparse methods select per query token
            in prefill too; when False they prefill densely and select in decode only.
            :class:`~sparda.LLM` and the CLI take it from the preset unless asked
            (:func:`resolve_sparse_prefill`: dense at ``small``, block-sparse at ``paper``).
        offload: keep the full KV cache in host memory (``None``: ``LLM`` decides, see
            :func:`sparda.engine.llm.default_offload`).
        quest_page_size: ``quest`` page in tokens (must divide ``block_size`` for ``quest``; default 16).
        snapkv_window: ``snapkv`` observation window in prompt tokens (default 32).
        shallow_layers: ``shallow``'s dense layers ``N`` (``None``: the calibration stored
            for the model, else :data:`sparda.attention.shallow.DEFAULT_LAYERS`).
        shallow_select_once: ``shallow`` selects once at the end of prefill.
        dense_heads: ``(layer, kv_head)`` pairs that read every visible block in decode
            (design §3.7; :mod:`sparda.attention.dense_heads`); :class:`~sparda.LLM` resolves
            ``auto`` / ``none`` / ``"L:H,..."`` into this tuple. Empty: none.
    Raises:
        SpardaError: an unknown method or an invalid method option.
    """

    method: str = "dense"
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    forecast_path: str | None = None
    sparse_prefill: bool = True
    offload: bool | None = None
    quest_page_size: int = 16
    snapkv_window: int = 32
    shallow_layers: int | None = None
    shallow_select_once: bool = False
    dense_heads: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpardaError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        page = self.quest_page_size
        if self.method == "quest" and (not isinstance(page, int) or page < 1 or self.selection.block_size % page):
            raise SpardaError(f"quest_page_size {page!r} must be a positive divisor of block_size "
                              f"{self.selection.block_size}; e.g. 16")
        if not isinstance(self.snapkv_window, int) or self.snapkv_window < 1:
            raise SpardaError(f"snapkv_window must be an integer >= 1, got {self.snapkv_window!r}")
        if self.shallow_layers is not None and (not isinstance(self.shallow_layers, int) or self.shallow_layers < 1):
            raise SpardaError(f"shallow_layers must be an integer >= 1, got {self.shallow_layers!r}")
        if not isinstance(self.dense_heads, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, int) and x >= 0 for x in p)
                for p in self.dense_heads):
            raise SpardaError(f"dense_heads must be a tuple of (layer, kv_head) pairs of integers >= 0, "
                              f"got {self.dense_heads!r}")


#: :class:`SpardaConfig` fields that tune one method (``LLM(..., shallow_layers=3)``)
METHOD_OPTIONS = ("quest_page_size", "snapkv_window", "shallow_layers", "shallow_select_once")
