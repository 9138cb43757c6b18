"""The scheduler loop's host timing (`sched.host_timing`) and, with
`SGLANG_PSA_HOST_PROFILE`, its sampling profile by phase (`sched.host_profile`): hooks
that pass straight through unless `SGLANG_PSA_HOST_TIMING=1`."""

from __future__ import annotations

import threading

from sglang_psa.sched import host_profile
from sglang_psa.sched.host_timing import TIMING, batch_key, enabled

_ON = enabled()  # read once per process: the hooks run on every loop iteration
PROFILE = host_profile.PROFILE if _ON else None  # the profile needs the loop's phases


def _phase(name: str) -> None:
    if PROFILE is not None:
        PROFILE.phase = name


def around_get_next_batch_to_run(original, scheduler, *args, **kwargs):
    if not _ON:
        return original(scheduler, *args, **kwargs)
    t0 = TIMING.clock()
    if PROFILE is not None:  # the iteration that ends here: its samples, its batch's
        PROFILE.end_iteration(TIMING.launched_key)
        PROFILE.start(threading.get_ident())  # the scheduler thread (once)
    TIMING.watch_gc()  # (once: the scheduler process's collections)
    TIMING.begin_iteration(t0)
    _phase("schedule")
    plan = original(scheduler, *args, **kwargs)
    _phase("other")
    batch = getattr(plan, "batch_to_run", plan)
    TIMING.add(batch_key(batch), "schedule", TIMING.clock() - t0)
    return plan


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    if not _ON:
        return original(scheduler, batch, *args, **kwargs)
    t0 = TIMING.clock()
    _phase("launch")
    result = original(scheduler, batch, *args, **kwargs)
    _phase("other")
    key = batch_key(batch)
    TIMING.add(key, "launch", TIMING.clock() - t0)
    TIMING.launched(key)
    return result


def around_process_batch_result(original, scheduler, batch, result, *args, **kwargs):
    """A decode batch's results: SGLang first waits for their copy to the host
    (`copy_done`); that wait is timed apart, as the GPU's share."""
    if not _ON:
        return original(scheduler, batch, result, *args, **kwargs)
    key = batch_key(batch)
    t0 = TIMING.clock()
    done = getattr(result, "copy_done", None)
    if key.startswith("decode/") and done is not None:
        _phase("gpu_wait")
        done.synchronize()  # what SGLang does first; its own call then returns at once
    t1 = TIMING.clock()
    _phase("results")
    out = original(scheduler, batch, result, *args, **kwargs)
    _phase("other")
    TIMING.add(key, "gpu_wait", t1 - t0)
    TIMING.add(key, "results", TIMING.clock() - t1)
    return out


def server_info(internal_state: dict) -> None:
    """`/get_server_info` carries the sums (every server, plain ones too), when on, and
    the loop's profile when that is on too."""
    if _ON:
        internal_state["psa_host_timing"] = TIMING.snapshot()
        internal_state["psa_plugin_timing"] = TIMING.plugin_snapshot()
    if PROFILE is not None:
        internal_state["psa_host_profile"] = PROFILE.snapshot()
