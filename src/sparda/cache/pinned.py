"""Page-locked host buffers of the offloaded KV cache, reused across calls (design §6).

A buffer is page-aligned numpy memory registered with the CUDA driver (``cudaHostRegister``),
exactly its size rounded up to a page, not PyTorch's caching host allocator (which rounds
every request up to a power of two). Registering is slow: the driver touches and locks every
page: on the H200, 0.8-1.1 s for 2.6 GiB (16 prompts of 7,680 tokens of the bundled model)
and 4.3-4.8 s for 16 GiB (Llama-3.1-8B at 128K), against 0.06 and 0.27-0.33 s reused
(design §6). So when the last tensor of a buffer is gone the buffer
is not unregistered but kept, registered, in :data:`POOL`, and the next request of the same
page-rounded size takes it back (after a device synchronize, so that no copy of the freed
cache is still in flight, and zeroed) instead of registering new memory. The pool keeps at
most ``max_bytes`` (:func:`default_pool_bytes`), evicting its oldest buffers first, and also
before registering new memory that the OS could not otherwise fit;
:meth:`PinnedPool.release` unregisters everything it keeps.
"""

from __future__ import annotations

import collections
import math
import os
import threading
import weakref

import numpy as np
import torch

from sparda.errors import SpardaError

#: bytes of a page; buffers are aligned to it and sized in whole pages
PAGE = 4096
#: environment variable: most GiB the pool keeps registered once their tensors are gone
POOL_ENV = "SPARDA_PINNED_POOL_GIB"


def _cuda_register(ptr: int, size: int) -> int:  # pragma: no cover - CUDA only
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    return int(getattr(err, "value", err))


def _cuda_unregister(ptr: int) -> None:  # pragma: no cover - CUDA only
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - the CUDA context may already be gone at exit
        pass


def _sysconf_bytes(pages: str) -> int | None:
    """``os.sysconf(pages)`` pages in bytes (``None`` if the OS does not say)."""
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - platform dependent
        return None


def os_free_bytes() -> int | None:
    """Free physical memory in bytes, as the OS reports it (``None`` if it does not say)."""
    return _sysconf_bytes("SC_AVPHYS_PAGES")


def default_pool_bytes() -> int:
    """Most bytes :data:`POOL` keeps: ``$SPARDA_PINNED_POOL_GIB`` GiB if set (``0`` turns the
    reuse off), else a quarter of physical memory (0 if the OS does not say).

    Raises:
        SpardaError: ``$SPARDA_PINNED_POOL_GIB`` is not a non-negative number.
    """
    text = os.environ.get(POOL_ENV)
    if text is not None:
        try:
            gib = float(text)
        except ValueError:
            gib = -1.0
        if not (gib >= 0 and math.isfinite(gib)):
            raise SpardaError(f"{POOL_ENV}={text!r} is not a finite number of GiB >= 0; set it to e.g. 16, "
                              "or 0 to unregister page-locked memory as soon as its KV cache is freed")
        return int(gib * 2**30)
    return (_sysconf_bytes("SC_PHYS_PAGES") or 0) // 4


class PinnedPool:
    """Registered host buffers handed out as zeroed tensors and kept for reuse when freed.

    Args:
        max_bytes: most bytes kept registered while no tensor uses them (``None``:
            :func:`default_pool_bytes`, read at the first request).
        register: ``register(ptr, size) -> error code`` (0 = success); CUDA's
            ``cudaHostRegister`` by default (tests pass fakes).
        unregister: ``unregister(ptr)``; ``cudaHostUnregister`` by default.

    Thread-safe. A buffer whose tensors are gone is queued by a finalizer, which then takes
    the pool's lock only if it is free (so a garbage collection inside the pool's own critical
    section cannot deadlock) and files it, evicting past ``max_bytes``; a buffer queued while
    the lock was held is filed by the next call that takes it.
    """

    def __init__(self, max_bytes: int | None = None, register=_cuda_register, unregister=_cuda_unregister) -> None:
        self.max_bytes = max_bytes
        self._register, self._unregister = register, unregister
        self._lock = threading.Lock()
        self._returned: collections.deque = collections.deque()  # (size, buf, ptr, device) from finalizers
        self._free: list[tuple] = []  # kept (size, buf, ptr, device), oldest first
        #: bytes registered and kept in the pool (not in use)
        self.cached_bytes = 0
        #: requests served from the pool / by registering new memory
        self.hits = 0
        self.misses = 0

    def zeros(self, shape, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
        """A zeroed page-locked host tensor of ``shape``/``dtype`` (exactly its size, in pages).

        Args:
            device: the CUDA device whose copies will read or write the tensor; when its buffer
                is reused later, that device is synchronized first, so that no copy of the
                freed tensor is still in flight when the buffer is zeroed (``None``: the
                current CUDA device).
        Raises:
            SpardaError: the driver refused to page-lock the memory (the message names the size;
                the usual causes are the locked-memory limit, ``ulimit -l``, and free RAM), or
                ``$SPARDA_PINNED_POOL_GIB`` is malformed.
        """
        elem = torch.empty((), dtype=dtype).element_size()
        nbytes = int(np.prod(shape, dtype=np.int64)) * elem
        size = max(PAGE, -(-nbytes // PAGE) * PAGE)
        with self._lock:
            self._drain()
            found = next((i for i, entry in enumerate(self._free) if entry[0] == size), None)
            if found is not None:
                _, buf, ptr, last_device = self._free.pop(found)
                self.cached_bytes -= size
                self.hits += 1
            else:
                self._make_room(size)
        if found is not None:
            _synchronize(last_device)  # no copy of the freed tensor may still be in flight
            region = _region(buf, size)
            torch.from_numpy(region).zero_()  # as a fresh buffer: callers rely on zeros
        else:
            buf = np.zeros(size + PAGE, dtype=np.uint8)  # calloc: pages are zero-filled when touched
            region = _region(buf, size)
            ptr = region.ctypes.data
            err = self._register(ptr, size)
            if err != 0 and self.release():  # kept buffers may be what stands in the way
                err = self._register(ptr, size)
            if err != 0:
                raise SpardaError(f"could not page-lock {size / 2**20:,.0f} MiB of host memory (error {err}); raise "
                                  "the locked-memory limit (ulimit -l) or use a smaller batch or context")
            with self._lock:
                self.misses += 1
        lease = region[:nbytes]  # the ndarray the tensor holds: its death returns the buffer
        weakref.finalize(lease, self._give_back, (size, buf, ptr, device)).atexit = False
        return torch.from_numpy(lease).view(dtype).view(shape)

    def reclaimable_bytes(self) -> int:
        """Bytes registered by the pool that no tensor uses (what :meth:`release` would free)."""
        with self._lock:
            self._drain()
            return self.cached_bytes

    def release(self) -> int:
        """Unregisters and frees every kept buffer; returns the bytes freed."""
        with self._lock:
            self._drain()
            freed = self.cached_bytes
            while self._free:
                self._evict_oldest()
        return freed

    def _give_back(self, entry) -> None:
        """Finalizer of a lease: queue its buffer, and file it now if the lock is free."""
        self._returned.append(entry)
        if self._lock.acquire(blocking=False):
            try:
                self._drain()
            except SpardaError:  # a malformed cap: the next zeros() call reports it
                pass
            finally:
                self._lock.release()

    def _make_room(self, size: int) -> None:
        """Unregisters and frees kept buffers, oldest first, until the OS's free memory plus
        what they held reaches ``1.05 * size`` bytes (the caller holds the lock)."""
        free = os_free_bytes()
        while self._free and free is not None and free < 1.05 * size:
            free += self._evict_oldest()

    def _evict_oldest(self) -> int:
        """Unregisters and drops the oldest kept buffer; returns its bytes (lock held)."""
        size, _, ptr, _ = self._free.pop(0)
        self.cached_bytes -= size
        self._unregister(ptr)
        return size

    def _drain(self) -> None:
        """Moves finalizer-returned buffers into the pool and unregisters the oldest past
        ``max_bytes`` (the caller holds the lock)."""
        if self.max_bytes is None:
            self.max_bytes = default_pool_bytes()
        while self._returned:
            entry = self._returned.popleft()
            self._free.append(entry)
            self.cached_bytes += entry[0]
        while self._free and self.cached_bytes > self.max_bytes:
            self._evict_oldest()


def _synchronize(device) -> None:
    """Waits for ``device`` (``None``: the current CUDA device) if CUDA is initialised."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def _region(buf: np.ndarray, size: int) -> np.ndarray:
    """The page-aligned ``size`` bytes of ``buf`` (allocated ``size + PAGE`` long)."""
    off = (-buf.ctypes.data) % PAGE
    return buf[off:off + size]


#: the process's pool (:func:`pinned_zeros`)
POOL = PinnedPool()


def pinned_zeros(shape, dtype: torch.dtype, device: torch.device | str | None = None) -> torch.Tensor:
    """A zeroed host tensor of ``shape``/``dtype`` in page-locked memory of exactly its size
    (in whole pages), from :data:`POOL`: memory a freed KV cache registered is reused. The GPU
    reads and writes it through UVA and DMAs it asynchronously, like memory from
    ``cudaHostAlloc``. CUDA only.

    Raises:
        SpardaError: the driver refused to page-lock the memory (see :meth:`PinnedPool.zeros`).
    """
    return POOL.zeros(shape, dtype, device)
