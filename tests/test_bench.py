"""`sparda bench`: quick sweep records, OOM handling, roofline arithmetic, trace round trip."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from sparda.bench import point as pt
from sparda.bench import sweep
from sparda.bench.models import build_model, random_forecast, selection_config
from sparda.bench.roofline import kv_read_bytes, roofline_ms
from sparda.bench.traces import (SelectionTrace, load_traces, record_selection, replay_masks, reuse_stats,
                                 save_traces)
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.model.llama import ModelShape


def _synthetic_trace(seed: int, steps=12, rows=2, layers=3, heads=2, pos0=1100) -> SelectionTrace:
    """A trace with forced blocks and a slowly changing random top-k (block size 64,
    init 1, local 2, topk 4)."""
    g = np.random.default_rng(seed)
    ids = np.full((steps, rows, layers, heads, 7), -1, dtype=np.int16)
    pos = np.repeat((pos0 + np.arange(steps))[:, None], rows, 1)
    for r in range(rows):
        for l in range(layers):
            for h in range(heads):
                top = list(g.choice(np.arange(1, 16), 4, replace=False))
                for s in range(steps):
                    if g.random() < 0.3:  # replace one top-k block
                        free = [b for b in range(1, 16) if b not in top]
                        top[g.integers(4)] = g.choice(free)
                    cur = pos[s, r] // 64
                    ids[s, r, l, h] = sorted([0, cur - 1, cur] + top)
    return SelectionTrace(ids, pos, dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4))


def test_quick_sweep_writes_valid_records(tmp_path):
    trace = tmp_path / "t.npz"
    save_traces(trace, {"sparse": _synthetic_trace(1), "sparda": _synthetic_trace(2)})
    cfg = sweep.quick_config(str(tmp_path / "out"), contexts=[1024], batches=[1, 2], decode_steps=1,
                             repeats=2, breakdown_steps=1, prefill_tokens=384, trace=str(trace))
    records = sweep.run_sweep(cfg, log=lambda _: None)
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert stored == json.loads(json.dumps(records, default=str))
    assert len(stored) == len(sweep.SWEEP_METHODS) * 2
    for rec in stored:
        assert all(k in rec for k in sweep.REQUIRED_KEYS), rec
        assert rec["status"] == "ok", rec.get("error")
        assert rec["decode_tok_s"] == pytest.approx(rec["batch"] / rec["tpot_ms"] * 1e3, rel=1e-2)
        assert 0 < rec["roofline_tpot_ms"] < rec["tpot_ms"]
        assert rec["prefill_tok_s"] > 0 and rec["selection_ms"] is not None
        if rec["kv"] == "host":
            assert 0 <= rec["hit_rate"] <= 1 and rec["pcie_bytes_per_token"] > 0
            assert rec["selection_source"].startswith("trace:")
        else:
            assert rec["hit_rate"] is None and rec["pcie_bytes_per_token"] == 0
    dense = next(r for r in stored if r["method"] == "dense" and r["batch"] == 2)
    # tiny: 4 layers x 2 KV heads x d 32, fp32; dense reads all 1024 keys and values
    assert dense["kv_read_bytes_per_step"] == 2 * 4 * 2 * 1024 * 2 * 32 * 4
    for name in ("report.md", "throughput.png", "breakdown.png", "roofline.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| sparda | host | 2 | ok |" in report and "1000.1" in report


def test_injected_oom_is_recorded_and_sweep_continues(tmp_path, monkeypatch):
    calls = []

    def fake_point(llm, model_name, batch, context, opts, bandwidth, traces=None, deadline=None, hit_rate=None,
                   hit_rates=()):
        calls.append((llm.config.method, batch))
        if llm.config.method == "sparse" and batch == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"decode_tok_s": 10.0 * batch, "tpot_ms": 100.0, "roofline_tpot_ms": 1.0, "selection_ms": 0.1,
                "exposed_wait_ms": 0.0, "hit_rate": None, "pcie_bytes_per_token": 0.0}

    monkeypatch.setattr(pt, "decode_point", fake_point)
    monkeypatch.setattr(pt, "measure_prefill", lambda llm, n: {"prefill_tokens": n, "ttft_ms": 5.0,
                                                                "prefill_tok_s": n / 5e-3})
    cfg = sweep.quick_config(str(tmp_path), methods=["sparse", "dense"], contexts=[512], batches=[1, 2, 4],
                             trace="none")
    records = sweep.run_sweep(cfg, log=lambda _: None)
    status = {(r["method"], r["batch"]): r["status"] for r in records}
    assert status == {("sparse", 1): "ok", ("sparse", 2): "oom", ("sparse", 4): "oom",
                      ("dense", 1): "ok", ("dense", 2): "ok", ("dense", 4): "ok"}
    assert ("sparse", 4) not in calls  # a larger batch after an OOM is not tried
    assert "OutOfMemoryError" in next(r["error"] for r in records if r["status"] == "oom")
    assert all(k in r for r in records for k in sweep.REQUIRED_KEYS)


def test_host_limit_marks_offloaded_points_oom(tmp_path):
    cfg = sweep.quick_config(str(tmp_path), methods=["sparse-offload", "dense"], contexts=[512], batches=[1],
                             decode_steps=1, repeats=1, breakdown_steps=0, host_mem_gb=1e-6, trace="none",
                             prefill_tokens=300)
    records = sweep.run_sweep(cfg, log=lambda _: None)
    status = {r["method"]: r["status"] for r in records}
    assert status == {"sparse-offload": "oom", "dense": "ok"}


def test_roofline_formula_by_hand():
    # 16 GB weights + 4 GB KV at 4,000 GB/s = 5 ms; 1 GB missed at 50 GB/s = 20 ms -> PCIe bound
    assert roofline_ms(16e9, 4e9, 1e9, 4000.0, 50.0) == pytest.approx(20.0)
    assert roofline_ms(16e9, 4e9, 1e8, 4000.0, 50.0) == pytest.approx(5.0)
    with pytest.raises(SpardaError):
        roofline_ms(1, 1, 1, 0.0, 50.0)
    paper = SelectionConfig.from_preset("paper")
    shape = ModelShape(32, 32, 8, 128, 4096, 131072)
    # 96 blocks x 64 tokens of K and V, plus (131072 - 32) / 16 + 1 = 8191 compressed keys, bf16
    assert kv_read_bytes("sparda", shape, paper, 1, 131072, 2) == 32 * 8 * (2 * 6144 + 8191) * 128 * 2
    assert kv_read_bytes("dense", shape, paper, 4, 131072, 2) == 4 * 32 * 8 * 2 * 131072 * 128 * 2


def test_trace_record_replay_round_trip(tmp_path):
    torch.manual_seed(0)
    model = build_model("tiny", "cpu", torch.float32)
    sel = selection_config("tiny")
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 512, (700,), generator=g).tolist() for _ in range(2)]
    fields = {f: getattr(sel, f) for f in ("init_blocks", "local_blocks", "topk_blocks", "dense_len")}
    traces = record_selection(model, seqs, 640, 5, ("sparse", "sparda"), "small", random_forecast(model), **fields)
    save_traces(tmp_path / "t.npz", traces)
    loaded = load_traces(tmp_path / "t.npz")
    assert set(loaded) == {"sparse", "sparda"}
    for name, tr in traces.items():
        assert np.array_equal(loaded[name].ids, tr.ids) and np.array_equal(loaded[name].pos, tr.pos)
        assert loaded[name].meta == tr.meta
        # every step selects exactly the budget: 1 init + 2 local + 4 top-k blocks
        assert ((tr.ids >= 0).sum(-1) == sel.budget_blocks).all()
        # replay at the recorded shape and budget reproduces the recording exactly
        masks = replay_masks(loaded[name], 4, 2, sel, [640, 640], 5, 11, row_offset=0)
        ref = torch.zeros(5, 2, 4, 2, 12, dtype=torch.bool)  # [S, R, L, H, N + pad]
        ids = torch.from_numpy(tr.ids.astype(np.int64))
        ref.scatter_(-1, torch.where(ids < 0, 11, ids), True)
        assert torch.equal(masks, ref[..., :11].permute(0, 2, 1, 3, 4))


def test_replay_scales_blocks_and_keeps_reuse():
    tr = _synthetic_trace(5, steps=20)
    target = SelectionConfig.from_preset("paper")  # init 1, local 33, topk 62
    masks = replay_masks(tr, 8, 4, target, [131072, 140000], 16, 2300)
    assert masks.shape == (16, 8, 2, 4, 2300)
    assert (masks.sum(-1) == target.budget_blocks).all()
    cur = torch.tensor([131072, 140000]) // 64
    assert masks[0, :, 0, :, cur[0]].all() and masks[0, :, 1, :, 0].all() and not masks[0, :, 0, :, cur[0] + 1:].any()
    prev, now = masks[:-1], masks[1:]
    reuse = ((prev & now).sum() - 34 * 15 * 8 * 2 * 4) / (now.sum() - 34 * 15 * 8 * 2 * 4)
    assert reuse.item() == pytest.approx(reuse_stats(tr)["topk_reuse"], abs=0.08)


def test_shipped_trace_is_realistic():
    from sparda.bench.traces import SHIPPED_TRACE

    if not SHIPPED_TRACE.is_file():
        pytest.skip("no shipped trace")
    traces = load_traces(SHIPPED_TRACE)
    assert {"sparse", "sparda"} <= set(traces)
    for tr in traces.values():
        assert tr.meta["model"] == "SmolLM2-135M-Instruct" and tr.ids.shape[2:4] == (30, 3)
        assert 0.5 < reuse_stats(tr)["topk_reuse"] <= 1.0
    early = traces["sparda"].early  # the shipped two-ahead heads' predictions (design §6.2)
    assert early is not None and (early[:, :, :2] == -1).all() and ((early[:, :, 2:] >= 0).sum(-1) == 21).all()
    assert 0.5 < reuse_stats(traces["sparda"])["early_recall"] < 1.0


def test_bad_options_raise():
    with pytest.raises(SpardaError):
        sweep.config_from_options(methods="dense,bogus")
    with pytest.raises(SpardaError):
        sweep.config_from_options(contexts="32k")
    with pytest.raises(SpardaError):
        sweep.config_from_options(models="llama-70b")


def test_weight_bytes_from_the_spec_equal_the_built_model():
    """The pre-allocation estimate counts exactly the parameters a built model holds."""
    from sparda.bench.models import spec_weight_bytes, weight_bytes

    model = build_model("tiny", "cpu", torch.float32)
    params = sum(p.numel() for p in model.parameters()) * 4  # tied embeddings count once
    embed_rows = model.model.embed_tokens.weight.numel() * 4
    assert spec_weight_bytes("tiny", torch.float32) == params
    assert weight_bytes(model) == params - embed_rows  # the per-step read skips the input embedding
    assert spec_weight_bytes("llama-8b", torch.bfloat16) == pytest.approx(16.06e9, rel=0.01)  # Llama-3-8B


def test_bench_refuses_a_model_that_cannot_fit_before_allocating(tmp_path, monkeypatch):
    """U1: the default llama-8b on a 24 GB CPU box was OOM-killed after 89 s."""
    from sparda.bench import models

    free = int(torch.randint(2**20, 2**28, ()))
    monkeypatch.setattr(models, "available_memory_bytes", lambda device: free)
    monkeypatch.setattr(sweep, "build_model", lambda *a, **k: pytest.fail("built the model"))
    cfg = sweep.quick_config(str(tmp_path / "out"), models=["bundled"])
    need = models.spec_weight_bytes("bundled", torch.float32)
    with pytest.raises(SpardaError, match=f"needs .*{need:,} bytes.*only .*{free:,} bytes"):
        sweep.run_sweep(cfg, log=lambda _: None)
    assert not (tmp_path / "out").exists()


def test_time_budget_is_honoured_inside_a_point(tmp_path, monkeypatch):
    """U1: a point that starts inside the budget stops at its next decode step once the
    budget is spent, and is recorded as skipped, not measured to the end."""
    import time

    fill = pt.fill_cache

    def slow_fill(*args, **kwargs):
        fill(*args, **kwargs)
        time.sleep(1.5)  # the budget runs out while the point fills its cache

    monkeypatch.setattr(pt, "fill_cache", slow_fill)
    monkeypatch.setattr(pt, "measure_prefill", lambda llm, n: {"prefill_tokens": n, "ttft_ms": 1.0,
                                                                "prefill_tok_s": 1.0})
    monkeypatch.setattr(sweep, "measure_bandwidth", lambda device: {"hbm_gbps": 1.0, "pcie_gbps": 1.0})
    cfg = sweep.quick_config(str(tmp_path), methods=["dense"], contexts=[512], batches=[1], decode_steps=50,
                             repeats=3, time_budget_s=1.0)
    records = sweep.run_sweep(cfg, log=lambda _: None)
    assert [(r["status"], r["error"]) for r in records] == [("skipped", "time budget (ran out inside the point)")]


def test_decode_point_stops_at_a_passed_deadline():
    import time

    model = build_model("tiny", "cpu", torch.float32)
    llm = pt.make_llm(model, "dense", selection_config("tiny"), random_forecast(model))
    calls = []
    decode = llm.decode
    llm.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    opts = sweep.quick_config("unused", decode_steps=4, repeats=2)
    with pytest.raises(pt.TimeBudgetExceeded):
        pt.decode_point(llm, "tiny", 1, 300, opts, {"hbm_gbps": 1.0, "pcie_gbps": 1.0},
                        deadline=time.perf_counter())
    assert calls == []


@pytest.mark.parametrize("args, message", [
    (["--out", "FILE"], "--out FILE is a file, not a directory; pass a directory path"),
    (["--record-trace", "DIR"], "--record-trace DIR is a directory; pass a file path such as DIR/trace.npz"),
])
def test_bench_output_paths_are_checked_first(tmp_path, monkeypatch, args, message):
    """U9: `bench --out afile` printed a raw [Errno 17]; `--record-trace` failed after 80 s of recording."""
    from click.testing import CliRunner

    from sparda.bench import traces
    from sparda.cli import main

    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    monkeypatch.setattr(traces, "record_traces", lambda **k: pytest.fail("recorded before checking"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["bench", "--quick", *args])
    assert result.exit_code == 2, result.output
    assert result.output.strip() == f"error: {message}"


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.7, 1.0])
def test_synthetic_masks_keep_the_chosen_fraction(rate, fresh_seed):
    """Each step keeps round(rate * k) of the previous step's top-k blocks (counted by brute
    force over the non-forced blocks), selects exactly k of them, and forces sinks + window."""
    from sparda.bench.traces import synthetic_masks
    from sparda.config import SelectionConfig

    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                          topk_blocks=10, dense_len=64)
    start = [4000, 3000 + 7, 2500]
    masks = synthetic_masks(3, 2, cfg, start, 12, 300, rate, seed=fresh_seed)
    keep = round(rate * cfg.topk_blocks)
    for i in range(masks.shape[0]):
        for b, p in enumerate(start):
            cur = (p + i) // cfg.block_size
            forced = {0, cur - 1, cur}
            for layer in range(3):
                for h in range(2):
                    got = set(torch.nonzero(masks[i, layer, b, h]).flatten().tolist())
                    assert forced <= got and max(got) == cur
                    top = got - forced
                    assert len(top) == cfg.topk_blocks
                    if i:
                        pcur = (p + i - 1) // cfg.block_size
                        prev = set(torch.nonzero(masks[i - 1, layer, b, h]).flatten().tolist()) - {0, pcur - 1, pcur}
                        assert len(top & prev) >= keep
                        if rate == 1.0:
                            assert top == prev


def test_quick_sweep_with_hit_rates_records_the_target(tmp_path):
    cfg = sweep.quick_config(str(tmp_path / "out"), methods=["sparda", "dense"], contexts=[1024], batches=[1],
                             decode_steps=2, repeats=1, warmup_steps=1, breakdown_steps=0, hit_rates=[0.2, 1.0])
    records = sweep.run_sweep(cfg, log=lambda _: None)
    offl = [r for r in records if r["method"] == "sparda"]
    assert [r["target_hit_rate"] for r in offl] == [None, 0.2, 1.0] and all(r["status"] == "ok" for r in offl)
    assert offl[0]["selection_source"].startswith("trace:")
    assert offl[2]["hit_rate"] > offl[1]["hit_rate"]
    assert [r.get("target_hit_rate") for r in records if r["method"] == "dense"] == [None]


def test_hit_rates_on_one_cache_count_like_fresh_points():
    """The hit-rate points measured on one filled cache (block ids swapped in place,
    slots emptied) count exactly the hits and misses of a fresh point per hit rate."""
    from sparda.bench.models import build_model, random_forecast, selection_config

    model = build_model("tiny", torch.device("cpu"), torch.float32, 2048)
    llm = pt.make_llm(model, "sparda", selection_config("tiny"), random_forecast(model))
    cfg = sweep.quick_config("unused", decode_steps=2, repeats=1, warmup_steps=1, breakdown_steps=0)
    env = {"hbm_gbps": 1.0, "pcie_gbps": 1.0}
    together = pt.decode_point(llm, "tiny", 2, 1024, cfg, env, None, hit_rates=[0.3, 0.9])
    assert together["target_hit_rate"] == 0.3 and [p["target_hit_rate"] for p in together["hit_rate_points"]] == [0.9]
    for rate, got in ((0.3, together), (0.9, together["hit_rate_points"][0])):
        fresh = pt.decode_point(llm, "tiny", 2, 1024, cfg, env, None, hit_rate=rate)
        assert got["hit_rate"] == fresh["hit_rate"] and got["pcie_bytes_per_token"] == fresh["pcie_bytes_per_token"]
    assert together["hit_rate_points"][0]["hit_rate"] > together["hit_rate"]


# ------------------------------------------------------------------ --kv-dtype (docs/kv_quant.md)
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quick_sweep_with_a_quantised_cache(tmp_path, kv_dtype):
    """``kv_dtype`` reaches every point: records carry it, the host store holds (and the
    gather moves) the quantised bytes, and the roofline reads them."""
    cfg = sweep.quick_config(str(tmp_path / "out"), methods=["sparse", "sparda"], contexts=[1024], batches=[2],
                             decode_steps=1, repeats=1, warmup_steps=1, breakdown_steps=0, kv_dtype=kv_dtype,
                             trace="none", prefill_tokens=300)
    records = sweep.run_sweep(cfg, log=lambda _: None)
    assert [(r["method"], r["status"], r["kv_dtype"]) for r in records] == [("sparse", "ok", kv_dtype),
                                                                            ("sparda", "ok", kv_dtype)]
    # tiny: 4 layers, 2 KV heads, d 32 (fp32 model): per token and head, codes + 8 bytes of (step, lo)
    token = {"int8": 32, "int4": 16}[kv_dtype] + 8
    sparda = records[1]
    cap = pt.point_capacity(1024, cfg)
    blocks = -(-cap // 64)  # tiny's blocks hold 64 tokens
    assert sparda["host_kv_bytes"] == 3 * 2 * 2 * 2 * blocks * 64 * token  # layers 1..3 x K,V x B x H
    assert sparda["pcie_bytes_per_token"] % (64 * token) == 0  # whole quantised blocks
    sel = selection_config("tiny")
    num_ck = (1024 - sel.kernel_size) // sel.kernel_stride + 1
    assert records[0]["kv_read_bytes_per_step"] == 2 * 4 * 2 * (2 * sel.budget_blocks * 64 * token + num_ck * 32 * 4)
    for rec in records:  # the offloaded cache's slots hold the quantised codes too: the same bytes
        assert rec["kv_read_bytes_by_kind"] == {"kv": 2 * 4 * 2 * 2 * sel.budget_blocks * 64 * token,
                                                "compressed_keys": 2 * 4 * 2 * num_ck * 32 * 4}
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"| sparda {kv_dtype} | host | 2 | ok |" in report


def test_mixed_roofline_reads_the_slots_in_the_model_dtype(tmp_path):
    """kv_dtype mixed: the host store is int4, but attention reads GPU slots in the model dtype
    (design §6.1), so the roofline counts those bytes, not the int4 codes."""
    cfg = sweep.quick_config(str(tmp_path / "out"), methods=["sparda"], contexts=[1024], batches=[2],
                             decode_steps=1, repeats=1, warmup_steps=1, breakdown_steps=0, kv_dtype="mixed",
                             trace="none", prefill_tokens=300)
    (rec,) = sweep.run_sweep(cfg, log=lambda _: None)
    assert rec["status"] == "ok" and rec["kv_dtype"] == "mixed"
    sel = selection_config("tiny")
    num_ck = (1024 - sel.kernel_size) // sel.kernel_stride + 1
    assert rec["kv_read_bytes_by_kind"] == {"kv": 2 * 4 * 2 * 2 * sel.budget_blocks * 64 * 32 * 4,  # fp32 slots
                                            "compressed_keys": 2 * 4 * 2 * num_ck * 32 * 4}
    assert rec["kv_read_bytes_per_step"] == sum(rec["kv_read_bytes_by_kind"].values())


def test_host_limit_counts_quantised_bytes(tmp_path):
    """A host cap between a point's int8 and bf16 host KV: bf16 is out of memory, int8 runs."""
    model = build_model("tiny", "cpu", torch.float32)
    sel = selection_config("tiny")
    opts = sweep.quick_config("unused", decode_steps=1, repeats=1, breakdown_steps=0)
    cap = pt.point_capacity(1024, opts)
    need = {kv: pt.kv_need_bytes("sparse-offload", model.shape, sel, kv, torch.float32, 2, cap)[1]
            for kv in ("bf16", "int8")}
    assert need["int8"] * 32 * 4 == need["bf16"] * (32 + 8)  # fp32 values vs codes + scales per token and head
    limit_gb = (need["int8"] + need["bf16"]) / 2 / 2**30
    status = {}
    for kv in ("bf16", "int8"):
        cfg = sweep.quick_config(str(tmp_path / kv), methods=["sparse-offload"], contexts=[1024], batches=[2],
                                 decode_steps=1, repeats=1, breakdown_steps=0, host_mem_gb=limit_gb, trace="none",
                                 prefill_tokens=300, kv_dtype=kv)
        (rec,) = sweep.run_sweep(cfg, log=lambda _: None)
        status[kv] = rec["status"]
    assert status == {"bf16": "oom", "int8": "ok"}


def test_largest_batch_at_128k_by_hand():
    """MiniCPM-8B shape (32 layers, 2 KV heads, d 128), 128K tokens, 96 GiB of host KV:
    per token and KV head K (or V) takes 256 B in bf16, 128 + 8 in int8, 64 + 8 in int4;
    31 offloaded layers hold K and V of every whole block of 64 tokens."""
    from sparda.bench.models import MODEL_SPECS

    spec = MODEL_SPECS["minicpm-8b"]
    shape = ModelShape(spec.layers, spec.q_heads, spec.kv_heads, spec.head_dim, spec.hidden, 131072)
    sel = selection_config("minicpm-8b")
    cap = 131072 + 100
    tokens = -(-cap // 64) * 64
    got = {}
    for kv, token in (("bf16", 256), ("int8", 136), ("int4", 72)):
        row = 31 * 2 * 2 * token * tokens
        got[kv] = pt.largest_batch("sparda", shape, sel, kv, torch.bfloat16, cap, 96 * 2**30)
        assert got[kv] == 96 * 2**30 // row
        assert pt.kv_need_bytes("sparda", shape, sel, kv, torch.bfloat16, got[kv], cap)[1] <= 96 * 2**30
        assert pt.kv_need_bytes("sparda", shape, sel, kv, torch.bfloat16, got[kv] + 1, cap)[1] > 96 * 2**30
    assert got == {"bf16": 24, "int8": 46, "int4": 88}
    # on-device methods are bounded by device memory only: K/V, plus the compressed keys (one
    # per 16 tokens past the first 32: (cap - 32) // 16 + 1) and the ring of the last 32 keys
    # of a quantised cache, bf16, in 32 layers x 2 KV heads x 128 dims
    dev_row = 32 * 2 * 2 * 136 * cap + 32 * 2 * ((cap - 32) // 16 + 1 + 32) * 128 * 2
    assert pt.largest_batch("sparse", shape, sel, "int8", torch.bfloat16, cap, 96 * 2**30, 80 * 2**30) == \
        80 * 2**30 // dev_row
    with pytest.raises(SpardaError, match="no memory limit"):
        pt.largest_batch("sparse", shape, sel, "int8", torch.bfloat16, cap, host_limit_bytes=96 * 2**30)


def test_kv_dtype_option():
    assert sweep.config_from_options(kv_dtype="int4").kv_dtype == "int4"
    assert sweep.config_from_options().kv_dtype == "bf16"
    with pytest.raises(SpardaError, match="unknown kv_dtype"):
        sweep.SweepConfig(kv_dtype="fp8")


def test_records_of_two_kv_dtypes_are_two_points():
    """Dedup and the sparda / sparse-offload pairs keep KV dtypes apart; a record without
    ``kv_dtype`` (older runs) is bf16."""
    from sparda.bench.records import dedup, method_label, speedups

    base = dict(model="minicpm-8b", context=131072, batch=24, status="ok", selection_source="trace:x", kv="host",
                slot_factor=1.5)
    recs = [dict(base, method="sparda", decode_tok_s=100.0),  # an older record: no kv_dtype
            dict(base, method="sparda", decode_tok_s=110.0, kv_dtype="bf16"),
            dict(base, method="sparda", decode_tok_s=150.0, kv_dtype="int8"),
            dict(base, method="sparse-offload", decode_tok_s=50.0, kv_dtype="int8")]
    kept, dropped = dedup([{"record": r, "rank": (str(i),), "file": "f"} for i, r in enumerate(recs)])
    assert dropped == 1 and [r["decode_tok_s"] for r in kept] == [110.0, 150.0, 50.0]
    assert [p["speedup"] for p in speedups(kept)] == [3.0]  # int8 pairs with int8 only
    assert method_label(kept[1]) == "sparda int8" and method_label(recs[0]) == "sparda"


def test_compute_alone_engine_implements_every_engine_call():
    """overlap_timing's engine that copies nothing must answer every call the offloaded
    cache makes of a TransferEngine (a missing ``gather_planes`` failed every overlap point
    on the GPU); its gathers leave the slots as they were, its token stores reach the host."""
    import inspect

    from sparda.cache.host import HostChunk
    from sparda.cache.transfer import SyncEngine, TransferEngine

    calls = [n for n, f in inspect.getmembers(TransferEngine, inspect.isfunction) if not n.startswith("_")]
    assert {"gather", "gather_planes", "store_tokens"} <= set(calls)
    fake = pt._NoGather(SyncEngine())
    missing = [n for n in calls if not callable(getattr(fake, n, None))]
    assert not missing, missing
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    gen = torch.Generator().manual_seed(seed)
    # pages [H, P, bs, d] with the identity table of 2 rows x 5 blocks
    host_k, host_v = torch.randn(2, 10, 4, 3, generator=gen), torch.randn(2, 10, 4, 3, generator=gen)
    chunk = HostChunk(0, 10, host_k, host_v, torch.arange(10, dtype=torch.int32).view(2, 5))
    dst_k, dst_v = torch.zeros(2, 2, 3, 4, 3), torch.zeros(2, 2, 3, 4, 3)
    load = torch.randint(-1, 5, (2, 2, 3), generator=gen)
    load[0, 0, 0] = 2  # at least one block to load
    fake.gather(chunk, dst_k, dst_v, load)
    fake.gather_planes(chunk, [(dst_k, dst_v)], load)
    assert not dst_k.any() and not dst_v.any(), f"seed {seed}"
    SyncEngine().gather_planes(chunk, [(dst_k, dst_v)], load)  # the real one copies (so the check can fail)
    assert torch.equal(dst_k[0, 0, 0], host_k[0, 2]), f"seed {seed}"
    tok_k, tok_v = torch.randn(2, 2, 3, generator=gen), torch.randn(2, 2, 3, generator=gen)
    fake.store_tokens(chunk, tok_k, tok_v, torch.tensor([6, 9]))
    assert torch.equal(host_k[:, 5 + 2, 1], tok_k[1]) and torch.equal(host_v[:, 1, 2], tok_v[0]), f"seed {seed}"


@pytest.mark.parametrize("kv_dtype,slot_factor", [("bf16", 1.0), ("bf16", 1.5), ("int8", 2.0), ("mixed", 1.5)])
def test_kv_need_bytes_counts_the_offloaded_slot_buffers(kv_dtype, slot_factor):
    """The device bytes the bench's memory check counts for an offloaded method are those
    the point's OffloadKVCache allocates: layer 0 whole plus every other layer's slot buffer
    of S + 1 blocks (S grows with slot_factor, design §6) with its block map and the slot
    diff's lists, the compressed keys and the ring; mixed: the slots in the model dtype, the
    int4 staging of S blocks, the hot-block state, and on the host the hot pool."""
    model = build_model("tiny", "cpu", torch.float32)
    sel = selection_config("tiny")
    llm = pt.make_llm(model, "sparse-offload", sel, None, kv_dtype=kv_dtype, slot_factor=slot_factor)
    batch, cap = 2, 40 * sel.block_size + 5
    cache = llm.new_cache(batch, cap)
    assert cache.resident == {0} and (cache.slots > cache.select_width or slot_factor == 1.0)
    allocated = sum(t.nbytes for buffers in (cache.k_slots, cache.v_slots, cache.k_full, cache.v_full,
                                             cache.cold_k, cache.cold_v) for t in buffers.values())
    allocated += sum(t.nbytes for t in cache.ck + cache.ring)
    allocated += sum(t.nbytes for maps in (cache.slot_map, cache.load, cache.attn_ids, cache.attn_blocks,
                                           cache.attn_slots) for t in maps.values())
    if cache.hot is not None:
        allocated += sum(t.nbytes for state in (cache.hot.hot, cache.hot.last) for t in state.values())
        allocated += cache.host.pool_table.table.nbytes
    allocated += cache.block_table.nbytes
    dev, host = pt.cache_need_bytes(llm, batch, cap)
    assert (dev, host) == (allocated, cache.host.nbytes), (slot_factor, kv_dtype)
    assert pt.kv_need_bytes("sparse-offload", llm.shape, sel, kv_dtype, torch.float32, batch, cap,
                            slot_factor=slot_factor) == (dev, host)


def test_copy_timing_replays_the_tpots_steps_with_their_misses(fresh_seed):
    """The copy-timing run (exposed wait, in-step PCIe) times the TPOT's own replayed steps
    with the slots as the TPOT found them: with spare slots a trace's returning blocks are
    resident, so its missed bytes per step equal the TPOT run's (a run entered a few steps
    early from empty slots missed ~3x more on the H200)."""
    model = build_model("tiny", torch.device("cpu"), torch.float32, 2048)
    llm = pt.make_llm(model, "sparda", selection_config("tiny"), random_forecast(model))
    trace = _synthetic_trace(fresh_seed, steps=16)
    cfg = sweep.quick_config("unused", decode_steps=4, repeats=1, warmup_steps=6, breakdown_steps=0,
                             timing_steps=4)
    env = {"hbm_gbps": 1.0, "pcie_gbps": 1.0}
    rec = pt.decode_point(llm, "tiny", 2, 1024, cfg, env, {"sparda": trace})
    assert rec["missed_bytes_per_step"] > 0, rec
    assert rec["timed_missed_bytes_per_step"] == pytest.approx(rec["missed_bytes_per_step"], rel=1e-9), \
        (fresh_seed, rec["timed_missed_bytes_per_step"], rec["missed_bytes_per_step"])


def test_an_untimed_offloaded_point_records_no_wait_rather_than_zero():
    """Without a copy timing (``timing_steps=0``) an offloaded point's exposed wait and copy time
    are unmeasured (None, shown as '-'), not 0 ms; an on-device point's are 0 (nothing to copy)."""
    model = build_model("tiny", torch.device("cpu"), torch.float32, 2048)
    cfg = sweep.quick_config("unused", decode_steps=2, repeats=1, warmup_steps=1, breakdown_steps=0, timing_steps=0)
    env = {"hbm_gbps": 1.0, "pcie_gbps": 1.0}
    offl = pt.decode_point(pt.make_llm(model, "sparda", selection_config("tiny"), random_forecast(model)),
                           "tiny", 2, 1024, cfg, env, None)
    assert offl["hit_rate"] is not None
    assert offl["exposed_wait_ms"] is None and offl["exposed_transfer_ms"] is None and offl["copy_ms"] is None
    assert sweep._line(dict(offl, status="ok", model="tiny", method="sparda", batch=2, context=1024)).endswith("exposed -")
    dense = pt.decode_point(pt.make_llm(model, "dense", selection_config("tiny"), None), "tiny", 2, 1024, cfg, env, None)
    assert dense["exposed_wait_ms"] == 0.0 and dense["copy_ms"] == 0.0


def test_a_parity_check_leaves_the_tpots_steps_unchanged(fresh_seed, monkeypatch):
    """With a CUDA-graph parity check first (graphs faked on the CPU: the replay runs the eager
    step) the TPOT times the same replayed steps, hence the same misses, as without one (it
    used to time the steps after the parity run, past the trace's end)."""
    from sparda.engine.graph_runner import DecodeRunner

    init = DecodeRunner.__init__

    def fake_graphs(self, llm, cache, cuda_graphs=True):
        init(self, llm, cache, cuda_graphs)
        self.use_graphs = bool(cuda_graphs)

    monkeypatch.setattr(DecodeRunner, "__init__", fake_graphs)
    monkeypatch.setattr(DecodeRunner, "step", lambda self, live_len: self.eager(live_len))
    model = build_model("tiny", torch.device("cpu"), torch.float32, 2048)
    llm = pt.make_llm(model, "sparda", selection_config("tiny"), random_forecast(model))
    trace = _synthetic_trace(fresh_seed, steps=16)
    env = {"hbm_gbps": 1.0, "pcie_gbps": 1.0}
    got = []
    for parity in (0, 24):
        cfg = sweep.quick_config("unused", decode_steps=4, repeats=2, warmup_steps=3, breakdown_steps=0,
                                 parity_steps=parity, overlap_steps=0)
        got.append(pt.decode_point(llm, "tiny", 2, 1024, cfg, env, {"sparda": trace}))
    assert got[1]["graph_tokens_equal"] is True, got[1]
    assert got[0]["missed_bytes_per_step"] > 0
    for key in ("missed_bytes_per_step", "hit_rate", "timed_missed_bytes_per_step"):
        assert got[1][key] == got[0][key], (fresh_seed, key, got[0][key], got[1][key])


def test_synthetic_prefill_mask_keeps_the_top_k_between_neighbours(fresh_seed):
    """Token ``i`` of the last ``Tq`` of ``T`` keys sits at position ``T - Tq + i``: it selects
    its own block, nothing after it, the forced blocks and ``topk_blocks`` others, of which
    at least ``round(keep * k)`` the previous token chose too (counted by brute force)."""
    from sparda.bench.traces import synthetic_prefill_mask
    from sparda.config import SelectionConfig
    from sparda.kernels.reference import forced_blocks

    cfg = SelectionConfig(block_size=16, kernel_size=8, kernel_stride=4, init_blocks=1, local_blocks=2,
                          topk_blocks=6, dense_len=64)
    num_keys, tq, keep = 900, 40, 0.5
    num_blocks = -(-num_keys // cfg.block_size)
    mask = synthetic_prefill_mask(2, cfg, num_keys, tq, num_blocks, keep, seed=fresh_seed)
    assert mask.shape == (1, 2, tq, num_blocks) and mask.dtype == torch.bool
    q_pos = torch.arange(num_keys - tq, num_keys).view(1, -1)
    cur = (q_pos // cfg.block_size)[0]
    blocks = torch.arange(num_blocks)
    forced = forced_blocks(q_pos, num_blocks, cfg)[0, 0] & (blocks <= cur[:, None])
    m = mask[0]
    assert (m[:, torch.arange(tq), cur]).all() and not (m & (blocks > cur[:, None])).any()
    assert (m | ~forced).all()
    top = m & ~forced
    assert (top.sum(-1) == cfg.topk_blocks).all()
    assert ((top[:, 1:] & top[:, :-1]).sum(-1) >= round(keep * cfg.topk_blocks)).all()


@pytest.mark.parametrize("recall", [0.0, 0.4, 0.79, 1.0])
def test_two_ahead_predictions_keep_the_chosen_recall(recall, fresh_seed):
    """``--lookahead-recall`` (docs/bench.md): a modelled two-ahead prediction of each replayed
    selection keeps its forced blocks, holds about ``recall`` of its other blocks, fills the rest
    with distinct blocks of the non-forced range outside the selection, and is ascending and
    ``-1`` padded like the selection; checked row by row in Python."""
    from sparda.bench.traces import synthetic_masks, two_ahead_ids
    from sparda.kernels.reference import block_mask_to_indices

    cfg = SelectionConfig(block_size=16, init_blocks=1, local_blocks=3, topk_blocks=8, dense_len=0)
    start = [700, 1000, 1290]
    steps, num_blocks = 6, 90
    masks = synthetic_masks(4, 3, cfg, start, steps, num_blocks, 0.6, seed=fresh_seed % 1000)
    ids = torch.stack([block_mask_to_indices(m, cfg.budget_blocks).to(torch.int32) for m in masks])
    early = two_ahead_ids(ids, cfg, start, recall, seed=fresh_seed)
    assert early.shape == ids.shape and early.dtype == torch.int32
    kept = total = 0
    for i in range(steps):
        for layer in range(4):
            for b, p in enumerate(start):
                cur = (p + i) // cfg.block_size
                forced = {n for n in range(cur + 1) if n < cfg.init_blocks or n > cur - cfg.local_blocks}
                for h in range(3):
                    final = [int(x) for x in ids[i, layer, b, h] if x >= 0]
                    row = early[i, layer, b, h].tolist()
                    pred = [x for x in row if x >= 0]
                    assert row == sorted(pred) + [-1] * (len(row) - len(pred)) and len(set(pred)) == len(pred)
                    assert forced <= set(pred) and len(pred) == len(final), (fresh_seed, i, layer, b, h)
                    free = set(final) - forced
                    assert all(cfg.init_blocks <= x <= cur - cfg.local_blocks for x in set(pred) - forced)
                    kept += len(free & set(pred))
                    total += len(free)
    share = kept / total  # 1,728 free blocks: a binomial share within ~5 standard deviations
    assert abs(share - recall) <= 5 * (recall * (1 - recall) / total) ** 0.5 + 1e-9, (fresh_seed, share)
    with pytest.raises(SpardaError, match="--lookahead-recall"):
        two_ahead_ids(ids, cfg, start, 1.5)


def test_quick_sweep_runs_both_lookaheads(tmp_path):
    """``--lookahead 1,2``: offloaded ``sparda`` once per lookahead (trace and synthetic points),
    the other methods once; lookahead-2 records carry the modelled recall and early copies."""
    cfg = sweep.config_from_options(quick=True, out=str(tmp_path / "out"), methods="sparda,dense", contexts="1024",
                                    batches="1", lookaheads="1,2", lookahead_recall=0.5, hit_rates="0.7")
    cfg.decode_steps, cfg.repeats, cfg.warmup_steps, cfg.breakdown_steps = 2, 1, 1, 0
    records = sweep.run_sweep(cfg, log=lambda _: None)
    got = [(r["method"], r["lookahead"], r.get("target_hit_rate")) for r in records]
    assert got == [("sparda", 1, None), ("sparda", 1, 0.7), ("sparda", 2, None), ("sparda", 2, 0.7),
                   ("dense", None, None)]
    assert all(r["status"] == "ok" for r in records)
    two = [r for r in records if r["lookahead"] == 2]
    assert all(r["lookahead_recall"] == 0.5 and r["early_copies"] > 0 for r in two)
    assert all(r["lookahead_predictions"] == "modelled" for r in two)
    assert all(r["early_copies"] == 0 for r in records if r["lookahead"] == 1)
    with pytest.raises(SpardaError, match="--lookahead takes 1, 2"):
        sweep.config_from_options(quick=True, out=str(tmp_path / "x"), lookaheads="3")
    with pytest.raises(SpardaError, match="add sparda to --methods"):
        sweep.config_from_options(quick=True, out=str(tmp_path / "x"), methods="dense", lookaheads="2")


def test_lookahead_two_replays_a_traces_recorded_predictions(tmp_path):
    """Without ``--lookahead-recall`` the early copies of a trace point replay the shipped trace's
    recorded two-ahead predictions (``lookahead_predictions`` ``recorded``, no recall), while a
    synthetic point, which has none, models them at the default recall."""
    from sparda.bench.traces import LOOKAHEAD2_RECALL

    cfg = sweep.config_from_options(quick=True, out=str(tmp_path / "out"), methods="sparda", contexts="1024",
                                    batches="1", lookaheads="2", hit_rates="0.7")
    cfg.decode_steps, cfg.repeats, cfg.warmup_steps, cfg.breakdown_steps = 2, 1, 1, 0
    trace, synthetic = sweep.run_sweep(cfg, log=lambda _: None)
    assert trace["status"] == synthetic["status"] == "ok"
    assert trace["selection_source"] == "trace:sparda" and trace["lookahead_predictions"] == "recorded"
    assert trace["lookahead_recall"] is None and trace["early_copies"] > 0
    assert synthetic["lookahead_predictions"] == "modelled" and synthetic["lookahead_recall"] == LOOKAHEAD2_RECALL


def test_two_ahead_stats_against_brute_force(fresh_seed):
    """:func:`two_ahead_stats` against Python set loops, rows at other positions whose steps cross
    block boundaries (each step's own free range), predictions empty at layers 0 and 1."""
    from sparda.bench.traces import two_ahead_stats

    rng = np.random.default_rng(fresh_seed)
    S, R, L, H, K = 7, 3, 4, 2, 7
    meta = dict(block_size=4, init_blocks=1, local_blocks=2, topk_blocks=3)
    pos = rng.integers(30, 50, R)[None, :] + np.arange(S)[:, None]

    def draw():
        a = np.full((S, R, L, H, K), -1, np.int16)
        for idx in np.ndindex(S, R, L, H):
            n = int(rng.integers(0, K + 1))
            a[idx][:n] = np.sort(rng.choice(14, n, replace=False))
        return a

    ids, early = draw(), draw()
    early[:, :, :2] = -1
    got = two_ahead_stats(SelectionTrace(ids, pos, meta, early))
    c = dict.fromkeys(("sel", "rec", "fresh", "saved", "pred", "efresh", "wrong", "kept"), 0)
    for s in range(1, S):
        for r in range(R):
            hi = pos[s, r] // 4 - 2
            for layer in range(2, L):
                for h in range(H):
                    def blocks(a, step):
                        return {int(x) for x in a[step, r, layer, h] if x >= 0}
                    sel, pred, sel0, pred0 = blocks(ids, s), blocks(early, s), blocks(ids, s - 1), blocks(early, s - 1)
                    fs, fp = {x for x in sel if 1 <= x <= hi}, {x for x in pred if 1 <= x <= hi}
                    fresh = fs - (sel0 | pred0)
                    c["sel"] += len(fs); c["rec"] += len(fs & pred); c["fresh"] += len(fresh)
                    c["saved"] += len(fresh & pred); c["pred"] += len(fp); c["efresh"] += len(fp - (sel0 | pred0))
                    c["wrong"] += len(fp - sel); c["kept"] += len((fp - sel) & (pred0 - sel0))
    want = {"early_recall": c["rec"] / c["sel"], "fresh": c["fresh"] / c["sel"], "early_fresh": c["efresh"] / c["pred"],
            "early_saved": c["saved"] / c["fresh"], "early_wasted_persist": c["kept"] / c["wrong"]}
    assert got == {k: round(v, 4) for k, v in want.items()}, (fresh_seed, got, want)


def test_replayed_predictions_of_layers_without_a_head_come_from_the_first_that_has_one(fresh_seed):
    """30 source layers onto 32: target layer 2 maps to source layer 1, which has no two-ahead head;
    its replayed prediction is source layer 2's (so are those of targets 0 and 1, never warmed)."""
    tr = _synthetic_trace(fresh_seed, steps=6, layers=30)
    early = _synthetic_trace(fresh_seed + 1, steps=6, layers=30).ids.copy()
    early[:, :, :2] = -1
    tr = SelectionTrace(tr.ids, tr.pos, tr.meta, early)
    sel = SelectionConfig(**dict(block_size=64, init_blocks=1, local_blocks=2, topk_blocks=4, dense_len=64))
    masks = replay_masks(tr, 32, 2, sel, [1100, 1100], 6, 20, early=True)
    alone = SelectionTrace(tr.ids, tr.pos, tr.meta, np.where(np.arange(30)[None, None, :, None, None] < 2,
                                                             early[:, :, 2:3], early))
    want = replay_masks(alone, 32, 2, sel, [1100, 1100], 6, 20, early=True)
    assert torch.equal(masks, want) and (masks[:, 2].sum(-1) > 3).any(), fresh_seed  # more than the forced 3
    with pytest.raises(SpardaError, match="no two-ahead predictions"):
        replay_masks(_synthetic_trace(0), 4, 2, sel, [1100], 2, 20, early=True)
