"""Forecast training (design §5): teacher causality, restricted KL, a short run, weight files."""

from __future__ import annotations

import math

import pytest
import torch

from sparda.attention.forecast import Forecast, load_forecast, model_identity, save_forecast
from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.training.loss import restricted, restricted_kl, restriction, student_distribution
from sparda.training.teacher import teacher_distribution

CFG = SelectionConfig(block_size=32, kernel_size=32, kernel_stride=16, init_blocks=1, local_blocks=2,
                      topk_blocks=3, dense_len=64)


def brute_teacher(q, k, t, cfg):
    """float64 loops: fine keys (kernel 2, stride 1) visible iff j+1 <= t, per-head softmax,
    group sum, max over each grid window's fine keys, renormalised over visible grid keys."""
    _, h, g, _, d = q.shape
    out = torch.zeros(h, (k.shape[2] - cfg.kernel_size) // cfg.kernel_stride + 1, dtype=torch.float64)
    for hh in range(h):
        fine = [(k[0, hh, j] + k[0, hh, j + 1]).double() / 2 for j in range(t)]  # j + 1 <= t
        probs = torch.zeros(t, dtype=torch.float64)
        for gg in range(g):
            logits = torch.stack([q[0, hh, gg, 0].double() @ f for f in fine]) / math.sqrt(d)
            probs += torch.softmax(logits, 0)
        for i in range(out.shape[1]):
            if i * cfg.kernel_stride + cfg.kernel_size - 1 <= t:
                out[hh, i] = probs[i * cfg.kernel_stride: i * cfg.kernel_stride + cfg.kernel_size - 1].max()
        out[hh] /= out[hh].sum()
    return out


def test_teacher_matches_brute_force_and_is_strictly_causal():
    h, g, d, t_len = 2, 3, 16, 150
    q = torch.randn(1, h, g, 1, d) * 2
    k = torch.randn(1, h, t_len, d)
    t = int(torch.randint(70, t_len - 2, ()).item())
    pos = torch.tensor([[t]])
    got = teacher_distribution(q, k, pos, CFG)[0, :, 0]
    assert torch.allclose(got.double(), brute_teacher(q, k, t, CFG), atol=1e-5)
    k2 = k.clone()
    k2[:, :, t + 1:] = torch.randn_like(k2[:, :, t + 1:]) * 5  # perturb every future token
    assert torch.equal(teacher_distribution(q, k2, pos, CFG), teacher_distribution(q, k, pos, CFG))
    k3 = k.clone()
    k3[:, :, t] += 3.0  # the query's own token does change it
    assert not torch.allclose(teacher_distribution(q, k3, pos, CFG), teacher_distribution(q, k, pos, CFG))


def _pair(tq=5, t_len=300, h=2, g=2, d=16):
    q = torch.randn(1, h, g, tq, d) * 2
    k = torch.randn(1, h, t_len, d)
    pos = torch.randint(CFG.dense_len + 100, t_len, (1, tq))
    teacher = teacher_distribution(q, k, pos, CFG)
    f = torch.randn(1, h, tq, d) * 2
    ck = torch.randn(1, h, teacher.shape[-1], d)
    student = student_distribution(f, ck, pos, CFG, 1)
    return teacher, student, restriction(teacher, pos, t_len, CFG), pos


def test_rest_bucket_makes_both_sum_to_one():
    teacher, student, entries, _ = _pair()
    assert entries.any() and not entries.all()
    for dist in (teacher, student):
        r = restricted(dist, entries)
        assert torch.allclose(r.sum(-1), torch.ones(r.shape[:-1]), atol=1e-5)
        assert (r[..., -1] > 0).all()


def test_loss_zero_iff_student_matches_teacher_on_restricted_set():
    teacher, student, entries, _ = _pair()
    assert restricted_kl(teacher, student, entries).item() > 1e-3
    assert abs(restricted_kl(teacher, teacher, entries).item()) < 1e-6
    # same mass on the kept entries and in the rest bucket, redistributed outside: still zero
    outside = (~entries) & (teacher > 0)
    noise = torch.rand_like(teacher) * outside
    noise = noise / noise.sum(-1, keepdim=True) * (teacher * outside).sum(-1, keepdim=True)
    moved = torch.where(outside, noise, teacher)
    assert not torch.allclose(moved, teacher)
    assert abs(restricted_kl(teacher, moved, entries).item()) < 1e-5


def test_forty_steps_reduce_the_loss(make_tiny, tmp_path):
    from sparda.data import bundled_text
    from sparda.training.trainer import train_forecast

    text = tmp_path / "train.txt"
    text.write_text(bundled_text("persuasion")[:20000])
    out = tmp_path / "f.safetensors"
    result = train_forecast(str(make_tiny("llama")), [str(text)], seq_len=384, steps=40, batch_size=2,
                            lr=3e-3, out=out, device="cpu", save_every=15, queries=96, init="random",
                            progress=False, selection=CFG)
    assert result["step"] == 40 and out.is_file()
    # the mean loss of steps 21-40 against step 1 (one noisy step: the 30-step version fell to 0.82x once)
    assert result["loss"] < 0.8 * result["first_loss"], result
    # resume continues from the checkpoint
    again = train_forecast(str(make_tiny("llama")), [str(text)], seq_len=384, steps=42, batch_size=2, out=out,
                           device="cpu", resume=True, queries=96, init="random", progress=False, selection=CFG)
    assert again["step"] == 42


def test_weights_round_trip(tmp_path):
    from transformers import LlamaConfig

    from sparda.model.llama import ModelShape

    config = LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=100)
    shape = ModelShape.from_config(config)
    fc = Forecast.for_shape(shape)
    path = tmp_path / "w.safetensors"
    save_forecast(fc, path, model_identity(config, shape), dtype=torch.float32, step=7, preset="small")
    loaded, meta = load_forecast(path, config, shape)
    assert meta["step"] == "7" and meta["architecture"] == "llama"
    for key, value in fc.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value)
    assert set(loaded.state_dict()) == {"current.weight", "forecast.0.weight", "forecast.1.weight"}


def test_mismatched_weights_are_refused(tmp_path):
    from transformers import LlamaConfig

    from sparda.model.llama import ModelShape

    a = LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=100)
    b = LlamaConfig(hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=64, vocab_size=100)
    c = LlamaConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=80, vocab_size=100)
    path = tmp_path / "a.safetensors"
    sa = ModelShape.from_config(a)
    save_forecast(Forecast.for_shape(sa), path, {**model_identity(a, sa), "model_name": "model-A"})
    for other, name in ((b, "model-B"), (c, "model-C")):
        with pytest.raises(SpardaError) as err:
            load_forecast(path, other, ModelShape.from_config(other), name)
        message = str(err.value)
        assert "model-A" in message and name in message and "\n" not in message


def test_student_follows_the_lookahead_rule():
    """The student of layer l >= 1 sees the windows complete before the query's token, as the
    Forecast in decode (design §4); W^C_0's student sees those complete at it. float64 loop."""
    h, d, t_len = 2, 16, 300
    t = CFG.kernel_size - 1 + CFG.kernel_stride * int(torch.randint(8, 16, ()).item())  # completes a window
    f = torch.randn(1, h, 1, d) * 2
    ck = torch.randn(1, h, (t_len - CFG.kernel_size) // CFG.kernel_stride + 1, d)
    pos = torch.tensor([[t]])
    for layer in (0, 1, 3):
        got = student_distribution(f, ck, pos, CFG, layer)[0, :, 0]
        last = t if layer == 0 else t - 1
        for hh in range(h):
            visible = [j for j in range(ck.shape[2]) if j * CFG.kernel_stride + CFG.kernel_size - 1 <= last]
            logits = torch.stack([f[0, hh, 0].double() @ ck[0, hh, j].double() for j in visible]) / math.sqrt(d)
            want = torch.zeros(ck.shape[2], dtype=torch.float64)
            want[visible] = torch.softmax(logits, 0)
            assert torch.allclose(got[hh].double(), want, atol=1e-6), layer
        completed = (t + 1 - CFG.kernel_size) // CFG.kernel_stride
        assert (got[:, completed] > 0).all() == (layer == 0)
