"""Offload runtime benchmark (design §6): copy bandwidth, parity, hit rate, hidden copy time.

Run on a CUDA machine from the repository root::

    PYTHONPATH=src python benchmarks/bench_offload.py [--quick]

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

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sparda.attention.forecast import Forecast
from sparda.attention.registry import build_method
from sparda.bench.timing import cuda_ms
from sparda.cache.host import HostKVStore
from sparda.cache.transfer import CopyEngine, UvaEngine
from sparda.config import SelectionConfig, SpardaConfig
from sparda.engine.llm import LLM
from sparda.model.llama import CausalLM

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
    """An :class:`LLM` around an in-memory model (no tokenizer)."""
    llm = LLM.__new__(LLM)
    llm.config = SpardaConfig(method=method, selection=sel, offload=offload)
    llm.device, llm.dtype, llm.model, llm.shape = DEV, next(model.parameters()).dtype, model, model.shape
    llm.transfer, llm.tokenizer, llm.model_dir = transfer, None, None
    kwargs = dict(model=model, model_dir=None)
    if method.startswith("sparda"):
        kwargs["forecast"] = forecast
    llm.method = build_method(llm.config, llm.shape, **kwargs)
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
    ref_k = chunk.k[0, torch.arange(heads).view(-1, 1), load[0].cpu()]
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
    if hasattr(cache, "lengths"):
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
    if hasattr(cache, "prefetcher"):
        cache.prefetcher.reset()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        tokens = llm.decode(cache, tokens, pos).argmax(-1)
        pos = pos + 1
    torch.cuda.synchronize()
    sec = time.perf_counter() - start
    stats = cache.offload_stats(steps * len(lengths)) if hasattr(cache, "offload_stats") else {}
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and a smaller 8B context")
    parser.add_argument("--parts", default="copy,parity,small,8b",
                        help="comma list of copy, parity, parity32, small, 8b")
    parser.add_argument("--methods", default=None, help="comma list: only these pipeline rows")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
