"""A decode step of the first ``b`` rows (design §3.13) through the CUDA path's kernels, run by the
Triton interpreter on CPU tensors: the fused decoder (stacked GEMMs, the RoPE + append kernel
writing the partial slot and the host store, ``mixed``'s hot pool and int4 store too), Triton
selection, the slot diff (and the early diff of lookahead 2; ``mixed``: with the hot rule and
the pool / cold split, design §6.1) and slot attention. Offloaded caches get the CPU stand-in of
CUDA's asynchronous engine (:func:`~sparda.bench.op_count.twin_engine`), so the append kernel
writes the host store itself. Rows ``b ..`` keep every per-row tensor and their host pages bit
for bit; rows ``< b`` get the full-batch step's logits.
"""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch

pytest.importorskip("triton")

from sparda import kernels  # noqa: E402
from sparda.bench.models import random_forecast  # noqa: E402
from sparda.bench.op_count import twin_engine  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.model.fused import FusedDecoder  # noqa: E402
from test_buckets import _host_pages, _row_tensors  # noqa: E402

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=2)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("method,options", [("sparda", {"offload": True, "kv_dtype": "int4"}),
                                            ("sparda", {"offload": True, "lookahead": 2}),
                                            ("sparda", {"offload": True, "kv_dtype": "mixed"}),
                                            ("sparda", {"offload": True, "kv_dtype": "mixed", "lookahead": 2}),
                                            ("sparse-offload", {}), ("sparse", {"kv_dtype": "int8"}),
                                            ("sparda", {"offload": False}), ("dense", {})],
                         ids=["sparda-offload-int4", "sparda-offload-lookahead2", "sparda-offload-mixed",
                              "sparda-offload-mixed-lookahead2", "sparse-offload", "sparse-int8", "sparda", "dense"])
def test_fused_triton_bucket_step_leaves_the_rows_past_it(tiny_model, method, options, fresh_seed, monkeypatch):
    monkeypatch.setattr(kernels, "_on_triton", lambda *tensors: True)  # CPU tensors take the Triton kernels
    two = {"forecast2": random_forecast(tiny_model, ahead=2)} if options.get("lookahead") == 2 else {}
    llm = LLM.from_model(tiny_model, method=method, preset="small", forecast=random_forecast(tiny_model),
                         fused_decode=True, cuda_graphs=False, **SMALL, **options, **two)
    llm.model_runner._fused_checked, llm.model_runner._fused = True, FusedDecoder(tiny_model, llm.method)
    rows, b = 4, int(torch.randint(1, 4, ()))
    lengths = torch.randint(70, 110, (rows,)).tolist()
    prompts = [torch.randint(100, 20000, (n,)).tolist() for n in lengths]
    caches = []
    with torch.inference_mode():
        for _ in range(2):
            llm.method.reset()
            cache = llm.new_cache(rows, max(lengths) + 8)
            twin_engine(cache)  # the append kernel writes the host store (and mixed's pool) itself
            first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
            caches.append(cache)
    cache, twin = caches
    mixed = options.get("kv_dtype") == "mixed"
    if cache.offload:
        assert all(cache._fused_host(layer) is not None for layer in cache.offloaded)
    tokens, positions = first.argmax(-1), torch.tensor(lengths)
    where = f"seed {fresh_seed}, {method} {options}, b={b}"
    for step in range(2):
        before = {k: v.clone() for k, v in _row_tensors(cache, rows).items()}
        pages = [t.clone() for t in _host_pages(cache, range(b, rows))]
        with _launches(monkeypatch) as seen:
            got = llm.decode(cache, tokens[:b], positions[:b])
        if mixed:  # the hot operands of the step's b rows only: a grid of b * H programs
            assert seen["hot"] and all(n == (b, b) for n in seen["hot"]), (where, seen["hot"])
            assert seen["pool"] and all(n == b for n in seen["pool"]), (where, seen["pool"])
        want = llm.decode(twin, tokens, positions)
        assert torch.allclose(got, want[:b], rtol=1e-4, atol=1e-4), (where, step)
        for name, value in _row_tensors(cache, rows).items():
            old = before.get(name, torch.zeros_like(value))
            assert torch.equal(value[b:].nan_to_num(), old[b:].nan_to_num()), (where, step, name)
        for old, new in zip(pages, _host_pages(cache, range(b, rows))):
            assert torch.equal(old, new), (where, step, "host pages")
        assert torch.equal(cache.lengths[:b], positions[:b] + 1), (where, step)
        tokens = torch.cat([got.argmax(-1), want[b:].argmax(-1)])
        positions = positions + 1
    if options.get("lookahead") == 2:  # the early diff (design §6.2) copied into the slots of rows < b
        assert int(cache.prefetcher.early[:b].sum()) > 0, where


@contextlib.contextmanager
def _launches(monkeypatch):
    """While in the block, record per Triton slot diff with ``hot`` operands ``(rows of ids,
    rows of the hot state)`` (``"hot"``) and per append with a hot pool its rows (``"pool"``)."""
    diff_mod, append_mod = kernels._slot_diff, kernels._rope_append
    seen = {"hot": [], "pool": []}
    diff, append = diff_mod.slot_diff_triton, append_mod.rope_append_triton

    def slot_diff(*args, **kwargs):
        hot = inspect.signature(diff).bind(*args, **kwargs).arguments.get("hot")
        if hot is not None:
            seen["hot"].append((args[0].shape[0], hot.hot.shape[0]))
        return diff(*args, **kwargs)

    def rope_append(qkv, *args, pool=None, **kwargs):
        if pool is not None:
            seen["pool"].append(qkv.shape[0])
        return append(qkv, *args, pool=pool, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(diff_mod, "slot_diff_triton", slot_diff)
        m.setattr(append_mod, "rope_append_triton", rope_append)
        yield seen
