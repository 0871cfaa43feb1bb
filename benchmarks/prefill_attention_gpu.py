"""Block-sparse prefill attention on the GPU (issue #11): the packed-heads kernel in bf16
against its PyTorch twin, and its time at 128K against the previous kernel and flash SDPA.

Usage (one CUDA GPU, from the repository root):

    PYTHONPATH=src python3 benchmarks/prefill_attention_gpu.py OUT [--old PATH]

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
   4 tokens walks ~2.8x one token's blocks), real ones do not (``prefill_overlap.py``: the
   bundled model's ``sparda`` keeps 83 % of a token's top-k for the next token): the same
   kernel also runs on synthetic masks whose neighbouring tokens keep :data:`KEEPS` of their
   top-k (``bench.traces.synthetic_prefill_mask``).

3. ``selection``: the prefill selection kernel alone on the same chunk (last 8,192 tokens of
   128K): query-based with G = 16 and G = 4 and the Forecast (one head), ms per chunk and x16
   per layer, the top-k rule as its own launch (default) and inside the scoring program
   (``select_launch="fused"``), the scoring launch alone (the top-k launch replaced by a
   no-op) and whether the masks of both launch modes are equal; the top-k search
   ``topk_search="bracket"`` against the default bisection (ms, equal masks, and the
   fraction of rows that take its tie pass); to set against the in-model ``select_ms_per_layer`` of ``prefill_gpu.py``
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
python3 benchmarks/prefill_attention_gpu.py OUT --parts selection`` (with ``PYTHONPATH=src``).
Writes ``OUT/prefill_attention_gpu.json`` and prints a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench.timing import cuda_ms  # noqa: E402
from sparda.bench.traces import synthetic_prefill_mask  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import prefill_attention, reference  # noqa: E402
from sparda.kernels.prefill_attention import prefill_attention_triton, tile_block_lists  # noqa: E402
from sparda.kernels.prefill_selection import select_prefill_blocks_triton  # noqa: E402


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
#: is what ``sparda``'s prefill selection keeps on the bundled model (benchmarks/prefill_overlap.py,
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--old", default=None, help="path of the previous prefill_attention.py (timed too)")
    ap.add_argument("--parts", default="check,timing,selection,tune,chunks",
                    help="comma list of check, timing, selection, tune, chunks, regs [default: all but regs]")
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
