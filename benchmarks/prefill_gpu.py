"""Long prefill on the GPU (issue #11): TTFT, tok/s, selection and attention ms per layer, peak memory.

Usage (one CUDA GPU, from the repository root; under 8 minutes on an H200: points stop at
``budget - 120 s``, the parity run's two parts start before ``budget``):

    PYTHONPATH=src python3 benchmarks/prefill_gpu.py OUT [--budget-s 420] [--lengths 32768,65536,131072]
        [--models minicpm-8b,llama-8b] [--methods dense,sparse,...] [--chunk 8192] [--skip-parity]
        [--keep 0.83] [--profile] [--topk-search bisect,bracket] [--query-stages 1,3]

Random bf16 weights at the 8B shapes of :mod:`sparda.bench.models`, the ``paper`` preset,
block-sparse prefill. Three parts, each failing soft (an error is recorded and the
script goes on) and all bounded by ``--budget-s``:

1. ``kernel_check``: the prefill selection kernel (``kernels.prefill_selection``, the bf16
   ``tl.dot`` path) against its PyTorch twin on the GPU, query-based G = 16 and 4 and the
   Forecast: agreement of the selected blocks and the score error.
2. ``points``: per model, length and method (``dense`` = unchunked flash SDPA; the others
   chunked by ``--chunk``): TTFT (prefill plus the first token's logits), prefill tok/s,
   selection and attention ms of the middle layer summed over the prompt's chunks (CUDA
   events around ``method.select`` and the attention call), the ms of its ``before_layer``
   (``forecast_ms_per_layer``: the Forecast projection and its RoPE for the next layer,
   which ``select`` does not include; ~0 for the query-based methods), peak GPU memory and
   peak minus weights. A point runs twice when the budget allows (the first compiles the
   kernels); ``warm`` says which was kept. ``--keep H``: the block-sparse points attend over
   synthetic masks whose neighbouring tokens keep ``H`` of their top-k (:class:`SyntheticMasks`;
   the selection kernels still run and are timed), records say ``masks``. ``--profile``: one
   more prefill of each warm point under ``torch.profiler`` (``profile``: kernel count and
   time, GPU busy and idle ms against the wall, synchronising/allocating runtime calls;
   :func:`sparda.bench.gpu_profile.profile_call`), to find host time the GPU waits on.
   ``--topk-search A,B``: each block-sparse point once per top-k search of the prefill
   selection kernel (``bracket``, the default, or ``bisect``; records say ``topk_search``).
   ``--query-stages 1,3``: each query-based point (``sparse``, ``sparse-offload``) once per
   pipeline depth of its scoring launch (records say ``query_num_stages``), so that the
   baseline runs at its fastest launch shape too.
3. ``parity``: 128K MiniCPM-8B shape, offloaded ``sparda`` with chunked prefill then 64
   greedy tokens, against the same with unchunked prefill (``chunked_vs_unchunked``, the
   criterion) and, time permitting, on-device ``sparda`` with unchunked prefill
   (``offload_vs_device``): equal tokens, the first mismatch, the first token's logits
   difference, peak memory of each run.

Writes ``OUT/prefill_gpu.json`` (atomically) and prints a short table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from sparda.attention import base, dense as dense_mod  # noqa: E402
from sparda.bench.gpu_profile import profile_call  # noqa: E402
from sparda.bench.models import build_model, random_forecast, weight_bytes  # noqa: E402
from sparda.engine.llm import LLM  # noqa: E402

#: label -> (method, offload)
METHODS = {"dense": ("dense", False), "sparse": ("sparse", False), "sparse-offload": ("sparse-offload", None),
           "sparda": ("sparda", False), "sparda-offload": ("sparda", True),
           "sparda-no-prefetch": ("sparda-no-prefetch", None)}
GIB = 2 ** 30


class _NoText:
    """Stands in for a tokenizer: token ids only."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


class LayerTimer:
    """CUDA events around ``method.select``, ``method.before_layer`` and the attention call
    of one layer (prefill).

    Wraps the method instance's ``attend``/``select``/``before_layer`` and the module-level
    attention functions that ``attend`` calls; ``totals()`` syncs and sums the elapsed ms."""

    KINDS = ("select", "forecast", "attention")

    def __init__(self, method, layer: int) -> None:
        self.method, self.layer, self.active = method, layer, False
        self.events = {kind: [] for kind in self.KINDS}
        self._saved = []
        attend, select = method.attend, getattr(method, "select", None)
        before = getattr(method, "before_layer", None)

        def timed_attend(lay, *args, **kwargs):
            self.active = lay == layer
            try:
                return attend(lay, *args, **kwargs)
            finally:
                self.active = False

        method.attend = timed_attend
        if select is not None:
            method.select = self._wrap(select, "select")
        if before is not None:
            method.before_layer = self._wrap(before, "forecast")
        for module, name in ((base, "sparse_attention"), (base, "dense_attention"), (dense_mod, "dense_attention")):
            fn = getattr(module, name)
            self._saved.append((module, name, fn))
            setattr(module, name, self._wrap(fn, "attention"))

    def _wrap(self, fn, kind):
        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return fn(*args, **kwargs)
            finally:
                end.record()
                self.events[kind].append((start, end))
        return timed

    def reset(self) -> None:
        self.events = {kind: [] for kind in self.KINDS}

    def totals(self) -> dict:
        torch.cuda.synchronize()
        return {f"{k}_ms_per_layer": round(sum(s.elapsed_time(e) for s, e in v), 3) if v else None
                for k, v in self.events.items()}

    def close(self) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        self.method.__dict__.pop("attend", None)
        self.method.__dict__.pop("select", None)
        self.method.__dict__.pop("before_layer", None)


class SyntheticMasks:
    """``--keep H``: while active, ``kernels.select_prefill_blocks`` still runs (its cost is
    measured) but returns a synthetic mask instead of its own: per token the forced blocks
    plus ``topk_blocks`` others, ``round(H * k)`` of them the previous token's
    (``bench.traces.synthetic_prefill_mask``; random queries make neighbouring tokens' selections
    nearly disjoint, real ones keep ~83 %, ``benchmarks/prefill_overlap.py``). One mask per
    chunk, shared by its layers, keyed by the call's shapes (queries, blocks, KV heads: no
    host sync) and drawn at the first call of that chunk (so in the first, compiling run;
    the second, warm run finds them all; the chunk is taken to end at ``blocks x block``)."""

    def __init__(self, keep: float, cfg):
        self.keep, self.cfg, self.cache = keep, cfg, {}
        self.made_in_timed_run = False

    def __enter__(self):
        from sparda import kernels

        self._kernels, self._original = kernels, kernels.select_prefill_blocks

        def select(query, ck, q_pos, num_blocks, cfg, **kw):
            self._original(query, ck, q_pos, num_blocks, cfg, **kw)  # its cost stays in the timing
            heads, tq = ck.shape[1], q_pos.shape[1]
            key = (tq, num_blocks, heads)
            if key not in self.cache:
                from sparda.bench.traces import synthetic_prefill_mask

                self.cache[key] = synthetic_prefill_mask(heads, cfg, num_blocks * cfg.block_size, tq, num_blocks,
                                                         self.keep, seed=len(self.cache)).to(q_pos.device)
                self.made_in_timed_run = self.timed
            return self.cache[key].expand(q_pos.shape[0], -1, -1, -1)

        self.timed = False
        kernels.select_prefill_blocks = select
        return self

    def __exit__(self, *exc):
        self._kernels.select_prefill_blocks = self._original


@contextlib.contextmanager
def selection_options(search=None, query_stages=None):
    """While active, the prefill selection kernel runs with ``topk_search=search`` and the
    query-based selector's scoring launch with ``num_stages=query_stages`` (``None``: the
    kernel's defaults)."""
    if search is None and query_stages is None:
        yield
        return
    from sparda.kernels import prefill_selection as ps

    original = ps.select_prefill_blocks_triton

    def select(query, *args, **kwargs):
        if search is not None:
            kwargs["topk_search"] = search
        if query_stages is not None and query.dim() == 5:  # [B, H, G, Tq, d]: query-based
            kwargs["num_stages"] = query_stages
        return original(query, *args, **kwargs)

    ps.select_prefill_blocks_triton = select
    try:
        yield
    finally:
        ps.select_prefill_blocks_triton = original


def _prefill_once(llm, ids, timer):
    cache = llm.new_cache(1, len(ids) + 64)
    llm.method.reset()
    if timer is not None:
        timer.reset()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    logits = llm.prefill(cache, 0, ids)
    first = int(logits[-1].argmax())  # the first token: TTFT includes its logits
    torch.cuda.synchronize()
    ttft = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated()
    del cache, logits
    return ttft, peak, first


def run_point(model, forecast, weights, label, length, chunk, deadline, keep=None, profile=False):
    method, offload = METHODS[label]
    llm = LLM.from_model(model, _NoText(), method=method, preset="paper", forecast=forecast, offload=offload,
                         prefill_chunk_tokens=0 if label == "dense" else chunk)
    ids = torch.randint(0, model.config.vocab_size, (length,)).tolist()
    timer = LayerTimer(llm.method, model.shape.num_layers // 2)
    synthetic = SyntheticMasks(keep, llm.config.selection) if keep is not None and label != "dense" else None
    try:
        with synthetic or contextlib.nullcontext():
            ttft, peak, _ = _prefill_once(llm, ids, timer)
            warm = False
            if time.perf_counter() + 1.5 * ttft < deadline:  # the first run compiled the kernels
                if synthetic is not None:
                    synthetic.timed = True
                ttft, peak, _ = _prefill_once(llm, ids, timer)
                warm = True
        layer = timer.totals()
    finally:
        timer.close()
    traced = None
    if profile and warm and time.perf_counter() + 3 * ttft < deadline:  # the profiler slows the run
        with synthetic or contextlib.nullcontext():
            traced = profile_call(lambda: _prefill_once(llm, ids, None))
    rec = {"ttft_s": round(ttft, 3), "prefill_tok_s": round(length / ttft, 1), **layer,
           "peak_gpu_gib": round(peak / GIB, 3), "peak_minus_weights_gib": round((peak - weights) / GIB, 3),
           "warm": warm, "chunk_tokens": 0 if label == "dense" else chunk,
           "offloaded": bool(getattr(llm.method, "offloaded", False) or llm.config.offload)}
    if profile:
        rec["profile"] = traced if traced is not None else "skipped (time budget, or no warm run)"
    if synthetic is not None:  # masks drawn inside the kept run would count in its TTFT
        rec.update(masks=f"synthetic, top-k keep {keep}", masks_drawn_in_kept_run=synthetic.made_in_timed_run or not warm)
    return rec


def kernel_check() -> list[dict]:
    """bf16 prefill selection kernel vs its twin on the GPU (32K context, 512 query tokens)."""
    from sparda.config import SelectionConfig
    from sparda.kernels import reference, twins
    from sparda.kernels.prefill_selection import select_prefill_blocks_triton

    cfg = SelectionConfig.from_preset("paper")
    rows = []
    num_tokens, num_q, heads, d = 32768, 512, 2, 128
    num_ck = reference.num_compressed(num_tokens, cfg.kernel_size, cfg.kernel_stride)
    num_blocks = num_tokens // cfg.block_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    ck = torch.randn(1, heads, num_ck, d, device="cuda", generator=gen).bfloat16()
    q_pos = torch.arange(num_tokens - num_q, num_tokens, device="cuda").view(1, -1)
    for groups in (16, 4, None):
        shape = (1, heads, num_q, d) if groups is None else (1, heads, groups, num_q, d)
        query = (torch.randn(shape, device="cuda", generator=gen) * 0.3).bfloat16()
        for lookahead in ((False, True) if groups is None else (False,)):
            mask, scores = select_prefill_blocks_triton(query, ck, q_pos, num_blocks, cfg, lookahead=lookahead,
                                                        return_scores=True)
            ref_mask, ref_scores = twins.select_prefill_reference(query, ck, q_pos, num_blocks, cfg,
                                                                  lookahead=lookahead, return_scores=True)
            valid = torch.arange(num_blocks, device="cuda").view(1, 1, 1, -1) <= (q_pos // cfg.block_size)[:, None, :, None]
            fin = torch.isfinite(ref_scores) & valid
            err = ((scores[fin] - ref_scores[fin]).abs().max() / ref_scores[fin].abs().max()).item()
            rule_exact = torch.equal(mask, reference.select_blocks(scores.nan_to_num(0.0), q_pos, cfg))
            rows.append({"groups": groups or "forecast", "lookahead": lookahead,
                         "rows_equal": float((mask == ref_mask).all(-1).float().mean()),
                         "selected_recall": round(float((mask & ref_mask).sum() / ref_mask.sum()), 6),
                         "score_max_rel_err": err, "rule_exact_on_kernel_scores": rule_exact})
            print("kernel_check", rows[-1], flush=True)
    return rows


def parity(deadline, chunk) -> dict:
    """128K, MiniCPM-8B shape, offloaded sparda decoding 64 greedy tokens after a chunked
    prefill vs after an unchunked one (the #11 criterion: same decode path, only the prefill
    differs); then, time permitting, on-device sparda with unchunked prefill (another decode
    path: its bf16 rounding may move a token of this random model)."""
    model = build_model("minicpm-8b", "cuda", torch.bfloat16, max_positions=131072 + 256)
    forecast = random_forecast(model)
    ids = torch.randint(0, model.config.vocab_size, (131072,)).tolist()
    out = {}
    runs = (("offload_chunked", True, chunk), ("offload_unchunked", True, 0), ("device_unchunked", False, 0))
    for label, offload, chunking in runs:
        if time.perf_counter() > deadline:
            out[label] = {"status": "skipped (time budget)"}
            continue
        llm = LLM.from_model(model, _NoText(), method="sparda", preset="paper", forecast=forecast, offload=offload,
                             prefill_chunk_tokens=chunking)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        res = llm.generate(None, prompt_token_ids=[ids], max_new_tokens=64, ignore_eos=True)[0]
        torch.cuda.synchronize()
        out[label] = {"tokens": res.token_ids, "seconds": round(time.perf_counter() - start, 2),
                      "prefill_ms": res.stats["prefill_ms"],
                      "peak_gpu_gib": round(torch.cuda.max_memory_allocated() / GIB, 3)}
        cache = llm.new_cache(1, len(ids) + 1)
        llm.method.reset()
        out[label]["first_logits"] = llm.prefill(cache, 0, ids)[-1].float().cpu()
        del cache, llm
        torch.cuda.empty_cache()

    def compare(a_label, b_label) -> dict:
        a, b = out[a_label], out[b_label]
        if "tokens" not in a or "tokens" not in b:
            return {"status": "skipped"}
        la, lb = a["first_logits"], b["first_logits"]
        return {"tokens_equal": a["tokens"] == b["tokens"],
                "first_mismatch": next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None),
                "first_logits_rel_diff": float((la - lb).norm() / la.norm())}

    out["chunked_vs_unchunked"] = compare("offload_chunked", "offload_unchunked")  # the criterion
    out["offload_vs_device"] = compare("offload_unchunked", "device_unchunked")
    out["tokens_equal"] = out["chunked_vs_unchunked"].get("tokens_equal")
    out["weights_gib"] = round(weight_bytes(model) / GIB, 3)
    for v in out.values():
        if isinstance(v, dict):
            v.pop("first_logits", None)
    del model
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--lengths", default="32768,65536,131072")
    ap.add_argument("--models", default="minicpm-8b,llama-8b")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--skip-parity", action="store_true")
    ap.add_argument("--keep", type=float, default=None,
                    help="block-sparse points attend over synthetic masks whose neighbouring tokens keep this "
                         "fraction of their top-k (the selection kernels still run); default: the kernels' masks")
    ap.add_argument("--topk-search", default=None,
                    help="comma-separated top-k searches of the prefill selection kernel (bisect, bracket): "
                         "each block-sparse point runs once per search; default: the kernel's default")
    ap.add_argument("--query-stages", default=None,
                    help="comma-separated pipeline depths of the query-based selector's scoring launch: each "
                         "sparse / sparse-offload point runs once per depth; default: the kernel's default")
    ap.add_argument("--profile", action="store_true",
                    help="after each warm point, one more prefill under torch.profiler: GPU busy and idle ms, "
                         "synchronising and allocating runtime calls, the kernels with the most time")
    args = ap.parse_args()
    if args.keep is not None and not 0.0 <= args.keep <= 1.0:
        ap.error(f"--keep must lie in [0, 1], got {args.keep}")
    searches = args.topk_search.split(",") if args.topk_search else [None]
    if not set(searches) <= {None, "bisect", "bracket"}:
        ap.error(f"--topk-search takes bisect and/or bracket, got {args.topk_search!r}")  # exit 2
    try:
        stages = [int(x) for x in args.query_stages.split(",")] if args.query_stages else [None]
    except ValueError:
        stages = [0]
    if not all(x is None or 1 <= x <= 4 for x in stages):
        ap.error(f"--query-stages takes integers from 1 to 4, got {args.query_stages!r}")  # exit 2
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        ap.error(f"unknown --methods {sorted(unknown)}; choose from {', '.join(METHODS)}")  # exit 2
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the CPU runtime's prefill is covered by tests/test_chunked_prefill.py)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    lengths = [int(x) for x in args.lengths.split(",")]
    report = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
              "torch": torch.__version__, "budget_s": args.budget_s, "chunk_tokens": args.chunk,
              "keep": args.keep, "points": []}

    def save():
        tmp = out_dir / "prefill_gpu.json.tmp"
        tmp.write_text(json.dumps(report, indent=1, default=str))
        os.replace(tmp, out_dir / "prefill_gpu.json")

    try:
        report["kernel_check"] = kernel_check()
    except Exception as exc:  # fail soft: record and go on
        report["kernel_check"] = {"status": "error", "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
    save()
    parity_s = 0 if args.skip_parity else 120  # kept for the parity run at the end
    for name in args.models.split(","):
        if time.perf_counter() > deadline - parity_s - 30:
            report["points"].append({"model": name, "status": "skipped (time budget)"})
            continue
        try:
            model = build_model(name, "cuda", torch.bfloat16, max_positions=max(lengths) + 256)
            forecast, weights = random_forecast(model), weight_bytes(model)
        except Exception as exc:
            report["points"].append({"model": name, "status": "error", "error": repr(exc)})
            continue
        for length in lengths:
            for label, search, stage in [(lab, s, st) for lab in args.methods.split(",")
                                         for s in ([None] if lab == "dense" else searches)
                                         for st in (stages if lab.startswith("sparse") else [None])]:
                rec = {"model": name, "length": length, "method": label}
                if search is not None:
                    rec["topk_search"] = search
                if stage is not None:
                    rec["query_num_stages"] = stage
                if time.perf_counter() > deadline - parity_s:
                    rec["status"] = "skipped (time budget)"
                else:
                    try:
                        with selection_options(search, stage):
                            rec.update(run_point(model, forecast, weights, label, length, args.chunk,
                                                 deadline - parity_s, keep=args.keep, profile=args.profile))
                        rec["status"] = "ok"
                    except Exception as exc:  # OOM or a bug: record, free, go on
                        rec.update(status="error", error=repr(exc)[:500], trace=traceback.format_exc()[-1500:])
                    torch.cuda.empty_cache()
                report["points"].append(rec)
                print(f"[{time.perf_counter() - t0:5.0f} s]", {k: v for k, v in rec.items() if k not in ("trace", "profile")},
                      flush=True)
                save()
        del model, forecast
        torch.cuda.empty_cache()
    if not args.skip_parity:
        try:
            report["parity"] = parity(deadline, args.chunk)
        except Exception as exc:
            report["parity"] = {"status": "error", "error": repr(exc), "trace": traceback.format_exc()[-2000:]}
        print("parity", {k: v for k, v in report["parity"].items() if k not in ("trace",)}, flush=True)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    save()
    print(f"\n{'model':11} {'len':>7} {'method':19} {'TTFT s':>7} {'tok/s':>9} {'sel ms/L':>9} {'attn ms/L':>9} "
          f"{'peak GiB':>8} {'-weights':>8}")
    for r in report["points"]:
        label = (r.get("method", "") + (f"/{r['topk_search']}" if r.get("topk_search") else "")
                 + (f"/s{r['query_num_stages']}" if r.get("query_num_stages") else ""))
        if r.get("status") != "ok":
            print(f"{r.get('model', ''):11} {r.get('length', ''):>7} {label:19} {r['status']}")
            continue
        print(f"{r['model']:11} {r['length']:>7} {label:19} {r['ttft_s']:>7.2f} {r['prefill_tok_s']:>9.0f} "
              f"{r['select_ms_per_layer'] or 0:>9.2f} {r['attention_ms_per_layer'] or 0:>9.2f} "
              f"{r['peak_gpu_gib']:>8.2f} {r['peak_minus_weights_gib']:>8.2f}")


if __name__ == "__main__":
    main()
