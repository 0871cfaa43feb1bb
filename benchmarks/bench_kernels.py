"""Kernel benchmarks and checks: one entry point, one subcommand per measurement (docs/bench.md).

Run from the repository root::

    python3 benchmarks/bench_kernels.py timing --out DIR [--tune] [--skip ...] [--smoke]  # Triton kernels (CUDA)
    python3 benchmarks/bench_kernels.py sass [OUT.json]       # static SASS counts of the top-k launches (no GPU)
    python3 benchmarks/bench_kernels.py kv-quant-error        # KV quantisation error, bundled model (CPU)
    python3 benchmarks/bench_kernels.py smoke --tokenizer DIR --out OUT  # every method end to end (CUDA)

``python3 benchmarks/bench_kernels.py SUBCOMMAND --help`` describes each one. Outputs:
``DIR/kernels.md`` and ``DIR/kernels.json`` (``timing``), ``OUT.json`` (``sass``),
``OUT/smoke.json`` (``smoke``); ``kv-quant-error`` prints only.

The subcommands replace the former scripts ``bench_kernels.py`` (now ``timing``),
``sass_count.py`` (``sass``), ``kv_quant_error.py`` (``kv-quant-error``) and
``smoke_cuda.py`` (``smoke``), with the same measurements and output files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

if "--smoke" in sys.argv:  # timing --smoke: the Triton interpreter, set before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.config import SelectionConfig  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.kernels import quant, reference, twins  # noqa: E402
from sparda.kernels.compress import compress_keys_triton  # noqa: E402
from sparda.kernels.decode_attention import decode_attention_triton  # noqa: E402
from sparda.kernels.prefill_attention import prefill_attention_triton, tile_block_lists  # noqa: E402
from sparda.kernels.selection import (  # noqa: E402
    decode_block_scores_triton, select_decode_blocks_triton, select_from_scores_triton)


TIMING_DOC = """\
Benchmark sparda's Triton kernels on one GPU (issue 5).

    python3 benchmarks/bench_kernels.py timing --out results/ [--tune] [--skip decode,...]
    python3 benchmarks/bench_kernels.py timing --out /tmp/k --smoke   # CPU, Triton interpreter

Per kernel: time per call (median of CUDA-event timings after warm-up, L2 flushed
before each call, CUDA-graph replay for the short decode-time kernels), the bytes it
must move, achieved GB/s against a device-to-device copy ceiling measured in the same
run, and the baselines (dense flash SDPA, the PyTorch reference or a PyTorch gather).
Prints a markdown table last and writes ``kernels.md`` and ``kernels.json`` to --out.
``--smoke`` runs tiny shapes on the CPU through the Triton interpreter (a syntax check).
"""

SASS_DOC = """\
Static instruction counts of the prefill top-k launches, compiled here for sm_90 (no GPU).

Triton compiles a kernel for a named target without a device, and its wheel carries
``ptxas`` and ``cuobjdump``; this script compiles the two top-k launches of
``kernels.prefill_selection`` (``topk_search`` ``bisect`` and ``bracket``) as the Forecast's
last 8K chunk of a 128K prompt uses them (``paper`` preset, ``N_P = 2048``, one row and one
warp per program), disassembles them and prints registers, spills and instructions before,
inside and after each backward-branch loop (the bisection steps). A static count, not a
timing: it tells which variant issues fewer instructions per row, the GPU says what that is
worth. Usage: ``python3 benchmarks/bench_kernels.py sass [OUT.json]``.
"""

KV_QUANT_ERROR_DOC = """\
KV quantisation error on the bundled model's real K/V (and Gaussian data): the numbers
behind the scheme chosen in docs/kv_quant.md. CPU, about a minute.

Compares, at int8 and int4, three ways to choose the scales:

* ``sym``: per token and head, ``step = max|x| / (2**(b-1) - 1)``, signed levels;
* ``asym``: per token and head, ``step = (max - min) / (2**b - 1)``, offset ``min``
  (:mod:`sparda.kernels.quant`, what sparda stores);
* ``chan``: KIVI-style per channel over groups of 64 tokens (one KV block), asymmetric.

Prints the relative Frobenius error of K and V (mean over layers) and of one decode
attention output per layer (the mean of the last 64 keys as the query; V asym).

    python3 benchmarks/bench_kernels.py kv-quant-error
"""

SMOKE_DOC = """\
End-to-end CUDA smoke test of the engine: every method on a random model at the bundled
shape, kernels on the hot path, offloaded vs on-device agreement.

Usage (on a GPU machine): python3 benchmarks/bench_kernels.py smoke --tokenizer DIR --out OUT
"""


# ------------------------------------------------------------------------------- timing
MODELS = {"llama8b": (8, 4, 128), "minicpm": (2, 16, 128)}  # H_kv, G, d
CFG = SelectionConfig.from_preset("paper")
ROWS: list[dict] = []
T0 = time.time()


class Timer:
    """Median per-call time in ms: CUDA events, L2 flushed before each call."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.flush_buf = torch.empty(64 * 2**20, dtype=torch.int32, device=device) if self.cuda else None

    def __call__(self, fn, warmup: int = 3, iters: int = 30, graph: bool = False) -> tuple[float, str]:
        if not self.cuda:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3, "cpu"
        mode = "eager"
        run = fn
        if graph:
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run, mode = g.replay, "graph"
            except Exception as exc:  # noqa: BLE001 - some baselines sync on the host
                torch.cuda.synchronize()
                mode = f"eager ({type(exc).__name__})"
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            self.flush_buf.zero_()
            starts[i].record()
            run()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)), mode


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float("inf") if torch.isnan(out).any() else ((out - ref).norm() / ref.norm()).item()


def add(**row) -> dict:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def copy_ceiling(timer: Timer, device: torch.device, gib: float) -> float:
    """GB/s of a big device-to-device copy, counting bytes read plus bytes written."""
    x = torch.randn(int(gib * 2**30) // 2, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms, _ = timer(lambda: y.copy_(x), warmup=3, iters=20)
    gbs = 2 * x.numel() * 2 / ms / 1e6
    add(kernel="copy", bytes=2 * x.numel() * 2, ms=ms, gbs=gbs)
    del x, y
    return gbs


def random_block_ids(bsz, heads, num_tokens, device, budget):
    """Sinks + local window + random top-k, as the paper preset selects (ascending, -1 padded)."""
    num_blocks = -(-num_tokens // CFG.block_size)
    scores = torch.rand(bsz, heads, 1, num_blocks, device=device)
    q_pos = torch.full((bsz, 1), num_tokens - 1, device=device, dtype=torch.long)
    cfg = dataclasses.replace(CFG, dense_len=0)
    mask = reference.select_blocks(scores, q_pos, cfg)[:, :, 0]
    return reference.block_mask_to_indices(mask, min(budget, num_blocks)).to(torch.int32)


def gather_decode(q, k, v, ids, kv_len, block_size):
    """PyTorch baseline: gather the selected blocks, then fp32 attention."""
    bsz, heads, groups, d = q.shape
    tok = (ids.clamp(min=0).long()[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(2)
    ok = (ids[..., None] >= 0).expand(-1, -1, -1, block_size).flatten(2) & (tok < kv_len.view(-1, 1, 1))
    tok = tok.clamp(max=k.shape[2] - 1)
    ks = k.gather(2, tok[..., None].expand(-1, -1, -1, d)).float()
    vs = v.gather(2, tok[..., None].expand(-1, -1, -1, d)).float()
    logits = torch.einsum("bhgd,bhkd->bhgk", q.float(), ks) / math.sqrt(d)
    probs = logits.masked_fill(~ok[:, :, None], float("-inf")).softmax(-1)
    return torch.einsum("bhgk,bhkd->bhgd", probs, vs).to(q.dtype)


def sdpa_flash(q, k, v, causal):
    """Dense SDPA on the flash backend as a callable; q [B, Hq, Tq, d], k/v [B, Hkv, T, d].

    Uses ``enable_gqa``; if the flash backend refuses it, K/V are expanded to the query
    heads once, outside the timed call (None if that would not fit).
    """
    ctx = contextlib.nullcontext
    if q.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731

    def gqa():
        with ctx():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    try:
        gqa()
        return gqa
    except RuntimeError as exc:
        print("flash SDPA with enable_gqa failed, expanding K/V:", str(exc).splitlines()[0])
    rep = q.shape[1] // k.shape[1]
    if 2 * k.numel() * rep * k.element_size() > 30e9:
        return None
    kx, vx = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)

    def expanded():
        with ctx():
            return F.scaled_dot_product_attention(q, kx, vx, is_causal=causal)
    return expanded


def bench_decode(timer, device, ctxs, batches, ceiling, dtype):
    for name, (heads, groups, d) in MODELS.items():
        for num_tokens in ctxs:
            for bsz in batches:
                kv_bytes = 2 * bsz * heads * num_tokens * d * 2
                if kv_bytes > 40e9:
                    continue
                k = torch.randn(bsz, heads, num_tokens, d, device=device, dtype=dtype)
                v = torch.randn_like(k)
                q = torch.randn(bsz, heads, groups, d, device=device, dtype=dtype)
                kv_len = torch.full((bsz,), num_tokens, device=device, dtype=torch.int32)
                ids = random_block_ids(bsz, heads, num_tokens, device, CFG.budget_blocks)
                tok = (kv_len.view(-1, 1, 1).long() - ids.long() * CFG.block_size).clamp(0, CFG.block_size)
                tokens = int(torch.where(ids >= 0, tok, 0).sum())
                need = tokens * d * 2 * 2 + 2 * q.numel() * 2 + ids.numel() * 4
                out = decode_attention_triton(q, k, v, ids, kv_len, CFG.block_size)
                base = gather_decode(q, k, v, ids, kv_len, CFG.block_size)
                err = rel_err(out, base)
                ms, mode = timer(lambda: decode_attention_triton(q, k, v, ids, kv_len, CFG.block_size), graph=True)
                g_ms, _ = timer(lambda: gather_decode(q, k, v, ids, kv_len, CFG.block_size), iters=10, graph=True)
                sdpa = sdpa_flash(q.reshape(bsz, heads * groups, 1, d), k, v, False)
                s_ms = timer(sdpa, iters=10)[0] if sdpa else float("nan")
                del sdpa
                r_ms = float("nan")
                if bsz * heads * num_tokens * d * 4 * 2 <= 4e9:  # the fp32 reference copies K/V
                    ref = twins.decode_attention_reference(q, k, v, ids, kv_len, CFG.block_size)
                    err = max(err, rel_err(out, ref))
                    r_ms, _ = timer(lambda: twins.decode_attention_reference(q, k, v, ids, kv_len, CFG.block_size),
                                    warmup=1, iters=5)
                gbs = need / ms / 1e6
                add(kernel="decode", model=name, ctx=num_tokens, batch=bsz, ms=ms, mode=mode, bytes=need,
                    gbs=gbs, frac_copy=gbs / ceiling, sdpa_ms=s_ms, gather_ms=g_ms, ref_ms=r_ms, rel_err=err,
                    sdpa_gbs=kv_bytes / s_ms / 1e6)
                del k, v, q, out, base
                torch.cuda.empty_cache() if device.type == "cuda" else None


def tune_decode(timer, device, dtype, num_tokens, bsz):
    heads, groups, d = MODELS["llama8b"]
    k = torch.randn(bsz, heads, num_tokens, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    q = torch.randn(bsz, heads, groups, d, device=device, dtype=dtype)
    kv_len = torch.full((bsz,), num_tokens, device=device, dtype=torch.int32)
    ids = random_block_ids(bsz, heads, num_tokens, device, CFG.budget_blocks)
    need = int((ids >= 0).sum()) * CFG.block_size * d * 4
    variants = [(None, 4, 2), (None, 4, 1), (None, 4, 3), (None, 4, 4), (None, 8, 2), (None, 8, 3),
                (2, 4, 2), (4, 4, 2), (8, 4, 2), (16, 4, 2), (32, 4, 2)]
    for splits, warps, stages in variants:
        ms, _ = timer(lambda: decode_attention_triton(q, k, v, ids, kv_len, CFG.block_size, splits,
                                                      num_warps=warps, num_stages=stages), graph=True)
        add(kernel="decode-tune", ctx=num_tokens, batch=bsz, splits=splits, warps=warps, stages=stages,
            ms=ms, gbs=need / ms / 1e6)


def bench_selection(timer, device, ctxs, batches, dtype):
    for name, (heads, groups, d) in MODELS.items():
        for num_tokens in ctxs:
            for bsz in batches:
                num_ck = reference.num_compressed(num_tokens, CFG.kernel_size, CFG.kernel_stride)
                num_blocks = -(-num_tokens // CFG.block_size)
                ck = torch.randn(bsz, heads, num_ck, d, device=device, dtype=dtype)
                q = torch.randn(bsz, heads, groups, d, device=device, dtype=dtype)
                f = torch.randn(bsz, heads, d, device=device, dtype=dtype)
                q_pos = torch.full((bsz,), num_tokens - 1, device=device, dtype=torch.long)
                width = CFG.budget_blocks
                sel_f = lambda: select_decode_blocks_triton(f, ck, q_pos, num_blocks, CFG, width=width)  # noqa: E731
                sel_q = lambda: select_decode_blocks_triton(q, ck, q_pos, num_blocks, CFG, width=width)  # noqa: E731
                f_ms, _ = timer(sel_f, graph=True)
                q_ms, _ = timer(sel_q, graph=True)
                fs_ms, _ = timer(lambda: decode_block_scores_triton(f, ck, q_pos, num_blocks, CFG), graph=True)
                qs_ms, _ = timer(lambda: decode_block_scores_triton(q, ck, q_pos, num_blocks, CFG), graph=True)
                scores = decode_block_scores_triton(q, ck, q_pos, num_blocks, CFG)
                pos2 = q_pos.view(-1, 1)
                rule_ms, _ = timer(lambda: select_from_scores_triton(scores, q_pos, CFG, width), graph=True)
                torch_rule = lambda: reference.block_mask_to_indices(  # noqa: E731
                    reference.select_blocks(scores[:, :, None], pos2, CFG)[:, :, 0], width)
                trule_ms, _ = timer(torch_rule, graph=True)
                mism, ref_ms = float("nan"), float("nan")
                if bsz * heads * num_ck * num_blocks * 4 <= 5e9:
                    for query, sel in ((f, sel_f), (q, sel_q)):
                        ref_ids = twins.select_decode_reference(query, ck, q_pos, num_blocks, CFG, width=width)
                        bad = (sel() != ref_ids).any(-1).float().mean().item()
                        mism = bad if math.isnan(mism) else max(mism, bad)
                    ref_ms, _ = timer(lambda: twins.select_decode_reference(q, ck, q_pos, num_blocks, CFG,
                                                                            width=width), warmup=1, iters=5)
                ck_bytes = ck.numel() * 2
                add(kernel="selection", model=name, ctx=num_tokens, batch=bsz, forecast_ms=f_ms, query_ms=q_ms,
                    speedup=q_ms / f_ms, target=0.6 * groups, forecast_scores_ms=fs_ms, query_scores_ms=qs_ms,
                    rule_triton_ms=rule_ms, rule_torch_ms=trule_ms, ref_query_ms=ref_ms,
                    ck_bytes=ck_bytes, forecast_gbs=ck_bytes / fs_ms / 1e6, query_gbs=ck_bytes / qs_ms / 1e6,
                    mismatch_rows=mism)
                del ck, q, f


def bench_compress(timer, device, dtype, num_tokens, ceiling):
    heads, _, d = MODELS["llama8b"]
    for bsz in (1, 8):
        k = torch.randn(bsz, heads, num_tokens, d, device=device, dtype=dtype)
        ck = compress_keys_triton(k, CFG.kernel_size, CFG.kernel_stride)
        err = rel_err(ck, reference.compress_keys(k, CFG.kernel_size, CFG.kernel_stride))
        ms, _ = timer(lambda: compress_keys_triton(k, CFG.kernel_size, CFG.kernel_stride))
        r_ms, _ = timer(lambda: reference.compress_keys(k, CFG.kernel_size, CFG.kernel_stride), iters=5)
        need = k.numel() * 2 + ck.numel() * 2
        add(kernel="compress", model="llama8b", ctx=num_tokens, batch=bsz, ms=ms, ref_ms=r_ms, bytes=need,
            gbs=need / ms / 1e6, frac_copy=need / ms / 1e6 / ceiling, rel_err=err)
        del k, ck


def prefill_mask(bsz, heads, num_tokens, device):
    """Selection per 64-query tile (the rule at the tile's last position), expanded to rows."""
    bs = CFG.block_size
    num_blocks = -(-num_tokens // bs)
    tiles = num_blocks
    last = torch.clamp(torch.arange(tiles, device=device) * bs + bs - 1, max=num_tokens - 1)
    scores = torch.rand(bsz, heads, tiles, num_blocks, device=device)
    cfg = dataclasses.replace(CFG, dense_len=0)
    tile_mask = reference.select_blocks(scores, last.expand(bsz, -1), cfg)  # [B, H, tiles, N]
    return tile_mask.repeat_interleave(bs, dim=2)[:, :, :num_tokens]


def bench_prefill(timer, device, dtype, num_tokens, check_rows, tune):
    for name, (heads, groups, d) in MODELS.items():
        bsz = 1
        q = torch.randn(bsz, heads, groups, num_tokens, d, device=device, dtype=dtype)
        k = torch.randn(bsz, heads, num_tokens, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q_pos = torch.arange(num_tokens, device=device).view(1, -1)
        kv_len = torch.full((bsz,), num_tokens, device=device, dtype=torch.int32)
        mask = prefill_mask(bsz, heads, num_tokens, device)
        # correctness on the last rows against the reference
        sl = slice(num_tokens - check_rows, num_tokens)
        part = prefill_attention_triton(q[:, :, :, sl].contiguous(), k, v, mask[:, :, sl].contiguous(),
                                        q_pos[:, sl].contiguous(), kv_len, CFG.block_size)
        ref = reference.block_sparse_attention(q[:, :, :, sl], k, v, mask[:, :, sl], q_pos[:, sl], kv_len,
                                               CFG.block_size, chunk=64)
        err = rel_err(part, ref)
        ms, _ = timer(lambda: prefill_attention_triton(q, k, v, mask, q_pos, kv_len, CFG.block_size),
                      warmup=1, iters=3)
        for block_m, warps, stages in ((64, 8, 3), (64, 4, 2), (128, 8, 3), (128, 8, 2)) if tune else ():
            t_ms, _ = timer(lambda: prefill_attention_triton(q, k, v, mask, q_pos, kv_len, CFG.block_size, block_m,
                                                             num_warps=warps, num_stages=stages), warmup=1, iters=3)
            add(kernel="prefill-tune", model=name, block_m=block_m, warps=warps, stages=stages, ms=t_ms)
        lists_ms, _ = timer(lambda: tile_block_lists(mask, q_pos, kv_len, heads, num_tokens, CFG.block_size, 64),
                            warmup=1, iters=3)
        dense_ms, _ = timer(lambda: prefill_attention_triton(q, k, v, None, q_pos, kv_len, CFG.block_size),
                            warmup=1, iters=3)
        sdpa = sdpa_flash(q.reshape(bsz, heads * groups, num_tokens, d), k, v, True)
        s_ms = timer(sdpa, warmup=1, iters=3)[0] if sdpa else float("nan")
        del sdpa
        pos = q_pos[0]
        pairs = int(((mask.sum(-1) - 1) * CFG.block_size + (pos % CFG.block_size + 1)).sum()) * groups
        dense_pairs = num_tokens * (num_tokens + 1) // 2 * heads * groups
        add(kernel="prefill", model=name, ctx=num_tokens, batch=bsz, ms=ms, tile_lists_ms=lists_ms,
            triton_dense_ms=dense_ms, sdpa_ms=s_ms, speedup_vs_sdpa=s_ms / ms, rel_err=err,
            sparse_tflops=4 * pairs * d / ms / 1e9, sdpa_tflops=4 * dense_pairs * d / s_ms / 1e9)
        del q, k, v, mask


def check_kernels(device) -> None:
    """Awkward shapes on the device against the reference run on the CPU: ragged lengths,
    G = 1/3/4/16, fp32/fp16/bf16, and rows that see no key.

    ``reference.block_sparse_attention`` requires every query to see a key; on the CPU
    its SDPA returns 0 for a row that sees none (as the kernels do), while on CUDA
    (torch 2.11) it returns finite non-zero values (seen 2026-11-29), so the reference
    runs on the CPU here.
    """
    cpu = torch.device("cpu")

    def on_cpu(*ts):
        return [t.to(cpu) if isinstance(t, torch.Tensor) else t for t in ts]
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    def ids_for(bsz, heads, num_blocks, width):
        scores = torch.rand(bsz, heads, num_blocks, generator=gen)
        top = scores.topk(min(width, num_blocks), -1).indices
        top[..., -2:] = -1  # padding, and unsorted ids
        return top.to(device=device, dtype=torch.int32)

    errs = {}
    for dtype, groups in ((torch.float32, 1), (torch.float32, 16), (torch.float16, 3), (torch.bfloat16, 4),
                          (torch.bfloat16, 16)):
        bsz, heads, d, bs, num_tokens = 3, 2, 64, 64, 1000
        q, k, v = (rnd(bsz, heads, groups, d, dtype=dtype), rnd(bsz, heads, num_tokens, d, dtype=dtype),
                   rnd(bsz, heads, num_tokens, d, dtype=dtype))
        kv_len = torch.tensor([1000, 333, 1], device=device)
        ids = ids_for(bsz, heads, 16, 12)
        ref = twins.decode_attention_reference(*on_cpu(q, k, v, ids, kv_len), bs).float().to(device)
        for splits in (1, None):
            out = decode_attention_triton(q, k, v, ids, kv_len, bs, splits)
            errs[f"decode {dtype} G{groups} s{splits}"] = rel_err(out, ref)
        # the same blocks through a slot buffer
        slots = 12
        slot_ids = torch.stack([torch.randperm(slots, generator=gen) for _ in range(bsz * heads)])
        slot_ids = slot_ids.view(bsz, heads, slots).to(device)
        kp = F.pad(k, (0, 0, 0, 16 * bs - num_tokens)).view(bsz, heads, 16, bs, d)
        vp = F.pad(v, (0, 0, 0, 16 * bs - num_tokens)).view(bsz, heads, 16, bs, d)
        k_slots, v_slots = rnd(bsz, heads, slots, bs, d, dtype=dtype), rnd(bsz, heads, slots, bs, d, dtype=dtype)
        idx = ids.long().clamp(min=0)[..., None, None].expand(-1, -1, -1, bs, d)
        k_slots.scatter_(2, slot_ids.long()[..., None, None].expand(-1, -1, -1, bs, d), kp.gather(2, idx))
        v_slots.scatter_(2, slot_ids.long()[..., None, None].expand(-1, -1, -1, bs, d), vp.gather(2, idx))
        from sparda.kernels.decode_attention import decode_attention_slots_triton
        out = decode_attention_slots_triton(q, k_slots, v_slots, ids, slot_ids, kv_len)
        errs[f"slots {dtype} G{groups}"] = rel_err(out, ref)
        # prefill, ragged chunk positions
        num_q = 300
        qp = rnd(2, heads, groups, num_q, d, dtype=dtype)
        kv2 = torch.tensor([1000, 650], device=device)
        pos = torch.stack([torch.arange(700, 1000), torch.arange(350, 650)]).to(device)
        mask = (torch.rand(2, heads, num_q, 16, generator=gen) < 0.4).to(device)
        pref = reference.block_sparse_attention(*on_cpu(qp, k[:2], v[:2], mask, pos, kv2), bs).float().to(device)
        errs[f"prefill {dtype} G{groups}"] = rel_err(
            prefill_attention_triton(qp, k[:2], v[:2], mask, pos, kv2, bs), pref)
        errs[f"prefill dense {dtype} G{groups}"] = rel_err(
            prefill_attention_triton(qp, k[:2], v[:2], None, pos, kv2, bs),
            reference.block_sparse_attention(*on_cpu(qp, k[:2], v[:2], None, pos, kv2), bs).float().to(device))
    mism = 0
    for query_shape in ((3, 2, 64), (3, 2, 3, 64), (3, 2, 16, 64)):
        query, ck = rnd(*query_shape, dtype=torch.bfloat16), rnd(3, 2, 500, 64, dtype=torch.bfloat16)
        q_pos = torch.tensor([8000, 4001, 20], device=device)
        ck_len = torch.tensor([499, 250, 0], device=device)
        for cl in (None, ck_len):
            got = select_decode_blocks_triton(query, ck, q_pos, 126, CFG, ck_len=cl)
            want = twins.select_decode_reference(*on_cpu(query, ck, q_pos), 126, CFG,
                                                ck_len=None if cl is None else cl.cpu()).to(device)
            mism += int((got != want).any(-1).sum())
            errs[f"scores {query_shape} ck_len={cl is not None}"] = rel_err(
                decode_block_scores_triton(query, ck, q_pos, 126, CFG, cl).nan_to_num(0, 0, 0),
                twins.decode_block_scores_reference(*on_cpu(query, ck, q_pos), 126, CFG,
                                                   None if cl is None else cl.cpu()).nan_to_num(0, 0, 0).to(device))
    k = rnd(2, 3, 777, 64, dtype=torch.bfloat16)
    errs["compress"] = rel_err(compress_keys_triton(k, 32, 16),
                               reference.compress_keys(k.cpu(), 32, 16).float().to(device))
    worst = {"fp32": 0.0, "half": 0.0}
    for key, err in errs.items():
        worst["fp32" if "float32" in key or "scores" in key else "half"] = max(
            worst["fp32" if "float32" in key or "scores" in key else "half"], err)
    add(kernel="check", worst_rel_err_fp32=worst["fp32"], worst_rel_err_half=worst["half"],
        selection_rows_mismatched=mism, errors=errs)


def fmt(x, digits=3):
    if isinstance(x, float):
        return "—" if math.isnan(x) else f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:.0f}"
    return str(x)


def markdown() -> str:
    lines = []
    for r in ROWS:
        if r["kernel"] == "check":
            lines.append(f"GPU checks vs reference: worst rel err fp32 {r['worst_rel_err_fp32']:.1e}, "
                         f"fp16/bf16 {r['worst_rel_err_half']:.1e}; selection rows differing "
                         f"{r['selection_rows_mismatched']}\n")
    ceiling = next((r["gbs"] for r in ROWS if r["kernel"] == "copy"), float("nan"))
    lines.append(f"Copy ceiling (device-to-device, read+write): {fmt(ceiling)} GB/s\n")
    lines.append("| decode | ctx | B | Triton ms | GB/s | % copy | torch gather ms | SDPA flash ms "
                 "| reference ms | rel err |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        if r["kernel"] == "decode":
            lines.append(f"| {r['model']} | {r['ctx'] // 1024}K | {r['batch']} | {fmt(r['ms'])} | {fmt(r['gbs'])} "
                         f"| {100 * r['frac_copy']:.0f}% | {fmt(r['gather_ms'])} | {fmt(r['sdpa_ms'])} "
                         f"| {fmt(r['ref_ms'])} | {r['rel_err']:.1e} |")
    lines.append("\n| selection | ctx | B | Forecast ms | query ms | query/Forecast | target 0.6·G "
                 "| Forecast scores GB/s | rule Triton / torch ms | reference ms | id mismatch |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in ROWS:
        if r["kernel"] == "selection":
            lines.append(f"| {r['model']} | {r['ctx'] // 1024}K | {r['batch']} | {fmt(r['forecast_ms'])} "
                         f"| {fmt(r['query_ms'])} | {r['speedup']:.2f}x | {r['target']:.1f}x "
                         f"| {fmt(r['forecast_gbs'])} | {fmt(r['rule_triton_ms'])} / {fmt(r['rule_torch_ms'])} "
                         f"| {fmt(r['ref_query_ms'])} | {fmt(r['mismatch_rows'])} |")
    lines.append("\n| compress / prefill | ctx | B | Triton ms | baseline ms | notes |")
    lines.append("|---|---|---|---|---|---|")
    for r in ROWS:
        if r["kernel"] == "compress":
            lines.append(f"| compress_keys {r['model']} | {r['ctx'] // 1024}K | {r['batch']} | {fmt(r['ms'])} "
                         f"| ref {fmt(r['ref_ms'])} | {fmt(r['gbs'])} GB/s ({100 * r['frac_copy']:.0f}% copy); "
                         f"rel err {r['rel_err']:.1e} |")
        if r["kernel"] == "prefill":
            lines.append(f"| sparse prefill {r['model']} | {r['ctx'] // 1024}K | {r['batch']} | {fmt(r['ms'])} "
                         f"| SDPA flash {fmt(r['sdpa_ms'])} | {r['speedup_vs_sdpa']:.1f}x faster than SDPA; "
                         f"tile lists {fmt(r['tile_lists_ms'])} ms; Triton dense {fmt(r['triton_dense_ms'])} ms; "
                         f"{fmt(r['sparse_tflops'])} vs {fmt(r['sdpa_tflops'])} TFLOP/s; rel err {r['rel_err']:.1e} |")
    ptune = [r for r in ROWS if r["kernel"] == "prefill-tune"]
    if ptune:
        lines.append("\n| prefill tuning | block_m | warps | stages | ms |")
        lines.append("|---|---|---|---|---|")
        for r in ptune:
            lines.append(f"| {r['model']} | {r['block_m']} | {r['warps']} | {r['stages']} | {fmt(r['ms'])} |")
    tune = [r for r in ROWS if r["kernel"] == "decode-tune"]
    if tune:
        lines.append("\n| decode tuning (llama8b) | ctx | B | splits | warps | stages | ms | GB/s |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in tune:
            lines.append(f"| | {r['ctx'] // 1024}K | {r['batch']} | {r['splits'] or 'auto'} | {r['warps']} "
                         f"| {r['stages']} | {fmt(r['ms'])} | {fmt(r['gbs'])} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- sass
INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")
BACK = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA (?:!?U?P\w+, )?0x([0-9a-f]+)")


def compile_sass(fn, consts: dict, num_warps: int = 1) -> tuple[str, str]:
    """``(sass, resource usage)`` of ``fn`` for sm_90 with the launch's int arguments as i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sig = {"SCR": "*fp32", "MASK": "*u8", "QPOS": "*i64"}
    for name in ("stride_pb", "stride_sb", "stride_sh", "stride_st", "stride_mb", "stride_mh", "stride_mt",
                 "H", "Tq", "N"):
        sig[name] = "i32"
    sig.update({k: "constexpr" for k in consts})
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": num_warps})
    cubin = Path("/tmp") / f"sparda-{fn.__name__}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    run = lambda *a: subprocess.run([str(bin_dir / "cuobjdump"), *a, str(cubin)], capture_output=True, text=True,
                                    check=True).stdout
    return run("-sass"), run("-res-usage")


def regions(sass: str) -> dict:
    """Instruction counts before, inside and after the first backward-branch loop."""
    ins = [(int(a, 16), op) for a, op in INSTR.findall(sass)]
    loops = [(int(t, 16), int(a, 16)) for a, t in BACK.findall(sass) if int(t, 16) < int(a, 16)]
    out = {"instructions": len(ins), "by_op": dict(Counter(op for _, op in ins).most_common(8))}
    if loops:
        start, end = loops[0]
        out.update(before_loop=sum(a < start for a, _ in ins), loop=sum(start <= a <= end for a, _ in ins),
                   after_loop=sum(a > end for a, _ in ins))
    return out


# ------------------------------------------------------------------------ kv-quant-error
def sym(x: torch.Tensor, bits: int) -> torch.Tensor:
    qmax = 2 ** (bits - 1) - 1
    s = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / qmax
    return (x / s).round().clamp(-qmax, qmax) * s


def asym(x: torch.Tensor, bits: int) -> torch.Tensor:
    kv = "int8" if bits == 8 else "int4"
    return quant.QuantizedKV.quantize(x, kv).dequantize(x.dtype)


def chan(x: torch.Tensor, bits: int, group: int = 64) -> torch.Tensor:
    b, h, t, d = x.shape
    t2 = t // group * group
    g = x[:, :, :t2].reshape(b, h, t2 // group, group, d).transpose(-1, -2)
    return torch.cat([asym(g, bits).transpose(-1, -2).reshape(b, h, t2, d), x[:, :, t2:]], 2)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def attention(q, k, v):
    p = (torch.einsum("bhgd,bhtd->bhgt", q, k) / math.sqrt(k.shape[-1])).softmax(-1)
    return torch.einsum("bhgt,bhtd->bhgd", p, v)


# -------------------------------------------------------------------------------- smoke
def build(tmp: Path, tokenizer_dir: str) -> tuple[Path, Path]:
    """A random model at the bundled shape saved with ``tokenizer_dir``'s tokenizer, and a
    Forecast initialised from its query weights (``q_init``): ``(model dir, forecast file)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from sparda.attention.forecast import Forecast, model_identity, q_init, save_forecast

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp / "model"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    llm = LLM(path, method="dense", device="cpu")
    forecast = Forecast.for_shape(llm.shape)
    q_init(forecast, llm.model)
    fpath = tmp / "forecast.safetensors"
    save_forecast(forecast, fpath, model_identity(llm.model.config, llm.shape))
    return path, fpath


# ---------------------------------------------------------------------------- commands
def cmd_timing(args) -> int:
    skip = set(filter(None, args.skip.split(",")))
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    timer = Timer(device)
    if args.smoke:
        from sparda.kernels._common import patch_interpreter_for_numpy
        patch_interpreter_for_numpy()
        global CFG
        CFG = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=3,
                              topk_blocks=4, dense_len=0)
        for key in list(MODELS):
            h, g, _ = MODELS[key]
            MODELS[key] = (h, g, 16)
        ctxs, batches, long_ctx, pre_ctx, ceiling = [200], [1, 2], 200, 128, float("nan")
    else:
        ctxs, batches, long_ctx, pre_ctx = [8192, 32768, 131072], [1, 8, 64], 131072, 131072
        ceiling = copy_ceiling(timer, device, 4.0)
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)",
                torch=torch.__version__, date=datetime.date.today().isoformat(), argv=sys.argv)
    print(json.dumps(info))
    if "check" not in skip:
        check_kernels(device)
        print(f"[{time.time() - T0:.0f}s] checks done", flush=True)
    if "decode" not in skip:
        bench_decode(timer, device, ctxs, batches, ceiling, dtype)
        print(f"[{time.time() - T0:.0f}s] decode done", flush=True)
    if args.tune:
        tune_decode(timer, device, dtype, long_ctx, 8 if not args.smoke else 2)
        print(f"[{time.time() - T0:.0f}s] tune done", flush=True)
    if "selection" not in skip:
        bench_selection(timer, device, ctxs, batches, dtype)
        print(f"[{time.time() - T0:.0f}s] selection done", flush=True)
    if "compress" not in skip:
        bench_compress(timer, device, dtype, long_ctx, ceiling)
    if "prefill" not in skip:
        bench_prefill(timer, device, dtype, pre_ctx, 256 if not args.smoke else 32, args.tune)
        print(f"[{time.time() - T0:.0f}s] prefill done", flush=True)
    table = markdown()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = f"device: {info['device']}; torch {info['torch']}; {info['date']}; {time.time() - T0:.0f} s\n\n"
    (out / "kernels.md").write_text(header + table + "\n")
    (out / "kernels.json").write_text(json.dumps(dict(info=info, rows=ROWS), indent=1))
    print("\n" + header + table)
    return 0


def cmd_sass(args) -> int:
    import triton

    import sparda.kernels.prefill_selection as ps

    cfg = SelectionConfig.from_preset("paper")
    common = dict(BS=cfg.block_size, INIT=cfg.init_blocks, LOCAL=cfg.local_blocks, TOPK=cfg.topk_blocks,
                  BUDGET=cfg.budget_blocks, DENSE_LEN=cfg.dense_len, N_P=2048)
    report = {"target": "sm_90", "triton": triton.__version__, "n_p": 2048, "topk_blocks": cfg.topk_blocks}
    for name, fn, extra in (("bisect", ps._prefill_topk_kernel, {"RS": 1}),
                            ("bracket", ps._prefill_topk_bracket_kernel, {})):
        sass, res = compile_sass(fn, {**common, **extra})
        regs = re.search(r"REG:(\d+)", res)
        report[name] = {"registers": int(regs.group(1)) if regs else None,
                        "spill_stores": sass.count("STL"), **regions(sass)}
        print(name, {k: v for k, v in report[name].items() if k != "by_op"}, flush=True)
    b, r = report["bisect"], report["bracket"]
    if "loop" in b:
        per_row = b["before_loop"] + 32 * b["loop"] + b["after_loop"]
        print(f"bisect: {per_row} instructions per row (32 steps of {b['loop']})")
    if "loop" in r:
        print(f"bracket, no tie at the k-th key: the tie pass is skipped; {r['before_loop']} before the search, "
              f"{r['loop']} per step, {r['after_loop']} after it (the tie pass included, run on tie rows only)")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def cmd_kv_quant_error(args) -> int:
    from sparda.data import heldout_text

    schemes = {"sym": sym, "asym": asym, "chan": chan}
    torch.manual_seed(0)
    x = torch.randn(1, 4, 2048, 64, dtype=torch.float64)
    for bits in (8, 4):
        print(f"gaussian int{bits}:", {n: round(rel(f(x, bits), x), 4) for n, f in schemes.items()})
    llm = LLM(method="dense", device="cpu")
    ids = llm.tokenizer.encode(heldout_text()[20000:60000])[:2048]
    cache = llm.new_cache(1, len(ids))
    llm.prefill(cache, 0, ids)
    for bits in (8, 4):
        for name, store in (("K", cache.k), ("V", cache.v)):
            errs = {n: sum(rel(f(t.double(), bits), t.double()) for t in store) / len(store)
                    for n, f in schemes.items()}
            print(f"bundled {name} int{bits}:", {n: round(e, 4) for n, e in errs.items()})
        for name, f in schemes.items():
            errs = []
            for k, v in zip(cache.k, cache.v):
                k, v = k.double(), v.double()
                q = k[:, :, -64:].mean(2, keepdim=True)
                errs.append(rel(attention(q, f(k, bits), asym(v, bits)), attention(q, k, v)))
            print(f"bundled attention output int{bits}, K {name}:", round(sum(errs) / len(errs), 4))
    return 0


def cmd_smoke(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path, fpath = build(Path("/tmp/sparda_smoke"), args.tokenizer)
    ids = [torch.randint(0, 49152, (n,)).tolist() for n in (args.prompt_tokens, args.prompt_tokens // 2 + 77)]
    runs = [("dense", {}), ("sparse", {}), ("sparse", {"dense_prefill": True}), ("sparse-offload", {}),
            ("sparda", {"forecast": str(fpath), "offload": False}), ("sparda", {"forecast": str(fpath), "offload": True}),
            ("sparda-no-prefetch", {"forecast": str(fpath)}), ("infinigen", {})]
    rows, tokens = [], {}
    for dtype in ("float32", "bfloat16"):
        for method, extra in runs:
            name = method + ("+offload" if extra.get("offload") else "") + ("+dense-prefill" if extra.get("dense_prefill") else "")
            try:
                llm = LLM(path, method=method, device=args.device, dtype=dtype, **extra)
                llm.generate([None], prompt_token_ids=[ids[1]], max_new_tokens=4, ignore_eos=True)  # warm-up
                if args.device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                res = llm.generate([None, None], prompt_token_ids=ids, max_new_tokens=args.new_tokens, ignore_eos=True)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
                tokens[(dtype, name)] = [r.token_ids for r in res]
                rows.append(dict(dtype=dtype, method=name, status="ok", wall_s=round(wall, 3),
                                 prefill_ms=res[0].stats["prefill_ms"], decode_tok_s=res[0].stats["decode_tok_s"],
                                 read_fraction=res[0].stats["kv_read_fraction"],
                                 offload=res[0].stats.get("offload")))
            except Exception as exc:  # report and continue
                rows.append(dict(dtype=dtype, method=name, status=f"error: {type(exc).__name__}: {exc}"[:300]))
            print(json.dumps(rows[-1]), flush=True)
    pairs = [("sparse", "sparse-offload"), ("sparda", "sparda+offload"), ("sparda", "sparda-no-prefetch")]
    agree = {}
    for dtype in ("float32", "bfloat16"):
        for a, b in pairs:
            ta, tb = tokens.get((dtype, a)), tokens.get((dtype, b))
            if ta and tb:
                same = sum(x == y for ra, rb in zip(ta, tb) for x, y in zip(ra, rb))
                agree[f"{dtype} {a} vs {b}"] = f"{same}/{sum(len(r) for r in ta)} tokens equal"
    (out / "smoke.json").write_text(json.dumps({"rows": rows, "agreement": agree}, indent=1))
    print("\n| dtype | method | status | prefill ms | decode tok/s | read frac |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['method']} | {r['status'][:60]} | {r.get('prefill_ms', '')} | "
              f"{r.get('decode_tok_s', '')} | {r.get('read_fraction', '')} |")
    for k, v in agree.items():
        print(f"{k}: {v}")
    return 0


def _doc_parser(sub, name: str, doc: str, short: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=short, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_kernels.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = _doc_parser(sub, "timing", TIMING_DOC, "time, GB/s and error of each Triton kernel vs baselines (CUDA)",
                    cmd_timing)
    p.add_argument("--out", required=True, help="directory for kernels.md and kernels.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    p.add_argument("--tune", action="store_true", help="also sweep decode launch parameters")
    p.add_argument("--skip", default="", help="comma list of: check,decode,selection,compress,prefill")

    p = _doc_parser(sub, "sass", SASS_DOC, "static SASS instruction counts of the prefill top-k launches (no GPU)",
                    cmd_sass)
    p.add_argument("out", metavar="OUT.json", nargs="?", default=None, help="also write the counts here")

    p = _doc_parser(sub, "kv-quant-error", KV_QUANT_ERROR_DOC,
                    "KV quantisation error of three scale schemes on real K/V (CPU)", cmd_kv_quant_error)

    p = _doc_parser(sub, "smoke", SMOKE_DOC, "every method end to end on a random bundled-shape model (CUDA)",
                    cmd_smoke)
    p.add_argument("--tokenizer", required=True, help="a tokenizer directory (the bundled model's)")
    p.add_argument("--out", required=True, help="output directory (smoke.json)")
    p.add_argument("--prompt-tokens", type=int, default=6000, help="the longer prompt's tokens [6000]")
    p.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt [48]")
    p.add_argument("--device", default="cuda", help="[cuda]")
    return ap


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
