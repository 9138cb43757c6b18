"""HBM admission: start new requests only while the running working sets fit the slot cache.

With sparse decode a request's KV lives in the host pool and only its working set must sit
in the GPU slot cache, so the limit is the sum of working sets, not of context lengths.
Working sets drift; when their sum outgrows the cache, the newest requests are retracted
(paused: their KV stays in the host pool, nothing is recomputed) until it fits again.

Requests that share a cached prompt prefix (a document asked many questions, a system
prompt) share its pages: their working sets over the prefix overlap in HBM, and together
they never need more of it than the prefix itself. A candidate names its shared prefix
(`SharedPrefix`); the controller counts each prefix's part of its holders' loads once,
capped at the prefix's size, so a document asked twelve questions costs about one
document, not twelve.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from sglang_psa.sched.estimates import WorkingSetTracker


@dataclass(frozen=True)
class SharedPrefix:
    """The first `units` of a request's `of_units` units are a prompt prefix that every
    request naming the same `key` holds too (the same pages). `key` must identify the
    prefix's content and length: two requests with equal keys share all `units`."""

    key: Hashable
    units: int
    of_units: int

    def __post_init__(self):
        if not 0 < self.units <= self.of_units:
            raise ValueError(f"need 0 < units <= of_units, got {self.units}, {self.of_units}")

    def part(self, load: int) -> int:
        """The share of a request's `load` that falls on the prefix (proportional)."""
        return load * self.units // self.of_units


@dataclass(frozen=True)
class Candidate:
    """A request asking to start (or resume) decoding; `est_units` from `estimate_new`;
    `prefix`, the cached prefix it shares, if any."""

    rid: Hashable
    prompt_tokens: int
    est_units: int
    prefix: SharedPrefix | None = None


class CannotFit(NamedTuple):
    """A new request whose working set alone is estimated larger than the whole cache."""

    candidate: Candidate
    need_units: int
    capacity_units: int

    @property
    def message(self) -> str:
        return (
            f"request {self.candidate.rid!r} ({self.candidate.prompt_tokens} prompt tokens) "
            f"needs an estimated {self.need_units} KV slots in its working set, more than the "
            f"whole GPU slot cache ({self.capacity_units}); shorten the prompt or raise "
            f"--psa-gpu-cache-gb"
        )


class AdmitResult(NamedTuple):
    """`try_admit`'s split of its candidates: every one lands in exactly one list, in order."""

    admitted: list[Candidate]  # now running
    waiting: list[Candidate]  # keep them queued, in this order
    cannot_fit: list[CannotFit]  # answer with an error (`message`); never admitted


@dataclass
class AdmissionStats:
    admitted: int = 0  # admissions, resumptions included
    retracted: int = 0
    finished: int = 0
    rejected: int = 0  # CannotFit results
    waiting: int = 0  # left waiting by the last try_admit


class AdmissionController:
    """Admission by working set, in units of slot-cache slots.

    A running request's load is its measured working set once its window is full, and
    max(estimate, measured) before (a young window understates). The units in use are
    the running loads summed, where the loads' parts on a shared prefix count at most the
    prefix's units per prefix (`SharedPrefix`). The controller owns its tracker's
    requests: record steps through `on_step`, not on the tracker directly.
    """

    def __init__(self, capacity_units: int, tracker: WorkingSetTracker):
        if capacity_units < 1:
            raise ValueError(f"capacity_units must be positive, got {capacity_units}")
        self.capacity_units = capacity_units
        self.tracker = tracker
        self.running: dict[Hashable, int] = {}  # rid -> est_units, oldest admission first
        self.paused: set[Hashable] = set()  # retracted, not finished; tracker keeps history
        self.stats = AdmissionStats()
        # Kept incrementally: Σ of the running loads off any shared prefix; per prefix key
        # [Σ of its holders' parts, its units, holders]; each running holder's prefix.
        self._own = 0
        self._shared: dict[Hashable, list[int]] = {}
        self._prefix: dict[Hashable, SharedPrefix] = {}

    def load(self, rid: Hashable, est_units: int) -> int:
        size = self.tracker.size(rid)
        return size if self.tracker.is_warm(rid) else max(est_units, size)

    @property
    def used_units(self) -> int:
        """Units the running requests hold: own parts plus each shared prefix once."""
        return self._own + sum(min(parts, units) for parts, units, _ in self._shared.values())

    @property
    def free_units(self) -> int:
        """Negative when working sets have outgrown the cache (see `retract_victims`)."""
        return self.capacity_units - self.used_units

    def used_by(self, rids: Iterable[Hashable]) -> int:
        """`used_units` of the running requests among `rids` alone."""
        own, shared = self._tally([r for r in rids if r in self.running])
        return own + sum(min(parts, units) for parts, units, _ in shared.values())

    def _tally(self, rids) -> tuple[int, dict[Hashable, list[int]]]:
        """(own parts, per prefix [parts, units, holders]) of running `rids`, from scratch."""
        own, shared = 0, {}
        for rid in rids:
            load, prefix = self.load(rid, self.running[rid]), self._prefix.get(rid)
            part = 0 if prefix is None else prefix.part(load)
            own += load - part
            if prefix is not None:
                entry = shared.setdefault(prefix.key, [0, prefix.units, 0])
                entry[0] += part
                entry[2] += 1
        return own, shared

    def cost(self, load: int, prefix: SharedPrefix | None) -> int:
        """What `load` on `prefix` adds to `used_units` beside the running requests."""
        if prefix is None:
            return load
        part = prefix.part(load)
        parts, units, _ = self._shared.get(prefix.key, (0, prefix.units, 0))
        return load - part + min(parts + part, units) - min(parts, units)

    def _charge(self, rid: Hashable, load: int, sign: int) -> None:
        """Add (`sign` 1) or take back (-1) running `rid`'s `load`."""
        prefix = self._prefix.get(rid)
        part = 0 if prefix is None else prefix.part(load)
        self._own += sign * (load - part)
        if prefix is not None:
            self._shared[prefix.key][0] += sign * part

    def _start(self, rid: Hashable, est: int, prefix: SharedPrefix | None) -> None:
        self.running[rid] = est
        self.paused.discard(rid)
        if prefix is not None:
            self._prefix[rid] = prefix
            self._shared.setdefault(prefix.key, [0, prefix.units, 0])[2] += 1
        self._charge(rid, self.load(rid, est), 1)

    def _stop(self, rid: Hashable) -> None:
        self._charge(rid, self.load(rid, self.running.pop(rid)), -1)
        prefix = self._prefix.pop(rid, None)
        if prefix is not None:
            entry = self._shared[prefix.key]
            entry[2] -= 1
            if entry[2] == 0:
                assert entry[0] == 0, "a prefix's parts outlived its holders"
                del self._shared[prefix.key]

    def try_admit(self, candidates: Iterable[Candidate]) -> AdmitResult:
        """Admit candidates in order while the running loads plus theirs fit the capacity.

        FIFO with head-of-line blocking, deliberately: the first candidate that does not
        fit stops admission of all later ones, even smaller ones that would fit, so that a
        large request is not starved by a stream of small ones. It waits for running
        requests to finish (they always do: the oldest is never retracted). Nothing is
        dropped: a candidate is admitted, left waiting, or, if it is new and its load alone
        exceeds the capacity, returned as CannotFit wherever it stands (it does not block).
        A retracted request is never CannotFit: it was accepted once, and it may resume
        alone when nothing else runs. A candidate sharing a prefix with running requests
        needs only what it adds (`cost`); CannotFit weighs its whole load. Raises
        ValueError on a duplicate or running rid.
        """
        candidates = list(candidates)
        rids = [c.rid for c in candidates]
        if len(set(rids)) != len(rids):
            raise ValueError("duplicate request ids among the candidates")
        if running := [r for r in rids if r in self.running]:
            raise ValueError(f"requests already running: {running}")
        admitted, waiting, cannot_fit = [], [], []
        for c in candidates:
            need = self.load(c.rid, c.est_units)
            if need > self.capacity_units and c.rid not in self.paused:
                cannot_fit.append(CannotFit(c, need, self.capacity_units))
            elif waiting or (
                self.running and self.used_units + self.cost(need, c.prefix) > self.capacity_units
            ):
                waiting.append(c)
            else:
                self._start(c.rid, c.est_units, c.prefix)
                admitted.append(c)
        self.stats.admitted += len(admitted)
        self.stats.rejected += len(cannot_fit)
        self.stats.waiting = len(waiting)
        return AdmitResult(admitted, waiting, cannot_fit)

    def on_step(
        self, rid: Hashable, units: Iterable[Hashable], total_units: int | None = None
    ) -> None:
        """Record the units a running request used in one decode step."""
        self._recorded(rid, lambda: self.tracker.record(rid, units, total_units))

    def on_step_size(
        self, rid: Hashable, size: int, total_units: int | None = None, steps: int = 1
    ) -> None:
        """Like `on_step`, with the window's union size counted elsewhere (on the GPU),
        after `steps` decode steps of `rid` since its last record."""
        self._recorded(rid, lambda: self.tracker.record_size(rid, size, total_units, steps))

    def _recorded(self, rid: Hashable, record) -> None:
        if rid not in self.running:
            raise KeyError(f"request {rid!r} is not running")
        est = self.running[rid]
        self._charge(rid, self.load(rid, est), -1)
        record()
        self._charge(rid, self.load(rid, est), 1)

    def retract_victims(self) -> list[Hashable]:
        """Pause the newest running requests until the loads fit; returns them, newest first.

        The oldest running request is never retracted, even if it alone exceeds the cache:
        it still makes progress (misses are read from the host pool), which rules out
        livelock. The caller requeues the victims at the front of its waiting queue; their
        history stays, so they come back with their measured working sets.
        """
        victims = []
        while self.used_units > self.capacity_units and len(self.running) > 1:
            rid = next(reversed(self.running))
            self._stop(rid)
            self.paused.add(rid)
            victims.append(rid)
        self.stats.retracted += len(victims)
        return victims

    def admit_alone(self, candidate: Candidate) -> None:
        """Admit regardless of capacity; for when nothing else runs, so a request whose
        estimate exceeds the cache still makes progress instead of stalling the server."""
        if candidate.rid in self.running:
            raise ValueError(f"request {candidate.rid!r} is already running")
        self._start(candidate.rid, candidate.est_units, candidate.prefix)
        self.stats.admitted += 1

    def pause(self, rid: Hashable) -> None:
        """The server retracted `rid` by its own choice: stop counting its load, keep its
        history so it resumes with its measured working set."""
        if rid not in self.running:
            raise KeyError(f"request {rid!r} is not running")
        self._stop(rid)
        self.paused.add(rid)
        self.stats.retracted += 1

    def finish(self, rid: Hashable) -> None:
        """Forget a running or retracted request (done or aborted). KeyError if neither."""
        if rid in self.running:
            self._stop(rid)
        elif rid in self.paused:
            self.paused.remove(rid)
        else:
            raise KeyError(f"request {rid!r} is neither running nor retracted")
        self.tracker.forget(rid)
        self.stats.finished += 1

    def check_integrity(self) -> None:
        assert not self.running.keys() & self.paused, "a request both running and retracted"
        tracked = self.tracker.steps.keys() | self.tracker.measured.keys()
        assert tracked <= self.running.keys() | self.paused, (
            "the tracker holds a request the controller does not know"
        )
        assert self._prefix.keys() <= self.running.keys(), "a prefix of a request not running"
        own, shared = self._tally(self.running)
        assert (own, shared) == (self._own, self._shared), "used_units drifted from the loads"
        self.tracker.check_integrity()
