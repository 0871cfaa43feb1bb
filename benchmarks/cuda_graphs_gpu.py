"""CUDA-graph decode on the GPU: parity with eager, speed-up, and the 128K sweep (docs/cuda_graphs.md).

Usage (on a CUDA machine, from the repository root, PYTHONPATH=src):

    python3 benchmarks/cuda_graphs_gpu.py parity OUT          # random model, every method, bf16 + fp32
    python3 benchmarks/cuda_graphs_gpu.py bundled OUT GGUF    # bundled model, ~7K-token passkey prompt
    python3 benchmarks/cuda_graphs_gpu.py sweep OUT [BUDGET_S [NAME ...]]  # MiniCPM-8B shape, 128K

Each part writes ``OUT/<part>.json`` and prints a short table. ``parity`` generates with
``cuda_graphs=True`` and ``False`` from the same prompts and checks that the greedy tokens
are equal (a prompt below ``dense_len`` crosses the dense fallback mid-generation, so
two graphs are captured); it also checks that the device timestamps of the offload
timing and the profiler's kernel count work inside a replayed graph.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.bench import point as pt  # noqa: E402
from sparda.bench.models import random_forecast  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402
from sparda.model.llama import CausalLM  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script itself
METHODS = [("dense", None), ("sparse", None), ("oracle", None), ("infinigen", None), ("sparda", False),
           ("sparda", True), ("sparse-offload", None), ("sparda-no-prefetch", None)]


class _NoText:
    """Stands in for a tokenizer: token ids only."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def _random_model(dtype, head_dim=128, seed=0):
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=head_dim, vocab_size=2048, max_position_embeddings=8192,
                      rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    with torch.device(DEV):
        model = CausalLM(cfg).to(dtype)
    model.rotary.inv_freq.data = model.rotary.inv_freq.float()
    return model.eval()


def _sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def _generate(llm, prompts, new_tokens):
    _sync()
    start = time.perf_counter()
    out = llm.generate(None, prompt_token_ids=prompts, max_new_tokens=new_tokens, ignore_eos=True)
    _sync()
    return out, time.perf_counter() - start


def parity(out_dir: Path) -> list[dict]:
    rows = []
    budget = dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=512)
    gen = torch.Generator().manual_seed(0)
    cases = {"batch": [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in (1500, 2300, 700)],
             "crossing": [torch.randint(0, 2048, (450,), generator=gen).tolist()]}
    for dtype in ((torch.bfloat16, torch.float32) if DEV == "cuda" else (torch.float32,)):
        model = _random_model(dtype)
        forecast = random_forecast(model)
        for method, offload in METHODS:
            for case, prompts in cases.items():
                res = {}
                for graphs in (False, True):
                    llm = LLM.from_model(model, _NoText(), method=method, forecast=forecast, offload=offload,
                                         cuda_graphs=graphs, **budget)
                    _generate(llm, prompts, 8)  # compile the kernels
                    res[graphs] = _generate(llm, prompts, 128)
                (eager, t_e), (graph, t_g) = res[False], res[True]
                same = all(a.token_ids == b.token_ids for a, b in zip(eager, graph))
                rows.append({"dtype": str(dtype).replace("torch.", ""), "method": method, "offload": offload,
                             "case": case, "tokens_equal": same, "cuda_graph": graph[0].stats["cuda_graph"],
                             "eager_tok_s": eager[0].stats["decode_tok_s"],
                             "graph_tok_s": graph[0].stats["decode_tok_s"],
                             "speedup": round(graph[0].stats["decode_tok_s"] / max(eager[0].stats["decode_tok_s"], 1e-9), 2)})
                print(rows[-1], flush=True)
    # offload timing (device timestamps) and the profiler inside replayed graphs
    model = _random_model(torch.bfloat16)
    llm = LLM.from_model(model, _NoText(), method="sparda", forecast=random_forecast(model), offload=True,
                         offload_timing=True, **budget)
    out, _ = _generate(llm, cases["batch"], 64)
    timing = out[0].stats["offload"]
    cache = llm.new_cache(2, 3000)
    run = llm.runner(cache)
    llm.prefill(cache, 0, cases["batch"][0])
    llm.prefill(cache, 1, cases["batch"][1])
    run.load(torch.zeros(2, dtype=torch.long, device=DEV), torch.tensor([1500, 2300], device=DEV))
    for _ in range(3):
        run.step(2301)
    prof = pt.profile_kernels(lambda: run.step(2301), 3) if DEV == "cuda" else None
    extra = {"offload_timing": timing, "graph_profile": prof, "graph_replays": run.replays}
    print(extra, flush=True)
    (out_dir / "parity.json").write_text(json.dumps({"rows": rows, **extra}, indent=1))
    return rows


def bundled(out_dir: Path, gguf: str) -> list[dict]:
    from sparda.data import heldout_text
    from sparda.eval.tasks.passkey import make_passkey

    rows = []
    for method, extra in (("sparda", {}), ("dense", {})):
        res = {}
        for graphs in (False, True):
            llm = LLM(gguf, method=method, device=DEV, dense_prefill=True, cuda_graphs=graphs, **extra)
            sample = make_passkey(llm.tokenizer, heldout_text(), 7000, 0.5, 0)
            ids = llm.encode(sample.prompt)
            llm.generate(None, prompt_token_ids=[ids], max_new_tokens=8, ignore_eos=True)
            res[graphs] = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=128, ignore_eos=True)[0]
        e, g = res[False], res[True]
        rows.append({"method": method, "offload": bool(llm.config.offload), "prompt_tokens": len(ids),
                     "new_tokens": 128, "tokens_equal": e.token_ids == g.token_ids,
                     "answer": g.text[:40], "expected": sample.answer,
                     "eager_tok_s": e.stats["decode_tok_s"], "graph_tok_s": g.stats["decode_tok_s"],
                     "speedup": round(g.stats["decode_tok_s"] / e.stats["decode_tok_s"], 2),
                     "cuda_graph": g.stats["cuda_graph"], "offload_stats": g.stats.get("offload")})
        print(rows[-1], flush=True)
    (out_dir / "bundled.json").write_text(json.dumps(rows, indent=1))
    return rows


#: (name, methods, batches, parity steps): every method at B4 and B8, the offloaded pair at B16
#: and at B24 (host memory: 24 rows x 4.2 GB of offloaded KV at 128K)
ALL = ["sparse-offload", "dense", "sparse", "sparda-no-prefetch", "infinigen", "sparda"]
SWEEPS = [("b4", ALL, [4], 64), ("b16", ["sparda", "sparse-offload"], [16], 64),
          ("b24", ["sparda", "sparse-offload"], [24], 16), ("b8", ALL, [8], 64)]


def sweep(out_dir: Path, budget_s: float, names=None) -> list[dict]:
    from sparda.bench.sweep import SweepConfig, run_sweep

    t0 = time.perf_counter()
    records = []
    for name, methods, batches, parity_steps in SWEEPS:
        if names and name not in names:
            continue
        left = budget_s - (time.perf_counter() - t0)
        if left < 30:
            break
        cfg = SweepConfig(models=["minicpm-8b"], contexts=[131072], batches=batches, methods=methods,
                          decode_steps=16, repeats=3, warmup_steps=3, breakdown_steps=0, prefill_tokens=16384,
                          out=str(out_dir / f"sweep-{name}"), time_budget_s=left, parity_steps=parity_steps)
        records += run_sweep(cfg, log=lambda line: print(f"[{time.perf_counter() - t0:6.0f} s] {line}", flush=True))
    (out_dir / "sweep.json").write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    part, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    if part == "parity":
        parity(out)
    elif part == "bundled":
        bundled(out, sys.argv[3])
    elif part == "sweep":
        recs = sweep(out, float(sys.argv[3]) if len(sys.argv) > 3 else 480, sys.argv[4:])
        for r in recs:
            print(r["method"], r["batch"], r["status"], r.get("decode_tok_s"), r.get("tpot_ms"),
                  r.get("gpu_kernel_ms"), r.get("kernels_per_step"), r.get("graph_tokens_equal"))
    else:
        raise SystemExit(f"unknown part {part!r}: parity, bundled or sweep")
