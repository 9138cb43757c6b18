"""Host cost of the tiered home's decode-round hook, round after round, at workload b's shape.

    python benchmark/scheduler/decode_round.py [--rounds N] [--baseline-rev REV] [--out FILE]

At `--psa-kv-home tiered` every decode round runs `plugin.scheduling.around_check_decode_mem`
on the scheduler's thread before SGLang's own check: with HBM full, room for the round's
pages (`Residency.make_room`: blocks leave HBM) and the unit cache's `refresh` (its pages,
cold blocks leaving). On the H200 (workload b, 13 running requests of 28K-token prompts,
2026-12-05) that hook took 1.94 ms of each 5.3 ms of host time a round, against 1.78 ms
for plain SGLang's whole round with FA3: once the GPU step is short, host time is the
step. On a GPU each tensor operation of the hook is a launch or a copy of several
microseconds, so this counts them (torch's profiler, top-level `aten::` calls) beside the
CPU time.

It runs through the `psa` radix cache's test store (test/unit/mem_cache/
test_psa_radix_cache.py: SGLang's real allocator, request table and tree, the real
write-back, residency and unit-cache tables, on CPU tensors), so it needs SGLang
installed: 13 requests of 28,000-token prompts in 32-token blocks (lengths staggered within a block, so that the requests' pages fill in turn, as in serving), prefilled, saved and
in the tree, HBM holding them and 8 pages more; random published block heat (0-48
readers of 48 units a block); the served `--psa-cold-fraction` default. Then `--rounds`
decode rounds: the hook, then a token for each request (SGLang's decode allocation). The
unit cache's refresh kernel is stubbed (on a GPU, one CUDA-graph replay). A warm-up
round, not counted, evicts the blocks the static heat makes cold. Setup ~30 s.

Summary: `hook_ms_per_round_b13x28k`, `hook_ops_per_round_b13x28k` (means over the
rounds), `evicting_rounds_fraction_b13x28k` (rounds in which a block left HBM); with
`--baseline-rev`, the same three `..._baseline` from that commit's plugin on the same CPU
in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, PROMPT, BS, SLACK_PAGES = 13, 28_000, 32, 8
KEYS = ("hook_ms_per_round", "hook_ops_per_round", "evicting_rounds_fraction")


def measure(rounds: int = 256, requests: int = REQUESTS, prompt: int = PROMPT) -> dict:
    """Means over `rounds` decode rounds of the hook's CPU milliseconds, its top-level tensor
    operations, and the fraction of rounds that evicted a block (see the module doc)."""
    import numpy as np
    import torch
    from benchmark.scheduler.evict_ops import _top_ops, replay_store
    from torch.profiler import ProfilerActivity, profile

    from sglang_psa.config import PSAConfig
    from sglang_psa.plugin import scheduling
    from sglang_psa.sched import process
    from sglang_psa.sched.serving import BackendReadouts, PSAServing

    n = prompt // BS
    ctx = prompt + (rounds // BS + 8) * BS
    pages, host_blocks = requests * (n + 1) + SLACK_PAGES, requests * (ctx // BS) + 64
    with replay_store(pages, host_blocks, BS=BS, CTX=ctx, ROWS=requests + 3) as s:
        try:
            res = s.res
            res.cold_readers = int(np.ceil(PSAConfig().cold_fraction * 48))  # 24 x 2 units
            res.cache.refresh = lambda *a: None  # the kernel: a graph replay on a GPU
            reqs = []
            for i in range(requests):
                tokens = prompt + (i * 5) % BS  # staggered: their pages fill in turn
                req = s.arrive(f"r{i}", [100_000 * i + j for j in range(tokens)], max_new=rounds)
                s.match(req), s.admit(req), s.prefill(req)
                reqs.append(req)
            s.ack()
            rng = np.random.default_rng(0)
            lengths = torch.zeros(requests + 3, dtype=torch.int32)
            heat = {r.row: rng.integers(0, 49, ctx // BS).astype(np.uint8) for r in reqs}
            res.ws.read, res.ws.heat = (lambda: (None, lengths)), (lambda: heat)
            res.ws.stamps = res.ws.step = None  # (read by the stubbed kernel only)
            sizes = np.full(requests + 3, 500)
            serving = PSAServing(
                PSAConfig(kv_home="tiered"), layers=24, kv_heads=2, hbm_units=10**9,
                host_tokens=10**9, readouts=BackendReadouts(measure=lambda: (sizes, lengths)),
                residency=res, writeback=s.wb,
            )  # fmt: skip
            process.register(SimpleNamespace(serving=serving))
            for q in reqs:
                assert serving.try_admit(q.rid, prompt, alone=False, max_new_tokens=rounds)
            batch = SimpleNamespace(reqs=reqs, token_to_kv_pool_allocator=s.alloc)

            def published():  # each request's length, as SGLang and the last step see it
                for r in reqs:
                    r.seqlen = lengths[r.row] = r.kv_len

            published()
            # warm-up: the blocks cold by the (static) heat leave HBM, the cache takes pages
            scheduling.around_check_decode_mem(lambda *a: True, batch)
            warm = res.evictions
            ms, ops, evicting = [], [], 0
            for k in range(rounds):
                published()
                before = res.evictions
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t0 = time.perf_counter()
                    assert scheduling.around_check_decode_mem(lambda *a: True, batch)
                    ms.append((time.perf_counter() - t0) * 1e3)
                ops.append(_top_ops(prof))
                evicting += res.evictions > before
                assert s.alloc.available_size() >= len(reqs), "the hook left no page to decode"
                for r in reqs:
                    s.decode(r, [7 + k])
            # (the profiler's own overhead is in `ms`, alike at both commits)
            return {
                "hook_ms_per_round": float(np.mean(ms)),
                "hook_ops_per_round": float(np.mean(ops)),
                "evicting_rounds_fraction": evicting / rounds,
                "rounds": rounds,
                "evictions": res.evictions - warm,
                "evictions_warmup": warm,
                "ops_by_round": ops,
                "ms_by_round": [round(x, 3) for x in ms],
                "cache_pages": res.cache.pages,
            }
        finally:
            process.register(None)


def main(argv=None) -> None:
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from benchmark.scheduler.evict_ops import setup
    from benchmark.scheduler.revision import round_args

    args = round_args(
        __doc__, "decode_round", 256, "also measure this commit's plugin (same CPU, same run)", argv
    )

    from benchmark.scheduler.revision import write_measured

    setup()
    data = {"requests": REQUESTS, "prompt_tokens": PROMPT, "block_size": BS}
    call = f"measure({args.rounds})"
    got = measure(args.rounds)
    rev = args.baseline_rev
    write_measured(args.out, got, KEYS, "b13x28k", data, _line, rev, "decode_round", call)


def _line(who: str, m: dict) -> str:
    return (
        f"{who}: {m['hook_ms_per_round']:.3f} ms and {m['hook_ops_per_round']:.1f} tensor ops a "
        f"round; {m['evicting_rounds_fraction']:.2f} of rounds evicted "
        f"({m['evictions']} blocks, {m['cache_pages']} cache pages at the end)"
    )


if __name__ == "__main__":
    main()
