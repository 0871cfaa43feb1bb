"""Model execution: KV caches, chunked and batched prefill, the decode step (fused, graphed).

:class:`ModelRunner` is everything between token ids and logits for one model and
attention method: it allocates KV caches, prefills prompts into cache rows (design §3.8)
and runs decode steps through a :class:`~sparda.engine.graph_runner.DecodeRunner` per
cache (docs/cuda_graphs.md). It never samples and never schedules: that is
:mod:`sparda.engine.sampler` and :class:`~sparda.engine.engine.Engine`.
"""

from __future__ import annotations

import torch

from sparda.cache.device import DeviceKVCache
from sparda.cache.mixed import new_offload_cache
from sparda.config import SpardaConfig
from sparda.engine.graph_runner import DecodeRunner
from sparda.errors import SpardaError
from sparda.kernels.quant import token_bytes
from sparda.model.llama import StepInfo

#: a KV cache's capacity is a multiple of this many tokens (:meth:`ModelRunner.cache_capacity`)
CAPACITY_ROUND = 512


class ModelRunner:
    """Prefill and decode of ``model`` with ``method`` under ``config``.

    Args:
        model: a :class:`~sparda.model.llama.CausalLM` (its device and dtype are the runner's).
        method: the :class:`~sparda.attention.base.AttentionMethod`.
        config: the checked :class:`~sparda.config.SpardaConfig`.
    """

    def __init__(self, model, method, config: SpardaConfig) -> None:
        param = next(model.parameters())
        self.model, self.method, self.config = model, method, config
        self.device, self.dtype, self.shape = param.device, param.dtype, model.shape
        self._fused = None
        self._fused_checked = False
        self.dense_noted: set[str] = set()  # causes of the dense fallback already said

    # ------------------------------------------------------------------ caches
    def cache_resident_layers(self) -> tuple:
        """The layers an offloaded cache keeps whole on the device (the method's choice)."""
        return tuple(self.method.cache_resident_layers())

    @property
    def offloaded(self) -> bool:
        """Whether this runner's caches live in host memory."""
        return bool(self.config.offload or self.method.offloaded)

    def new_cache(self, batch: int, capacity: int, host_blocks: int | None = None):
        """An empty KV cache of ``batch`` rows x ``capacity`` tokens (``config.cache`` storage).

        ``host_blocks``: an offloaded cache's host pages per offloaded layer (``None``: every
        row a whole capacity, the identity block table; otherwise rows start without pages,
        ``cache.assign_blocks``); a device cache ignores it."""
        s, c = self.shape, self.config.cache
        if self.offloaded:
            return new_offload_cache(s.num_layers, batch, s.num_kv_heads, s.head_dim, capacity,
                                     self.config.selection, self.dtype, self.device, engine=c.transfer,
                                     resident_layers=self.cache_resident_layers(), timing=c.timing,
                                     kv_dtype=c.kv_dtype, slot_factor=c.slot_factor, host_blocks=host_blocks,
                                     **c.hot)
        return DeviceKVCache(s.num_layers, batch, s.num_kv_heads, s.head_dim, capacity,
                             self.config.selection, self.dtype, self.device, kv_dtype=c.kv_dtype)

    def kv_bytes_per_token(self) -> int:
        """Bytes one token takes in the KV cache: K and V of every layer and KV head, in
        ``kv_dtype`` (quantised: packed codes plus fp32 scales, docs/kv_quant.md). ``mixed``:
        resident layers in the model dtype, offloaded ones in int4 (the bf16 hot pool is a
        fixed number of blocks per row, not counted per token)."""
        s, kv_dtype = self.shape, self.config.cache.kv_dtype
        if kv_dtype != "mixed":
            return 2 * s.num_layers * s.num_kv_heads * token_bytes(s.head_dim, kv_dtype, self.dtype)
        full = len({layer for layer in self.cache_resident_layers() if 0 <= layer < s.num_layers})
        return 2 * s.num_kv_heads * (full * token_bytes(s.head_dim, "bf16", self.dtype)
                                     + (s.num_layers - full) * token_bytes(s.head_dim, "mixed", self.dtype))

    def kv_bytes(self, batch: int, capacity: int, host_blocks: int | None = None) -> tuple[int, int]:
        """``(device_bytes, host_bytes)`` that :meth:`new_cache` of ``batch`` x ``capacity``
        with ``host_blocks`` host pages allocates (:func:`sparda.engine.memory.kv_need_bytes`)."""
        from sparda.engine.memory import kv_need_bytes

        c = self.config.cache
        return kv_need_bytes(self.shape, self.config.selection, c.kv_dtype, self.dtype, batch, capacity,
                             offload=self.offloaded, resident_layers=self.cache_resident_layers(),
                             slot_factor=c.slot_factor, hot_blocks=c.hot.get("hot_blocks"),
                             state_bytes=self.method.state_bytes(batch, capacity), host_blocks=host_blocks)

    def host_block_bytes(self) -> int:
        """Host bytes of one KV block of an offloaded cache, every offloaded layer
        (:func:`sparda.engine.memory.host_page_bytes`); 0 for a device cache."""
        from sparda.engine.memory import host_page_bytes

        if not self.offloaded:
            return 0
        return host_page_bytes(self.shape, self.config.selection, self.config.cache.kv_dtype, self.dtype,
                               resident_layers=self.cache_resident_layers())

    def cache_capacity(self, tokens: int) -> int:
        """``tokens`` rounded up to a multiple of :data:`CAPACITY_ROUND` (not past the model's
        context unless ``tokens`` is): the decode kernels specialise on the capacity's block
        count, so calls of similar lengths share compiled kernels (docs/cuda_graphs.md)."""
        rounded = -(-tokens // CAPACITY_ROUND) * CAPACITY_ROUND
        return max(tokens, min(rounded, self.shape.max_positions))

    # ----------------------------------------------------------------- prefill
    def _step(self, phase: str, rows: torch.Tensor, q_pos: torch.Tensor, max_kv_len: int | None = None,
              live_len: int | None = None, row: int | None = None) -> StepInfo:
        cos, sin = self.model.rotary(q_pos, self.dtype)
        return StepInfo(phase=phase, rows=rows, q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=cos, sin=sin,
                        max_kv_len=max_kv_len, live_len=live_len, row=row)

    @torch.inference_mode()
    def prefill(self, cache, row: int, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run one prompt into cache row ``row``; logits ``[T or 1, V]`` fp32.

        ``prefill_chunk_tokens`` tokens at a time (design §3.8): chunk ``[start, end)``
        appends its K/V and attends to every key ``< end``, so the logits equal an
        unchunked prefill's; offloaded caches write each chunk to host memory (on CUDA on a
        side stream)."""
        outs = []
        with cache.chunked_prefill():
            for start, end in self.chunks(len(ids)):
                outs.append(self._chunk_forward(cache, row, ids, start, end, all_logits))
                if not all_logits:
                    outs = outs[-1:]
        return torch.cat(outs) if all_logits else outs[-1]

    def chunks(self, num_tokens: int) -> list[tuple[int, int]]:
        """The prefill chunks ``[(start, end), ...]`` of a prompt of ``num_tokens`` tokens:
        ``prefill_chunk_tokens`` each (the last one shorter), one if that is 0 (design §3.8)."""
        chunk = self.config.runtime.prefill_chunk_tokens or num_tokens
        return [(start, min(num_tokens, start + chunk)) for start in range(0, num_tokens, chunk)]

    @property
    def prefill_across_steps(self) -> bool:
        """Whether the engine may spread a prompt's :meth:`chunks` over its steps
        (:meth:`prefill_chunk`, decode steps of other rows between them): the method keeps no
        per-row state (``AttentionMethod.prefill_across_steps``) and the cache is not
        ``mixed`` (its hot pool is prefilled whole, design §6.1)."""
        return bool(self.method.prefill_across_steps and self.config.cache.kv_dtype != "mixed")

    def _chunk_forward(self, cache, row: int, ids: list[int], start: int, end: int,
                       all_logits: bool = False) -> torch.Tensor:
        x = torch.tensor([ids[start:end]], device=self.device)
        q_pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        step = self._step("prefill", torch.tensor([row], device=self.device), q_pos, end, row=row)
        return self.model(x, step, cache, self.method, all_logits=all_logits)[0]

    @torch.inference_mode()
    def prefill_chunk(self, cache, row: int, ids: list[int], start: int, end: int) -> torch.Tensor:
        """One of :meth:`chunks` of prompt ``ids`` into row ``row``, whose tokens ``< start``
        are already in the cache: appends tokens ``start .. end - 1`` and returns the last
        one's logits ``[1, V]`` fp32, equal to :meth:`prefill`'s when ``end = len(ids)``
        (the same chunks, the same order; an offloaded cache writes this chunk to host memory
        and reads the earlier ones back, :mod:`sparda.cache.chunked_prefill`)."""
        with cache.chunked_prefill():
            return self._chunk_forward(cache, row, ids, start, end)[-1:]

    def prefill_groups(self, cache, prompts: list[list[int]]) -> list[list[int]]:
        """Indices of ``prompts`` grouped for :meth:`prefill_batch`, in order: consecutive
        prompts share a forward while size x longest stays within ``prefill_batch_tokens``
        (design §3.8). A prompt longer than one chunk, a method or cache without batched
        prefill, or ``prefill_batch_tokens = 0`` gives groups of one."""
        budget, chunk = self.config.runtime.prefill_batch_tokens, self.config.runtime.prefill_chunk_tokens
        batched = budget and self.method.batched_prefill and cache.batched_prefill
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
        """Run several prompts into cache ``rows`` through one right-padded forward (design
        §3.8); each prompt's last-token logits ``[B, V]`` fp32, equal to its :meth:`prefill`
        alone up to summation order.

        Raises:
            SpardaError: not one distinct row per prompt, an empty prompt, a method or cache
                without batched prefill, or a longest prompt over one prefill chunk.
        """
        if len(rows) != len(prompts) or len(set(rows)) != len(rows):
            raise SpardaError(f"prefill_batch needs one distinct cache row per prompt, got rows {rows} for "
                              f"{len(prompts)} prompts")
        if any(not ids for ids in prompts):
            raise SpardaError("empty prompt; pass some text")
        if len(prompts) == 1:
            return self.prefill(cache, rows[0], prompts[0])[-1:]
        if not (self.method.batched_prefill and cache.batched_prefill):
            raise SpardaError(f"method {self.config.method} has no batched prefill; prefill its prompts one at a time")
        longest = max(len(ids) for ids in prompts)
        chunk = self.config.runtime.prefill_chunk_tokens
        if chunk and longest > chunk:
            raise SpardaError(f"a prompt of {longest} tokens exceeds one prefill chunk ({chunk}); prefill it alone")
        order = sorted(range(len(rows)), key=rows.__getitem__)  # ascending rows: a cache's whole-batch view
        rows, prompts = [rows[i] for i in order], [prompts[i] for i in order]
        x = torch.tensor([ids + [0] * (longest - len(ids)) for ids in prompts], device=self.device)
        q_pos = torch.arange(longest, device=self.device).expand(len(prompts), longest)
        cos, sin = self.model.rotary(q_pos, self.dtype)
        step = StepInfo(phase="prefill", rows=torch.tensor(rows, device=self.device), q_pos=q_pos,
                        kv_len=q_pos[:, -1] + 1, cos=cos, sin=sin, max_kv_len=longest,
                        row_lengths=tuple(zip(rows, (len(ids) for ids in prompts))))
        with cache.chunked_prefill():
            logits = self.model(x, step, cache, self.method)[:, 0]
        return logits[torch.tensor(order, device=logits.device).argsort()]  # the callers' order

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Next-token logits ``[T, V]`` fp32 at every position of ``ids`` (perplexity, agreement)."""
        cache = self.new_cache(1, len(ids))
        self.method.reset()
        return self.prefill(cache, 0, ids, all_logits=True)

    # ------------------------------------------------------------------ decode
    def decode_step(self, cache, tokens: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                    live_len: int) -> torch.Tensor:
        """The static-shape decode step (docs/cuda_graphs.md): ``tokens, positions [b]`` int64
        of rows ``rows = arange(b)``, the cache's first ``b`` rows (design §3.13) -> logits
        ``[b, V]`` fp32; views span the cache's capacity, per-row lengths mask the rest;
        ``live_len`` (host int, tokens) steers host-side branches only."""
        step = self._step("decode", rows, positions.view(-1, 1), cache.capacity, live_len)
        fused = self.fused_decoder()
        if fused is not None:
            return fused.forward(tokens.view(-1, 1), step, cache, self.method)[:, -1]
        return self.model(tokens.view(-1, 1), step, cache, self.method)[:, -1]

    def fused_decoder(self):
        """The :class:`~sparda.model.fused.FusedDecoder` on CUDA (built once), or ``None``:
        CPU, no Triton, ``fused_decode=False`` or a model the fused step does not cover."""
        if not self._fused_checked:
            self._fused_checked = True
            from sparda import kernels
            from sparda.model.fused import FusedDecoder

            if (self.config.runtime.fused_decode and self.device.type == "cuda" and kernels.HAS_TRITON
                    and FusedDecoder.supports(self.model)):
                with torch.inference_mode(False), torch.no_grad():
                    self._fused = FusedDecoder(self.model, self.method)
        return self._fused

    def runner(self, cache) -> DecodeRunner:
        """The :class:`~sparda.engine.graph_runner.DecodeRunner` of ``cache`` (one per cache)."""
        run = cache.decode_runner
        if run is None:
            run = cache.decode_runner = DecodeRunner(self, cache, self.config.runtime.cuda_graphs)
        return run

    @torch.inference_mode()
    def decode(self, cache, tokens: torch.Tensor, positions: torch.Tensor,
               max_position: int | None = None) -> torch.Tensor:
        """One decode step of the cache's first ``b`` rows: ``tokens [b]`` at ``positions [b]``
        -> fresh logits ``[b, V]`` fp32 (a replayed CUDA graph on CUDA, one per ``b``); rows
        ``b ..`` are not touched (design §3.13; the engine passes a bucket, every row by
        default). ``max_position`` (host int) avoids a sync."""
        if max_position is None:
            max_position = int(positions.max().item())
        run = self.runner(cache)
        run.load(tokens, positions)
        return run.step(max_position + 1, tokens.shape[0]).clone()

    def sync(self) -> None:
        """Wait for the device (host timings)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
