"""Tensor operations and host time an eviction costs the tiered home's scheduler.

    python benchmark/scheduler/evict_ops.py [--out FILE] [--skip-time] [--baseline-rev REV]

At `--psa-kv-home tiered` blocks leave HBM in the scheduler's schedule phase
(`Residency.make_room` and `refresh`, every decode round while HBM is short: about 9
blocks a round over several requests in workload b on the H200). On a GPU every tensor
operation of that path is a launch (or a copy to the device) of several microseconds on
the scheduler's thread. This counts them with torch's profiler (top-level `aten::` calls)
for a round that evicts two blocks of each of N requests, two ways on the same code: a
call per request (`Residency.evict`) and one call for all (`Residency.evict_many`, what
the scheduler's hooks use). It runs on CPU tensors through the `psa` radix cache's test
store (SGLang's real allocator, request table and tree, the real write-back and
residency; test/unit/mem_cache/test_psa_radix_cache.py), so it needs SGLang installed;
counts, not times, are its result (CPU tensors launch nothing).

It also times `Residency.make_room` (what a prefill chunk's admission and a short decode
round call) at workload b's shape: 13 running requests of 28,000-token prompts in
32-token blocks, every block saved and in the tree, random block heat, 64 and 512
blocks made room for (about a few decode rounds' and a 16K-token chunk's), on this
machine's CPU: the host part, which on the H200 ran ~1.9x slower (the serving stage's
`python_loop_ms`).
Setup prefills the 13 prompts through the store (~25 s).

Summary: `ops_per_round_by_requests` ({N: {"per_request": ..., "one_call": ...}}),
`ops_ratio_one_call_vs_per_request_4` (4 requests) and `ops_one_node_12_blocks` (12
blocks of one tree node: a slice write a block against one indexed write, the default
past `psa_radix_cache._SLICE_WRITES` blocks); `make_room_ms_b13x28k` ({blocks: ms}) and,
with `--baseline-rev`, `make_room_ms_b13x28k_baseline` (that commit's, same CPU, same run).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUESTS = (1, 2, 4)


def _store(n: int):
    """The test store with `n` requests of 6 blocks each prefilled, saved and in the tree."""
    import test_psa_radix_cache as t

    t.ROWS = max(t.ROWS, n + 2)  # (the store reads it when built)
    cm = t._store(pages=40 + 8 * n, host_blocks=28 + 8 * n)
    s = cm.__enter__()
    for i in range(n):
        req = s.arrive(f"r{i}", [1000 + 50 * i + j for j in range(6 * t.BS)])
        s.match(req)
        assert s.admit(req)
        s.prefill(req)
    s.ack()
    return cm, s


def _top_ops(prof) -> int:
    """The top-level tensor operations (`aten::`) a profile recorded."""
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def ops(n: int, one_call: bool) -> int:
    """Top-level tensor operations of evicting blocks 1-2 of each of `n` requests."""
    from torch.profiler import ProfilerActivity, profile

    cm, s = _store(n)
    wanted = {f"r{i}": [1, 2] for i in range(n)}
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if one_call:
                freed = s.res.evict_many(wanted, s.alloc)
            else:
                freed = sum(s.res.evict(rid, bl, s.alloc) for rid, bl in wanted.items())
        assert freed == 2 * n * s.res.block_size, freed
    finally:
        cm.__exit__(None, None, None)
    return _top_ops(prof)


def node_ops(blocks: int, indexed: bool) -> int:
    """Top-level tensor operations of evicting `blocks` blocks of one request's prompt,
    which the tree holds in one node (as making room for a new chunk does), with the
    node's page-0 entries written in one indexed write (the default past
    `_SLICE_WRITES` blocks) or a slice write a block."""
    import test_psa_radix_cache as t
    from torch.profiler import ProfilerActivity, profile

    from sglang_psa.mem_cache import psa_radix_cache

    keep = psa_radix_cache._SLICE_WRITES
    psa_radix_cache._SLICE_WRITES = 0 if indexed else 10**9
    cm = t._store()
    s = cm.__enter__()
    try:
        req = s.arrive("a", list(range(500, 500 + 14 * t.BS)) + [1, 2])
        s.match(req), s.admit(req), s.prefill(req)
        s.ack()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            assert s.res.evict("a", list(range(1, 1 + blocks)), s.alloc) == blocks * t.BS
    finally:
        psa_radix_cache._SLICE_WRITES = keep
        cm.__exit__(None, None, None)
    return _top_ops(prof)


@contextlib.contextmanager
def _shape(**values):
    """The test store's module constants set to `values` for the block."""
    import test_psa_radix_cache as t

    old = {k: getattr(t, k) for k in values}
    vars(t).update(values)
    try:
        yield t
    finally:
        vars(t).update(old)


@contextlib.contextmanager
def replay_store(pages: int, host_blocks: int, **shape):
    """The radix cache's test store at the module constants `shape` (`_shape`) with
    `pages` KV pages and `host_blocks` host blocks, its invariant checks off (they are the
    tests': seconds to minutes at a benchmark's scale); closed on leaving the block."""
    with _shape(**shape) as t, t._store(pages=pages, host_blocks=host_blocks) as s:
        s.check = lambda *a, **k: None
        yield s


def make_room_ms(requests=13, prompt=28_000, blocks=(64, 512), reps=5) -> dict[str, float]:
    """Median host milliseconds of `Residency.make_room` for each of `blocks` over
    `requests` running requests of `prompt` tokens (32-token blocks, all saved, random
    published heat: 0-48 readers a block), `reps` calls each in a row (each evicts the
    next coldest blocks: the same work on other blocks)."""
    import numpy as np
    import torch

    bs = 32
    n = prompt // bs
    out = {}
    pages, host_blocks = requests * n + 64, requests * (n + 8) + 64
    with replay_store(pages, host_blocks, BS=bs, CTX=prompt + 4 * bs, ROWS=requests + 3) as s:
        reqs = []
        for i in range(requests):
            req = s.arrive(f"r{i}", [100_000 * i + j for j in range(prompt)])
            s.match(req), s.admit(req), s.prefill(req)
            req.seqlen = prompt
            reqs.append(req)
        s.ack()
        rng = np.random.default_rng(0)
        lengths = torch.zeros(requests + 3, dtype=torch.int32)
        heat = {}
        for r in reqs:
            lengths[r.row] = prompt
            heat[r.row] = rng.integers(0, 49, n + 8).astype(np.uint8)
        s.res.ws.read, s.res.ws.heat = (lambda: (None, lengths)), (lambda: heat)
        for k in blocks:
            times = []
            for _ in range(reps):
                # each rep evicts other blocks (the coldest left): same work, new blocks
                t0 = time.perf_counter()
                freed = s.res.make_room(reqs, k * bs, s.alloc)
                times.append((time.perf_counter() - t0) * 1e3)
                assert freed == k * bs, freed
            out[str(k)] = statistics.median(times)
    return out


def setup() -> None:
    """What the store needs beside `sglang_psa` (here and in `--baseline-rev`'s run)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (kernel modules load with the store)
    sys.path.insert(1, str(ROOT / "test" / "unit" / "mem_cache"))
    if importlib.util.find_spec("torchvision") is None:  # as the tests do (test/conftest.py)
        sys.path.append(str(ROOT / "test" / "stubs"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "evict_ops.json"))
    ap.add_argument("--skip-time", action="store_true", help="the counts only (seconds, not ~30)")
    ap.add_argument(
        "--baseline-rev", help="also time make_room at this commit (same CPU, same run)"
    )
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    setup()
    from sglang_psa.eval.results import write_result

    by = {str(n): {"per_request": ops(n, False), "one_call": ops(n, True)} for n in REQUESTS}
    for n, c in by.items():
        print(f"{n} request(s): {c['per_request']} ops a call each, {c['one_call']} in one call")
    node = {"slice_writes": node_ops(12, False), "indexed": node_ops(12, True)}
    print(f"12 blocks of one tree node: {node['slice_writes']} ops with a write a block, "
          f"{node['indexed']} with one indexed write")  # fmt: skip
    timed = base = None
    if not args.skip_time:
        timed = make_room_ms()
        print("make_room at batch 13 x 28K: " + _ms(timed))
    if args.baseline_rev and not args.skip_time:
        from benchmark.scheduler.revision import at_revision

        imports = "from benchmark.scheduler import evict_ops as m; m.setup()"
        base = at_revision(args.baseline_rev, "m.make_room_ms()", imports)
        print(f"  at {base['rev'][:9]}: " + _ms(base["value"]))
    summary = {
        "make_room_ms_b13x28k": timed,
        "make_room_ms_b13x28k_baseline": base and base["value"],
        "ops_per_round_by_requests": by,
        "ops_ratio_one_call_vs_per_request_4": by["4"]["one_call"] / by["4"]["per_request"],
        "ops_one_node_12_blocks": node,
    }
    data = {"blocks_per_request": 2, "requests": REQUESTS, "one_node_blocks": 12}
    if base:
        data["baseline_rev"] = base["rev"]
    print(write_result(Path(args.out), summary, data))


def _ms(by_blocks: dict) -> str:
    return ", ".join(f"{k} blocks {v:.2f} ms" for k, v in by_blocks.items())


if __name__ == "__main__":
    main()
