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


def test_hit_rate_tracker():
    class Step:
        phase = "decode"

    masks = [torch.rand(1, 2, 1, 9) > 0.5 for _ in range(4)]

    class Fake:
        def __init__(self):
            self.calls = iter(masks)

        def select(self, layer, q, h, cache, step):
            return next(self.calls)

    method = Fake()
    tracker = metrics.HitRateTracker(method)
    for _ in masks:
        method.select(0, None, None, None, Step())
    hits = sum((a & b).sum().item() for a, b in zip(masks, masks[1:]))
    sel = sum(m.sum().item() for m in masks[1:])
    expected = hits / sel if sel else None
    got = tracker.take()
    assert got == pytest.approx(expected) if expected is not None else got is None
    assert tracker.take() is None
