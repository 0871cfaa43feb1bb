"""Selection traces: record which KV blocks a real model selects, replay them at other shapes.

Random weights make a random selection at every step, so the offload runtime would see
an unrealistically low step-to-step block reuse (hit rate). A *trace* records, for every
decode step, row, layer and KV head, the block ids a real model selected (the bundled
SmolLM2-135M on the held-out Emma, teacher-forced), and the benchmark replays it at the
8B shapes.

File format (``.npz``, numpy, no pickles), one group of keys per selecting method
(``sparse``: the layer's own query; ``sparda``: the shipped Forecast):

* ``{method}.ids``: ``[S, R, L, H, K]`` int16 selected block ids, sorted, ``-1`` padded
  (S decode steps, R rows, L layers, H KV heads, K = budget blocks);
* ``{method}.pos``: ``[S, R]`` int64 position of each step's token;
* ``{method}.meta``: JSON string: block size, init/local/topk blocks, model, text.

Replay mapping (source ``s`` = trace, target ``t`` = benchmarked model), per target
step ``i``, row ``b``, layer ``l``, KV head ``h``:

* step: ping-pong over the trace (``0, 1, .., S-1, S-2, .., 1, 0, ..``; a reversed step
  has the same overlap as the forward one), starting at ``b * 7``;
* row ``(b + h // H_s) % R``, layer ``l * L_s // L_t``, head ``h % H_s``;
* blocks: forced blocks (``init`` sinks, ``local`` recent) follow the target position;
  each source top-k block at offset ``o`` of the source's non-forced range (width
  ``W_s``) becomes ``k = ceil(topk_t / topk_s)`` target blocks
  ``init_t + floor((o*k + j) * W_t / (W_s*k))``, ``j < k`` (the same relative place in
  the target's range of width ``W_t``); sub-blocks ``j`` are taken in order, ties by
  a fixed hash of the source block, up to ``topk_t``. A source block kept from one step
  to the next keeps its target blocks, so the top-k reuse of the trace is preserved.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sparda.errors import SpardaError
from sparda.io import atomic_output

FORMAT = "sparda-trace-v1"
#: the trace shipped with the package (recorded by :func:`record_traces` with defaults)
SHIPPED_TRACE = Path(__file__).with_name("traces") / "smollm2-emma.npz"


@dataclass
class SelectionTrace:
    """One method's recorded selection.

    Attributes:
        ids: ``[S, R, L, H, K]`` int16 block ids (sorted, ``-1`` padded).
        pos: ``[S, R]`` int64 token position of each step.
        meta: ``block_size``, ``init_blocks``, ``local_blocks``, ``topk_blocks`` (ints) and
            free-form fields (``model``, ``text``, ``method``).
    """

    ids: np.ndarray
    pos: np.ndarray
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ids.ndim != 5 or self.pos.shape != self.ids.shape[:2]:
            raise SpardaError(f"trace ids {self.ids.shape} / pos {self.pos.shape} are not [S,R,L,H,K] / [S,R]")
        for key in ("block_size", "init_blocks", "local_blocks", "topk_blocks"):
            if key not in self.meta:
                raise SpardaError(f"trace metadata lacks {key!r}; re-record the trace")


def save_traces(path: str | os.PathLike, traces: dict[str, SelectionTrace]) -> None:
    """Write traces (method -> trace) to ``path`` (npz), atomically."""
    arrays = {"format": np.array(FORMAT)}
    for name, tr in traces.items():
        arrays[f"{name}.ids"] = tr.ids.astype(np.int16)
        arrays[f"{name}.pos"] = tr.pos.astype(np.int64)
        arrays[f"{name}.meta"] = np.array(json.dumps(tr.meta))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as tmp, open(tmp, "wb") as handle:
        np.savez_compressed(handle, **arrays)


def load_traces(path: str | os.PathLike) -> dict[str, SelectionTrace]:
    """Read a trace file. Raises SpardaError if missing or not a sparda trace."""
    path = Path(path)
    if not path.is_file():
        raise SpardaError(f"trace file not found: {path}; record one with `sparda bench --record-trace FILE`")
    try:
        with np.load(path, allow_pickle=False) as data:
            if str(data.get("format", "")) != FORMAT:
                raise SpardaError(f"{path} is not a sparda selection trace (format {FORMAT})")
            names = sorted({k.rsplit(".", 1)[0] for k in data.files if k.endswith(".ids")})
            return {n: SelectionTrace(data[f"{n}.ids"], data[f"{n}.pos"], json.loads(str(data[f"{n}.meta"])))
                    for n in names}
    except (OSError, ValueError, KeyError) as exc:
        raise SpardaError(f"cannot read trace {path}: {exc}".splitlines()[0]) from exc


def trace_for(traces: dict[str, SelectionTrace], method: str) -> SelectionTrace:
    """The trace a method replays: ``sparda*`` the Forecast's, the others the query's."""
    want = "sparda" if method.startswith("sparda") else "sparse"
    if want in traces:
        return traces[want]
    return next(iter(traces.values()))


def reuse_stats(trace: SelectionTrace) -> dict[str, float]:
    """Step-to-step block reuse of a trace: the fraction of a step's selected blocks (the
    current block excluded) that the previous step also selected, i.e. the hit rate of a
    slot buffer holding exactly the previous selection. ``reuse`` over all such blocks,
    ``topk_reuse`` over the non-forced (top-k) blocks only. Fractions in [0, 1]."""
    m = trace.meta
    ids, pos = trace.ids.astype(np.int64), trace.pos
    cur = (pos // m["block_size"])[..., None, None, None]
    first_local = cur - m["local_blocks"] + 1
    kept = all_n = kept_k = all_k = 0
    for s in range(1, ids.shape[0]):
        now, before = ids[s], ids[s - 1]
        valid = (now >= 0) & (now != cur[s])
        hit = (now[..., :, None] == before[..., None, :]).any(-1) & valid
        topk = valid & (now >= m["init_blocks"]) & (now < first_local[s])
        kept += hit.sum(); all_n += valid.sum()
        kept_k += (hit & topk).sum(); all_k += topk.sum()
    return {"reuse": round(float(kept / max(all_n, 1)), 4), "topk_reuse": round(float(kept_k / max(all_k, 1)), 4)}


def _source_index(i: int, steps: int) -> int:
    if steps == 1:
        return 0
    period = 2 * (steps - 1)
    u = i % period
    return u if u < steps else period - u


def replay_masks(trace: SelectionTrace, num_layers: int, num_kv_heads: int, selection,
                 start_pos: list[int], steps: int, num_blocks: int, row_offset: int = 7) -> torch.Tensor:
    """Target block masks for ``steps`` decode steps replayed from ``trace`` (module doc).

    Args:
        selection: the target :class:`~sparda.config.SelectionConfig`.
        start_pos: per row, the position of the first replayed step's token.
        num_blocks: mask width ``N`` (blocks of the target cache).
        row_offset: row ``b`` starts at trace step ``b * row_offset`` (decorrelates rows).
    Returns:
        ``[steps, L, B, H, N]`` bool (CPU), forced blocks included.
    """
    m, cfg = trace.meta, selection
    S, R, Ls, Hs, _ = trace.ids.shape
    B = len(start_pos)
    k = max(1, math.ceil(cfg.topk_blocks / max(m["topk_blocks"], 1)))
    layers = np.arange(num_layers) * Ls // num_layers
    heads = np.arange(num_kv_heads) % Hs
    rows = (np.arange(B)[:, None] + np.arange(num_kv_heads)[None, :] // Hs) % R  # [B, H]
    out = np.zeros((steps, num_layers, B, num_kv_heads, num_blocks + 1), dtype=bool)
    j = np.arange(k)
    for i in range(steps):
        src = np.array([_source_index(i + row_offset * b, S) for b in range(B)])  # [B]
        ids = trace.ids[src[:, None, None], rows[:, :, None], layers[None, None, :], heads[None, :, None]]
        ids = ids.astype(np.int64).transpose(2, 0, 1, 3)  # [L, B, H, K]
        cur_s = trace.pos[src[:, None], rows] // m["block_size"]  # [B, H]
        w_s = np.maximum(cur_s - m["local_blocks"] + 1 - m["init_blocks"], 1)[None, :, :, None]
        pos_t = np.asarray(start_pos) + i
        cur_t = pos_t // cfg.block_size  # [B]
        w_t = (cur_t - cfg.local_blocks + 1 - cfg.init_blocks)[None, :, None, None, None]
        off = ids - m["init_blocks"]
        ok = (ids >= 0) & (off >= 0) & (off < w_s)
        tgt = cfg.init_blocks + ((off[..., None] * k + j) * w_t) // (w_s[..., None] * k)  # [L,B,H,K,k]
        prio = j * 65536 + (ids[..., None] * 40503) % 65536
        prio = np.where(ok[..., None] & (tgt < cfg.init_blocks + w_t), prio, np.iinfo(np.int64).max)
        flat_t, flat_p = tgt.reshape(*tgt.shape[:3], -1), prio.reshape(*prio.shape[:3], -1)
        order = np.argsort(flat_p, axis=-1, kind="stable")[..., :cfg.topk_blocks]
        chosen = np.take_along_axis(flat_t, order, -1)
        valid = np.take_along_axis(flat_p, order, -1) < np.iinfo(np.int64).max
        np.put_along_axis(out[i], np.where(valid, np.clip(chosen, 0, num_blocks - 1), num_blocks), True, -1)
        for b in range(B):
            c = int(cur_t[b])
            if c + 1 <= cfg.budget_blocks:  # the budget covers every block (design §3.6)
                out[i, :, b, :, :c + 1] = True
                continue
            out[i, :, b, :, :cfg.init_blocks] = True
            out[i, :, b, :, max(0, c - cfg.local_blocks + 1):c + 1] = True
    return torch.from_numpy(out[..., :num_blocks])


def synthetic_prefill_mask(num_kv_heads: int, selection, num_keys: int, num_queries: int, num_blocks: int,
                           keep: float, seed: int = 0) -> torch.Tensor:
    """Prefill masks of the last ``num_queries`` tokens of ``num_keys`` whose neighbouring tokens
    keep ``keep`` of their top-k (:func:`synthetic_masks`, consecutive tokens taken as decode
    steps): ``[1, H, num_queries, num_blocks]`` bool (CPU). Real selections keep most of their
    top-k from one token to the next, random weights almost none (design §3.5).

    Raises:
        SpardaError: ``keep`` outside ``[0, 1]``.
    """
    masks = synthetic_masks(1, num_kv_heads, selection, [num_keys - num_queries], num_queries, num_blocks, keep,
                            seed=seed)
    return masks[:, 0, 0, :, :num_blocks].permute(1, 0, 2).unsqueeze(0).contiguous()


def synthetic_masks(num_layers: int, num_kv_heads: int, selection, start_pos: list[int], steps: int,
                    num_blocks: int, hit_rate: float, seed: int = 0) -> torch.Tensor:
    """Block masks with a chosen step-to-step reuse, for the bench's ``--hit-rate`` sweep.

    Per (layer, row, KV head) the forced blocks (sinks and the local window, design §3.4)
    plus ``topk_blocks`` others: at the first step drawn uniformly from the valid
    non-forced blocks, then at each step a fraction ``hit_rate`` of the previous step's
    top-k blocks is kept (``round(hit_rate * k)``, a random subset) and the rest is
    redrawn uniformly among the non-forced blocks not kept (seeded). Kept blocks are hits
    of the slot cache; the forced blocks hit too (except the block entering the local
    window), so the measured hit rate lies above ``hit_rate``. Contexts whose blocks fit
    the budget select every block (the dense fallback).

    Args:
        start_pos: per row, the position of the first step's token. num_blocks: mask width.
        hit_rate: in ``[0, 1]``.
    Returns:
        ``[steps, L, B, H, N]`` bool (CPU).
    Raises:
        SpardaError: ``hit_rate`` outside ``[0, 1]``.
    """
    from sparda.errors import SpardaError

    if not 0.0 <= hit_rate <= 1.0:
        raise SpardaError(f"--hit-rate must lie in [0, 1], got {hit_rate}")
    cfg = selection
    rng = np.random.default_rng(seed)
    b = len(start_pos)
    rows = num_layers * b * num_kv_heads
    k = cfg.topk_blocks
    keep = int(round(hit_rate * k))
    out = np.zeros((steps, num_layers, b, num_kv_heads, num_blocks + 1), dtype=bool)
    lo = cfg.init_blocks
    prev = None
    for i in range(steps):
        cur = (np.asarray(start_pos) + i) // cfg.block_size  # [B]
        hi = np.repeat(np.maximum(cur - cfg.local_blocks + 1, lo + 1), num_kv_heads)  # exclusive, per (B, H)
        hi = np.tile(hi, num_layers)  # [rows], layer-major like the reshape below
        fresh = lo + (rng.random((rows, k)) * (hi - lo)[:, None]).astype(np.int64)
        if prev is None:
            chosen = fresh
        else:
            order = np.argsort(rng.random((rows, k)), axis=1)
            kept = np.take_along_axis(prev, order, 1)[:, :keep]
            chosen = np.concatenate([kept, fresh[:, keep:]], 1)
        for _ in range(64):  # redraw the later of two equal blocks (kept ones come first)
            srt = np.sort(chosen, 1)
            dup = np.zeros_like(chosen, dtype=bool)
            for r_idx in np.nonzero((srt[:, 1:] == srt[:, :-1]).any(1))[0]:
                _, first = np.unique(chosen[r_idx], return_index=True)
                dup[r_idx] = True
                dup[r_idx, first] = False
            if not dup.any():
                break
            redraw = lo + (rng.random(chosen.shape) * (hi - lo)[:, None]).astype(np.int64)
            chosen = np.where(dup, redraw, chosen)
        prev = chosen
        view = out[i].reshape(rows, num_blocks + 1)
        np.put_along_axis(view, np.clip(prev, 0, num_blocks), True, 1)
        for r in range(b):
            c = int(cur[r])
            if c + 1 <= cfg.budget_blocks:
                out[i, :, r, :, :c + 1] = True
                continue
            out[i, :, r, :, :cfg.init_blocks] = True
            out[i, :, r, :, max(0, c - cfg.local_blocks + 1):c + 1] = True
    return torch.from_numpy(out[..., :num_blocks])


class Replayer:
    """Replaces the blocks an offloaded cache fetches by replayed ones.

    :meth:`install` wraps ``cache.fetch`` of an :class:`~sparda.cache.offload.OffloadKVCache`
    (the one place where a selection turns into copies and into the slots attention
    reads); the benchmark sets :attr:`step` before each decode step. The method still
    computes its own selection (its cost is measured); only the blocks used change.

    Args: ``masks`` ``[steps, L, B, H, N]`` bool on the cache's device (:func:`replay_masks`);
    :meth:`install` turns them into block ids of the cache's slot width once (and drops them).
    """

    def __init__(self, masks: torch.Tensor) -> None:
        self.masks = masks
        self.ids: torch.Tensor | None = None
        #: ``[1]`` int64 on the masks' device: the replayed step (device-side, so that a
        #: captured CUDA graph of the decode step reads the current one on every replay)
        self.index = torch.zeros(1, dtype=torch.long, device=masks.device)

    @property
    def step(self) -> int:
        """The replayed step (reads the device index: one host sync)."""
        return int(self.index.item())

    @step.setter
    def step(self, value: int) -> None:
        self.index.fill_(int(value))

    def install(self, cache) -> None:
        """Wrap ``cache.fetch`` (instance attribute; the class is untouched)."""
        from sparda.kernels.reference import block_mask_to_indices

        width = min(cache.select_width, self.masks.shape[-1])
        self.ids = torch.stack([block_mask_to_indices(m, width).to(torch.int32) for m in self.masks])
        self.masks = None
        original = cache.fetch

        def fetch(layer, selection, pos, prefetch=False, counters=None):
            chosen = self.ids.index_select(0, self.index)[0, layer]
            return original(layer, chosen, pos, prefetch, counters)

        cache.fetch = fetch


def _masks_to_ids(masks: list[torch.Tensor], width: int) -> np.ndarray:
    """Per-layer decode masks ``[B, H, N]`` -> ids ``[B, L, H, width]`` int16."""
    from sparda.kernels.reference import block_mask_to_indices

    ids = [block_mask_to_indices(m, width) for m in masks]  # each [B, H, width]
    return torch.stack(ids, 1).to(torch.int16).cpu().numpy()


def record_selection(model, seqs: list[list[int]], prompt_tokens: int, steps: int,
                     methods=("sparse", "sparda"), preset: str = "small", forecast=None,
                     meta: dict | None = None, **overrides) -> dict[str, SelectionTrace]:
    """Record the decode selections of ``model`` (a CausalLM) on token sequences.

    Each sequence's first ``prompt_tokens`` tokens are prefilled densely once (one cache
    row per sequence); then every method decodes ``steps`` teacher-forced steps (the
    sequence's next tokens) from a copy of that cache, and the block mask each layer
    attends over is captured (``sparda``: the Forecast's prediction made in the previous
    layer; ``sparse``: the layer's own query).

    Args:
        seqs: ``R`` token id lists of at least ``prompt_tokens + steps`` tokens.
        forecast: the :class:`Forecast` for ``sparda*`` methods.
        overrides: selection fields on top of ``preset``.
    Returns: method -> :class:`SelectionTrace`.
    Raises: SpardaError if a sequence is too short or the context stays under the dense fallback.
    """
    import copy

    from sparda.engine.llm import LLM

    if any(len(s) < prompt_tokens + steps for s in seqs):
        raise SpardaError(f"every sequence needs {prompt_tokens + steps} tokens; use fewer steps")
    rows = len(seqs)
    base = LLM.from_model(model, method="dense", preset=preset, **overrides)
    cache = base.new_cache(rows, prompt_tokens + steps)
    for r, seq in enumerate(seqs):
        base.prefill(cache, r, seq[:prompt_tokens])
    out = {}
    for name in methods:
        extra = {"forecast": forecast} if name.startswith("sparda") else {}
        llm = LLM.from_model(model, method=name, preset=preset, **extra, **overrides)
        cfg = llm.config.selection
        method, run_cache = llm.method, copy.deepcopy(cache)
        captured: dict[int, torch.Tensor] = {}
        select = method.select

        def capture(layer, q, h, c, step, first=0, _select=select, _into=captured):
            mask = _select(layer, q, h, c, step, first)
            if step.phase == "decode":
                _into[layer] = mask[..., -1, :]
            return mask

        method.select = capture
        method.reset()
        all_ids = []
        for s in range(steps):
            tokens = torch.tensor([seq[prompt_tokens + s] for seq in seqs], device=llm.device)
            pos = torch.full((rows,), prompt_tokens + s, device=llm.device)
            captured.clear()
            llm.decode(run_cache, tokens, pos, prompt_tokens + s)
            if len(captured) != llm.shape.num_layers:
                raise SpardaError(f"method {name} selected in {len(captured)} of {llm.shape.num_layers} layers; "
                                  "use a prompt longer than dense_len and the budget")
            all_ids.append(_masks_to_ids([captured[l] for l in range(llm.shape.num_layers)], cfg.budget_blocks))
        info = dict(block_size=cfg.block_size, init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks,
                    topk_blocks=cfg.topk_blocks, method=name, prompt_tokens=prompt_tokens, **(meta or {}))
        pos = np.repeat((prompt_tokens + np.arange(steps))[:, None], rows, 1).astype(np.int64)
        out[name] = SelectionTrace(np.stack(all_ids), pos, info)
    return out


def record_traces(rows: int = 4, prompt_tokens: int = 4096, steps: int = 64, device: str = "cpu",
                  methods=("sparse", "sparda")) -> dict[str, SelectionTrace]:
    """:func:`record_selection` of the bundled SmolLM2-135M (real weights, shipped Forecast)
    on ``rows`` evenly spaced excerpts of the held-out Emma, ``small`` preset.

    ``prompt_tokens`` and ``steps`` (decoded tokens) are token counts.

    Raises:
        SpardaError: Emma is too short for ``rows x (prompt_tokens + steps)`` tokens, no
            shipped Forecast for a ``sparda*`` method, or the model fails to load.
    """
    from sparda.attention.forecast import load_forecast, shipped_path
    from sparda.data import heldout_text
    from sparda.model.loader import load_model, shipped_name

    model, tokenizer, model_dir = load_model(None, torch.device(device), torch.float32)
    ids = tokenizer.encode(heldout_text())
    need = prompt_tokens + steps
    if len(ids) < rows * need:
        raise SpardaError(f"Emma has {len(ids)} tokens, too few for {rows} x {need}; use fewer rows")
    span = len(ids) // rows
    seqs = [ids[r * span: r * span + need] for r in range(rows)]
    forecast = None
    if any(m.startswith("sparda") for m in methods):
        path = shipped_path(shipped_name(model_dir))
        if path is None:
            raise SpardaError("no shipped Forecast weights for the bundled model; record only sparse")
        forecast = load_forecast(path, model.config, model.shape)[0]
    return record_selection(model, seqs, prompt_tokens, steps, methods, "small", forecast,
                            meta=dict(model="SmolLM2-135M-Instruct", text="emma (held out)"))
