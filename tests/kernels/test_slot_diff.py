"""The slot-diff kernel (interpreter) against the sort-based PyTorch twin and a brute force."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda.kernels import slot_diff as dispatch  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.kernels.slot_diff import slot_diff_triton  # noqa: E402


def _case(gen, b, h, s, n, block_size, width=None):
    """Random block maps (distinct blocks or -1) and selections of at most ``width`` (default
    S) blocks plus the current one; ``width < S`` leaves spare slots (design §6)."""
    width = s if width is None else width
    pos = torch.randint(block_size * 2, n * block_size, (b,), generator=gen)
    slot_map = torch.full((b, h, s), -1, dtype=torch.long)
    ids = torch.full((b, h, width + 1), -1, dtype=torch.int32)
    for i in range(b):
        cur = int(pos[i]) // block_size
        for j in range(h):
            held = torch.randperm(cur, generator=gen)[:int(torch.randint(0, s + 1, (1,), generator=gen))]
            where = torch.randperm(s, generator=gen)[:held.numel()]
            slot_map[i, j, where] = held
            k = int(torch.randint(0, min(width, cur) + 1, (1,), generator=gen))
            # overlap with what is held, so that hits, misses and stale slots all occur
            pool = torch.unique(torch.cat([held, torch.randperm(cur, generator=gen)[:s]]))
            chosen = pool[torch.randperm(pool.numel(), generator=gen)[:k]]
            if torch.rand((), generator=gen) < 0.7:
                chosen = torch.cat([chosen, torch.tensor([cur])])
            chosen = torch.sort(chosen).values
            ids[i, j, :chosen.numel()] = chosen.int()
    return ids, slot_map, pos


def _brute(ids, slot_map, pos, block_size, c_width=None):
    """Python loops over one (row, head) at a time: the rule as written in design §6; with
    ``c_width`` also the compact (block, slot) attention list of that width."""
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
    if c_width is None:
        return load, new_map, attn, hits, misses
    c_blk = torch.full((b, h, c_width), -1, dtype=torch.long)
    c_slot = torch.zeros((b, h, c_width), dtype=torch.long)
    for i in range(b):
        for j in range(h):
            pairs = [(int(attn[i, j, k]), k) for k in range(s) if attn[i, j, k] >= 0]
            assert len(pairs) <= c_width - 1
            for e, (block, slot) in enumerate(pairs):
                c_blk[i, j, e], c_slot[i, j, e] = block, slot
            c_blk[i, j, -1], c_slot[i, j, -1] = attn[i, j, s], s
    return load, new_map, attn, hits, misses, c_blk, c_slot


@pytest.mark.parametrize("b,h,s,n,block_size,width", [(3, 2, 5, 9, 16, None), (2, 3, 12, 40, 8, None),
                                                      (1, 1, 1, 4, 4, None), (2, 2, 11, 40, 8, 6),
                                                      (3, 1, 20, 60, 4, 9), (2, 3, 7, 30, 8, 1)])
def test_slot_diff_kernel_matches_twin_and_brute_force(b, h, s, n, block_size, width, fresh_seed):
    """Every output of the kernel and the twin equals the brute force, with spare slots
    (``width < S``: the selection is narrower than the slot buffer) and without, and the
    compact attention list (at its narrowest width and wider) too."""
    gen = torch.Generator().manual_seed(fresh_seed)
    for trial in range(3):
        ids, slot_map, pos = _case(gen, b, h, s, n, block_size, width)
        c_width = min(ids.shape[-1], s) + 1 + trial  # the narrowest allowed, then padded wider
        expect = _brute(ids, slot_map, pos, block_size, c_width)
        outs = []
        for fn in (slot_diff_triton, twins.slot_diff_reference):
            sm = slot_map.clone()
            load = torch.full_like(sm, -5)
            attn = torch.full((b, h, s + 1), -5, dtype=torch.int32)
            compact = (torch.full((b, h, c_width), -5, dtype=torch.int32), torch.full((b, h, c_width), -5, dtype=torch.int32))
            counters = tuple(torch.zeros(b, dtype=torch.long) for _ in range(4))
            fn(ids, sm, pos, block_size, n, load, attn, counters, compact)
            outs.append((load, sm, attn.long(), *counters, compact[0].long(), compact[1].long()))
        for name, (load, sm, attn, hits, misses, read, valid, c_blk, c_slot) in zip(("kernel", "twin"), outs):
            where = f"{name}, seed {fresh_seed}, trial {trial}"
            assert torch.equal(load, expect[0]), where
            assert torch.equal(sm, expect[1]), where
            assert torch.equal(attn, expect[2]), where
            assert torch.equal(hits, expect[3]) and torch.equal(misses, expect[4]), where
            assert torch.equal(read, (ids >= 0).sum((-1, -2))), where
            assert torch.equal(valid, (pos // block_size + 1) * h), where
            assert torch.equal(c_blk, expect[5]) and torch.equal(c_slot, expect[6]), where


def test_spare_slots_keep_a_block_that_returns(fresh_seed):
    """With spare slots a block that leaves the selection stays in its slot and is a hit
    when it comes back; without them the next miss overwrites it."""
    del fresh_seed  # a fixed scenario
    bs, n = 4, 30
    pos = torch.tensor([n * bs - 1])
    seq = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]  # block 3 leaves, then returns
    for slots, want_hits in ((3, 2), (5, 3)):
        sm = torch.full((1, 1, slots), -1, dtype=torch.long)
        load, attn = torch.empty_like(sm), torch.empty(1, 1, slots + 1, dtype=torch.int32)
        for sel in seq:
            counters = tuple(torch.zeros(1, dtype=torch.long) for _ in range(4))
            slot_diff_triton(torch.tensor([[sel]], dtype=torch.int32), sm, pos, bs, n, load, attn, counters)
        assert int(counters[0]) == want_hits, (slots, int(counters[0]))


def test_slot_diff_dispatch_runs_the_twin_on_cpu_tensors(fresh_seed):
    gen = torch.Generator().manual_seed(fresh_seed)
    ids, slot_map, pos = _case(gen, 2, 2, 6, 20, 8)
    load = torch.empty_like(slot_map)
    attn = torch.empty(2, 2, 7, dtype=torch.int32)
    dispatch(ids, slot_map, pos, 8, 20, load, attn)
    expect = _brute(ids, _case(torch.Generator().manual_seed(fresh_seed), 2, 2, 6, 20, 8)[1], pos, 8)
    assert torch.equal(load, expect[0]) and torch.equal(attn.long(), expect[2])


def _brute_early(ids, slot_map, protect, pos, block_size):
    """The early diff of design §6.2 in Python loops: misses of the prediction, in block order, go to
    empty slots, then to slots holding a block neither predicted nor protected; the rest are dropped."""
    b, h, s = slot_map.shape
    load, new_map = torch.full_like(slot_map, -1), slot_map.clone()
    loaded = torch.zeros(b, dtype=torch.long)
    for i in range(b):
        cur = int(pos[i]) // block_size
        for j in range(h):
            want = [int(x) for x in ids[i, j] if x >= 0 and x != cur]
            held = [int(x) for x in slot_map[i, j]]
            kept = [int(protect[i, j, k]) >= 0 for k in range(s)]
            missed = sorted(x for x in want if x not in held)
            free = [k for k in range(s) if held[k] < 0] + [
                k for k in range(s) if held[k] >= 0 and held[k] not in want and not kept[k]]
            for block, slot in zip(missed, free):
                load[i, j, slot] = block
                new_map[i, j, slot] = block
                loaded[i] += 1
    return load, new_map, loaded


@pytest.mark.parametrize("b,h,s,n,block_size,width", [(3, 2, 9, 40, 8, 6), (2, 3, 5, 20, 8, 5), (1, 2, 12, 60, 4, 8)])
def test_protected_slot_diff_matches_twin_and_brute_force(b, h, s, n, block_size, width, fresh_seed):
    """``protect`` (the early diff): kernel and twin equal the brute force in the block map, the copy
    list and the count of loaded blocks, including predictions with more misses than open slots."""
    gen = torch.Generator().manual_seed(fresh_seed)
    for trial in range(4):
        ids, slot_map, pos = _case(gen, b, h, s, n, block_size, width)
        protect = torch.where(torch.rand(b, h, s + 1, generator=gen) < 0.5, 1, -1).to(torch.int32)
        protect = torch.where(slot_map >= 0, protect[..., :s], -1).to(torch.int32)
        protect = torch.cat([protect, torch.zeros(b, h, 1, dtype=torch.int32)], -1)
        expect = _brute_early(ids, slot_map, protect, pos, block_size)
        for name, fn in (("kernel", slot_diff_triton), ("twin", twins.slot_diff_reference)):
            sm, load = slot_map.clone(), torch.full_like(slot_map, -5)
            attn = torch.full((b, h, s + 1), -5, dtype=torch.int32)
            counters = tuple(torch.zeros(b, dtype=torch.long) for _ in range(4))
            fn(ids, sm, pos, block_size, n, load, attn, counters, None, protect)
            where = f"{name}, seed {fresh_seed}, trial {trial}"
            assert torch.equal(load, expect[0]), where
            assert torch.equal(sm, expect[1]), where
            assert torch.equal(counters[1], expect[2]), where
