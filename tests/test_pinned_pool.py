"""The pool of page-locked host buffers (sparda.cache.pinned), with the CUDA driver's
register/unregister replaced by fakes that record every call (the CPU has no driver)."""

from __future__ import annotations

import gc

import pytest
import torch

from sparda.cache import host, pinned
from sparda.errors import SpardaError


class FakeDriver:
    """``register`` / ``unregister`` that keep the set of registered ``ptr -> size``."""

    def __init__(self, fail: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.fail = fail  # registrations to refuse first (error code 2)

    def register(self, ptr: int, size: int) -> int:
        if self.fail:
            self.fail -= 1
            return 2
        assert ptr % pinned.PAGE == 0 and size % pinned.PAGE == 0 and ptr not in self.registered
        self.registered[ptr] = size
        return 0

    def unregister(self, ptr: int) -> None:
        self.registered.pop(ptr)
        self.unregistered.append(ptr)


def _pool(max_bytes=1 << 30, fail=0):
    driver = FakeDriver(fail)
    return pinned.PinnedPool(max_bytes, driver.register, driver.unregister), driver


def test_freed_buffer_comes_back_zeroed(fresh_seed):
    """A freed tensor's registered buffer serves the next request of the same page-rounded
    size: same address, no new registration, and zeros where the last user wrote data."""
    pool, driver = _pool()
    gen = torch.Generator().manual_seed(fresh_seed)
    t = pool.zeros((3, 5, 7), torch.bfloat16)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    ptr = t.data_ptr()
    assert driver.registered == {ptr: pinned.PAGE}  # 210 bytes: one page
    t.copy_(torch.randn(3, 5, 7, generator=gen) + 3)
    assert t.all()
    del t
    gc.collect()
    assert pool.reclaimable_bytes() == pinned.PAGE and driver.unregistered == []
    u = pool.zeros((7, 15), torch.float16)  # other shape and dtype, same pages
    assert u.data_ptr() == ptr and not u.any() and (pool.hits, pool.misses) == (1, 1)
    assert pool.reclaimable_bytes() == 0
    w = pool.zeros((3 * pinned.PAGE,), torch.uint8)  # three pages: a new buffer
    assert w.data_ptr() != ptr and pool.misses == 2 and len(driver.registered) == 2


def test_a_view_keeps_the_buffer_in_use():
    pool, _ = _pool()
    t = pool.zeros((4, 1024), torch.float32)
    ptr, view = t.data_ptr(), t[2:, 10:]
    del t
    gc.collect()
    assert pool.reclaimable_bytes() == 0  # the view still uses it
    second = pool.zeros((4, 1024), torch.float32)
    assert second.data_ptr() != ptr and pool.misses == 2
    del view
    gc.collect()
    assert pool.reclaimable_bytes() == 4 * 4096
    assert pool.zeros((4, 1024), torch.float32).data_ptr() == ptr and pool.hits == 1
    assert second.shape == (4, 1024)


def test_pool_keeps_at_most_max_bytes_oldest_out_first():
    pool, driver = _pool(max_bytes=2 * pinned.PAGE)
    a, b, c = (pool.zeros((n * pinned.PAGE,), torch.uint8) for n in (1, 1, 2))
    pa, pb, pc = a.data_ptr(), b.data_ptr(), c.data_ptr()
    del a
    gc.collect()
    del b
    gc.collect()
    del c
    gc.collect()
    assert pool.reclaimable_bytes() == 2 * pinned.PAGE  # a and b went out to make room for c
    assert driver.unregistered == [pa, pb] and list(driver.registered) == [pc]
    assert pool.release() == 2 * pinned.PAGE and driver.registered == {} and pool.reclaimable_bytes() == 0


def test_zero_max_bytes_unregisters_at_once():
    pool, driver = _pool(max_bytes=0)
    t = pool.zeros((100,), torch.float32)
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert driver.unregistered == [ptr]  # by the finalizer itself, no later pool call needed
    assert pool.reclaimable_bytes() == 0


def test_buffer_freed_while_the_pool_is_locked_is_filed_later():
    """A finalizer that runs while the pool's lock is held (a garbage collection inside its
    own critical section) only queues the buffer; release() files and frees it."""
    pool, driver = _pool()
    t = pool.zeros((3 * pinned.PAGE,), torch.uint8)
    ptr = t.data_ptr()
    with pool._lock:
        del t
        gc.collect()
        assert pool.cached_bytes == 0 and len(pool._returned) == 1
    assert pool.release() == 3 * pinned.PAGE and driver.unregistered == [ptr]


def test_reuse_waits_for_the_device_of_the_freed_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(pinned.torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(pinned.torch.cuda, "synchronize", lambda device=None: calls.append(device))
    pool, _ = _pool()
    t = pool.zeros((10,), torch.float32, device="cuda:1")
    assert calls == []  # a fresh buffer has no copies to wait for
    del t
    gc.collect()
    u = pool.zeros((10,), torch.float32, device="cuda:0")
    assert calls == ["cuda:1"] and pool.hits == 1
    del u
    gc.collect()
    pool.zeros((10,), torch.float32)
    assert calls == ["cuda:1", "cuda:0"]


def test_make_room_evicts_only_what_the_request_needs(monkeypatch):
    """No free memory at all (as the OS reports it, which does not change here): a 20-page
    request evicts the oldest kept buffer (64 pages) and keeps the two younger ones."""
    pool, driver = _pool()
    bufs = [pool.zeros((n * pinned.PAGE,), torch.uint8) for n in (64, 16, 16)]
    ptrs = [b.data_ptr() for b in bufs]
    for i in range(3):
        bufs[i] = None
        gc.collect()
    monkeypatch.setattr(pinned, "os_free_bytes", lambda: 0)
    new = pool.zeros((20 * pinned.PAGE,), torch.uint8)
    assert driver.unregistered == ptrs[:1] and pool.reclaimable_bytes() == 32 * pinned.PAGE
    assert new.numel() == 20 * pinned.PAGE


def test_refused_registration_releases_the_pool_then_says_what_to_do():
    pool, driver = _pool()
    kept = pool.zeros((pinned.PAGE,), torch.uint8)
    del kept
    gc.collect()
    driver.fail = 1  # refused once: the pool gives its buffer back and the retry succeeds
    t = pool.zeros((2 * pinned.PAGE,), torch.uint8)
    assert len(driver.unregistered) == 1 and list(driver.registered.values()) == [2 * pinned.PAGE]
    driver.fail = 2
    with pytest.raises(SpardaError, match=r"could not page-lock 4 MiB .*ulimit -l"):
        pool.zeros((1024 * pinned.PAGE,), torch.uint8)
    assert t.shape == (2 * pinned.PAGE,)


def test_default_pool_bytes(monkeypatch):
    monkeypatch.setenv(pinned.POOL_ENV, "1.5")
    assert pinned.default_pool_bytes() == 3 << 29
    monkeypatch.setenv(pinned.POOL_ENV, "0")
    assert pinned.default_pool_bytes() == 0
    for bad in ("-1", "lots", "nan", "inf", "1e400"):
        monkeypatch.setenv(pinned.POOL_ENV, bad)
        with pytest.raises(SpardaError, match=pinned.POOL_ENV):
            pinned.default_pool_bytes()
    monkeypatch.delenv(pinned.POOL_ENV)
    sizes = {"SC_PHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(pinned.os, "sysconf", lambda name: sizes[name])
    assert pinned.default_pool_bytes() == 1000 * 4096 // 4  # a quarter of physical memory


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "mixed"])
def test_second_offloaded_cache_reuses_the_first_ones_memory(kv_dtype, monkeypatch):
    """What a second generate call sees: its pinned host store registers nothing new, and every
    plane reads zeros although the first store was written."""
    pool, driver = _pool()
    monkeypatch.setattr(pinned, "POOL", pool)
    args = dict(layers=[0, 2], batch=3, num_kv_heads=2, head_dim=16, num_blocks=4, block_size=8,
                dtype=torch.bfloat16, pin=True, kv_dtype=kv_dtype, hot_blocks=2)

    def planes(store):
        out = []
        for chunks in (*store.chunks.values(), *store.pool.values()):
            for chunk in chunks:
                for plane in chunk.planes():
                    out += [plane.k, plane.v]
        return out

    first = host.HostKVStore(**args)
    registered = len(driver.registered)
    assert registered == len(planes(first)) and pool.misses == registered
    for p in planes(first):
        p.fill_(7)
    del first, p
    gc.collect()
    second = host.HostKVStore(**args)
    assert len(driver.registered) == registered and pool.hits == registered
    assert all(not p.any() for p in planes(second))


def test_kept_buffers_count_as_free_and_go_back_when_in_the_way(monkeypatch):
    """``available_host_bytes`` counts what the pool keeps; a store of the same sizes reuses
    its buffers even with little free memory; one of other sizes makes the pool give back its
    oldest buffers until the OS has room for each new one, and no more."""
    pool, driver = _pool()
    monkeypatch.setattr(pinned, "POOL", pool)
    page, free = 4096, {"pages": 1 << 20}
    monkeypatch.setattr(pinned.os, "sysconf", lambda name: page if name == "SC_PAGE_SIZE" else free["pages"])
    unregister = driver.unregister

    def unregister_frees(ptr):  # the OS gets the pages back
        free["pages"] += driver.registered[ptr] // page
        unregister(ptr)

    register = driver.register

    def register_takes(ptr, size):
        free["pages"] -= size // page
        return register(ptr, size)

    pool._register, pool._unregister = register_takes, unregister_frees
    kept = pool.zeros((64 * page,), torch.uint8)  # 256 KiB, oldest
    del kept
    gc.collect()
    assert host.available_host_bytes() == (1 << 20) * page  # the kept 256 KiB count as free
    small = dict(layers=[0], batch=1, num_kv_heads=1, head_dim=64, num_blocks=8, block_size=32,
                 dtype=torch.float32, pin=True)  # K and V planes of 64 KiB
    store = host.HostKVStore(**small)
    del store
    gc.collect()
    free["pages"] = 0
    store = host.HostKVStore(**small)  # both planes from the pool: nothing given back
    assert driver.unregistered == [] and pool.hits == 2
    del store
    gc.collect()
    big = dict(small, num_blocks=16)  # planes of 128 KiB: the 256 KiB buffer goes, then one 64 KiB
    store = host.HostKVStore(**big)
    assert len(driver.unregistered) == 2 and pool.reclaimable_bytes() == 16 * page
    assert host.available_host_bytes() == (64 - 32 + 16 - 32 + 16) * page
    assert all(not p.any() for c in store.chunks[0] for p in (c.k, c.v))
