"""Selection traces: the blocks a real model selects, recorded and replayed at other shapes
(docs/bench.md, Realistic selection: trace replay).

File (``.npz``, no pickles), per method (``sparse``, ``sparda``): ``{method}.ids`` ``[S, R,
L, H, K]`` int16 sorted block ids, ``-1`` padded (steps, rows, layers, KV heads, budget
blocks); ``{method}.pos`` ``[S, R]`` int64 positions; ``{method}.meta`` JSON (block size,
init/local/topk blocks, model, text); optionally ``{method}.early`` (``sparda``): as ``ids``,
the two-ahead heads' prediction of each layer's blocks made two layers before it (design
§6.2), all ``-1`` at layers 0 and 1.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from sparda.errors import SpardaError
from sparda.io import atomic_output

FORMAT = "sparda-trace-v1"
#: the refusal of a replay of recorded two-ahead predictions from a trace without them
NO_PREDICTIONS = "this trace holds no two-ahead predictions; re-record it with `sparda bench --record-trace`"
#: the trace shipped with the package (recorded by :func:`record_traces` with defaults)
SHIPPED_TRACE = Path(__file__).with_name("traces") / "smollm2-emma.npz"


@dataclass
class SelectionTrace:
    """One method's recorded selection: ``ids [S, R, L, H, K]`` int16, ``pos [S, R]`` int64,
    ``meta`` (``block_size``, ``init_blocks``, ``local_blocks``, ``topk_blocks``, free-form fields),
    ``early`` ``[S, R, L, H, K]`` int16 or ``None``: the two-ahead prediction of each layer's
    blocks (design §6.2; ``-1`` rows where no head predicts that layer)."""

    ids: np.ndarray
    pos: np.ndarray
    meta: dict = field(default_factory=dict)
    early: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.ids.ndim != 5 or self.pos.shape != self.ids.shape[:2]:
            raise SpardaError(f"trace ids {self.ids.shape} / pos {self.pos.shape} are not [S,R,L,H,K] / [S,R]")
        if self.early is not None and self.early.shape != self.ids.shape:
            raise SpardaError(f"trace early predictions {self.early.shape} do not match its ids {self.ids.shape}")
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
        if tr.early is not None:
            arrays[f"{name}.early"] = tr.early.astype(np.int16)
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
            return {n: SelectionTrace(data[f"{n}.ids"], data[f"{n}.pos"], json.loads(str(data[f"{n}.meta"])),
                                      data[f"{n}.early"] if f"{n}.early" in data.files else None)
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
        hit = _member(now, before) & valid
        topk = valid & (now >= m["init_blocks"]) & (now < first_local[s])
        kept += hit.sum(); all_n += valid.sum()
        kept_k += (hit & topk).sum(); all_k += topk.sum()
    out = {"reuse": round(float(kept / max(all_n, 1)), 4), "topk_reuse": round(float(kept_k / max(all_k, 1)), 4)}
    if trace.early is not None:
        out.update(two_ahead_stats(trace))
    return out


def _member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a [..., K]`` ids: which are among ``b [..., K2]``'s (``-1`` never matches)."""
    return (a[..., :, None] == b[..., None, :]).any(-1) & (a >= 0)


def two_ahead_stats(trace: SelectionTrace) -> dict[str, float]:
    """How a trace's recorded two-ahead predictions (``early``, design §6.2) would copy, over the
    top-k (free) blocks of steps ``1 ..`` and the layers that have a prediction; fractions 0-1:

    * ``early_recall``: of the selection's blocks, those its prediction holds;
    * ``fresh``: of the selection's blocks, those the previous step held in neither its selection
      nor its prediction (what lookahead 2 has to copy anew this step, slots' memory aside);
    * ``early_fresh``: of the prediction's blocks, those the previous step held in neither (the
      early copies per predicted block);
    * ``early_saved``: of the selection's fresh blocks, those the prediction holds (the misses an
      early copy takes off the one-layer copy);
    * ``early_wasted_persist``: of the prediction's blocks outside the selection, those it also
      predicted, outside the selection, the step before (its errors' persistence: a persistent
      wrong block is copied once, an independent one every step).
    """
    m = trace.meta
    ids, early, pos = trace.ids.astype(np.int64), trace.early.astype(np.int64), trace.pos
    has = (early >= 0).any((0, 1, 3, 4))  # [L] layers with a prediction
    ids, early = ids[:, :, has], early[:, :, has]
    top = pos // m["block_size"] - m["local_blocks"]  # [S, R]: the free range is [init_blocks, top]
    lo = m["init_blocks"]

    def free(x, s):
        return (x >= lo) & (x <= top[s][:, None, None, None])

    sums = dict.fromkeys(("sel", "rec", "fresh", "pred", "efresh", "fresh_saved", "wrong", "wrong_kept"), 0)
    for s in range(1, ids.shape[0]):
        sel, pred, sel0, pred0 = ids[s], early[s], ids[s - 1], early[s - 1]
        fs, fp = free(sel, s) & (sel >= 0), free(pred, s) & (pred >= 0)
        held = np.concatenate([sel0, pred0], -1)
        fresh = fs & ~_member(sel, held)
        wrong, wrong0 = fp & ~_member(pred, sel), ~_member(pred0, sel0) & (pred0 >= 0)
        sums["sel"] += fs.sum(); sums["rec"] += (fs & _member(sel, pred)).sum()
        sums["fresh"] += fresh.sum(); sums["fresh_saved"] += (fresh & _member(sel, pred)).sum()
        sums["pred"] += fp.sum(); sums["efresh"] += (fp & ~_member(pred, held)).sum()
        sums["wrong"] += wrong.sum()
        sums["wrong_kept"] += (wrong & _member(pred, np.where(wrong0, pred0, -1))).sum()

    def ratio(a, b):
        return round(float(sums[a] / max(sums[b], 1)), 4)

    return {"early_recall": ratio("rec", "sel"), "fresh": ratio("fresh", "sel"),
            "early_fresh": ratio("efresh", "pred"), "early_saved": ratio("fresh_saved", "fresh"),
            "early_wasted_persist": ratio("wrong_kept", "wrong")}


def _source_index(i: int, steps: int) -> int:
    if steps == 1:
        return 0
    period = 2 * (steps - 1)
    u = i % period
    return u if u < steps else period - u


def replay_masks(trace: SelectionTrace, num_layers: int, num_kv_heads: int, selection,
                 start_pos: list[int], steps: int, num_blocks: int, row_offset: int = 7,
                 first_row: int = 0, early: bool = False) -> torch.Tensor:
    """Target block masks of ``steps`` decode steps replayed from ``trace`` (docs/bench.md).

    Args:
        selection: the target config. start_pos: per row, the first step's position (tokens).
        num_blocks: ``N``. row_offset: row ``b`` starts at trace step ``b * row_offset``.
        first_row: the rows are rows ``first_row ..`` of a larger batch (its row ``first_row + b``
            is this call's row ``b``: the same trace row and step offset).
        early: replay the trace's two-ahead predictions (:attr:`SelectionTrace.early`) instead of
            its selections, mapped alike: a block both hold maps to the same target blocks (the cut
            to ``topk_blocks`` depends on the set, so a few may survive in one and not the other). A
            target layer whose source layer has no prediction (layers 0 and 1) takes the first
            source layer that has one (lookahead 2 warms every target layer from 2).
    Returns:
        ``[steps, L, B, H, N]`` bool (CPU), forced blocks included.
    Raises:
        SpardaError: ``early`` on a trace without predictions.
    """
    m, cfg = trace.meta, selection
    if early and trace.early is None:
        raise SpardaError(NO_PREDICTIONS)
    source = trace.early if early else trace.ids
    S, R, Ls, Hs, _ = source.shape
    B = len(start_pos)
    k = max(1, math.ceil(cfg.topk_blocks / max(m["topk_blocks"], 1)))
    layers = np.arange(num_layers) * Ls // num_layers
    if early:  # a target layer whose source layer has no head (0, 1) takes the first that has one
        has = np.nonzero((source >= 0).any((0, 1, 3, 4)))[0]
        layers = np.maximum(layers, has[0] if has.size else 0)
    heads = np.arange(num_kv_heads) % Hs
    rows = (first_row + np.arange(B)[:, None] + np.arange(num_kv_heads)[None, :] // Hs) % R  # [B, H]
    out = np.zeros((steps, num_layers, B, num_kv_heads, num_blocks + 1), dtype=bool)
    j = np.arange(k)
    for i in range(steps):
        src = np.array([_source_index(i + row_offset * (first_row + b), S) for b in range(B)])  # [B]
        ids = source[src[:, None, None], rows[:, :, None], layers[None, None, :], heads[None, :, None]]
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


def replay_ids(masks: torch.Tensor, width: int) -> torch.Tensor:
    """``[steps, L, B, H, N]`` bool block masks -> ``[steps, L, B, H, width]`` int32 ascending ids,
    ``-1`` padded (:func:`sparda.kernels.reference.block_mask_to_indices` per step)."""
    from sparda.kernels.reference import block_mask_to_indices

    return torch.stack([block_mask_to_indices(m, width).to(torch.int32) for m in masks])


class Replayer:
    """Replace the blocks an offloaded cache fetches by replayed ones (``masks [steps, L, B, H, N]``
    bool, :func:`replay_masks`); the method's own selection still runs. Set :attr:`step` per step.
    With :meth:`predict_two_ahead`, the cache's early copies (``--lookahead 2``) get modelled
    predictions of the replayed selections (:func:`two_ahead_ids`); with :meth:`replay_two_ahead`
    replayed ones (a trace's recorded predictions, :func:`replay_masks` with ``early=True``)."""

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
        self.ids = replay_ids(self.masks, min(cache.select_width, self.masks.shape[-1]))
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
        self._set_early(cache, two_ahead_ids(self.ids, selection, start_pos, recall, seed))

    def replay_two_ahead(self, cache, masks: torch.Tensor) -> None:
        """The early copies get the predictions ``masks [steps, L, B, H, N]`` bool (as the
        constructor's; :func:`replay_masks` with ``early=True``), cut to the installed width."""
        self._set_early(cache, replay_ids(masks, self.ids.shape[-1]))

    def _set_early(self, cache, early: torch.Tensor) -> None:
        """Install ``early`` ``[steps, L, B, H, W]`` int32 ids as the early copies' predictions."""
        if self.early is not None:
            self.early.copy_(early)  # in place: a captured CUDA graph reads this buffer
            return
        self.early = early
        original = cache.warm

        def warm(layer, selection, pos):
            return original(layer, self.early.index_select(0, self.index)[0, layer, :pos.shape[0]], pos)  # the step's rows

        cache.warm = warm


def replay_period(trace: SelectionTrace) -> int:
    """Steps of one cycle of :func:`replay_masks` over ``trace``: its ``S`` steps forth and back,
    ``2 (S - 1)`` (1 for a one-step trace)."""
    return max(1, 2 * (trace.ids.shape[0] - 1))


def mask_ids(mask: np.ndarray, width: int, dtype=np.int32) -> np.ndarray:
    """Bool ``[..., N]`` -> ascending ids ``[..., width]`` of ``dtype``, ``-1`` padded, the lowest
    ``width`` kept: :func:`sparda.kernels.reference.block_mask_to_indices` in numpy, O(selected)."""
    flat = mask.reshape(-1, mask.shape[-1])
    out = np.full((flat.shape[0], width), -1, dtype=dtype)
    row, col = np.nonzero(flat)  # row-major: ascending columns within a row
    rank = np.arange(row.size) - np.searchsorted(row, row)
    keep = rank < width
    out[row[keep], rank[keep]] = col[keep]
    return out.reshape(*mask.shape[:-1], width)


class RowReplayer:
    """The serving engine's trace replay (benchmarks only; docs/bench.md, Trace replay in the
    server benchmark): the blocks an offloaded cache fetches for each decoding row are replaced by
    a replayed selection of that row's own request; the method's own selection still runs.

    When a request starts decoding on row ``r`` at position ``p`` (:meth:`on_decode_start`: its
    first decode step, again after a recompute), the row gets one full cycle of the trace
    (:func:`replay_period` steps) from :func:`replay_masks` at positions ``p ..`` as row
    ``first_row = k`` of a bench batch (its trace row and step offset ``row_offset * k``), ``k``
    a hash of the request id (:meth:`request_key`): a request replays the same ids alone or in a
    busy batch, and requests mostly differ in trace row and phase. A row's step counter advances
    once per decode step it runs and wraps at the cycle's end. Within a cycle the ids are
    bench's at the same positions; the cycle then repeats, so the step-to-step reuse stays the
    trace's, while the forced blocks stay those of ``p .. p + period - 1`` and the top-k mapping
    that of ``p``: over 1K decode steps at 128K that is a drift of 16 blocks of 2,048 (under 1 %
    of the range the top-k maps onto), so the replayed traffic is bench's at ``p``.

    Memory: :attr:`ids` ``[rows, period, L, H, W]`` on the cache's device, int16 (int32 past
    32,767 blocks), ``W`` the cache's ``select_width``; MiniCPM-8B at 128K, paper preset, 16 rows:
    16 x 126 x 32 x 2 x 128 x 2 B = 33 MB; with lookahead 2 (``recall``) :attr:`early`, as much
    again. Host: up to ``cached`` recent tables (2 MB each there), keyed by ``(p, k)``.

    CUDA graphs: the wrapped ``fetch`` (and ``warm``) only gather from device tensors
    (:attr:`ids`, :attr:`step` ``[rows]`` int64, :attr:`active` ``[rows]`` bool), which are
    updated in place between steps (:meth:`before_decode_step`, :meth:`after_decode_step`),
    so a captured decode graph reads the current ones on every replay; no host sync, no branch
    on a device value. Rows that do not decode (free, padding, half-prefilled) pass on
    the method's own selection, which an engine's cache then drops (design §3.13).

    Args:
        trace: the selection trace (:func:`trace_for` of the engine's method).
        cache: the engine's offloaded cache (its ``fetch`` is wrapped here).
        row_offset: as :func:`replay_masks`. recall: lookahead 2 only: also wrap ``warm``, whose
            early copies get :func:`two_ahead_ids` predictions of the replayed ids at this recall.
        recorded: lookahead 2 only, instead of ``recall``: the early copies replay the trace's
            recorded predictions (:func:`replay_masks` with ``early=True``, mapped as the ids).
        keys: ``"hash"`` (:meth:`request_key`, a request replays the same ids alone or batched) or
            ``"order"``: the ``n``-th request to start decoding replays bench row ``n mod keys``,
            so ``B`` requests of one length replay exactly the rows of ``sparda bench`` at batch
            ``B`` (the engine-overhead comparison of docs/bench.md).
    Raises:
        SpardaError: a cache that is not offloaded, ``recall`` outside [0, 1], unknown ``keys``, or
            ``recorded`` with ``recall`` or with a trace that holds no predictions.
    """

    def __init__(self, trace: SelectionTrace, cache, row_offset: int = 7, recall: float | None = None,
                 cached: int = 64, keys: str = "hash", recorded: bool = False) -> None:
        if keys not in ("hash", "order"):
            raise SpardaError(f"replay keys must be 'hash' or 'order', got {keys!r}")
        if not getattr(cache, "offload", False):
            raise SpardaError("trace replay in the server needs an offloaded KV cache (sparda with offload, "
                              "sparse-offload); this method keeps its KV on the device and copies nothing")
        if recall is not None and not 0.0 <= recall <= 1.0:
            raise SpardaError(f"--lookahead-recall must lie in [0, 1], got {recall}")
        if recorded and recall is not None:
            raise SpardaError("the early copies replay recorded predictions or model them at a recall, not both")
        if recorded and trace.early is None:
            raise SpardaError(NO_PREDICTIONS)
        self.trace, self.selection, self.row_offset, self.recall = trace, cache.selection, row_offset, recall
        self.recorded = recorded
        self.num_layers, self.num_kv_heads = cache.num_layers, cache.num_kv_heads
        self.num_blocks, self.width, self.rows = cache.num_blocks, cache.select_width, cache.batch
        self.period = replay_period(trace)
        #: distinct ``(trace row, step offset)`` pairs of :func:`replay_masks`' ``first_row``
        self.keys = math.lcm(trace.ids.shape[1], self.period // math.gcd(row_offset, self.period))
        dtype = torch.int16 if self.num_blocks < 2**15 else torch.int32
        self._host_dtype = np.int16 if dtype == torch.int16 else np.int32
        shape = (self.rows, self.period, self.num_layers, self.num_kv_heads, self.width)
        device = cache.device
        self.ids = torch.full(shape, -1, dtype=dtype, device=device)
        two_ahead = recall is not None or recorded
        self.early = torch.full(shape, -1, dtype=dtype, device=device) if two_ahead else None
        self.step = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.active = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self._row_index = torch.arange(self.rows, device=device)
        self._decoding: tuple[int, ...] = ()
        #: per row, the ``(position, key)`` of its table (host record)
        self.starts: dict[int, tuple[int, int]] = {}
        self._tables: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = {}
        self._cached = cached
        self.key_mode = keys
        self._order: dict[str, int] = {}  # request id -> its key, with ``keys="order"``
        self._install(cache)

    @classmethod
    def attach(cls, engine, trace: str | os.PathLike | SelectionTrace | None = None,
               row_offset: int = 7, keys: str = "hash") -> RowReplayer:
        """Replay ``trace`` (a file, default the shipped one, read with :func:`trace_for` of the
        engine's method) in ``engine``'s cache and observe its decode steps
        (``engine.decode_hook``); at lookahead 2 the early copies replay the trace's recorded
        predictions, or where it has none are modelled at :data:`LOOKAHEAD2_RECALL`; ``keys`` as
        the constructor. Raises SpardaError as the constructor, or for a bad file."""
        config = engine.runner.config
        if not isinstance(trace, SelectionTrace):
            trace = trace_for(load_traces(trace or SHIPPED_TRACE), config.method)
        recorded = config.lookahead == 2 and trace.early is not None
        recall = LOOKAHEAD2_RECALL if config.lookahead == 2 and not recorded else None
        replayer = cls(trace, engine.cache, row_offset, recall, keys=keys, recorded=recorded)
        engine.decode_hook = replayer
        return replayer

    def request_key(self, request_id: str) -> int:
        """The bench row ``k`` in ``[0, keys)`` a request replays: a CRC-32 of its id, or with
        ``keys="order"`` the number of requests that started decoding before it (the same
        again after a recompute)."""
        if self.key_mode == "hash":
            return zlib.crc32(str(request_id).encode()) % self.keys
        return self._order.setdefault(str(request_id), len(self._order)) % self.keys

    def table(self, position: int, key: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The ids ``[period, L, H, W]`` (and, at lookahead 2, the early copies' predictions) of a
        row that starts decoding at ``position`` as bench row ``key`` (recent ones cached)."""
        found = self._tables.pop((position, key), None)
        if found is None:
            def replayed(early=False):
                masks = replay_masks(self.trace, self.num_layers, self.num_kv_heads, self.selection, [position],
                                     self.period, self.num_blocks, self.row_offset, first_row=key, early=early)
                return mask_ids(masks[:, :, 0].numpy(), self.width, self._host_dtype)

            ids, early = replayed(), None
            if self.recorded:
                early = replayed(early=True)
            elif self.recall is not None:
                early = two_ahead_ids(torch.from_numpy(ids[:, :, None]), self.selection, [position], self.recall,
                                      seed=key)[:, :, 0].numpy().astype(self._host_dtype)
            found = (ids, early)
            while len(self._tables) >= self._cached:
                self._tables.pop(next(iter(self._tables)))
        self._tables[(position, key)] = found  # the most recent last
        return found

    # -------------------------------------------------------- engine hook
    def on_decode_start(self, row: int, position: int, request_id: str) -> None:
        """Row ``row`` starts decoding at ``position`` (tokens) for request ``request_id``: its
        table and step counter (0) are set in place."""
        key = self.request_key(request_id)
        ids, early = self.table(position, key)
        with torch.inference_mode():
            self.ids[row].copy_(torch.from_numpy(ids))
            if self.early is not None:
                self.early[row].copy_(torch.from_numpy(early))
            self.step[row] = 0
        self.starts[row] = (position, key)

    def before_decode_step(self, rows) -> None:
        """The decode step about to run decodes ``rows``: only they fetch replayed ids."""
        self._set_decoding(rows)

    def after_decode_step(self, rows) -> None:
        """The decode step of ``rows`` ran: their step counters advance (mod the period)."""
        self._set_decoding(rows)  # the same rows as before the step: nothing to copy
        with torch.inference_mode():
            self.step.add_(self.active).remainder_(self.period)

    def _set_decoding(self, rows) -> None:
        """:attr:`active` is ``rows``' mask (copied in place, only when the rows change)."""
        rows = tuple(rows)
        if rows != self._decoding:
            mask = torch.zeros(self.rows, dtype=torch.bool)
            mask[list(rows)] = True
            with torch.inference_mode():
                self.active.copy_(mask)
            self._decoding = rows

    # ------------------------------------------------------------ wrapping
    def _replayed(self, table: torch.Tensor, layer: int, own: torch.Tensor) -> torch.Tensor:
        """``[b, H, W]`` ids of the step's rows, the cache's first ``b = len(own)`` (design §3.13):
        each active row's replayed ones at its step, the others ``own``."""
        b = own.shape[0]
        chosen = table[self._row_index[:b], self.step[:b], layer].to(own.dtype)
        if own.shape[-1] < self.width:
            own = torch.nn.functional.pad(own, (0, self.width - own.shape[-1]), value=-1)
        return torch.where(self.active[:b].view(-1, 1, 1), chosen, own)

    def _install(self, cache) -> None:
        """Wrap ``cache.fetch`` (and with ``recall`` ``cache.warm``): instance attributes."""
        fetch, warm = cache.fetch, cache.warm

        def replay_fetch(layer, selection, pos, prefetch=False, counters=None):
            if layer in cache.resident:
                return fetch(layer, selection, pos, prefetch, counters)
            return fetch(layer, self._replayed(self.ids, layer, cache.selection_ids(selection)), pos, prefetch,
                         counters)

        def replay_warm(layer, selection, pos):
            if layer in cache.resident:
                return warm(layer, selection, pos)
            return warm(layer, self._replayed(self.early, layer, cache.selection_ids(selection)), pos)

        cache.fetch = replay_fetch
        if self.early is not None:
            cache.warm = replay_warm


def _masks_to_ids(masks: list[torch.Tensor], width: int) -> np.ndarray:
    """Per-layer decode masks ``[B, H, N]`` -> ids ``[B, L, H, width]`` int16."""
    from sparda.kernels.reference import block_mask_to_indices

    ids = [block_mask_to_indices(m, width) for m in masks]  # each [B, H, width]
    return torch.stack(ids, 1).to(torch.int16).cpu().numpy()


def record_selection(model, seqs: list[list[int]], prompt_tokens: int, steps: int,
                     methods=("sparse", "sparda"), preset: str = "small", forecast=None,
                     meta: dict | None = None, forecast2=None, **overrides) -> dict[str, SelectionTrace]:
    """Record the decode selections of ``model`` on token sequences ``seqs`` (each at least
    ``prompt_tokens + steps`` tokens): dense prefill, then ``steps`` teacher-forced decode steps
    per method. With ``forecast2`` (two-ahead heads, design §6.2) a ``sparda*`` trace also gets
    :attr:`SelectionTrace.early`: ``F2_l``'s selection of layer ``l + 2``, made in layer ``l`` of
    the same step over the compressed keys before the token (what ``--lookahead 2`` copies early).
    Returns method -> :class:`SelectionTrace`.

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
        early: dict[int, torch.Tensor] | None = None
        if forecast2 is not None and name.startswith("sparda"):
            early = _capture_two_ahead(method, forecast2, model)
        method.reset()
        num_layers = llm.shape.num_layers
        all_ids, all_early = [], []
        for s in range(steps):
            tokens = torch.tensor([seq[prompt_tokens + s] for seq in seqs], device=llm.device)
            pos = torch.full((rows,), prompt_tokens + s, device=llm.device)
            captured.clear()
            llm.decode(run_cache, tokens, pos, prompt_tokens + s)
            if len(captured) != num_layers:
                raise SpardaError(f"method {name} selected in {len(captured)} of {num_layers} layers; "
                                  "use a prompt longer than dense_len and the budget")
            all_ids.append(_masks_to_ids([captured[l] for l in range(num_layers)], cfg.budget_blocks))
            if early is not None:
                none = torch.zeros_like(captured[0])  # layers 0 and 1: no two-ahead head
                all_early.append(_masks_to_ids([early.pop(l, none) for l in range(num_layers)], cfg.budget_blocks))
        info = dict(block_size=cfg.block_size, init_blocks=cfg.init_blocks, local_blocks=cfg.local_blocks,
                    topk_blocks=cfg.topk_blocks, method=name, prompt_tokens=prompt_tokens, **(meta or {}))
        pos = np.repeat((prompt_tokens + np.arange(steps))[:, None], rows, 1).astype(np.int64)
        out[name] = SelectionTrace(np.stack(all_ids), pos, info, np.stack(all_early) if all_early else None)
    return out


def _capture_two_ahead(method, forecast2, model) -> dict[int, torch.Tensor]:
    """Give a ``sparda`` ``method`` the two-ahead heads ``forecast2`` and wrap its
    ``before_layer`` so that every decode step stores ``F2_l``'s mask of layer ``l + 2``
    (``[B, H, N]`` bool, :meth:`ForecastAttention.predict_next` with ``ahead=2``) in the
    returned dict, keyed by the target layer."""
    from sparda.attention.forecast import on_model

    method.forecast2 = on_model(forecast2, model)
    into: dict[int, torch.Tensor] = {}
    before = method.before_layer
    num_layers = method.shape.num_layers

    def before_layer(layer, q, h, cache, step):
        before(layer, q, h, cache, step)
        if step.phase == "decode" and layer + 2 < num_layers and method.needs_selection(step):
            into[layer + 2] = method.predict_next(layer, h, cache, step, ahead=2)[..., -1, :]

    method.before_layer = before_layer
    return into


def record_traces(rows: int = 4, prompt_tokens: int = 4096, steps: int = 64, device: str = "cpu",
                  methods=("sparse", "sparda")) -> dict[str, SelectionTrace]:
    """:func:`record_selection` of the bundled model (shipped Forecast and two-ahead heads) on ``rows``
    excerpts of Emma, ``small`` preset; ``prompt_tokens`` and ``steps`` are token counts.

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
    forecast = forecast2 = None
    if any(m.startswith("sparda") for m in methods):
        path = shipped_path(shipped_name(model_dir))
        if path is None:
            raise SpardaError("no shipped Forecast weights for the bundled model; record only sparse")
        forecast = load_forecast(path, model.config, model.shape)[0]
        path2 = shipped_path(shipped_name(model_dir), ahead=2)
        forecast2 = None if path2 is None else load_forecast(path2, model.config, model.shape, ahead=2)[0]
    return record_selection(model, seqs, prompt_tokens, steps, methods, "small", forecast,
                            meta=dict(model="SmolLM2-135M-Instruct", text="emma (held out)"), forecast2=forecast2)
