"""The scheduler loop's host timing (`SGLANG_PSA_HOST_TIMING=1`): a loop driven through
the hooks as SGLang's overlap loop calls them, on a fake clock, gives each phase's time
under the batch it belongs to; off, the hooks only pass through."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_psa.plugin import host_timing as hooks
from sglang_psa.plugin import scheduling
from sglang_psa.sched import host_timing


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def batch(kind: str, n: int):
    mode = SimpleNamespace(is_decode=lambda: kind == "decode", is_extend=lambda: kind == "extend")
    return SimpleNamespace(forward_mode=mode, reqs=[object()] * n)


class Event:
    def __init__(self, clock, wait):
        self.clock, self.wait, self.done = clock, wait, False

    def synchronize(self):
        if not self.done:  # the first synchronize waits for the GPU, later ones return
            self.clock.advance(self.wait)
            self.done = True


@pytest.fixture
def timing(monkeypatch):
    clock = Clock()
    t = host_timing.HostTiming(clock)
    monkeypatch.setattr(hooks, "TIMING", t)
    monkeypatch.setattr(hooks, "_ON", True)
    return t, clock


def step(clock, b, last, last_result, schedule=0.3e-3, launch=0.2e-3, process=0.5e-3):
    """One overlap-loop iteration: schedule `b`, launch it, process the last batch."""

    def get_next(sched, running_batch, last_batch):
        clock.advance(schedule)
        return SimpleNamespace(batch_to_run=b)

    def run(sched, bb):
        clock.advance(launch)
        return SimpleNamespace(copy_done=Event(clock, 1e-3))

    def process_result(sched, bb, result):
        result.copy_done.synchronize()  # SGLang's own first line
        clock.advance(process)

    hooks.around_get_next_batch_to_run(get_next, None, running_batch=None, last_batch=last)
    result = hooks.around_run_batch(run, None, b)
    if last is not None:
        hooks.around_process_batch_result(process_result, None, last, last_result)
    return result


def test_a_decode_loop_splits_into_schedule_launch_gpu_wait_and_results(timing):
    t, clock = timing
    d = batch("decode", 32)
    last, res = None, None
    for _ in range(5):  # 5 iterations; the 5th ends when a 6th begins
        res, last = step(clock, d, last, res), d
        clock.advance(0.1e-3)  # receiving requests: in the iteration, in no phase
    hooks.around_get_next_batch_to_run(lambda s, **kw: None, None, running_batch=None,
                                       last_batch=d)  # fmt: skip
    got = t.snapshot()["decode/32"]
    assert got["n"] == 5
    assert got["schedule_s"] == pytest.approx(5 * 0.3e-3)
    assert got["launch_s"] == pytest.approx(5 * 0.2e-3)
    assert got["gpu_wait_s"] == pytest.approx(4 * 1e-3)  # 4 batches' results processed
    assert got["results_s"] == pytest.approx(4 * 0.5e-3)
    # the first iteration processed nothing; the others waited 1 ms and processed 0.5
    assert got["iteration_s"] == pytest.approx(5 * 0.6e-3 + 4 * 1.5e-3)
    assert t.snapshot()["idle/0"]["schedule_s"] == 0.0  # the last call found no batch


def test_extend_batches_count_apart_and_their_results_are_not_presynchronized(timing):
    t, clock = timing
    e = batch("extend", 3)
    res = step(clock, e, None, None)
    seen = []
    res.copy_done = SimpleNamespace(synchronize=lambda: seen.append("sync"))
    hooks.around_process_batch_result(lambda s, b, r: clock.advance(2e-3), None, e, res)
    got = t.snapshot()["extend/3"]
    assert seen == [] and got["gpu_wait_s"] == 0.0
    assert got["results_s"] == pytest.approx(2e-3)


def test_off_the_hooks_pass_through_and_report_nothing(monkeypatch):
    monkeypatch.setattr(hooks, "_ON", False)
    t = host_timing.HostTiming()
    monkeypatch.setattr(hooks, "TIMING", t)
    d = batch("decode", 8)
    assert hooks.around_run_batch(lambda s, b: "ran", None, d) == "ran"
    res = SimpleNamespace(copy_done=None)
    assert hooks.around_process_batch_result(lambda s, b, r: "done", None, d, res) == "done"
    assert t.snapshot() == {}
    state: dict = {}
    hooks.server_info(state)
    assert state == {}


def test_server_info_carries_the_sums_in_a_plain_server_too(timing, monkeypatch):
    t, clock = timing
    t.add("decode/4", "launch", 0.25)
    t.add_plugin("decode_check", 0.125)
    monkeypatch.setattr(scheduling, "_serving", lambda: None)  # no --sparse-mode
    out = scheduling.after_get_internal_state(SimpleNamespace(internal_state={}), None, None)
    assert out.internal_state["psa_host_timing"]["decode/4"]["launch_s"] == 0.25
    assert out.internal_state["psa_plugin_timing"] == {"decode_check": {"n": 1, "s": 0.125}}
    assert "psa" not in out.internal_state


def test_batch_keys():
    assert host_timing.batch_key(None) == "idle/0"
    assert host_timing.batch_key(batch("decode", 7)) == "decode/7"
    assert host_timing.batch_key(batch("extend", 2)) == "extend/2"
    assert host_timing.batch_key(batch("idle", 5)) == "idle/0"


def test_a_hooks_own_time_leaves_out_sglangs_and_a_timed_function_counts_whole(monkeypatch):
    """The plugin's share of a phase (`psa_plugin_timing`): an `around_*` hook's time less
    the time inside SGLang's `original` (also when that raises), a plain function's whole;
    off, both are the functions themselves."""
    clock = Clock()
    t = host_timing.HostTiming(clock)
    monkeypatch.setattr(host_timing, "TIMING", t)

    def sglang(x):
        clock.advance(5e-3)
        if x < 0:
            raise ValueError(x)
        return x + 1

    def hook(original, x):
        clock.advance(2e-3)  # the plugin's work before
        out = original(x)
        clock.advance(1e-3)  # ... and after
        return out

    timed_hook = host_timing.own_time("admit", on=True)(hook)
    assert timed_hook(sglang, 1) == 2
    with pytest.raises(ValueError):
        timed_hook(sglang, -1)  # 2 ms of its own, then SGLang's raised
    plan = host_timing.timed("plan_decode", on=True)(lambda: clock.advance(4e-3))
    plan()
    got = t.plugin_snapshot()
    assert got["admit"]["n"] == 2 and got["admit"]["s"] == pytest.approx(3e-3 + 2e-3)
    assert got["plan_decode"] == {"n": 1, "s": pytest.approx(4e-3)}
    assert host_timing.own_time("admit", on=False)(hook) is hook
    assert host_timing.timed("plan_decode", on=False)(plan) is plan


def test_the_loops_timing_counts_pythons_collections_by_generation(timing):
    """Python's garbage collections pause the scheduler loop (a full one scans every
    object the process tracks): once the loop is timed, each counts under
    `gc.gen<generation>` in `psa_plugin_timing`, once however often the loop asks."""
    import gc

    t, clock = timing
    b = batch("decode", 4)
    step(clock, b, None, None)
    step(clock, b, b, SimpleNamespace(copy_done=Event(clock, 0)))  # asks to watch again
    try:
        before = t.plugin_snapshot().get("gc.gen2", {"n": 0})["n"]
        gc.collect()
        gc.collect(0)
        snap = t.plugin_snapshot()
        assert snap["gc.gen2"]["n"] == before + 1  # one callback: counted once
        assert snap["gc.gen0"]["n"] >= 1 and snap["gc.gen2"]["s"] >= 0
    finally:
        gc.callbacks[:] = [c for c in gc.callbacks if getattr(c, "__qualname__", "").split(
            ".")[0] != "HostTiming"]  # fmt: skip
