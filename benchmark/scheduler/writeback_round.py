"""Host cost of the tiered home's write-back while HBM has room, at workload a's shape.

    python benchmark/scheduler/writeback_round.py [--rounds N] [--baseline-rev REV] [--out FILE]

Workload a (32 x 28K-token prompts, 1024 outputs, all at once) never fills the KV pool,
so at `--psa-kv-home tiered` no block ever leaves HBM; the host tier is insurance. Yet on
the H100 (2026-12-05, batch 32) the tiered home's round took 3.42 ms against the hbm
home's 2.64, host-bound at both, and the plugin's own timers over the run added about the
difference: matches of queued prompts (`match_prefix`), the extend's and the decode's
saves (`writeback.issue_*`) and their planning (`plan_*`). `--psa-writeback-start
FRACTION` starts the write-back only once less than that fraction of the pool is free;
this measures, through the `psa` radix cache's test store (test/unit/mem_cache/
test_psa_radix_cache.py: SGLang's real allocator, request table and tree, the real
write-back on its uva path, host blocks, prefix index and request records, on CPU
tensors, the save kernel stubbed: on a GPU one launch, counted as an operation; it needs
SGLang installed), what each of the write-back's host calls costs with the write-back on
from the start (`eager`, the default 1) and not yet started (`lazy`):

- the intake: 32 prompts of 28,000 tokens (a 512-token stem shared, as the
  serving tasks share their instructions, the rest distinct) arrive at once; each extend
  round matches the request it admits and the next in the queue (SGLang's adder stops at
  the first that does not fit), then that request's extend (`plan_extend`, `issue_extend`,
  SGLang's insert; acknowledged by the next plan);
- `--rounds` decode rounds of every request: a token each (SGLang's decode allocation),
  then `plan_decode` (with the acknowledgements) and `issue_decode` (a flush every 16
  pending blocks), as the scheduler and the backend call them.

Each call's CPU milliseconds and top-level tensor operations (torch's profiler; on a GPU
each is a launch or a copy of several microseconds), and what the run means to Python's
garbage collector: the tracked objects it left alive, and the objects promoted into the
collector's oldest generation (counted at each middle-generation collection, in a second
run: reading that generation's size scans it, so the timed run does not). Python starts
a full collection once the objects promoted since the last exceed a quarter of those that
survived it, and a full collection scans every tracked object: the modules of SGLang's
scheduler process are imported first (`server_heap`: ~0.6M tracked objects, as that
process holds before its model), and one full collection of that heap is timed
(`gc_full_collection_ms_at_start`). `--baseline-rev` measures `eager` with the plugin at
another commit too (same CPU, same run). ~40 s (~80 with a baseline).

Summary (`a32x28k`: the shape; MODE `eager`, `lazy`, `eager_baseline`):
`{match,extend,decode_round}_{ms,ops}_MODE_a32x28k` (means per call),
`{match,extend,decode_round}_ms_p50_MODE_a32x28k` (medians: the few calls a full
collection lands in move a mean by milliseconds from run to run),
`{tracked_objects_added,promoted_to_oldest}_MODE_a32x28k`, and
`pool_free_fraction_a32x28k` (the pool's free share after the intake: the lazy start's
0.25 is not reached).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, PROMPT, BS, STEM = 32, 28_000, 32, 512
PHASES = ("match", "extend", "decode_round")


def run(eager: bool, rounds: int = 128) -> dict:
    """`measure` timed, then again counting promotions (reading the oldest generation's
    size at each middle-generation collection scans it: a cost of the counting, kept out
    of the times)."""
    timed = measure(eager, rounds)
    counted = measure(eager, rounds, count_promotions=True)
    return timed | {"promoted_to_oldest": counted["promoted_to_oldest"]}


def measure(
    eager: bool,
    rounds: int = 128,
    requests: int = REQUESTS,
    prompt: int = PROMPT,
    count_promotions: bool = False,
):
    """Per-call means of CPU ms and top-level tensor operations of the three phases (see
    the module doc), the write-back on from the start (`eager`) or not started; with
    `count_promotions`, the objects promoted into the collector's oldest generation
    (`promoted_to_oldest`; the times then include the counting's own cost)."""
    import numpy as np
    from benchmark.scheduler.evict_ops import _top_ops, replay_store
    from torch.profiler import ProfilerActivity, profile

    from sglang_psa.mem_cache.transports import uva

    ctx = prompt + (rounds // BS + 2) * BS
    cost = {p: ([], []) for p in PHASES}
    launches = [0]

    def timed(phase, fn, *args):
        before = launches[0]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            out = fn(*args)
            ms = (time.perf_counter() - t0) * 1e3
        cost[phase][0].append(ms)
        cost[phase][1].append(_top_ops(prof) + launches[0] - before)
        return out

    def save_kernel(*args, **kwargs):  # one launch on a GPU (Triton's interpreter here)
        launches[0] += 1

    kernel, uva.copy_layers_to_units = uva.copy_layers_to_units, save_kernel
    t0 = time.perf_counter()
    gc.collect()
    full_ms = (time.perf_counter() - t0) * 1e3  # one full collection of the heap as it is
    tracked = len(gc.get_objects())
    oldest = [len(gc.get_objects(generation=2)), 0]  # its size, objects promoted into it

    def collector(phase, info):
        if phase == "stop" and info["generation"] == 1:  # (a full one would reset it)
            n = len(gc.get_objects(generation=2))
            oldest[1] += max(0, n - oldest[0])
            oldest[0] = n

    if count_promotions:
        gc.callbacks.append(collector)

    # a's pool: the requests' KV and as much again free (44% was free on the H100)
    pages = 2 * requests * (ctx // BS)
    host_blocks = requests * (ctx // BS) + 64
    try:
        with replay_store(pages, host_blocks, BS=BS, CTX=ctx, ROWS=requests + 3) as s:
            wb = s.wb
            wb.saving = eager
            stem = list(range(7, 7 + STEM))
            queue = [
                s.arrive(f"r{i}", stem + [100_000 * (i + 1) + j for j in range(prompt - STEM)],
                         max_new=rounds)
                for i in range(requests)
            ]  # fmt: skip
            reqs = []
            for i, req in enumerate(queue):
                timed("match", s.match, req)
                assert s.admit(req)
                if i + 1 < len(queue):  # the next one, matched and left waiting
                    timed("match", s.match, queue[i + 1])
                timed("extend", s.prefill, req, False)  # acknowledged by the next plan
                reqs.append(req)
            free = s.alloc.available_size() / (pages * BS)
            k, v, rt = s.pool.k_buffer, s.pool.v_buffer, s.rtp.req_to_token
            lens = [0] * len(reqs)

            def round_(j):
                wb.plan_decode(reqs, lens)
                wb.issue_decode(k, v, rt)

            for j in range(rounds):
                for n, r in enumerate(reqs):  # SGLang's decode allocation, a token each
                    r.output_ids.append(9 + j)
                    if r.kv_len % BS == 0:
                        r.slots = s.alloc.alloc(BS)
                    rt[r.row, r.kv_len] = r.slots[0]
                    r.slots = r.slots[1:]
                    s._set_len(r, r.kv_len + 1)
                    lens[n] = r.kv_len
                timed("decode_round", round_, j)
            if collector in gc.callbacks:
                gc.callbacks.remove(collector)
            gc.collect()
            out = {
                "pool_free_fraction": free,
                "saved_blocks": wb.stats.blocks_saved,
                "tracked_objects_at_start": tracked,
                "gc_full_collection_ms_at_start": full_ms,
                "tracked_objects_added": len(gc.get_objects()) - tracked,
                "promoted_to_oldest": oldest[1] if count_promotions else None,
            }
            for p, (ms, ops) in cost.items():
                out[f"{p}_ms"] = float(np.mean(ms))
                out[f"{p}_ms_p50"] = float(np.median(ms))  # (a full collection lands in a few)
                out[f"{p}_ops"] = float(np.mean(ops))
                out[f"{p}_calls"] = len(ms)
            out["decode_round_ms_by_round"] = [round(x, 3) for x in cost["decode_round"][0]]
            return out
    finally:
        if collector in gc.callbacks:
            gc.callbacks.remove(collector)
        uva.copy_layers_to_units = kernel


def main(argv=None) -> None:
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from benchmark.scheduler.evict_ops import setup
    from benchmark.scheduler.revision import round_args

    args = round_args(
        __doc__, "writeback_round", 128, "also measure eager at this commit's plugin", argv
    )
    from sglang_psa.eval.results import write_result

    setup()
    server_heap()
    warm()
    got = {mode: run(mode == "eager", args.rounds) for mode in ("eager", "lazy")}
    if args.baseline_rev:
        from benchmark.scheduler.revision import at_revision

        base = at_revision(
            args.baseline_rev,
            f"m.run(True, {args.rounds})",
            "from benchmark.scheduler.evict_ops import setup; setup(); "
            "from benchmark.scheduler import writeback_round as m; m.server_heap(); m.warm()",
        )
        got["eager_baseline"] = base["value"] | {"rev": base["rev"]}
    summary = {}
    for mode, m in got.items():
        print(
            f"{mode}: match {m['match_ms']:.3f} ms (median {m['match_ms_p50']:.3f}) / "
            f"{m['match_ops']:.1f} ops, extend {m['extend_ms']:.2f} ms (median "
            f"{m['extend_ms_p50']:.2f}) / {m['extend_ops']:.1f} ops, decode round "
            f"{m['decode_round_ms']:.3f} ms (median {m['decode_round_ms_p50']:.3f}) / "
            f"{m['decode_round_ops']:.1f} ops; "
            f"{m['saved_blocks']} blocks saved; {m['tracked_objects_added']} tracked objects "
            f"kept, {m['promoted_to_oldest']} promoted to the collector's oldest generation",
            flush=True,
        )
        for p in PHASES:
            summary[f"{p}_ms_{mode}_a32x28k"] = m[f"{p}_ms"]
            summary[f"{p}_ms_p50_{mode}_a32x28k"] = m[f"{p}_ms_p50"]
            summary[f"{p}_ops_{mode}_a32x28k"] = m[f"{p}_ops"]
        for k in ("tracked_objects_added", "promoted_to_oldest"):
            summary[f"{k}_{mode}_a32x28k"] = m[k]
    summary["pool_free_fraction_a32x28k"] = got["lazy"]["pool_free_fraction"]
    data = {"requests": REQUESTS, "prompt_tokens": PROMPT, "block_size": BS,
            "stem_tokens": STEM, "rounds": args.rounds, **got}  # fmt: skip
    print(write_result(Path(args.out), summary, data))


def warm() -> None:
    """A small run of both modes first: what the first run imports and caches is not
    counted as kept by the run measured."""
    for eager in (True, False):
        measure(eager, 8, requests=2, prompt=2048)


def server_heap() -> int:
    """Import the modules SGLang's scheduler process imports (about 0.6M objects Python's
    collector tracks, before a model is loaded), so that a full collection costs what it
    costs there (the store alone holds few); returns the tracked objects."""
    import sglang.srt.managers.scheduler  # noqa: F401

    return len(gc.get_objects())


if __name__ == "__main__":
    main()
