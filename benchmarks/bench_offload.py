"""Offload benchmarks: one entry point, one subcommand per measurement (docs/offload.md, design §6).

Run from the repository root::

    python3 benchmarks/bench_offload.py runtime [--quick] [--parts ...]  # copy, parity, pipeline (CUDA)
    python3 benchmarks/bench_offload.py pinned [--out FILE.json]         # the pinned host pool (CUDA)
    python3 benchmarks/bench_offload.py spare-slots [--trace NPZ]        # slot-buffer hit rates (CPU)

``python3 benchmarks/bench_offload.py SUBCOMMAND --help`` describes each one. ``runtime``
and ``spare-slots`` print markdown / text tables; ``pinned`` prints a table and writes
``FILE.json`` with ``--out``.

The subcommands replace the former scripts ``bench_offload.py`` (now ``runtime``),
``pinned_pool_gpu.py`` (``pinned``) and ``spare_slots_sim.py`` (``spare-slots``), with the
same measurements and outputs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.attention.forecast import Forecast  # noqa: E402
from sparda.bench.harness import NoText  # noqa: E402
from sparda.bench.timing import cuda_ms  # noqa: E402
from sparda.bench.traces import SHIPPED_TRACE, load_traces  # noqa: E402
from sparda.cache import host, pinned  # noqa: E402
from sparda.cache.host import HostKVStore  # noqa: E402
from sparda.cache.transfer import CopyEngine, UvaEngine  # noqa: E402
from sparda.config import ALWAYS_OFFLOADED, SelectionConfig  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.kernels import twins  # noqa: E402
from sparda.model.llama import CausalLM  # noqa: E402

RUNTIME_DOC = """\
Offload runtime benchmark (design §6): copy bandwidth, parity, hit rate, hidden copy time.

Run on a CUDA machine from the repository root::

    python3 benchmarks/bench_offload.py runtime [--quick] [--parts copy,parity,small,8b] [--methods ...]

Parts (each prints one table):

1. ``copy``: the uva gather kernel (CTA x warp sweep) and the ``copy`` engine on 512
   random 16 KiB blocks (K and V: 1,024 blocks, 16 MiB) from pinned host memory; GB/s.
2. ``parity``: random model at the bundled shape (SmolLM2-135M: 30 layers, 9 Q / 3 KV
   heads, d 64), bf16: offloaded vs on-device logits in lockstep (same fed tokens);
   uva vs copy engine must be bit-identical.
3. ``pipeline``: decode tok/s, hit rate, bytes per token, copy time and the fraction of
   it hidden behind compute for ``sparse`` (device KV), ``sparse-offload``,
   ``sparda-no-prefetch`` and ``sparda`` (prefetch), at the bundled shape and at an
   8B shape (32 layers, 32 Q / 8 KV heads, d 128, hidden 4096; random weights, the cache
   filled with random K/V). Also checks that a decode step makes no host sync.
"""

PINNED_DOC = """\
Page-locked host store of an offloaded KV cache on the GPU machine: registering new memory
(first call) against taking a freed cache's memory back from the pool (sparda.cache.pinned).

    python3 benchmarks/bench_offload.py pinned [--out FILE.json]

For each shape, builds the offloaded cache's host store (``HostKVStore``, pinned) three times,
freeing it in between: call 1 registers, calls 2 and 3 reuse. Checks that the reused planes are
page-locked and zero and that a non-blocking copy to the GPU and back returns what was written.
Then end to end: offloaded ``sparda`` on the bundled model's shape (random weights, random
Forecast), ``generate`` on 16 random prompts of 7,680 tokens three times; ``cache_alloc_ms``
of each call, and the generated tokens must be the same every time (a reused buffer that
was not zeroed, or still written by the last call, would change them). Exits 1 if a check
fails. ``--device cpu --e2e-only`` tries the end-to-end part on the CPU (tiny shape, no pinning).
"""

SPARE_SLOTS_DOC = """\
Block hit rate of the offloaded cache's slot buffer against its size, on a recorded trace (CPU).

Usage (from the repository root):

    python3 benchmarks/bench_offload.py spare-slots [--trace src/sparda/bench/traces/smollm2-emma.npz]

Replays each (row, layer, KV head) of every method's recorded decode selection through the
slot diff the offloaded cache runs (``kernels.twins.slot_diff_reference``: empty slots first,
then stale slots in slot order) with ``S = ceil(f * W)`` slots for the trace's own selection
width ``W`` (its budget), ``f`` = 1, 1.25, 1.5, 2, and prints the
hit rate (selected blocks already in a slot, the current block excluded; after 3 warm-up
steps), with the hit rate of a least-recently-used rule beside it for comparison.

``f`` here is a multiple of the budget, not the runtime's ``slot_factor`` (design §6), whose
``W`` includes the dense-fallback prefix: at the ``small`` preset (dense_len 2048, blocks of
64) ``W`` is 32, so ``slot_factor`` 1 and 1.5 give 32 and 48 slots for this budget of 21.
"""


# ------------------------------------------------------------------------------ runtime
DEV = torch.device("cuda")
ONLY: set[str] = set()  # --methods filter


def random_model(layers, hq, hkv, d, hidden, inter, vocab=4096, ctx=131072) -> CausalLM:
    """A random Llama-shaped CausalLM in bf16 on the GPU."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, vocab_size=vocab,
                      max_position_embeddings=ctx, rms_norm_eps=1e-5, tie_word_embeddings=False)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(DEV):
        model = CausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.rotary.inv_freq.data = model.rotary.inv_freq.float()
    return model.eval()


def make_llm(model, method, sel, offload=None, transfer="uva", forecast=None, resident=(0,)) -> LLM:
    """An :class:`LLM` around an in-memory model (no tokenizer): ``sel``'s budget, the whole
    prompt in one prefill chunk; an offloaded cache copies with ``transfer`` and times its
    copies (the pipeline table's copy and exposed-wait columns)."""
    fields = {f: getattr(sel, f) for f in ("block_size", "kernel_size", "kernel_stride", "init_blocks",
                                           "local_blocks", "topk_blocks", "dense_len")}
    offloaded = bool(offload) or method in ALWAYS_OFFLOADED
    llm = LLM.from_model(model, method=method, forecast=forecast, offload=offload,
                         transfer=transfer if offloaded else None, offload_timing=offloaded,
                         prefill_chunk_tokens=0, **fields)
    if hasattr(llm.method, "resident_layers"):
        llm.method.resident_layers = resident
    return llm


# ------------------------------------------------------------------ 1. copy
def bench_copy() -> None:
    heads, blocks, bs, d = 8, 2048, 64, 128  # 8B shape, 128K tokens: 16 KiB blocks
    host = HostKVStore([0], 1, heads, d, blocks, bs, torch.bfloat16, pin=True)
    chunk = host.chunks[0][0]
    chunk.k.normal_()
    chunk.v.normal_()
    slots = 64  # 8 heads x 64 slots = 512 random blocks (of K, and as many of V)
    load = torch.stack([torch.randperm(blocks)[:slots] for _ in range(heads)]).view(1, heads, slots).to(DEV)
    dk = torch.zeros(1, heads, slots + 1, bs, d, dtype=torch.bfloat16, device=DEV)
    dv = torch.zeros_like(dk)
    nbytes = 2 * heads * slots * bs * d * 2
    print(f"\n## copy: {2 * heads * slots} random {bs * d * 2 // 1024} KiB blocks ({nbytes / 2**20:.0f} MiB) "
          "pinned host -> GPU")
    print("| engine | CTAs | warps | ms | GB/s |\n|---|---|---|---|---|")
    ref_k = chunk.k[torch.arange(heads).view(-1, 1), load[0].cpu()]  # one row: page = block
    for ctas in (8, 16, 32, 64, 132):
        for warps in (4, 8):
            eng = UvaEngine(num_ctas=ctas, num_warps=warps)
            ms = cuda_ms(lambda: eng.gather(chunk, dk, dv, load))
            print(f"| uva | {ctas} | {warps} | {ms:.3f} | {nbytes / ms / 1e6:.1f} |")
    assert torch.equal(dk[0, :, :slots].cpu(), ref_k), "uva gather copied wrong data"
    eng = CopyEngine()
    ms = cuda_ms(lambda: eng.gather(chunk, dk, dv, load), reps=5)
    print(f"| copy (CPU gather + 1 memcpy) | - | - | {ms:.3f} | {nbytes / ms / 1e6:.1f} |")
    flat = chunk.k.view(-1, bs, d)
    idx = load[0].cpu() + torch.arange(heads).view(-1, 1) * blocks

    def per_block():
        for i, j in enumerate(idx.flatten().tolist()[:128]):
            dk.view(-1, bs, d)[i].copy_(flat[j], non_blocking=True)

    ms = cuda_ms(per_block, reps=3)
    print(f"| one copy_ per block (128 blocks) | - | - | {ms:.3f} | {128 * bs * d * 2 / ms / 1e6:.2f} |")
    del host


# ---------------------------------------------------------------- 2. parity
def lockstep(a: LLM, b: LLM, prompts, steps):
    """Feed a's greedy tokens to both; returns (max rel err, median rel err, top-1 agreement)."""
    caches = []
    cap = max(len(p) for p in prompts) + steps + 1
    for llm in (a, b):
        llm.method.reset()
        cache = llm.new_cache(len(prompts), cap)
        first = torch.stack([llm.prefill(cache, r, ids)[-1] for r, ids in enumerate(prompts)])
        caches.append(cache)
    tokens = first.argmax(-1)
    pos = torch.tensor([len(p) for p in prompts], device=DEV)
    errs, agree = [], []
    for _ in range(steps):
        la = a.decode(caches[0], tokens, pos)
        lb = b.decode(caches[1], tokens, pos)
        errs.append(((la - lb).float().norm() / la.float().norm()).item())
        agree.append((la.argmax(-1) == lb.argmax(-1)).float().mean().item())
        tokens, pos = la.argmax(-1), pos + 1
    return max(errs), statistics.median(errs), sum(agree) / len(agree), caches


def bench_parity(model, forecast, sel, quick, dtype=torch.bfloat16) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in ((2500, 3100) if quick else (2500, 3100, 4000))]
    steps = 32 if quick else 64
    print(f"\n## parity ({dtype}, bundled shape, random weights, prompts {[len(p) for p in prompts]}, {steps} steps)")
    print("| reference | offloaded | max rel err | median rel err | top-1 agree |\n|---|---|---|---|---|")
    pairs = [
        (make_llm(model, "sparse", sel), make_llm(model, "sparse-offload", sel, resident=())),
        (make_llm(model, "sparda", sel, forecast=forecast), make_llm(model, "sparda", sel, offload=True,
                                                                  forecast=forecast, resident=())),
        (make_llm(model, "sparda", sel, offload=True, forecast=forecast, transfer="copy", resident=()),
         make_llm(model, "sparda", sel, offload=True, forecast=forecast, transfer="uva", resident=())),
    ]
    names = [("sparse (device)", "sparse-offload uva"), ("sparda (device)", "sparda offload uva"),
             ("sparda offload copy", "sparda offload uva")]
    for (a, b), (na, nb) in zip(pairs, names):
        try:
            worst, med, agree, _ = lockstep(a, b, prompts, steps)
        except Exception as exc:  # report and go on
            print(f"| {na} | {nb} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} |")
            continue
        print(f"| {na} | {nb} | {worst:.2e} | {med:.2e} | {agree:.3f} |")


# -------------------------------------------------------------- 3. pipeline
def fill_random(cache, lengths, shape) -> None:
    """Prefill-append random K/V rows into ``cache`` (no model run)."""
    from sparda.model.llama import StepInfo

    for row, t in enumerate(lengths):
        q_pos = torch.arange(t, device=DEV).view(1, -1)
        step = StepInfo("prefill", torch.tensor([row], device=DEV), q_pos, q_pos[:, -1] + 1, None, None)
        for layer in range(shape.num_layers):
            k = torch.randn(1, shape.num_kv_heads, t, shape.head_dim, device=DEV, dtype=torch.bfloat16)
            cache.append(layer, k, torch.randn_like(k), step)
    cache.lengths[: len(lengths)] = torch.tensor(lengths, device=DEV)


def decode_run(llm: LLM, lengths, steps, prompts=None, check_sync=False):
    cap = max(lengths) + steps + 8
    llm.method.reset()
    cache = llm.new_cache(len(lengths), cap)
    if prompts is None:
        fill_random(cache, lengths, llm.shape)
    else:
        for r, ids in enumerate(prompts):
            llm.prefill(cache, r, ids)
    tokens = torch.randint(0, 4096, (len(lengths),), device=DEV)
    pos = torch.tensor(lengths, device=DEV)
    for _ in range(3):  # warm-up (compiles kernels, fills slots)
        tokens = llm.decode(cache, tokens, pos).argmax(-1)
        pos = pos + 1
    sync_note = ""
    if check_sync:
        import warnings

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                tokens = llm.decode(cache, tokens, pos).argmax(-1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message).splitlines()[0][:60] for w in caught if "synchroniz" in str(w.message)]
        sync_note = "none" if not syncs else f"{len(syncs)}: {syncs[0]}"
        pos = pos + 1
    if cache.prefetcher is not None:
        cache.prefetcher.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        tokens = llm.decode(cache, tokens, pos).argmax(-1)
        pos = pos + 1
    torch.cuda.synchronize()
    sec = time.perf_counter() - start
    stats = cache.offload_stats(steps * len(lengths)) if cache.offload else {}
    del cache
    torch.cuda.empty_cache()
    return len(lengths) * steps / sec, sec / steps * 1e3, stats, sync_note


def bench_pipeline(title, model, forecast, sel, lengths, steps, prompts=None) -> None:
    print(f"\n## pipeline: {title}, batch {len(lengths)}, context {lengths}, {steps} decode steps")
    print("| method | KV | tok/s | ms/step | hit rate | MiB copied/token | copy ms/step | exposed ms/step "
          "| hidden | host sync in step |\n|---|---|---|---|---|---|---|---|---|---|")
    runs = [("sparse", "device", make_llm(model, "sparse", sel)),
            ("sparda", "device", make_llm(model, "sparda", sel, forecast=forecast)),
            ("sparse-offload", "host, uva", make_llm(model, "sparse-offload", sel)),
            ("sparda-no-prefetch", "host, uva", make_llm(model, "sparda-no-prefetch", sel, forecast=forecast)),
            ("sparda", "host, uva, prefetch", make_llm(model, "sparda", sel, offload=True, forecast=forecast))]
    for name, kv, llm in runs:
        if ONLY and f"{name}/{kv.split(',')[0]}" not in ONLY and name not in ONLY:
            continue
        try:
            tps, ms, st, sync = decode_run(llm, lengths, steps, prompts, check_sync=True)
        except Exception as exc:  # report and continue with the next method
            print(f"| {name} | {kv} | failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} |")
            continue
        if st:
            print(f"| {name} | {kv} | {tps:.1f} | {ms:.2f} | {st['hit_rate']:.3f} | "
                  f"{st['bytes_per_token'] / 2**20:.2f} | {st['copy_ms'] / steps:.2f} | "
                  f"{st['exposed_wait_ms'] / steps:.2f} | {st['hidden_fraction']:.2f} | {sync} |")
        else:
            print(f"| {name} | {kv} | {tps:.1f} | {ms:.2f} | - | - | - | - | - | {sync} |")


# ------------------------------------------------------------------------------- pinned
SHAPES = {  # name: layers, batch, H_kv, d, tokens
    "SmolLM2-135M, 16 x 7,680 tokens": (30, 16, 3, 64, 7680),
    "Llama-3.1-8B, 1 x 131,072 tokens": (32, 1, 8, 128, 131072),
    "Llama-3.1-8B, 4 x 32,768 tokens": (32, 4, 8, 128, 32768),
}


def planes(store):
    return [p for chunks in store.chunks.values() for c in chunks for q in c.planes() for p in (q.k, q.v)]


def end_to_end(device: str, model_name: str, batch: int, tokens: int) -> tuple[list[dict], bool]:
    from sparda.bench.models import build_model, random_forecast
    from sparda.engine.llm import LLM

    model = build_model(model_name, device, torch.bfloat16 if device == "cuda" else torch.float32)
    llm = LLM.from_model(model, NoText(), method="sparda", forecast=random_forecast(model),
                         offload=device == "cuda", sparse_prefill=False)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=gen).tolist()
    rows, first = [], None
    for call in range(3):
        hits0 = pinned.POOL.hits
        out = llm.generate("", prompt_token_ids=prompts, max_new_tokens=16, ignore_eos=True)
        ids = [c.token_ids for c in out]
        first = first or ids
        rows.append({"shape": f"{model_name} sparda offload, {batch} x {tokens:,}", "call": call + 1,
                     "cache_alloc_ms": out[0].stats["cache_alloc_ms"], "prefill_ms": out[0].stats["prefill_ms"],
                     "reused": pinned.POOL.hits - hits0, "tokens_same_as_call_1": ids == first})
        del out
        gc.collect()
    return rows, all(r["tokens_same_as_call_1"] for r in rows)


# -------------------------------------------------------------------------- spare-slots
WARM = 3


def slot_rule_hit_rate(trace, slots: int) -> float:
    """Hit rate of the cache's own slot diff (all rows, layers, heads at once) with ``slots`` slots."""
    ids = torch.from_numpy(trace.ids.astype("int64"))  # [S, R, L, H, K]
    steps, rows, layers, heads, width = ids.shape
    bs = trace.meta["block_size"]
    pos = torch.from_numpy(trace.pos)  # [S, R]
    flat = lambda x: x.reshape(rows * layers, heads, -1)  # noqa: E731  (rows x layers as batch rows)
    slot_map = torch.full((rows * layers, heads, slots), -1, dtype=torch.long)
    load = torch.empty_like(slot_map)
    attn = torch.empty(rows * layers, heads, slots + 1, dtype=torch.int32)
    num_blocks = int(ids.max()) + 2
    hits = total = 0
    for s in range(steps):
        p = pos[s].repeat_interleave(layers)  # [R * L]
        counters = tuple(torch.zeros(rows * layers, dtype=torch.long) for _ in range(4))
        twins.slot_diff_reference(flat(ids[s]), slot_map, p, bs, num_blocks, load, attn, counters)
        if s >= WARM:
            hits += int(counters[0].sum())
            total += int(counters[0].sum() + counters[1].sum())
    return hits / max(total, 1)


def lru_hit_rate(trace, slots: int) -> float:
    """Hit rate of a least-recently-used slot buffer of ``slots`` blocks (for comparison)."""
    steps, rows, layers, heads, _ = trace.ids.shape
    bs = trace.meta["block_size"]
    hits = total = 0
    for r in range(rows):
        for layer in range(layers):
            for h in range(heads):
                last: dict[int, int] = {}
                for s in range(steps):
                    cur = int(trace.pos[s, r]) // bs
                    sel = [int(x) for x in trace.ids[s, r, layer, h] if x >= 0 and x != cur]
                    if s >= WARM:
                        hits += sum(x in last for x in sel)
                        total += len(sel)
                    for x in sel:
                        last[x] = s
                    for x, _ in sorted(last.items(), key=lambda kv: kv[1])[:max(0, len(last) - slots)]:
                        del last[x]
    return hits / max(total, 1)


# ---------------------------------------------------------------------------- commands
def cmd_runtime(args) -> int:
    parts = args.parts.split(",")
    if args.methods:
        ONLY.update(args.methods.split(","))
    print(f"# bench_offload on {torch.cuda.get_device_name()} | torch {torch.__version__}")
    torch.manual_seed(0)
    if "copy" in parts:
        try:
            bench_copy()
        except Exception as exc:
            print(f"copy part failed: {type(exc).__name__}: {exc}")
    small = SelectionConfig.from_preset("small")
    if "parity" in parts or "parity32" in parts or "small" in parts:
        model = random_model(30, 9, 3, 64, 576, 1536)
        forecast = Forecast.for_shape(model.shape)
        with torch.inference_mode():
            if "parity" in parts:
                bench_parity(model, forecast, small, args.quick)
            if "parity32" in parts:  # fp32: separates selection/slot bugs from bf16 rounding
                model32 = model.float()
                bench_parity(model32, forecast.float(), small, True, torch.float32)
                model = model32.to(torch.bfloat16)
                forecast = forecast.to(torch.bfloat16)
            if "small" in parts:
                g = torch.Generator().manual_seed(1)
                lengths = [7000] * 8
                prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in lengths]
                bench_pipeline("bundled shape (random weights, real prefill)", model, forecast, small,
                               lengths, 32 if args.quick else 64, prompts)
        del model
        torch.cuda.empty_cache()
    if "8b" in parts:
        model = random_model(32, 32, 8, 128, 4096, 14336)
        forecast = Forecast.for_shape(model.shape)
        paper = SelectionConfig.from_preset("paper")
        ctx = 16384 if args.quick else 32768
        with torch.inference_mode():
            bench_pipeline("8B shape (random weights, random K/V)", model, forecast, paper,
                           [ctx] * 4, 16 if args.quick else 32)
    return 0


def cmd_pinned(args) -> int:
    rows, ok = [], True
    for name, (layers, batch, heads, d, tokens) in ({} if args.e2e_only else SHAPES).items():
        block = 64
        kw = dict(layers=range(layers), batch=batch, num_kv_heads=heads, head_dim=d,
                  num_blocks=tokens // block, block_size=block, dtype=torch.bfloat16, pin=True)
        times = []
        for call in range(3):
            hits0 = pinned.POOL.hits
            t0 = time.perf_counter()
            store = host.HostKVStore(**kw)
            times.append(time.perf_counter() - t0)
            ps = planes(store)
            reused = pinned.POOL.hits - hits0
            check = all(p.is_pinned() for p in ps[:4]) and all(not p[0].any() and not p[-1].any() for p in ps)
            src = torch.randn(ps[0].numel() // 2, device="cuda").to(torch.bfloat16)
            flat = ps[0].view(-1)[: src.numel()]
            flat.copy_(src, non_blocking=True)
            back = torch.empty_like(src)
            back.copy_(flat, non_blocking=True)
            torch.cuda.synchronize()
            check = check and torch.equal(back, src)
            ok &= check
            rows.append({"shape": name, "call": call + 1, "gib": store.nbytes / 2**30, "seconds": times[-1],
                         "planes": len(ps), "reused": reused, "checks_pass": bool(check)})
            del store, ps, flat, src, back
            gc.collect()
        pinned.POOL.release()
    e2e, same = end_to_end(args.device, *(("bundled", 16, 7680) if args.device == "cuda" else ("tiny", 2, 600)))
    ok &= same
    print(f"{'shape':36} {'GiB':>6} {'call':>4} {'s':>7} {'planes reused':>13} ok")
    for r in rows:
        print(f"{r['shape']:36} {r['gib']:6.2f} {r['call']:4d} {r['seconds']:7.3f} {r['reused']:6d}/{r['planes']:<6d} {r['checks_pass']}")
    print(f"\n{'end to end':44} {'call':>4} {'cache_alloc_ms':>14} {'prefill_ms':>10} {'reused':>6} same tokens")
    for r in e2e:
        print(f"{r['shape']:44} {r['call']:4d} {r['cache_alloc_ms']:14.1f} {r['prefill_ms']:10.1f} {r['reused']:6d} "
              f"{r['tokens_same_as_call_1']}")
    rows += e2e
    if args.out:
        device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
        Path(args.out).write_text(json.dumps({"device": device, "torch": torch.__version__,
                                              "rows": rows}, indent=1))
    return 0 if ok else 1


def cmd_spare_slots(args) -> int:
    print(f"{'method':<10} {'W':>3} {'factor':>6} {'S':>4} {'hit (slot diff)':>16} {'hit (LRU)':>10}")
    for method, trace in load_traces(args.trace).items():
        m = trace.meta
        width = m["init_blocks"] + m["topk_blocks"] + m["local_blocks"]
        for factor in (1.0, 1.25, 1.5, 2.0):
            slots = math.ceil(factor * width - 1e-9)
            print(f"{method:<10} {width:>3} {factor:>6} {slots:>4} {slot_rule_hit_rate(trace, slots):>16.4f} "
                  f"{lru_hit_rate(trace, slots):>10.4f}")
    return 0


def _doc_parser(sub, name: str, doc: str, short: str, func) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=short, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(func=func)
    return p


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_offload.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")

    p = _doc_parser(sub, "runtime", RUNTIME_DOC, "copy bandwidth, offload parity, decode pipeline tables (CUDA)",
                    cmd_runtime)
    p.add_argument("--quick", action="store_true", help="fewer steps and a smaller 8B context")
    p.add_argument("--parts", default="copy,parity,small,8b",
                   help="comma list of copy, parity, parity32, small, 8b [copy,parity,small,8b]")
    p.add_argument("--methods", default=None, help="comma list: only these pipeline rows")
    p.set_defaults(needs_cuda=True)

    p = _doc_parser(sub, "pinned", PINNED_DOC, "pinned host store: first registration vs pool reuse, end to end",
                    cmd_pinned)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    p.add_argument("--device", default="cuda", help="cuda; cpu only with --e2e-only (tiny shape, no pinning)")
    p.add_argument("--e2e-only", action="store_true", help="only the end-to-end part")

    p = _doc_parser(sub, "spare-slots", SPARE_SLOTS_DOC, "slot-buffer hit rate vs its size on a recorded trace (CPU)",
                    cmd_spare_slots)
    p.add_argument("--trace", default=str(SHIPPED_TRACE), help="the trace file [the shipped trace]")
    return ap


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if getattr(args, "needs_cuda", False) and not torch.cuda.is_available():
        ap.error(f"{args.command} needs a CUDA GPU")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
