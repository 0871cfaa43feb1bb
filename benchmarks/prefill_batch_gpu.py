"""Batched prefill (design §3.8) on the GPU: same tokens as one prompt per forward, and the time.

Usage (from the repository root, on a CUDA machine):

    python3 benchmarks/prefill_batch_gpu.py [--model GGUF_OR_DIR] [--lengths 2048,7680]
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

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.data import heldout_text  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402

METHODS = ("dense,sparse,oracle,sparda,sparda-random,infinigen,streaming,h2o,quest,snapkv,shallow,"
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=_csv(int), default=[2048, 7680])
    p.add_argument("--methods", type=_methods, default=_methods(METHODS))
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script (no kernel count)")
    args = p.parse_args(argv)
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
                llm.prefill_batch_tokens = budget
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


if __name__ == "__main__":
    sys.exit(main())
