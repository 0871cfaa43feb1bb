"""``sparda calibrate-shallow`` against a brute force built on transformers' own attention
weights (eager attention, ``output_attentions``) and Python sets, on a tiny random Llama."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from sparda.attention.baselines.shallow import CALIBRATION_FILE, calibrated_layers
from sparda.config import SelectionConfig
from sparda.engine.llm import LLM
from sparda.errors import SpardaError
from sparda.eval.shallow_calibration import calibrate_shallow
from sparda.kernels import reference as ref

SMALL = dict(block_size=16, kernel_size=8, kernel_stride=4, dense_len=64, init_blocks=1, local_blocks=2, topk_blocks=3)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(make_tiny):
    return make_tiny("llama", num_hidden_layers=4)


def _free_topk(scores, t, cfg):
    """Free top-k block ids of one query at ``t`` by hand (ties to the lower block)."""
    c = t // cfg.block_size
    free = [b for b in range(c + 1) if b >= cfg.init_blocks and b <= c - cfg.local_blocks]
    return set(sorted(free, key=lambda b: (-scores[b], b))[:cfg.topk_blocks])


#: masses closer than this at the top-k boundary are a near-tie: the runtime's fp32 masses
#: (~1e-8 from the float64 brute force) may rank either block first
NEAR_TIE = 1e-6


def _free_topk_options(scores, t, cfg):
    """``[top-k]``, or with a near-tie between the k-th and (k+1)-th free block both sets."""
    c = t // cfg.block_size
    free = sorted((b for b in range(c + 1) if b >= cfg.init_blocks and b <= c - cfg.local_blocks),
                  key=lambda b: (-scores[b], b))
    k = cfg.topk_blocks
    top = set(free[:k])
    if len(free) > k and scores[free[k - 1]] - scores[free[k]] < NEAR_TIE:
        return [top, top - {free[k - 1]} | {free[k]}]
    return [top]


def _iou_choices(options, deep):
    """IoU with deep layers 2 and 3 (``[iou_2, iou_3]``) for every resolution of the near-ties
    in ``options`` ({(h, t): [set, ...]}); ``deep[d, h, t]`` the deep layers' sets."""
    multi = [key for key, opts in options.items() if len(opts) > 1]
    assert len(multi) <= 6, f"{len(multi)} near-ties: a degenerate random model"
    out = []
    for pick in itertools.product(*(range(len(options[key])) for key in multi)):
        chosen = {key: opts[0] for key, opts in options.items()}
        chosen.update({key: options[key][i] for key, i in zip(multi, pick)})
        out.append([sum(len(chosen[key] & deep[(d, *key)]) for key in chosen)
                    / sum(len(chosen[key] | deep[(d, *key)]) for key in chosen) for d in (2, 3)])
    return out


def test_calibration_matches_brute_force(tiny, tmp_path, fresh_seed):
    from transformers import AutoModelForCausalLM

    length, queries = 300, 6
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 5000, (1200,))))
    llm = LLM(str(tiny), method="dense", device="cpu", **SMALL)
    out = tmp_path / "cal.json"
    got = calibrate_shallow(text=str(text), length=length, queries=queries, candidates=(1, 2), out=str(out), llm=llm)
    assert json.loads(out.read_text())["shallow_layers"] == got["shallow_layers"]

    cfg = SelectionConfig(**SMALL)
    ids_all = llm.tokenizer.encode(text.read_text(), add_special_tokens=False)
    start = (len(ids_all) - length) // 3
    ids = torch.tensor([ids_all[start:start + length]])
    q_idx = torch.linspace(length // 2, length - 1, queries).long().unique()
    hf = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager", dtype=torch.float64)
    with torch.no_grad():
        attn = hf(ids, output_attentions=True).attentions  # per layer [1, H_q, T, T]
    s = llm.shape
    shallow = {}  # (layer, head, query) -> mass per block, averaged over the group
    for layer in range(2):
        a = attn[layer][0].view(s.num_kv_heads, s.group_size, length, length).mean(1)
        for h in range(s.num_kv_heads):
            for t in q_idx.tolist():
                shallow[layer, h, t] = [float(a[h, t, b * 16:(b + 1) * 16].sum()) for b in range(-(-length // 16))]
    deep = {}  # the deep layers' query-based free top-k (sparse, design §3.2-3.4)
    for layer, _, q, k, _, _ in llm.model.dense_layers(ids):
        if layer >= 2:
            ck = ref.compress_keys(k, cfg.kernel_size, cfg.kernel_stride).float()
            qp = q_idx.view(1, -1)
            sc = ref.pool_to_blocks(ref.query_group_scores(q[..., q_idx, :], ck, qp, 8, 4), -(-length // 16), cfg)
            for h in range(s.num_kv_heads):
                for j, t in enumerate(q_idx.tolist()):
                    deep[layer, h, t] = _free_topk(sc[0, h, j].tolist(), t, cfg)

    # the shallow sets: float64 masses, a near-tie at the top-k boundary allowing either block
    for layer in range(2):
        options = {(h, t): _free_topk_options(shallow[layer, h, t], t, cfg) for (l2, h, t) in shallow if l2 == layer}
        row = got["per_layer"][layer]
        assert any(all(row["iou_by_deep_layer"][str(d)] == pytest.approx(iou, abs=1e-4) for d, iou in zip((2, 3), ious))
                   and row["mean_iou"] == pytest.approx(sum(ious) / 2, abs=2e-4)
                   for ious in _iou_choices(options, deep)), (layer, row, _iou_choices(options, deep))
    for n in (1, 2):
        fused = {(h, t): [sum(shallow[l, h, t][b] for l in range(n)) / n for b in range(len(shallow[0, h, t]))]
                 for (l0, h, t) in shallow if l0 == 0}
        options = {key: _free_topk_options(v, key[1], cfg) for key, v in fused.items()}
        choices = [sum(ious) / 2 for ious in _iou_choices(options, deep)]
        assert any(got["fused_iou"][str(n)] == pytest.approx(c, abs=1e-4) for c in choices), (n, got["fused_iou"], choices)
    best = max((1, 2), key=lambda n: (got["fused_iou"][str(n)], -n))
    assert got["shallow_layers"] == best


def test_calibration_is_stored_with_the_model_and_used(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"w{int(i)}" for i in torch.randint(0, 5000, (900,))))
    llm = LLM(str(tiny), method="dense", device="cpu", **SMALL)
    assert calibrated_layers(tiny) is None or (tiny / CALIBRATION_FILE).exists()
    got = calibrate_shallow(text=str(text), length=200, queries=4, candidates=(1, 3), llm=llm)
    try:
        assert got["path"] == str(tiny / CALIBRATION_FILE)
        assert calibrated_layers(tiny) == got["shallow_layers"]
        shallow = LLM(str(tiny), method="shallow", device="cpu", **SMALL)
        assert shallow.method.num_shallow == got["shallow_layers"]
        assert LLM(str(tiny), method="shallow", device="cpu", shallow_layers=2, **SMALL).method.num_shallow == 2
    finally:
        (tiny / CALIBRATION_FILE).unlink()


def test_calibration_refuses_bad_input_before_running(tiny, tmp_path):
    llm = LLM(str(tiny), method="dense", device="cpu", **SMALL)
    short = tmp_path / "short.txt"
    short.write_text("only a few words")
    with pytest.raises(SpardaError, match="fewer than --length 200"):
        calibrate_shallow(text=str(short), length=200, candidates=(1, 2), llm=llm)
    with pytest.raises(SpardaError, match="--candidates must lie in 1..3"):
        calibrate_shallow(text=str(short), length=200, candidates=(2, 4), llm=llm)
    with pytest.raises(SpardaError, match="--length 10 is outside"):
        calibrate_shallow(text=str(short), length=10, candidates=(1, 2), llm=llm)
    with pytest.raises(SpardaError, match="is a directory"):
        calibrate_shallow(text=str(short), length=200, candidates=(1, 2), out=str(tmp_path), llm=llm)
