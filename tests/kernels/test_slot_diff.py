"""The slot-diff kernel (interpreter) against the sort-based PyTorch twin and a brute force."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.kernels import slot_diff as dispatch  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.kernels.slot_diff import slot_diff_triton  # noqa: E402


def _case(gen, b, h, s, n, block_size):
    """Random block maps (distinct blocks or -1) and selections of at most S blocks plus the current one."""
    pos = torch.randint(block_size * 2, n * block_size, (b,), generator=gen)
    slot_map = torch.full((b, h, s), -1, dtype=torch.long)
    ids = torch.full((b, h, s + 1), -1, dtype=torch.int32)
    for i in range(b):
        cur = int(pos[i]) // block_size
        for j in range(h):
            held = torch.randperm(cur, generator=gen)[:int(torch.randint(0, s + 1, (1,), generator=gen))]
            where = torch.randperm(s, generator=gen)[:held.numel()]
            slot_map[i, j, where] = held
            k = int(torch.randint(0, min(s, cur) + 1, (1,), generator=gen))
            # overlap with what is held, so that hits, misses and stale slots all occur
            pool = torch.unique(torch.cat([held, torch.randperm(cur, generator=gen)[:s]]))
            chosen = pool[torch.randperm(pool.numel(), generator=gen)[:k]]
            if torch.rand((), generator=gen) < 0.7:
                chosen = torch.cat([chosen, torch.tensor([cur])])
            chosen = torch.sort(chosen).values
            ids[i, j, :chosen.numel()] = chosen.int()
    return ids, slot_map, pos


def _brute(ids, slot_map, pos, block_size):
    """Python loops over one (row, head) at a time: the rule as written in design §6."""
    b, h, s = slot_map.shape
    load = torch.full_like(slot_map, -1)
    new_map = slot_map.clone()
    attn = torch.full((b, h, s + 1), -1, dtype=torch.long)
    hits = torch.zeros(b, dtype=torch.long)
    misses = torch.zeros(b, dtype=torch.long)
    for i in range(b):
        cur = int(pos[i]) // block_size
        for j in range(h):
            want = [int(x) for x in ids[i, j] if x >= 0 and x != cur]
            held = [int(x) for x in slot_map[i, j]]
            missed = sorted(x for x in want if x not in held)
            free = [k for k in range(s) if held[k] < 0] + [k for k in range(s) if held[k] >= 0 and held[k] not in want]
            for block, slot in zip(missed, free):
                load[i, j, slot] = block
                new_map[i, j, slot] = block
            hits[i] += sum(1 for x in held if x >= 0 and x in want)
            misses[i] += len(missed)
            for k in range(s):
                if int(new_map[i, j, k]) in want:
                    attn[i, j, k] = new_map[i, j, k]
            attn[i, j, s] = cur
    return load, new_map, attn, hits, misses


@pytest.mark.parametrize("b,h,s,n,block_size", [(3, 2, 5, 9, 16), (2, 3, 12, 40, 8), (1, 1, 1, 4, 4)])
def test_slot_diff_kernel_matches_twin_and_brute_force(b, h, s, n, block_size, fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    for _ in range(3):
        ids, slot_map, pos = _case(gen, b, h, s, n, block_size)
        expect = _brute(ids, slot_map, pos, block_size)
        outs = []
        for fn in (slot_diff_triton, twins.slot_diff_reference):
            sm = slot_map.clone()
            load = torch.full_like(sm, -5)
            attn = torch.full((b, h, s + 1), -5, dtype=torch.int32)
            counters = tuple(torch.zeros(b, dtype=torch.long) for _ in range(4))
            fn(ids, sm, pos, block_size, n, load, attn, counters)
            outs.append((load, sm, attn.long(), *counters))
        for load, sm, attn, hits, misses, read, valid in outs:
            assert torch.equal(load, expect[0])
            assert torch.equal(sm, expect[1])
            assert torch.equal(attn, expect[2])
            assert torch.equal(hits, expect[3]) and torch.equal(misses, expect[4])
            assert torch.equal(read, (ids >= 0).sum((-1, -2)))
            assert torch.equal(valid, (pos // block_size + 1) * h)


def test_slot_diff_dispatch_runs_the_twin_on_cpu_tensors(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    ids, slot_map, pos = _case(gen, 2, 2, 6, 20, 8)
    load = torch.empty_like(slot_map)
    attn = torch.empty(2, 2, 7, dtype=torch.int32)
    dispatch(ids, slot_map, pos, 8, 20, load, attn)
    expect = _brute(ids, _case(torch.Generator().manual_seed(fresh_seed), 2, 2, 6, 20, 8)[1], pos, 8)
    assert torch.equal(load, expect[0]) and torch.equal(attn.long(), expect[2])
