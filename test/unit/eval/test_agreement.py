"""Greedy agreement: identical completions are counted, and a split is a near-tie only
when the other engine took a token the reference ranked within `tie` of its own choice."""

import json

import pytest

from sglang_psa.eval.agreement import compare
from sglang_psa.eval.results import dump_result


def _run(ids, gaps, third=None):
    """A completion with its top (logprob, id) per step: the chosen id, then id + 1000 at
    `gap` below it, then id + 2000 (at `third[i]` below, else 5 nats below)."""
    third = third or {}
    top = [
        [(-0.1, t), (-0.1 - g, t + 1000), (-0.1 - third.get(i, 5.0), t + 2000)]
        for i, (t, g) in enumerate(zip(ids, gaps))
    ]
    return {"ids": ids, "top": top, "text": ""}


def test_identical_and_diverging_completions_are_classified():
    ref = [
        _run([1, 2, 3, 4], [1.0, 0.1, 2.0, 0.2]),
        _run([5, 6, 7], [1.0, 1.0, 0.1]),
        _run([8, 9], [1.0, 3.0]),
        _run([10, 11], [1.0, 0.0], third={1: 0.0}),  # a three-way tie at step 1
    ]
    other = [
        _run([1, 2, 3, 4], [1.0, 0.1, 2.0, 0.2]),  # identical
        _run([5, 6, 1007], [1.0, 1.0, 0.1]),  # took the reference's 2nd choice at gap 0.1
        _run([8, 42], [1.0, 3.0]),  # a token the reference did not rank at all
        _run([10, 2011], [1.0, 0.0]),  # the third of a three-way tie
    ]
    got = compare(ref, other, tie=0.25)
    assert (got["n"], got["identical"]) == (4, 1)
    assert got["fraction_identical"] == pytest.approx(1 / 4)
    assert [(d["prompt"], d["step"], d["near_tie"]) for d in got["divergences"]] == [
        (1, 2, True),
        (2, 1, False),
        (3, 1, True),
    ]
    assert [d["chosen_rank"] for d in got["divergences"]] == [1, None, 2]
    # the unranked token's gap is unknown: null in a result file, which is valid JSON
    strict = {"parse_constant": lambda c: pytest.fail(f"{c} in a result file")}
    written = json.loads(dump_result({"data": got}), **strict)["data"]
    assert written["divergences"][1]["gap"] is None
    assert got["divergences_at_near_tie"] == 2
    # only the three-way tie is exact: it agrees; the 0.1-nat near-tie does not
    assert [d["exact_tie"] for d in got["divergences"]] == [False, False, True]
    assert got["fraction_agreeing"] == pytest.approx(2 / 4)


def test_an_exact_tie_listed_either_way_round_is_a_near_tie():
    ref = _run([1, 2], [1.0, 0.0])
    # The reference chose 2, but listed the token tied with it (1002) first.
    ref["top"][1] = [(-0.1, 1002), (-0.1, 2), (-5.1, 2002)]
    got = compare([ref], [_run([1, 1002], [1.0, 0.0])], tie=0.25)
    assert got["divergences"][0]["near_tie"] and got["divergences"][0]["gap"] == 0.0


def test_a_wide_gap_is_not_a_near_tie_and_lengths_must_match():
    ref = [_run([1, 2], [1.0, 0.9])]
    got = compare(ref, [_run([1, 1002], [1.0, 0.9])], tie=0.25)
    d = got["divergences"][0]
    assert d["chosen_rank"] == 1 and d["gap"] == pytest.approx(0.9) and not d["near_tie"]
    assert not d["exact_tie"] and got["fraction_agreeing"] == 0.0
    with pytest.raises(ValueError, match="2 to compare"):
        compare(ref, ref + ref)
