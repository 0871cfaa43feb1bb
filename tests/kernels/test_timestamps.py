"""The device clock's accounting kernel (sparda.cache.timestamps) under the Triton interpreter:
copy, exposed and exposed-transfer totals against a Python brute force over random stamps.
(The timer read itself is PTX inline assembly and runs on the GPU only.)"""

import pytest
import torch

from sparda.cache.timestamps import STAMPS_PER_LAYER, DeviceClock


def test_account_kernel_matches_brute_force(fresh_seed):
    seed = fresh_seed
    g = torch.Generator().manual_seed(seed)
    layers = 6
    clock = DeviceClock.__new__(DeviceClock)
    clock.stamps = torch.zeros(layers, STAMPS_PER_LAYER, dtype=torch.long)
    clock.totals = torch.zeros(3, dtype=torch.long)
    want = [0, 0, 0]
    for _ in range(3):  # steps: the totals accumulate
        for layer in range(layers):
            # ready <= start <= end on the copy's streams; wait anywhere (before, inside, after the copy)
            ready = int(torch.randint(0, 10_000, (1,), generator=g))
            start = ready + int(torch.randint(0, 3_000, (1,), generator=g))
            end = start + int(torch.randint(0, 8_000, (1,), generator=g))
            wait = int(torch.randint(0, 25_000, (1,), generator=g))
            row = [0] * STAMPS_PER_LAYER
            row[DeviceClock.START], row[DeviceClock.END] = start, end
            row[DeviceClock.WAIT], row[DeviceClock.READY] = wait, ready
            early = 0
            if layer % 2:  # an early copy (lookahead 2, design §6.2) before the layer's own
                first = int(torch.randint(0, 5_000, (1,), generator=g))
                early = int(torch.randint(0, 4_000, (1,), generator=g))
                row[DeviceClock.EARLY_START], row[DeviceClock.EARLY_END] = first, first + early
            clock.stamps[layer] = torch.tensor(row)
            clock.account(layer)
            want[0] += end - start + early
            want[1] += max(0, end - wait)
            want[2] += max(0, end - max(wait, ready))
    assert clock.totals.tolist() == want, f"seed {seed}"
    assert want[2] <= want[1]  # the transfer's part is a part of the stall
    copy, exposed, transfer = clock.drain()
    assert (copy, exposed, transfer) == pytest.approx([w / 1e6 for w in want]) and clock.totals.tolist() == [0, 0, 0]
    tl = clock.timeline([1, 3])
    assert [r["layer"] for r in tl] == [1, 3]
    assert all(("early_start" in r) == bool(r["layer"] % 2) for r in tl)
    assert min(min(r[k] for k in ("ready", "start", "end", "wait", "early_start", "early_end") if k in r)
               for r in tl) == 0.0
    assert tl[0]["end"] - tl[0]["start"] == pytest.approx((clock.stamps[1, 1] - clock.stamps[1, 0]).item() / 1e3, abs=0.011)
