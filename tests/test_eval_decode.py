"""``ppl-decode``: held-out windows fed token by token through the decode path and compared
with dense (design §8), against independent references: transformers' own model in
float64 and an unbatched loop of ``LLM.decode`` calls; the KV dtype's cost (the reference
stays unquantised); the plan's checks and fingerprint."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sparda.engine.llm import LLM
from sparda.errors import SpardaError
from sparda.eval.runner import DECODE_TOKENS, EvalPlan, load_results, run_eval

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs dominate on 2 cores

TEXT = ("It was a fine morning in Highbury. Emma walked to the village and met Harriet.\n" * 30 +
        "Mr. Knightley called upon them, and they spoke of the weather and of Frank Churchill.\n" * 30)
#: sparse selection that acts from the first decode step: 1 + 2 + 1 of 13 blocks at 400 tokens
OVERRIDES = dict(dense_len=0, topk_blocks=1, local_blocks=2, block_size=32)
LENGTH, DECODE = 400, 24


def _plan(model_dir, out, **extra):
    text = out.parent / "haystack.txt"
    text.write_text(TEXT)
    fields = dict(text=str(text), tasks=("ppl-decode",), methods=("dense", "sparse"), lengths=(LENGTH,), samples=1,
                  ppl_windows=3, out=str(out), model=str(model_dir), device="cpu", overrides=OVERRIDES,
                  batch_size=2, decode_tokens=DECODE)
    return EvalPlan(**{**fields, **extra})


def _window(llm, plan, index):
    """Window ``index`` of the plan, drawn here as the runner's docs say (seeded offset)."""
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    seed = plan.seed * 1_000_003 + index
    offset = random.Random(f"ppl-{seed}-{LENGTH}").randint(0, len(ids) - LENGTH - 1)
    return ids[offset:offset + LENGTH + 1]


def _unbatched_decode_logits(llm, ids, prefix):
    """``[D, V]`` logits of one window fed through ``LLM.decode`` one call per token."""
    cache = llm.new_cache(1, LENGTH)
    llm.method.reset()
    llm.prefill(cache, 0, ids[:prefix])
    return torch.cat([llm.decode(cache, torch.tensor([ids[p]]), torch.tensor([p])) for p in range(prefix, LENGTH)])


def _metrics(logp, ref, targets):
    """KL(ref || logp), top-1 agreement, perplexity and reference perplexity, float64."""
    n = len(targets)
    nll = lambda lp: -float(lp.gather(-1, targets.view(-1, 1)).sum()) / n
    return dict(kl=float((ref.exp() * (ref - logp)).sum()) / n,
                top1_agreement=float((logp.argmax(-1) == ref.argmax(-1)).double().mean()),
                ppl=math.exp(nll(logp)), dense_ppl=math.exp(nll(ref)))


def test_ppl_decode_against_transformers_and_unbatched_decode(make_tiny, tmp_path):
    """dense's decode logits equal transformers' float64 forward (KL ~ 0); sparse's records
    equal the metrics recomputed from an unbatched LLM.decode loop against that forward
    (windows 0-1 ran as one batch, 2 alone); sparsity shows (KL > 1e-3)."""
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny("llama")
    plan = _plan(model_dir, tmp_path / "run")
    run_eval(plan, progress=False)
    records = {(r["label"], r["sample"]): r for r in load_results(tmp_path / "run" / "results.jsonl")}
    assert len(records) == 6 and {r["batch"] for r in records.values()} == {2, 1}
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    sparse = LLM(str(model_dir), method="sparse", device="cpu", **OVERRIDES)
    prefix = LENGTH - DECODE
    for index in range(3):
        ids = _window(sparse, plan, index)
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0, prefix:], -1)
        targets = torch.tensor(ids[prefix + 1:])
        dense = records[("dense", index)]
        assert dense["positions"] == DECODE and dense["prefix"] == prefix and dense["kv_dtype"] == "bf16"
        assert dense["kl"] < 1e-6 and dense["top1_agreement"] == 1.0
        assert dense["ppl"] == pytest.approx(math.exp(-float(ref.gather(-1, targets.view(-1, 1)).mean())), rel=1e-4)
        got = records[("sparse", index)]
        want = _metrics(torch.log_softmax(_unbatched_decode_logits(sparse, ids, prefix).double(), -1), ref, targets)
        assert got["kl"] == pytest.approx(want["kl"], rel=1e-3, abs=1e-7)
        assert got["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=1.5 / DECODE)
        for key in ("ppl", "dense_ppl"):
            assert got[key] == pytest.approx(want[key], rel=1e-4)
        assert got["kl"] > 1e-3 and got["prefill"] == "dense"  # small preset: dense prefill, selection in decode
    report = (tmp_path / "run" / "report.md").read_text()
    assert "Decode-time perplexity" in report and "Accuracy per task" not in report  # not a generation task


def test_ppl_decode_measures_the_kv_dtype_against_an_unquantised_reference(make_tiny, tmp_path):
    """The reference is dense over an unquantised cache under every kv_dtype (dense_ppl equal
    across dtypes), so dense's own KL is the quantisation's: > 0 at int8, small, and below
    int4's; the offloaded cache (sparse-offload) gives on-device sparse's numbers; ppl's
    reference is unquantised too."""
    model_dir = make_tiny("llama")
    runs = {}
    for kv in ("bf16", "int8", "int4"):
        plan = _plan(model_dir, tmp_path / kv, kv_dtype=kv, tasks=("ppl-decode", "ppl"), ppl_windows=2,
                     methods=("dense", "sparse", "sparse-offload"))
        run_eval(plan, progress=False)
        runs[kv] = {(r["task"], r["label"], r["sample"]): r for r in load_results(tmp_path / kv / "results.jsonl")}
    for task in ("ppl-decode", "ppl"):
        for index in range(2):
            dense = {kv: runs[kv][(task, "dense", index)] for kv in runs}
            assert dense["int8"]["dense_ppl"] == dense["int4"]["dense_ppl"] == dense["bf16"]["dense_ppl"]
            assert dense["bf16"]["kl"] < 1e-9
            assert 1e-8 < dense["int8"]["kl"] < 1e-3 and dense["int8"]["top1_agreement"] > 0.8
            assert dense["int4"]["kl"] > 10 * dense["int8"]["kl"]
            for kv in runs:
                on_device, offloaded = runs[kv][(task, "sparse", index)], runs[kv][(task, "sparse-offload", index)]
                assert offloaded["kl"] == pytest.approx(on_device["kl"], rel=1e-4, abs=1e-8)
    assert all(r["kv_dtype"] == "int8" for k, r in runs["int8"].items() if k[0] == "ppl-decode")
    assert {r["offload"] for k, r in runs["int8"].items() if k[0] == "ppl-decode" and k[1] == "sparse-offload"} == {True}


def test_ppl_decode_in_bf16_is_within_bf16_tolerance(make_tiny, tmp_path):
    """A bf16 model: dense's decode path against its own full forward (the reference runs in
    the model dtype) agrees within bf16 rounding (on the CPU often exactly), and that
    reference's perplexity is fp32's within bf16 tolerance but not equal to it (it ran in
    bf16); fp32 agrees to rounding."""
    model_dir = make_tiny("llama")
    runs = {}
    for dtype in ("float32", "bfloat16"):
        run_eval(_plan(model_dir, tmp_path / dtype, dtype=dtype, methods=("dense",), ppl_windows=2), progress=False)
        runs[dtype] = {r["sample"]: r for r in load_results(tmp_path / dtype / "results.jsonl")}
    for index in range(2):
        fp32, bf16 = runs["float32"][index], runs["bfloat16"][index]
        assert fp32["kl"] < 1e-9 and bf16["kl"] < 1e-3 and bf16["top1_agreement"] >= 0.9
        assert bf16["dense_ppl"] != fp32["dense_ppl"]
        assert abs(math.log(bf16["dense_ppl"] / fp32["dense_ppl"])) < 0.02


def test_decode_tokens_checks_and_fingerprint(make_tiny, tmp_path):
    """decode_tokens is in the fingerprint unless default (older run directories keep theirs);
    a value that leaves no prefix fails before anything is written."""
    model_dir = make_tiny("llama")
    plan = _plan(model_dir, tmp_path / "x", decode_tokens=DECODE_TOKENS)
    fields = {k: v for k, v in vars(plan).items() if k != "decode_tokens"}
    assert EvalPlan(**fields).fingerprint() == plan.fingerprint()
    assert _plan(model_dir, tmp_path / "x", decode_tokens=DECODE_TOKENS + 1).fingerprint() != plan.fingerprint()
    for bad in (0, LENGTH):
        with pytest.raises(SpardaError, match="--decode-tokens must be"):
            run_eval(_plan(model_dir, tmp_path / "bad", decode_tokens=bad), progress=False)
    assert not (tmp_path / "bad").exists()
