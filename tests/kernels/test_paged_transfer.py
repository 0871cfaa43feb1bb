"""The uva transfer kernels through a block table (design §6), under the Triton interpreter
(ordinary CPU tensors stand in for pinned memory, which the interpreter cannot read through
UVA), against a brute-force walk through the table and against the sync engine.

A pool larger than needed, split into several chunks, a random permutation of pages with
blocks left unassigned: a gather of an unassigned block reads zeros, a store to one writes
nothing, every other page is untouched.

On a CUDA machine ``TRITON_INTERPRET=0 python3 -m pytest tests/kernels/test_paged_transfer.py``
runs the same checks compiled, on a pinned store read and written through UVA.
"""

from __future__ import annotations

import os

import pytest
import torch

from sparda.cache.host import HostKVStore
from sparda.cache.transfer import SyncEngine, UvaEngine
from sparda.kernels import quant

pytest.importorskip("triton")

#: the compiled kernels on CUDA (pinned store, device tables and slots), else the interpreter on CPU
DEV = "cuda" if os.environ.get("TRITON_INTERPRET") == "0" and torch.cuda.is_available() else "cpu"


def _store(kv_dtype: str, b: int, h: int, n: int, bs: int, d: int, chunks: int) -> HostKVStore:
    """A store of ``2 * b * n`` pages in about ``chunks`` chunks, rows given random pages
    (a random count each, one row none), random contents."""
    pages = 2 * b * n
    page_bytes = h * bs * quant.token_bytes(d, kv_dtype, torch.float32)
    store = HostKVStore([0], b, h, d, n, bs, torch.float32, pin=DEV == "cuda", kv_dtype=kv_dtype, host_blocks=pages,
                        chunk_bytes=page_bytes * -(-pages // chunks), device=DEV if DEV == "cuda" else None)
    order = torch.randperm(pages).tolist()
    for row in range(b - 1):
        store.table.assign(row, order[row * n:row * n + int(torch.randint(1, n + 1, ()))])
    for c in store.chunks[0]:
        for t in (c.k, c.v):
            if isinstance(t, quant.QuantizedKV):
                t.data.random_(0, 256)
                t.scale.normal_()
            else:
                t.normal_()
    return store


def _pool(store: HostKVStore, plane: int):
    """The whole pool's K and V of one plane ``[H, P, bs, x]`` (chunks concatenated)."""
    parts = [c.planes()[plane] for c in store.chunks[0]]
    return torch.cat([p.k for p in parts], 1), torch.cat([p.v for p in parts], 1)


def _brute_gather(pool, table, load, init):
    out = init.clone()
    for b, h, s in (load >= 0).nonzero().tolist():
        page = int(table[b, load[b, h, s]])
        out[b, h, s] = pool[h, page] if page >= 0 else 0
    return out


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_uva_gather_follows_the_table(kv_dtype, fresh_seed):
    b, h, n, bs, d, s = 4, 3, 9, 16, 16, 37
    store = _store(kv_dtype, b, h, n, bs, d, chunks=3)
    assert len(store.chunks[0]) >= 3
    table = store.table.table.cpu()
    load = torch.where(torch.rand(b, h, s) < 0.3, torch.randint(0, n, (b, h, s)), -1)
    load[-1, 0, 0] = 1  # the row without pages: zeros
    load[0, -1, -1] = int((store.table.host[0] >= 0).sum()) - 1  # row 0's last page
    planes = store.chunks[0][0].planes()
    slots = [(torch.full((b, h, s + 1, bs, p.k.shape[-1]), 7, dtype=p.k.dtype, device=DEV),
              torch.full((b, h, s + 1, bs, p.k.shape[-1]), 7, dtype=p.k.dtype, device=DEV)) for p in planes]
    got = []
    for engine in (UvaEngine(num_ctas=3, num_warps=2, tile=64), SyncEngine()):
        out = [(k.clone(), v.clone()) for k, v in slots]
        for chunk in store.chunks[0]:
            engine.gather_planes(chunk, out, load.to(DEV))
        got.append([(k.cpu(), v.cpu()) for k, v in out])
    for i, (init_k, init_v) in enumerate(slots):
        pool_k, pool_v = _pool(store, i)
        want_k, want_v = (_brute_gather(pool, table, load, init.cpu()) for pool, init in ((pool_k, init_k),
                                                                                           (pool_v, init_v)))
        for name, (k, v) in zip(("uva", "sync"), (g[i] for g in got)):
            assert torch.equal(k, want_k) and torch.equal(v, want_v), f"{name} plane {i} seed={fresh_seed}"
    assert (got[0][0][0][-1, 0, 0] == 0).all()


def test_uva_store_follows_the_table(fresh_seed):
    b, h, n, bs, d = 5, 2, 6, 16, 32
    store = _store("bf16", b, h, n, bs, d, chunks=4)
    table = store.table.host
    pos = torch.randint(0, n * bs, (b,))
    held = int((table[0] >= 0).sum())
    if held < n:
        pos[0] = held * bs  # row 0's first block without a page
    kt, vt = torch.randn(b, h, d), torch.randn(b, h, d)
    want_k, want_v = (p.clone() for p in _pool(store, 0))
    for row in range(b):
        page = int(table[row, pos[row] // bs])
        if page >= 0:
            want_k[:, page, pos[row] % bs] = kt[row]
            want_v[:, page, pos[row] % bs] = vt[row]
    engine = UvaEngine(num_ctas=2, num_warps=1, tile=64)
    for chunk in store.chunks[0]:
        engine.store_tokens(chunk, kt.to(DEV), vt.to(DEV), pos.to(DEV))
    if DEV == "cuda":
        torch.cuda.synchronize()
    got_k, got_v = _pool(store, 0)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), f"seed={fresh_seed}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4"])
def test_write_pages_kernel_equals_the_per_run_copies(kv_dtype, fresh_seed):
    """A prefill chunk starting and ending mid-block into scattered pages (a pool in several
    chunks): the kernel writes exactly what the per-run copies write, and nothing else."""
    b, h, n, bs, d = 3, 2, 10, 16, 32
    stores = [_store(kv_dtype, b, h, n, bs, d, chunks=3) for _ in range(2)]
    for row in range(b):
        pages = [int(p) for p in stores[0].table.host[row] if p >= 0]
        stores[1].table.assign(row, pages)  # the same table in both
    for a, c in zip(stores[0].chunks[0], stores[1].chunks[0]):
        for pa, pc in zip(a.planes(), c.planes()):
            pc.k.copy_(pa.k)
            pc.v.copy_(pa.v)
    row = 0
    have = int((stores[0].table.host[row] >= 0).sum()) * bs
    start = int(torch.randint(0, have // 2, ()))
    end = int(torch.randint(start + 1, have + 1, ()))
    k, v = torch.randn(h, end - start, d), torch.randn(h, end - start, d)
    if kv_dtype != "bf16":
        k, v = quant.QuantizedKV.quantize(k, kv_dtype), quant.QuantizedKV.quantize(v, kv_dtype)
    stores[0].put_tokens(0, row, k.to(DEV), v.to(DEV), start, kernel=True)
    stores[1].put_tokens(0, row, k.to(DEV), v.to(DEV), start, kernel=False)
    if DEV == "cuda":
        torch.cuda.synchronize()
    for plane in range(len(stores[0].chunks[0][0].planes())):
        got, want = _pool(stores[0], plane), _pool(stores[1], plane)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), f"plane {plane} seed={fresh_seed}"
    back = stores[0].read_tokens(0, row, end)
    assert torch.equal(quant.as_float(back[0], torch.float32)[:, start:], quant.as_float(k, torch.float32))


@pytest.mark.parametrize("kv_dtype", ["bf16", "int4"])
def test_read_pages_kernel_equals_the_per_run_copies(kv_dtype, fresh_seed):
    """A chunked prefill's read-back of a row's earlier tokens from scattered pages: the
    kernel fills the buffer exactly as the per-run copies do, and only tokens ``< end``."""
    b, h, n, bs, d = 3, 2, 10, 16, 32
    store = _store(kv_dtype, b, h, n, bs, d, chunks=3)
    have = int((store.table.host[0] >= 0).sum()) * bs
    end = int(torch.randint(1, have + 1, ()))
    bufs = []
    for kernel in (True, False):
        k, v = (quant.kv_zeros((h, n * bs, d), kv_dtype, torch.float32, DEV) for _ in range(2))
        for t in (k, v):
            for part in ([t.data, t.scale] if isinstance(t, quant.QuantizedKV) else [t]):
                part.fill_(3)
        store.get_tokens(0, 0, end, k, v, kernel=kernel)
        bufs.append((k, v))
    if DEV == "cuda":
        torch.cuda.synchronize()
    for x, y in zip(*bufs):
        xs = [x.data, x.scale] if isinstance(x, quant.QuantizedKV) else [x]
        ys = [y.data, y.scale] if isinstance(y, quant.QuantizedKV) else [y]
        for p, q in zip(xs, ys):
            assert torch.equal(p.cpu(), q.cpu()), f"seed={fresh_seed}"
            assert (p[:, end:] == 3).all()
    want = store.read_tokens(0, 0, end)[0]
    got = bufs[0][0][:, :end]
    assert torch.equal(quant.as_float(got, torch.float32).cpu(), quant.as_float(want, torch.float32))
