"""Greedy outputs of two runs whose logits agree only to rounding: equal up to a near tie."""

from __future__ import annotations

import pytest


def agree_up_to_a_tie(got, want, tol: float, where) -> bool:
    """Assert that ``got``'s greedy tokens and log-probabilities equal ``want``'s up to a near
    tie; return whether every token agreed.

    ``got`` / ``want``: :class:`sparda.RequestOutput` of the same greedy request, run with
    ``logprobs >= 2``. Two runs a rounding apart (a K/V element of an int8 store a summation
    order apart rounds to the neighbouring code; fp32 GEMMs of another row count) may choose
    differently where ``want``'s best two tokens are within ``tol``. Up to the first token that
    differs the log-probabilities agree within ``tol``; at it ``got``'s choice must be among
    ``want``'s top log-probabilities, at most ``tol`` below ``want``'s best, with its own
    log-probability within ``tol`` of ``want``'s for it. Past it the continuations are other
    texts and are not compared. Raises ``AssertionError`` naming ``where``.
    """
    ours, theirs = got.token_ids, want.token_ids
    assert len(ours) == len(theirs), (where, len(ours), len(theirs))
    same = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    lp, ref = [e["logprob"] for e in got.logprobs], [e["logprob"] for e in want.logprobs]
    assert lp[:same] == pytest.approx(ref[:same], abs=tol), where
    if same == len(ours):
        return True
    mine, best = got.logprobs[same], want.logprobs[same]
    rival = best["top_logprobs"].get(mine["token_id"])
    assert rival is not None, (where, f"token {same}: {mine['token_id']} is not among the reference's best "
                                      f"{len(best['top_logprobs'])}: {best['top_logprobs']}")
    assert best["logprob"] - rival <= tol, (where, f"token {same} differs without a near tie", mine, best)
    assert abs(mine["logprob"] - rival) <= tol, (where, f"token {same}", mine, best)
    return False
