"""The two-ahead Forecast of ``lookahead=2`` (design §6.2): the option, the weight files, the
visibility rule's generalisation and training (the runtime: tests/test_lookahead2.py)."""

from __future__ import annotations

import math

import pytest
import torch

from sparda.attention.forecast import Forecast, load_forecast, model_identity, save_forecast
from sparda.config import SelectionConfig, build_config
from sparda.errors import SpardaError
from sparda.kernels import reference as ref

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=0, init_blocks=1, local_blocks=2,
             topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    """5 layers: layers 2-4 get early copies (tests/test_lookahead2.py)."""
    return make_tiny("llama", num_hidden_layers=5)


@pytest.fixture(scope="module")
def weights(tiny, tmp_path_factory):
    """``(one-layer file, two-ahead file)`` of random Forecasts (scaled up: peaky scores). The
    two-ahead head of layer ``l`` is ``F_{l+1}``'s weights, read from layer ``l``'s input: a
    prediction that overlaps the one-layer selection, so that early copies turn into hits."""
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="dense", device="cpu")
    one, two = Forecast.for_shape(llm.shape), Forecast.for_shape(llm.shape, ahead=2)
    with torch.no_grad():
        for p in one.parameters():
            p.normal_(0, 0.3)
        for layer, lin in enumerate(two.forecast):
            lin.weight.copy_(one.forecast[layer + 1].weight)
    path = tmp_path_factory.mktemp("forecast2")
    identity = model_identity(llm.model.config, llm.shape)
    save_forecast(one, path / "f1.safetensors", identity, dtype=torch.float32)
    save_forecast(two, path / "f2.safetensors", identity, dtype=torch.float32)
    return str(path / "f1.safetensors"), str(path / "f2.safetensors")


# ------------------------------------------------------------------- option and files

def test_lookahead_is_checked_once_with_one_line_errors(weights):
    assert build_config(method="sparda", offload=True).lookahead == 1
    assert build_config(method="sparda", offload=True, lookahead=2).lookahead == 2
    bad = [(dict(method="sparda", offload=True, lookahead=3), "'lookahead' must be 1 or 2"),
           (dict(method="sparda", offload=True, lookahead=True), "'lookahead' must be 1 or 2"),
           (dict(method="sparda", lookahead=2), "use --method sparda --offload"),
           (dict(method="sparda-no-prefetch", lookahead=2), "of method sparda-no-prefetch"),
           (dict(method="sparse", offload=True, lookahead=2), "of method sparse"),
           (dict(method="sparda", offload=True, forecast2=weights[1]), "add --lookahead 2")]
    for options, words in bad:
        with pytest.raises(SpardaError, match=words) as info:
            build_config(device="cpu", **options)
        assert "\n" not in str(info.value)


def test_cli_lookahead_without_offload_is_one_error_line():
    from click.testing import CliRunner

    from sparda.cli import main

    result = CliRunner().invoke(main, ["generate", "-p", "x", "--device", "cpu", "--lookahead", "2"])
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert len(errors) == 1 and "--lookahead 2" in errors[0] and "--offload" in errors[0], result.output


def test_two_ahead_weight_files_round_trip_and_refuse_the_wrong_option(tiny, weights):
    from sparda.engine.llm import LLM

    llm = LLM(str(tiny), method="dense", device="cpu")
    two, meta = load_forecast(weights[1], llm.model.config, llm.shape, ahead=2)
    assert meta["lookahead"] == "2" and two.current is None and len(two.forecast) == llm.shape.num_layers - 2
    assert list(two.targets()) == list(range(2, llm.shape.num_layers))
    one = load_forecast(weights[0], llm.model.config, llm.shape)[0]
    assert torch.equal(two.forecast[1].weight, one.forecast[2].weight)  # as the fixture wrote them
    with pytest.raises(SpardaError, match="pass the file as --forecast2"):
        load_forecast(weights[1], llm.model.config, llm.shape)
    with pytest.raises(SpardaError, match="pass the file as --forecast,"):
        load_forecast(weights[0], llm.model.config, llm.shape, ahead=2)
    with pytest.raises(IndexError):
        two.scorer(1)  # layer 1 has no two-ahead head


def test_lookahead_pos_generalises_to_two_layers_ahead():
    pos = torch.randint(0, 10_000, (2, 5))
    assert torch.equal(ref.lookahead_pos(pos, 0), pos) and torch.equal(ref.lookahead_pos(pos, 0, 0), pos)
    for target in (1, 2, 7):
        assert torch.equal(ref.lookahead_pos(pos, target), pos - 1)
    for target in (2, 7):
        assert torch.equal(ref.lookahead_pos(pos, target, 2), pos - 1)
    for target, ahead in ((1, 2), (3, -1)):
        with pytest.raises(ValueError):
            ref.lookahead_pos(pos, target, ahead)


# ----------------------------------------------------------------- training

def test_train_two_ahead_heads(tiny, tmp_path):
    """``train_forecast(lookahead=2)``: a two-ahead file that ``--forecast2`` loads, trained away from
    its query init; the loss covers layers 2.. only (``targets``) and each student reads layer
    ``l - 2``'s input (a head whose input is zeroed gets no gradient from any other layer)."""
    from sparda.attention.forecast import q_init
    from sparda.model.loader import load_model
    from sparda.training.step import query_positions, sequence_loss
    from sparda.training.trainer import train_forecast

    text = tmp_path / "t.txt"
    from sparda.data import bundled_text

    text.write_text(bundled_text("persuasion")[:20000])
    out = tmp_path / "f2.safetensors"
    result = train_forecast(str(tiny), [str(text)], seq_len=192, steps=2, batch_size=1, queries=16, out=out,
                            device="cpu", progress=False, selection=SelectionConfig(**SMALL), lookahead=2,
                            save_every=1)
    assert result["step"] == 2 and math.isfinite(result["loss"])
    net = load_model(str(tiny), torch.device("cpu"), torch.float32)[0]
    two, meta = load_forecast(out, net.config, net.shape, ahead=2)
    assert meta["lookahead"] == "2" and meta["step"] == "2"
    start = Forecast.for_shape(net.shape, ahead=2)
    q_init(start, net)
    assert all(not torch.equal(a.weight.bfloat16().float(), b.weight) for a, b in zip(start.forecast, two.forecast))
    # the student of layer l reads layer l - 2: zero the input of the head scoring layer 3 and its
    # gradient vanishes while the others' stay
    cfg = SelectionConfig(**SMALL)
    ids = torch.randint(0, 1000, (160,))
    q_idx = query_positions(0, 0, 0, 160, 16, cfg)
    walk = net.dense_layers

    def zero_layer1_input(ids_, attention=None):
        for layer, h, q, k, cos, sin in walk(ids_, attention):
            yield layer, (h * 0 if layer == 1 else h), q, k, cos, sin

    net.dense_layers = zero_layer1_input
    start.zero_grad()
    sequence_loss(net, start.requires_grad_(True), ids, q_idx, cfg)
    grads = [lin.weight.grad for lin in start.forecast]
    assert grads[1] is None or float(grads[1].abs().max()) == 0.0  # forecast[1] reads layer 1, scores 3
    assert float(grads[0].abs().max()) > 0 and float(grads[2].abs().max()) > 0
