"""Run a measurement of this checkout against the plugin's code at another commit, on the
same CPU in the same run (`--baseline-rev` of the scheduler benchmarks).

Contract: `at_revision(rev, expr)` checks commit `rev` out into a temporary git worktree
and evaluates the Python expression `expr` in a subprocess whose `sglang_psa` is that
commit's (its `python/` first on `sys.path`) while the benchmark modules and test stores
are this checkout's (`benchmark.scheduler.*`, `test/unit/mem_cache`); `expr`'s value must
be JSON. Returns `{"rev": full commit, "value": the value}`. The worktree is removed
afterwards.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def at_revision(rev: str, expr: str, imports: str = "") -> dict:
    """`expr` evaluated against the plugin at commit `rev` (after the statements
    `imports`, e.g. `from benchmark.scheduler import evict_ops as m`)."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(tree), rev],
                       check=True)  # fmt: skip
        try:
            paths = [str(tree / "python"), str(ROOT), str(ROOT / "test" / "unit" / "mem_cache")]
            code = (
                f"import sys, json; sys.path[:0] = {paths!r}; {imports}; print(json.dumps({expr}))"
            )
            out = subprocess.run([sys.executable, "-c", code], cwd=tmp, check=True,
                                 capture_output=True, text=True).stdout  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                           check=True)  # fmt: skip
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], check=True,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    return {"rev": commit, "value": json.loads(out.splitlines()[-1])}


def write_measured(
    out, got: dict, keys, tag: str, data: dict, line, rev=None, module=None, call=None
) -> None:
    """Print and write a scheduler benchmark's result: `got` (this checkout's measurement)
    under `data["this"]`, its `keys` in the summary as `KEY_TAG`; with `rev`, `call` (say
    `"measure(256)"`) of `benchmark.scheduler.MODULE`, run after the test store's setup,
    measured against the plugin at `rev` too, its keys as `KEY_TAG_baseline` and the whole
    answer under `data["baseline"]`. `line(who, m)`: the printed line of one measurement."""
    from sglang_psa.eval.results import write_result

    print(line("this commit", got), flush=True)
    summary = {f"{k}_{tag}": got[k] for k in keys}
    data = {**data, "this": got}
    if rev:
        base = at_revision(
            rev,
            f"m.{call}",
            "from benchmark.scheduler.evict_ops import setup; setup(); "
            f"from benchmark.scheduler import {module} as m",
        )
        print(line(f"baseline {base['rev'][:10]}", base["value"]), flush=True)
        summary |= {f"{k}_{tag}_baseline": base["value"][k] for k in keys}
        data["baseline"] = base
    print(write_result(Path(out), summary, data))


def round_args(doc: str, result: str, rounds: int, baseline: str, argv=None):
    """The command line of a benchmark timing rounds against a `--baseline-rev`: `--out`
    (default `benchmark/results/RESULT.json`), `--rounds`, `--baseline-rev` (help
    `baseline`); parsed from `argv`."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / f"{result}.json"))
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--baseline-rev", help=baseline)
    return ap.parse_args(argv)
