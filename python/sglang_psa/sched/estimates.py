"""Working sets: the KV units each decoding request touched in its last `window` steps.

Sparse decode attends a different subset of blocks at every step, but consecutive steps
overlap heavily. The union over a short window (`--psa-ws-window`, 12 by default) is what
a request needs resident in the HBM slot cache to decode without reading the host pool,
so admission (admission.py) sums these unions against the slot-cache capacity.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Hashable, Iterable

from sglang_psa.config import PSAConfig


class WorkingSetTracker:
    """Per request: the unit set of each of its last `window` steps, and their union.

    A unit is any hashable id of one slot's worth of KV, typically (layer, kv_head, block).
    `counts[rid]` maps each unit to the number of window steps that used it, so its keys
    are exactly the union: `size` is O(1) and `record` costs O(units entering + leaving).
    """

    def __init__(self, window: int, default_fraction: float = 0.5):
        if window < 1:
            raise ValueError(f"window must be positive, got {window}")
        if not 0.0 < default_fraction <= 1.0:
            raise ValueError(f"default_fraction must be in (0, 1], got {default_fraction}")
        self.window = window
        self.default_fraction = default_fraction
        self.steps: dict[Hashable, deque[frozenset[Hashable]]] = {}
        self.counts: dict[Hashable, Counter[Hashable]] = {}
        self.total_units: dict[Hashable, int] = {}  # rid -> all units it owns (last reported)
        # Requests whose window union is measured elsewhere (the GPU counts it): rid ->
        # (union size, steps seen, at most `window`).
        self.measured: dict[Hashable, tuple[int, int]] = {}

    @classmethod
    def from_config(cls, config: PSAConfig, default_fraction: float = 0.5) -> WorkingSetTracker:
        return cls(config.ws_window, default_fraction)

    def record(
        self, rid: Hashable, units: Iterable[Hashable], total_units: int | None = None
    ) -> None:
        """Add one decode step of `rid` that used `units`; the oldest step leaves the window.

        `total_units` (all units the request owns now, e.g. layers × kv_heads × blocks) is
        optional; when given, the request's measured share feeds `estimate_new`.
        """
        step = frozenset(units)
        steps = self.steps.setdefault(rid, deque())
        counts = self.counts.setdefault(rid, Counter())
        steps.append(step)
        counts.update(step)
        if len(steps) > self.window:
            for unit in steps.popleft():
                if counts[unit] == 1:
                    del counts[unit]
                else:
                    counts[unit] -= 1
        if total_units is not None:
            self.total_units[rid] = total_units

    def record_size(
        self, rid: Hashable, size: int, total_units: int | None = None, steps: int = 1
    ) -> None:
        """`steps` decode steps of `rid` (since its last record) whose window union,
        `size`, was counted elsewhere (e.g. on the GPU from per-block last-use stamps),
        instead of unit sets."""
        if rid in self.steps:
            raise ValueError(f"{rid!r} is tracked by unit sets; do not mix the two")
        if steps < 1:
            raise ValueError(f"steps must be positive, got {steps}")
        steps = min(self.window, self.measured.get(rid, (0, 0))[1] + steps)
        self.measured[rid] = (size, steps)
        if total_units is not None:
            self.total_units[rid] = total_units

    def working_set(self, rid: Hashable) -> set[Hashable]:
        """Union of the units `rid` used in its window (a copy; empty if unknown)."""
        return set(self.counts.get(rid, ()))

    def size(self, rid: Hashable) -> int:
        if rid in self.measured:
            return self.measured[rid][0]
        return len(self.counts.get(rid, ()))

    def num_steps(self, rid: Hashable) -> int:
        """Steps in the window so far (at most `window`)."""
        if rid in self.measured:
            return self.measured[rid][1]
        return len(self.steps.get(rid, ()))

    def is_warm(self, rid: Hashable) -> bool:
        """True once the window is full: before that the union is still growing."""
        return self.num_steps(rid) >= self.window

    def forget(self, rid: Hashable) -> None:
        self.steps.pop(rid, None)
        self.counts.pop(rid, None)
        self.total_units.pop(rid, None)
        self.measured.pop(rid, None)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self.steps or rid in self.measured

    def _pooled(self) -> tuple[int, int]:
        """(Σ working-set size, Σ total units) over warm requests with a known total."""
        warm = [r for r, n in self.total_units.items() if n > 0 and self.is_warm(r)]
        return sum(self.size(r) for r in warm), sum(self.total_units[r] for r in warm)

    def fraction(self) -> float:
        """Share of their units that warm requests keep in their working sets, pooled."""
        used, total = self._pooled()
        return used / total if total else self.default_fraction

    def estimate_new(self, total_units: int, floor_units: int = 0) -> int:
        """Working set to reserve for a request that has not decoded yet.

        min(total_units, max(floor_units, ceil(fraction() × total_units))). Why this shape:
        with a fixed model and threshold, sparse attention keeps a fairly stable share of
        a context's blocks, so the share measured on the running requests predicts a
        newcomer's. It is pooled (Σ size / Σ total) so that long requests, which hold most
        slots, weigh most, and it uses only warm requests: a window still filling would
        understate it. With nothing measured yet, `default_fraction` stands in; erring high
        is the cheap side (it delays admission until the first request warms up, where
        erring low causes retractions). `floor_units` is what every step touches whatever
        the scores (see `always_attended_units`). A request never needs more than it owns.
        """
        used, total = self._pooled()
        share = -(-used * total_units // total) if total else self.default_fraction * total_units
        estimate = max(floor_units, math.ceil(share))
        return min(total_units, estimate)

    def check_integrity(self) -> None:
        assert self.steps.keys() == self.counts.keys(), "steps and counts track different requests"
        assert not self.steps.keys() & self.measured.keys(), "a request tracked both ways"
        assert self.total_units.keys() <= self.steps.keys() | self.measured.keys(), (
            "a total for an untracked request"
        )
        assert all(0 < n <= self.window for _, n in self.measured.values())
        for rid, steps in self.steps.items():
            assert len(steps) <= self.window, f"{rid!r}: window overflow"
            counts = self.counts[rid]
            assert all(n > 0 for n in counts.values()), f"{rid!r}: zero count kept"
            assert counts == Counter(u for step in steps for u in step), f"{rid!r}: counts drift"


def always_attended_units(config: PSAConfig, num_blocks: int, num_layer_heads: int) -> int:
    """Units every decode step touches: the sink and recent blocks (the tail block is one
    of the recent ones) of each of the `num_layer_heads` (layer, kv_head) pairs."""
    return min(num_blocks, config.sink_blocks + config.recent_blocks) * num_layer_heads
