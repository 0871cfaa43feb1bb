"""The lookahead rule (design §4) in every place that applies it.

A selector of layer ``l+1 >= 1`` (the Forecast ``F_l``, ``infinigen``) scores layer
``l+1``'s compressed keys as they stood before the query's token: the window that token
completes is not scored. Layer 0 is scored after its own append.

``SelectionConfig`` refuses budgets whose local window misses that window; at the budgets
it accepts, scoring it or not gives the same ``sparda`` masks (it only overlaps forced
blocks). So the rule is tested twice: at an accepted budget (``VALID``), and at the same
budget with ``local_blocks = 1`` set past the validation (``OBSERVABLE``), where the
completed window overlaps a block that competes for the top-k and a runtime that scores
it selects differently.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sparda.kernels import twins

from sparda.attention.forecast import Forecast, ForecastAttention
from sparda.attention.baselines.infinigen import InfiniGenAttention
from sparda.attention.offload import OffloadedForecastAttention, SpardaNoPrefetchAttention
from sparda.config import SelectionConfig, SpardaConfig
from sparda.engine.runner import ModelRunner
from sparda.errors import SpardaError
from sparda.kernels import reference as ref

# kernel 16 = block 16, stride 4: 3 of 4 windows start in the block before their last token
VALID = SelectionConfig(block_size=16, kernel_size=16, kernel_stride=4, init_blocks=1, local_blocks=2,
                        topk_blocks=2, dense_len=0)


def _observable() -> SelectionConfig:
    cfg = SelectionConfig(**dataclasses.asdict(VALID))
    object.__setattr__(cfg, "local_blocks", 1)  # refused by validation: see the module docstring
    return cfg


CONFIGS = {"valid": lambda: VALID, "observable": _observable}
METHODS = {"sparda": ForecastAttention, "sparda-offloaded": OffloadedForecastAttention,
           "sparda-no-prefetch": SpardaNoPrefetchAttention, "infinigen": InfiniGenAttention}
NEAR_TIE = 1e-4


# ----------------------------------------------------------------------------- config

def _brute_min_local(block: int, kernel: int, stride: int) -> int:
    """Smallest local window holding every completed window, by enumerating windows."""
    need = 1
    for j in range(4 * block // stride + kernel):
        t = j * stride + kernel - 1  # the token that completes window j
        need = max(need, t // block - (j * stride) // block + 1)
    return need


@pytest.mark.parametrize("block", [8, 16, 32, 64])
def test_config_refuses_a_local_window_without_the_completed_window(block):
    for stride in (s for s in (1, 2, 4, 8, 16, 32) if block % s == 0):
        for kernel in sorted({stride, 2 * stride, 3 * stride, 12, 32, 48, 70} - set(range(stride))):
            need = _brute_min_local(block, kernel, stride)
            for local in range(1, need + 2):
                fields = dict(block_size=block, kernel_size=kernel, kernel_stride=stride, local_blocks=local)
                if local < need:
                    with pytest.raises(SpardaError, match=f"--local-blocks {need} or more"):
                        SelectionConfig(**fields)
                else:
                    assert SelectionConfig(**fields).min_local_blocks == need


def test_presets_and_cli_local_blocks():
    from click.testing import CliRunner

    from sparda.cli import main

    assert SelectionConfig.from_preset("small").min_local_blocks == 2
    assert SelectionConfig.from_preset("paper").min_local_blocks == 2
    result = CliRunner().invoke(main, ["generate", "-p", "x", "--local-blocks", "1"])
    assert result.exit_code == 2 and "--local-blocks 2 or more" in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert "Traceback" not in result.output and len(errors) == 1 and "--local-blocks 2" in errors[0]


# ------------------------------------------------------------------- runs on a tiny model

@pytest.fixture(scope="module")
def tiny(make_tiny):
    """6 KV heads x 4 lookahead layers: a runtime that scores the completed window differs
    from the rule in ~30 (head, layer, step) rows of one run at ``OBSERVABLE`` (>= 18 in
    every seed tried; 2 KV heads x 2 layers gave 1-4)."""
    from sparda.engine.llm import LLM

    return LLM(str(make_tiny("llama", num_key_value_heads=6, num_hidden_layers=5)), method="dense", device="cpu")


def _use(llm, name: str, cfg: SelectionConfig, forecast: Forecast):
    """Install method ``name`` with budget ``cfg`` (block-sparse prefill) on ``llm``: the
    method's class decides whether the KV cache is offloaded (``cache.offload`` off), and the
    :class:`ModelRunner` that ``llm.prefill`` / ``decode`` / ``logits`` run through gets both."""
    llm.config = dataclasses.replace(llm.config, method="infinigen" if name == "infinigen" else "sparda",
                                     selection=cfg, sparse_prefill=True,
                                     cache=dataclasses.replace(llm.config.cache, offload=False))
    extra = {} if name == "infinigen" else {"forecast": forecast}
    llm.method = METHODS[name](llm.config, llm.shape, model=llm.model, **extra)
    llm.model_runner = ModelRunner(llm.model, llm.method, llm.config)
    return llm.method


def _run(llm, method, ids: list[int], split: int):
    """Prefill ``ids[:split]``, decode the rest one token at a time (teacher forced).

    Returns ``(masks, hidden)``: ``masks[(t, layer)]`` the ``[H, N]`` bool blocks layer
    ``layer`` read for the token at ``t``; ``hidden[layer]`` the ``[T, d_model]`` float64
    attention inputs at every position."""
    masks, hidden, layer_of = {}, {}, {}
    attend, count = method.attend, method._count

    def spy_attend(layer, q, h, cache, step):
        hidden.setdefault(layer, []).append(h[0].double())
        layer_of["now"] = layer
        return attend(layer, q, h, cache, step)

    def spy_count(cache, step, read_mask):
        if step.phase == "decode":
            assert read_mask is not None, "the test budget must select in every decode step"
            masks[(int(step.q_pos[0, -1]), layer_of["now"])] = read_mask[0].clone()
        return count(cache, step, read_mask)

    offloaded = method.offloaded
    if offloaded:  # offloaded decode counts in the slot diff: read what attention reads instead
        attend_decode = method._attend_decode

        def spy_decode(layer, q, ids, cache, step):
            read = cache.attn_ids[layer] if cache.is_offloaded(layer) else ids
            masks[(int(step.q_pos[0, -1]), layer)] = twins.ids_to_block_mask(read[0], cache.num_blocks)
            return attend_decode(layer, q, ids, cache, step)

        method._attend_decode = spy_decode
    method.attend, method._count = spy_attend, spy_count
    try:
        method.reset()
        cache = llm.new_cache(1, len(ids))
        llm.prefill(cache, 0, ids[:split])
        for t in range(split, len(ids)):
            llm.decode(cache, torch.tensor([ids[t]]), torch.tensor([t]))
    finally:
        del method.attend, method._count
        if offloaded:
            del method._attend_decode
    return masks, {layer: torch.cat(rows) for layer, rows in hidden.items()}


def _prefill_masks(llm, method, ids: list[int]):
    """Block-sparse prefill of ``ids``: ``(masks, scores)`` keyed ``(t, layer)``, each ``[H, N]``."""
    masks, scores = {}, {}
    select, block_scores = method.select, method.block_scores

    def spy_scores(layer, q, h, cache, step, k, ck, chunk):
        out = block_scores(layer, q, h, cache, step, k, ck, chunk)
        for i, t in enumerate(step.q_pos[0, chunk].tolist()):
            scores[(t, layer)] = out[0, :, i].clone()
        return out

    def spy_select(layer, q, h, cache, step, first=0):
        out = select(layer, q, h, cache, step, first)
        for i, t in enumerate(step.q_pos[0, first:].tolist()):
            masks[(t, layer)] = out[0, :, i].clone()
        return out

    method.select, method.block_scores = spy_select, spy_scores
    try:
        llm.logits(ids)
    finally:
        del method.select, method.block_scores
    return masks, scores


def _near_tie(scores: torch.Tensor, t: int, cfg: SelectionConfig) -> bool:
    """True if the top-k of one ``[N]`` score row is decided by less than NEAR_TIE (fp32
    noise between two code paths may then pick either block)."""
    cur = t // cfg.block_size
    forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
    rest = sorted((float(scores[b]) for b in range(cur + 1) if b not in forced), reverse=True)
    k = cfg.topk_blocks
    if len(rest) <= k:
        return False
    a, b = rest[k - 1], rest[k]
    # exact ties (two blocks pooling the same window) break to the lower block everywhere
    return math.isfinite(a) and math.isfinite(b) and 0 < abs(a - b) < NEAR_TIE * (1 + abs(a))


def _sequence():
    n = int(torch.randint(145, 165, ()).item())
    split = int(torch.randint(88, 96, ()).item())  # past the 80-token budget: every step selects
    return torch.randint(0, 1000, (n,)).tolist(), split


# -------------------------------------------------------------- float64 brute force

def _rope64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def _brute_masks(llm, forecast: Forecast, hidden, cfg: SelectionConfig, positions):
    """design §3-§4 with float64 Python loops: the block set each layer reads at ``t``.

    Layer ``L >= 1``: ``F_{L-1}`` of layer ``L-1``'s input at ``t`` scores layer ``L``'s
    compressed keys whose window ends before ``t``; layer 0: ``W^C_0`` of its own input
    scores its windows ending at or before ``t``. Returns ``{(t, L): [set per head]}`` and
    ``{(t, L): [near tie per head]}``."""
    s = llm.shape
    d, kernel, stride, bs = s.head_dim, cfg.kernel_size, cfg.kernel_stride, cfg.block_size
    num = max(positions) + 1
    cos, sin = (x[0, 0].double() for x in llm.model.rotary(torch.arange(num).view(1, -1), torch.float32))
    out, ties = {}, {}
    for layer in range(s.num_layers):
        wk = llm.model.model.layers[layer].self_attn.k_proj.weight.detach().double()
        keys = _rope64((hidden[layer][:num] @ wk.T).view(num, s.num_kv_heads, d).transpose(0, 1), cos, sin)
        src = hidden[layer if layer == 0 else layer - 1]
        w = forecast.scorer(layer).weight.detach().double()
        for t in positions:
            last = t if layer == 0 else t - 1  # the lookahead rule
            f = _rope64((w @ src[t]).view(s.num_kv_heads, d), cos[t], sin[t])
            cur = t // bs
            sets, near = [], []
            for head in range(s.num_kv_heads):
                block = [-math.inf] * (cur + 1)
                j = 0
                while j * stride + kernel - 1 <= last:
                    ck = keys[head, j * stride:j * stride + kernel].mean(0)
                    score = float(f[head] @ ck)
                    for b in range(j * stride // bs, min((j * stride + kernel - 1) // bs, cur) + 1):
                        block[b] = max(block[b], score)
                    j += 1
                forced = {b for b in range(cur + 1) if b < cfg.init_blocks or b > cur - cfg.local_blocks}
                rest = sorted((b for b in range(cur + 1) if b not in forced),
                              key=lambda b: (-(block[b] if block[b] > -math.inf else -1e30), b))
                sets.append(forced | set(rest[:cfg.topk_blocks]))
                near.append(_near_tie(torch.tensor(block), t, cfg))
            out[(t, layer)], ties[(t, layer)] = sets, near
    return out, ties


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("name", ["sparda", "sparda-offloaded"])
def test_decode_matches_float64_brute_force_at_every_position(tiny, name, cfg_name):
    """Every decode step from the prefill's end, windows completing at the new token included
    (``sparda-no-prefetch`` selects with the offloaded code; its masks are checked against
    prefill below)."""
    cfg = CONFIGS[cfg_name]()
    forecast = Forecast.for_shape(tiny.shape)
    ids, split = _sequence()
    method = _use(tiny, name, cfg, forecast)
    masks, hidden = _run(tiny, method, ids, split)
    positions = list(range(split, len(ids)))
    want, ties = _brute_masks(tiny, forecast, hidden, cfg, positions)
    completes = [t for t in positions if (t + 1 - cfg.kernel_size) % cfg.kernel_stride == 0]
    assert len(completes) >= 10  # steps whose token completes a window
    compared = 0
    for (t, layer), sets in want.items():
        for head, blocks in enumerate(sets):
            if ties[(t, layer)][head]:
                continue
            got = set(torch.nonzero(masks[(t, layer)][head][:t // cfg.block_size + 1]).flatten().tolist())
            assert got == blocks, (name, cfg_name, t, layer, head)
            compared += 1
    assert compared >= 0.9 * len(want) * tiny.shape.num_kv_heads


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("name", list(METHODS))
def test_prefill_masks_equal_decode_masks_at_every_position(tiny, name, cfg_name):
    """Per query token, block-sparse prefill selects what decode selects, every layer."""
    cfg = CONFIGS[cfg_name]()
    forecast = Forecast.for_shape(tiny.shape)
    ids, split = _sequence()
    method = _use(tiny, name, cfg, forecast)
    prefill, scores = _prefill_masks(tiny, method, ids)
    decode, _ = _run(tiny, method, ids, split)
    compared = 0
    for (t, layer), got in decode.items():
        valid = t // cfg.block_size + 1
        for head in range(tiny.shape.num_kv_heads):
            if _near_tie(scores[(t, layer)][head], t, cfg):
                continue
            row = scores[(t, layer)][head][:valid]
            differ = torch.nonzero(got[head][:valid] != prefill[(t, layer)][head][:valid]).flatten().tolist()
            assert torch.equal(got[head][:valid], prefill[(t, layer)][head][:valid]), (
                name, cfg_name, t, layer, head, {b: float(row[b]) for b in differ}, sorted(row.tolist())[-6:])
            compared += 1
    assert len(decode) == (len(ids) - split) * tiny.shape.num_layers
    assert compared >= 0.9 * len(decode) * tiny.shape.num_kv_heads


def _completed_window(cfg: SelectionConfig, t: int) -> int:
    assert (t + 1 - cfg.kernel_size) % cfg.kernel_stride == 0
    return (t + 1 - cfg.kernel_size) // cfg.kernel_stride


def test_infinigen_and_prefill_forecast_ignore_the_completed_window(tiny):
    """Perturbing the window the query's token completes changes layer 0's scores only."""
    cfg = VALID
    s = tiny.shape
    t = cfg.kernel_size - 1 + cfg.kernel_stride * int(torch.randint(20, 30, ()).item())
    j = _completed_window(cfg, t)
    ck = torch.randn(1, s.num_kv_heads, j + 1, s.head_dim)
    bumped = ck.clone()
    bumped[:, :, j] += 5.0
    pos = torch.tensor([[t]])
    ig = InfiniGenAttention(SpardaConfig(method="infinigen", selection=cfg), s, model=tiny.model)
    h = torch.randn(1, 1, s.hidden_size)
    cos, sin = tiny.model.rotary(pos, torch.float32)
    for layer in range(s.num_layers):
        qp = ig.partial_query(layer, h, cos, sin)
        a, b = ig.scores(layer, qp, ck, pos), ig.scores(layer, qp, bumped, pos)
        assert torch.equal(a, b) == (layer > 0), layer
        assert (a[..., j] == 0).all() == (layer > 0)
        assert (a[..., :j] > 0).all()
    forecast = Forecast.for_shape(s)
    method = _use(tiny, "sparda", cfg, forecast)
    step = tiny.model_runner._step("prefill", torch.tensor([0]), pos, t + 1)
    k = torch.zeros(1, s.num_kv_heads, t + 1, s.head_dim)
    for layer in range(s.num_layers):
        f = forecast.project(layer, h, cos, sin)  # [1, H, 1, d]
        method._queries[layer] = f
        bumped = ck.clone()
        bumped[:, :, j] = 100 * f[:, :, 0]  # the top score of every block it overlaps, if scored
        a = method.block_scores(layer, None, h, None, step, k, ck, slice(0, 1))
        b = method.block_scores(layer, None, h, None, step, k, bumped, slice(0, 1))
        assert torch.equal(a, b) == (layer > 0), layer
