"""Host cost of the `psa` radix cache's prefix match while prompts wait, at workload a's shape.

    python benchmark/scheduler/prefix_match.py [--requests N] [--baseline-rev REV] [--out FILE]

At `--psa-kv-home tiered` SGLang matches every queued prompt each round it offers its
queue (`PsaRadixCache.match_prefix`); the prefix index then names the prompt's blocks by
chained hashes (`prefix_index.chain_hashes`), all of them at a prompt's first match once
the index holds anything. On the H100 (workload a, 32 distinct 28K-token prompts, profile
of 2026-12-06 at 110df94, archive/serving_profile_a_h100.json) those matches were the
tiered home's largest plugin item: 209 ms over 247 calls, where the hbm home has none.

This replays that queue through the radix cache's test store (test/unit/mem_cache/
test_psa_radix_cache.py: SGLang's real tree, allocator and request table, the real
write-back, index and records, on CPU tensors), so it needs SGLang installed: `--requests`
prompts of 28,000 distinct tokens arrive at once; each round matches every waiting prompt
(timed) and admits the first, which is prefilled, saved and inserted (not timed), as the
scheduler admits one 28K prompt a round at the 8K chunk the server runs. Setup ~10 s.

Summary: `match_ms_total_a32x28k` (every match of the replay), `match_us_mean_a32x28k`,
`first_match_ms_a32x28k` (the mean of the matches that hash a whole prompt: a prompt's
first once the index holds anything), `match_calls_a32x28k`; with `--baseline-rev`, the
same keys `..._baseline` from that commit's plugin on the same CPU in the same run.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROMPT, BS = 28_000, 32
KEYS = ("match_ms_total", "match_us_mean", "first_match_ms", "match_calls")


def measure(requests: int = 32, prompt: int = PROMPT) -> dict:
    """Milliseconds of every `match_prefix` of the replay (see the module doc)."""
    from benchmark.scheduler.evict_ops import replay_store

    pages = requests * (prompt // BS + 2) + 8
    with replay_store(pages, pages, BS=BS, CTX=prompt + 2 * BS, ROWS=requests + 2) as s:
        waiting = [
            s.arrive(f"r{i}", [150_000 * i + j for j in range(prompt)], max_new=4)
            for i in range(requests)
        ]
        ms, first = [], []
        seen: set[str] = set()
        while waiting:
            for req in waiting:
                hashes = len(s.index) > 0 and req.rid not in seen
                t0 = time.perf_counter()
                s.match(req)
                ms.append((time.perf_counter() - t0) * 1e3)
                if hashes:
                    seen.add(req.rid)
                    first.append(ms[-1])
            req = waiting.pop(0)
            assert s.admit(req), req.rid
            s.prefill(req)
        return {
            "match_ms_total": sum(ms),
            "match_us_mean": sum(ms) / len(ms) * 1e3,
            "first_match_ms": sum(first) / max(len(first), 1),
            "match_calls": len(ms),
            "first_matches": len(first),
        }


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "prefix_match.json"))
    ap.add_argument("--requests", type=int, default=32, help="prompts waiting at the start")
    ap.add_argument("--baseline-rev", help="also measure this commit's plugin (same CPU, run)")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from benchmark.scheduler.evict_ops import setup
    from benchmark.scheduler.revision import write_measured

    setup()
    data = {"requests": args.requests, "prompt_tokens": PROMPT, "block_size": BS}
    call = f"measure({args.requests})"
    got = measure(args.requests)
    tag, rev = f"a{args.requests}x28k", args.baseline_rev
    write_measured(args.out, got, KEYS, tag, data, _line, rev, "prefix_match", call)


def _line(who: str, m: dict) -> str:
    return (
        f"{who}: {m['match_calls']} matches, {m['match_ms_total']:.1f} ms in all "
        f"({m['match_us_mean']:.0f} us each); {m['first_matches']} first matches of a whole "
        f"prompt, {m['first_match_ms']:.2f} ms each"
    )


if __name__ == "__main__":
    main()
