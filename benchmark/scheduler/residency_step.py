"""Host time of the tiered home's HBM residency in a decode round of SGLang's scheduler.

    python benchmark/scheduler/residency_step.py [--baseline-rev REV] [--out FILE]

At `--psa-kv-home tiered` every decode round runs, in the scheduler's `check_decode_mem`
hook (`plugin.scheduling.around_check_decode_mem`), on the host: `make_room` (the coldest
saved blocks of the running requests leave HBM when the allocator is short:
`Residency._coldest`), `refresh` (while blocks are evicted, the resident blocks few units
read leave too) and, when SGLang found the batch full, `evictable`. Each walks every saved
block of every running request: at batch 50 of 16K prompts about 25,000 blocks. On the
H200 (workload f, 2026-12-03) that round's "schedule" phase took 8.8 ms of a 9.4 ms
decode step at batch 50, against 0.3 ms for plain SGLang.

This times those three calls over batches of 16K-token requests (random block heat, a
fifth of every third request's blocks evicted; the unit cache's kernel and the page moves
stubbed: they run on the GPU), on this machine's CPU, no GPU, no SGLang. `refresh` is
timed in its steady state: the warm-up round evicts the cold blocks, later rounds find
none new. `--baseline-rev` also times
the same calls at another commit (a git worktree, in a subprocess), on the same CPU in
the same run.

Summary: `residency_host_ms_b50` (this commit, batch 50), `residency_host_ms_by_batch`,
and with a baseline `residency_host_ms_b50_baseline`, `residency_speedup_b50`. The data
also time the whole decode-round hook (`hook`: `around_check_decode_mem` over the same
stand-in, with nothing to evict).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPT, BLOCK, BATCHES = 16_000, 32, (8, 32, 50)


def stand_in(batch: int, prompt: int = PROMPT) -> SimpleNamespace:
    """A `Residency` over `batch` running requests of `prompt` tokens, as a decode round
    finds it: random block heat (24 layers x 2 KV heads: 0-48 readers a block), every
    request's blocks saved but its last 4, a fifth of every third request's blocks
    evicted; the unit cache's kernel and the page moves stubbed (they run on the GPU).
    Returns `res`, `reqs` (SGLang's requests as the calls read them), `records`, `heat`
    (row -> readers by block) and `alloc` (an allocator with no free pages). The tests
    check `Residency`'s choices on it against a reference (test_residency.py)."""
    from sglang_psa.mem_cache.fence import TableFence
    from sglang_psa.mem_cache.request_kv import RequestKV
    from sglang_psa.mem_cache.residency import Residency

    rng = np.random.default_rng(0)
    blocks = prompt // BLOCK
    lengths = torch.zeros(batch + 2, dtype=torch.int32)
    heat, records, reqs = {}, {}, []
    for i in range(batch):
        row = i + 1
        heat[row] = rng.integers(0, 49, blocks + 8).astype(np.uint8)
        lengths[row] = prompt
        rec = RequestKV(f"r{i}", host=list(range(i * blocks, (i + 1) * blocks)), row=row)
        rec.saved = blocks - 4
        if i % 3 == 0:
            rec.evicted = rng.random(blocks + 8) < 0.2
        records[rec.rid] = rec
        reqs.append(
            SimpleNamespace(rid=rec.rid, req_pool_idx=row, seqlen=prompt, finished=lambda: False)
        )
    ws = SimpleNamespace(
        read=lambda: (None, lengths), heat=lambda: heat, layers=24, kv_heads=2,
        heat_blocks=blocks + 8, stamps=None, step=None,
    )  # fmt: skip
    host = SimpleNamespace(num_blocks=batch * blocks, refs=np.ones(batch * blocks, np.int32))
    wb = SimpleNamespace(records=records, blocks=host, host=None, fence=TableFence())
    cfg = SimpleNamespace(
        block_size=BLOCK, sink_blocks=1, recent_blocks=1, cold_fraction=0.125, unit_cache_ways=8
    )
    res = Residency(
        wb, SimpleNamespace(page_rows=100), ws, torch.zeros(batch + 2, prompt + 64),
        cfg, SimpleNamespace(size=1000 * BLOCK), None,
    )  # fmt: skip

    def evict_many(wanted, alloc):  # marks them gone, as the real one does (no pages moved)
        for rid, bl in wanted.items():
            rec = records[rid]
            if rec.evicted is None:
                rec.evicted = np.zeros(blocks + 8, dtype=bool)
            rec.evicted[bl] = True
        return 0

    res.evict_many = evict_many
    res.cache.refresh = lambda *a: None
    alloc = SimpleNamespace(available_size=lambda: 0, alloc=lambda n: None)
    return SimpleNamespace(res=res, reqs=reqs, records=records, heat=heat, alloc=alloc)


def round_ms(batch: int, rounds: int, prompt: int = PROMPT) -> dict[str, float]:
    """Mean host milliseconds a decode round of `batch` requests spends in each residency
    call, and their sum."""
    s = stand_in(batch, prompt)
    res, reqs = s.res, s.reqs
    calls = {
        "coldest": lambda: res._coldest(reqs, 2 * batch),  # make_room: 2 pages a request
        "refresh": lambda: res.refresh(reqs, s.alloc),
        "evictable": lambda: res.evictable(reqs),
    }
    out = {}
    for name, call in calls.items():
        call()
        t0 = time.perf_counter()
        for _ in range(rounds):
            call()
        out[name] = (time.perf_counter() - t0) / rounds * 1e3
    out["round"] = sum(out.values())
    return out


def hook_ms(batch: int, rounds: int, prompt: int = PROMPT) -> float:
    """Mean host milliseconds of the whole decode-round hook
    (`plugin.scheduling.around_check_decode_mem`: the residency calls, the queue retry,
    the working-set record and check) at the tiered home over the stand-in, SGLang's own
    check stubbed to "fits", no block short of a page (nothing to evict)."""
    from sglang_psa.config import PSAConfig
    from sglang_psa.plugin import scheduling
    from sglang_psa.sched import process
    from sglang_psa.sched.serving import BackendReadouts, PSAServing

    s = stand_in(batch, prompt)
    sizes, lengths = np.full(batch + 2, 500), np.full(batch + 2, prompt)
    serving = PSAServing(
        PSAConfig(kv_home="tiered"), layers=24, kv_heads=2, hbm_units=10**7,
        host_tokens=10**8, readouts=BackendReadouts(measure=lambda: (sizes, lengths)),
        residency=s.res, writeback=SimpleNamespace(records=s.records, reserve=lambda *a: True),
    )  # fmt: skip
    process.register(SimpleNamespace(serving=serving))
    try:
        for q in s.reqs:
            assert serving.try_admit(q.rid, prompt, alone=False, max_new_tokens=1024)
        free = 2 * batch * BLOCK  # the two pages a request the hook keeps free
        alloc = SimpleNamespace(available_size=lambda: free, alloc=lambda n: None)
        batch_ = SimpleNamespace(reqs=s.reqs, token_to_kv_pool_allocator=alloc, batch_is_full=True)
        call = lambda: scheduling.around_check_decode_mem(lambda *a: True, batch_)  # noqa: E731
        call()
        t0 = time.perf_counter()
        for _ in range(rounds):
            call()
        return (time.perf_counter() - t0) / rounds * 1e3
    finally:
        process.register(None)


def measure(rounds: int) -> dict[str, dict[str, float]]:
    return {str(b): round_ms(b, rounds) | {"hook": hook_ms(b, rounds)} for b in BATCHES}


def main(argv=None) -> None:
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from benchmark.scheduler.revision import round_args

    args = round_args(
        __doc__,
        "residency_step",
        200,
        "also time this commit's residency (same CPU, same run)",
        argv,
    )
    from sglang_psa.eval.results import write_result

    ms = measure(args.rounds)
    base = None
    if args.baseline_rev:
        from benchmark.scheduler.revision import at_revision

        got = at_revision(
            args.baseline_rev,
            f"r.measure({args.rounds})",
            "from benchmark.scheduler import residency_step as r",
        )
        base = {"rev": got["rev"], "ms": got["value"]}
    for b in map(str, BATCHES):
        line = f"batch {b}: {ms[b]['round']:.2f} ms a round, the whole hook {ms[b]['hook']:.2f}"
        if base:
            line += f" (baseline {base['ms'][b]['round']:.2f} ms)"
        print(line, flush=True)
    summary = {
        "residency_host_ms_b50": ms["50"]["round"],
        "residency_host_ms_by_batch": {b: m["round"] for b, m in ms.items()},
    }
    if base:
        summary["residency_host_ms_b50_baseline"] = base["ms"]["50"]["round"]
        summary["residency_speedup_b50"] = base["ms"]["50"]["round"] / ms["50"]["round"]
    data = {"prompt_tokens": PROMPT, "block_size": BLOCK, "rounds": args.rounds, "ms": ms}
    if base:
        data["baseline"] = base
    print(write_result(Path(args.out), summary, data))


if __name__ == "__main__":
    main()
