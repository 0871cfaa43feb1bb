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

Counters: hits, misses, bytes copied, copy time and the part of it the compute
stream waited for (exposed wait), measured with CUDA events on the GPU and a wall
clock on the CPU.
"""

from __future__ import annotations

import time

import torch


def diff_slots(slot_map: torch.Tensor, want: torch.Tensor):
    """Diff a selection against the resident slots (device-side, static shapes).

    Args:
        slot_map: ``[B, H, S]`` int64 logical block per slot, ``-1`` empty.
        want: ``[B, H, N]`` bool, the blocks to make resident (at most ``S`` per row).
    Returns:
        ``(load, new_map, hits, misses)``: ``load [B, H, S]`` int64 block to copy into
        each slot (``-1`` none); ``new_map [B, H, S]`` the block map afterwards;
        ``hits, misses`` ``[B, H]`` int64 counts.
    """
    b, h, s = slot_map.shape
    n = want.shape[-1]
    dev = slot_map.device
    ext = torch.cat([want, want.new_zeros(b, h, 1)], -1)  # index n = "empty"
    held = torch.where(slot_map < 0, n, slot_map)
    hit_slot = torch.gather(ext, -1, held)  # [B,H,S] slot's block is wanted
    resident = torch.zeros(b, h, n + 1, dtype=torch.bool, device=dev).scatter_(-1, held, True)[..., :n]
    miss = want & ~resident
    hits = hit_slot.sum(-1)
    misses = miss.sum(-1)
    # k-th miss (ascending block id) -> k-th replaceable slot (empty first, then stale)
    blocks = torch.arange(n, device=dev)
    miss_ids = torch.sort(torch.where(miss, blocks, n), dim=-1).values
    if n < s:
        miss_ids = torch.cat([miss_ids, miss_ids.new_full((b, h, s - n), n)], -1)
    miss_ids = miss_ids[..., :s]
    slots = torch.arange(s, device=dev)
    priority = torch.where(hit_slot, 2, torch.where(slot_map < 0, 0, 1)) * s + slots
    order = torch.sort(priority, dim=-1).indices  # replaceable slots first
    load_sorted = torch.where(torch.gather(hit_slot, -1, order), n, miss_ids)
    load = torch.full_like(slot_map, n).scatter_(-1, order, load_sorted)
    load = torch.where(load >= n, -1, load)
    new_map = torch.where(load >= 0, load, slot_map)
    return load, new_map, hits, misses


class Prefetcher:
    """Streams, events and counters of one offloaded cache.

    Args:
        engine: a :class:`~sparda.cache.transfer.TransferEngine`.
        device: the compute device. On CUDA a side stream (high priority by default)
            carries prefetch copies; ``timing`` adds CUDA timing events.
        num_layers: layers of the model.
        block_bytes: bytes of one block of one head, K or V alone.
    """

    def __init__(self, engine, device: torch.device, num_layers: int, block_bytes: int,
                 stream_priority: int = -1, timing: bool = True) -> None:
        self.engine = engine
        self.device = device
        self.block_bytes = block_bytes
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device, priority=stream_priority) if self.cuda else None
        self.timing = timing
        self.pending: dict[int, tuple] = {}  # layer -> (done event, keep-alive tensors)
        self._timings: list[tuple] = []      # (start, done, need) CUDA events
        self.reset()

    def reset(self) -> None:
        """Zero the counters."""
        self.hits = torch.zeros((), dtype=torch.long, device=self.device)
        self.misses = torch.zeros((), dtype=torch.long, device=self.device)
        self.copy_ms = 0.0
        self.exposed_ms = 0.0
        self.fetches = 0
        self._timings.clear()

    def _event(self):
        return torch.cuda.Event(enable_timing=self.timing)

    def fetch(self, layer: int, copy_fn, hits: torch.Tensor, misses: torch.Tensor,
              keep: tuple, prefetch: bool) -> None:
        """Run ``copy_fn()`` (the gather of one layer's misses) and count.

        ``prefetch``: on the side stream after the compute stream's pending work, with an
        event :meth:`wait` blocks on; else on the compute stream (synchronous fetch, all
        of its time exposed). ``keep``: tensors that must live until the copy is done.
        ``hits, misses``: ``[B, H]`` int64 device counts (from :func:`diff_slots`), summed
        into the scalar counters without a host sync. Copy time (``copy_ms``, ms) is
        timed with CUDA events (resolved in :meth:`stats`) or the wall clock on the CPU.
        """
        self.hits += hits.sum()
        self.misses += misses.sum()
        self.fetches += 1
        if not self.cuda:
            start = time.perf_counter()
            copy_fn()
            ms = (time.perf_counter() - start) * 1e3
            self.copy_ms += ms
            self.exposed_ms += ms
            return
        main = torch.cuda.current_stream(self.device)
        stream = self.stream if prefetch else main
        start = self._event() if self.timing else None
        if prefetch:
            stream.wait_stream(main)
        with torch.cuda.stream(stream):
            if start is not None:
                start.record(stream)
            copy_fn()
            done = self._event()
            done.record(stream)
        if prefetch:
            self.pending[layer] = (done, start, keep)
        elif start is not None:
            self._timings.append((start, done, None))

    def wait(self, layer: int) -> None:
        """Make the compute stream wait for ``layer``'s prefetch (no host sync)."""
        item = self.pending.pop(layer, None)
        if item is None or not self.cuda:
            return
        done, start, _ = item
        main = torch.cuda.current_stream(self.device)
        need = None
        if start is not None:
            need = self._event()
            need.record(main)
        main.wait_event(done)
        if start is not None:
            self._timings.append((start, done, need))

    def resolve(self) -> None:
        """Turn recorded CUDA events into ``copy_ms`` / ``exposed_ms`` (synchronises)."""
        if not self._timings:
            return
        torch.cuda.synchronize(self.device)
        for start, done, need in self._timings:
            copy = start.elapsed_time(done)
            self.copy_ms += copy
            self.exposed_ms += copy if need is None else max(0.0, need.elapsed_time(done))
        self._timings.clear()

    def stats(self, tokens: int) -> dict[str, float]:
        """Counters: ``hit_rate``, ``bytes_per_token`` (K+V copied per decoded token),
        ``copy_ms``, ``exposed_wait_ms``, ``hidden_fraction`` (copy time not waited for)."""
        self.resolve()
        hits, misses = int(self.hits.item()), int(self.misses.item())
        copied = 2 * misses * self.block_bytes
        return {
            "hits": hits, "misses": misses,
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
            "bytes_copied": copied,
            "bytes_per_token": round(copied / tokens, 1) if tokens else 0.0,
            "copy_ms": round(self.copy_ms, 3),
            "exposed_wait_ms": round(self.exposed_ms, 3),
            "hidden_fraction": round(1 - self.exposed_ms / self.copy_ms, 4) if self.copy_ms > 0 else 0.0,
        }
