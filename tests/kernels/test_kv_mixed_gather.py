"""``--kv-dtype mixed`` through the uva engine's Triton kernels (interpreter; ordinary CPU
tensors stand in for pinned memory) against the sync engine: the same pool and int4 store
bytes after decode-token stores, the same slots after every fetch (hot blocks from the pool,
cold ones gathered as codes + scales and dequantised: by the Triton kernel on the uva side,
by the PyTorch twin on the sync side; the hot rule and the split in the Triton slot diff on the
uva side, in the twin on the sync side), the same hot state and counters."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from sparda import kernels  # noqa: E402
from sparda.cache.mixed import MixedOffloadKVCache  # noqa: E402
from sparda.kernels.cold_slots import dequantize_cold_triton  # noqa: E402
from sparda.kernels.slot_diff import slot_diff_triton  # noqa: E402
from sparda.cache.transfer import UvaEngine  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.model.llama import StepInfo  # noqa: E402

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)


def _step(phase, rows, q_pos, max_kv_len):
    return StepInfo(phase=phase, rows=rows, q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=None, sin=None,
                    max_kv_len=max_kv_len)


def test_mixed_uva_gather_equals_sync(monkeypatch):
    cfg = SelectionConfig(**SMALL)
    b, h, d, cap, prompt, steps = 3, 2, 16, 160, 50, 40
    caches = []
    for engine in ("sync", "uva"):
        # a small chunk_bytes: the rows span two host chunks (store and pool alike)
        cache = MixedOffloadKVCache(1, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", hot_blocks=4,
                                    hot_steps=2, chunk_bytes=8000)
        if engine == "uva":
            cache.engine = UvaEngine(num_ctas=3, num_warps=2, tile=64)
        caches.append(cache)
    assert len(caches[0].host.chunks[0]) >= 2 and len(caches[0].host.pool[0]) >= 2
    k_all, v_all = torch.randn(b, h, cap, d), torch.randn(b, h, cap, d)
    for cache in caches:
        for row in range(b):
            cache.append(0, k_all[row:row + 1, :, :prompt], v_all[row:row + 1, :, :prompt],
                         _step("prefill", torch.tensor([row]), torch.arange(prompt).view(1, -1), prompt))
    rows = torch.arange(b)
    for pos in range(prompt, prompt + steps):
        step = _step("decode", rows, torch.full((b, 1), pos), cap)
        cur = pos // cfg.block_size
        ids = torch.full((b, h, caches[0].select_width), -1, dtype=torch.long)
        for r in range(b):
            for j in range(h):
                chosen = torch.randperm(cur)[:3].sort().values
                ids[r, j, :len(chosen) + 1] = torch.cat([chosen, torch.tensor([cur])])
        for cache in caches:
            cache.append(0, k_all[:, :, pos:pos + 1], v_all[:, :, pos:pos + 1], step)
            with monkeypatch.context() as patch:
                if cache is caches[1]:  # the uva path also diffs and dequantises through the Triton kernels
                    patch.setattr(kernels, "dequantize_cold_slots", dequantize_cold_triton)
                    patch.setattr(kernels, "slot_diff", slot_diff_triton)
                cache.fetch(0, ids, torch.full((b,), pos))
        sync, uva = caches
        assert torch.equal(sync.k_slots[0], uva.k_slots[0]) and torch.equal(sync.v_slots[0], uva.v_slots[0]), pos
        assert torch.equal(sync.hot.hot[0], uva.hot.hot[0]) and torch.equal(sync.hot.last[0], uva.hot.last[0])
        assert torch.equal(sync.slot_map[0], uva.slot_map[0])
    for a, c in zip(caches[0].host.chunks[0], caches[1].host.chunks[0]):
        assert torch.equal(a.k.data, c.k.data) and torch.equal(a.v.scale, c.v.scale)
    for a, c in zip(caches[0].host.pool[0], caches[1].host.pool[0]):
        assert torch.equal(a.k, c.k) and torch.equal(a.v, c.v)
    s0, s1 = (c.offload_stats(steps) for c in caches)
    assert s0["pool_misses"] == s1["pool_misses"] > 0 and s0["misses"] > s0["pool_misses"]
    assert s0["bytes_copied"] == s1["bytes_copied"]
