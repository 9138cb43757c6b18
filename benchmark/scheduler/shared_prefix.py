"""Host cost of a shared document's questions at the tiered home, at workload f's shape.

    python benchmark/scheduler/shared_prefix.py [--docs N] [--questions Q] [--baseline-rev REV] [--out FILE]

Workload f of the serving benchmark asks each of ten 16K-token documents twelve
questions. At `--psa-kv-home tiered` every question's match adopts its document's saved
host blocks (`HostBlocks.adopt`: the question becomes one more holder of each of the
512), and its release at the end lets go of every one (`HostBlocks.release`), so both
cost a block's worth of Python per holder. On the H100 (2026-12-07, b4ed022, f at 16/s)
the tiered home's `release` took 1.3 ms a call and `match_prefix` 0.63 ms, where the
hbm home's release took 0.02 ms.

This replays f's order through the radix cache's test store (test/unit/mem_cache/
test_psa_radix_cache.py: SGLang's real tree, allocator and request table, the real
write-back, index and records, on CPU tensors; needs SGLang installed): questions
arrive a document after another (question 1 of every document, then question 2, ...),
each matched three times while it waits, admitted and prefilled (saved, acknowledged
and inserted: not timed); `running` questions run at once, the oldest finishing as the
next is admitted, so a document's blocks have up to `running / docs + 1` holders.
Timed: every match, every admission, every finish (SGLang's release with the tree's
insert, then the tiered store's).

Summary: `match_us_mean_fDxQ`, `admit_us_mean_fDxQ`, `finish_us_mean_fDxQ` (D documents,
Q questions) and the medians `..._us_p50_fDxQ`; with `--baseline-rev`, the same keys
`..._baseline` from that commit's plugin on the same CPU in the same run.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC, QUESTION, BS = 16_384, 200, 32
KEYS = ("match_us_mean", "admit_us_mean", "finish_us_mean", "match_us_p50", "admit_us_p50",
        "finish_us_p50")  # fmt: skip


def measure(docs: int = 10, questions: int = 12, running: int = 24) -> dict:
    """Microseconds a call of match, admission and finish (see the module doc)."""
    from benchmark.scheduler.evict_ops import replay_store

    n = docs * questions
    pages = docs * (DOC // BS + 2) + n * (QUESTION // BS + 3) + 8
    with replay_store(pages, pages, BS=BS, CTX=DOC + QUESTION + 2 * BS, ROWS=running + 3) as s:
        text = [[1_000_000 * (d + 1) + j for j in range(DOC)] for d in range(docs)]
        times: dict[str, list[float]] = {k: [] for k in ("match", "admit", "finish")}

        def timed(what, call, *args):
            t0 = time.perf_counter()
            out = call(*args)
            times[what].append(time.perf_counter() - t0)
            return out

        live = []
        for i in range(n):
            q, d = divmod(i, docs)
            asked = [5_000_000 + QUESTION * i + j for j in range(QUESTION)]
            req = s.arrive(f"q{i}", text[d] + asked, max_new=4)
            for _ in range(3):
                timed("match", s.match, req)
            if len(live) == running:
                timed("finish", s.finish, live.pop(0))
            assert timed("admit", s.admit, req), req.rid
            s.prefill(req)
            live.append(req)
        while live:
            timed("finish", s.finish, live.pop(0))
        means = {f"{k}_us_mean": sum(v) / len(v) * 1e6 for k, v in times.items()}
        medians = {f"{k}_us_p50": statistics.median(v) * 1e6 for k, v in times.items()}
        return means | medians | {"calls": {k: len(v) for k, v in times.items()}}


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "shared_prefix.json"))
    ap.add_argument("--docs", type=int, default=10)
    ap.add_argument("--questions", type=int, default=12, help="questions a document")
    ap.add_argument("--baseline-rev", help="also measure this commit's plugin (same CPU, run)")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "python"), str(ROOT)]
    from benchmark.scheduler.evict_ops import setup
    from benchmark.scheduler.revision import write_measured

    setup()
    data = {"docs": args.docs, "questions": args.questions, "doc_tokens": DOC, "block_size": BS}
    call = f"measure({args.docs}, {args.questions})"
    got = measure(args.docs, args.questions)
    tag = f"f{args.docs}x{args.questions}"
    write_measured(args.out, got, KEYS, tag, data, _line, args.baseline_rev, "shared_prefix", call)


def _line(who: str, m: dict) -> str:
    return (
        f"{who}: match {m['match_us_mean']:.0f} us (median {m['match_us_p50']:.0f}), admission "
        f"{m['admit_us_mean']:.0f} us ({m['admit_us_p50']:.0f}), finish "
        f"{m['finish_us_mean']:.0f} us ({m['finish_us_p50']:.0f}) a call ({m['calls']})"
    )


if __name__ == "__main__":
    main()
