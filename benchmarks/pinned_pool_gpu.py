"""Page-locked host store of an offloaded KV cache on the GPU machine: registering new memory
(first call) against taking a freed cache's memory back from the pool (sparda.cache.pinned).

    python3 benchmarks/pinned_pool_gpu.py [--out FILE.json]

For each shape, builds the offloaded cache's host store (``HostKVStore``, pinned) three times,
freeing it in between: call 1 registers, calls 2 and 3 reuse. Checks that the reused planes are
page-locked and zero and that a non-blocking copy to the GPU and back returns what was written.
Then end to end: offloaded ``sparda`` on the bundled model's shape (random weights, random
Forecast), ``generate`` on 16 random prompts of 7,680 tokens three times; ``cache_alloc_ms``
of each call, and the generated tokens must be the same every time (a reused buffer that
was not zeroed, or still written by the last call, would change them). Exits 1 if a check
fails. ``--device cpu --e2e-only`` tries the end-to-end part on the CPU (tiny shape, no pinning).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.cache import host, pinned  # noqa: E402

SHAPES = {  # name: layers, batch, H_kv, d, tokens
    "SmolLM2-135M, 16 x 7,680 tokens": (30, 16, 3, 64, 7680),
    "Llama-3.1-8B, 1 x 131,072 tokens": (32, 1, 8, 128, 131072),
    "Llama-3.1-8B, 4 x 32,768 tokens": (32, 4, 8, 128, 32768),
}


def planes(store):
    return [p for chunks in store.chunks.values() for c in chunks for q in c.planes() for p in (q.k, q.v)]


class _NoText:
    """Stands in for a tokenizer: token ids only."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def end_to_end(device: str, model_name: str, batch: int, tokens: int) -> tuple[list[dict], bool]:
    from sparda.bench.models import build_model, random_forecast
    from sparda.engine.llm import LLM

    model = build_model(model_name, device, torch.bfloat16 if device == "cuda" else torch.float32)
    llm = LLM.from_model(model, _NoText(), method="sparda", forecast=random_forecast(model),
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--e2e-only", action="store_true")
    args = ap.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
