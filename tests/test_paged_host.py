"""The paged host store (design §6): a pool of KV pages per offloaded layer and a block table.

The reference is the same cache with the identity table (``host_blocks=None``), whose own
correctness the other test modules establish. A paged cache gets a pool larger than needed,
each row a random set of pages in random order; pages a row holds but has not written are
finite garbage (as a page a finished request left), the pages nobody holds are NaN, so a
stray read shows in the logits and a stray write in the pool. Tiny random llama, fp32,
small blocks (block 16), on the CPU through the real model: logits must be identical.
"""

from __future__ import annotations

import pytest
import torch

from sparda.cache.host import HostKVStore
from sparda.cache.offload import OffloadKVCache
from sparda.cache.paged import BlockTable
from sparda.cache.transfer import SyncEngine
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import quant
from test_offload import forecast_file  # noqa: F401 - fixture

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=40, init_blocks=1, local_blocks=2,
             topk_blocks=3)
METHODS = [("sparda", {"offload": True}), ("sparse-offload", {}), ("sparda-no-prefetch", {})]
KV_DTYPES = ["bf16", "int8", "int4", "mixed"]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


def _llm(tiny, method, options, kv_dtype, forecast_file):
    from sparda.engine.llm import LLM

    options = dict(options, kv_dtype=kv_dtype)
    if method.startswith("sparda"):
        options["forecast"] = forecast_file
    return LLM(str(tiny), method=method, device="cpu", cuda_graphs=False, dense_heads="none",
               sparse_prefill=True, **SMALL, **options)


def _fill(store: HostKVStore, value: float) -> None:
    """Every page of every layer set to ``value`` (quantised: codes random, scales ``value``)."""
    for chunks in store.chunks.values():
        for chunk in chunks:
            for t in (chunk.k, chunk.v):
                if isinstance(t, quant.QuantizedKV):
                    t.data.random_(0, 256)
                    t.scale.fill_(value)
                else:
                    t.fill_(value)


def _garbage(store: HostKVStore, pages: list[int]) -> None:
    """Finite garbage in ``pages`` of every layer (what a finished request left there)."""
    for chunks in store.chunks.values():
        for chunk in chunks:
            local = [p - chunk.page0 for p in pages if chunk.page0 <= p < chunk.page1]
            for t in (chunk.k, chunk.v):
                parts = [t.data, t.scale] if isinstance(t, quant.QuantizedKV) else [t]
                for part in parts:
                    if part.dtype == torch.uint8:
                        part[:, local] = torch.randint(0, 256, part[:, local].shape, dtype=torch.uint8)
                    else:
                        part[:, local] = torch.randn(part[:, local].shape) * 50


def _free_pages_untouched(store: HostKVStore, free: list[int]) -> bool:
    """Whether the NaN pages nobody holds are still all NaN (no stray write)."""
    for chunks in store.chunks.values():
        for chunk in chunks:
            local = [p - chunk.page0 for p in free if chunk.page0 <= p < chunk.page1]
            for t in (chunk.k, chunk.v):
                plane = t.scale if isinstance(t, quant.QuantizedKV) else t
                if not torch.isnan(plane[:, local]).all():
                    return False
    return True


def _paged_pair(runner, batch: int, capacity: int, need: list[int], extra: int):
    """An identity cache and a paged one of ``sum(need) + extra`` pages, row ``b`` assigned
    ``need[b]`` random pages; returns ``(identity, paged, free pages)``."""
    ident = runner.new_cache(batch, capacity)
    pages = sum(need) + extra
    paged = runner.new_cache(batch, capacity, host_blocks=pages)
    assert paged.host_blocks == pages and ident.host_blocks == batch * ident.num_blocks
    assert torch.equal(ident.block_table.view(-1), torch.arange(batch * ident.num_blocks, dtype=torch.int32))
    assert (paged.block_table == -1).all()
    order = torch.randperm(pages).tolist()
    _fill(paged.host, float("nan"))
    used = 0
    for row, n in enumerate(need):
        paged.assign_blocks(row, order[used:used + n])
        used += n
    _garbage(paged.host, order[:used])
    paged.host.table.check_disjoint()
    return ident, paged, order[used:]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("method,options", METHODS, ids=[m + ("-offload" if o else "") for m, o in METHODS])
def test_paged_cache_gives_the_identity_caches_logits(tiny, forecast_file, method, options, kv_dtype, fresh_seed):
    """Prefill two prompts, then decode every row (a third row holds no pages: decode padding)
    for several steps, extending one row's pages on the way: the real rows' logits are
    identical to the identity-table cache's, and no page nobody holds is written."""
    llm = _llm(tiny, method, options, kv_dtype, forecast_file)
    runner = llm.model_runner
    bs, steps = SMALL["block_size"], 12
    lengths = [int(torch.randint(120, 190, ())), int(torch.randint(40, 120, ()))]
    capacity = max(lengths) + steps + 20
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    need = [-(-n // bs) for n in lengths] + [0]  # row 1 is extended before it crosses a block
    ident, paged, free = _paged_pair(runner, 3, capacity, need, extra=int(torch.randint(3, 9, ())))
    extend = -(-(lengths[1] + steps) // bs) - need[1]
    spare, free = free[:extend], free[extend:]
    paged.assign_blocks(1, paged.host.table.host[1, :need[1]].tolist() + spare)
    assert paged.block_table[1, :need[1] + extend].tolist() == paged.host.table.host[1, :need[1] + extend].tolist()
    paged.assign_blocks(0, paged.host.table.host[0, :need[0]].tolist() + free[:1])  # row 0 too, one block
    free = free[1:]
    tokens = []
    for cache in (ident, paged):
        llm.method.reset()
        last = [runner.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)]
        tokens.append(last)
    for a, b in zip(*tokens):
        assert torch.equal(a, b), f"prefill seed={fresh_seed}"
    nxt = torch.stack([t.argmax() for t in tokens[0]] + [torch.tensor(0)])
    pos = torch.tensor(lengths + [0])
    for step in range(steps):
        outs = []
        for cache in (ident, paged):
            outs.append(runner.decode(cache, nxt, pos + step * torch.tensor([1, 1, 0])))
        assert torch.equal(outs[0][:2], outs[1][:2]), f"step {step} seed={fresh_seed}"
        nxt = torch.cat([outs[0][:2].argmax(-1), torch.zeros(1, dtype=torch.long)])
    assert _free_pages_untouched(paged.host, free), f"seed={fresh_seed}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("method,options", METHODS[:2], ids=["sparda-offload", "sparse-offload"])
def test_chunked_prefill_across_steps_follows_the_table(tiny, forecast_file, method, options, kv_dtype, fresh_seed):
    """``ModelRunner.prefill_chunk`` over chunks of 37 tokens (not a multiple of the block),
    the row's pages extended chunk by chunk, while another row decodes: the same logits
    and decode logits as the identity cache's."""
    llm = _llm(tiny, method, options, kv_dtype, forecast_file)
    runner = llm.model_runner
    bs = SMALL["block_size"]
    n0, n1 = int(torch.randint(150, 220, ())), int(torch.randint(40, 90, ()))
    capacity = n0 + 40
    ids0, ids1 = (torch.randint(100, 20000, (n,)).tolist() for n in (n0, n1))
    total = -(-n0 // bs) + 1
    ident, paged, free = _paged_pair(runner, 2, capacity, [0, -(-(n1 + 8) // bs)], extra=total + 4)
    mine = free[:total]
    _garbage(paged.host, mine)
    logits = []
    for cache in (ident, paged):
        llm.method.reset()
        out = [runner.prefill(cache, 1, ids1)[-1]]
        tok1 = int(out[0].argmax())
        for i, start in enumerate(range(0, n0, 37)):
            end = min(n0, start + 37)
            if cache is paged:  # the row's pages so far plus those of this chunk
                paged.assign_blocks(0, mine[:-(-end // bs)])
            out.append(runner.prefill_chunk(cache, 0, ids0, start, end)[-1])
            # row 1 decodes between the chunks; row 0 is padding at its next chunk's start
            dec = runner.decode(cache, torch.tensor([0, tok1]), torch.tensor([end, n1 + i]))
            out.append(dec[1])
            tok1 = int(dec[1].argmax())
        logits.append(out)
    for i, (a, b) in enumerate(zip(*logits)):
        assert torch.equal(a, b), f"output {i} seed={fresh_seed}"


def test_assign_blocks_refuses_bad_pages():
    cfg = SelectionConfig(**SMALL)
    cache = OffloadKVCache(2, 3, 2, 16, 100, cfg, torch.float32, "cpu", engine="sync", host_blocks=10)
    n = cache.num_blocks
    with pytest.raises(SpardaError, match="outside the host pool's 10 pages"):
        cache.assign_blocks(0, [1, 10])
    with pytest.raises(SpardaError, match="outside the host pool"):
        cache.assign_blocks(0, [-1])
    with pytest.raises(SpardaError, match="given a page twice"):
        cache.assign_blocks(1, [3, 4, 3])
    with pytest.raises(SpardaError, match=f"exceed its {n} blocks"):
        cache.assign_blocks(1, list(range(n + 1)))
    with pytest.raises(SpardaError, match="row 3 is outside"):
        cache.assign_blocks(3, [0])
    with pytest.raises(SpardaError, match="row -1 is outside"):
        cache.release_blocks(-1)
    assert (cache.block_table == -1).all()  # refused calls changed nothing
    cache.assign_blocks(1, [7, 2])
    cache.assign_blocks(1, [7, 2, 5])  # extended: the prefix kept
    assert cache.block_table[1].tolist() == [7, 2, 5] + [-1] * (n - 3)
    cache.assign_blocks(2, [2])
    with pytest.raises(SpardaError, match="host page 2 is held by more than one block"):
        cache.host.table.check_disjoint()
    cache.release_blocks(1)
    assert (cache.block_table[1] == -1).all()
    cache.host.table.check_disjoint()
    with pytest.raises(SpardaError, match="host_blocks must be at least 1"):
        BlockTable(2, 4, 0, "cpu")


def test_unassigned_blocks_raise_in_python_paths_and_are_skipped_by_engines():
    """Prefill writes and read-backs of a block without a page raise; a decode write of one
    writes nothing and its gather reads zeros."""
    cfg = SelectionConfig(**SMALL)
    store = HostKVStore([0], 2, 2, 16, 6, 16, torch.float32, pin=False, host_blocks=5)
    store.table.assign(0, [4, 1])
    with pytest.raises(SpardaError, match="row 0 block 2 has no host page"):
        store.write_tokens(0, 0, torch.randn(2, 40, 16), torch.randn(2, 40, 16))
    with pytest.raises(SpardaError, match="row 1 block 0 has no host page"):
        store.read_tokens(0, 1, 5)
    k = torch.randn(2, 32, 16)
    store.write_tokens(0, 0, k, -k)
    got_k, got_v = store.read_tokens(0, 0, 32)
    assert torch.equal(got_k, k) and torch.equal(got_v, -k)
    assert torch.equal(store.chunks[0][0].k[:, 4], k[:, :16].view(2, 16, 16))  # block 0 in page 4
    before = [c.k.clone() for c in store.chunks[0]]
    engine = SyncEngine()
    pos = torch.tensor([40, 3])  # row 0 block 2: no page; row 1: no pages at all
    for chunk in store.chunks[0]:
        engine.store_tokens(chunk, torch.randn(2, 2, 16), torch.randn(2, 2, 16), pos)
    assert all(torch.equal(a, c.k) for a, c in zip(before, store.chunks[0]))
    dk, dv = torch.full((2, 2, 4, 16, 16), 7.0), torch.full((2, 2, 4, 16, 16), 7.0)
    load = torch.tensor([[[1, 3, -1], [0, -1, -1]], [[0, -1, -1], [-1, -1, 2]]])
    for chunk in store.chunks[0]:
        engine.gather(chunk, dk, dv, load)
    assert torch.equal(dk[0, 0, 0], k[0, 16:]) and torch.equal(dk[0, 1, 0], k[1, :16])
    assert (dk[0, 0, 1] == 0).all() and (dk[1, 0, 0] == 0).all() and (dk[1, 1, 2] == 0).all()
    assert (dk[0, 0, 2] == 7).all() and (dk[..., 3, :, :] == 7).all()  # no load: untouched


def _brute_gather(pool_k, table, load, init):
    """``init`` with each slot ``load >= 0`` set to the page ``table[b, load]`` of ``pool_k``
    ``[H, P, bs, d]`` (zeros for no page)."""
    out = init.clone()
    for b, h, s in (load >= 0).nonzero().tolist():
        page = int(table[b, load[b, h, s]])
        out[b, h, s] = pool_k[h, page] if page >= 0 else 0
    return out


def test_sync_and_copy_layout_engines_against_brute_force(fresh_seed):
    """The sync engine's gather and store over a pool split into several chunks, a random
    table with unassigned blocks, against a brute-force walk through the table."""
    b, h, n, bs, d, s = 3, 2, 7, 4, 8, 5
    pages = 2 * b * n
    store = HostKVStore([0], b, h, d, n, bs, torch.float32, pin=False, host_blocks=pages,
                        chunk_bytes=5 * h * bs * d * 4)
    assert len(store.chunks[0]) >= 4
    order = torch.randperm(pages)
    for row in range(b):
        store.table.assign(row, order[row * n:row * n + int(torch.randint(1, n + 1, ()))].tolist())
    for c in store.chunks[0]:
        c.k.normal_()
        c.v.normal_()
    pool_k = torch.cat([c.k for c in store.chunks[0]], 1)
    pool_v = torch.cat([c.v for c in store.chunks[0]], 1)
    table = store.table.table
    load = torch.where(torch.rand(b, h, s) < 0.6, torch.randint(0, n, (b, h, s)), -1)
    init = torch.randn(b, h, s + 1, bs, d)
    dk, dv = init.clone(), init.clone()
    for c in store.chunks[0]:
        SyncEngine().gather(c, dk, dv, load)
    assert torch.equal(dk, _brute_gather(pool_k, table, load, init)), f"seed={fresh_seed}"
    assert torch.equal(dv, _brute_gather(pool_v, table, load, init)), f"seed={fresh_seed}"
    kt, vt = torch.randn(b, h, d), torch.randn(b, h, d)
    pos = torch.randint(0, n * bs, (b,))
    want_k = pool_k.clone()
    for row in range(b):
        page = int(table[row, pos[row] // bs])
        if page >= 0:
            want_k[:, page, pos[row] % bs] = kt[row]
    for c in store.chunks[0]:
        SyncEngine().store_tokens(c, kt, vt, pos)
    assert torch.equal(torch.cat([c.k for c in store.chunks[0]], 1), want_k), f"seed={fresh_seed}"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "int4", "mixed"])
def test_kv_need_bytes_counts_the_paged_pool(tiny, kv_dtype, fresh_seed):
    """``kv_need_bytes(host_blocks=P)`` equals the bytes a paged cache allocates (host: every
    chunk of every plane; device: as ``kv_bytes`` plus nothing), and the host pages are
    ``P x host_page_bytes`` (plus ``mixed``'s hot pool, per row)."""
    from sparda.engine.llm import LLM
    from sparda.engine.memory import host_page_bytes, kv_need_bytes

    llm = LLM(str(tiny), method="sparse-offload", device="cpu", cuda_graphs=False, dense_heads="none",
              kv_dtype=kv_dtype, **SMALL)
    runner = llm.model_runner
    batch, capacity = int(torch.randint(1, 5, ())), int(torch.randint(20, 400, ()))
    pages = int(torch.randint(1, 3 * batch * -(-capacity // 16), ()))
    cache = runner.new_cache(batch, capacity, host_blocks=pages)
    c, resident = runner.config.cache, runner.cache_resident_layers()
    kw = dict(offload=True, resident_layers=resident, slot_factor=c.slot_factor, hot_blocks=c.hot.get("hot_blocks"),
              state_bytes=runner.method.state_bytes(batch, capacity))
    device, host = kv_need_bytes(runner.shape, runner.config.selection, kv_dtype, runner.dtype, batch, capacity,
                                 host_blocks=pages, **kw)
    allocated = sum(t.nbytes for chunks in (cache.host.chunks, cache.host.pool) for layer in chunks.values()
                    for chunk in layer for t in (chunk.k, chunk.v))
    assert host == allocated == cache.host.nbytes, f"seed={fresh_seed}"
    assert device == runner.kv_bytes(batch, capacity)[0]
    page = host_page_bytes(runner.shape, runner.config.selection, kv_dtype, runner.dtype, resident_layers=resident)
    assert host - cache.host.pool_bytes == pages * page
    one = sum(t[:, :1].nbytes if not isinstance(t, quant.QuantizedKV) else t.data[:, :1].nbytes + t.scale[:, :1].nbytes
              for layer in cache.host.chunks.values() for t in (layer[0].k, layer[0].v))
    assert page == one  # one page of every offloaded layer, K and V, scales included
