"""Working-set tracker against a brute-force union of the last `window` steps."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.config import PSAConfig
from sglang_psa.sched import WorkingSetTracker, always_attended_units

units = st.frozensets(
    st.tuples(st.integers(0, 2), st.integers(0, 1), st.integers(0, 5)), max_size=12
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, 3), units),
        st.tuples(st.just("forget"), st.integers(0, 3), st.just(frozenset())),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(window=st.integers(1, 5), ops=ops)
def test_matches_brute_force_union_of_window(window, ops):
    tracker = WorkingSetTracker(window)
    history: dict[int, list[frozenset]] = {}
    for op, rid, step in ops:
        if op == "record":
            tracker.record(rid, step)
            history.setdefault(rid, []).append(step)
        else:
            tracker.forget(rid)
            history.pop(rid, None)
        tracker.check_integrity()
        for r in range(4):
            steps = history.get(r, [])[-window:]
            expected = frozenset().union(*steps)
            assert tracker.working_set(r) == expected
            assert tracker.size(r) == len(expected)
            assert tracker.num_steps(r) == len(steps)
            assert tracker.is_warm(r) == (len(steps) == window)
            assert (r in tracker) == (r in history)


def test_unit_leaves_only_when_no_step_in_window_uses_it():
    tracker = WorkingSetTracker(window=2)
    tracker.record("r", {"a", "b"})
    tracker.record("r", {"a"})
    tracker.record("r", {"c"})  # step {a, b} leaves; a is still used by step {a}
    assert tracker.working_set("r") == {"a", "c"}
    tracker.record("r", {"c"})
    assert tracker.working_set("r") == {"c"}
    tracker.check_integrity()


def _warm(tracker: WorkingSetTracker, rid, size: int, total: int) -> None:
    for _ in range(tracker.window):
        tracker.record(rid, range(size), total_units=total)


def test_estimate_uses_default_until_some_request_is_warm():
    tracker = WorkingSetTracker(window=3, default_fraction=0.5)
    assert tracker.estimate_new(100) == 50
    tracker.record("young", range(1), total_units=100)  # window not full: ignored
    assert tracker.fraction() == 0.5
    _warm(tracker, "a", size=10, total=100)
    assert tracker.fraction() == pytest.approx(0.1)
    assert tracker.estimate_new(200) == 20


def test_estimate_is_pooled_floored_and_capped():
    tracker = WorkingSetTracker(window=2)
    _warm(tracker, "short", size=9, total=10)  # 90 % of a short context
    _warm(tracker, "long", size=91, total=990)  # ~9 % of a long one
    assert tracker.fraction() == pytest.approx(100 / 1000)  # weighted by slots, not 0.5
    assert tracker.estimate_new(1000) == 100
    assert tracker.estimate_new(1000, floor_units=300) == 300
    assert tracker.estimate_new(40, floor_units=300) == 40  # never more than it owns
    assert tracker.estimate_new(1) == 1  # rounds up: a request needs at least a slot
    tracker.forget("long")
    assert tracker.fraction() == pytest.approx(0.9)


@given(
    totals=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 50)), max_size=5),
    total=st.integers(0, 10_000),
    floor=st.integers(0, 10_000),
)
def test_estimate_bounds(totals, total, floor):
    tracker = WorkingSetTracker(window=1)
    for rid, (size, extra) in enumerate(totals):
        tracker.record(rid, range(size), total_units=size + extra)
    est = tracker.estimate_new(total, floor)
    assert est <= total
    assert est >= min(total, floor)
    assert est >= tracker.fraction() * total - 1e-9
    assert 0.0 <= tracker.fraction() <= 1.0


def test_always_attended_units_and_from_config():
    cfg = PSAConfig(sink_blocks=1, recent_blocks=2, ws_window=7)
    assert always_attended_units(cfg, num_blocks=100, num_layer_heads=4 * 8) == 3 * 32
    assert always_attended_units(cfg, num_blocks=2, num_layer_heads=32) == 2 * 32
    assert WorkingSetTracker.from_config(cfg).window == 7
    with pytest.raises(ValueError):
        WorkingSetTracker(0)


def test_a_size_recorded_after_several_steps_fills_the_window_by_them():
    """A size counted on the GPU and recorded every few steps (`sched.serving` records
    it every `RECORD_EVERY_STEPS`) counts the steps it covers: the window fills after as
    many decode steps as when recorded every step, never more than the window."""
    t = WorkingSetTracker(window=12)
    t.record_size("a", 40, 100, steps=8)
    assert t.num_steps("a") == 8 and not t.is_warm("a")
    t.record_size("a", 30, 100, steps=8)
    assert t.num_steps("a") == 12 and t.is_warm("a") and t.size("a") == 30
    t.record_size("b", 5)  # one step by default
    assert t.num_steps("b") == 1
    with pytest.raises(ValueError, match="steps must be positive"):
        t.record_size("b", 5, steps=0)
