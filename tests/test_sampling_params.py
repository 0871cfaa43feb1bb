"""SamplingParams validation and the scheduler's admission rules."""

import math

import pytest

from sparda import SamplingParams, SpardaError
from sparda.engine.scheduler import QueueFull, Scheduler
from sparda.engine.sequence import Sequence, Status


@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", math.nan, "temperature must be a finite number >= 0"),
    ("temperature", "1", "temperature must be"),
    ("top_p", 0.0, "top_p must be a number in (0, 1]"),
    ("top_p", 1.5, "top_p must be"),
    ("top_k", -2, "top_k must be an integer >= 1, or 0 / -1"),
    ("top_k", 2.5, "top_k must be"),
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("max_tokens", -3, "max_tokens must be an integer >= 1"),
    ("max_tokens", 2.0, "max_tokens must be an integer >= 1"),
    ("max_tokens", True, "max_tokens must be an integer >= 1"),
    ("stop", 5, "stop must be a string or a list of strings"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop_token_ids", [1, -1], "stop_token_ids must be a list of non-negative integers"),
    ("seed", 1.5, "seed must be an integer in [-2**63, 2**64 - 1] or None"),
    ("seed", 2**64, "seed must be an integer in [-2**63, 2**64 - 1]"),  # torch's generator would raise
    ("seed", -(2**63) - 1, "seed must be an integer in"),
    ("temperature", 1e-40, "a positive one at least 1e-05"),  # logits / 1e-40 overflow: NaN probabilities
    ("ignore_eos", 1, "ignore_eos must be True or False"),
    ("logprobs", 21, "logprobs must be an integer in 0..20 or None"),
])
def test_bad_fields_raise_one_line_naming_the_field(field, value, fragment):
    with pytest.raises(SpardaError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert fragment in message and f"SamplingParams.{field}" in message and "\n" not in message


def test_fields_are_normalised():
    p = SamplingParams(stop="###", stop_token_ids=[7, 9], max_tokens=None, top_k=-1)
    assert p.stop == ("###",) and p.stop_token_ids == (7, 9) and p.max_tokens is None
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy


def _seq(name, prompt_len, max_tokens):
    return Sequence(name, [1] * prompt_len, SamplingParams(max_tokens=max_tokens), max_tokens)


def test_scheduler_reserves_whole_rows_and_refuses_what_can_never_fit():
    sched = Scheduler(max_batch=2, max_model_len=100, max_waiting=2)
    with pytest.raises(SpardaError, match="prompt of 90 tokens plus max_tokens 20 exceeds --max-model-len 100; "
                                          "lower max_tokens to at most 10"):
        sched.add(_seq("a", 90, 20))
    with pytest.raises(SpardaError, match="prompt of 100 tokens does not fit --max-model-len 100"):
        sched.add(_seq("a", 100, 1))
    with pytest.raises(SpardaError, match="empty prompt"):
        sched.add(_seq("a", 0, 1))
    seqs = [_seq(str(i), 10, 90) for i in range(3)]  # 10 + 90 fits exactly
    sched.add(seqs[0])
    sched.add(seqs[1])
    with pytest.raises(QueueFull, match="2 requests waiting"):
        sched.add(seqs[2])
    first, second = sched.admit()
    assert (first.row, second.row) == (0, 1) and first.status is Status.RUNNING
    sched.add(seqs[2])
    assert sched.admit() == []  # every row in use: it waits
    sched.free(first)
    third, = sched.admit()
    assert third is seqs[2] and third.row == 0 and sched.rows_in_use == 2
    third.cancelled = True
    assert sched.drop_cancelled() == [third] and sched.rows_in_use == 2 and third.row == 0  # its row, until freed
    sched.free(third)
    assert sched.rows_in_use == 1 and third.row is None


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p, fresh_seed):
    """A top_p in (0, 1] but below float32's least subnormal (~1.4e-45) compared as 0 and
    masked every token: multinomial raised, and the server answered 500. The nucleus of a
    tiny top_p is the single most likely token: sampling it is the argmax."""
    import torch

    from sparda.engine.sampler import sample, sample_requests

    logits = torch.randn(3, 1000) * 3
    generator = torch.Generator().manual_seed(fresh_seed)
    want = logits.argmax(-1)
    assert torch.equal(sample(logits, 1.0, top_p, generator), want), f"seed {fresh_seed}"
    params = [SamplingParams(temperature=0.7, top_p=top_p, seed=fresh_seed)] * 3
    got = [tok for tok, _ in sample_requests(logits, params, [generator] * 3)]
    assert got == want.tolist(), f"seed {fresh_seed}"
