"""Task generators (deterministic, answer really in the prompt), scoring and metrics (design §8)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sparda.config import SelectionConfig
from sparda.errors import SpardaError
from sparda.eval import metrics
from sparda.eval.tasks import DEPTHLESS, TASKS, make_sample
from sparda.eval.tasks.common import NOISE, insert_at_depths
from sparda.eval.tasks.passkey import make_passkey, passkey_correct

HAYSTACK = ("It was a fine morning in Highbury. Emma walked to the village.\n" * 40 +
            "Mr. Knightley called upon them, and they spoke of many things.\n" * 40)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generators_are_deterministic_and_hold_the_answer(task, bundled_tokenizer, fresh_seed):
    seed, depth = fresh_seed % 1000, random.choice([0.0, 0.3, 0.5, 1.0])
    length = random.choice([700, 1100])
    a = make_sample(task, bundled_tokenizer, HAYSTACK, length, depth, seed)
    b = make_sample(task, bundled_tokenizer, HAYSTACK, length, depth, seed)
    c = make_sample(task, bundled_tokenizer, HAYSTACK, length, depth, seed + 1)
    assert a == b and a.prompt == b.prompt
    assert a.prompt != c.prompt
    for answer in a.answers:
        assert answer in a.prompt
    # the prompt is about the requested length
    n = len(bundled_tokenizer.encode(a.prompt, add_special_tokens=False))
    assert 0.85 * length <= n <= length + 16, n
    assert (a.depth is None) == (task in DEPTHLESS)


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_lands_at_requested_depth(depth, bundled_tokenizer):
    sample = make_sample("niah-single", bundled_tokenizer, HAYSTACK, 1500, depth, 3)
    body = sample.prompt[:sample.prompt.rfind("\n\n")]
    where = body.find("special magic number") / len(body)
    assert abs(where - depth) < 0.06


def test_cwe_common_words_are_most_frequent(bundled_tokenizer):
    sample = make_sample("cwe", bundled_tokenizer, "", 1500, 0.5, random.randrange(100))
    words = [line.split(". ", 1)[1] for line in sample.prompt.splitlines() if line[:1].isdigit()]
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=counts.get, reverse=True)[:len(sample.answers)]
    assert set(top) == set(sample.answers)


def test_vt_chain_is_in_order(bundled_tokenizer):
    sample = make_sample("vt", bundled_tokenizer, "", 1200, 0.5, random.randrange(100))
    names = sample.answers
    pos = [sample.prompt.find(f"VAR {n} =") for n in names]
    assert pos == sorted(pos) and min(pos) >= 0
    assert f"VAR {names[1]} = VAR {names[0]} ." in sample.prompt


def test_insert_keeps_order_on_ties():
    text = NOISE * 3
    out = insert_at_depths(text, [(0.5, "FIRST."), (0.5, "SECOND.")])
    assert out.index("FIRST.") < out.index("SECOND.")


def test_bad_inputs_raise(bundled_tokenizer):
    with pytest.raises(SpardaError):
        make_sample("nope", bundled_tokenizer, HAYSTACK, 500, 0.5, 0)
    with pytest.raises(SpardaError):
        make_sample("niah-single", bundled_tokenizer, HAYSTACK, 500, 1.5, 0)
    with pytest.raises(SpardaError):
        make_sample("niah-multivalue", bundled_tokenizer, HAYSTACK, 40, 0.5, 0)


def test_passkey_api_still_works(bundled_tokenizer):
    s = make_passkey(bundled_tokenizer, HAYSTACK, 600, 0.5, 7)
    assert passkey_correct(s, f"The key is {s.answer}.") and not passkey_correct(s, "no idea")


def test_scoring():
    assert metrics.contains(("12345",), "The pass key is 12345.") == 1.0
    assert metrics.contains(("12345",), "1234") == 0.0
    assert metrics.fraction_found(("ABCDE", "FGHIJ", "KLMNO"), "abcde, KLMNO") == pytest.approx(2 / 3)
    assert metrics.fraction_found(("cat",), "concatenate") == 0.0  # whole words only
    assert metrics.exact_match(("Paris",), "  paris. ") == 1.0
    assert metrics.exact_match(("a", "b"), "a, b") == 1.0
    assert metrics.exact_match(("Paris",), "It is Paris") == 0.0


def test_compare_logits_matches_brute_force():
    t, v = random.randint(5, 40), random.randint(7, 50)
    ref, got = torch.randn(t, v) * 3, torch.randn(t, v) * 3
    targets = torch.randint(0, v, (t,))
    m = metrics.compare_logits(got, ref, targets, chunk=7)
    nll = kl = agree = 0.0
    for i in range(t):
        p = [math.exp(x) for x in ref[i].double().tolist()]
        q = [math.exp(x) for x in got[i].double().tolist()]
        sp, sq = sum(p), sum(q)
        p, q = [x / sp for x in p], [x / sq for x in q]
        nll -= math.log(q[targets[i]])
        kl += sum(a * math.log(a / b) for a, b in zip(p, q))
        agree += max(range(v), key=p.__getitem__) == max(range(v), key=q.__getitem__)
    assert m["positions"] == t
    assert m["nll_sum"] == pytest.approx(nll, rel=1e-9)
    assert m["kl_sum"] == pytest.approx(kl, rel=1e-9)
    assert m["agree_sum"] == agree
    same = metrics.compare_logits(ref, ref, targets)
    assert same["kl_sum"] == pytest.approx(0, abs=1e-9) and same["agree_sum"] == t


def test_budget_topk():
    sel = SelectionConfig.from_preset("small")
    assert metrics.budget_topk(25, 8192, sel) == 32 - 5
    assert metrics.budget_topk(1, 4096, sel) == 0
    blocks = -(-8000 // 64)
    total = metrics.budget_topk(50, 8000, sel) + sel.init_blocks + sel.local_blocks
    assert abs(total - blocks / 2) <= 1
    with pytest.raises(SpardaError):
        metrics.budget_topk(0, 4096, sel)


def _tracker_steps(rng, batch=3, layers=2, heads=2, blocks=9, block_size=4, steps=7):
    """Random decode masks of a batch whose rows sit at different positions; layer 1 skips
    one step of row 0 (a step the dense fallback would not select in)."""
    start = torch.tensor([int(v) for v in rng.integers(0, 10, size=batch)])
    out = []
    for t in range(steps):
        for layer in range(layers):
            if layer == 1 and t == 3:
                continue
            mask = torch.from_numpy(rng.random((batch, heads, 1, blocks)) > 0.5)
            out.append((layer, start + t, mask))
    return out, start


def _brute_hits(steps, row, first, last):
    """Blocks selected at position p also selected by the same row and layer at p - 1, over
    positions first..last, with Python sets."""
    seen, hits, sel = {}, 0, 0
    for layer, pos, mask in steps:
        p = int(pos[row])
        now = {tuple(x) for x in mask[row, :, 0].nonzero().tolist()}
        before = seen.get((layer, p - 1))
        if before is not None and first <= p <= last:
            hits += len(now & before)
            sel += len(now)
        seen[(layer, p)] = now
    return hits / sel if sel else None


def test_hit_rate_tracker_per_row_against_sets():
    import numpy as np

    rng = np.random.default_rng(torch.initial_seed())

    class Step:
        phase = "decode"

        def __init__(self, pos):
            self.q_pos = pos.view(-1, 1)

    steps, start = _tracker_steps(rng)

    class Fake:
        class selection:
            block_size = 4

        def __init__(self):
            self.calls = iter(steps)

        def select(self, layer, q, h, cache, step):
            return next(self.calls)[2]

    method = Fake()
    tracker = metrics.HitRateTracker(method)
    for layer, pos, _ in steps:
        method.select(layer, None, None, None, Step(pos))
    spans = [(int(start[0]) + 1, int(start[0]) + 5), (int(start[1]), int(start[1]) + 6), (0, -1)]
    got = tracker.take_rows(spans)
    for row, (first, last) in enumerate(spans):
        want = _brute_hits(steps, row, first, last)
        assert got[row] == (pytest.approx(want, abs=1e-12) if want is not None else None), row
    assert tracker.take_rows(spans) == [None, None, None]  # taken: reset


def test_hit_rate_tracker_records_without_host_syncs(monkeypatch):
    """What a captured CUDA graph needs: after the first (eager warm-up) step no buffer is
    reallocated and no step reads a device value on the host."""
    import numpy as np

    class Step:
        phase = "decode"

        def __init__(self, pos):
            self.q_pos = pos.view(-1, 1)

    steps, _ = _tracker_steps(np.random.default_rng(torch.initial_seed()))

    class Fake:
        class selection:
            block_size = 4

        def __init__(self):
            self.calls = iter(steps)

        def select(self, layer, q, h, cache, step):
            return next(self.calls)[2]

    method = Fake()
    tracker = metrics.HitRateTracker(method)
    for layer, pos, _ in steps[:2]:  # warm-up: allocates
        method.select(layer, None, None, None, Step(pos))
    pointers = (tracker._hits.data_ptr(), tracker._selected.data_ptr(),
                *(t.data_ptr() for t in tracker._prev.values()), *(t.data_ptr() for t in tracker._last_pos.values()))

    def sync(*a, **k):
        raise AssertionError("host sync while recording")

    for name in ("item", "tolist", "cpu", "__bool__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    for layer, pos, _ in steps[2:]:
        method.select(layer, None, None, None, Step(pos))
    monkeypatch.undo()
    assert pointers == (tracker._hits.data_ptr(), tracker._selected.data_ptr(),
                        *(t.data_ptr() for t in tracker._prev.values()),
                        *(t.data_ptr() for t in tracker._last_pos.values()))
