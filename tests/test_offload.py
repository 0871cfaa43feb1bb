"""Offload runtime (design §6): host storage, slot diff, transfer engines, offloaded methods.

The offloaded paths are checked against the on-device methods on tiny random models with
small blocks (block 16, kernel 8, stride 4, dense_len 0) so that selection drops blocks
at short lengths; counters against a brute-force simulation.
"""

from __future__ import annotations

import math

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sparda.cache.host import HostKVStore
from sparda.cache.offload import OffloadKVCache
from sparda.cache.prefetch import diff_slots
from sparda.config import SelectionConfig
from sparda.errors import SpardaError

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama")


@pytest.fixture(scope="module")
def forecast_file(tiny, tmp_path_factory):
    """A random Forecast for the tiny model (weights scaled up: peaky, non-trivial scores)."""
    from sparda.attention.forecast import Forecast, model_identity, save_forecast
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="dense", device="cpu")
    forecast = Forecast.for_shape(llm.shape)
    with torch.no_grad():
        for p in forecast.parameters():
            p.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("forecast") / "f.safetensors"
    save_forecast(forecast, path, model_identity(llm.model.config, llm.shape), dtype=torch.float32)
    return str(path)


def _llm(tiny, method, resident=(), **extra):
    from sparda.engine.llm import LLM

    extra.setdefault("sparse_prefill", True)  # prefill selects too: on-device and offloaded paths compared
    llm = LLM(str(tiny), method=method, device="cpu", **SMALL, **extra)
    if hasattr(llm.method, "resident_layers"):
        llm.method.resident_layers = resident
    return llm


def _run_lockstep(ref_llm, off_llm, prompts: list[list[int]], steps: int):
    """Decode ``steps`` tokens feeding the reference's greedy tokens to both; returns the
    worst logits relative error and whether every greedy token agreed.

    The two paths score blocks a summation order apart (~1e-8), so where the reference has two
    blocks tied (a compressed key straddling both gives them one max-pooled score; ties go to
    the lower block) the other path may take the other one. At the first step whose logits
    differ past 1e-5, every block the two selections differ in must score within 1e-6 of
    another of them in the reference (a swap across a tie); the runs then part and the
    comparison stops there."""
    from unittest import mock

    from sparda.kernels import reference as ref

    caches, firsts, calls, side = [], [], {0: [], 1: []}, [0]
    select = ref.select_blocks

    def recorded(scores, *args, **kwargs):
        mask = select(scores, *args, **kwargs)
        calls[side[0]].append((scores.detach().clone(), mask.clone()))
        return mask

    cap = max(len(p) for p in prompts) + steps + 1
    for llm in (ref_llm, off_llm):
        llm.method.reset()
        cache = llm.new_cache(len(prompts), cap)
        logits = torch.stack([llm.prefill(cache, row, ids)[-1] for row, ids in enumerate(prompts)])
        caches.append(cache)
        firsts.append(logits)
    worst = _rel(firsts[1], firsts[0])
    same = True
    tokens = firsts[0].argmax(-1)
    positions = torch.tensor([len(p) for p in prompts])
    with mock.patch.object(ref, "select_blocks", recorded):
        for _ in range(steps):
            calls[0].clear(), calls[1].clear()
            side[0] = 0
            want = ref_llm.decode(caches[0], tokens, positions)
            side[0] = 1
            got = off_llm.decode(caches[1], tokens, positions)
            error = _rel(got, want)
            if error > 1e-5 and _swapped_at_a_tie(calls[0], calls[1]):
                break
            worst = max(worst, error)
            same &= bool((got.argmax(-1) == want.argmax(-1)).all())
            tokens, positions = want.argmax(-1), positions + 1
    return worst, same, caches[1]


def _swapped_at_a_tie(want: list, got: list) -> bool:
    """Whether the selections of one decode step (``(scores, mask)`` per call, in order) differ,
    and only in blocks whose reference scores are within 1e-6 of another differing block's."""
    differed = False
    for (s0, m0), (_, m1) in zip(want, got):
        n = min(m0.shape[-1], m1.shape[-1])
        diff = m0[..., :n] != m1[..., :n]
        for where in diff.any(-1).nonzero().tolist():
            values = s0[tuple(where)][:n][diff[tuple(where)]].double()
            if values.numel() < 2 or float(values.max() - values.min()) > 1e-6:
                return False
            differed = True
    return differed and len(want) == len(got)


def test_sparse_offload_matches_device_sparse(tiny):
    """Same selection rule: offloaded logits == on-device logits (fp32), 256 greedy steps."""
    ref, off = _llm(tiny, "sparse"), _llm(tiny, "sparse-offload")
    prompt = torch.randint(100, 20000, (150,)).tolist()
    worst, same, cache = _run_lockstep(ref, off, [prompt], 256)
    assert worst <= 1e-5 and same
    assert cache.read_fraction() < 0.5  # selection really dropped blocks
    stats = cache.offload_stats(256)
    assert stats["misses"] > 0 and stats["hits"] > stats["misses"]


def test_offloaded_sparda_matches_device_sparda(tiny, forecast_file):
    """Forecast selection: on-device sparda, offloaded sparda (prefetch) and sparda-no-prefetch
    give the same logits; a mixed-length batch exercises per-row selection."""
    ref = _llm(tiny, "sparda", forecast=forecast_file)
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150, 41)]
    for method, offload in (("sparda", True), ("sparda-no-prefetch", None)):
        off = _llm(tiny, method, resident=(0,) if method == "sparda" else (), forecast=forecast_file,
                   offload=offload)
        assert off.method.offloaded
        worst, same, cache = _run_lockstep(ref, off, prompts, 96)
        assert worst <= 1e-5 and same, method
        assert cache.offload_stats(96)["misses"] > 0


@pytest.mark.parametrize("shallow_layers", [1, 2])
def test_offloaded_shallow_matches_device_shallow(tiny, shallow_layers):
    """``shallow --offload`` (design §7: the shallow layers resident, every deep layer's blocks
    fetched once the mask is known) gives on-device ``shallow``'s logits (fp32) on a batch of
    three lengths, with blocks dropped and fetched; ``--shallow-select-once`` is refused."""
    ref = _llm(tiny, "shallow", shallow_layers=shallow_layers)
    off = _llm(tiny, "shallow", shallow_layers=shallow_layers, offload=True)
    assert off.method.offloaded and off.method.cache_resident_layers() == tuple(range(shallow_layers))
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (97, 150, 41)]
    worst, same, cache = _run_lockstep(ref, off, prompts, 96)
    assert worst <= 1e-5 and same
    assert cache.offloaded == tuple(range(shallow_layers, off.shape.num_layers))
    stats = cache.offload_stats(96)
    assert stats["misses"] > 0 and stats["hits"] > 0
    assert cache.read_fraction() < 0.9  # the deep layers read a subset
    with pytest.raises(SpardaError, match="shallow_select_once=True does not run offloaded"):
        _llm(tiny, "shallow", offload=True, shallow_select_once=True)


@pytest.mark.parametrize("method", ["sparse", "sparda"])
def test_offloaded_dense_heads_match_the_device_path(tiny, forecast_file, method):
    """Dense heads (design §3.7) on the offloaded cache: their layers stay resident and those
    heads read every visible block; logits == the on-device method with the same heads
    (fp32), which differ from the method without them (so the heads really act)."""
    from sparda.engine.llm import LLM

    shape = LLM(str(tiny), method="dense", device="cpu").shape
    assert shape.num_layers >= 3  # layer 0 resident anyway, layer 1 for its dense heads, the rest offloaded
    heads = f"1:0,1:{shape.num_kv_heads - 1}"
    extra = dict(forecast=forecast_file) if method == "sparda" else {}
    ref = _llm(tiny, method, dense_heads=heads, **extra)
    off = _llm(tiny, "sparse-offload" if method == "sparse" else "sparda", resident=(0,), offload=True,
               dense_heads=heads, **extra)
    assert off.method.offloaded and off.config.dense_heads == ref.config.dense_heads
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (150, 97)]
    worst, same, cache = _run_lockstep(ref, off, prompts, 48)
    assert worst <= 1e-5 and same, worst
    assert cache.resident == {0, 1} and cache.offload_stats(48)["misses"] > 0
    plain_worst, _, _ = _run_lockstep(_llm(tiny, method, **extra), off, prompts, 48)
    assert plain_worst > 1e-4, "the dense heads changed nothing: no test"


def test_batch_of_three_lengths_matches_each_alone(tiny):
    llm = _llm(tiny, "sparse-offload")
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in (23, 130, 71)]
    batch = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=40, ignore_eos=True)
    for ids, got in zip(prompts, batch):
        alone = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=40, ignore_eos=True)[0]
        assert got.token_ids == alone.token_ids


def test_long_generation_recycles_slots(tiny):
    """1,024 new tokens: 64 block boundaries, slots recycled; tokens equal on-device sparse."""
    prompts = [torch.randint(100, 20000, (40,)).tolist()]
    ref = _llm(tiny, "sparse").generate(None, prompt_token_ids=prompts, max_new_tokens=1024, ignore_eos=True)[0]
    off = _llm(tiny, "sparse-offload").generate(None, prompt_token_ids=prompts, max_new_tokens=1024,
                                                 ignore_eos=True)[0]
    assert len(off.token_ids) == 1024
    assert off.token_ids == ref.token_ids
    stats = off.stats["offload"]
    assert stats["misses"] > 3 * 64 * 3 * 2  # far more misses than slots: slots were reused


def _brute_force(resident: list[set], want: list[set]):
    """Hits / misses of one diff (set semantics, one set per (row, head))."""
    hits = sum(len(w & r) for w, r in zip(want, resident))
    misses = sum(len(w - r) for w, r in zip(want, resident))
    return hits, misses


@pytest.mark.parametrize("slot_factor", [1.0, 1.5])
def test_diff_counters_against_brute_force(slot_factor):
    """Random selections over many steps: hits/misses equal a set-based count, wanted blocks
    end up resident, slot contents equal the host blocks, slots get reused; the compact list
    attention reads is the selected slots in slot order (with and without spare slots)."""
    cfg = SelectionConfig(**SMALL)
    b, h, d, cap = 2, 3, 16, 400
    cache = OffloadKVCache(2, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", slot_factor=slot_factor)
    s, n, width = cache.slots, cache.num_blocks, cache.select_width
    assert s == min(n, math.ceil(slot_factor * width)) and width == min(n, cfg.budget_blocks)
    layer = 1
    for chunk in cache.host.chunks[layer]:
        chunk.k.normal_()
        chunk.v.normal_()
    total_hits = total_misses = 0
    evictions = 0
    pos = torch.full((b,), n * cfg.block_size - 1)  # current block = last one (never fetched)
    for _ in range(60):
        want = torch.zeros(b, h, n, dtype=torch.bool)
        for i in range(b):
            for j in range(h):
                k = int(torch.randint(0, width + 1, ()))
                want[i, j, torch.randperm(n - 1)[:k]] = True
        before = [set(x for x in cache.slot_map[layer][i, j].tolist() if x >= 0) for i in range(b) for j in range(h)]
        wanted = [set(torch.nonzero(want[i, j]).flatten().tolist()) for i in range(b) for j in range(h)]
        hits, misses = _brute_force(before, wanted)
        h0, m0 = int(cache.prefetcher.hits.sum()), int(cache.prefetcher.misses.sum())
        cache.fetch(layer, want, pos)
        assert int(cache.prefetcher.hits.sum()) - h0 == hits
        assert int(cache.prefetcher.misses.sum()) - m0 == misses
        total_hits, total_misses = total_hits + hits, total_misses + misses
        after = [set(x for x in cache.slot_map[layer][i, j].tolist() if x >= 0) for i in range(b) for j in range(h)]
        for bef, wnt, aft in zip(before, wanted, after):
            assert wnt <= aft and len(aft) <= s
            evictions += len(bef - aft)
        assert torch.equal(cache.attn_ids[layer][..., :-1] >= 0, torch.stack(
            [torch.tensor([blk in wanted[i * h + j] for blk in cache.slot_map[layer][i, j].tolist()])
             for i in range(b) for j in range(h)]).view(b, h, s))
        for i in range(b):
            for j in range(h):
                pairs = [(blk, slot) for slot, blk in enumerate(cache.slot_map[layer][i, j].tolist())
                         if blk in wanted[i * h + j]]
                pad = [(-1, 0)] * (width - len(pairs))
                got = list(zip(cache.attn_blocks[layer][i, j].tolist(), cache.attn_slots[layer][i, j].tolist()))
                assert got == pairs + pad + [(n - 1, s)], (i, j)
        for i in range(b):
            for j in range(h):
                for slot, blk in enumerate(cache.slot_map[layer][i, j].tolist()):
                    if blk >= 0:
                        hk, hv = cache.host.block(layer, i, j, blk)
                        assert torch.equal(cache.k_slots[layer][i, j, slot], hk)
                        assert torch.equal(cache.v_slots[layer][i, j, slot], hv)
    assert evictions > 0 and total_hits > 0 and total_misses > 0
    stats = cache.offload_stats(60)
    assert stats["hits"] == total_hits and stats["misses"] == total_misses
    assert stats["bytes_copied"] == 2 * total_misses * cfg.block_size * d * 4
    assert stats["hit_rate"] == round(total_hits / (total_hits + total_misses), 4)


def test_diff_slots_prefers_empty_slots():
    slot_map = torch.tensor([[[5, -1, 2, -1]]])
    want = torch.zeros(1, 1, 8, dtype=torch.bool)
    want[0, 0, [2, 6]] = True
    load, new_map, hits, misses = diff_slots(slot_map, want)
    assert load.tolist() == [[[-1, 6, -1, -1]]]
    assert new_map.tolist() == [[[5, 6, 2, -1]]]
    assert hits.item() == 1 and misses.item() == 1


def test_host_allocation_failure_names_bytes():
    with pytest.raises(SpardaError, match=r"needs .* GiB .* available; use a smaller batch or context"):
        HostKVStore(range(64), 4096, 8, 128, 2048, 64, torch.bfloat16, pin=False)


def test_uva_kernels_under_interpreter(tmp_path, fresh_seed):
    """The uva gather/store kernels' index logic on CPU tensors (TRITON_INTERPRET=1; the
    interpreter cannot read pinned memory through UVA, so ordinary tensors stand in)."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from sparda.kernels._common import patch_interpreter_for_numpy
        patch_interpreter_for_numpy()
        from sparda.cache.host import HostKVStore
        from sparda.cache.transfer import SyncEngine, UvaEngine
        torch.manual_seed(SEED)
        b, h, n, bs, d, s = 3, 2, 9, 16, 16, 5
        host = HostKVStore([0], b, h, d, n, bs, torch.float32, pin=False, chunk_bytes=2 * h * n * bs * d * 4)
        assert len(host.chunks[0]) == 2  # pages split over two chunks
        for c in host.chunks[0]:
            c.k.normal_(); c.v.normal_()
        load = torch.randint(-1, n, (b, h, s))
        init_k, init_v = torch.randn(b, h, s + 1, bs, d), torch.randn(b, h, s + 1, bs, d)
        outs = []
        for eng in (SyncEngine(), UvaEngine(num_ctas=4, num_warps=2, tile=64)):
            dk, dv = init_k.clone(), init_v.clone()
            for c in host.chunks[0]:
                eng.gather(c, dk, dv, load)
            outs.append((dk, dv))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
        assert not torch.equal(outs[1][0], init_k)  # something was copied
        assert torch.equal(outs[1][0][:, :, :s][load < 0], init_k[:, :, :s][load < 0])  # hits untouched
        # many tasks, few misses (several vector loads of load entries per program), and a
        # quantised cache: both planes (codes, scales) in one launch against plane-by-plane sync
        from sparda.kernels.quant import QuantizedKV
        b2, h2, n2, s2 = 4, 3, 40, 37
        for kv_dtype in ("int8", "int4"):
            qhost = HostKVStore([0], b2, h2, d, n2, bs, torch.float32, pin=False, kv_dtype=kv_dtype,
                                chunk_bytes=100000)
            assert len(qhost.chunks[0]) >= 2
            for c in qhost.chunks[0]:
                for buf in (c.k, c.v):
                    buf.data.random_(0, 256); buf.scale.normal_()
            qload = torch.where(torch.rand(b2, h2, s2) < 0.15, torch.randint(0, n2, (b2, h2, s2)), -1)
            qload[0, 0, 0] = n2 - 1  # the last block of the first row
            qload[-1, -1, -1] = 0
            got = []
            for eng in (SyncEngine(), UvaEngine(num_ctas=3, num_warps=2, tile=64)):
                slots = [QuantizedKV.zeros((b2, h2, s2 + 1, bs, d), kv_dtype) for _ in range(2)]
                for t in slots:
                    t.data.fill_(7); t.scale.fill_(-3.0)
                planes = [(slots[0].data, slots[1].data), (slots[0].scale, slots[1].scale)]
                for c in qhost.chunks[0]:
                    eng.gather_planes(c, planes, qload)
                got.append(planes)
            for (sd, ss), (ud, us) in zip(got[0], got[1]):
                assert torch.equal(sd, ud) and torch.equal(ss, us), kv_dtype
            hit = qload < 0
            assert (got[1][0][0][:, :, :s2][hit] == 7).all() and (got[1][1][0][:, :, :s2][hit] == -3.0).all()
            for i, j, k_ in [(0, 0, 0), (b2 - 1, h2 - 1, s2 - 1)]:  # spot check against the host store
                blk = int(qload[i, j, k_])
                hk, hv = qhost.block(0, i, j, blk)
                assert torch.equal(got[1][0][0][i, j, k_], hk.data)
                assert torch.equal(got[1][1][1][i, j, k_], hv.scale)
        kt, vt = torch.randn(b, h, d), torch.randn(b, h, d)
        pos = torch.randint(0, n * bs, (b,))
        eng = UvaEngine(num_ctas=2, num_warps=1, tile=64)
        for c in host.chunks[0]:
            eng.store_tokens(c, kt, vt, pos)
        for i in range(b):
            for j in range(h):
                hk, hv = host.block(0, i, j, int(pos[i]) // bs)
                assert torch.equal(hk[int(pos[i]) % bs], kt[i, j]) and torch.equal(hv[int(pos[i]) % bs], vt[i, j])
        print("ok")
    """)
    script = script.replace("SEED", str(fresh_seed))  # the test's recorded seed
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_cli_generate_sparse_offload(tiny):
    from click.testing import CliRunner

    from sparda.cli import main

    result = CliRunner().invoke(main, ["generate", "--model", str(tiny), "--method", "sparse-offload",
                                       "--device", "cpu", "--block-size", "16", "--dense-len", "0",
                                       "-p", "hello there " * 30, "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    assert '"offload"' in result.output and '"engine": "sync"' in result.output


def test_bad_engine_is_a_sparda_error():
    with pytest.raises(SpardaError, match="needs a CUDA device"):
        OffloadKVCache(1, 1, 1, 16, 64, SelectionConfig(**SMALL), torch.float32, "cpu", engine="uva")


def test_view_of_an_offloaded_layer_in_decode_is_refused(fresh_seed):
    """``view`` hands out an offloaded layer's K/V during its prefill (the prompt's own, as
    appended) and refuses it in decode (no silent full copy from the host); a resident
    layer stays readable."""
    from sparda.model.llama import StepInfo

    cfg = SelectionConfig(**SMALL)
    cache = OffloadKVCache(2, 1, 2, 16, 96, cfg, torch.float32, "cpu", engine="sync", resident_layers=(0,))
    k = torch.randn(1, 2, 40, 16)
    prefill = StepInfo("prefill", torch.tensor([0]), torch.arange(40).view(1, -1), torch.tensor([40]), None, None, 40)
    rows = torch.tensor([0])
    for layer in range(2):
        cache.append(layer, k * (layer + 1), -k, prefill)
        got_k, got_v, _ = cache.view(layer, rows, 40)
        assert torch.equal(got_k, k * (layer + 1)) and torch.equal(got_v, -k)
    step = StepInfo("decode", rows, torch.tensor([[40]]), torch.tensor([41]), None, None, 96, 41)
    for layer in range(2):
        cache.append(layer, k[..., :1, :], k[..., :1, :], step)
    assert torch.equal(cache.view(0, rows, 41)[0][..., :40, :], k)
    with pytest.raises(SpardaError, match="layer 1 is offloaded"):
        cache.view(1, rows, 41)


def test_dense_fallback_copies_each_block_once(tiny):
    """C5: under the dense fallback (shorter than dense_len) offloaded decode reads every
    block, but the slots keep them: each completed block is copied once per layer and head
    (when it stops being the partial block), never the whole layer per step. Counted by
    hand: at position p the step wants blocks 0 .. p//B - 1 (the current block lives in
    the partial slot)."""
    from sparda.engine.llm import LLM

    cfg = dict(SMALL, dense_len=512)
    llm = LLM(str(tiny), method="sparse-offload", device="cpu", **cfg)
    llm.method.resident_layers = ()
    prompt_len, new = int(torch.randint(60, 140, ())), int(torch.randint(20, 40, ()))
    ids = torch.randint(100, 20000, (prompt_len,)).tolist()
    out = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=new, ignore_eos=True)[0]
    stats = out.stats["offload"]
    bs, heads, layers = SMALL["block_size"], llm.shape.num_kv_heads, llm.shape.num_layers
    positions = range(prompt_len, prompt_len + new - 1)  # one decode step per token after the first
    wanted = layers * heads * sum(p // bs for p in positions)
    misses = layers * heads * (positions[-1] // bs)
    assert out.stats["kv_read_fraction"] == 1.0  # it really ran the dense fallback
    assert (stats["misses"], stats["hits"]) == (misses, wanted - misses)


def test_prefetch_wait_sits_just_before_attention(tiny, forecast_file, monkeypatch):
    """C4: the wait for layer l's prefetch was in ``append``, before layer l+1's Forecast
    selection and copy enqueue. Per offloaded layer l of a decode step the order must be:
    append l, enqueue the prefetch of layer l+1, wait for l, attention over l's slots."""
    from sparda import kernels

    llm = _llm(tiny, "sparda", resident=(0,), forecast=forecast_file, offload=True)
    ids = torch.randint(100, 20000, (int(torch.randint(90, 140, ())),)).tolist()
    cache = llm.new_cache(1, len(ids) + 8)
    llm.method.reset()
    logits = llm.prefill(cache, 0, ids)[-1]
    log = []
    pref = cache.prefetcher
    fetch, wait, append, attention = pref.fetch, pref.wait, cache.append, kernels.decode_attention_slots

    def spy_fetch(layer, *args, prefetch, **kwargs):
        log.append(("fetch", layer, prefetch))
        return fetch(layer, *args, prefetch=prefetch, **kwargs)

    def spy_wait(layer):
        log.append(("wait", layer))
        return wait(layer)

    def spy_append(layer, *args, **kwargs):
        log.append(("append", layer))
        return append(layer, *args, **kwargs)

    def spy_attention(*args, **kwargs):
        log.append(("attention",))
        return attention(*args, **kwargs)

    monkeypatch.setattr(pref, "fetch", spy_fetch)
    monkeypatch.setattr(pref, "wait", spy_wait)
    monkeypatch.setattr(cache, "append", spy_append)
    monkeypatch.setattr(kernels, "decode_attention_slots", spy_attention)
    token, pos = logits.argmax().view(1), torch.tensor([len(ids)])
    layers = llm.shape.num_layers
    for _ in range(3):
        log.clear()
        token, pos = llm.decode(cache, token, pos).argmax(-1), pos + 1
        for layer in range(1, layers):
            start = log.index(("append", layer))
            end = log.index(("append", layer + 1)) if layer + 1 < layers else len(log)
            own = log[start:end]
            want = [("append", layer)] + ([("fetch", layer + 1, True)] if layer + 1 < layers else []) + \
                [("wait", layer), ("attention",)]
            assert own == want, (layer, own)


def test_copy_time_is_zero_when_nothing_was_copied():
    """U6: 0 bytes copied but ``copy_ms`` 12 ms. A fetch with hits only reports no copy time;
    one with misses reports its bytes (2 x misses x block bytes) and the copy's wall time."""
    import time

    from sparda.cache.prefetch import Prefetcher

    pref = Prefetcher(None, torch.device("cpu"), num_layers=2, block_bytes=256, batch=2, timing=True)
    hits = torch.randint(1, 5, (2, 3))
    pref.fetch(1, lambda: time.sleep(0.01), hits, torch.zeros(2, 3, dtype=torch.long), keep=(), prefetch=False)
    stats = pref.stats(tokens=4)
    assert stats["hits"] == int(hits.sum()) and stats["misses"] == 0 and stats["bytes_copied"] == 0
    assert stats["copy_ms"] == stats["exposed_wait_ms"] == stats["hidden_fraction"] == 0.0
    misses = torch.randint(1, 5, (2, 3))
    pref.fetch(0, lambda: time.sleep(0.01), torch.zeros(2, 3, dtype=torch.long), misses, keep=(), prefetch=False)
    stats, row = pref.stats(tokens=4), pref.stats(tokens=4, row=1)
    assert stats["bytes_copied"] == 2 * int(misses.sum()) * 256 and stats["bytes_per_token"] == stats["bytes_copied"] / 4
    assert row["misses"] == int(misses[1].sum()) and row["hits"] == int(hits[1].sum())
    assert stats["copy_ms"] >= 10.0 and stats["exposed_wait_ms"] == stats["copy_ms"]  # synchronous: all exposed
    assert stats["exposed_transfer_ms"] == stats["copy_ms"] and pref.timeline() == []  # no device clock on the CPU


def test_offload_defaults():
    """sparda offloads by default on CUDA only; no other method offloads unless asked
    (sparse-offload and sparda-no-prefetch always do)."""
    from sparda.config import ALWAYS_OFFLOADED, METHODS, build_config

    def offloaded(method, cuda):
        config = build_config(method=method, device="cuda" if cuda else "cpu", cuda_available=cuda)
        return config.offload or method in ALWAYS_OFFLOADED

    assert offloaded("sparda", True) and not offloaded("sparda", False)
    for method in set(METHODS) - {"sparda", *ALWAYS_OFFLOADED}:
        assert not offloaded(method, True) and not offloaded(method, False)


def test_sparda_on_cpu_keeps_cache_on_device(tiny, forecast_file):
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="sparda", forecast=str(forecast_file), device="cpu")
    assert llm.config.offload is False and not isinstance(llm.new_cache(1, 64), OffloadKVCache)
    llm = LLM(str(tiny), method="sparda", forecast=str(forecast_file), device="cpu", offload=True)
    assert isinstance(llm.new_cache(1, 64), OffloadKVCache)


def test_kv_cache_bytes_is_the_sequence_kv_wherever_it_lives(tiny):
    """stats["kv_cache_bytes"] = 2 (K, V) x layers x H_kv x d x 4 bytes (fp32) x tokens, offloaded or not."""
    prompt = torch.randint(100, 20000, (int(torch.randint(60, 120, ())),)).tolist()
    got = []
    for method in ("sparse", "sparse-offload"):
        llm = _llm(tiny, method)
        stats = llm.generate(None, prompt_token_ids=[prompt], max_new_tokens=5, ignore_eos=True)[0].stats
        s = llm.shape
        assert stats["kv_cache_bytes"] == 2 * s.num_layers * s.num_kv_heads * s.head_dim * 4 * (len(prompt) + 4)  # 5 new tokens, the last never cached
        got.append(stats)
    assert "offload" in got[1] and got[1]["offload"]["host_bytes"] > 0


def test_host_chunks_are_even_and_fewest(fresh_seed):
    """Host chunk spans: a contiguous cover of the pages, each within chunk_bytes and the
    element limit (unless one page alone exceeds it), as few as a brute-force minimum, sizes
    differing by at most one page."""
    import random

    from sparda.cache.host import MAX_CHUNK_ELEMENTS, chunk_spans

    rnd = random.Random(fresh_seed)
    for _ in range(200):
        count, unit = rnd.randint(1, 40), rnd.randint(1_000, 70_000_000)
        chunk = rnd.choice([4 << 30, 1 << 30, 1 << 28, unit * rnd.randint(1, 5)])
        elems = rnd.choice([None, unit // 2, unit // 4])
        spans = chunk_spans(count, unit, chunk, elems)
        assert spans[0][0] == 0 and spans[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        fits = lambda n: n * unit <= chunk and (not elems or n * elems <= MAX_CHUNK_ELEMENTS)  # noqa: E731
        assert all(r1 > r0 and (fits(r1 - r0) or r1 - r0 == 1) for r0, r1 in spans)
        per = max([n for n in range(1, count + 1) if fits(n)], default=1)
        assert len(spans) == -(-count // per)  # the fewest chunks
        sizes = [r1 - r0 for r0, r1 in spans]
        assert max(sizes) - min(sizes) <= 1
    # the 128K MiniCPM-8B layer of the H200 sweep at B24 (1.6 GB of bf16: 49,152 pages of
    # 2 KV heads x 64 tokens x 128) is one chunk
    assert chunk_spans(24 * 2048, 2 * 64 * 128 * 2, 4 << 30, 2 * 64 * 128) == [(0, 24 * 2048)]


def test_gather_grid_follows_the_measured_batch_rule(monkeypatch):
    """The uva engine's CTA count comes from ``gather_ctas(batch)`` unless given: 32 below
    B16, 64 from B16 on (design §6)."""
    from sparda.cache import transfer

    assert [transfer.gather_ctas(b) for b in (1, 4, 15, 16, 24, 88)] == [32, 32, 32, 64, 64, 64]
    if not transfer.HAS_TRITON:
        pytest.skip("triton missing")
    cuda = torch.device("cuda")  # make_engine only checks the device type: nothing is allocated
    assert transfer.make_engine("uva", cuda, batch=4).num_ctas == 32
    assert transfer.make_engine("uva", cuda, batch=16).num_ctas == 64
    assert transfer.make_engine("uva", cuda, batch=16, num_ctas=8).num_ctas == 8
    assert transfer.make_engine("uva", cuda).num_ctas == 32  # no batch: the constructor's default
    assert isinstance(transfer.make_engine("sync", cuda, batch=16), transfer.SyncEngine)


@pytest.mark.parametrize("slot_factor,prompt_len,steps", [(1.0, 150, 200), (1.5, 150, 200), (2.0, 150, 200),
                                                         (2.0, 40, 60)])
def test_spare_slots_keep_offloaded_logits_equal(tiny, slot_factor, prompt_len, steps, fresh_seed, monkeypatch):
    """Spare GPU slots (design §6) change which blocks are copied, never the logits:
    sparse-offload with ``slot_factor`` 1 / 1.5 / 2 (and a capacity so short that ``S`` is
    capped by the cache's blocks) equals on-device sparse (fp32) over many decode steps
    in which blocks leave the selection and return; with spare slots some block that left
    the selection is a hit when it returns (a block that slot_factor 1 would have lost)."""
    from sparda.cache.offload import OffloadKVCache

    ref = _llm(tiny, "sparse")
    off = _llm(tiny, "sparse-offload", slot_factor=slot_factor)
    returns = []  # per fetch: blocks selected now, not at the last fetch of the layer, held in a slot
    last, fetch = {}, OffloadKVCache.fetch

    def spy(self, layer, selection, pos, prefetch=False, counters=None):
        held = self.slot_map[layer].clone()
        fetch(self, layer, selection, pos, prefetch, counters)
        picked = self.attn_ids[layer][..., :-1].long()
        if layer in last:  # hits of blocks that the last fetch of this (row, head) did not select
            before = (picked[..., :, None] == last[layer][..., None, :]).any(-1)
            returns.append(int(((picked >= 0) & (held == picked) & ~before).sum()))
        last[layer] = torch.where(picked >= 0, picked, -2)

    prompt = torch.randint(100, 20000, (prompt_len,)).tolist()
    monkeypatch.setattr(OffloadKVCache, "fetch", spy)
    worst, same, cache = _run_lockstep(ref, off, [prompt], steps)
    where = f"seed {fresh_seed}, slot_factor {slot_factor}"
    width, s = cache.select_width, cache.slots
    assert s == max(width, min(cache.num_blocks, math.ceil(slot_factor * width))), where
    assert worst <= 1e-5 and same, (worst, where)
    if prompt_len < 100:  # the short case: S capped by the cache's blocks
        assert s == cache.num_blocks < math.ceil(slot_factor * width), where
    else:
        assert cache.read_fraction() < 0.6, where  # selection really dropped blocks
    stats = cache.offload_stats(steps)
    assert stats["misses"] > 0, where
    if s > width:
        assert sum(returns) > 0, where
