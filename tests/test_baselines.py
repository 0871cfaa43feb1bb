"""The seeds' selectors (streaming, h2o, quest, snapkv, shallow) against float64 brute force.

A model-free driver feeds random queries/keys/values of a few layers through a real
``DeviceKVCache`` and each method's ``attend``, as ``CausalLM.forward`` does: one prefill
per row (rows of different lengths, none a multiple of the block size), then decode steps
of the whole batch on the static capacity-sized views. An independent reference written
with Python loops over blocks and float64 maths re-derives, per step, layer, row and KV
head, the blocks the method must read (with its own state: accumulated mass, evictions,
page bounds, the observation window's votes, the shallow layers' EMA) and the exact
attention over them; outputs and the blocks-read counters must match. Budgets: one that
selects, one under the dense fallback (``dense_len`` above every length) and one larger
than the context (nothing may be dropped).
"""

from __future__ import annotations

import math

import pytest
import torch

from sparda.attention.registry import METHOD_CLASSES
from sparda.cache.device import DeviceKVCache
from sparda.config import SelectionConfig, SpardaConfig
from sparda.model.llama import ModelShape, StepInfo

H, D, LAYERS, STEPS = 2, 8, 4, 10
pytestmark = pytest.mark.usefixtures("one_thread")
BASE = dict(block_size=8, kernel_size=4, kernel_stride=2, init_blocks=1, local_blocks=2, topk_blocks=2, dense_len=20)
BUDGETS = {"select": {}, "dense-len": {"dense_len": 10_000}, "budget": {"topk_blocks": 10_000}}


def _lengths(gen) -> list[int]:
    """Two long rows and one that starts under dense_len 20, none a multiple of 8."""
    out = []
    for lo, hi in ((41, 75), (30, 60), (5, 13)):
        while True:
            n = int(torch.randint(lo, hi, (1,), generator=gen))
            if n % 8:
                out.append(n)
                break
    return out


def drive(name, group, cfg, options=None, sparse_prefill=False, seed=0):
    """Run a method on random inputs; returns ``(inputs, lengths, prefill outputs, decode outputs, cache)``.

    ``inputs[l] = (q [B, H, G, T, d], k, v [B, H, T, d])`` fp32; decode output
    ``outs[s][l]`` is ``[B, H, G, d]``; prefill ``pre[r][l]`` is ``[H, G, T_r, d]``.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = _lengths(gen)
    batch, total = len(lengths), max(lengths) + STEPS
    shape = ModelShape(LAYERS, H * group, H, D, 16, 4096)
    config = SpardaConfig(method=name, selection=cfg, sparse_prefill=sparse_prefill, **(options or {}))
    method = METHOD_CLASSES[name](config, shape)
    cache = DeviceKVCache(LAYERS, batch, H, D, total + 3, cfg, torch.float32, "cpu")
    inputs = [(torch.randn(batch, H, group, total, D, generator=gen) * 1.5,
               torch.randn(batch, H, total, D, generator=gen) * 1.5,
               torch.randn(batch, H, total, D, generator=gen)) for _ in range(LAYERS)]
    method.reset()
    pre = []
    with torch.inference_mode():
        for r, t in enumerate(lengths):
            pos = torch.arange(t).view(1, -1)
            step = StepInfo("prefill", torch.tensor([r]), pos, torch.tensor([t]),
                            torch.ones(1, 1, t, D), torch.zeros(1, 1, t, D), t)
            outs = []
            for layer, (q, k, v) in enumerate(inputs):
                cache.append(layer, k[r:r + 1, :, :t], v[r:r + 1, :, :t], step)
                outs.append(method.attend(layer, q[r:r + 1, :, :, :t], torch.zeros(1, t, 16), cache, step)[0])
            pre.append(outs)
        dec = []
        rows = torch.arange(batch)
        for s in range(STEPS):
            pos = torch.tensor(lengths) + s
            step = StepInfo("decode", rows, pos.view(-1, 1), pos + 1, torch.ones(batch, 1, 1, D),
                            torch.zeros(batch, 1, 1, D), cache.capacity, int(pos.max()) + 1)
            outs = []
            for layer, (q, k, v) in enumerate(inputs):
                cache.append(layer, k[rows, :, pos].unsqueeze(2), v[rows, :, pos].unsqueeze(2), step)
                qs = q[rows, :, :, pos].unsqueeze(3)  # [B, H, G, 1, d]
                outs.append(method.attend(layer, qs, torch.zeros(batch, 1, 16), cache, step)[:, :, :, 0])
            dec.append(outs)
    return inputs, lengths, pre, dec, cache


# ----------------------------------------------------------------- float64 reference
def rule(scores, t, cfg):
    """The selection rule, by hand: blocks for a query at ``t`` from ``scores[b]`` (None = unscored)."""
    c = t // cfg.block_size
    valid = list(range(c + 1))
    if t + 1 < cfg.dense_len or c + 1 <= cfg.init_blocks + cfg.local_blocks + cfg.topk_blocks:
        return set(valid)
    forced = {b for b in valid if b < cfg.init_blocks or b > c - cfg.local_blocks}
    free = [b for b in valid if b not in forced]
    scored = sorted((b for b in free if scores[b] is not None), key=lambda b: (-scores[b], b))
    unscored = [b for b in free if scores[b] is None]
    return forced | set((scored + unscored)[:cfg.topk_blocks])


def attention(q, k, v, t, blocks, bs):
    """Exact softmax attention of ``q [G, d]`` over the tokens ``<= t`` of ``blocks``; float64.
    Returns ``(out [G, d], mass per block {b: sum over G})``."""
    toks = torch.tensor([i for b in sorted(blocks) for i in range(b * bs, min((b + 1) * bs, t + 1))])
    kk, vv = k[toks].double(), v[toks].double()
    p = torch.softmax(q.double() @ kk.T / math.sqrt(q.shape[-1]), dim=-1)  # [G, n]
    per_block = torch.zeros(t // bs + 1, dtype=torch.float64).index_add_(0, toks // bs, p.sum(0))
    return p @ vv, {b: float(per_block[b]) for b in blocks}


def causal_dense(q, k, v):
    """Dense causal attention of ``q [G, T, d]`` over ``k, v [T, d]`` (positions 0..T-1), float64."""
    t = q.shape[1]
    logits = q.double() @ k[:t].double().T / math.sqrt(q.shape[-1])
    logits = logits.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v[:t].double()


def dense_mass(q, k, t, bs):
    """Per-block attention mass of one query ``q [G, d]`` at ``t`` over every key ``<= t``."""
    return attention(q, k, k, t, range(t // bs + 1), bs)[1]


class Reference:
    """Per-method block choice by hand; ``blocks(s, layer, r, h, t)`` is called in step order."""

    def __init__(self, name, cfg, inputs, lengths, options):
        self.name, self.cfg, self.inputs, self.lengths, self.opt = name, cfg, inputs, lengths, options
        self.bs = cfg.block_size
        self.acc, self.evicted, self.fixed, self.ema = {}, {}, {}, {}
        for r, t in enumerate(lengths):
            for h in range(H):
                if name == "h2o":
                    for layer in range(LAYERS):
                        q, k, _ = (x[r, h] for x in inputs[layer])
                        acc = {}
                        for i in range(t):
                            for b, m in dense_mass(q[:, i], k, i, self.bs).items():
                                acc[b] = acc.get(b, 0.0) + m
                        self.acc[layer, r, h], self.evicted[layer, r, h] = acc, set()
                if name == "snapkv":
                    for layer in range(LAYERS):
                        self.fixed[layer, r, h] = self._snapkv(layer, r, h, t)
                if name == "shallow":
                    cur = self._shallow_mass(r, h, t - 1)
                    self.ema[r, h] = cur
                    chosen = rule(cur, t - 1, cfg)
                    start = max((t - 1) // self.bs - cfg.local_blocks + 1, 0)
                    self.fixed[r, h] = ({b for b in chosen if b < start}, start)

    def _snapkv(self, layer, r, h, t):
        q, k, _ = (x[r, h] for x in self.inputs[layer])
        w = min(self.opt.get("snapkv_window", 32), t)
        votes = [0.0] * t
        for i in range(t - w, t):
            p = torch.softmax(q[:, i].double() @ k[:i + 1].double().T / math.sqrt(D), dim=-1)
            for j in range(i + 1):
                votes[j] += float(p[:, j].sum())
        pooled = [max(votes[max(0, j - 3):j + 4]) for j in range(t)]
        scores = [sum(pooled[b * self.bs:(b + 1) * self.bs]) for b in range(-(-t // self.bs))]
        chosen = rule(scores, t - 1, self.cfg)
        start = max(min((t - 1) // self.bs - self.cfg.local_blocks + 1, (t - w) // self.bs), 0)
        return {b for b in chosen if b < start}, start

    def _shallow_mass(self, r, h, t):
        n = self.opt["shallow_layers"]
        total = [0.0] * (t // self.bs + 1)
        for layer in range(n):
            q, k, _ = (x[r, h] for x in self.inputs[layer])
            for b, m in dense_mass(q[:, t], k, t, self.bs).items():
                total[b] += m / q.shape[0] / n
        return total

    def blocks(self, layer, r, h, t):
        cfg, bs = self.cfg, self.bs
        c = t // bs
        q, k, _ = (x[r, h] for x in self.inputs[layer])
        if self.name == "streaming":
            if t + 1 < cfg.dense_len or c + 1 <= cfg.init_blocks + cfg.local_blocks + cfg.topk_blocks:
                return set(range(c + 1))
            return {b for b in range(c + 1) if b < cfg.init_blocks or b > c - cfg.local_blocks - cfg.topk_blocks}
        if self.name == "quest":
            page = self.opt.get("quest_page_size", 16)
            scores = []
            for b in range(c + 1):
                best = None
                for j in range(b * bs // page, (b + 1) * bs // page):
                    if (j + 1) * page - 1 > t:
                        continue
                    if (layer, r, h, j) not in self.fixed:
                        kp = k[j * page:(j + 1) * page].double()
                        self.fixed[layer, r, h, j] = kp.min(0).values, kp.max(0).values
                    lo, hi = self.fixed[layer, r, h, j]
                    qd = q[:, t].double()
                    bound = float(torch.maximum(qd * lo, qd * hi).sum())
                    best = bound if best is None else max(best, bound)
                scores.append(best)
            return rule(scores, t, cfg)
        if self.name == "h2o":
            acc, evicted = self.acc[layer, r, h], self.evicted[layer, r, h]
            chosen = rule([acc.get(b, 0.0) for b in range(c + 1)], t, cfg)
            assert not chosen & evicted, ("an evicted block returned", layer, r, h, t)
            evicted |= set(range(c + 1)) - chosen
            return chosen
        if self.name == "snapkv":
            fixed, start = self.fixed[layer, r, h]
            return {b for b in range(c + 1) if b in fixed or b >= start}
        if self.name == "shallow":
            if layer < self.opt["shallow_layers"]:
                return set(range(c + 1))
            if self.opt.get("shallow_select_once"):
                fixed, start = self.fixed[r, h]
                return {b for b in range(c + 1) if b in fixed or b >= start}
            if t != self.ema.get(("step", r, h)):  # the first deep layer of this step
                cur = self._shallow_mass(r, h, t)
                prev = self.ema[r, h] + [0.0] * (len(cur) - len(self.ema[r, h]))
                self.ema[r, h] = [0.7 * a + 0.3 * b for a, b in zip(cur, prev)]
                self.ema["step", r, h] = t
                self.ema["mask", r, h] = rule(self.ema[r, h], t, cfg)
            return self.ema["mask", r, h]
        raise AssertionError(self.name)

    def after(self, layer, r, h, t, blocks):
        """Decode bookkeeping after attention (h2o adds the mass of what was read)."""
        if self.name == "h2o":
            q, k, v = (x[r, h] for x in self.inputs[layer])
            for b, m in attention(q[:, t], k, v, t, blocks, self.bs)[1].items():
                self.acc[layer, r, h][b] = self.acc[layer, r, h].get(b, 0.0) + m


def check(name, group, budget, options=None, sparse_prefill=False, seed=0):
    cfg = SelectionConfig(**{**BASE, **BUDGETS[budget]})
    options = options or {}
    inputs, lengths, pre, dec, cache = drive(name, group, cfg, options, sparse_prefill, seed)
    ref = Reference(name, cfg, inputs, lengths, options)
    read = valid = 0
    for r, t in enumerate(lengths):  # prefill: dense, or per-token selection with sparse_prefill
        for layer, (q, k, v) in enumerate(inputs):
            for h in range(H):
                if not sparse_prefill:
                    want = causal_dense(q[r, h, :, :t], k[r, h], v[r, h])
                    assert torch.allclose(pre[r][layer][h].double(), want, atol=1e-4, rtol=1e-4), (name, r, layer, h)
                    continue
                for i in range(t):
                    blocks = ref.blocks(layer, r, h, i)
                    want, _ = attention(q[r, h, :, i], k[r, h], v[r, h], i, blocks, cfg.block_size)
                    got = pre[r][layer][h, :, i]
                    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), (name, "prefill", r, layer, h, i)
    for s in range(STEPS):
        # reference order of state updates per step: layers in order, rows, heads
        for layer, (q, k, v) in enumerate(inputs):
            for r, t0 in enumerate(lengths):
                t = t0 + s
                for h in range(H):
                    blocks = ref.blocks(layer, r, h, t)
                    want, _ = attention(q[r, h, :, t], k[r, h], v[r, h], t, blocks, cfg.block_size)
                    ref.after(layer, r, h, t, blocks)
                    got = dec[s][layer][r, h]
                    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), (
                        name, "decode step", s, "layer", layer, "row", r, "head", h, sorted(blocks))
                    read += len(blocks)
                    valid += t // cfg.block_size + 1
    assert cache.read_fraction() == pytest.approx(read / valid, abs=1e-12)
    if budget != "select":
        assert read == valid  # the dense fallback, or a budget over the context, drops nothing
    return read / valid


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_streaming(group, budget, fresh_seed):
    frac = check("streaming", group, budget, seed=fresh_seed)
    assert budget != "select" or frac < 0.9


@pytest.mark.parametrize("group", [1, 3])
def test_streaming_sparse_prefill(group, fresh_seed):
    check("streaming", group, "select", sparse_prefill=True, seed=fresh_seed)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_quest(group, budget, fresh_seed):
    check("quest", group, budget, {"quest_page_size": 4}, seed=fresh_seed)


@pytest.mark.parametrize("group", [1, 4])
def test_quest_sparse_prefill_and_whole_block_pages(group, fresh_seed):
    check("quest", group, "select", {"quest_page_size": 4}, sparse_prefill=True, seed=fresh_seed)
    check("quest", group, "select", {"quest_page_size": 8}, seed=fresh_seed + 1)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_h2o(group, budget, fresh_seed):
    check("h2o", group, budget, seed=fresh_seed)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_snapkv(group, budget, fresh_seed):
    check("snapkv", group, budget, {"snapkv_window": 6}, seed=fresh_seed)


@pytest.mark.parametrize("budget", list(BUDGETS))
@pytest.mark.parametrize("group", [1, 3, 4])
def test_shallow(group, budget, fresh_seed):
    check("shallow", group, budget, {"shallow_layers": 2}, seed=fresh_seed)


@pytest.mark.parametrize("group", [1, 3])
def test_shallow_select_once(group, fresh_seed):
    check("shallow", group, "select", {"shallow_layers": 2, "shallow_select_once": True}, seed=fresh_seed)
    check("shallow", group, "budget", {"shallow_layers": 1, "shallow_select_once": True}, seed=fresh_seed + 1)


@pytest.mark.parametrize("group", [1, 3])
def test_h2o_prefill_mass_from_the_sdpa_backward(group, fresh_seed, monkeypatch):
    """h2o's prefill block mass (the gradient SDPA's backward gives V) equals the summed
    probabilities of an fp64 softmax: whole prompts, a later chunk (queries at the last
    ``Tq`` of ``T`` key positions) and queries split to stay under MASS_CHUNK_BYTES (the
    CPU path of ``kernels.prefill_block_mass``; the Triton kernel's own tests are in
    tests/kernels/test_attention_mass.py)."""
    from sparda import kernels
    from sparda.kernels import twins

    gen = torch.Generator().manual_seed(fresh_seed)
    for total, tq, chunk_bytes in ((53, 53, 1 << 28), (77, 20, 1 << 28), (64, 64, 4 * 2 * group * 64 * 5)):
        monkeypatch.setattr(twins, "MASS_CHUNK_BYTES", chunk_bytes)
        q = torch.randn(1, 2, group, tq, D, generator=gen) * 2
        k = torch.randn(1, 2, total, D, generator=gen) * 2
        with torch.inference_mode():
            got = kernels.prefill_block_mass(q, k, 8)
        pos = torch.arange(total - tq, total)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", q.double(), k.double()) / math.sqrt(D)
        logits = logits.masked_fill(torch.arange(total).view(1, -1) > pos.view(-1, 1), float("-inf"))
        probs = torch.softmax(logits, dim=-1).sum((2, 3))  # [1, H, T]
        want = torch.nn.functional.pad(probs, (0, -total % 8)).view(1, 2, -1, 8).sum(-1)
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        assert abs(float(got.sum()) - 2 * group * tq) < 1e-3
