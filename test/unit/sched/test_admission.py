"""Admission by working set: FIFO, capacity after every operation, retraction, never dropping."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_psa.sched import AdmissionController, Candidate, SharedPrefix, WorkingSetTracker


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


def test_a_shared_prefix_counts_once_among_its_holders_up_to_its_size():
    ctrl = make(100, window=1)
    doc = SharedPrefix("doc", units=40, of_units=50)  # 4/5 of each holder's load
    ctrl.try_admit([Candidate(q, 1600, 25, doc) for q in "abcd"])
    # own parts 4 x 5; the parts on the document 4 x 20 = 80, counted as its 40 units
    assert len(ctrl.running) == 4 and ctrl.used_units == 20 + 40
    assert ctrl.cost(25, doc) == 5 and ctrl.cost(25, None) == 25
    res = ctrl.try_admit([Candidate("e", 1600, 25, doc), Candidate("lone", 1600, 40)])
    assert [c.rid for c in res.admitted] == ["e"] and ctrl.used_units == 65  # "lone": 105
    assert ctrl.used_by(["a", "b"]) == 10 + 40 and ctrl.used_by(["a"]) == 25
    ctrl.on_step("a", range(50))  # measured: 50 units, 40 of them on the document
    assert ctrl.used_units == 30 + 40
    ctrl.on_step("a", range(250))  # own part 50: the document still counts 40
    assert ctrl.used_units == 70 + 40
    assert ctrl.retract_victims() == ["e", "d"] and ctrl.used_units == 60 + 40
    ctrl.check_integrity()
    for rid in "abc":
        ctrl.finish(rid)
    assert ctrl.used_units == 0 and not ctrl._shared and not ctrl._prefix
    ctrl.check_integrity()
    with pytest.raises(ValueError, match="units"):
        SharedPrefix("doc", units=60, of_units=50)


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
DOC_UNITS = {0: 20, 1: 35}  # two shared documents, most of their holders


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
        self.prefix: dict[int, SharedPrefix] = {}  # running requests' shared prefixes
        self.drifted = False  # a step since the last retraction may have outgrown the cache

    def load(self, rid: int) -> int:
        steps = self.steps.get(rid, [])
        size = len(frozenset().union(*steps[-WINDOW:]))
        return size if len(steps) >= WINDOW else max(self.est[rid], size)

    def used(self, extra: Candidate | None = None) -> int:
        """Σ loads, each prefix's parts (load × units // of_units) summed up to its units."""
        items = [(self.load(r), self.prefix.get(r)) for r in self.running]
        if extra is not None:
            items.append((self.load(extra.rid), extra.prefix))
        own, parts, units = 0, {}, {}
        for load, prefix in items:
            part = 0 if prefix is None else load * prefix.units // prefix.of_units
            own += load - part
            if prefix is not None:
                parts[prefix.key] = parts.get(prefix.key, 0) + part
                units[prefix.key] = prefix.units
        return own + sum(min(parts[k], units[k]) for k in parts)

    @rule(est=st.integers(1, 50), doc=st.sampled_from([None, 0, 1]))
    def arrive(self, est, doc):
        rid = len(self.est)
        self.est[rid] = est
        prefix = (
            None if doc is None else SharedPrefix(doc, DOC_UNITS[doc], DOC_UNITS[doc] + est // 4)
        )
        self.queue.append(Candidate(rid, est * 32, est, prefix))

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
        self.prefix.update({c.rid: c.prefix for c in res.admitted if c.prefix is not None})
        self.paused -= {c.rid for c in res.admitted}
        self.rejected |= rejected
        if res.waiting:  # maximal: the head really does not fit
            assert self.running and self.used(res.waiting[0]) > CAP
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
            self.prefix.pop(expected[-1], None)
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
            self.prefix.pop(rid, None)
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
