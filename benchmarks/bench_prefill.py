"""Prefill benchmarks: one entry point, one subcommand per measurement (docs/bench.md).

Run from the repository root (``ttft``, ``attention``, ``batch`` and ``h2o`` on a CUDA
machine; ``overlap`` on the CPU)::

    python3 benchmarks/bench_prefill.py ttft OUT [--budget-s 420] [--lengths ...]   # whole-model long prefill
    python3 benchmarks/bench_prefill.py attention OUT [--parts ...] [--old PATH]  # the prefill kernels alone
    python3 benchmarks/bench_prefill.py batch [--model M] [--methods ...] [--out DIR]  # batched prefill
    python3 benchmarks/bench_prefill.py overlap OUT.json [--tokens 4096]  # selection overlap of real tokens
    python3 benchmarks/bench_prefill.py h2o [--out FILE.json]  # h2o's block mass: Triton vs SDPA backward

``python3 benchmarks/bench_prefill.py SUBCOMMAND --help`` describes each one: what it
measures, its options and the file it writes (``OUT/prefill_gpu.json``,
``OUT/prefill_attention_gpu.json``, ``DIR/prefill_batch.json``, ``OUT.json``,
``FILE.json``: the formats of the result pages under docs/results/benchmarks/).

The subcommands replace the former scripts ``prefill_gpu.py`` (``ttft``),
``prefill_attention_gpu.py`` (``attention``), ``prefill_batch_gpu.py`` (``batch``),
``prefill_overlap.py`` (``overlap``) and ``h2o_prefill_gpu.py`` (``h2o``), with the same
measurements and output files.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda import kernels  # noqa: E402
from sparda.attention import base, dense as dense_mod  # noqa: E402
from sparda.bench.gpu_profile import profile_call  # noqa: E402
from sparda.bench.harness import NoText, git_commit, prefill_selection_check  # noqa: E402
from sparda.bench.models import build_model, random_forecast, weight_bytes  # noqa: E402
from sparda.bench.timing import cuda_ms  # noqa: E402
from sparda.bench.traces import synthetic_prefill_mask  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.data import heldout_text  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.kernels import prefill_attention, reference, twins  # noqa: E402
from sparda.kernels.prefill_attention import prefill_attention_triton, tile_block_lists  # noqa: E402
from sparda.kernels.prefill_selection import select_prefill_blocks_triton  # noqa: E402


TTFT_DOC = """\
Long prefill on the GPU (issue #11): TTFT, tok/s, selection and attention ms per layer, peak memory.

Usage (one CUDA GPU, from the repository root; under 8 minutes on an H200: points stop at
``budget - 120 s``, the parity run's two parts start before ``budget``):

    python3 benchmarks/bench_prefill.py ttft OUT [--budget-s 420] [--lengths 32768,65536,131072]
        [--models minicpm-8b,llama-8b] [--methods dense,sparse,...] [--chunk 8192] [--skip-parity]
        [--keep 0.83] [--profile] [--topk-search bisect,bracket] [--query-stages 1,3]

Random bf16 weights at the 8B shapes of :mod:`sparda.bench.models`, the ``paper`` preset,
block-sparse prefill. Three parts, each failing soft (an error is recorded and the
script goes on) and all bounded by ``--budget-s``:

1. ``kernel_check``: the prefill selection kernel (``kernels.prefill_selection``, the bf16
   ``tl.dot`` path) against its PyTorch twin on the GPU, query-based G = 16 and 4 and the
   Forecast: agreement of the selected blocks and the score error.
2. ``points``: per model, length and method (``dense`` = unchunked flash SDPA; the others
   chunked by ``--chunk``): TTFT (prefill plus the first token's logits), prefill tok/s,
   selection and attention ms of the middle layer summed over the prompt's chunks (CUDA
   events around ``method.select`` and the attention call), the ms of its ``before_layer``
   (``forecast_ms_per_layer``: the Forecast projection and its RoPE for the next layer,
   which ``select`` does not include; ~0 for the query-based methods), peak GPU memory and
   peak minus weights. A point runs twice when the budget allows (the first compiles the
   kernels); ``warm`` says which was kept. ``--keep H``: the block-sparse points attend over
   synthetic masks whose neighbouring tokens keep ``H`` of their top-k (:class:`SyntheticMasks`;
   the selection kernels still run and are timed), records say ``masks``. ``--profile``: one
   more prefill of each warm point under ``torch.profiler`` (``profile``: kernel count and
   time, GPU busy and idle ms against the wall, synchronising/allocating runtime calls;
   :func:`sparda.bench.gpu_profile.profile_call`), to find host time the GPU waits on.
   ``--topk-search A,B``: each block-sparse point once per top-k search of the prefill
   selection kernel (``bracket``, the default, or ``bisect``; records say ``topk_search``).
   ``--query-stages 1,3``: each query-based point (``sparse``, ``sparse-offload``) once per
   pipeline depth of its scoring launch (records say ``query_num_stages``), so that the
   baseline runs at its fastest launch shape too.
3. ``parity``: 128K MiniCPM-8B shape, offloaded ``sparda`` with chunked prefill then 64
   greedy tokens, against the same with unchunked prefill (``chunked_vs_unchunked``, the
   criterion) and, time permitting, on-device ``sparda`` with unchunked prefill
   (``offload_vs_device``): equal tokens, the first mismatch, the first token's logits
   difference, peak memory of each run.

Writes ``OUT/prefill_gpu.json`` (atomically) and prints a short table.
"""

ATTENTION_DOC = """\
Block-sparse prefill attention on the GPU (issue #11): the packed-heads kernel in bf16
against its PyTorch twin, and its time at 128K against the previous kernel and flash SDPA.

Usage (one CUDA GPU, from the repository root):

    python3 benchmarks/bench_prefill.py attention OUT [--old PATH] [--parts check,timing,...]

1. ``check``: ``kernels.prefill_attention`` (bf16, real ``tl.dot``) vs
   ``reference.block_sparse_attention`` in fp32 on a 4K context, G = 1, 4, 16, with
   the masks of the prefill selection kernel (``paper`` preset): max relative error.
2. ``timing``: one layer-chunk of a 128K prefill, MiniCPM-8B shape (2 KV heads, G = 16)
   and Llama-8B shape (8 KV heads, G = 4): the last 8,192 query tokens over 131,072
   keys, masks from the prefill selection kernel on random bf16 queries and compressed
   keys; ms of the packed kernel, of the previous kernel (``--old``: a copy of the
   earlier ``prefill_attention.py``, if given), the packed kernel's estimate for the whole
   layer (16 such chunks; earlier chunks reach fewer blocks) against causal flash SDPA over
   the whole 128K layer; the mean number of blocks a tile walks against the blocks a token
   selected. Random queries make neighbouring tokens' selections nearly disjoint (a tile of
   4 tokens walks ~2.8x one token's blocks), real ones do not (``bench_prefill.py overlap``: the
   bundled model's ``sparda`` keeps 83 % of a token's top-k for the next token): the same
   kernel also runs on synthetic masks whose neighbouring tokens keep :data:`KEEPS` of their
   top-k (``bench.traces.synthetic_prefill_mask``).

3. ``selection``: the prefill selection kernel alone on the same chunk (last 8,192 tokens of
   128K): query-based with G = 16 and G = 4 and the Forecast (one head), ms per chunk and x16
   per layer, the top-k rule as its own launch (default) and inside the scoring program
   (``select_launch="fused"``), the scoring launch alone (the top-k launch replaced by a
   no-op) and whether the masks of both launch modes are equal; the top-k search
   ``topk_search="bracket"`` against the default bisection (ms, equal masks, and the
   fraction of rows that take its tie pass); to set against the in-model ``select_ms_per_layer`` of ``bench_prefill.py ttft``
   (CUDA events around ``method.select`` only: the row's compressed keys, the mask and
   scratch allocation and this kernel; the Forecast projection, its RoPE and the compressed
   keys' update run before it, in ``before_layer`` and the cache append, and are not counted).

4. ``tune``: launch shapes for the next defaults, on the same chunk: the attention kernel over
   ``block_m`` 16-128 (tokens per tile x G) x ``num_warps`` 4/8, the selection kernel over
   tokens per program 8-128 x ``num_warps`` 4/8, for both shapes and both selectors, and the
   top-k launch over rows per program 1-8 x warps 1-8.

5. ``chunks``: the selection call at *every* chunk of a 128K prefill in 8K chunks, MiniCPM-8B
   shape, as the model makes it (queries in the projection's ``[B, T, H, d]`` layout seen as
   ``[B, H, T, d]``, the dense-fallback prefix cut off, ``N`` and the compressed keys growing
   with the chunk; Forecast with the lookahead rule, query-based G = 16): GPU ms per chunk
   and their sum per layer (the kernel-only figure that the x16 of ``selection`` bounds from
   above: the Forecast's top-k phase scans ``next_pow2(N)`` blocks per token whatever its
   position, so its chunks do not average half of the last one), and the host microseconds
   one call takes while the GPU is busy (the launch cost a GPU left idle by a host sync waits for).

6. ``regs`` (only when asked for): registers, spills and shared memory of the selection
   launches as compiled for that chunk (the scoring launch and both top-k searches).

7. ``topk`` (only when asked for): the Forecast's two launches on its last chunk, both
   shapes: the scoring launch alone for 64 / 128 tokens per program x 4 / 8 warps x 1-3
   pipeline stages, then the top-k launch alone (the selection call minus the scoring
   launch alone) for each search (``bisect``, ``bracket``) x 1 / 2 warps x register cap
   (none, 168, 128: Triton's ``maxnreg``), masks against the default's.

``--parts`` picks some of them (default: the first five). The top-k launches under Nsight
Compute: ``ncu --clock-control none -k regex:_prefill_topk -c 4 --set full -o OUT/topk
python3 benchmarks/bench_prefill.py attention OUT --parts selection``.
Writes ``OUT/prefill_attention_gpu.json`` and prints a short table.
"""

BATCH_DOC = """\
Batched prefill (design §3.8) on the GPU: same tokens as one prompt per forward, and the time.

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/bench_prefill.py batch [--model GGUF_OR_DIR] [--lengths 2048,7680]
        [--methods dense,sparse,oracle,sparda,sparda-random,infinigen,streaming,h2o,quest,snapkv,shallow,
                   sparda:offload=true+kv_dtype=int8,sparda:offload=true+kv_dtype=mixed,
                   shallow:offload=true]
        [--batch 16]
        [--new-tokens 24] [--out DIR]

For each method (``method:key=value+key=value`` adds ``LLM`` options: the default list
ends with offloaded ``sparda`` over int8 and mixed KV caches and offloaded ``shallow``) and
prompt length, ``--batch`` held-out-text prompts (each cut to a length drawn within 40
tokens of ``--lengths``) go through ``LLM.generate`` twice on the
same model: with ``prefill_batch_tokens=0`` (one prompt per prefill forward, as before) and
with room for all of them in one forward. Records, per method and length: the share of
prompts whose greedy tokens agree exactly (bf16: a different summation order may flip a
near tie late in a completion), the share of first tokens that agree, the mean
prefill wall time per prompt of each (CUDA-synchronised, after one warm-up call), and the
CUDA kernels launched by one prefill of the batch (``torch.profiler``). Writes
``DIR/prefill_batch.json`` and prints a short table.
"""

OVERLAP_DOC = """\
How much neighbouring query tokens share their prefill selection (CPU, bundled model).

The block-sparse prefill attention kernel walks, per tile of ``T`` consecutive query tokens
(64 rows: ``T = 64 / G``), the union of the tile's selected blocks, so its cost follows the
overlap of neighbouring tokens' selections. Random weights (the 8B-shape benchmarks) give
nearly disjoint top-k sets; this script measures the overlap of real selections: the bundled
SmolLM2-135M on held-out Emma, block-sparse prefill (``small`` preset geometry, the dense
fallback lowered so every token past the first blocks selects), for ``sparda`` (shipped
Forecast), ``sparse`` (query-based) and ``sparda-random`` (an untrained Forecast).

Per method, over layers >= 1 and all KV heads: ``keep``, the fraction of a token's top-k
(non-forced) blocks that the previous token also chose (the decode hit rate's prefill
analogue), and ``union_T`` for T = 1, 4, 16: blocks in the union over T consecutive
tokens / blocks one token selects.

Usage: ``python3 benchmarks/bench_prefill.py overlap OUT.json [--tokens 4096]``.
"""

H2O_DOC = """\
h2o's prefill block mass on the GPU: the Triton kernel against the SDPA-backward twin.

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/bench_prefill.py h2o [--out FILE.json]

For the bundled model's attention shape (3 KV heads x 3 query heads, d = 64, block 32) at
2,048, 4,096 and 7,680 tokens, bf16 queries and keys (as the model gives them), plus a
later prefill chunk (the last 1,000 queries of 7,680 keys) and one fp32 case:
:func:`sparda.kernels.prefill_block_mass` (on CUDA the two Triton passes of
:mod:`sparda.kernels.attention_mass`: bf16 ``tl.dot`` with fp32 accumulation, IEEE fp32
dots for fp32 inputs) against :func:`sparda.kernels.twins.token_attention_mass_reference`
summed onto blocks (SDPA forward + backward in fp32, the path it replaced on CUDA) and
against float64 (a materialised softmax, query chunks). Prints the largest relative errors
and the time of each path (median of 5 after a warm-up, CUDA-synchronised), in a short
table; exits 1 if the Triton mass is off by more than 1e-3 relative to float64.
"""


# --------------------------------------------------------------------------------- ttft
#: label -> (method, offload)
TTFT_METHODS = {"dense": ("dense", False), "sparse": ("sparse", False), "sparse-offload": ("sparse-offload", None),
           "sparda": ("sparda", False), "sparda-offload": ("sparda", True),
           "sparda-no-prefetch": ("sparda-no-prefetch", None)}
GIB = 2 ** 30


class LayerTimer:
    """CUDA events around ``method.select``, ``method.before_layer`` and the attention call
    of one layer (prefill).

    Wraps the method instance's ``attend``/``select``/``before_layer`` and the module-level
    attention functions that ``attend`` calls; ``totals()`` syncs and sums the elapsed ms."""

    KINDS = ("select", "forecast", "attention")

    def __init__(self, method, layer: int) -> None:
        self.method, self.layer, self.active = method, layer, False
        self.events = {kind: [] for kind in self.KINDS}
        self._saved = []
        attend, select = method.attend, getattr(method, "select", None)
        before = getattr(method, "before_layer", None)

        def timed_attend(lay, *args, **kwargs):
            self.active = lay == layer
            try:
                return attend(lay, *args, **kwargs)
            finally:
                self.active = False

        method.attend = timed_attend
        if select is not None:
            method.select = self._wrap(select, "select")
        if before is not None:
            method.before_layer = self._wrap(before, "forecast")
        for module, name in ((base, "sparse_attention"), (base, "dense_attention"), (dense_mod, "dense_attention")):
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(fn, "attention"))

    def _wrap(self, fn, kind):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self.events[kind].append((start, end))
        return timed

    def reset(self) -> None:
        self.events = {kind: [] for kind in self.KINDS}

    def totals(self) -> dict:
        torch.cuda.synchronize()
        return {f"{k}_ms_per_layer": round(sum(s.elapsed_time(e) for s, e in v), 3) if v else None
                for k, v in self.events.items()}

    def close(self) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        self.method.__dict__.pop("attend", None)
        self.method.__dict__.pop("select", None)
        self.method.__dict__.pop("before_layer", None)


class SyntheticMasks:
    """``--keep H``: while active, ``kernels.select_prefill_blocks`` still runs (its cost is
    measured) but returns a synthetic mask instead of its own: per token the forced blocks
    plus ``topk_blocks`` others, ``round(H * k)`` of them the previous token's
    (``bench.traces.synthetic_prefill_mask``; random queries make neighbouring tokens' selections
    nearly disjoint, real ones keep ~83 %, ``bench_prefill.py overlap``). One mask per
    chunk, shared by its layers, keyed by the call's shapes (queries, blocks, KV heads: no
    host sync) and drawn at the first call of that chunk (so in the first, compiling run;
    the second, warm run finds them all; the chunk is taken to end at ``blocks x block``)."""

    def __init__(self, keep: float, cfg):
        self.keep, self.cfg, self.cache = keep, cfg, {}
        self.made_in_timed_run = False

    def __enter__(self):
        from sparda import kernels

        self._kernels, self._original = kernels, kernels.select_prefill_blocks

        def select(query, ck, q_pos, num_blocks, cfg, **kw):
            self._original(query, ck, q_pos, num_blocks, cfg, **kw)  # its cost stays in the timing
            heads, tq = ck.shape[1], q_pos.shape[1]
            key = (tq, num_blocks, heads)
            if key not in self.cache:
                from sparda.bench.traces import synthetic_prefill_mask

                self.cache[key] = synthetic_prefill_mask(heads, cfg, num_blocks * cfg.block_size, tq, num_blocks,
                                                         self.keep, seed=len(self.cache)).to(q_pos.device)
                self.made_in_timed_run = self.timed
            return self.cache[key].expand(q_pos.shape[0], -1, -1, -1)

        self.timed = False
        kernels.select_prefill_blocks = select
        return self

    def __exit__(self, *exc):
        self._kernels.select_prefill_blocks = self._original


@contextlib.contextmanager
def selection_options(search=None, query_stages=None):
    """While active, the prefill selection kernel runs with ``topk_search=search`` and the
    query-based selector's scoring launch with ``num_stages=query_stages`` (``None``: the
    kernel's defaults)."""
    if search is None and query_stages is None:
        yield
        return
    from sparda.kernels import prefill_selection as ps

    original = ps.select_prefill_blocks_triton

    def select(query, *args, **kwargs):
        if search is not None:
            kwargs["topk_search"] = search
        if query_stages is not None and query.dim() == 5:  # [B, H, G, Tq, d]: query-based
            kwargs["num_stages"] = query_stages
        return original(query, *args, **kwargs)

    ps.select_prefill_blocks_triton = select
    try:
        yield
    finally:
        ps.select_prefill_blocks_triton = original


def _prefill_once(llm, ids, timer):
    cache = llm.new_cache(1, len(ids) + 64)
    llm.method.reset()
    if timer is not None:
        timer.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = llm.prefill(cache, 0, ids)
    first = int(logits[-1].argmax())  # the first token: TTFT includes its logits
    torch.cuda.synchronize()
    ttft = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    del cache, logits
    return ttft, peak, first


def run_point(model, forecast, weights, label, length, chunk, deadline, keep=None, profile=False):
    method, offload = TTFT_METHODS[label]
    llm = LLM.from_model(model, NoText(), method=method, preset="paper", forecast=forecast, offload=offload,
                         prefill_chunk_tokens=0 if label == "dense" else chunk)
    ids = torch.randint(0, model.config.vocab_size, (length,)).tolist()
    timer = LayerTimer(llm.method, model.shape.num_layers // 2)
    synthetic = SyntheticMasks(keep, llm.config.selection) if keep is not None and label != "dense" else None
    try:
        with synthetic or contextlib.nullcontext():
            ttft, peak, _ = _prefill_once(llm, ids, timer)
            warm = False
            if time.perf_counter() + 1.5 * ttft < deadline:  # the first run compiled the kernels
                if synthetic is not None:
                    synthetic.timed = True
                ttft, peak, _ = _prefill_once(llm, ids, timer)
                warm = True
        layer = timer.totals()
    finally:
        timer.close()
    traced = None
    if profile and warm and time.perf_counter() + 3 * ttft < deadline:  # the profiler slows the run
        with synthetic or contextlib.nullcontext():
            traced = profile_call(lambda: _prefill_once(llm, ids, None))
    rec = {"ttft_s": round(ttft, 3), "prefill_tok_s": round(length / ttft, 1), **layer,
           "peak_gpu_gib": round(peak / GIB, 3), "peak_minus_weights_gib": round((peak - weights) / GIB, 3),
           "warm": warm, "chunk_tokens": 0 if label == "dense" else chunk,
           "offloaded": bool(getattr(llm.method, "offloaded", False) or llm.config.offload)}
    if profile:
        rec["profile"] = traced if traced is not None else "skipped (time budget, or no warm run)"
    if synthetic is not None:  # masks drawn inside the kept run would count in its TTFT
        rec.update(masks=f"synthetic, top-k keep {keep}", masks_drawn_in_kept_run=synthetic.made_in_timed_run or not warm)
    return rec


def parity(deadline, chunk) -> dict:
    """128K, MiniCPM-8B shape, offloaded sparda decoding 64 greedy tokens after a chunked
    prefill vs after an unchunked one (the #11 criterion: same decode path, only the prefill
    differs); then, time permitting, on-device sparda with unchunked prefill (another decode
    path: its bf16 rounding may move a token of this random model)."""
    model = build_model("minicpm-8b", "cuda", torch.bfloat16, max_positions=131072 + 256)
    forecast = random_forecast(model)
    ids = torch.randint(0, model.config.vocab_size, (131072,)).tolist()
    out = {}
    runs = (("offload_chunked", True, chunk), ("offload_unchunked", True, 0), ("device_unchunked", False, 0))
    for label, offload, chunking in runs:
        if time.perf_counter() > deadline:
            out[label] = {"status": "skipped (time budget)"}
            continue
        llm = LLM.from_model(model, NoText(), method="sparda", preset="paper", forecast=forecast, offload=offload,
                             prefill_chunk_tokens=chunking)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        res = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=64, ignore_eos=True)[0]
        torch.cuda.synchronize()
        out[label] = {"tokens": res.token_ids, "seconds": round(time.perf_counter() - start, 2),
                      "prefill_ms": res.stats["prefill_ms"],
                      "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}
        cache = llm.new_cache(1, len(ids) + 1)
        llm.method.reset()
        out[label]["first_logits"] = llm.prefill(cache, 0, ids)[-1].float().cpu()
        del cache, llm
        torch.cuda.empty_cache()

    def compare(a_label, b_label) -> dict:
        a, b = out[a_label], out[b_label]
        if "tokens" not in a or "tokens" not in b:
            return {"status": "skipped"}
        la, lb = a["first_logits"], b["first_logits"]
        return {"tokens_equal": a["tokens"] == b["tokens"],
                "first_mismatch": next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None),
                "first_logits_rel_diff": float((la - lb).norm() / la.norm())}

    out["chunked_vs_unchunked"] = compare("offload_chunked", "offload_unchunked")  # the criterion
    out["offload_vs_device"] = compare("offload_unchunked", "device_unchunked")
    out["tokens_equal"] = out["chunked_vs_unchunked"].get("tokens_equal")
    out["weights_gib"] = round(weight_bytes(model) / GIB, 3)
    for v in out.values():
        if isinstance(v, dict):
            v.pop("first_logits", None)
    del model
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------- attention
def _inputs(heads: int, groups: int, num_keys: int, num_q: int, cfg, d: int = 128, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, heads, groups, num_q, d, device="cuda", generator=gen).bfloat16()
    k = torch.randn(1, heads, num_keys, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(1, heads, num_keys, d, device="cuda", generator=gen).bfloat16()
    num_ck = reference.num_compressed(num_keys, cfg.kernel_size, cfg.kernel_stride)
    ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
    q_pos = torch.arange(num_keys - num_q, num_keys, device="cuda").view(1, -1)
    mask = select_prefill_blocks_triton((q * 0.3).bfloat16(), ck, q_pos, -(-num_keys // cfg.block_size), cfg)
    kv_len = torch.tensor([num_keys], device="cuda")
    return q, k, v, mask, q_pos, kv_len


#: top-k reuse between neighbouring query tokens for the synthetic masks of ``timing``: 0.83
#: is what ``sparda``'s prefill selection keeps on the bundled model (``bench_prefill.py overlap``,
#: design §3.5), 0.9 the decode trace's step-to-step reuse
KEEPS = (0.83, 0.9)


def check(cfg) -> list[dict]:
    rows = []
    for groups in (1, 4, 16):
        q, k, v, mask, q_pos, kv_len = _inputs(2, groups, 4096, 1024, cfg, seed=groups)
        out = prefill_attention(q, k, v, mask, q_pos, kv_len, cfg.block_size).float()
        ref = reference.block_sparse_attention(q.float(), k.float(), v.float(), mask, q_pos, kv_len, cfg.block_size)
        rows.append({"groups": groups, "max_rel_err": float((out - ref).abs().max() / ref.abs().max()),
                     "rel_err": float((out - ref).norm() / ref.norm())})
        print("check", rows[-1], flush=True)
    return rows


def timing(cfg, old) -> list[dict]:
    rows = []
    for shape, heads, groups in (("minicpm-8b", 2, 16), ("llama-8b", 8, 4)):
        q, k, v, mask, q_pos, kv_len = _inputs(heads, groups, 131072, 8192, cfg)
        row = {"shape": shape, "kv_heads": heads, "groups": groups, "keys": 131072, "queries": 8192,
               "blocks_per_token": float(mask.sum(-1).float().mean())}
        g_p = 1 << (groups - 1).bit_length()
        for label, tokens in (("packed", max(1, 64 // g_p)), ("old", 64)):
            _, counts = tile_block_lists(mask, q_pos, kv_len, heads, 131072, cfg.block_size, tokens)
            row[f"blocks_per_tile_{label}"] = float(counts.float().mean())
        row["packed_ms"] = cuda_ms(lambda: prefill_attention(q, k, v, mask, q_pos, kv_len, cfg.block_size), reps=5)
        for keep in KEEPS:  # neighbouring tokens sharing their top-k as real selections do
            synth = synthetic_prefill_mask(heads, cfg, 131072, 8192, mask.shape[-1], keep).to(mask.device)
            _, counts = tile_block_lists(synth, q_pos, kv_len, heads, 131072, cfg.block_size, max(1, 64 // g_p))
            row[f"keep_{keep}"] = {
                "blocks_per_token": round(float(synth.sum(-1).float().mean()), 1),
                "blocks_per_tile": round(float(counts.float().mean()), 1),
                "ms": round(cuda_ms(lambda: prefill_attention(q, k, v, synth, q_pos, kv_len, cfg.block_size), reps=5), 3)}
            print("timing", shape, "keep", keep, row[f"keep_{keep}"], flush=True)
            del synth
        if old is not None:
            row["old_ms"] = cuda_ms(lambda: old.prefill_attention_triton(q, k, v, mask, q_pos, kv_len, cfg.block_size),
                                    reps=5)
        del q, k, v, mask
        torch.cuda.empty_cache()
        # flash SDPA over the whole causal 128K prompt of one layer (dense prefill's cost per layer)
        qkv = [torch.randn(1, heads * groups if i == 0 else heads, 131072, 128, device="cuda").bfloat16()
               for i in range(3)]
        row["sdpa_layer_ms"] = cuda_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
            *qkv, is_causal=True, enable_gqa=True), reps=2)
        row["packed_layer_ms_est"] = row["packed_ms"] * 131072 / 8192  # 16 chunks, each at most this chunk's
        del qkv
        rows.append({k_: (round(v_, 3) if isinstance(v_, float) else v_) for k_, v_ in row.items()})
        print("timing", rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


class _NoLaunch:
    """Stands in for a Triton kernel: ``[grid](...)`` launches nothing (times the rest)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _scoring_only(ps):
    """While active, both top-k launches of the prefill selection launch nothing: a call
    times its scoring launch alone."""
    names = ("_prefill_topk_kernel", "_prefill_topk_bracket_kernel")
    saved = {name: getattr(ps, name) for name in names}
    for name in names:
        setattr(ps, name, _NoLaunch())
    try:
        yield
    finally:
        for name, kernel in saved.items():
            setattr(ps, name, kernel)


def _tie_rows(scores: torch.Tensor, q_pos: torch.Tensor, cfg) -> float:
    """Fraction of query rows whose k-th and (k+1)-th candidate block scores share their
    31-bit key (``topk_search="bracket"`` runs its tie pass on those rows)."""
    num_blocks = scores.shape[-1]
    blocks = torch.arange(num_blocks, device=scores.device).view(1, 1, 1, -1)
    cur = (q_pos // cfg.block_size)[:, None, :, None]
    cand = (blocks <= cur) & ~reference.forced_blocks(q_pos, num_blocks, cfg)
    # the rule's ranking key without its block-index bits (reference.select_blocks' sanitising)
    key = reference._rank_key(scores.nan_to_num(nan=-1e30, neginf=-1e30)) >> 24
    key = key.masked_fill(~cand, -2**40)
    top = key.topk(cfg.topk_blocks + 1, dim=-1).values
    dense = (q_pos + 1 < cfg.dense_len) | (q_pos // cfg.block_size + 1 <= cfg.budget_blocks)  # no top-k there
    enough = ((cand.sum(-1) > cfg.topk_blocks) & ~dense[:, None]).expand(top.shape[:-1])
    tie = (top[..., -2] >> 1) == (top[..., -1] >> 1)
    return float((tie & enough).float().sum() / enough.float().sum().clamp_min(1))


def selection(cfg) -> list[dict]:
    rows = []
    num_keys, num_q, d = 131072, 8192, 128
    num_ck = reference.num_compressed(num_keys, cfg.kernel_size, cfg.kernel_stride)
    gen = torch.Generator(device="cuda").manual_seed(1)
    q_pos = torch.arange(num_keys - num_q, num_keys, device="cuda").view(1, -1)
    for label, heads, groups in (("query G=16", 2, 16), ("forecast (MiniCPM)", 2, None),
                                 ("query G=4", 8, 4), ("forecast (Llama)", 8, None)):
        ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
        shape = (1, heads, num_q, d) if groups is None else (1, heads, groups, num_q, d)
        query = (torch.randn(shape, device="cuda", generator=gen) * 0.3).bfloat16()
        ms = {launch: cuda_ms(lambda: select_prefill_blocks_triton(
            query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=groups is None, select_launch=launch,
            topk_search="bisect"), reps=5) for launch in ("split", "fused")}
        ps = sys.modules[select_prefill_blocks_triton.__module__]
        with _scoring_only(ps):  # the scoring launch alone: split minus this is the top-k launch
            ms["scoring"] = cuda_ms(lambda: select_prefill_blocks_triton(
                query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=groups is None), reps=5)
        ms["bracket"] = cuda_ms(lambda: select_prefill_blocks_triton(
            query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=groups is None, topk_search="bracket"), reps=5)
        masks = [select_prefill_blocks_triton(query, ck, q_pos, num_keys // cfg.block_size, cfg,
                                              lookahead=groups is None, **kw)
                 for kw in ({"topk_search": "bisect"}, {"select_launch": "fused"}, {"topk_search": "bracket"})]
        scores = select_prefill_blocks_triton(query, ck, q_pos, num_keys // cfg.block_size, cfg,
                                              lookahead=groups is None, return_scores=True)[1]
        rows.append({"selector": label, "kv_heads": heads, "chunk_ms": round(ms["split"], 3),
                     "fused_chunk_ms": round(ms["fused"], 3), "split_equals_fused": bool(torch.equal(*masks[:2])),
                     "scoring_ms": round(ms["scoring"], 3), "topk_ms": round(ms["split"] - ms["scoring"], 3),
                     "bracket_chunk_ms": round(ms["bracket"], 3),
                     "bracket_topk_ms": round(ms["bracket"] - ms["scoring"], 3),
                     "bracket_equals_bisect": bool(torch.equal(masks[0], masks[2])),
                     "tie_row_fraction": round(_tie_rows(scores, q_pos, cfg), 4),
                     "layer_ms_est": round(ms["split"] * num_keys / num_q, 1)})
        del scores, masks
        print("selection", rows[-1], flush=True)
        del ck, query
    return rows


def _tune_ms(fn, reps: int, *what) -> float | None:
    """``cuda_ms(fn)``, or ``None`` (printed) when a launch shape fails, e.g. out of shared memory."""
    try:
        return cuda_ms(fn, reps=reps)
    except Exception as exc:  # record, go on with the next shape
        print("tune", *what, "failed:", str(exc).splitlines()[0], flush=True)
        return None


def tune(cfg) -> list[dict]:
    """Launch shapes for the next defaults: the prefill attention kernel over ``block_m`` (rows
    per program = tokens per tile x G) x ``num_warps`` on the same 8K chunk at 128K, and the
    selection kernel over ``block_m`` (tokens per program for the Forecast, tokens x G for the
    query-based selector) x ``num_warps``; ms per chunk of each, blocks walked per tile."""
    rows = []
    for shape, heads, groups in (("minicpm-8b", 2, 16), ("llama-8b", 8, 4)):
        q, k, v, mask, q_pos, kv_len = _inputs(heads, groups, 131072, 8192, cfg)
        g_p = 1 << (groups - 1).bit_length()
        for block_m in (16, 32, 64, 128):
            if block_m < g_p:
                continue
            _, counts = tile_block_lists(mask, q_pos, kv_len, heads, 131072, cfg.block_size, block_m // g_p)
            for warps in (4, 8):
                ms = _tune_ms(lambda: prefill_attention_triton(q, k, v, mask, q_pos, kv_len, cfg.block_size,
                                                               block_m=block_m, num_warps=warps),
                              5, "attention", shape, block_m, warps)
                rows.append({"kernel": "attention", "shape": shape, "groups": groups, "block_m": block_m,
                             "tokens_per_tile": block_m // g_p, "num_warps": warps,
                             "blocks_per_tile": round(float(counts.float().mean()), 1),
                             "chunk_ms": None if ms is None else round(ms, 3)})
                print("tune", rows[-1], flush=True)
        del q, k, v, mask
        torch.cuda.empty_cache()
    num_keys, num_q, d = 131072, 8192, 128
    num_ck = reference.num_compressed(num_keys, cfg.kernel_size, cfg.kernel_stride)
    gen = torch.Generator(device="cuda").manual_seed(2)
    q_pos = torch.arange(num_keys - num_q, num_keys, device="cuda").view(1, -1)
    for label, heads, groups in (("forecast (MiniCPM)", 2, None), ("forecast (Llama)", 8, None),
                                 ("query G=16", 2, 16), ("query G=4", 8, 4)):
        ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
        shape = (1, heads, num_q, d) if groups is None else (1, heads, groups, num_q, d)
        query = (torch.randn(shape, device="cuda", generator=gen) * 0.3).bfloat16()
        g_p = 1 if groups is None else 1 << (groups - 1).bit_length()
        for tokens in (8, 16, 32, 64, 128):
            if tokens * g_p > 256 or tokens * g_p < 16:
                continue
            for warps in (4, 8):
                ms = _tune_ms(lambda: select_prefill_blocks_triton(
                    query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=groups is None,
                    block_m=tokens, num_warps=warps, num_stages=1), 5, "selection", label, tokens, warps)
                rows.append({"kernel": "selection", "selector": label, "block_m": tokens, "rows": tokens * g_p,
                             "num_warps": warps, "num_stages": 1, "chunk_ms": None if ms is None else round(ms, 3)})
                print("tune", rows[-1], flush=True)
        for topk_rows in (1, 2, 4, 8):  # the bisection's launch: rows per program x warps (default scoring)
            for topk_warps in (1, 2, 4, 8):
                ms = _tune_ms(lambda: select_prefill_blocks_triton(
                    query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=groups is None,
                    topk_rows=topk_rows, topk_warps=topk_warps, topk_search="bisect"), 3, "topk", label,
                    topk_rows, topk_warps)
                rows.append({"kernel": "topk", "search": "bisect", "selector": label, "block_m": topk_rows,
                             "rows": topk_rows, "num_warps": topk_warps,
                             "chunk_ms": None if ms is None else round(ms, 3)})
                print("tune", rows[-1], flush=True)
        del ck, query
    return rows


class _MaxRegs:
    """Stands in for a Triton kernel: ``[grid](...)`` launches it with ``maxnreg`` (a register cap
    per thread, a Triton launch option on CUDA) added."""

    def __init__(self, kernel, maxnreg: int):
        self.kernel, self.maxnreg = kernel, maxnreg

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, maxnreg=self.maxnreg, **kwargs)


def topk(cfg) -> list[dict]:
    """Part ``topk``: the Forecast's two selection launches on the last 8K chunk of a 128K
    prompt (both 8B shapes). The scoring launch alone (top-k launch replaced by a no-op) for
    tokens per program 64 / 128 x 4 / 8 warps x pipeline stages 1-3; then the top-k launch
    alone (the whole call minus the default scoring alone) for each search (``bisect``,
    ``bracket``), warp count and register cap; masks against the default's."""
    ps = sys.modules[select_prefill_blocks_triton.__module__]
    num_keys, num_q, d = 131072, 8192, 128
    num_ck = reference.num_compressed(num_keys, cfg.kernel_size, cfg.kernel_stride)
    gen = torch.Generator(device="cuda").manual_seed(4)
    q_pos = torch.arange(num_keys - num_q, num_keys, device="cuda").view(1, -1)
    rows = []
    for label, heads in (("forecast (MiniCPM)", 2), ("forecast (Llama)", 8)):
        ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
        query = (torch.randn(1, heads, num_q, d, device="cuda", generator=gen) * 0.3).bfloat16()

        def call(**kw):
            return select_prefill_blocks_triton(query, ck, q_pos, num_keys // cfg.block_size, cfg, lookahead=True,
                                                **kw)

        want = call()
        for block_m in (64, 128):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    ms = _tune_ms(lambda: call(block_m=block_m, num_warps=warps, num_stages=stages), 10, "scoring",
                                  label, block_m, warps, stages)
                    same = ms is not None and bool(torch.equal(call(block_m=block_m, num_warps=warps,
                                                                    num_stages=stages), want))
                    with _scoring_only(ps):
                        alone = ms and _tune_ms(lambda: call(block_m=block_m, num_warps=warps, num_stages=stages),
                                                10, "scoring", label, block_m, warps, stages)
                    rows.append({"selector": label, "launch": "scoring", "block_m": block_m, "num_warps": warps,
                                 "num_stages": stages, "chunk_ms": None if ms is None else round(ms, 3),
                                 "scoring_ms": None if not alone else round(alone, 3), "equal": same})
                    print("topk", rows[-1], flush=True)
        with _scoring_only(ps):
            scoring = cuda_ms(call, reps=10)
        for search, name in (("bisect", "_prefill_topk_kernel"), ("bracket", "_prefill_topk_bracket_kernel")):
            for warps in (1, 2):
                for maxnreg in (None, 168, 128):
                    original, cap = getattr(ps, name), ps._BRACKET_MAXNREG
                    if search == "bracket":  # the launch reads its cap from the module (None: uncapped)
                        ps._BRACKET_MAXNREG = maxnreg
                    elif maxnreg:
                        setattr(ps, name, _MaxRegs(original, maxnreg))
                    try:
                        ms = _tune_ms(lambda: call(topk_search=search, topk_warps=warps), 10, "topk", label,
                                      search, warps, maxnreg)
                        same = ms is not None and bool(torch.equal(call(topk_search=search, topk_warps=warps), want))
                    finally:
                        setattr(ps, name, original)
                        ps._BRACKET_MAXNREG = cap
                    rows.append({"selector": label, "launch": "topk", "search": search, "num_warps": warps,
                                 "maxnreg": maxnreg,
                                 "chunk_ms": None if ms is None else round(ms, 3), "scoring_ms": round(scoring, 3),
                                 "topk_ms": None if ms is None else round(ms - scoring, 3), "equal": same})
                    print("topk", rows[-1], flush=True)
        del ck, query, want
    return rows


def chunks(cfg, total: int = 131072, chunk: int = 8192) -> list[dict]:
    """Part 5 (see the module docstring): one row per selector, ``per_chunk`` ms and host us."""
    import time

    heads, d = 2, 128
    prefix = max(cfg.dense_len - 1, cfg.budget_blocks * cfg.block_size)  # BlockSparseMethod.dense_prefix
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for label, groups in (("forecast (MiniCPM)", None), ("query G=16", 16)):
        per = []
        for start in range(0, total, chunk):
            end = min(total, start + chunk)
            first = min(end - start, max(0, prefix - start))
            if first == end - start:
                continue
            num_ck = reference.num_compressed(end, cfg.kernel_size, cfg.kernel_stride)
            ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
            g = groups or 1
            proj = (torch.randn(1, end - start, heads * g, d, device="cuda", generator=gen) * 0.3).bfloat16()
            query = proj.transpose(1, 2)  # [B, H*G, T, d], the model's layout after RoPE
            query = query[:, :, first:] if groups is None else query.view(1, heads, g, end - start, d)[..., first:, :]
            q_pos = torch.arange(start + first, end, device="cuda").view(1, -1)
            num_blocks = -(-end // cfg.block_size)

            def call(launch="split", search="bisect"):
                return select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg, lookahead=groups is None,
                                                    select_launch=launch, topk_search=search)

            ms = cuda_ms(call, reps=5)
            fused_ms = cuda_ms(lambda: call("fused"), reps=3)
            bracket_ms = cuda_ms(lambda: call(search="bracket"), reps=5)
            host = []
            for _ in range(5):
                torch.cuda._sleep(20_000_000)  # keep the GPU busy: time the host side alone
                t0 = time.perf_counter()
                call()
                host.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            per.append({"start": start, "queries": end - start - first, "blocks": num_blocks,
                        "ms": round(ms, 4), "fused_ms": round(fused_ms, 4), "bracket_ms": round(bracket_ms, 4),
                        "host_us": round(min(host), 1)})
            del ck, proj, query
        row = {"selector": label, "layer_ms": round(sum(c["ms"] for c in per), 3),
               "fused_layer_ms": round(sum(c["fused_ms"] for c in per), 3),
               "bracket_layer_ms": round(sum(c["bracket_ms"] for c in per), 3),
               "last_chunk_x16_ms": round(per[-1]["ms"] * total / chunk, 3),
               "host_us_per_call": round(sum(c["host_us"] for c in per) / len(per), 1), "per_chunk": per}
        rows.append(row)
        print("chunks", {k: v for k, v in row.items() if k != "per_chunk"}, flush=True)
    return rows


def regs(cfg) -> list[dict]:
    """Part ``regs``: registers, spills and shared memory of the selection's two launches as
    compiled for the last 8K chunk of a 128K prompt (MiniCPM-8B shape, both selectors)."""
    ps = sys.modules[select_prefill_blocks_triton.__module__]
    num_keys, num_q, d = 131072, 8192, 128
    num_ck = reference.num_compressed(num_keys, cfg.kernel_size, cfg.kernel_stride)
    q_pos = torch.arange(num_keys - num_q, num_keys, device="cuda").view(1, -1)
    rows = []
    for label, groups in (("forecast (MiniCPM)", None), ("query G=16", 16)):
        ck = torch.randn(1, 2, num_ck, d, device="cuda").bfloat16()
        query = torch.randn((1, 2, num_q, d) if groups is None else (1, 2, groups, num_q, d), device="cuda").bfloat16()
        seen = {}
        originals = {name: getattr(ps, name) for name in ("_prefill_select_kernel", "_prefill_topk_kernel",
                                                          "_prefill_topk_bracket_kernel")}

        class Record:
            def __init__(self, name):
                self.name = name

            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    seen[self.name] = (grid, originals[self.name][grid](*args, **kwargs))
                return run
        try:
            for name in originals:
                setattr(ps, name, Record(name))
            for search in ("bisect", "bracket"):
                select_prefill_blocks_triton(query, ck, q_pos, num_keys // cfg.block_size, cfg,
                                             lookahead=groups is None, topk_search=search)
        finally:
            for name, kernel in originals.items():
                setattr(ps, name, kernel)
        for name, (grid, compiled) in seen.items():
            rows.append({"selector": label, "kernel": name, "grid": list(grid),
                         **{k: getattr(compiled, k, None) for k in ("n_regs", "n_spills")},
                         "shared_bytes": getattr(getattr(compiled, "metadata", None), "shared", None),
                         "num_warps": getattr(getattr(compiled, "metadata", None), "num_warps", None)})
            print("regs", rows[-1], flush=True)
    return rows


# -------------------------------------------------------------------------------- batch
BATCH_METHODS = ("dense,sparse,oracle,sparda,sparda-random,infinigen,streaming,h2o,quest,snapkv,shallow,"
           "sparda:offload=true+kv_dtype=int8,sparda:offload=true+kv_dtype=mixed,shallow:offload=true")


def _variant(spec: str) -> tuple[str, dict]:
    """``method[:key=value+key=value]`` -> ``(method, LLM options)``; ``true``/``false`` (any
    case) become booleans and digits integers (``sparda:offload=true+kv_dtype=int8``).

    Raises:
        argparse.ArgumentTypeError: an option without ``=`` or with an empty key or value.
    """
    method, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, (part.strip() for part in rest.split("+"))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not (eq and key and value):
            raise argparse.ArgumentTypeError(f"--methods {spec!r}: write each option as key=value, "
                                             f"joined by '+' (e.g. sparda:offload=true+kv_dtype=int8)")
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdecimal() else value)
    return method.strip(), options


def _csv(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def _methods(text: str) -> list[tuple[str, dict]]:
    """``--methods``: comma-separated :func:`_variant` specs, as ``(spec, method, options)``."""
    return [(spec.strip(), *_variant(spec)) for spec in text.split(",") if spec.strip()]


def _prompts(llm, text_ids: list[int], length: int, batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(batch):
        n = length - int(torch.randint(0, 40, (1,), generator=gen))
        start = int(torch.randint(0, len(text_ids) - n, (1,), generator=gen))
        out.append(text_ids[start:start + n])
    return out


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _kernels(llm, prompts: list[list[int]]) -> int | None:
    """CUDA kernels launched by one prefill of ``prompts`` (their groups, as ``generate``)."""
    from torch.profiler import ProfilerActivity, profile

    if llm.device.type != "cuda":
        return None
    cache = llm.new_cache(len(prompts), max(map(len, prompts)) + 1)
    llm.method.reset()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.inference_mode():
            for group in llm.prefill_groups(cache, prompts):
                llm.prefill_batch(cache, group, [prompts[i] for i in group])
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def _run(llm, prompts, new_tokens: int):
    outs = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=new_tokens, ignore_eos=True)
    _sync()
    return outs


# ------------------------------------------------------------------------------ overlap
def _stats(masks: list[torch.Tensor], q_pos: torch.Tensor, cfg) -> dict:
    """``masks``: per layer ``[1, H, Tq, N]`` bool over query positions ``q_pos [Tq]``."""
    from sparda.kernels.reference import forced_blocks

    keep, union = [], {1: [], 4: [], 16: []}
    for mask in masks:
        m = mask[0]  # [H, Tq, N]
        forced = forced_blocks(q_pos.view(1, -1), m.shape[-1], cfg)[0]  # [1, Tq, N]
        top = m & ~forced
        k = top.sum(-1).float()  # [H, Tq]
        both = (top[:, 1:] & top[:, :-1]).sum(-1).float()
        ok = k[:, 1:] > 0
        keep.append(float((both[ok] / k[:, 1:][ok]).mean()))
        per_token = m.sum(-1).float().mean()
        for t in union:
            n = m.shape[1] // t * t
            tiles = m[:, :n].reshape(m.shape[0], n // t, t, -1).any(2)
            union[t].append(float(tiles.sum(-1).float().mean() / per_token))
    return {"keep": round(sum(keep) / len(keep), 4),
            **{f"union_{t}": round(sum(v) / len(v), 3) for t, v in union.items()}}


# ---------------------------------------------------------------------------------- h2o
H, G, D, BLOCK = 3, 3, 64, 32


def _time(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def twin_mass(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The SDPA-backward path (fp32), summed onto blocks."""
    mass = twins.token_attention_mass_reference(q, k)
    total = k.shape[-2]
    mass = torch.nn.functional.pad(mass, (0, -total % BLOCK))
    return mass.view(*mass.shape[:-1], -1, BLOCK).sum(-1)


def fp64_mass(q: torch.Tensor, k: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """float64 softmax, materialised ``chunk`` queries at a time, summed onto blocks."""
    t, total = q.shape[-2], k.shape[-2]
    kd = k.double()
    keys = torch.arange(total, device=q.device)
    mass = torch.zeros(k.shape[0], H, total, dtype=torch.float64, device=q.device)
    for s in range(0, t, chunk):
        qd = q[..., s:s + chunk, :].double()
        pos = torch.arange(total - t + s, total - t + s + qd.shape[-2], device=q.device)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qd, kd) / D ** 0.5
        logits = logits.masked_fill(keys.view(1, -1) > pos.view(-1, 1), float("-inf"))
        mass += torch.softmax(logits, -1).sum((2, 3))
    mass = torch.nn.functional.pad(mass, (0, -total % BLOCK))
    return mass.view(*mass.shape[:-1], -1, BLOCK).sum(-1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.double() - b).abs() / b.abs().clamp(min=1e-3)).max())


# ---------------------------------------------------------------------------- commands
def cmd_ttft(args) -> int:
    ap = args.parser
    if args.keep is not None and not 0.0 <= args.keep <= 1.0:
        ap.error(f"--keep must lie in [0, 1], got {args.keep}")
    searches = args.topk_search.split(",") if args.topk_search else [None]
    if not set(searches) <= {None, "bisect", "bracket"}:
        ap.error(f"--topk-search takes bisect and/or bracket, got {args.topk_search!r}")  # exit 2
    try:
        stages = [int(x) for x in args.query_stages.split(",")] if args.query_stages else [None]
    except ValueError:
        stages = [0]
    if not all(x is None or 1 <= x <= 4 for x in stages):
        ap.error(f"--query-stages takes integers from 1 to 4, got {args.query_stages!r}")  # exit 2
    unknown = set(args.methods.split(",")) - set(TTFT_METHODS)
    if unknown:
        ap.error(f"unknown --methods {sorted(unknown)}; choose from {', '.join(TTFT_METHODS)}")  # exit 2
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the CPU runtime's prefill is covered by tests/test_chunked_prefill.py)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    lengths = [int(x) for x in args.lengths.split(",")]
    report = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "budget_s": args.budget_s, "chunk_tokens": args.chunk,
              "keep": args.keep, "points": []}

    def save():
        tmp = out_dir / "prefill_gpu.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, out_dir / "prefill_gpu.json")

    try:
        report["kernel_check"] = prefill_selection_check("cuda")
    except Exception as exc:  # fail soft: record and go on
        report["kernel_check"] = {"status": "error", "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
    save()
    parity_s = 0 if args.skip_parity else 120  # kept for the parity run at the end
    for name in args.models.split(","):
        if time.perf_counter() > deadline - parity_s - 30:
            report["points"].append({"model": name, "status": "skipped (time budget)"})
            continue
        try:
            model = build_model(name, "cuda", torch.bfloat16, max_positions=max(lengths) + 256)
            forecast, weights = random_forecast(model), weight_bytes(model)
        except Exception as exc:
            report["points"].append({"model": name, "status": "error", "error": repr(exc)})
            continue
        for length in lengths:
            for label, search, stage in [(lab, s, st) for lab in args.methods.split(",")
                                         for s in ([None] if lab == "dense" else searches)
                                         for st in (stages if lab.startswith("sparse") else [None])]:
                rec = {"model": name, "length": length, "method": label}
                if search is not None:
                    rec["topk_search"] = search
                if stage is not None:
                    rec["query_num_stages"] = stage
                if time.perf_counter() > deadline - parity_s:
                    rec["status"] = "skipped (time budget)"
                else:
                    try:
                        with selection_options(search, stage):
                            rec.update(run_point(model, forecast, weights, label, length, args.chunk,
                                                 deadline - parity_s, keep=args.keep, profile=args.profile))
                        rec["status"] = "ok"
                    except Exception as exc:  # OOM or a bug: record, free, go on
                        rec.update(status="error", error=repr(exc)[:500], trace=traceback.format_exc()[-1500:])
                    torch.cuda.empty_cache()
                report["points"].append(rec)
                print(f"[{time.perf_counter() - t0:5.0f} s]", {k: v for k, v in rec.items() if k not in ("trace", "profile")},
                      flush=True)
                save()
        del model, forecast
        torch.cuda.empty_cache()
    if not args.skip_parity:
        try:
            report["parity"] = parity(deadline, args.chunk)
        except Exception as exc:
            report["parity"] = {"status": "error", "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
        print("parity", {k: v for k, v in report["parity"].items() if k not in ("trace",)}, flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"\n{'model':11} {'len':>7} {'method':19} {'TTFT s':>7} {'tok/s':>9} {'sel ms/L':>9} {'attn ms/L':>9} "
          f"{'peak GiB':>8} {'-weights':>8}")
    for r in report["points"]:
        label = (r.get("method", "") + (f"/{r['topk_search']}" if r.get("topk_search") else "")
                 + (f"/s{r['query_num_stages']}" if r.get("query_num_stages") else ""))
        if r.get("status") != "ok":
            print(f"{r.get('model', ''):11} {r.get('length', ''):>7} {label:19} {r['status']}")
            continue
        print(f"{r['model']:11} {r['length']:>7} {label:19} {r['ttft_s']:>7.2f} {r['prefill_tok_s']:>9.0f} "
              f"{r['select_ms_per_layer'] or 0:>9.2f} {r['attention_ms_per_layer'] or 0:>9.2f} "
              f"{r['peak_gpu_gib']:>8.2f} {r['peak_minus_weights_gib']:>8.2f}")
    return 0


def cmd_attention(args) -> int:
    ap = args.parser
    parts = args.parts.split(",")
    if any(p not in ("check", "timing", "selection", "tune", "chunks", "regs", "topk") for p in parts):
        ap.error(f"--parts: unknown part in {args.parts!r}; choose from check, timing, selection, tune, chunks, "
                 "regs, topk")
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the interpreter tests cover the CPU: tests/kernels/test_prefill_attention.py)")
    old = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_prefill_attention", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
    cfg = SelectionConfig.from_preset("paper")
    report = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__}
    report["check"] = check(cfg) if "check" in parts else []
    report["timing"] = timing(cfg, old) if "timing" in parts else []
    report["selection"] = selection(cfg) if "selection" in parts else []
    report["tune"] = tune(cfg) if "tune" in parts else []
    report["chunks"] = chunks(cfg) if "chunks" in parts else []
    report["regs"] = regs(cfg) if "regs" in parts else []
    report["topk"] = topk(cfg) if "topk" in parts else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_attention_gpu.json").write_text(json.dumps(report, indent=1))
    print(f"{'shape':<11} {'G':>3} {'blk/token':>9} {'blk/tile':>9} {'old blk/tile':>12} {'chunk ms':>9} "
          f"{'old ms':>8} {'layer ms':>9} {'sdpa layer':>10}")
    for r in report["timing"]:
        print(f"{r['shape']:<11} {r['groups']:>3} {r['blocks_per_token']:>9.1f} {r['blocks_per_tile_packed']:>9.1f} "
              f"{r['blocks_per_tile_old']:>12.1f} {r['packed_ms']:>9.2f} {r.get('old_ms', 0):>8.2f} "
              f"{r['packed_layer_ms_est']:>9.1f} {r['sdpa_layer_ms']:>10.1f}")
        for keep in KEEPS:
            if f"keep_{keep}" in r:
                syn = r[f"keep_{keep}"]
                print(f"{'':<11} synthetic masks, top-k keep {keep}: {syn['blocks_per_tile']:.1f} blocks per tile, "
                      f"{syn['ms']:.2f} ms per chunk (random masks: {r['packed_ms']:.2f})")
    for r in report["selection"]:
        print(f"selection {r['selector']:<20} {r['chunk_ms']:>8.2f} ms per chunk = scoring {r['scoring_ms']:.2f} + top-k "
              f"{r['topk_ms']:.2f} (fused select {r['fused_chunk_ms']:.2f}, equal {r['split_equals_fused']}; "
              f"bracket top-k {r['bracket_topk_ms']:.2f}, equal {r['bracket_equals_bisect']}, tie rows "
              f"{r['tie_row_fraction']:.3f}), ~{r['layer_ms_est']:.1f} ms per layer")
    for r in report["chunks"]:
        print(f"chunks {r['selector']:<20} {r['layer_ms']:>8.2f} ms per layer, fused select {r['fused_layer_ms']:.2f}"
              f", bracket top-k {r['bracket_layer_ms']:.2f}"
              f" (16 chunks summed; last chunk x16 "
              f"{r['last_chunk_x16_ms']:.1f}), host {r['host_us_per_call']:.0f} us per call")
    for r in report["topk"]:
        if r["launch"] == "scoring":
            print(f"topk {r['selector']:<20} scoring block_m {r['block_m']:>3} warps {r['num_warps']} stages "
                  f"{r['num_stages']} {'-' if r['scoring_ms'] is None else r['scoring_ms']:>7} ms scoring (chunk "
                  f"{r['chunk_ms']}), equal {r['equal']}")
            continue
        print(f"topk {r['selector']:<20} {r['search']:<8} warps {r['num_warps']} maxnreg {r['maxnreg'] or '-':>4} "
              f"{'-' if r['topk_ms'] is None else r['topk_ms']:>7} ms top-k (chunk {r['chunk_ms']}), equal {r['equal']}")
    for r in report["tune"]:
        name = r.get("shape") or r.get("selector")
        print(f"tune {r['kernel']:<9} {name:<20} block_m {r['block_m']:>3} warps {r['num_warps']} "
              f"{'-' if r['chunk_ms'] is None else r['chunk_ms']:>8} ms per chunk")
    return 0


def cmd_batch(args) -> int:
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: needs CUDA (or --device cpu to try the script)", file=sys.stderr)
        return 2
    rows = []
    text_ids = None
    for spec, method, options in args.methods:
        llm = LLM(args.model, method=method, device=args.device, **options)
        if text_ids is None:
            text_ids = llm.tokenizer.encode(heldout_text(), add_special_tokens=False)
        for length in args.lengths:
            prompts = _prompts(llm, text_ids, length, args.batch, seed=length)
            result = dict(method=spec, length=length, batch=args.batch, offload=bool(llm.config.offload),
                          batched_prefill=llm.method.batched_prefill)
            outs = {}
            for name, budget in (("alone", 0), ("batched", args.batch * (length + 64))):
                llm = llm.derive(prefill_batch_tokens=budget)
                _run(llm, prompts[:2], 2)  # warm-up (kernels, graphs)
                start = time.perf_counter()
                outs[name] = _run(llm, prompts, args.new_tokens)
                result[f"{name}_s"] = time.perf_counter() - start
                result[f"{name}_prefill_ms_per_prompt"] = sum(
                    o.stats["prefill_ms"] / o.stats["prefill_batch"] for o in outs[name]) / len(prompts)
                result[f"{name}_kernels"] = _kernels(llm, prompts)
            same = [a.token_ids == b.token_ids for a, b in zip(outs["alone"], outs["batched"])]
            first = [a.token_ids[0] == b.token_ids[0] for a, b in zip(outs["alone"], outs["batched"])]
            result.update(tokens_agree=sum(same) / len(same), first_token_agrees=sum(first) / len(first))
            rows.append(result)
            print(json.dumps(result), flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    meta = dict(device=device, torch=torch.__version__, command=" ".join(sys.argv))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefill_batch.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    print(f"\n{'method':<34} {'len':>5} {'tok agree':>9} {'1st agree':>9} {'ms/prompt 1x':>12} "
          f"{'ms/prompt B':>11} {'kernels 1x':>10} {'kernels B':>9} {'gen s 1x':>8} {'gen s B':>7}")
    for r in rows:
        print(f"{r['method']:<34} {r['length']:>5} {r['tokens_agree']:>9.2f} {r['first_token_agrees']:>9.2f} "
              f"{r['alone_prefill_ms_per_prompt']:>12.1f} {r['batched_prefill_ms_per_prompt']:>11.1f} "
              f"{str(r['alone_kernels']):>10} {str(r['batched_kernels']):>9} {r['alone_s']:>8.2f} {r['batched_s']:>7.2f}")
    return 0


def cmd_overlap(args) -> int:
    from sparda.attention.forecast import load_forecast, shipped_path
    from sparda.model.loader import load_model, shipped_name

    model, tokenizer, model_dir = load_model(None, torch.device("cpu"), torch.float32)
    forecast = load_forecast(shipped_path(shipped_name(model_dir)), model.config, model.shape)[0]
    ids = tokenizer.encode(heldout_text())[:args.tokens]
    report = {"device": "cpu", "date": datetime.date.today().isoformat(), "commit": git_commit(),
              "command": "python3 benchmarks/bench_prefill.py overlap OUT.json --tokens " + str(args.tokens),
              "model": "SmolLM2-135M-Instruct (bundled)", "text": "emma (held out)", "tokens": len(ids)}
    for method in ("sparda", "sparse", "sparda-random"):
        llm = LLM.from_model(model, tokenizer, method=method, preset="small", dense_len=0, prefill_chunk_tokens=0,
                             forecast=forecast if method == "sparda" else None)
        seen = []
        select = llm.method.select

        def capture(layer, q, h, cache, step, first=0, _select=select):
            mask = _select(layer, q, h, cache, step, first)
            if step.phase == "prefill" and layer > 0:
                seen.append((mask.cpu(), step.q_pos[0, first:].cpu()))
            return mask

        llm.method.select = capture
        cache = llm.new_cache(1, len(ids) + 8)
        with torch.no_grad():
            llm.prefill(cache, 0, ids)
        cfg = llm.config.selection
        start = cfg.budget_blocks * cfg.block_size  # earlier tokens select every valid block
        masks = [m[:, :, int((p < start).sum()):] for m, p in seen]
        pos = seen[0][1][seen[0][1] >= start]
        report[method] = {"layers": len(masks), "topk_blocks": cfg.topk_blocks, **_stats(masks, pos, cfg)}
        print(method, report[method], flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def cmd_h2o(args) -> int:
    if not torch.cuda.is_available():
        print("error: needs CUDA", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    with torch.inference_mode():
        for total, t, dtype in ((2048, 2048, torch.bfloat16), (4096, 4096, torch.bfloat16),
                                (7680, 7680, torch.bfloat16), (7680, 1000, torch.bfloat16),
                                (4096, 4096, torch.float32)):
            q = (torch.randn(1, H, G, t, D, device="cuda", generator=gen) * 1.5).to(dtype)
            k = (torch.randn(1, H, total, D, device="cuda", generator=gen) * 1.5).to(dtype)
            new, old, want = kernels.prefill_block_mass(q, k, BLOCK), twin_mass(q, k), fp64_mass(q, k)
            rows.append(dict(keys=total, queries=t, dtype=str(dtype).split(".")[-1],
                             rel_err_triton=_rel(new, want), rel_err_sdpa=_rel(old, want),
                             sum_triton=float(new.sum()), sum_want=G * H * t,
                             ms_triton=_time(lambda: kernels.prefill_block_mass(q, k, BLOCK)),
                             ms_sdpa_backward=_time(lambda: twin_mass(q, k))))
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=dict(H=H, G=G, d=D, block=BLOCK))
    if args.out:
        Path(args.out).write_text(json.dumps(dict(meta, rows=rows), indent=1))
    print(f"{'keys':>6} {'queries':>7} {'dtype':>8} {'err triton':>10} {'err sdpa':>9} {'triton ms':>9} "
          f"{'SDPA bwd ms':>11} {'speed-up':>8}")
    for r in rows:
        print(f"{r['keys']:>6} {r['queries']:>7} {r['dtype']:>8} {r['rel_err_triton']:>10.2e} {r['rel_err_sdpa']:>9.2e} "
              f"{r['ms_triton']:>9.2f} {r['ms_sdpa_backward']:>11.2f} {r['ms_sdpa_backward'] / r['ms_triton']:>7.1f}x")
    ok = all(r["rel_err_triton"] < 1e-3 for r in rows)
    print("masses agree" if ok else "MASSES DIFFER")
    return 0 if ok else 1


def _doc_parser(sub, name: str, doc: str, short: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=short, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func, parser=p)
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_prefill.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = _doc_parser(sub, "ttft", TTFT_DOC, "whole-model long prefill: TTFT, tok/s, ms per layer, memory (CUDA)",
                    cmd_ttft)
    p.add_argument("out", metavar="OUT", help="output directory (prefill_gpu.json)")
    p.add_argument("--budget-s", type=float, default=420.0, help="time budget of the whole run [420]")
    p.add_argument("--lengths", default="32768,65536,131072", help="prompt lengths [32768,65536,131072]")
    p.add_argument("--models", default="minicpm-8b,llama-8b", help="model shapes [minicpm-8b,llama-8b]")
    p.add_argument("--methods", default=",".join(TTFT_METHODS), help=f"of {','.join(TTFT_METHODS)} [all]")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk tokens of the chunked methods [8192]")
    p.add_argument("--skip-parity", action="store_true", help="leave out the 128K chunked-vs-unchunked parity run")
    p.add_argument("--keep", type=float, default=None,
                   help="block-sparse points attend over synthetic masks whose neighbouring tokens keep this "
                        "fraction of their top-k (the selection kernels still run); default: the kernels' masks")
    p.add_argument("--topk-search", default=None,
                   help="comma-separated top-k searches of the prefill selection kernel (bisect, bracket): "
                        "each block-sparse point runs once per search; default: the kernel's default")
    p.add_argument("--query-stages", default=None,
                   help="comma-separated pipeline depths of the query-based selector's scoring launch: each "
                        "sparse / sparse-offload point runs once per depth; default: the kernel's default")
    p.add_argument("--profile", action="store_true",
                   help="after each warm point, one more prefill under torch.profiler: GPU busy and idle ms, "
                        "synchronising and allocating runtime calls, the kernels with the most time")

    p = _doc_parser(sub, "attention", ATTENTION_DOC, "the prefill attention and selection kernels alone (CUDA)",
                    cmd_attention)
    p.add_argument("out", metavar="OUT", help="output directory (prefill_attention_gpu.json)")
    p.add_argument("--old", default=None, help="path of the previous prefill_attention.py (timed too)")
    p.add_argument("--parts", default="check,timing,selection,tune,chunks",
                   help="comma list of check, timing, selection, tune, chunks, regs, topk "
                        "[check,timing,selection,tune,chunks]")

    p = _doc_parser(sub, "batch", BATCH_DOC, "batched prefill vs one prompt per forward: tokens and time (CUDA)",
                    cmd_batch)
    p.add_argument("--model", default=None, help="GGUF file or model directory [the bundled model]")
    p.add_argument("--lengths", type=_csv(int), default=[2048, 7680], help="prompt lengths [2048,7680]")
    p.add_argument("--methods", type=_methods, default=_methods(BATCH_METHODS),
                   help="comma list of method[:key=value+key=value] [the list above]")
    p.add_argument("--batch", type=int, default=16, help="prompts per length [16]")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt [24]")
    p.add_argument("--out", default=None, help="directory for prefill_batch.json [none: print only]")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the command (no kernel count)")

    p = _doc_parser(sub, "overlap", OVERLAP_DOC, "how much neighbouring tokens share their prefill selection (CPU)",
                    cmd_overlap)
    p.add_argument("out", metavar="OUT.json", help="the JSON file to write")
    p.add_argument("--tokens", type=int, default=4096, help="held-out tokens prefilled [4096]")

    p = _doc_parser(sub, "h2o", H2O_DOC, "h2o's prefill block mass: Triton kernel vs SDPA backward vs fp64 (CUDA)",
                    cmd_h2o)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
