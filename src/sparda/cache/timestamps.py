"""Device-side timestamps for the prefetcher's copy timing (design §6), CUDA-graph safe.

CUDA timing events cannot be recorded inside a captured graph, so the copy time and
the exposed wait of each offloaded layer are measured with the GPU's global nanosecond
timer (``%globaltimer``), read by a one-thread Triton kernel launched on the stream
whose progress it marks:

* ``START`` / ``END`` on the stream that runs the copy, around the gather;
* ``WAIT`` on the compute stream just before it waits for the copy's event.

After the wait, :meth:`DeviceClock.account` adds ``END - START`` to the copy total and
``max(0, END - WAIT)`` (how long the compute stream stalled) to the exposed total, on
the device. :meth:`DeviceClock.drain` reads both (one host sync). A synchronous fetch
marks ``WAIT`` and ``START`` together, so all of its time counts as exposed.
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


@triton.jit
def _account_kernel(STAMPS, TOTALS, layer):
    offs = tl.arange(0, 1)
    start = tl.load(STAMPS + layer * 3 + 0 + offs)
    end = tl.load(STAMPS + layer * 3 + 1 + offs)
    wait = tl.load(STAMPS + layer * 3 + 2 + offs)
    tl.store(TOTALS + offs, tl.load(TOTALS + offs) + (end - start))
    tl.store(TOTALS + 1 + offs, tl.load(TOTALS + 1 + offs) + tl.maximum(end - wait, 0))


class DeviceClock:
    """Per-layer ``(START, END, WAIT)`` nanosecond stamps ``[L, 3]`` int64 and two running
    totals (copy ns, exposed ns) on one CUDA device (module doc)."""

    START, END, WAIT = 0, 1, 2

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.stamps = torch.zeros(num_layers, 3, dtype=torch.long, device=device)
        self.totals = torch.zeros(2, dtype=torch.long, device=device)

    def mark(self, layer: int, which: int) -> None:
        """Stamp ``which`` of ``layer`` with the global timer, on the current stream."""
        _mark_kernel[(1,)](self.stamps, layer * 3 + which, num_warps=1)

    def account(self, layer: int) -> None:
        """Add ``layer``'s copy and exposed time to the totals (current stream, after the wait)."""
        _account_kernel[(1,)](self.stamps, self.totals, layer, num_warps=1)

    def drain(self) -> tuple[float, float]:
        """``(copy_ms, exposed_ms)`` accumulated since the last drain; resets the totals (syncs)."""
        copy_ns, exposed_ns = self.totals.tolist()
        self.totals.zero_()
        return copy_ns / 1e6, exposed_ns / 1e6
