"""GPU check of ``--kv-dtype mixed``'s hot-pool bookkeeping in the slot diff and the fused append
(design §6.1), against :class:`OldBookkeeping`, the PyTorch bookkeeping it replaced.

1. ``kernels``: the slot diff with the hot pool (Triton on CUDA) against its twin on the same
   CUDA tensors, random hot states at the shape of a 128K context (``N`` 2048 blocks: the hot
   pass spans two tiles), a small one and one of fewer blocks than a CTA's threads (a
   replicated layout), a fetch and an early diff, every operand the first ``b`` rows of a
   larger buffer (a batch bucket, design §3.13): every output identical, the rows past ``b``
   untouched. The kernel has no ``tl.dot``; bf16 reaches it only through the append, checked in 2.
2. ``parity``: offloaded ``sparda`` in bf16 at the model's shape, eager steps from one filled
   context, ``mixed`` through the new kernels and through :class:`OldBookkeeping`: the same
   logits, hot states, slot maps, slots, int4 store and hot pool after every step.
3. ``speed``: per ``bf16``, ``int8``, ``mixed`` and ``mixed-old`` (:class:`OldBookkeeping`), the
   replayed CUDA-graph step: kernels per step and per layer (``torch.profiler``) and the time
   per step.

Prints one line per check (with ``--out DIR`` also ``DIR/check_mixed.json``: the verdict, the
options and the speed records) and exits non-zero on a difference. Random weights
(``sparda.bench.models``); sized to take under two minutes on an H100 / H200 at the defaults.

    python3 benchmarks/check_mixed.py                                # CUDA, MiniCPM-8B shape
    python3 benchmarks/check_mixed.py --out /tmp/mixed               # ... and /tmp/mixed/check_mixed.json
    python3 benchmarks/check_mixed.py --device cpu --model tiny --context 600 --steps 3   # smoke run (twins)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda import kernels  # noqa: E402
from sparda.bench import point as pt  # noqa: E402
from sparda.bench.models import build_model, check_models_fit, random_forecast, selection_config  # noqa: E402
from sparda.cache.hot import NEVER  # noqa: E402
from sparda.cache.mixed import MixedOffloadKVCache  # noqa: E402
from sparda.kernels import twins  # noqa: E402


class OldBookkeeping(MixedOffloadKVCache):
    """``mixed`` with the bookkeeping the fused kernels replaced: before a plain slot diff the hot
    rule in PyTorch (:meth:`~sparda.cache.hot.HotBlocks.update`) and the demoted blocks' slots
    emptied, after it the split (:meth:`~sparda.cache.hot.HotBlocks.split`) and the pool-miss
    count, and the token written to the pool and the int4 store after the append
    (:meth:`_store_tokens`); a step of the first ``b`` rows touches only those (design §3.13).
    The reference of tests/test_kv_mixed_fused.py."""

    _early_pos = None

    def _fused_host(self, layer):
        return None

    def _hot_operands(self, layer, load, update):
        return None

    def fetch(self, layer, selection, pos, prefetch=False, counters=None):
        if layer not in self.resident:
            ids = self._diff_ids(selection, "fetch")
            demoted = self.hot.update(layer, ids, pos)
            held = self.slot_map[layer][:ids.shape[0]]
            held.masked_fill_(torch.gather(demoted, -1, held.clamp(min=0)) & (held >= 0), -1)
        super().fetch(layer, selection, pos, prefetch, counters)

    def warm(self, layer, selection, pos):
        self._early_pos = pos
        try:
            super().warm(layer, selection, pos)
        finally:
            self._early_pos = None

    def _copy_misses(self, layer, load, prefetch, early=False, hot=None):
        from_pool, cold = self.hot.split(layer, load, self._early_pos if early else None)
        self.prefetcher.pool_misses[:load.shape[0]].add_((from_pool >= 0).sum((1, 2)))
        super()._copy_misses(layer, load, prefetch, early, SimpleNamespace(pool_load=from_pool, cold_load=cold))


# ------------------------------------------------------------------ 1. kernels
def _random_diff(gen, dev, b, h, s, w, n, bs, pool, steps):
    """Selections (the current block and up to ``w - 1`` others), block maps of distinct
    blocks, hot states mostly in the pool's window: what a fetch meets."""
    pos = torch.randint(pool * bs, n * bs, (b,), generator=gen).to(dev)
    cur = (pos // bs).view(-1, 1, 1)
    blocks = torch.arange(n, device=dev).view(1, 1, -1)
    score = torch.rand(b, h, n, generator=gen).to(dev).masked_fill(blocks >= cur, -1.0)
    top = score.topk(w - 1, -1)
    ids = torch.where(top.values >= 0, top.indices, n)
    ids = torch.cat([ids, cur.expand(b, h, 1)], -1).sort(-1).values
    ids = torch.where(ids >= n, -1, ids).to(torch.int32).contiguous()
    held = torch.rand(b, h, n, generator=gen).to(dev).masked_fill(blocks >= cur, -1.0).topk(s, -1)
    slot_map = torch.where((held.values >= 0) & (torch.rand(b, h, s, generator=gen).to(dev) < 0.9), held.indices, -1)
    recent = (blocks > cur - pool - 2) & (blocks <= cur)
    hot = recent & (torch.rand(b, h, n, generator=gen).to(dev) < 0.6)
    ago = torch.randint(0, 2 * steps + 2, (b, h, n), generator=gen).to(dev)
    last = torch.where(torch.rand(b, h, n, generator=gen).to(dev) < 0.8, pos.view(-1, 1, 1) - ago, NEVER)
    return ids, slot_map.contiguous(), pos, hot, last


#: rows past the bucket in the kernel check's buffers
EXTRA_ROWS = 2


def _bucket_rows(x: torch.Tensor, extra: int = EXTRA_ROWS) -> torch.Tensor:
    """A buffer of ``b + extra`` rows whose first ``b`` are ``x [b, ...]`` and whose others hold
    a filler (7, ``True``): a decode step of a batch bucket passes its first ``b`` rows (design §3.13)."""
    buf = torch.full((x.shape[0] + extra, *x.shape[1:]), 7, dtype=x.dtype, device=x.device)
    buf[:x.shape[0]] = x
    return buf


def check_kernels(dev, seed: int = 0) -> bool:
    """The hot slot diff (:func:`sparda.kernels.slot_diff`, Triton on CUDA) against its twin; every
    per-row operand is the first ``b`` rows of a buffer of ``b +`` :data:`EXTRA_ROWS` (a batch
    bucket, design §3.13), whose rows past ``b`` must come back untouched."""
    gen = torch.Generator().manual_seed(seed)
    ok = True
    # paper at 128K (the hot pass spans two tiles); small; N below the threads of a CTA (a replicated layout)
    shapes = ((4, 2, 192, 128, 2048, 64, 96, 4, 33), (3, 8, 48, 32, 300, 64, 21, 2, 4),
              (2, 4, 12, 8, 40, 16, 6, 2, 2))
    for b, h, s, w, n, bs, pool, steps, local in shapes:
        for early in (False, True):
            ids, slot_map, pos, hot, last = _random_diff(gen, dev, b, h, s, w, n, bs, pool, steps)
            protect = None
            if early:
                protect = torch.where(torch.rand(b, h, s + 1, generator=gen).to(dev) < 0.5, 1, -1).to(torch.int32)
            outs, untouched = [], True
            for fn in (kernels.slot_diff, twins.slot_diff_reference):
                rows = _bucket_rows
                blank = torch.full_like(slot_map, -5)
                bufs = [rows(slot_map), rows(blank), rows(torch.full((b, h, s + 1), -5, dtype=torch.int32, device=dev))]
                bufs += [rows(torch.zeros(b, dtype=torch.long, device=dev)) for _ in range(4)]
                if not early:
                    bufs += [rows(torch.full((b, h, w + 1), -5, dtype=torch.int32, device=dev)) for _ in range(2)]
                bufs += [rows(hot), rows(last), rows(blank), rows(blank), rows(torch.zeros(b, dtype=torch.long, device=dev))]
                views, tails = [t[:b] for t in bufs], [t[b:].clone() for t in bufs]
                sm, load, attn, counters, compact = views[0], views[1], views[2], tuple(views[3:7]), None
                if not early:
                    compact = tuple(views[7:9])
                state = twins.HotSplit(*views[-5:], pool, steps, local, not early)
                fn(ids, sm, pos, bs, n, load, attn, counters, compact, None if protect is None else rows(protect)[:b],
                   state)
                outs.append(views)
                untouched &= all(torch.equal(t[b:], tail) for t, tail in zip(bufs, tails))
            same = all(torch.equal(x, y) for x, y in zip(*outs)) and untouched
            ok &= same
            demoted = int((slot_map != outs[0][0]).sum())
            print(f"kernels  slot_diff hot {'early' if early else 'fetch'} B{b} H{h} S{s} W{w} N{n} P{pool}: "
                  f"identical={same} pool loads={int(outs[0][-1].sum())} slots changed={demoted} "
                  f"rows past b untouched={untouched}")
    return ok


# ------------------------------------------------------------------ 2. parity, 3. speed
def _llm(model, sel, forecast, kv, cuda_graphs, old):
    kv_dtype = "mixed" if kv.startswith("mixed") else kv
    llm = pt.make_llm(model, "sparda", sel, forecast, kv_dtype=kv_dtype, cuda_graphs=cuda_graphs)
    if old:  # every cache this LLM makes keeps the old bookkeeping
        make = llm.new_cache

        def new_cache(*args, **kwargs):
            cache = make(*args, **kwargs)
            cache.__class__ = OldBookkeeping
            return cache

        llm.new_cache = new_cache
    return llm


def _filled(llm, batch: int, context: int, steps: int):
    cache = llm.new_cache(batch, context + steps + 2)
    pt.fill_cache(cache, llm.shape, batch, context, llm.device, llm.dtype)
    return cache


def _state(cache) -> dict[str, torch.Tensor]:
    """The cache's decode state by name (``hot.L``, ``slot_map.L``, ``k_slots.L``, ``int4.L.c.k``...)."""
    out = {}
    for layer in cache.offloaded:
        for name, t in (("hot", cache.hot.hot[layer]), ("last", cache.hot.last[layer]),
                        ("slot_map", cache.slot_map[layer]), ("k_slots", cache.k_slots[layer]),
                        ("v_slots", cache.v_slots[layer])):
            out[f"{name}.{layer}"] = t
        for c, chunk in enumerate(cache.host.chunks[layer]):
            for part in ("k", "v"):
                q = getattr(chunk, part)
                out[f"int4.{layer}.{c}.{part}"], out[f"int4.{layer}.{c}.{part}.scale"] = q.data, q.scale
        for c, chunk in enumerate(cache.host.pool[layer]):
            out[f"pool.{layer}.{c}.k"], out[f"pool.{layer}.{c}.v"] = chunk.k, chunk.v
    return out


def _differences(new: dict, old: dict) -> list[str]:
    """One line per differing state tensor: its name, differing elements, the largest difference,
    and for the slots whether a slot that ``old``'s slot map names (one the attention reads) differs."""
    lines = []
    for name, x in new.items():
        y = old[name]
        if torch.equal(x, y):
            continue
        diff = x != y if x.dtype == torch.bool else (x.float() - y.float()).abs() > 0
        worst = 0.0 if x.dtype == torch.bool else (x.float() - y.float()).abs().max().item()
        line = f"{name}: {int(diff.sum())} of {x.numel()} differ, max |diff| {worst:.3g}"
        if name.startswith(("k_slots", "v_slots")) and diff.dim() >= 3:  # [b, H, S + 1, ...]
            held = old[f"slot_map.{name.split('.')[1]}"] >= 0  # [b, H, S]: slot holds a block
            per_slot = diff.flatten(3).any(-1) if diff.dim() > 3 else diff
            line += f"; in slots holding a block: {int((per_slot[:, :, :held.shape[2]] & held).sum())}"
        lines.append(line)
    return lines


def check_parity(model, sel, forecast, batch: int, context: int, steps: int) -> bool:
    """Eager steps of the new and the old mixed path from the same filled context."""
    dev = next(model.parameters()).device
    runs = []
    for old in (False, True):
        llm = _llm(model, sel, forecast, "mixed", False, old)
        cache = _filled(llm, batch, context, steps)
        runs.append((llm, cache))
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=dev)
    ok, worst, first = True, 0.0, None
    for i in range(steps):
        pos = torch.full((batch,), context + i, device=dev)
        outs = [llm.model_runner.decode(cache, tokens, pos, max_position=context + i) for llm, cache in runs]
        worst = max(worst, (outs[0] - outs[1]).abs().max().item())
        states = [_state(cache) for _, cache in runs]
        same = torch.equal(outs[0], outs[1]) and all(torch.equal(x, states[1][k]) for k, x in states[0].items())
        if not same and first is None:
            first = i
            lines = _differences(states[0], states[1])
            for line in lines[:12]:
                print(f"parity   step {i}: {line}")
            kinds: dict[str, int] = {}  # every differing tensor, by kind (hot, slot_map, int4, pool, ...)
            for line in lines:
                kind = line.split(".", 1)[0] + (".scale" if ".scale:" in line else "")
                kinds[kind] = kinds.get(kind, 0) + 1
            print(f"parity   step {i}: {len(lines)} differing tensors by kind: {kinds}")
        ok &= same
        tokens = outs[1].argmax(-1)
    stats = [cache.offload_stats(steps * batch) for _, cache in runs]
    keys = ("hits", "misses", "pool_misses", "bytes_copied")
    ok &= all(stats[0][k] == stats[1][k] for k in keys)
    print(f"parity   mixed new vs old, {steps} eager steps B{batch} {context} tokens: identical={ok} "
          f"(first difference at step {first}) max|logit diff|={worst:.3g} "
          + " ".join(f"{k}={stats[0][k]}/{stats[1][k]}" for k in keys))
    return ok


def measure_speed(model, sel, forecast, kv: str, batch: int, context: int, steps: int) -> dict:
    """Kernels per replayed step (CUDA) and ms per step of ``kv`` (a kv_dtype, or ``mixed-old``)."""
    dev = next(model.parameters()).device
    llm = _llm(model, sel, forecast, kv, True, kv == "mixed-old")
    cache = _filled(llm, batch, context, 2 * steps + 8)
    runner = llm.runner(cache)
    tokens = torch.randint(0, model.config.vocab_size, (batch,), device=dev)
    runner.load(tokens, torch.full((batch,), context, device=dev))
    state = {"i": 0}

    def step():
        i = state["i"]
        runner.positions.fill_(context + i)
        runner.step(context + i + 1)
        state["i"] = i + 1

    for _ in range(3):
        step()
    pt.sync(dev)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    pt.sync(dev)
    ms = (time.perf_counter() - start) * 1e3 / steps
    rec = {"kv": kv, "ms_per_step": round(ms, 3)}
    if dev.type == "cuda":
        prof = pt.profile_kernels(step, 2)
        rec.update(kernels_per_step=prof["kernels_per_step"],
                   kernels_per_layer=round(prof["kernels_per_step"] / llm.shape.num_layers, 1))
    del cache, runner, llm
    pt.release_memory(dev)
    return rec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (twins, no profiler) [cuda]")
    p.add_argument("--model", default="minicpm-8b", help="bench model shape (sparda.bench.models) [minicpm-8b]")
    p.add_argument("--batch", type=int, default=4, help="cache rows [4]")
    p.add_argument("--context", type=int, default=16384, help="tokens filled per row [16384]")
    p.add_argument("--steps", type=int, default=16, help="timed steps per kv_dtype, eager parity steps [16]")
    p.add_argument("--checks", default="kernels,parity,speed", help="comma list of kernels, parity, speed [all]")
    p.add_argument("--speed-kv", default="bf16,int8,mixed,mixed-old",
                   help="speed: kv_dtypes, mixed-old the PyTorch bookkeeping [%(default)s]")
    p.add_argument("--out", default=None, help="also write OUT/check_mixed.json (benchmarks/gpu_checks.sh) [none]")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("check_mixed needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    checks = set(args.checks.split(","))
    torch.manual_seed(0)
    ok, speed = True, []
    if "kernels" in checks:
        ok &= check_kernels(dev)
    if checks & {"parity", "speed"}:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        check_models_fit([args.model], dev, dtype)
        model = build_model(args.model, dev, dtype, args.context + 4 * args.steps + 64)
        forecast, sel = random_forecast(model), selection_config(args.model)
        if "parity" in checks:
            ok &= check_parity(model, sel, forecast, args.batch, args.context, args.steps)
        if "speed" in checks:
            for kv in args.speed_kv.split(","):
                rec = measure_speed(model, sel, forecast, kv, args.batch, args.context, args.steps)
                speed.append(rec)
                print("speed    " + " ".join(f"{k}={v}" for k, v in rec.items()))
    if args.out is not None:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"ok": bool(ok), "options": vars(args), "speed": speed}
        (out / "check_mixed.json").write_text(json.dumps(record, indent=1) + "\n")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
