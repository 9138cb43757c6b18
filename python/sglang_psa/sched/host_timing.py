"""Where SGLang's scheduler loop spends its host time, per batch kind and size: a
diagnostic that runs only with `SGLANG_PSA_HOST_TIMING=1` in the server's environment
(in every server, plain or `--sparse-mode`: the plugin's hooks wrap the loop alike).

A decode step short enough leaves the scheduler's host loop no slack: the GPU then waits
for the host between replays. The loop's iteration (from one `get_next_batch_to_run` to
the next) splits into `schedule` (choosing and preparing the next batch), `launch`
(`run_batch`: the forward's host side), `gpu_wait` (blocked on the last batch's results:
the GPU's share), `results` (processing them: tokens, finish checks, streaming) and the
rest (receiving requests). An iteration counts under the batch it launched; `gpu_wait`
and `results` under the batch they processed (in a steady decode, the same kind).

Inside the phases, the plugin's own scheduler work is timed by entry point (`timed`: the
tiered home's `make_room`, `refresh`, admission, the prefix match's own part, ...), so
that a phase's time splits into the plugin's and SGLang's without the sampling
profiler's cost to the loop.

Contract: `TIMING.snapshot()` gives cumulative sums (seconds, iterations) per
`"<kind>/<batch size>"` (kind: decode, extend, idle), for `/get_server_info`
(`internal_states[0].psa_host_timing`); `TIMING.plugin_snapshot()` cumulative calls and
seconds per plugin entry point (`psa_plugin_timing`); a client takes the difference of
two. Host-only and sync-free except `gpu_wait`, which times the synchronize SGLang itself
does first when it processes a decode batch's results.
"""

from __future__ import annotations

import functools
import gc
import os
import time

ENV = "SGLANG_PSA_HOST_TIMING"
PHASES = ("iteration", "schedule", "launch", "gpu_wait", "results")


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def batch_key(batch) -> str:
    """`"decode/<size>"`, `"extend/<size>"` or `"idle/0"` (no batch, or another mode)."""
    if batch is None:
        return "idle/0"
    mode = batch.forward_mode
    kind = "decode" if mode.is_decode() else "extend" if mode.is_extend() else "idle"
    return f"{kind}/{len(batch.reqs) if kind != 'idle' else 0}"


class HostTiming:
    """Cumulative host time of the scheduler loop by phase and batch (`PHASES`)."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.sums: dict[str, dict[str, float]] = {}
        self._started: float | None = None
        self._launched = "idle/0"
        self.plugin_sums: dict[str, dict[str, float]] = {}  # entry point -> calls, seconds
        self._gc_watched = False

    def add(self, key: str, phase: str, seconds: float) -> None:
        entry = self.sums.setdefault(key, {"n": 0} | {f"{p}_s": 0.0 for p in PHASES})
        entry[f"{phase}_s"] += seconds
        if phase == "iteration":
            entry["n"] += 1

    def begin_iteration(self, now: float) -> None:
        """A new loop iteration starts (`get_next_batch_to_run`): the last one ends."""
        if self._started is not None:
            self.add(self._launched, "iteration", now - self._started)
        self._started, self._launched = now, "idle/0"

    def launched(self, key: str) -> None:
        self._launched = key

    @property
    def launched_key(self) -> str:
        """The batch the current iteration launched so far (`"idle/0"`: none yet)."""
        return self._launched

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in sorted(self.sums.items())}

    def add_plugin(self, name: str, seconds: float) -> None:
        entry = self.plugin_sums.setdefault(name, {"n": 0, "s": 0.0})
        entry["n"] += 1
        entry["s"] += seconds

    def plugin_snapshot(self) -> dict[str, dict[str, float]]:
        return {k: dict(v) for k, v in sorted(self.plugin_sums.items())}

    def watch_gc(self) -> None:
        """From now on (once per process), each of Python's garbage collections in this
        process counts its pause under `gc.gen<generation>` in `plugin_sums`: not the
        plugin's work, but it stops the scheduler loop of every server alike (plain SGLang
        too), and a plugin entry point running when it starts counts it as well (a full
        collection scans every object the process tracks: hundreds of ms with SGLang's)."""
        if self._gc_watched:
            return
        self._gc_watched = True
        started = [0.0]

        def collector(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = self.clock()
            else:
                self.add_plugin(f"gc.gen{info['generation']}", self.clock() - started[0])

        gc.callbacks.append(collector)


TIMING = HostTiming()


def timed(name: str, on: bool | None = None):
    """Decorator: the calls of a plugin function the scheduler loop runs, and their host
    seconds, under `name` in `TIMING.plugin_sums`, when the loop is timed
    (`SGLANG_PSA_HOST_TIMING=1` when the module is imported, or `on`); otherwise the
    function itself, untouched."""

    def deco(f):
        if not (enabled() if on is None else on):
            return f

        @functools.wraps(f)
        def wrapper(*args, **kwargs):
            t0 = TIMING.clock()
            try:
                return f(*args, **kwargs)
            finally:
                TIMING.add_plugin(name, TIMING.clock() - t0)

        return wrapper

    return deco


def own_time(name: str, on: bool | None = None):
    """`timed` for an `around_*` hook `hook(original, *args)`: its own host seconds, less
    the time inside SGLang's `original` (so that a phase splits into the plugin's time
    and SGLang's)."""

    def deco(hook):
        if not (enabled() if on is None else on):
            return hook

        @functools.wraps(hook)
        def wrapper(original, *args, **kwargs):
            inner = 0.0

            def sglangs(*a, **k):
                nonlocal inner
                t = TIMING.clock()
                try:
                    return original(*a, **k)
                finally:
                    inner += TIMING.clock() - t

            t0 = TIMING.clock()
            try:
                return hook(sglangs, *args, **kwargs)
            finally:
                TIMING.add_plugin(name, TIMING.clock() - t0 - inner)

        return wrapper

    return deco
