"""Forecast training at scale (issue #16): bit-exact resume and SIGINT checkpoints, the
teacher-selected block-sparse frozen model, chunked loss = unchunked loss, the CLI with a
parquet corpus, and peak memory at 64K tokens that does not grow with the layer count."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from sparda.config import SelectionConfig
from sparda.errors import SpardaError

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = SelectionConfig(block_size=32, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=2,
                      topk_blocks=3, dense_len=64)


def _corpus(tmp_path):
    from sparda.data import bundled_text

    path = tmp_path / "train.txt"
    path.write_text(bundled_text("persuasion")[:9000])  # ~9 sequences of 256 tokens: passes wrap
    return str(path)


def _run(model, data, out, steps, **extra):
    from sparda.training.trainer import train_forecast

    kwargs = dict(seq_len=256, batch_size=2, queries=24, lr=3e-3, init="random", seed=11, save_every=4,
                  device="cpu", progress=False, selection=CFG)
    kwargs.update(extra)
    return train_forecast(model, [data], steps=steps, out=out, **kwargs)


def _state(out):
    return torch.load(out.with_name(out.name + ".state.pt"), weights_only=False)


def _assert_same_checkpoint(a, b):
    sa, sb = _state(a), _state(b)
    assert sa["step"] == sb["step"]
    for key, value in sa["forecast"].items():
        assert torch.equal(value, sb["forecast"][key]), key
    for pid, st in sa["optimizer"]["state"].items():
        for key, value in st.items():
            assert torch.equal(value, sb["optimizer"]["state"][pid][key]), (pid, key)
    assert sa["data"]["order"] == sb["data"]["order"] and torch.equal(sa["data"]["gen"], sb["data"]["gen"])
    assert sa["history"] == sb["history"]
    from safetensors import safe_open

    wa, wb = load_file(a), load_file(b)  # the bf16 weights file, metadata included
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with safe_open(a, "pt") as fa, safe_open(b, "pt") as fb:
        assert fa.metadata() == fb.metadata()


def test_resume_is_bit_exact_and_sigint_checkpoints(make_tiny, tmp_path, monkeypatch):
    model, data = str(make_tiny("llama")), _corpus(tmp_path)
    whole = tmp_path / "whole.safetensors"
    _run(model, data, whole, 20)
    split = tmp_path / "split.safetensors"
    _run(model, data, split, 10)
    once = tmp_path / "once.safetensors"  # the 10-step checkpoint, for the SIGINT run below
    once.write_bytes(split.read_bytes())
    once.with_name(once.name + ".state.pt").write_bytes(split.with_name(split.name + ".state.pt").read_bytes())
    ten = _state(split)["forecast"]
    assert not all(torch.equal(v, _state(whole)["forecast"][k]) for k, v in ten.items())
    result = _run(model, data, split, 20, resume=True)
    assert result["step"] == 20
    _assert_same_checkpoint(whole, split)

    # Ctrl-C during step 3: the step finishes, a checkpoint is written, Interrupted (exit 130)
    from sparda.training import trainer
    from sparda.training.checkpoint import Interrupted

    real = trainer.ForecastTrainer.step

    def step_with_sigint(self, step, *args):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(self, step, *args)

    monkeypatch.setattr(trainer.ForecastTrainer, "step", step_with_sigint)
    stopped = tmp_path / "stopped.safetensors"
    with pytest.raises(Interrupted, match="interrupted at step 3: checkpoint written .*--resume") as err:
        _run(model, data, stopped, 10)
    assert err.value.exit_code == 130 and _state(stopped)["step"] == 3
    monkeypatch.setattr(trainer.ForecastTrainer, "step", real)
    _run(model, data, stopped, 10, resume=True)
    _assert_same_checkpoint(once, stopped)

    with pytest.raises(SpardaError, match="trained with queries 24, this run asks for 8"):
        _run(model, data, stopped, 12, resume=True, queries=8)


def test_sparse_frozen_model_matches_the_sparse_method_prefill(make_tiny):
    """``--frozen-attention sparse``: every layer's input equals that of the runtime's
    ``sparse`` method with block-sparse prefill (an independent path: cache, method,
    chunked selection), and differs from the dense frozen model."""
    from sparda.engine.llm import LLM
    from sparda.training.frozen import frozen_attention

    fields = {f: getattr(CFG, f) for f in ("block_size", "kernel_size", "kernel_stride", "init_blocks",
                                           "local_blocks", "topk_blocks", "dense_len")}
    llm = LLM(str(make_tiny("llama")), method="sparse", device="cpu", sparse_prefill=True, **fields)
    gen = torch.Generator().manual_seed(torch.initial_seed())
    t = int(torch.randint(400, 700, (), generator=gen))
    ids = torch.randint(0, llm.model.config.vocab_size, (t,), generator=gen).tolist()
    seen = {}
    hooks = [layer.input_layernorm.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0].clone()))
             for i, layer in enumerate(llm.model.model.layers)]
    llm.logits(ids)
    for hook in hooks:
        hook.remove()
    x = torch.tensor([ids])
    with torch.no_grad():
        sparse = {i: h[0].clone() for i, h, *_ in llm.model.dense_layers(x, frozen_attention("sparse", CFG, llm.shape))}
        dense = {i: h[0].clone() for i, h, *_ in llm.model.dense_layers(x)}
    last = len(seen) - 1
    for i in range(last + 1):
        scale = seen[i].abs().max()
        assert torch.allclose(sparse[i], seen[i], atol=1e-4 * scale, rtol=0), i
    assert not torch.allclose(dense[last], seen[last], atol=1e-3 * seen[last].abs().max(), rtol=0)


def test_chunked_loss_and_accumulation_equal_one_pass(make_tiny):
    """Loss chunks of 5 query tokens give the loss and gradient of one chunk; two sequences
    accumulated one at a time give the mean of their gradients."""
    from sparda.attention.forecast import Forecast
    from sparda.model.loader import load_model
    from sparda.training.step import query_positions, sequence_loss

    net, _, _ = load_model(str(make_tiny("llama")), "cpu", torch.float32)
    net.requires_grad_(False)
    fc = Forecast.seeded(net.shape, torch.initial_seed())
    gen = torch.Generator().manual_seed(torch.initial_seed())
    seqs = [torch.randint(0, net.config.vocab_size, (320,), generator=gen) for _ in range(2)]
    grads = []
    for chunk, batch in ((None, 1), (5, 1), (None, 2)):
        fc.zero_grad(set_to_none=True)
        total = 0.0
        for j, ids in enumerate(seqs[:batch]):
            q_idx = query_positions(3, 0, j, 320, 17, CFG)
            total += sequence_loss(net, fc, ids, q_idx, CFG, scale=1.0 / batch, chunk=chunk).loss
        grads.append((total, torch.cat([p.grad.flatten() for p in fc.parameters()])))
    assert grads[0][0] == pytest.approx(grads[1][0], rel=1e-5)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-7, rtol=1e-4)
    # the second sequence alone, to check the accumulated mean
    fc.zero_grad(set_to_none=True)
    sequence_loss(net, fc, seqs[1], query_positions(3, 0, 1, 320, 17, CFG), CFG)
    second = torch.cat([p.grad.flatten() for p in fc.parameters()])
    assert torch.allclose(grads[2][1], (grads[0][1] + second) / 2, atol=1e-7, rtol=1e-4)
    q = query_positions(3, 0, 1, 320, 17, CFG)
    assert q.tolist() == sorted(set(q.tolist())) and q.min() >= 192 and q.max() < 320 and len(q) == 17
    assert not torch.equal(q, query_positions(3, 0, 0, 320, 17, CFG))


def test_cli_trains_from_parquet_with_sparse_frozen_attention(make_tiny, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from sparda.data import bundled_text

    text = bundled_text("northangerabbey")
    docs = [text[i:i + 3000] for i in range(0, 24000, 3000)]
    pq.write_table(pa.table({"body": docs}), tmp_path / "c.parquet")
    out = tmp_path / "f.safetensors"
    res = subprocess.run([sys.executable, "-m", "sparda.cli", "train-forecast", "--model", str(make_tiny("llama")),
                          "--data", str(tmp_path / "c.parquet"), "--text-column", "body", "--seq-len", "2176",
                          "--steps", "1", "--queries", "8", "--frozen-attention", "sparse", "--device", "cpu",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.splitlines()[-1])
    assert summary["step"] == 1 and summary["tokens_per_s"] > 0 and summary["loss"] > 0
    assert set(load_file(out)) >= {"current.weight", "forecast.0.weight"}
    bad = subprocess.run([sys.executable, "-m", "sparda.cli", "train-forecast", "--model", str(make_tiny("llama")),
                          "--data", str(tmp_path / "c.parquet"), "--seq-len", "2176",
                          "--out", str(tmp_path / "g.safetensors"), "--device", "cpu"],
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.startswith("error: ") and "--text-column" in bad.stderr
    assert "Traceback" not in bad.stderr and not (tmp_path / "g.safetensors").exists()


def test_sparse_frozen_attention_refuses_sliding_windows(make_tiny, tmp_path, monkeypatch):
    from sparda.model import loader
    from sparda.training.trainer import train_forecast

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking"))
    with pytest.raises(SpardaError, match="--frozen-attention sparse does not apply to sliding-window"):
        train_forecast(str(make_tiny("mistral", sliding_window=64)), None, seq_len=256, steps=1, device="cpu",
                       out=tmp_path / "f.st", frozen_attention="sparse", selection=CFG, progress=False)


_PROBE = textwrap.dedent("""
    import sys, torch
    from transformers import LlamaConfig
    from sparda.attention.forecast import Forecast
    from sparda.config import SelectionConfig
    from sparda.model.llama import CausalLM
    from sparda.training.trainer import ForecastTrainer
    layers, tokens, seed = (int(v) for v in sys.argv[1:4])
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=1,
                         num_key_value_heads=1, head_dim=16, vocab_size=256, max_position_embeddings=tokens)
    net = CausalLM(config).eval().requires_grad_(False)
    trainer = ForecastTrainer(net, Forecast.for_shape(net.shape), SelectionConfig.from_preset("small"), queries=16)
    ids = torch.randint(0, 256, (tokens,))
    def peak_kib():  # this process's peak RSS (ru_maxrss would carry the parent's over the exec)
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    before = peak_kib()
    totals = trainer.step(0, [ids], [0], 1)
    print(before, peak_kib(), totals.loss, totals.total)
""")


def test_64k_sequence_memory_is_flat_in_the_number_of_layers(tmp_path):
    """One training step on a 65,536-token sequence, 4 vs 8 layers, each in its own process
    (peak RSS, VmHWM; glibc told to return every allocation over 64 KiB, so RSS follows live
    tensors). Keeping one more ``[T, hidden]`` fp32 activation per layer would add 8 MiB
    per layer, 32 MiB over the 4 extra layers; the bound is 8 MiB."""
    tokens, seed = 65536, torch.initial_seed() % 1000
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.path.join(os.path.dirname(__file__), "..", "src"),
                                                       os.environ.get("PYTHONPATH")]))}
    procs = {layers: subprocess.Popen([sys.executable, "-c", _PROBE, str(layers), str(tokens), str(seed)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for layers in (4, 8)}
    peaks = {}
    for layers, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
        before_kib, after_kib, loss, total = out.split()
        assert float(loss) > 0 and int(total) == 16 * 16 * layers  # 16 queries x 16 free top-k per layer
        peaks[layers] = int(after_kib) * 1024
        assert peaks[layers] - int(before_kib) * 1024 > 40 * 2**20  # the step did allocate at 64K
    assert peaks[8] - peaks[4] < 8 * 2**20, peaks


def test_gpu_bench_script_smoke_on_cpu(tmp_path):
    """``benchmarks/bench_train.py throughput`` on the CPU with the tiny shape: every point ok,
    an unknown model recorded as an error (fail-soft), the JSON written."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_train.py"
    spec = importlib.util.spec_from_file_location("bench_train", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.throughput(bench.parser().parse_args(
        ["throughput", str(tmp_path), "--models", "tiny,no-such-model", "--seq-lens", "512", "--steps", "1",
         "--queries", "8"]))
    ok = [r for r in rows if r["model"] == "tiny"]
    assert [r["frozen"] for r in ok] == ["dense", "sparse"] and all(r["status"] == "ok" for r in ok)
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in ok)
    assert {r["status"] for r in rows if r["model"] == "no-such-model"} == {"error"}
    saved = json.loads((tmp_path / "train_gpu.json").read_text())
    assert saved["points"] == rows and saved["meta"]["steps"] == 1
