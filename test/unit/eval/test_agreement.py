"""Greedy agreement: identical completions are counted, and a split is a near-tie only
when the other engine took the reference's second choice at a small top-2 gap."""

import pytest

from sglang_psa.eval.agreement import compare


def _run(ids, gaps, second=None):
    """A completion with its top-2 (logprob, id) per step; the second choice is id + 1000."""
    top2 = [
        [(-0.1, t), (-0.1 - g, (second or {}).get(i, t + 1000))]
        for i, (t, g) in enumerate(zip(ids, gaps))
    ]
    return {"ids": ids, "top2": top2, "text": ""}


def test_identical_and_diverging_completions_are_classified():
    ref = [
        _run([1, 2, 3, 4], [1.0, 0.1, 2.0, 0.2]),
        _run([5, 6, 7], [1.0, 1.0, 0.1]),
        _run([8, 9], [1.0, 3.0]),
    ]
    other = [
        _run([1, 2, 3, 4], [1.0, 0.1, 2.0, 0.2]),  # identical
        _run([5, 6, 1007], [1.0, 1.0, 0.1]),  # took the reference's 2nd choice at gap 0.1
        _run([8, 42], [1.0, 3.0]),  # a token the reference did not even rank second
    ]
    got = compare(ref, other, tie=0.25)
    assert (got["n"], got["identical"]) == (3, 1)
    assert got["fraction_identical"] == pytest.approx(1 / 3)
    assert [(d["prompt"], d["step"], d["near_tie"]) for d in got["divergences"]] == [
        (1, 2, True),
        (2, 1, False),
    ]
    assert got["divergences_at_near_tie"] == 1


def test_a_wide_gap_is_not_a_near_tie_and_lengths_must_match():
    ref = [_run([1, 2], [1.0, 0.9])]
    got = compare(ref, [_run([1, 1002], [1.0, 0.9])], tie=0.25)
    assert got["divergences"][0]["chose_second"] and not got["divergences"][0]["near_tie"]
    with pytest.raises(ValueError, match="2 to compare"):
        compare(ref, ref + ref)
