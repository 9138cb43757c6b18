"""Admission by working set: FIFO, capacity after every operation, retraction, never dropping."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_psa.sched import AdmissionController, Candidate, WorkingSetTracker


def make(capacity: int, window: int = 2) -> AdmissionController:
    return AdmissionController(capacity, WorkingSetTracker(window))


def cand(rid, est: int) -> Candidate:
    return Candidate(rid, prompt_tokens=est * 32, est_units=est)


def test_fifo_head_of_line_blocks_smaller_later_requests():
    ctrl = make(10)
    res = ctrl.try_admit([cand("a", 6), cand("big", 5), cand("small", 1)])
    assert [c.rid for c in res.admitted] == ["a"]
    assert [c.rid for c in res.waiting] == ["big", "small"]  # small would fit; waits anyway
    assert ctrl.stats.waiting == 2 and ctrl.used_units == 6
    ctrl.finish("a")
    res = ctrl.try_admit(res.waiting)
    assert [c.rid for c in res.admitted] == ["big", "small"] and ctrl.used_units == 6
    ctrl.check_integrity()


def test_cannot_fit_is_reported_wherever_it_stands_and_does_not_block():
    ctrl = make(10)
    res = ctrl.try_admit([cand("a", 4), cand("huge", 11), cand("b", 6), cand("c", 1)])
    assert [c.rid for c in res.admitted] == ["a", "b"]
    assert [c.rid for c in res.waiting] == ["c"]
    (bad,) = res.cannot_fit
    assert bad.candidate.rid == "huge" and bad.need_units == 11 and bad.capacity_units == 10
    assert "'huge'" in bad.message and "--psa-gpu-cache-gb" in bad.message
    assert ctrl.stats.rejected == 1


def test_measured_working_set_replaces_estimate_once_window_is_full():
    ctrl = make(10, window=2)
    ctrl.try_admit([cand("a", 5)])
    ctrl.on_step("a", range(8))
    assert ctrl.used_units == 8  # young window: max(estimate, measured)
    ctrl.on_step("a", range(2))
    assert ctrl.used_units == 8  # warm: the union of both steps
    ctrl.on_step("a", range(2))
    assert ctrl.used_units == 2  # warm and smaller than the estimate
    ctrl.check_integrity()


def test_retract_newest_first_keeps_oldest_and_resumes_with_measured_set():
    ctrl = make(10, window=1)
    ctrl.try_admit([cand("old", 3), cand("mid", 3), cand("new", 3)])
    ctrl.on_step("new", range(7))
    ctrl.on_step("mid", range(2))
    ctrl.on_step("old", range(9))
    assert ctrl.used_units == 18
    assert ctrl.retract_victims() == ["new", "mid"]  # only "mid" would not suffice
    assert list(ctrl.running) == ["old"] and ctrl.paused == {"new", "mid"}
    ctrl.on_step("old", range(12))  # the oldest alone exceeds the cache: it keeps running
    assert ctrl.retract_victims() == [] and ctrl.used_units == 12
    res = ctrl.try_admit([cand("mid", 3), cand("new", 3)])
    assert res.admitted == [] and res.cannot_fit == []  # paused, not rejected
    ctrl.finish("old")
    res = ctrl.try_admit([cand("mid", 3), cand("new", 3)])
    assert [c.rid for c in res.admitted] == ["mid", "new"]
    assert ctrl.used_units == 2 + 7  # measured sets, not the estimates
    assert ctrl.stats.retracted == 2 and ctrl.stats.admitted == 5


def test_paused_request_larger_than_cache_resumes_alone():
    ctrl = make(10, window=1)
    ctrl.try_admit([cand("a", 1), cand("b", 1)])
    ctrl.on_step("b", range(15))
    assert ctrl.retract_victims() == ["b"]
    ctrl.finish("a")
    res = ctrl.try_admit([cand("b", 1), cand("c", 1)])
    assert [c.rid for c in res.admitted] == ["b"] and [c.rid for c in res.waiting] == ["c"]


def test_misuse_raises():
    ctrl = make(10)
    ctrl.try_admit([cand("a", 1)])
    with pytest.raises(ValueError, match="already running"):
        ctrl.try_admit([cand("a", 1)])
    with pytest.raises(ValueError, match="duplicate"):
        ctrl.try_admit([cand("b", 1), cand("b", 1)])
    with pytest.raises(KeyError):
        ctrl.on_step("b", [1])
    with pytest.raises(KeyError):
        ctrl.finish("b")
    assert ctrl.stats.admitted == 1


CAP, WINDOW = 40, 3


class AdmissionMachine(RuleBasedStateMachine):
    """The server's side of the protocol, with a brute-force model of every load."""

    def __init__(self):
        super().__init__()
        self.ctrl = AdmissionController(CAP, WorkingSetTracker(WINDOW))
        self.queue: list[Candidate] = []  # the server's waiting queue
        self.est: dict[int, int] = {}
        self.steps: dict[int, list[frozenset]] = {}  # every step of every request
        self.running: list[int] = []  # admission order
        self.paused: set[int] = set()
        self.finished: set[int] = set()
        self.rejected: set[int] = set()
        self.drifted = False  # a step since the last retraction may have outgrown the cache

    def load(self, rid: int) -> int:
        steps = self.steps.get(rid, [])
        size = len(frozenset().union(*steps[-WINDOW:]))
        return size if len(steps) >= WINDOW else max(self.est[rid], size)

    def used(self) -> int:
        return sum(self.load(r) for r in self.running)

    @rule(est=st.integers(1, 50))
    def arrive(self, est):
        rid = len(self.est)
        self.est[rid] = est
        self.queue.append(Candidate(rid, est * 32, est))

    @rule()
    def admit(self):
        was_idle = not self.running
        res = self.ctrl.try_admit(self.queue)
        rejected = {f.candidate.rid for f in res.cannot_fit}
        assert rejected == {
            c.rid for c in self.queue if c.rid not in self.paused and self.load(c.rid) > CAP
        }
        fitting = [c for c in self.queue if c.rid not in rejected]
        n = len(res.admitted)
        assert res.admitted == fitting[:n] and res.waiting == fitting[n:]  # FIFO prefix
        self.running += [c.rid for c in res.admitted]
        self.paused -= {c.rid for c in res.admitted}
        self.rejected |= rejected
        if res.waiting:  # maximal: the head really does not fit
            assert self.running and self.used() + self.load(res.waiting[0].rid) > CAP
        if n:  # admission itself never overfills, except one request resuming alone
            assert self.used() <= CAP or (was_idle and n == 1)
        self.queue = res.waiting

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(self.running))
        units = data.draw(st.frozensets(st.integers(0, 30), max_size=20))
        self.ctrl.on_step(rid, units)
        self.steps.setdefault(rid, []).append(units)
        self.drifted = True

    @rule()
    def retract(self):
        expected = []
        while self.used() > CAP and len(self.running) > 1:
            expected.append(self.running.pop())
        assert self.ctrl.retract_victims() == expected
        self.paused |= set(expected)
        self.queue = [
            Candidate(r, self.est[r] * 32, self.est[r]) for r in reversed(expected)
        ] + self.queue
        self.drifted = False

    @precondition(lambda self: self.running or self.paused)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.paused) + self.running))
        self.ctrl.finish(rid)
        if rid in self.paused:  # aborted while waiting to resume
            self.paused.remove(rid)
            self.queue = [c for c in self.queue if c.rid != rid]
        else:
            self.running.remove(rid)
        self.steps.pop(rid, None)
        self.finished.add(rid)

    @invariant()
    def consistent(self):
        self.ctrl.check_integrity()
        assert list(self.ctrl.running) == self.running
        assert self.ctrl.paused == self.paused
        assert self.ctrl.used_units == self.used()
        if not self.drifted:
            assert self.used() <= CAP or len(self.running) <= 1
        # Never dropped: every request that arrived is in exactly one place.
        places = [{c.rid for c in self.queue}, set(self.running), self.finished, self.rejected]
        assert sum(len(p) for p in places) == len(self.est) == len(set().union(*places))
        assert self.paused <= places[0]


AdmissionMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_admission_machine = AdmissionMachine.TestCase
