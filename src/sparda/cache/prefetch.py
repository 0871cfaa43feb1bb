"""Slot diff, side-stream prefetch and counters of the offload runtime (design §6).

Each offloaded layer keeps ``S`` GPU slots and a block map ``slot_map [B, H, S]``
(logical block held by each slot, ``-1`` = empty). A new selection is diffed against
it on the device, with static shapes and no host synchronisation:

* hits: selected blocks already in a slot stay where they are;
* misses: selected blocks not resident; the ``k``-th miss goes to the ``k``-th
  replaceable slot (empty slots first, then slots whose block is no longer selected,
  in slot order);
* the copy of the misses is enqueued on a side stream (prefetch, with an event that
  the layer waits on just before it uses its slots) or on the compute stream
  (synchronous fetch).

With prefetch, the whole lookahead chain of layer ``l+1`` -- Forecast scoring, top-k,
slot diff -- runs on a second side stream, the *selection stream* (:meth:`Prefetcher.ahead`),
forked from the compute stream once layer ``l``'s Forecast query exists; the copy
stream waits for it, and layer ``l+1`` waits for both just before its attention. The
compute stream is left with the projections, the append, attention and the MLP
(design §6).

With ``lookahead=2`` layer ``l`` also enqueues an *early* copy of layer ``l+2``'s predicted
misses (design §6.2, :meth:`Prefetcher.fetch` with ``early``): the same selection and copy
streams, behind layer ``l+1``'s copy; layer ``l+2``'s wait joins the later copy of layer
``l+1``, which the copy stream runs after it.

Counters: hits and misses per cache row (device tensors updated in place, so a captured
CUDA graph keeps counting), early copies, bytes copied, and -- only with ``timing`` -- copy time and
the part of it the compute stream waited for (exposed wait), measured with device
timestamps on the GPU (graph-safe, :mod:`sparda.cache.timestamps`) and a wall clock on
the CPU.
"""

from __future__ import annotations

import contextlib
import time

import torch

from sparda.kernels.twins import diff_slots  # noqa: F401  (the slot diff's PyTorch twin)


class Prefetcher:
    """Streams, events and counters of one offloaded cache.

    Args:
        engine: a :class:`~sparda.cache.transfer.TransferEngine`.
        device: the compute device. On CUDA a side stream (high priority by default)
            carries prefetch copies.
        num_layers: layers of the model.
        block_bytes: bytes of one block of one head, K or V alone.
        batch: cache rows (hits and misses are counted per row).
        timing: measure copy time and the part the compute stream waited for. Off by
            default: on CUDA it adds four tiny timestamp kernels per offloaded layer and
            step (:mod:`sparda.cache.timestamps`), which work inside a CUDA graph.
        pool_block_bytes: ``kv_dtype`` ``mixed``: bytes of one block of one head in the hot
            pool (the model dtype); misses served from the pool are counted apart
            (:attr:`pool_misses`) and cost these bytes, the others ``block_bytes`` (int4).
    Attributes:
        hits, misses: ``[batch]`` int64 device counters, updated in place (graph-safe).
        early: ``[batch]`` int64, blocks copied by early copies (design §6.2), not in ``misses``.
        pool_misses: ``mixed``: ``[batch]`` int64, the misses copied from the hot pool
            (a part of ``misses``); ``None`` otherwise.
    """

    def __init__(self, engine, device: torch.device, num_layers: int, block_bytes: int,
                 batch: int = 1, stream_priority: int = -1, timing: bool = False,
                 pool_block_bytes: int | None = None) -> None:
        self.engine = engine
        self.pool_block_bytes = pool_block_bytes
        self.pool_misses = None
        self.device = device
        self.block_bytes = block_bytes
        self.num_layers = num_layers
        self.batch = batch
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device, priority=stream_priority) if self.cuda else None
        #: the lookahead selection chain's stream (:meth:`ahead`)
        self.select_stream = torch.cuda.Stream(device=device, priority=stream_priority) if self.cuda else None
        self.timing = timing
        self.pending: dict[int, tuple] = {}  # layer -> (done event, keep-alive tensors)
        self._selected: dict[int, object] = {}  # layer -> event after its selection chain
        self._clock = None
        #: layers whose copies the device clock stamps: filled when a step is run or captured
        #: (a replayed CUDA graph runs no Python, so :meth:`reset` keeps it; :meth:`set_timing` clears it)
        self.timed_layers: set[int] = set()
        self.hits = self.misses = self.early = None
        self.reset()

    def reset(self) -> None:
        """Zero the counters, in place: a captured CUDA graph keeps counting into them."""
        if getattr(self, "hits", None) is None:
            self.hits = torch.zeros(self.batch, dtype=torch.long, device=self.device)
            self.misses = torch.zeros(self.batch, dtype=torch.long, device=self.device)
            self.early = torch.zeros(self.batch, dtype=torch.long, device=self.device)
            if self.pool_block_bytes is not None:
                self.pool_misses = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        else:
            with torch.inference_mode():
                self.hits.zero_()
                self.misses.zero_()
                self.early.zero_()
                if self.pool_misses is not None:
                    self.pool_misses.zero_()
        self.copy_ms = 0.0
        self.exposed_ms = 0.0
        self.exposed_transfer_ms = 0.0
        if self._clock is not None:
            with torch.inference_mode():
                self._clock.totals.zero_()
        elif self.cuda and self.timing:
            from sparda.cache.timestamps import DeviceClock

            self._clock = DeviceClock(self.num_layers, self.device)

    def set_timing(self, enabled: bool) -> None:
        """Turn copy timing on or off and zero the counters. Graphs captured before keep
        the timestamp kernels they were captured with (a runner per setting)."""
        self.timing = bool(enabled)
        self._clock = None
        self.timed_layers = set()
        self.reset()

    def fetch(self, layer: int, copy_fn, hits: torch.Tensor, misses: torch.Tensor,
              keep: tuple, prefetch: bool, early: bool = False) -> None:
        """Run ``copy_fn()`` (the gather of one layer's misses) and count.

        ``prefetch``: on the side stream after the compute stream's pending work, with an
        event :meth:`wait` blocks on; else on the compute stream (synchronous fetch, all
        of its time exposed). ``early``: an early copy (design §6.2, implies ``prefetch``),
        timed apart (``EARLY_START``/``EARLY_END``); the layer's later fetch on the same
        stream supersedes its event. ``keep``: tensors that must live until the copy is done
        (kept until :meth:`wait` of ``layer``, with those of an earlier pending copy).
        ``hits, misses``: ``[B, H]`` int64 device counts (from :func:`diff_slots`), summed
        over heads into the per-row counters in place (no host sync); ``None`` when the
        slot diff kernel already added them (:func:`sparda.kernels.slot_diff`). With ``timing``,
        copy time comes from device timestamps (CUDA) or the wall clock (CPU).
        """
        if hits is not None:  # else the slot diff kernel counted them
            self.hits.add_(hits.sum(-1))
            self.misses.add_(misses.sum(-1))
        if not self.cuda:
            start = time.perf_counter()
            copy_fn()
            if self.timing:
                ms = (time.perf_counter() - start) * 1e3
                self.copy_ms += ms
                self.exposed_ms += ms
                self.exposed_transfer_ms += ms
            return
        main = torch.cuda.current_stream(self.device)
        clock = self._clock
        if clock is not None:
            self.timed_layers.add(layer)
        if not prefetch and not early:  # on the compute stream: the whole copy is waited for
            if clock is not None:  # READY first: max(WAIT, READY) = WAIT, all of the stall is the copy's
                clock.mark(layer, clock.READY)
                clock.mark(layer, clock.WAIT)
                clock.mark(layer, clock.START)
            copy_fn()
            if clock is not None:
                clock.mark(layer, clock.END)
                clock.account(layer)
            return
        if clock is not None:
            first, last = (clock.EARLY_START, clock.EARLY_END) if early else (clock.START, clock.END)
        if clock is not None and not early:  # on the issuing stream: its work so far is the copy's input
            clock.mark(layer, clock.READY)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            if clock is not None:
                clock.mark(layer, first)
            copy_fn()
            if clock is not None:
                clock.mark(layer, last)
            done = torch.cuda.Event()
            done.record(self.stream)
        earlier = self.pending.get(layer)
        self.pending[layer] = (done, keep + (earlier[1] if earlier is not None else ()))

    @contextlib.contextmanager
    def ahead(self, layer: int, *inputs: torch.Tensor):
        """Run the body (``layer``'s lookahead: scoring, selection, slot diff and the
        :meth:`fetch` with ``prefetch=True``) on the selection stream, after the compute
        stream's pending work; :meth:`wait` of ``layer`` joins it back. ``inputs``: tensors
        made on the compute stream that the body reads (kept from reuse until it is done).
        No-op off CUDA."""
        if not self.cuda:
            yield
            return
        main = torch.cuda.current_stream(self.device)
        self.select_stream.wait_stream(main)
        for t in inputs:
            t.record_stream(self.select_stream)
        with torch.cuda.stream(self.select_stream):
            yield
            done = torch.cuda.Event()
            done.record(self.select_stream)
        self._selected[layer] = done

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s prefetch and selection chain (no host sync)."""
        item = self.pending.pop(layer, None)
        selected = self._selected.pop(layer, None)
        if not self.cuda or (item is None and selected is None):
            return
        main = torch.cuda.current_stream(self.device)
        clock = self._clock
        if clock is not None and item is not None:
            clock.mark(layer, clock.WAIT)
        if selected is not None:
            main.wait_event(selected)
        if item is not None:
            main.wait_event(item[0])
            if clock is not None:
                clock.account(layer)

    def resolve(self) -> None:
        """Move the device-side timing totals into ``copy_ms`` / ``exposed_ms`` /
        ``exposed_transfer_ms`` (synchronises)."""
        if self._clock is not None:
            copy, exposed, transfer = self._clock.drain()
            self.copy_ms += copy
            self.exposed_ms += exposed
            self.exposed_transfer_ms += transfer

    def timeline(self) -> list[dict]:
        """The last timed step's per-layer stamps (:meth:`DeviceClock.timeline`), ``[]``
        without device timing."""
        return [] if self._clock is None else self._clock.timeline(sorted(self.timed_layers))

    def row_counters(self) -> list[torch.Tensor]:
        """The per-row ``[batch]`` counters, in the order :meth:`stats` takes ``saved``:
        ``hits``, ``misses``, ``early`` and, ``mixed``, ``pool_misses``."""
        return [self.hits, self.misses, self.early] + ([self.pool_misses] if self.pool_misses is not None else [])

    def stats(self, tokens: int, row: int | None = None, saved: list | None = None) -> dict[str, float]:
        """Counters of one cache row (``row``), of the whole batch, or ``saved`` (one row's
        :meth:`row_counters` as saved when its request was preempted): ``hits``, ``misses``,
        ``hit_rate``, ``early_copies`` (blocks copied early, design §6.2; not in ``misses``),
        ``bytes_copied`` (misses and early copies), ``bytes_per_token`` (K+V copied per decoded token,
        ``tokens`` decoded tokens of that row or batch; ``mixed``: ``pool_misses`` of the
        copies cost a pool block each, the others an int4 block with its scales). With ``timing``, also ``copy_ms``,
        ``exposed_wait_ms`` (the compute stream's stall for the lookahead: selection chain and
        copy), ``exposed_transfer_ms`` (the part of it after the copy's inputs were ready,
        :mod:`sparda.cache.timestamps`) and ``hidden_fraction`` (copy time not waited for) --
        batch-wide: one copy carries every row's misses; 0 when nothing was copied."""
        if saved is None:
            saved = [c if row is None else c[row] for c in self.row_counters()]
        counts = [int(c.sum().item()) for c in saved]
        hits, misses, early = counts[:3]
        pool = counts[3] if self.pool_misses is not None else None
        copied = 2 * (misses + early) * self.block_bytes
        if pool is not None:
            copied = 2 * (pool * self.pool_block_bytes + (misses + early - pool) * self.block_bytes)
        out = {
            "hits": hits, "misses": misses,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0, "early_copies": early,
            "bytes_copied": copied,
            "bytes_per_token": round(copied / tokens, 1) if tokens else 0.0,
        }
        if pool is not None:
            out["pool_misses"] = pool
        if self.timing:
            self.resolve()
            nothing = int(self.misses.sum().item()) + int(self.early.sum().item()) == 0
            copy_ms, exposed, transfer = ((0.0, 0.0, 0.0) if nothing else
                                          (self.copy_ms, self.exposed_ms, self.exposed_transfer_ms))
            out.update(copy_ms=round(copy_ms, 3), exposed_wait_ms=round(exposed, 3),
                       exposed_transfer_ms=round(transfer, 3),
                       hidden_fraction=round(1 - exposed / copy_ms, 4) if copy_ms > 0 else 0.0)
        return out
