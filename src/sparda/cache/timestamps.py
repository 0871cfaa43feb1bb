"""Device-side timestamps for the prefetcher's copy timing (design §6), CUDA-graph safe.

CUDA timing events cannot be recorded inside a captured graph, so the copy time and
the exposed wait of each offloaded layer are measured with the GPU's global nanosecond
timer (``%globaltimer``), read by a one-thread Triton kernel launched on the stream
whose progress it marks:

* ``READY`` on the stream that issues the copy (the selection stream for a lookahead,
  design §6), once the copy's inputs -- the selection and the slot diff -- are enqueued:
  it runs when they are done;
* ``START`` / ``END`` on the stream that runs the copy, around the gather;
* ``WAIT`` on the compute stream just before it waits for the copy's event;
* ``EARLY_START`` / ``EARLY_END`` around the layer's early copy (``lookahead=2``, design §6.2),
  issued one layer before the copy above; zero for a layer without one.

After the wait, :meth:`DeviceClock.account` adds, on the device:

* ``END - START`` plus ``EARLY_END - EARLY_START`` to the copy total;
* ``max(0, END - WAIT)`` (how long the compute stream stalled) to the exposed total;
* ``max(0, END - max(WAIT, READY))`` to the exposed *transfer* total: the part of that
  stall after the copy's inputs were ready, i.e. spent on the copy (and on its stream
  getting the GPU), not on the selection chain before it. The rest of the exposed wait
  is the selection's: a lookahead whose scoring or top-k is not done when the layer
  needs it stalls the compute stream even with nothing to copy.

:meth:`DeviceClock.drain` reads the totals (one host sync); :meth:`DeviceClock.timeline`
the last step's stamps. A synchronous fetch marks ``READY``, ``WAIT`` and ``START``
(in this order) together, so all of its time counts as exposed transfer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mark_kernel(STAMPS, index):
    zero = tl.zeros([1], dtype=tl.int64)
    now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [zero], dtype=tl.int64,
                                    is_pure=False, pack=1)
    tl.store(STAMPS + index + tl.arange(0, 1), now)


#: stamps per layer, in this order (module doc)
STAMPS_PER_LAYER = 6


@triton.jit
def _account_kernel(STAMPS, TOTALS, layer, PER: tl.constexpr):
    offs = tl.arange(0, 1)
    start = tl.load(STAMPS + layer * PER + 0 + offs)
    end = tl.load(STAMPS + layer * PER + 1 + offs)
    wait = tl.load(STAMPS + layer * PER + 2 + offs)
    ready = tl.load(STAMPS + layer * PER + 3 + offs)
    early = tl.load(STAMPS + layer * PER + 5 + offs) - tl.load(STAMPS + layer * PER + 4 + offs)
    tl.store(TOTALS + offs, tl.load(TOTALS + offs) + (end - start) + early)
    tl.store(TOTALS + 1 + offs, tl.load(TOTALS + 1 + offs) + tl.maximum(end - wait, 0))
    tl.store(TOTALS + 2 + offs, tl.load(TOTALS + 2 + offs) + tl.maximum(end - tl.maximum(wait, ready), 0))


class DeviceClock:
    """Per-layer ``(START, END, WAIT, READY, EARLY_START, EARLY_END)`` nanosecond stamps ``[L, 6]``
    int64 and three running totals (copy, exposed, exposed transfer; ns) on one device (module doc)."""

    START, END, WAIT, READY, EARLY_START, EARLY_END = 0, 1, 2, 3, 4, 5

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.stamps = torch.zeros(num_layers, STAMPS_PER_LAYER, dtype=torch.long, device=device)
        self.totals = torch.zeros(3, dtype=torch.long, device=device)

    def mark(self, layer: int, which: int) -> None:
        """Stamp ``which`` of ``layer`` with the global timer, on the current stream."""
        _mark_kernel[(1,)](self.stamps, layer * STAMPS_PER_LAYER + which, num_warps=1)

    def account(self, layer: int) -> None:
        """Add ``layer``'s copy, exposed and exposed-transfer time to the totals (current
        stream, after the wait)."""
        _account_kernel[(1,)](self.stamps, self.totals, layer, PER=STAMPS_PER_LAYER, num_warps=1)

    def drain(self) -> tuple[float, float, float]:
        """``(copy_ms, exposed_ms, exposed_transfer_ms)`` accumulated since the last drain;
        resets the totals (syncs)."""
        copy_ns, exposed_ns, transfer_ns = self.totals.tolist()
        self.totals.zero_()
        return copy_ns / 1e6, exposed_ns / 1e6, transfer_ns / 1e6

    def timeline(self, layers) -> list[dict]:
        """The last step's stamps of ``layers`` (those that fetched), in microseconds from
        the earliest of them: ``[{"layer", "ready", "start", "end", "wait"}]``, plus
        ``early_start``, ``early_end`` for a layer with an early copy (syncs)."""
        stamps = self.stamps[list(layers)].tolist()
        if not stamps:
            return []
        t0 = min(min(row[:4] + (row[4:] if row[self.EARLY_END] else [])) for row in stamps)
        us = lambda ns: round((ns - t0) / 1e3, 2)
        out = []
        for layer, row in zip(layers, stamps):
            item = {"layer": layer, "ready": us(row[self.READY]), "start": us(row[self.START]),
                    "end": us(row[self.END]), "wait": us(row[self.WAIT])}
            if row[self.EARLY_END]:
                item.update(early_start=us(row[self.EARLY_START]), early_end=us(row[self.EARLY_END]))
            out.append(item)
        return out
