"""The scheduler loop's sampling profile (`SGLANG_PSA_HOST_PROFILE`): samples are counted
under the loop phase the host-timing hooks are in and filed under the decode batch their
iteration launched, with exact inclusive and self counts per function; a real sampler
thread reads a real busy thread's stack."""

from __future__ import annotations

import sys
import threading
import time
from types import SimpleNamespace

import pytest

from sglang_psa.plugin import host_timing as hooks
from sglang_psa.sched import host_profile, host_timing


def outer(fn):
    return fn()


def inner():
    return None


def frames_of(*codes):
    """A fake innermost frame whose stack is `codes` (innermost first)."""
    frame = None
    for code in reversed(codes):
        frame = SimpleNamespace(f_code=code, f_back=frame)
    return frame


class FakeThreads:
    """`sys._current_frames` for one thread whose stack the test sets."""

    def __init__(self, tid):
        self.tid, self.stack = tid, None

    def __call__(self):
        return {self.tid: self.stack} if self.stack is not None else {}


def test_rate_is_read_from_the_environment_and_a_bad_one_names_the_variable():
    assert host_profile.rate_hz({}) == 0.0
    assert host_profile.rate_hz({host_profile.ENV: "0"}) == 0.0
    assert host_profile.rate_hz({host_profile.ENV: "500"}) == 500.0
    for bad in ("fast", "-1", "1e9"):
        with pytest.raises(ValueError, match=host_profile.ENV):
            host_profile.rate_hz({host_profile.ENV: bad})


def _package(root):
    for d in (root / "pkg", root / "pkg" / "sub"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "__init__.py").write_text("")
    return root / "pkg"


def test_function_names_start_at_the_import_root(tmp_path):
    roots = ("/tmp/psa-site", "/opt/v/lib/python3.12/site-packages", "/work/main/python")
    code = SimpleNamespace(
        co_filename="/opt/v/lib/python3.12/site-packages/sglang/srt/managers/scheduler.py",
        co_name="run_batch",
        co_firstlineno=2140,
    )
    name = "sglang/srt/managers/scheduler.py:run_batch:2140"
    assert host_profile.function_name(code, roots) == name
    code.co_filename = "/tmp/psa-site/sglang/srt/managers/scheduler.py"  # pip --target
    assert host_profile.function_name(code, roots) == name
    code.co_filename = "/work/main/python/sglang_psa/sched/serving.py"
    assert host_profile.function_name(code, roots).startswith("sglang_psa/sched/serving.py:")
    code.co_filename = "/elsewhere/deep/pkg/mod.py"  # not under a root: its last two parts
    assert host_profile.function_name(code, roots).startswith("pkg/mod.py:")
    # under no root (an editable install's import finder): from above its package folders
    loose = SimpleNamespace(co_name="f", co_firstlineno=1)
    loose.co_filename = str(_package(tmp_path) / "sub" / "mod.py")
    assert host_profile.function_name(loose, roots) == "pkg/sub/mod.py:f:1"
    # this process's own roots: this package from wherever it was imported
    real = host_profile.function_name(host_profile.function_name.__code__)
    assert real.startswith("sglang_psa/sched/host_profile.py:function_name:")


def test_samples_count_by_phase_and_function_under_their_iterations_batch():
    threads = FakeThreads(7)
    p = host_profile.HostProfile(1000, frames=threads)
    p.thread_id = 7
    o, i = outer.__code__, inner.__code__
    threads.stack = frames_of(i, o)  # inner called from outer
    p.phase = "schedule"
    p.sample()
    p.sample()
    threads.stack = frames_of(o)
    p.phase = "launch"
    p.sample()
    p.end_iteration("decode/32")
    threads.stack = frames_of(i, o)
    p.sample()
    p.end_iteration("extend/3")  # prefill iterations: every size under one key
    p.sample()
    p.sample()
    p.end_iteration("extend/1")
    p.sample()
    p.end_iteration("idle/0")  # idle iterations are not kept
    threads.stack = None  # the thread is gone: no sample
    p.sample()
    p.end_iteration("decode/32")
    got = p.snapshot()
    assert list(got) == ["decode/32", "extend"]
    assert got["extend"]["samples"] == 3 and got["extend"]["phases"] == {"launch": 3}
    d = got["decode/32"]
    assert d["samples"] == 3 and d["phases"] == {"schedule": 2, "launch": 1}
    name_o, name_i = host_profile.function_name(o), host_profile.function_name(i)
    assert d["functions"][f"schedule|{name_o}"] == [2, 0]
    assert d["functions"][f"schedule|{name_i}"] == [2, 2]
    assert d["functions"][f"launch|{name_o}"] == [1, 1]


def test_a_recursive_function_counts_once_per_sample_inclusive():
    threads = FakeThreads(1)
    p = host_profile.HostProfile(1000, frames=threads)
    p.thread_id = 1
    o = outer.__code__
    threads.stack = frames_of(o, o, o)
    p.sample()
    p.end_iteration("decode/1")
    assert p.snapshot()["decode/1"]["functions"][f"other|{host_profile.function_name(o)}"] == [1, 1]


def test_a_sampler_thread_reads_a_busy_threads_real_stack():
    def spin(stop):
        while not stop.is_set():
            sum(range(100))

    stop = threading.Event()
    worker = threading.Thread(target=spin, args=(stop,))
    worker.start()
    p = host_profile.HostProfile(2000)
    switch = sys.getswitchinterval()
    try:
        p.start(worker.ident)
        # the GIL handed over within a quarter period, so samples come when asked
        assert sys.getswitchinterval() <= 0.25 / 2000
        time.sleep(0.3)
    finally:
        p.stop()
        stop.set()
        worker.join()
        sys.setswitchinterval(switch)
    p.end_iteration("decode/1")
    d = p.snapshot()["decode/1"]
    spin_key = f"other|{host_profile.function_name(spin.__code__)}"
    assert d["samples"] >= 5
    assert d["functions"][spin_key][0] == d["samples"]  # on the stack in every sample


@pytest.fixture
def profiled(monkeypatch):
    clock = SimpleNamespace(t=0.0)
    t = host_timing.HostTiming(lambda: clock.t)
    threads = FakeThreads(threading.get_ident())
    threads.stack = frames_of(outer.__code__)
    p = host_profile.HostProfile(1000, frames=threads)
    p.start = lambda tid: setattr(p, "thread_id", tid)  # sampled by hand below
    monkeypatch.setattr(hooks, "TIMING", t)
    monkeypatch.setattr(hooks, "_ON", True)
    monkeypatch.setattr(hooks, "PROFILE", p)
    return p


def test_the_hooks_mark_the_phase_each_sample_lands_in(profiled):
    p = profiled
    mode = SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)
    d = SimpleNamespace(forward_mode=mode, reqs=[object()] * 4)
    done = SimpleNamespace(synchronize=p.sample)  # the GPU wait is sampled once

    def get_next(sched, **kw):
        p.sample()
        return SimpleNamespace(batch_to_run=d)

    def run(sched, b):
        p.sample()
        p.sample()
        return SimpleNamespace(copy_done=done)

    def process(sched, b, r):
        p.sample()

    for _ in range(2):
        hooks.around_get_next_batch_to_run(get_next, None, running_batch=None, last_batch=d)
        res = hooks.around_run_batch(run, None, d)
        p.sample()  # between phases: other
        hooks.around_process_batch_result(process, None, d, res)
    hooks.around_get_next_batch_to_run(lambda s, **kw: None, None, last_batch=d)
    got = p.snapshot()["decode/4"]
    assert got["phases"] == {"schedule": 2, "launch": 4, "other": 2, "gpu_wait": 2, "results": 2}
    state: dict = {}
    hooks.server_info(state)
    assert state["psa_host_profile"]["decode/4"]["samples"] == 12
