"""The scheduler loop's host timing (`sched.host_timing`): hooks that pass straight
through unless `SGLANG_PSA_HOST_TIMING=1`."""

from __future__ import annotations

from sglang_psa.sched.host_timing import TIMING, batch_key, enabled

_ON = enabled()  # read once per process: the hooks run on every loop iteration


def around_get_next_batch_to_run(original, scheduler, *args, **kwargs):
    if not _ON:
        return original(scheduler, *args, **kwargs)
    t0 = TIMING.clock()
    TIMING.begin_iteration(t0)
    plan = original(scheduler, *args, **kwargs)
    batch = getattr(plan, "batch_to_run", plan)
    TIMING.add(batch_key(batch), "schedule", TIMING.clock() - t0)
    return plan


def around_run_batch(original, scheduler, batch, *args, **kwargs):
    if not _ON:
        return original(scheduler, batch, *args, **kwargs)
    t0 = TIMING.clock()
    result = original(scheduler, batch, *args, **kwargs)
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
        done.synchronize()  # what SGLang does first; its own call then returns at once
    t1 = TIMING.clock()
    out = original(scheduler, batch, result, *args, **kwargs)
    TIMING.add(key, "gpu_wait", t1 - t0)
    TIMING.add(key, "results", TIMING.clock() - t1)
    return out


def server_info(internal_state: dict) -> None:
    """`/get_server_info` carries the sums (every server, plain ones too), when on."""
    if _ON:
        internal_state["psa_host_timing"] = TIMING.snapshot()
