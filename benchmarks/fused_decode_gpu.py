"""Fused decode on the GPU: the kernels in bf16 against their twins, parity, and a profile.

Usage (on a CUDA machine, from the repository root):

    python3 benchmarks/fused_decode_gpu.py kernels OUT    # bf16/fp32 kernels vs PyTorch twins (real tl.dot)
    python3 benchmarks/fused_decode_gpu.py parity OUT     # every method: fused graphs vs fused eager vs unfused
    python3 benchmarks/fused_decode_gpu.py profile OUT [CONTEXT BATCH METHOD...]  # kernels by name

Each part writes ``OUT/<part>.json`` and prints a short table. ``kernels`` checks, on CUDA
tensors with compiled kernels (the interpreter runs fp32 dots only): RoPE + append
(offload partial slot + ring + pinned host store, and the full device cache), the slot
diff, add + RMSNorm, SiLU * mul, and the bf16 ``tl.dot`` paths of decode selection,
decode attention (full cache and slots) and prefill attention.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sparda import kernels  # noqa: E402
from sparda.config import SelectionConfig  # noqa: E402
from sparda.kernels import reference as ref  # noqa: E402
from sparda.kernels import twins  # noqa: E402

DEV = "cuda"


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def kernel_checks(out_dir: Path) -> list[dict]:
    from sparda.kernels.norm import add_rmsnorm_triton, silu_mul_triton
    from sparda.kernels.rope_append import rope_append_triton
    from sparda.kernels.slot_diff import slot_diff_triton

    rows = []
    cfg = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                          topk_blocks=8, dense_len=1024)
    gen = torch.Generator(device=DEV).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).replace("torch.", "")
        for g, d in ((16, 128), (4, 128), (3, 64), (1, 64)):
            b, hk, nf, cap = 4, 2, 2, 4096
            qkv = torch.randn(b, (hk * g + (2 + nf) * hk) * d, device=DEV, generator=gen).to(dtype)
            pos = torch.tensor([31, 1000, 2047 + 16, 4000], device=DEV)
            theta = pos.view(-1, 1).float() * (1.0 / 10000.0 ** (torch.arange(0, d, 2, device=DEV).float() / d))
            emb = torch.cat([theta, theta], -1)
            cos, sin = emb.cos().to(dtype).view(b, 1, 1, d), emb.sin().to(dtype).view(b, 1, 1, d)
            slots = 24
            for layout in ("slots", "full"):
                if layout == "slots":
                    kd = torch.randn(b, hk, slots + 1, cfg.block_size, d, device=DEV, generator=gen).to(dtype)
                    ring = torch.randn(b, hk, cfg.kernel_size, d, device=DEV, generator=gen).to(dtype)
                    host = tuple(torch.zeros(b, hk, cap // cfg.block_size, cfg.block_size, d, dtype=dtype,
                                             pin_memory=True) for _ in range(2))
                    extra = dict(slot=slots, ring=ring, host=host)
                else:
                    kd = torch.randn(b, hk, cap, d, device=DEV, generator=gen).to(dtype)
                    extra = {}
                vd = torch.randn(kd.shape, device=DEV, generator=gen).to(dtype)
                ck = torch.randn(b, hk, ref.num_compressed(cap, 32, 16), d, device=DEV, generator=gen).to(dtype)
                outs = []
                for fn in (rope_append_triton, twins.rope_append_reference):
                    state = {k: v.clone() for k, v in dict(kd=kd, vd=vd, ck=ck).items()}
                    ex = dict(extra)
                    if "ring" in ex:
                        ex["ring"] = ring.clone()
                        ex["host"] = tuple(h.clone().pin_memory() for h in host)
                    q = torch.empty(b, hk * g, d, device=DEV, dtype=dtype)
                    f = torch.empty(b, nf, hk, d, device=DEV, dtype=dtype)
                    fn(qkv, cos, sin, pos, q, f, state["kd"], state["vd"], state["ck"], num_kv_heads=hk, group=g,
                       num_f=nf, block_size=cfg.block_size, kernel=32, stride=16, **ex)
                    torch.cuda.synchronize()
                    outs.append((q, f, state, ex))
                (q1, f1, s1, e1), (q2, f2, s2, e2) = outs
                errs = {"q": _rel(q1, q2), "f": _rel(f1, f2), "k": _rel(s1["kd"], s2["kd"]),
                        "v": _rel(s1["vd"], s2["vd"]), "ck": _rel(s1["ck"], s2["ck"])}
                if layout == "slots":
                    errs.update(ring=_rel(e1["ring"], e2["ring"]), host_k=_rel(e1["host"][0], e2["host"][0]))
                rows.append({"kernel": f"rope_append/{layout}", "dtype": name, "G": g, "d": d,
                             "max_rel_err": max(errs.values()), **{k: round(v, 8) for k, v in errs.items()}})
        # add + rmsnorm, silu * mul
        x = torch.randn(8, 4096, device=DEV, generator=gen).to(dtype)
        delta = torch.randn(8, 4096, device=DEV, generator=gen).to(dtype)
        w = torch.randn(4096, device=DEV, generator=gen).to(dtype)
        a, b_ = x.clone(), x.clone()
        o1 = add_rmsnorm_triton(a, delta, w, 1e-5, torch.empty_like(x))
        o2 = twins.add_rmsnorm_reference(b_, delta, w, 1e-5, torch.empty_like(x))
        rows.append({"kernel": "add_rmsnorm", "dtype": name, "max_rel_err": max(_rel(o1, o2), _rel(a, b_)),
                     "exact_residual": bool(torch.equal(a, b_))})
        gu = torch.randn(8, 2 * 16384, device=DEV, generator=gen).to(dtype)
        m1 = silu_mul_triton(gu, torch.empty(8, 16384, device=DEV, dtype=dtype))
        m2 = twins.silu_mul_reference(gu, torch.empty(8, 16384, device=DEV, dtype=dtype))
        rows.append({"kernel": "silu_mul", "dtype": name, "max_rel_err": _rel(m1, m2)})
    # slot diff (integers: must be exact); w < s: spare slots (slot_factor, design §6) with the
    # compact (block, slot) list attention reads
    for b, h, s, n, w in ((4, 2, 96, 2048, 96), (16, 8, 128, 1024, 128), (3, 3, 7, 40, 7), (4, 2, 192, 2048, 128),
                          (16, 2, 48, 1024, 32)):
        ok = True
        for trial in range(20):
            pos = torch.randint(64 * 4, n * 64, (b,), device=DEV, generator=gen)
            slot_map = torch.full((b, h, s), -1, dtype=torch.long, device=DEV)
            ids = torch.full((b, h, w), -1, dtype=torch.int32, device=DEV)
            for i in range(b):
                cur = int(pos[i]) // 64
                for j in range(h):
                    held = torch.randperm(cur, device=DEV, generator=gen)[:int(torch.randint(0, s + 1, (1,)))]
                    slot_map[i, j, torch.randperm(s, device=DEV, generator=gen)[:held.numel()]] = held
                    k = int(torch.randint(0, min(w - 1, cur) + 1, (1,)))
                    pool = torch.unique(torch.cat([held, torch.randperm(cur, device=DEV, generator=gen)[:s]]))
                    chosen = torch.sort(torch.cat([pool[torch.randperm(pool.numel(), device=DEV, generator=gen)[:k]],
                                                   torch.tensor([cur], device=DEV)])).values
                    ids[i, j, :chosen.numel()] = chosen.int()
            res = []
            for fn in (slot_diff_triton, twins.slot_diff_reference):
                sm, load = slot_map.clone(), torch.empty_like(slot_map)
                attn = torch.empty(b, h, s + 1, dtype=torch.int32, device=DEV)
                cnt = tuple(torch.zeros(b, dtype=torch.long, device=DEV) for _ in range(4))
                compact = tuple(torch.empty(b, h, min(w, s) + 1, dtype=torch.int32, device=DEV) for _ in range(2)) \
                    if w < s else None
                fn(ids, sm, pos, 64, n, load, attn, cnt, compact)
                res.append((load, sm, attn, *cnt, *(compact or ())))
            ok &= all(torch.equal(x, y) for x, y in zip(*res))
        rows.append({"kernel": "slot_diff", "dtype": "int", "B": b, "H": h, "S": s, "W": w, "exact": bool(ok),
                     "max_rel_err": 0.0 if ok else 1.0})
    # the bf16 tl.dot paths of the older kernels (review C8)
    for g in (16, 4, 1):
        b, hk, d, t = 4, 2, 128, 8192
        k = torch.randn(b, hk, t, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(b, hk, g, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kv_len = torch.tensor([t, t - 5, 3000, 777], device=DEV)
        ck = ref.compress_keys(k, 32, 16)
        sel = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                              topk_blocks=16, dense_len=1024)
        ids_t = kernels.select_decode_blocks(q, ck, kv_len - 1, t // 64, sel)
        ids_r = twins.select_decode_reference(q, ck, kv_len - 1, t // 64, sel)
        same = float((twins.ids_to_block_mask(ids_t, t // 64) == twins.ids_to_block_mask(ids_r, t // 64)).float().mean())
        rows.append({"kernel": "select_decode(query, bf16 dot)", "dtype": "bfloat16", "G": g,
                     "mask_agreement": round(same, 5), "max_rel_err": 1 - same})
        o1 = kernels.decode_attention(q, k, v, ids_r, kv_len, 64)
        o2 = twins.decode_attention_reference(q, k, v, ids_r, kv_len, 64)
        rows.append({"kernel": "decode_attention (bf16 dot)", "dtype": "bfloat16", "G": g, "max_rel_err": _rel(o1, o2)})
        qp = torch.randn(1, hk, g, 2048, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kp, vp = k[:1, :, :2048].contiguous(), v[:1, :, :2048].contiguous()
        qpos = torch.arange(2048, device=DEV).view(1, -1)
        o1 = kernels.prefill_attention(qp, kp, vp, None, qpos, torch.tensor([2048], device=DEV), 64)
        o2 = ref.block_sparse_attention(qp.float(), kp.float(), vp.float(), None, qpos,
                                        torch.tensor([2048], device=DEV), 64)
        rows.append({"kernel": "prefill_attention (bf16 dot)", "dtype": "bfloat16", "G": g, "max_rel_err": _rel(o1, o2)})
    # decode selection in bf16 for the other group sizes and the Forecast's mode (one head, raw
    # dot, the next layer's compressed keys cut at the window complete before this token)
    for mode in ("forecast", 3, 8):
        b, hk, d, t = 4, 2, 128, 8192
        k = torch.randn(b, hk, t, d, device=DEV, generator=gen, dtype=torch.bfloat16)
        kv_len = torch.tensor([t, t - 5, 3000, 777], device=DEV)
        ck = ref.compress_keys(k, 32, 16)
        sel = SelectionConfig(block_size=64, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=4,
                              topk_blocks=16, dense_len=1024)
        if mode == "forecast":
            q = torch.randn(b, hk, d, device=DEV, generator=gen, dtype=torch.bfloat16)
            ck_len = torch.clamp((kv_len - 1 - 32) // 16 + 1, min=0)  # windows complete at q_pos - 1
        else:
            q = torch.randn(b, hk, mode, d, device=DEV, generator=gen, dtype=torch.bfloat16)
            ck_len = None
        ids_t = kernels.select_decode_blocks(q, ck, kv_len - 1, t // 64, sel, ck_len=ck_len)
        ids_r = twins.select_decode_reference(q, ck, kv_len - 1, t // 64, sel, ck_len=ck_len)
        same = float((twins.ids_to_block_mask(ids_t, t // 64) == twins.ids_to_block_mask(ids_r, t // 64)).float().mean())
        rows.append({"kernel": f"select_decode({'forecast' if mode == 'forecast' else 'query'}, bf16 dot)",
                     "dtype": "bfloat16", "G": 1 if mode == "forecast" else mode, "mask_agreement": round(same, 5),
                     "max_rel_err": 1 - same})
    for r in rows:
        print(r, flush=True)
    (out_dir / "kernels.json").write_text(json.dumps(rows, indent=1))
    return rows


def parity(out_dir: Path) -> list[dict]:
    from cuda_graphs_gpu import METHODS, _NoText, _generate, _random_model
    from sparda.bench.models import random_forecast
    from sparda.engine.llm import LLM

    rows = []
    budget = dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=512)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (1500, 2300, 700, 450)]
    for dtype in (torch.bfloat16, torch.float32):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        for method, offload in METHODS:
            res = {}
            for name, kw in (("fused", {}), ("fused_eager", {"cuda_graphs": False}),
                             ("unfused", {"fused_decode": False})):
                llm = LLM.from_model(model, _NoText(), method=method, forecast=forecast, offload=offload,
                                     **budget, **kw)
                _generate(llm, prompts, 8)
                res[name] = _generate(llm, prompts, 128)
                del llm
            (f, t_f), (e, _), (u, t_u) = res["fused"], res["fused_eager"], res["unfused"]
            agree = sum(sum(x == y for x, y in zip(a.token_ids, b.token_ids)) for a, b in zip(f, u))
            total = sum(len(a.token_ids) for a in f)
            rows.append({"dtype": str(dtype).replace("torch.", ""), "method": method, "offload": offload,
                         "graph_eq_eager": all(a.token_ids == b.token_ids for a, b in zip(f, e)),
                         "fused_eq_unfused": all(a.token_ids == b.token_ids for a, b in zip(f, u)),
                         "token_agreement": round(agree / total, 4),
                         "fused_tok_s": f[0].stats["decode_tok_s"], "unfused_tok_s": u[0].stats["decode_tok_s"]})
            print(rows[-1], flush=True)
    (out_dir / "parity.json").write_text(json.dumps(rows, indent=1))
    return rows


def profile(out_dir: Path, context: int, batch: int, methods: list[str]) -> list[dict]:
    from profile_decode_gpu import profile_point
    from sparda.bench.models import build_model, random_forecast
    from sparda.bench.traces import SHIPPED_TRACE, load_traces

    model = build_model("minicpm-8b", DEV, torch.bfloat16, context + 1024)
    forecast = random_forecast(model)
    traces = load_traces(SHIPPED_TRACE)
    recs = []
    for method in methods:
        rec = profile_point(model, forecast, method, batch, context, traces)
        recs.append(rec)
        print(f"\n== {method} B{batch} {context}: TPOT {rec['tpot_ms']} ms, {rec['kernels_per_step']:.0f} kernels, "
              f"{rec['gpu_kernel_ms']} ms kernel time; phases {rec['phases']}", flush=True)
        for k in rec["kernels"][:22]:
            print(f"  {k['us_per_step']:9.1f} us {k['per_step']:7.1f}x  {k['name'][:90]}")
    (out_dir / f"profile-b{batch}.json").write_text(json.dumps(recs, indent=1))
    return recs


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if part == "kernels":
        kernel_checks(out)
    elif part == "parity":
        parity(out)
    elif part == "profile":
        ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 131072
        bat = int(sys.argv[4]) if len(sys.argv) > 4 else 4
        profile(out, ctx, bat, sys.argv[5:] or ["sparda", "sparse-offload", "dense"])
    else:
        raise SystemExit(f"unknown part {part!r}: kernels, parity or profile")
    print(f"[{part}: {time.perf_counter() - t0:.0f} s]")
