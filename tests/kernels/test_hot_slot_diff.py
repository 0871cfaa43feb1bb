"""``kv_dtype`` ``mixed``'s hot pool inside the slot diff (design §6.1, §6.2): the kernel
(interpreter) and its PyTorch twin against a brute force in Python loops that applies the
rule block by block, then the plain diff, then the split, on fresh random hot-pool states,
edge cases included (empty pool, full pool, every block hot, everything demoted, one hot
pass over several tiles)."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("triton")

from sparda.cache.hot import NEVER  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.kernels.slot_diff import slot_diff_triton  # noqa: E402
from test_slot_diff import _brute, _brute_early, _case  # noqa: E402

slot_diff_mod = importlib.import_module("sparda.kernels.slot_diff")  # the module (the package's name is the dispatch)


def _state(gen, pos, n, bs, pool, steps, kind):
    """Random ``hot [B, H, N]`` / ``last [B, H, N]`` of kind ``random`` (mostly recent hot
    blocks, recent or stale ``last``), ``empty``, ``full`` (every block of the pool's window
    hot, last selected just now), ``all`` (every block hot) or ``stale`` (every block hot, none
    selected for ``R`` steps)."""
    b = pos.shape[0]
    h = 2
    hot = torch.zeros(b, h, n, dtype=torch.bool)
    last = torch.full((b, h, n), NEVER, dtype=torch.long)
    for i in range(b):
        p = int(pos[i])
        cur = p // bs
        blocks = torch.arange(n)
        if kind == "random":
            recent = (blocks > cur - pool - 2) & (blocks <= cur)
            hot[i] = (torch.rand(h, n, generator=gen) < torch.where(recent, 0.6, 0.05))
            ago = torch.randint(0, 2 * steps + 2, (h, n), generator=gen)
            last[i] = torch.where(torch.rand(h, n, generator=gen) < 0.8, p - ago, NEVER)
        elif kind == "full":
            hot[i] = (blocks > cur - pool) & (blocks <= cur)
            last[i] = torch.where(hot[i], p - 1, NEVER)
        elif kind == "all":
            hot[i] = True
            last[i] = p - torch.randint(0, steps + 1, (h, n), generator=gen)
        elif kind == "stale":
            hot[i] = True
            last[i] = p - steps
    return hot, last


def _brute_rule(hot, last, ids, pos, bs, local, pool, steps):
    """The rule of design §6.1, block by block: ``(hot', last', demoted)``."""
    hot, last = hot.clone(), last.clone()
    demoted = torch.zeros_like(hot)
    b, h, n = hot.shape
    for i in range(b):
        p = int(pos[i])
        cur = p // bs
        for j in range(h):
            picked = {int(x) for x in ids[i, j] if 0 <= x < n} | set(range(max(0, cur - local + 1), min(n, cur + 1)))
            for m in picked:
                last[i, j, m] = p
            for m in range(n):
                keep = (bool(hot[i, j, m]) and p - int(last[i, j, m]) < steps and m > cur - pool) or m == cur
                demoted[i, j, m] = bool(hot[i, j, m]) and not keep
                hot[i, j, m] = keep
    return hot, last, demoted


def _brute_split(hot, load, pos, bs, pool, early):
    """Per slot: a hot block's pool slot, a cold block's id (an early copy: hot only if its pool
    slot is not the current block's)."""
    from_pool, cold = torch.full_like(load, -1), torch.full_like(load, -1)
    for i, j, s in (load >= 0).nonzero().tolist():
        m = int(load[i, j, s])
        is_hot = bool(hot[i, j, m]) and (not early or m > int(pos[i]) // bs - pool)
        if is_hot:
            from_pool[i, j, s] = m % pool
        else:
            cold[i, j, s] = m
    return from_pool, cold


def _run(fn, ids, slot_map, pos, bs, n, hot, last, pool, steps, local, update, c_width=None, protect=None):
    b, h, s = slot_map.shape
    sm, load = slot_map.clone(), torch.full_like(slot_map, -5)
    attn = torch.full((b, h, s + 1), -5, dtype=torch.int32)
    compact = None if c_width is None else tuple(torch.full((b, h, c_width), -5, dtype=torch.int32) for _ in range(2))
    counters = tuple(torch.zeros(b, dtype=torch.long) for _ in range(4))
    state = twins.HotSplit(hot.clone(), last.clone(), torch.full_like(slot_map, -5), torch.full_like(slot_map, -5),
                           torch.full((b,), 3, dtype=torch.long), pool, steps, local, update)
    fn(ids, sm, pos, bs, n, load, attn, counters, compact, protect, state)
    return sm, load, attn.long(), counters, compact, state


KINDS = ["random"] * 4 + ["empty", "full", "all", "stale"]


@pytest.mark.parametrize("tile", [1024, 8])
@pytest.mark.parametrize("b,s,n,bs,width,pool,steps,local", [
    (3, 6, 24, 8, 4, 5, 2, 2), (2, 12, 40, 4, 6, 9, 3, 3), (2, 5, 9, 16, None, 9, 1, 1), (1, 20, 60, 4, 9, 12, 4, 2)])
def test_hot_fetch_diff_matches_twin_and_brute_force(b, s, n, bs, width, pool, steps, local, tile, fresh_seed,
                                                     monkeypatch):
    """A fetch (``update``): the rule's new state, the demoted blocks' slots emptied before the
    diff, the diff's outputs, the split and the pool-miss counter equal the brute force, for
    the kernel (hot pass of ``tile`` blocks) and the twin."""
    monkeypatch.setattr(slot_diff_mod, "HOT_TILE", tile)
    gen = torch.Generator().manual_seed(fresh_seed)
    seen = dict(evicted=0, pool=0, cold=0)
    for trial, kind in enumerate(KINDS):
        ids, slot_map, pos = _case(gen, b, 2, s, n, bs, width)
        if kind == "stale" and trial % 2 == 0:
            ids = torch.full_like(ids, -1)  # nothing selected: everything but the current block demoted
        hot, last = _state(gen, pos, n, bs, pool, steps, kind)
        c_width = min(ids.shape[-1], s) + 1
        want_hot, want_last, demoted = _brute_rule(hot, last, ids, pos, bs, local, pool, steps)
        held = torch.where(torch.gather(demoted, -1, slot_map.clamp(min=0)) & (slot_map >= 0), -1, slot_map)
        expect = _brute(ids, held, pos, bs, c_width)
        want_pool, want_cold = _brute_split(want_hot, expect[0], pos, bs, pool, early=False)
        seen["evicted"] += int((held != slot_map).sum())
        seen["pool"] += int((want_pool >= 0).sum())
        seen["cold"] += int((want_cold >= 0).sum())
        for name, fn in (("kernel", slot_diff_triton), ("twin", twins.slot_diff_reference)):
            sm, load, attn, counters, compact, state = _run(fn, ids, slot_map, pos, bs, n, hot, last, pool, steps,
                                                            local, True, c_width)
            where = f"{name}, {kind}, seed {fresh_seed}, trial {trial}"
            assert torch.equal(state.hot, want_hot), where
            assert torch.equal(state.last, want_last), where
            assert torch.equal(load, expect[0]) and torch.equal(sm, expect[1]), where
            assert torch.equal(attn, expect[2]), where
            assert torch.equal(counters[0], expect[3]) and torch.equal(counters[1], expect[4]), where
            assert torch.equal(compact[0].long(), expect[5]) and torch.equal(compact[1].long(), expect[6]), where
            assert torch.equal(state.pool_load, want_pool) and torch.equal(state.cold_load, want_cold), where
            assert torch.equal(state.pool_misses, 3 + (want_pool >= 0).sum((1, 2))), where
        if kind == "stale" and trial % 2 == 0:
            assert want_hot.sum() == want_hot.shape[0] * want_hot.shape[1]  # the current blocks alone
    assert min(seen.values()) > 0, (seen, f"seed {fresh_seed}")  # slots emptied, pool and cold copies all seen


@pytest.mark.parametrize("b,s,n,bs,width,pool", [(3, 9, 40, 8, 6, 5), (2, 12, 60, 4, 8, 11)])
def test_hot_early_diff_splits_without_the_rule(b, s, n, bs, width, pool, fresh_seed):
    """The early diff (``protect``, no ``update``, design §6.2): the hot state is only read, the
    slots are those of the protected diff, and a hot block whose pool slot the current block
    takes is copied as int4."""
    gen = torch.Generator().manual_seed(fresh_seed)
    for trial, kind in enumerate(KINDS):
        ids, slot_map, pos = _case(gen, b, 2, s, n, bs, width)
        protect = torch.where((torch.rand(b, 2, s, generator=gen) < 0.5) & (slot_map >= 0), 1, -1)
        protect = torch.cat([protect, torch.zeros(b, 2, 1, dtype=torch.long)], -1).to(torch.int32)
        hot, last = _state(gen, pos, n, bs, pool, 3, kind)
        expect = _brute_early(ids, slot_map, protect, pos, bs)
        want_pool, want_cold = _brute_split(hot, expect[0], pos, bs, pool, early=True)
        for name, fn in (("kernel", slot_diff_triton), ("twin", twins.slot_diff_reference)):
            sm, load, _, counters, _, state = _run(fn, ids, slot_map, pos, bs, n, hot, last, pool, 3, 2, False,
                                                   protect=protect)
            where = f"{name}, {kind}, seed {fresh_seed}, trial {trial}"
            assert torch.equal(state.hot, hot) and torch.equal(state.last, last), where
            assert torch.equal(load, expect[0]) and torch.equal(sm, expect[1]), where
            assert torch.equal(counters[1], expect[2]), where
            assert torch.equal(state.pool_load, want_pool) and torch.equal(state.cold_load, want_cold), where
            assert torch.equal(state.pool_misses, 3 + (want_pool >= 0).sum((1, 2))), where


def test_hot_operands_are_checked(fresh_seed):
    from sparda.errors import SpardaError

    gen = torch.Generator().manual_seed(fresh_seed)
    ids, slot_map, pos = _case(gen, 2, 2, 6, 20, 8)
    hot, last = _state(gen, pos, 20, 8, 4, 2, "random")
    _, _, _, _, _, good = _run(twins.slot_diff_reference, ids, slot_map, pos, 8, 20, hot, last, 4, 2, 2, True)
    load, attn = torch.empty_like(slot_map), torch.empty(2, 2, 7, dtype=torch.int32)
    bads = ((good._replace(hot=hot.long()), "hot state"), (good._replace(cold_load=load[..., :3]), "cold_load"),
            (good._replace(pool_misses=pos[:1]), "pool_misses"), (good._replace(hot_steps=0), ">= 1"))
    for bad, match in bads:
        with pytest.raises(SpardaError, match=match):
            slot_diff_triton(ids, slot_map.clone(), pos, 8, 20, load, attn, hot=bad)
