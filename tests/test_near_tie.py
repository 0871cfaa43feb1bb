"""The near-tie comparison of greedy outputs (tests/near_tie.py) accepts a flip at a near tie
and nothing else."""

from types import SimpleNamespace

import pytest
import torch

from near_tie import agree_up_to_a_tie


def _output(tokens, logprobs, rivals):
    """A stand-in RequestOutput: ``rivals[j]`` is ``(token, logprob)`` of the runner-up at ``j``."""
    entries = [{"token_id": t, "logprob": lp, "top_logprobs": {t: lp, r: rl}}
               for t, lp, (r, rl) in zip(tokens, logprobs, rivals)]
    return SimpleNamespace(token_ids=list(tokens), logprobs=entries)


def test_a_flip_is_accepted_at_a_near_tie_only(fresh_seed):
    n, j, tol = 12, int(torch.randint(1, 11, ())), 1e-3
    tokens = torch.randint(0, 1000, (n,)).tolist()
    lps = (-torch.rand(n) * 5).tolist()
    rivals = [(t + 1000, lp - 0.5) for t, lp in zip(tokens, lps)]
    want = _output(tokens, lps, rivals)
    noise = [lp + 1e-4 for lp in lps]
    assert agree_up_to_a_tie(_output(tokens, noise, rivals), want, tol, fresh_seed)

    near = list(rivals)
    near[j] = (tokens[j] + 1000, lps[j] - tol / 2)  # the runner-up within tol of the best at j
    want = _output(tokens, lps, near)
    flipped = tokens[:j] + [tokens[j] + 1000] + torch.randint(0, 1000, (n - j - 1,)).tolist()
    got_lps = noise[:j] + [lps[j] - tol / 4] + (-torch.rand(n - j - 1) * 5).tolist()
    def runs(tokens, lps):  # another run's outputs: runners-up far below
        return _output(tokens, lps, [(t + 1, lp - 1) for t, lp in zip(tokens, lps)])

    got = runs(flipped, got_lps)
    assert not agree_up_to_a_tie(got, want, tol, fresh_seed)  # parted at the near tie: fine

    far = _output(tokens, lps, rivals)  # the runner-up 0.5 below: no tie
    with pytest.raises(AssertionError, match="without a near tie"):
        agree_up_to_a_tie(got, far, tol, fresh_seed)
    off = list(got_lps)
    off[j - 1] += 10 * tol  # a log-probability off before the flip
    with pytest.raises(AssertionError):
        agree_up_to_a_tie(runs(flipped, off), want, tol, fresh_seed)
    stranger = flipped[:j] + [tokens[j] + 5000] + flipped[j + 1:]  # a token not among the reference's best
    with pytest.raises(AssertionError, match="not among"):
        agree_up_to_a_tie(runs(stranger, got_lps), want, tol, fresh_seed)
