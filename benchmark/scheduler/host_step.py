"""Host time the plugin adds to a decode step of SGLang's scheduler.

    python benchmark/scheduler/host_step.py [--out benchmark/results/host_step.json]

SGLang's scheduler prepares step N+1 on the CPU while the GPU runs step N; once the GPU
step is short (a sparse step at batch 32 takes ~2 ms), host time is step time. Under
`--sparse-mode` the scheduler calls the plugin once per decode step, in
`ScheduleBatch.check_decode_mem` (`plugin.scheduling.around_check_decode_mem`): the
working-set record (`PSAServing.flush_step`) and the retraction check (`fits`). This times
that hook, with SGLang's own check stubbed to "fits", over batches of running requests
as the HBM home serves them (working sets published by the GPU, read from host memory),
per step averaged over whole recording intervals. No GPU, no SGLang process: it runs on
the CPU that would host the scheduler (the GPU machine's, for a figure that applies there).

Summary: `host_us_per_step_b32` (batch 32), `host_us_per_step_by_batch`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from sglang_psa.config import PSAConfig  # noqa: E402
from sglang_psa.eval.results import write_result  # noqa: E402
from sglang_psa.plugin import scheduling  # noqa: E402
from sglang_psa.sched import process  # noqa: E402
from sglang_psa.sched.serving import RECORD_EVERY_STEPS, BackendReadouts, PSAServing  # noqa: E402

PROMPT = 16_000


def host_us_per_step(batch: int, steps: int) -> float:
    """Mean host microseconds of the plugin's per-step hook over `steps` decode steps of
    `batch` running requests of PROMPT tokens."""
    rows = batch + 1
    sizes = np.full(rows, 60, dtype=np.int32)
    lengths = np.zeros(rows, dtype=np.int32)
    serving = PSAServing(
        PSAConfig(), layers=24, kv_heads=2, hbm_units=1 << 40, host_tokens=4096,
        readouts=BackendReadouts(measure=lambda: (sizes, lengths)),
    )  # fmt: skip
    process.register(SimpleNamespace(serving=serving))
    reqs = []
    for i in range(batch):
        rid = f"r{i}"
        if not serving.try_admit(rid, PROMPT, alone=not reqs):
            raise RuntimeError(f"{rid} was not admitted")
        reqs.append(SimpleNamespace(rid=rid, req_pool_idx=i + 1, seqlen=PROMPT))
    batch_ns = SimpleNamespace(reqs=reqs)
    fits = lambda *a: True  # SGLang's own check_decode_mem

    def step():
        for r in reqs:  # a token a step, as the GPU last measured it
            r.seqlen += 1
        lengths[1:] = reqs[0].seqlen - 1  # published by the last step
        if not scheduling.around_check_decode_mem(fits, batch_ns):
            raise RuntimeError("the benchmark's batch must fit")

    for _ in range(2 * RECORD_EVERY_STEPS):  # warm: the windows fill
        step()
    # the per-request bookkeeping of step() itself, timed apart and taken off
    t0 = time.perf_counter()
    for _ in range(steps):
        for r in reqs:
            r.seqlen += 1
        lengths[1:] = reqs[0].seqlen - 1
    own = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    total = time.perf_counter() - t0
    serving.controller.check_integrity()
    return (total - own) / steps * 1e6


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "host_step.json"))
    ap.add_argument("--steps", type=int, default=40 * RECORD_EVERY_STEPS)
    args = ap.parse_args(argv)
    by_batch = {b: host_us_per_step(b, args.steps) for b in (8, 32, 64)}
    for b, us in by_batch.items():
        print(f"batch {b}: {us:.1f} us a decode step", flush=True)
    summary = {
        "host_us_per_step_b32": by_batch[32],
        "host_us_per_step_by_batch": {str(b): us for b, us in by_batch.items()},
    }
    data = {"steps": args.steps, "prompt_tokens": PROMPT, "record_every_steps": RECORD_EVERY_STEPS}
    print(write_result(Path(args.out), summary, data))


if __name__ == "__main__":
    main()
