"""Block hit rate of the offloaded cache's slot buffer against its size, on a recorded trace (CPU).

Usage (from the repository root):

    python3 benchmarks/spare_slots_sim.py [--trace src/sparda/bench/traces/smollm2-emma.npz]

Replays each (row, layer, KV head) of every method's recorded decode selection through the
slot diff the offloaded cache runs (``kernels.twins.slot_diff_reference``: empty slots first,
then stale slots in slot order) with ``S = ceil(f * W)`` slots for the trace's own selection
width ``W`` (its budget), ``f`` = 1, 1.25, 1.5, 2, and prints the
hit rate (selected blocks already in a slot, the current block excluded; after 3 warm-up
steps), with the hit rate of a least-recently-used rule beside it for comparison.

``f`` here is a multiple of the budget, not the runtime's ``slot_factor`` (design §6), whose
``W`` includes the dense-fallback prefix: at the ``small`` preset (dense_len 2048, blocks of
64) ``W`` is 32, so ``slot_factor`` 1 and 1.5 give 32 and 48 slots for this budget of 21.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench.traces import SHIPPED_TRACE, load_traces  # noqa: E402
from sparda.kernels import twins  # noqa: E402

WARM = 3


def slot_rule_hit_rate(trace, slots: int) -> float:
    """Hit rate of the cache's own slot diff (all rows, layers, heads at once) with ``slots`` slots."""
    ids = torch.from_numpy(trace.ids.astype("int64"))  # [S, R, L, H, K]
    steps, rows, layers, heads, width = ids.shape
    bs = trace.meta["block_size"]
    pos = torch.from_numpy(trace.pos)  # [S, R]
    flat = lambda x: x.reshape(rows * layers, heads, -1)  # noqa: E731  (rows x layers as batch rows)
    slot_map = torch.full((rows * layers, heads, slots), -1, dtype=torch.long)
    load = torch.empty_like(slot_map)
    attn = torch.empty(rows * layers, heads, slots + 1, dtype=torch.int32)
    num_blocks = int(ids.max()) + 2
    hits = total = 0
    for s in range(steps):
        p = pos[s].repeat_interleave(layers)  # [R * L]
        counters = tuple(torch.zeros(rows * layers, dtype=torch.long) for _ in range(4))
        twins.slot_diff_reference(flat(ids[s]), slot_map, p, bs, num_blocks, load, attn, counters)
        if s >= WARM:
            hits += int(counters[0].sum())
            total += int(counters[0].sum() + counters[1].sum())
    return hits / max(total, 1)


def lru_hit_rate(trace, slots: int) -> float:
    """Hit rate of a least-recently-used slot buffer of ``slots`` blocks (for comparison)."""
    steps, rows, layers, heads, _ = trace.ids.shape
    bs = trace.meta["block_size"]
    hits = total = 0
    for r in range(rows):
        for layer in range(layers):
            for h in range(heads):
                last: dict[int, int] = {}
                for s in range(steps):
                    cur = int(trace.pos[s, r]) // bs
                    sel = [int(x) for x in trace.ids[s, r, layer, h] if x >= 0 and x != cur]
                    if s >= WARM:
                        hits += sum(x in last for x in sel)
                        total += len(sel)
                    for x in sel:
                        last[x] = s
                    for x, _ in sorted(last.items(), key=lambda kv: kv[1])[:max(0, len(last) - slots)]:
                        del last[x]
    return hits / max(total, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(SHIPPED_TRACE))
    args = p.parse_args(argv)
    print(f"{'method':<10} {'W':>3} {'factor':>6} {'S':>4} {'hit (slot diff)':>16} {'hit (LRU)':>10}")
    for method, trace in load_traces(args.trace).items():
        m = trace.meta
        width = m["init_blocks"] + m["topk_blocks"] + m["local_blocks"]
        for factor in (1.0, 1.25, 1.5, 2.0):
            slots = math.ceil(factor * width - 1e-9)
            print(f"{method:<10} {width:>3} {factor:>6} {slots:>4} {slot_rule_hit_rate(trace, slots):>16.4f} "
                  f"{lru_hit_rate(trace, slots):>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
