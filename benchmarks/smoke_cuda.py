"""End-to-end CUDA smoke test of the engine: every method on a random model at the bundled
shape, kernels on the hot path, offloaded vs on-device agreement.

Usage (on a GPU machine): PYTHONPATH=src python benchmarks/smoke_cuda.py --tokenizer DIR --out OUT
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from sparda import LLM
from sparda.attention.forecast import Forecast, model_identity, q_init, save_forecast


def build(tmp: Path, tokenizer_dir: str) -> tuple[Path, Path]:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=6000)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
