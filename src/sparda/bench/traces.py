"""Selection traces: the blocks a real model selects, recorded and replayed at other shapes
(docs/bench.md, Realistic selection: trace replay).

File (``.npz``, no pickles), per method (``sparse``, ``sparda``): ``{method}.ids`` ``[S, R,
L, H, K]`` int16 sorted block ids, ``-1`` padded (steps, rows, layers, KV heads, budget
blocks); ``{method}.pos`` ``[S, R]`` int64 positions; ``{method}.meta`` JSON (block size,
init/local/topk blocks, model, text).
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
    """One method's recorded selection: ``ids [S, R, L, H, K]`` int16, ``pos [S, R]`` int64,
    ``meta`` (``block_size``, ``init_blocks``, ``local_blocks``, ``topk_blocks``, free-form fields)."""

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
    """Step-to-step reuse of a trace, fractions 0-1: of a step's selected blocks (current block
    excluded) those the previous step selected, over all (``reuse``) or top-k blocks (``topk_reuse``)."""
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
    """Target block masks of ``steps`` decode steps replayed from ``trace`` (docs/bench.md).

    Args:
        selection: the target config. start_pos: per row, the first step's position (tokens).
        num_blocks: ``N``. row_offset: row ``b`` starts at trace step ``b * row_offset``.
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
    """``[1, H, num_queries, num_blocks]`` bool (CPU) prefill masks of the last ``num_queries`` of
    ``num_keys`` tokens whose neighbours keep ``keep`` of their top-k (design §3.5). Raises
    SpardaError for ``keep`` outside [0, 1]."""
    masks = synthetic_masks(1, num_kv_heads, selection, [num_keys - num_queries], num_queries, num_blocks, keep,
                            seed=seed)
    return masks[:, 0, 0, :, :num_blocks].permute(1, 0, 2).unsqueeze(0).contiguous()


def synthetic_masks(num_layers: int, num_kv_heads: int, selection, start_pos: list[int], steps: int,
                    num_blocks: int, hit_rate: float, seed: int = 0) -> torch.Tensor:
    """Block masks with step-to-step top-k reuse ``hit_rate`` (``--hit-rate``): forced blocks
    (design §3.4) plus ``topk_blocks`` others, ``round(hit_rate * k)`` kept per step, the rest
    redrawn uniformly (seeded); forced blocks hit too, so the measured hit rate is higher.

    Returns:
        ``[steps, L, B, H, N]`` bool (CPU).
    Raises:
        SpardaError: ``hit_rate`` outside [0, 1].
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


#: the two-ahead prediction's measured recall of the one-layer Forecast's free top-k, held-out
#: Emma, layers 2-29 of the bundled model (docs/forecast.md, Two-ahead heads): ``--lookahead-recall``
LOOKAHEAD2_RECALL = 0.79


def two_ahead_ids(ids: torch.Tensor, selection, start_pos: list[int], recall: float, seed: int = 0) -> torch.Tensor:
    """Modelled two-ahead predictions (design §6.2) of replayed selections, for ``--lookahead 2``
    (docs/bench.md): each selection's forced blocks (design §3.4), each of its other blocks kept
    with probability ``recall`` and the rest replaced by distinct blocks of the non-forced range
    outside the selection, drawn uniformly (independent across steps, layers, rows and heads;
    seeded). Where the range holds no such block, the prediction is that much shorter.

    Args:
        ids: ``[steps, L, B, H, W]`` int32 ascending block ids, ``-1`` padded (as :meth:`Replayer.install`
            makes them); step ``i`` of row ``b`` is at position ``start_pos[b] + i``.
        recall: in [0, 1].
    Returns:
        ``[steps, L, B, H, W]`` int32 on ``ids``' device, ascending, ``-1`` padded, unique per row.
    Raises:
        SpardaError: ``recall`` outside [0, 1].
    """
    if not 0.0 <= recall <= 1.0:
        raise SpardaError(f"--lookahead-recall must lie in [0, 1], got {recall}")
    cfg = selection
    final = ids.cpu().numpy().astype(np.int64)
    steps, width = final.shape[0], final.shape[-1]
    cur = (np.asarray(start_pos)[None, :] + np.arange(steps)[:, None]) // cfg.block_size  # [steps, B]
    hi = np.broadcast_to((cur - cfg.local_blocks)[:, None, :, None, None], final.shape)  # top of the free range
    lo = cfg.init_blocks
    rng = np.random.default_rng(seed)
    drop = (final >= lo) & (final <= hi) & (rng.random(final.shape) >= recall)
    span = np.maximum(hi - lo + 1, 1)
    key = int(max(final.max(), hi.max())) + 2  # row * key + block: one sorted key space for all rows
    row = np.arange(final.size // width).reshape(final.shape[:-1])[..., None] * key
    given = (row + final)[final >= 0]  # ascending: rows in order, ids ascending within a row
    out, todo = final.copy(), drop.copy()
    for _ in range(64):
        if not todo.any():
            break
        out[todo] = lo + (rng.random(int(todo.sum())) * span[todo]).astype(np.int64)
        cand = (row + out)[drop]
        at = np.minimum(np.searchsorted(given, cand), given.size - 1)
        bad = given[at] == cand  # a block of the selection itself
        _, first = np.unique(cand, return_index=True)
        again = np.ones(cand.size, dtype=bool)
        again[first] = False  # a block drawn twice in one row
        todo = np.zeros_like(drop)
        todo[drop] = bad | again
    out[todo] = -1
    big = np.iinfo(np.int64).max
    out = np.sort(np.where(out < 0, big, out), axis=-1)
    return torch.from_numpy(np.where(out == big, -1, out).astype(np.int32)).to(ids.device)


class Replayer:
    """Replace the blocks an offloaded cache fetches by replayed ones (``masks [steps, L, B, H, N]``
    bool, :func:`replay_masks`); the method's own selection still runs. Set :attr:`step` per step.
    With :meth:`predict_two_ahead`, the cache's early copies (``--lookahead 2``) get modelled
    predictions of the replayed selections (:func:`two_ahead_ids`)."""

    def __init__(self, masks: torch.Tensor) -> None:
        self.masks = masks
        self.ids: torch.Tensor | None = None
        self.early: torch.Tensor | None = None
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
            chosen = self.ids.index_select(0, self.index)[0, layer, :pos.shape[0]]  # the step's rows
            return original(layer, chosen, pos, prefetch, counters)

        cache.fetch = fetch

    def predict_two_ahead(self, cache, selection, start_pos: list[int], recall: float, seed: int = 0) -> None:
        """Model the early copies' predictions of the installed ids with ``recall``
        (:func:`two_ahead_ids`; again after :attr:`ids` changed) and, the first time, wrap
        ``cache.warm`` to use them. Raises SpardaError for ``recall`` outside [0, 1]."""
        early = two_ahead_ids(self.ids, selection, start_pos, recall, seed)
        if self.early is not None:
            self.early.copy_(early)  # in place: a captured CUDA graph reads this buffer
            return
        self.early = early
        original = cache.warm

        def warm(layer, selection, pos):
            return original(layer, self.early.index_select(0, self.index)[0, layer, :pos.shape[0]], pos)  # the step's rows

        cache.warm = warm


def _masks_to_ids(masks: list[torch.Tensor], width: int) -> np.ndarray:
    """Per-layer decode masks ``[B, H, N]`` -> ids ``[B, L, H, width]`` int16."""
    from sparda.kernels.reference import block_mask_to_indices

    ids = [block_mask_to_indices(m, width) for m in masks]  # each [B, H, width]
    return torch.stack(ids, 1).to(torch.int16).cpu().numpy()


def record_selection(model, seqs: list[list[int]], prompt_tokens: int, steps: int,
                     methods=("sparse", "sparda"), preset: str = "small", forecast=None,
                     meta: dict | None = None, **overrides) -> dict[str, SelectionTrace]:
    """Record the decode selections of ``model`` on token sequences ``seqs`` (each at least
    ``prompt_tokens + steps`` tokens): dense prefill, then ``steps`` teacher-forced decode steps
    per method. Returns method -> :class:`SelectionTrace`.

    Raises:
        SpardaError: a sequence too short, or a context under the dense fallback.
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
    """:func:`record_selection` of the bundled model (shipped Forecast) on ``rows`` excerpts of Emma,
    ``small`` preset; ``prompt_tokens`` and ``steps`` are token counts.

    Raises:
        SpardaError: Emma too short, no shipped Forecast, or the model fails to load.
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
