"""``--kv-dtype mixed`` (design §6.1, :mod:`sparda.cache.hot`): offloaded decode attention
against a float64 reference over exact hot blocks and int4 cold blocks, the demotion rule on
a scripted selection history, the byte counters, the refusals (on-device caches, the CLI)
and a short generation of the bundled model."""

from __future__ import annotations

import math

import pytest
import torch

from sparda.cache.hot import HotBlocks
from sparda.cache.mixed import MixedOffloadKVCache
from sparda.cache.offload import OffloadKVCache
from sparda.cache.transfer import SyncEngine
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.kernels import quant
from sparda.model.llama import StepInfo

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(phase, rows, q_pos, max_kv_len):
    return StepInfo(phase=phase, rows=rows, q_pos=q_pos, kv_len=q_pos[:, -1] + 1, cos=None, sin=None,
                    max_kv_len=max_kv_len)


class CountingEngine(SyncEngine):
    """The sync engine, counting the bytes each gather reads from the host (every plane)."""

    def __init__(self) -> None:
        self.bytes = 0

    def gather(self, chunk, dst_k, dst_v, load):
        r, _, _ = (load >= 0).nonzero(as_tuple=True)
        page = chunk.table[r, load[load >= 0]]
        block = chunk.k[0, 0]
        mine = int(((page >= chunk.page0) & (page < chunk.page1)).sum())  # the blocks this chunk holds
        self.bytes += 2 * mine * block.numel() * block.element_size()
        super().gather(chunk, dst_k, dst_v, load)


def _reference_hot(hot: set, last: dict, chosen: set, pos: int, cfg: SelectionConfig, pool: int, steps: int):
    """The rule of design §6.1 written out for one (row, head), independently of HotBlocks."""
    cur = pos // cfg.block_size
    for n in chosen | set(range(max(0, cur - cfg.local_blocks + 1), cur + 1)):
        last[n] = pos
    return {n for n in hot if pos - last[n] < steps and n > cur - pool} | {cur}


def _prefill(cache, k_all, v_all, prompt, chunks):
    for row in range(k_all.shape[0]):
        for start, end in chunks:
            for layer in range(cache.num_layers):
                cache.append(layer, k_all[row:row + 1, :, start:end], v_all[row:row + 1, :, start:end],
                             _step("prefill", torch.tensor([row]), torch.arange(start, end).view(1, -1), end))


@pytest.mark.parametrize("pool,steps", [(5, 2), (4, 1), (8, 4)])
def test_mixed_attention_equals_float64_reference(pool, steps):
    """Two prefill chunks, then decode steps with random selections: the attention over the
    slots equals a float64 attention over a cache whose hot blocks (by the rule, tracked in
    the test from the selections) are exact and whose cold blocks are int4-dequantised; the
    hot mask equals the test's; the counters count a bf16 block per pool miss and an int4
    block (codes + scales) per other miss, which are the bytes the gathers read."""
    cfg = SelectionConfig(**SMALL)
    b, h, g, d, cap, prompt, steps_n = 2, 2, 3, 16, 240, 70, 90
    off = MixedOffloadKVCache(1, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", hot_blocks=pool,
                              hot_steps=steps)
    assert isinstance(off, OffloadKVCache)
    off.engine = CountingEngine()
    k_all, v_all = torch.randn(b, h, cap, d) * 3, torch.randn(b, h, cap, d) * 3
    _prefill(off, k_all, v_all, prompt, ((0, 45), (45, prompt)))
    int4_k = quant.QuantizedKV.quantize(k_all, "int4").dequantize().double()
    int4_v = quant.QuantizedKV.quantize(v_all, "int4").dequantize().double()
    bs = cfg.block_size
    cur0 = (prompt - 1) // bs
    window = set(range(cur0 - cfg.local_blocks + 1, cur0 + 1))
    hot = {(r, j): set(window) for r in range(b) for j in range(h)}
    last = {(r, j): {n: prompt - 1 for n in window} for r in range(b) for j in range(h)}
    rows, worst, pool_hits, cold_hits, demoted_seen = torch.arange(b), 0.0, 0, 0, False
    for pos in range(prompt, prompt + steps_n):
        step = _step("decode", rows, torch.full((b, 1), pos), cap)
        off.append(0, k_all[:, :, pos:pos + 1], v_all[:, :, pos:pos + 1], step)
        cur = pos // bs
        ids = torch.full((b, h, off.select_width), -1, dtype=torch.long)
        for r in range(b):
            for j in range(h):
                # mostly recent blocks (so some stay hot), sometimes old ones
                recent = list(range(max(0, cur - 6), cur))
                pick = [n for n in recent if torch.rand(()) < 0.4] + [int(torch.randint(0, cur, ()))]
                chosen = sorted(set(pick))[:off.select_width - 1]
                ids[r, j, :len(chosen) + 1] = torch.tensor([*chosen, cur])
                before = hot[r, j]
                hot[r, j] = _reference_hot(before, last[r, j], set(chosen), pos, cfg, pool, steps)
                demoted_seen |= bool(before - hot[r, j])
        p = torch.full((b,), pos)
        off.fetch(0, ids, p)
        load = off.load[0]
        for r, j, s in (load >= 0).nonzero().tolist():
            if int(load[r, j, s]) in hot[r, j]:
                pool_hits += 1
            else:
                cold_hits += 1
        for r in range(b):
            for j in range(h):
                got_hot = set(off.hot.hot[0][r, j].nonzero().flatten().tolist())
                assert got_hot == hot[r, j], (pos, r, j, got_hot, hot[r, j])
        q = torch.randn(b, h, g, d)
        got = off.attend(0, q, p + 1, p).double()
        for r in range(b):
            for j in range(h):
                blocks = sorted(set(ids[r, j][ids[r, j] >= 0].tolist()))
                tok = torch.cat([torch.arange(n * bs, min((n + 1) * bs, pos + 1)) for n in blocks])
                exact = torch.tensor([int(t) // bs in hot[r, j] for t in tok]).view(-1, 1)
                kk = torch.where(exact, k_all[r, j, tok].double(), int4_k[r, j, tok])
                vv = torch.where(exact, v_all[r, j, tok].double(), int4_v[r, j, tok])
                want = torch.softmax(q[r, j].double() @ kk.T / math.sqrt(d), -1) @ vv
                worst = max(worst, ((got[r, j] - want).norm() / want.norm()).item())
    assert worst <= 1e-5, worst
    assert demoted_seen and pool_hits > 0 and cold_hits > 0
    stats = off.offload_stats(steps_n)
    bf16_block, int4_block = bs * d * 4, bs * (d // 2 + 8)  # fp32 on the CPU stands in for bf16
    assert stats["pool_misses"] == pool_hits and stats["misses"] == pool_hits + cold_hits
    assert stats["bytes_copied"] == 2 * (pool_hits * bf16_block + cold_hits * int4_block)
    assert off.engine.bytes == stats["bytes_copied"]  # what the gathers actually read
    assert stats["host_bytes"] == 2 * b * h * (off.num_blocks * int4_block + off.hot_blocks * bf16_block)
    assert stats["pool_bytes"] == 2 * b * h * off.hot_blocks * bf16_block


def test_demotion_rule_on_a_scripted_history():
    """P = 4 pool blocks, R = 2 steps, local window 2, blocks of 16 tokens, one row and head;
    the expected hot sets are written out by hand from the rule (design §6.1)."""
    cfg = SelectionConfig(**SMALL)
    hb = HotBlocks([0], 1, 1, 12, cfg, hot_blocks=4, hot_steps=2, device=torch.device("cpu"))
    hb.prefill(0, 0, 64)  # tokens 0..63: blocks 0..3, window {2, 3}
    hot = lambda: set(hb.hot[0][0, 0].nonzero().flatten().tolist())  # noqa: E731
    assert hot() == {2, 3}

    def step(pos, chosen):
        ids = torch.tensor([[[*chosen, pos // 16] + [-1] * 2]])
        return set(hb.update(0, ids, torch.tensor([pos]))[0, 0].nonzero().flatten().tolist())

    assert step(64, [0, 2]) == set() and hot() == {2, 3, 4}  # block 0 selected but cold: no promotion
    assert step(65, [1]) == set() and hot() == {2, 3, 4}  # block 2 last at 64: 65 - 64 < 2
    assert step(66, []) == {2} and hot() == {3, 4}  # block 2 unselected for 2 steps: demoted
    assert step(67, [2]) == set() and hot() == {3, 4}  # ... and stays int4 when selected again
    for pos in range(68, 80):
        step(pos, [3])
    assert hot() == {3, 4}
    assert step(80, [3]) == set() and hot() == {3, 4, 5}  # block 5 born hot; 4 still in the window
    for pos in range(81, 96):
        step(pos, [3])
    assert step(96, [3]) == set() and hot() == {3, 4, 5, 6}  # block 4 left the window: last at 95
    assert step(97, [3]) == {4} and hot() == {3, 5, 6}
    for pos in range(98, 112):
        step(pos, [3, 5, 6])
    assert step(112, [3, 5, 6]) == {3} and hot() == {5, 6, 7}


def test_mixed_prefill_pool_and_partial_slot_are_exact():
    """After a chunked prefill, the hot pool holds the window's exact tokens, the store the
    int4 bytes of every token, and the partial slot the current block's exact tokens."""
    cfg = SelectionConfig(**SMALL)
    b, h, d, cap, prompt = 1, 2, 16, 160, 75
    off = MixedOffloadKVCache(1, b, h, d, cap, cfg, torch.float32, "cpu", engine="sync", hot_blocks=3)
    k_all, v_all = torch.randn(b, h, cap, d), torch.randn(b, h, cap, d)
    _prefill(off, k_all, v_all, prompt, ((0, 20), (20, 40), (40, prompt)))
    for head in range(h):
        for n in (3, 4):  # the window of token 74
            pk, pv = off.host.pool_block(0, 0, head, n)
            m = min(16, prompt - n * 16)
            assert torch.equal(pk[:m], k_all[0, head, n * 16:n * 16 + m])
            assert torch.equal(pv[:m], v_all[0, head, n * 16:n * 16 + m])
        sk, _ = off.host.block(0, 0, head, 1)
        assert torch.equal(sk.dequantize(), quant.QuantizedKV.quantize(k_all[0, head, 16:32], "int4").dequantize())
    assert torch.equal(off.k_slots[0][0, :, off.slots, :11], k_all[0, :, 64:prompt])
    assert off.hot.hot[0][0].nonzero()[:, 1].tolist() == [3, 4, 3, 4]


def test_mixed_refused_on_device_and_checked():
    """The config, the one place these options are checked, refuses them before the model
    loads (no such model is looked for) and fills the defaults (P = budget, R = 4)."""
    from sparda.config import DEFAULT_HOT_STEPS, build_config
    from sparda.engine.llm import LLM

    for method in ("dense", "sparse", "quest"):
        with pytest.raises(SpardaError, match=f"method {method}.* keeps its KV cache on the device"):
            LLM("/nonexistent/model", method=method, kv_dtype="mixed", device="cpu")
    with pytest.raises(SpardaError, match="kv_hot_blocks must be an integer of at least local_blocks"):
        LLM("/nonexistent/model", method="sparse-offload", kv_dtype="mixed", kv_hot_blocks=1, local_blocks=2,
            device="cpu")
    with pytest.raises(SpardaError, match="kv_hot_steps .*decode steps"):
        LLM("/nonexistent/model", method="sparse-offload", kv_dtype="mixed", kv_hot_steps=0, device="cpu")
    with pytest.raises(SpardaError, match=r"^kv_hot_blocks / kv_hot_steps apply to kv_dtype=mixed only"):
        LLM("/nonexistent/model", method="sparse-offload", kv_hot_blocks=8, device="cpu")
    cfg = build_config(method="sparse-offload", kv_dtype="mixed", device="cpu")
    assert (cfg.cache.hot_blocks, cfg.cache.hot_steps) == (cfg.selection.budget_blocks, DEFAULT_HOT_STEPS) == \
        (cfg.selection.budget_blocks, 4)


def test_cli_mixed_on_device_exits_2_with_one_line():
    from click.testing import CliRunner

    from sparda.cli import main

    for args in (["--method", "sparse"], ["--method", "dense"], ["--method", "sparda", "--no-offload"]):
        result = CliRunner().invoke(main, ["generate", "-p", "hi", "--device", "cpu", "--kv-dtype", "mixed", *args])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --kv-dtype mixed"), result.output
        assert "Traceback" not in result.output
    result = CliRunner().invoke(main, ["generate", "-p", "hi", "--device", "cpu", "--method", "sparse-offload",
                                       "--kv-dtype", "mixed", "--local-blocks", "4", "--kv-hot-blocks", "3"])
    assert result.exit_code == 2, result.output  # P < local_blocks: refused before the loading line
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --kv-hot-blocks must be"), result.output
    assert "kv_hot_blocks" not in lines[0] and "local_blocks" not in lines[0], result.output  # the CLI's spelling
    for args in (["--kv-hot-blocks", "4"], ["--kv-hot-steps", "2", "--kv-dtype", "int4"]):  # mixed-only options
        result = CliRunner().invoke(main, ["generate", "-p", "hi", "--device", "cpu", "--method", "sparse-offload",
                                           *args])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --kv-hot-blocks / --kv-hot-steps"), result.output


def test_offloaded_mixed_generates_on_the_bundled_model(bundled_dir):
    """sparse-offload with a mixed cache on the bundled model: a prompt past a few blocks,
    selection in decode (dense_len lowered), a few greedy tokens; blocks were fetched and the
    stats carry the pool's counters and size."""
    from sparda.engine.llm import LLM

    common = dict(method="sparse-offload", device="cpu", dense_len=256, topk_blocks=2, local_blocks=2,
                  prefill_chunk_tokens=0, cuda_graphs=False)
    text = "The quick brown fox jumps over the lazy dog. " * 40
    mixed = LLM(str(bundled_dir), kv_dtype="mixed", kv_hot_steps=2, **common)
    out = mixed.generate([text], max_new_tokens=6, temperature=0.0, chat=False)[0]
    assert len(out.token_ids) == 6
    off = out.stats["offload"]
    assert off["misses"] > 0 and 0 <= off["pool_misses"] <= off["misses"]
    assert off["kv_hot_blocks"] == 5 and off["pool_bytes"] > 0
    # per token: the cache's resident layers in the model dtype, the offloaded ones in int4
    cache, s = mixed.new_cache(1, 512), mixed.shape
    per_head = {kind: quant.token_bytes(s.head_dim, kind, mixed.dtype) for kind in ("bf16", "int4")}
    want = 2 * s.num_kv_heads * (len(cache.resident) * per_head["bf16"] + len(cache.offloaded) * per_head["int4"])
    assert len(cache.resident) >= 1 and mixed.kv_bytes_per_token() == want


def test_eval_mixed_offloaded_only_and_recorded(bundled_dir, tmp_path):
    """``sparda eval`` plans with ``kv_dtype`` mixed: a method whose cache stays on the device is
    refused before anything is written; an offloaded one runs ``ppl-decode`` and its records
    carry ``kv_dtype`` mixed and a finite, non-negative KL to the unquantised dense reference."""
    from sparda.eval.runner import EvalPlan, load_results, run_eval

    common = dict(model=str(bundled_dir), tasks=("ppl-decode",), lengths=(1024,), samples=1, ppl_windows=1,
                  kv_dtype="mixed", decode_tokens=16, device="cpu", overrides=dict(dense_len=256))
    with pytest.raises(SpardaError, match="method dense keeps its KV cache on the device"):
        run_eval(EvalPlan(methods=("dense", "sparse-offload"), out=str(tmp_path / "bad"), **common), progress=False)
    assert not (tmp_path / "bad").exists()
    run_eval(EvalPlan(methods=("sparse-offload",), out=str(tmp_path / "ok"), **common), progress=False)
    recs = [r for r in load_results(tmp_path / "ok" / "results.jsonl") if r.get("task") == "ppl-decode"]
    assert recs and all(r["kv_dtype"] == "mixed" and math.isfinite(r["kl"]) and r["kl"] >= 0 for r in recs), recs


def test_cli_eval_mixed_refuses_on_device_methods(tmp_path):
    from click.testing import CliRunner

    from sparda.cli import main

    out = tmp_path / "ev"
    result = CliRunner().invoke(main, ["eval", "--quick", "--device", "cpu", "--kv-dtype", "mixed", "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "method dense keeps its KV cache on the device" in lines[0], result.output
    assert not out.exists()


def test_bench_mixed_runs_offloaded_methods_and_skips_the_others(tmp_path):
    """``sparda bench --kv-dtype mixed``: an offloaded method's points run with the mixed
    cache (records carry it; its host store is the int4 blocks plus the bf16 pool, fewer
    bytes than bf16's); an on-device method's points are recorded ``skipped`` with the
    reason; a sweep with no offloaded method is refused before anything is written."""
    from click.testing import CliRunner

    from sparda.bench import sweep
    from sparda.cli import main

    common = dict(contexts=[1024], batches=[1], decode_steps=1, repeats=1, warmup_steps=1, breakdown_steps=0,
                  trace="none", prefill_tokens=300)
    recs = {kv: sweep.run_sweep(sweep.quick_config(str(tmp_path / kv), methods=["dense", "sparda"], kv_dtype=kv,
                                                   **common), log=lambda _: None) for kv in ("mixed", "bf16")}
    mixed = {r["method"]: r for r in recs["mixed"]}
    assert mixed["dense"]["status"] == "skipped" and mixed["dense"]["error"] == sweep.MIXED_SKIP
    assert mixed["sparda"]["status"] == "ok" and mixed["sparda"]["kv_dtype"] == "mixed"
    bf16 = {r["method"]: r for r in recs["bf16"]}["sparda"]
    assert 0 < mixed["sparda"]["host_kv_bytes"] < bf16["host_kv_bytes"]
    assert "| dense mixed | - | 1 | skipped |" in (tmp_path / "mixed" / "report.md").read_text()
    out = tmp_path / "refused"
    result = CliRunner().invoke(main, ["bench", "--quick", "--kv-dtype", "mixed", "--methods", "dense,sparse",
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --kv-dtype mixed needs an offloaded method"), result.output
    assert not out.exists()
