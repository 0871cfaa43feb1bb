"""``sparda eval`` runner: resumable, atomic, identical to an uninterrupted run (design §8)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from sparda.cli import main
from sparda.engine.llm import LLM
from sparda.eval.runner import EvalPlan, load_results, run_eval

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: thread hand-offs dominate on 2 cores

VOLATILE = {"prefill_ms", "decode_tok_s", "seconds", "batch", "prefill_batch", "cache_alloc_ms", "graph_capture_ms"}  # timings; the batch a record ran in


TEXT = ("It was a fine morning in Highbury. Emma walked to the village and met Harriet.\n" * 30 +
        "Mr. Knightley called upon them, and they spoke of the weather and of Frank Churchill.\n" * 30)


def _plan(model_dir, out, batch_size=2):
    text = out.parent / "haystack.txt"
    text.write_text(TEXT)
    return EvalPlan(text=str(text), tasks=("passkey", "niah-single", "ppl"), methods=("dense", "sparse"), lengths=(400,),
                    samples=2, ppl_windows=1, out=str(out), model=str(model_dir), device="cpu",
                    depths=(0.3, 0.8), overrides=dict(dense_len=0, topk_blocks=1, local_blocks=2,
                                                      block_size=32), batch_size=batch_size)


def _counting(monkeypatch):
    calls = {"generate": 0, "logits": 0}
    from sparda.engine.runner import ModelRunner

    generate, logits = LLM.generate, ModelRunner.logits

    def counted_generate(self, *a, **k):
        calls["generate"] += 1
        return generate(self, *a, **k)

    def counted_logits(self, *a, **k):
        calls["logits"] += 1
        return logits(self, *a, **k)

    monkeypatch.setattr(LLM, "generate", counted_generate)
    monkeypatch.setattr(ModelRunner, "logits", counted_logits)
    return calls


def _stable(records):
    return sorted(({k: v for k, v in r.items() if k not in VOLATILE} for r in records), key=lambda r: r["key"])


def test_interrupted_run_resumes_without_recomputing(make_tiny, tmp_path, monkeypatch):
    model_dir = make_tiny("llama")
    calls = _counting(monkeypatch)
    # 2 tasks x 2 methods = 4 generate calls of 2 samples each, + ppl: 2 records from 2 prefills (dense ref + sparse)
    full = run_eval(_plan(model_dir, tmp_path / "full"), progress=False)
    assert calls == {"generate": 4, "logits": 2}
    assert set(full) == {"dense", "sparse"} and set(full["dense"]) == {"passkey", "niah-single"}
    ppl = {r["label"]: r for r in load_results(tmp_path / "full" / "results.jsonl") if r["task"] == "ppl"}
    _check_ppl_against_transformers(model_dir, tmp_path / "full", ppl)

    calls.update(generate=0, logits=0)
    out = tmp_path / "resumed"
    run_eval(_plan(model_dir, out), max_new_items=3, progress=False)  # "killed" after 3 samples
    assert calls == {"generate": 2, "logits": 0}  # dense's batch of 2 passkeys, then sparse's
    first = load_results(out / "results.jsonl")
    assert len(first) == 3
    with open(out / "results.jsonl", "a") as handle:  # a torn line, as if killed mid-write
        handle.write('{"key": "dense|passk')

    calls.update(generate=0, logits=0)
    assert json.loads((out / "progress.json").read_text())["complete"] is False
    resumed = run_eval(_plan(model_dir, out, batch_size=3), progress=False)  # another batch size resumes too
    assert calls == {"generate": 3, "logits": 2}  # nothing finished was recomputed: sparse's 2nd passkey, 2 niah batches
    records = load_results(out / "results.jsonl")
    assert len(records) == 10 and len({r["key"] for r in records}) == 10
    assert _stable(records) == _stable(load_results(tmp_path / "full" / "results.jsonl"))
    assert resumed == full
    summary = json.loads((out / "summary.json").read_text())
    assert summary == full
    assert (out / "report.md").read_text().count("| sparse |") >= 2
    assert (out / "accuracy_vs_length.png").stat().st_size > 1000
    # a second rerun does nothing at all
    calls.update(generate=0, logits=0)
    run_eval(_plan(model_dir, out), progress=False)
    assert calls == {"generate": 0, "logits": 0}


def _check_ppl_against_transformers(model_dir, out, ppl):
    """The ppl records against an independent reference: transformers' own model (float64)
    for dense, and KL / top-1 agreement / perplexity recomputed in float64 from it and the
    `sparse` method's block-sparse prefill logits, on the window the runner scores."""
    import math
    import random

    from transformers import AutoModelForCausalLM

    plan = _plan(model_dir, out)
    llm = LLM(str(model_dir), method="sparse", device="cpu", sparse_prefill=True, **plan.overrides)
    text_ids = llm.tokenizer.encode((out.parent / "haystack.txt").read_text(), add_special_tokens=False)
    length = plan.lengths[0]
    offset = random.Random(f"ppl-{plan.seed * 1_000_003}-{length}").randint(0, len(text_ids) - length - 1)
    ids = text_ids[offset:offset + length + 1]
    first = length // 2
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        dense = torch.log_softmax(hf(torch.tensor([ids[:-1]])).logits[0, first:].double(), -1)
    sparse = torch.log_softmax(llm.logits(ids[:-1])[first:].double(), -1)
    targets = torch.tensor(ids[first + 1:])
    n = len(targets)
    nll = lambda lp: -float(lp.gather(-1, targets.view(-1, 1)).sum())
    for label in ("dense", "sparse"):
        assert ppl[label]["positions"] == n == length - first
        assert ppl[label]["dense_ppl"] == pytest.approx(math.exp(nll(dense) / n), rel=1e-4)
    assert ppl["sparse"]["ppl"] == pytest.approx(math.exp(nll(sparse) / n), rel=1e-4)
    assert ppl["sparse"]["kl"] == pytest.approx(float((dense.exp() * (dense - sparse)).sum()) / n, rel=1e-3, abs=1e-6)
    agree = float((dense.argmax(-1) == sparse.argmax(-1)).double().mean())
    assert ppl["sparse"]["top1_agreement"] == pytest.approx(agree, abs=1.5 / n)
    assert ppl["sparse"]["kl"] > 1e-3 and ppl["sparse"]["prefill"] == "block-sparse"  # 4 of 13 blocks


def test_changed_plan_in_same_dir_is_refused(make_tiny, tmp_path):
    plan = _plan(make_tiny("llama"), tmp_path)
    run_eval(plan, max_new_items=1, progress=False)
    plan.seed = 5
    with pytest.raises(Exception, match="different plan"):
        run_eval(plan, progress=False)


def test_new_forecast_weights_or_dense_heads_refuse_the_old_dir(make_tiny, tmp_path, monkeypatch):
    """A run directory made with other Forecast weights or another dense-heads calibration
    is refused (no silent mix of old and new samples on resume)."""
    import shutil

    from sparda.attention import forecast as forecast_mod
    from sparda.attention.dense_heads import CALIBRATION_FILE

    model = tmp_path / "model"
    shutil.copytree(make_tiny("llama"), model)
    plan = _plan(model, tmp_path / "run")
    assert plan.asset_digests() == {}  # a model without either: the fingerprint of older directories
    run_eval(plan, max_new_items=1, progress=False)
    (model / CALIBRATION_FILE).write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": [[1, 0]]}))
    assert set(plan.asset_digests()) == {"dense_heads"}
    with pytest.raises(Exception, match="different plan"):
        run_eval(plan, progress=False)
    weights = tmp_path / "f.safetensors"
    weights.write_bytes(b"one")
    monkeypatch.setattr(forecast_mod, "shipped_path", lambda name: weights)
    first = plan.fingerprint()
    weights.write_bytes(b"two, retrained")
    assert plan.asset_digests()["forecast"] != "" and plan.fingerprint() != first


def test_eval_methods_get_the_dense_heads_of_llm(make_tiny, tmp_path):
    """Every evaluated method resolves ``dense_heads`` as ``LLM(model, method=...)`` does
    (design §3.7): the model's calibration under ``auto``, none under ``none``."""
    import shutil

    from sparda.attention.dense_heads import CALIBRATION_FILE
    from sparda.eval.runner import MethodSpec, _Models

    model = tmp_path / "model"
    shutil.copytree(make_tiny("llama"), model)
    (model / CALIBRATION_FILE).write_text(json.dumps({"format": "sparda-dense-heads-v1", "heads": [[1, 0]]}))
    plan = _plan(model, tmp_path / "run")
    plan.methods = ("dense", "sparse", "oracle")
    models = _Models(plan)
    for method in ("sparse", "oracle"):
        want = LLM(str(model), method=method, device="cpu", **plan.overrides).config.dense_heads
        assert want == ((1, 0),)
        assert models.get(MethodSpec(method), 400)[0].config.dense_heads == want, method
    assert models.get(MethodSpec("dense"), 400)[0].config.dense_heads == ()
    none = dataclasses.replace(plan, dense_heads="none")
    assert _Models(none).get(MethodSpec("sparse"), 400)[0].config.dense_heads == ()
    assert none.fingerprint() != plan.fingerprint()


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["eval", "--methods", "dense,bogus", "--out", str(tmp_path), "--quick"])
    assert result.exit_code == 2
    assert "unknown method(s) bogus" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["eval", "--tasks", "passkey,nope", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown task(s) nope" in result.output


def test_selection_task_reports_recall(make_tiny, tmp_path):
    """The selection records are the report's numbers for the same model, text and length
    (the report itself is checked against a float64 brute force in test_selection_report)."""
    from sparda.eval.selection import selection_report

    plan = _plan(make_tiny("llama"), tmp_path / "sel")
    plan.tasks, plan.methods = ("selection",), ("dense", "sparse", "oracle")
    run_eval(plan, progress=False)
    sel = {r["label"]: r for r in load_results(tmp_path / "sel" / "results.jsonl")}
    assert sel["dense"]["score"] is None
    llm = LLM(plan.model, method="dense", device="cpu", **plan.overrides)
    direct = selection_report(llm=llm, text=plan.text, methods=["oracle", "sparse"], lengths=plan.lengths,
                              queries=16)
    for name in ("sparse", "oracle"):
        for key in ("recall_vs_sparse", "recall_vs_oracle", "mass"):
            assert sel[name][key] == direct[name][f"mean_{key}"]
        assert sel[name]["score"] == direct[name]["mean_recall_vs_oracle"]
    assert sel["sparse"]["recall_vs_oracle"] < 1  # the two top-k differ on this model
    assert "Selection quality" in (tmp_path / "sel" / "report.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--budgets", "150"], "--budgets are percentages in (0, 100], got 150"),
    (["--text", "/no/such/text.txt"], "cannot read --text /no/such/text.txt: no such file or directory"),
    (["--samples", "0"], "--samples >= 1"),
])
def test_late_errors_write_nothing(tmp_path, args, message):
    out = tmp_path / "never"
    result = CliRunner().invoke(main, ["eval", "--quick", "--out", str(out), *args])
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_prefill_mode_of_the_plan(make_tiny, tmp_path):
    """Generation tasks prefill as the plan says (default at the small preset: dense);
    ppl always scores block-sparse prefill logits."""
    from sparda.eval.runner import MethodSpec, _Models

    plan = _plan(make_tiny("llama"), tmp_path / "dp")
    ids = torch.randint(0, 1000, (300,)).tolist()
    for sparse_prefill in (None, False, True):
        plan.sparse_prefill = sparse_prefill
        models = _Models(plan)
        sparse, _, _ = models.get(MethodSpec("sparse"), 300)
        got, want = sparse.logits(ids), models.base.logits(ids)
        assert torch.allclose(got, want, atol=1e-5) == (sparse_prefill is not True)
        ppl_llm, _, _ = models.get(MethodSpec("sparse"), 300, sparse_prefill=True)
        assert not torch.allclose(ppl_llm.logits(ids), want, atol=1e-5)


def test_prefill_options_and_fingerprints(tmp_path):
    from sparda.eval.runner import PPL, plan_from_options

    default = plan_from_options(quick=True, out=str(tmp_path / "q"))
    dense = plan_from_options(quick=True, sparse_prefill=False, out=str(tmp_path / "q"))
    sparse = plan_from_options(quick=True, sparse_prefill=True, out=str(tmp_path / "q"))
    assert PPL in default.tasks and PPL in dense.tasks
    assert not default.prefill_is_sparse and sparse.prefill_is_sparse
    assert default.fingerprint() == dense.fingerprint() != sparse.fingerprint()
    assert plan_from_options(quick=True, preset="paper", out=str(tmp_path / "q")).prefill_is_sparse
    result = CliRunner().invoke(main, ["eval", "--quick", "--dense-prefill", "--sparse-prefill", "--methods",
                                       "bogus", "--out", str(tmp_path / "never")])
    assert result.exit_code == 2 and "bogus" in result.output  # both flags parse (the last one wins)


def _brute_slot_hits(fetches):
    """Hits and misses of the offload slot cache (design §6), replayed with Python sets and
    lists from the block masks each decode fetch received: a selected block other than the
    current one is a hit iff a slot holds it; the k-th miss (ascending id) takes the k-th
    free slot, then the k-th slot whose block is no longer selected (slot order). Also the
    step-to-step overlap (blocks selected at t and at t-1), a lower bound of the hits."""
    slots, last, hits, misses, overlap = {}, {}, 0, 0, 0
    for layer, num_slots, block_size, mask, pos in fetches:
        for row in range(mask.shape[0]):
            cur = int(pos[row]) // block_size
            for head in range(mask.shape[1]):
                key = (layer, row, head)
                held = slots.setdefault(key, [-1] * num_slots)
                want = {b for b in mask[row, head].nonzero().flatten().tolist() if b != cur}
                hits += len(want & set(held))
                overlap += len(want & last.get(key, set()))
                miss = sorted(want - set(held))
                misses += len(miss)
                free = [i for i, b in enumerate(held) if b < 0] + [i for i, b in enumerate(held) if b >= 0 and b not in want]
                for block, i in zip(miss, free):
                    held[i] = block
                last[key] = want
    return hits, misses, overlap


def _recording_fetches(monkeypatch):
    from sparda.cache.offload import OffloadKVCache
    from sparda.kernels import twins

    fetches, fetch = [], OffloadKVCache.fetch

    def spy(self, layer, selection, pos, prefetch=False, counters=None):
        if layer not in self.resident:  # block ids (or a mask) -> the mask of the selected blocks
            mask = selection if selection.dtype == torch.bool else twins.ids_to_block_mask(selection, self.num_blocks)
            fetches.append((layer, self.slots, self.block_size, mask.clone(), pos.clone()))
        return fetch(self, layer, selection, pos, prefetch, counters)

    monkeypatch.setattr(OffloadKVCache, "fetch", spy)
    return fetches


def test_offloaded_hit_rate_is_the_runtime_count(make_tiny, tmp_path, monkeypatch):
    """sparse-offload through `sparda eval` and sparda offloaded through the API: the hit rate
    is measured (not None) and equals a replay of the slot cache from the fetched masks."""
    from sparda.attention.forecast import Forecast, model_identity, save_forecast
    from sparda.eval.metrics import runtime_hit_rate
    from sparda.eval.records import task_records
    from sparda.eval.runner import MethodSpec, _Models
    from sparda.eval.tasks import make_sample

    plan = _plan(make_tiny("llama"), tmp_path / "hit")
    plan.overrides = dict(dense_len=0, topk_blocks=2, local_blocks=2, block_size=16, kernel_size=8, kernel_stride=4)
    models = _Models(plan)
    sample = make_sample("passkey", models.base.tokenizer, TEXT, 400, 0.5, 0)
    sample = dataclasses.replace(sample, max_new_tokens=12)
    fetches = _recording_fetches(monkeypatch)
    record, = task_records(models, MethodSpec("sparse-offload"), [(0, 0, sample)], 400)
    hits, misses, overlap = _brute_slot_hits(fetches)
    assert fetches and record["offload"] and record["hit_rate"] is not None and record["hit_rate_source"] == "runtime"
    assert record["hit_rate"] == pytest.approx(hits / (hits + misses), abs=1e-12)
    assert hits >= overlap > 0 and misses > 0
    assert models.get(MethodSpec("sparse-offload"), 400)[1] is None  # no select() wrapper: decode bypasses it

    llm = LLM(plan.model, method="dense", device="cpu", **plan.overrides)
    path = tmp_path / "f.safetensors"
    save_forecast(Forecast.for_shape(llm.shape), path, model_identity(llm.model.config, llm.shape),
                  dtype=torch.float32)
    llm = LLM(plan.model, method="sparda", forecast=str(path), offload=True, device="cpu", **plan.overrides)
    fetches.clear()
    out = llm.generate([sample.prompt], max_new_tokens=12, ignore_eos=True)[0]
    hits, misses, overlap = _brute_slot_hits(fetches)
    assert out.stats["offload"]["hits"] == hits and out.stats["offload"]["misses"] == misses
    assert runtime_hit_rate(out.stats["offload"]) == pytest.approx(hits / (hits + misses), abs=1e-12)
    assert hits >= overlap > 0


def test_batched_eval_equals_unbatched(make_tiny, tmp_path):
    """Batches of prompts of different lengths (and of tasks with different answer budgets),
    prefilled in one forward, give each sample the record it gets alone: same completion
    and score, same step-to-step hit rate over its own decode steps; ppl within 1e-5
    (greedy, fp32)."""
    plan = _plan(make_tiny("llama"), tmp_path / "one", batch_size=1)
    plan.tasks = ("passkey", "niah-multikey", "ppl")
    plan.methods = ("dense", "sparse", "sparda-random")
    plan.samples, plan.depths = 4, (0.0, 0.3, 0.6, 1.0)
    single = {r["key"]: r for r in (run_eval(plan, progress=False), load_results(tmp_path / "one" / "results.jsonl"))[1]}
    plan.out, plan.batch_size = str(tmp_path / "three"), 3  # batches of 3, then 1
    batched = {r["key"]: r for r in (run_eval(plan, progress=False), load_results(tmp_path / "three" / "results.jsonl"))[1]}
    assert single.keys() == batched.keys() and len(single) == 2 * 4 * 3 + 3
    assert {r["batch"] for r in batched.values() if r["task"] != "ppl"} == {3, 1}
    # every method here prefills a batch in one forward (design §3.8)
    assert {r["prefill_batch"] for r in batched.values() if r["task"] != "ppl"} == {3, 1}
    assert {r["prefill_batch"] for r in single.values() if r["task"] != "ppl"} == {1}
    lengths = {r["prompt_tokens"] for r in batched.values() if r["task"] == "passkey"}
    assert len(lengths) > 1  # the batch really mixes prompt lengths
    hit_rates = 0
    for key, one in single.items():
        many = batched[key]
        if one["task"] == "ppl":
            for field in ("ppl", "dense_ppl", "kl", "top1_agreement"):
                assert many[field] == pytest.approx(one[field], rel=1e-5, abs=1e-12), (key, field)
            continue
        assert many["completion"] == one["completion"] and many["score"] == one["score"], key
        assert many["new_tokens"] == one["new_tokens"], key
        if one["method"] == "dense":
            assert one["hit_rate"] is None and many["hit_rate"] is None
        else:
            assert one["hit_rate_source"] == many["hit_rate_source"] == "overlap"
            assert many["hit_rate"] == pytest.approx(one["hit_rate"], abs=1e-12), key
            hit_rates += 0 < one["hit_rate"] < 1
    assert hit_rates > 0  # a hit rate that means something was compared


def test_time_budget_stops_between_batches_and_resumes(make_tiny, tmp_path, monkeypatch):
    from sparda.eval import runner

    model_dir = make_tiny("llama")
    full = run_eval(_plan(model_dir, tmp_path / "full"), progress=False)
    out = tmp_path / "budget"
    ticks = iter(range(10**6))
    monkeypatch.setattr(runner, "_now", lambda: float(next(ticks)))  # 1 s per clock read
    assert run_eval(_plan(model_dir, out), time_budget_s=0.5, progress=False) == {}  # spent before any batch
    assert not out.exists()
    ticks = iter(range(10**6))
    # reads: start 0, check 1 (1 + 0 <= 4.5: run), unit start 2, end 3 (took 1 s), check 4 (4 + 1 > 4.5: stop)
    run_eval(_plan(model_dir, out), time_budget_s=4.5, progress=False)
    monkeypatch.undo()
    progress = json.loads((out / "progress.json").read_text())
    assert progress == {**progress, "planned": 10, "done": 2, "complete": False, "stopped": "time budget"}
    assert len(load_results(out / "results.jsonl")) == 2
    assert run_eval(_plan(model_dir, out), progress=False) == full
    assert json.loads((out / "progress.json").read_text())["complete"] is True
    assert _stable(load_results(out / "results.jsonl")) == _stable(load_results(tmp_path / "full" / "results.jsonl"))


def test_prefill_tokens_that_fit_bounds_the_batched_prefill(monkeypatch, make_tiny, tmp_path):
    """The eval's batched prefill takes at most a quarter of the free CUDA memory: bytes per
    token from the model's widths, unbounded off CUDA (a fake CUDA model, fake free memory);
    the eval raises ``prefill_batch_tokens`` to its batch's padded tokens, not past that
    bound, nor below the default."""
    from types import SimpleNamespace

    from sparda.config import DEFAULT_PREFILL_BATCH_TOKENS
    from sparda.eval import runner
    from sparda.eval.runner import _Models

    plan = dataclasses.replace(_plan(make_tiny("llama"), tmp_path / "run"), batch_size=100)
    wanted = 100 * (400 + 256)  # batch x (longest length + the prompt slack)
    for fit, want in ((1 << 62, wanted), (20_000, 20_000), (1_000, DEFAULT_PREFILL_BATCH_TOKENS)):
        monkeypatch.setattr(runner, "prefill_tokens_that_fit", lambda llm, fit=fit: fit)
        assert _Models(plan).base.config.runtime.prefill_batch_tokens == want, fit
    monkeypatch.undo()

    import torch

    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336)
    llm = SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, model=SimpleNamespace(config=cfg))
    free = int(torch.randint(1, 80, ())) << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    per_token = 2 * (8 * 4096 + 3 * 14336)  # bf16: residual, norms, q/k/v/o, gate/up/act
    assert runner.prefill_tokens_that_fit(llm) == free // 4 // per_token, free
    assert runner.prefill_tokens_that_fit(SimpleNamespace(device=torch.device("cpu"))) >= 1 << 40
