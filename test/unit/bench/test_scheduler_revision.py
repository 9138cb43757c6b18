"""`--baseline-rev` of the scheduler benchmarks (benchmark/scheduler/revision.py): the
expression runs against the plugin at the named commit, in a worktree that is removed
afterwards, beside this checkout's benchmark modules."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location(
    "revision", ROOT / "benchmark" / "scheduler" / "revision.py"
)
revision = importlib.util.module_from_spec(spec)
sys.modules["revision"] = revision
spec.loader.exec_module(revision)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()  # fmt: skip


def test_the_expression_runs_against_that_commits_plugin_and_the_worktree_goes():
    try:
        head = _git("rev-parse", "HEAD")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout (the benchmark compares commits)")
    trees = _git("worktree", "list")
    got = revision.at_revision(
        "HEAD",
        "[m.__file__, b.__file__]",
        "import sglang_psa as m; from benchmark.scheduler import evict_ops as b",
    )
    plugin, bench = map(Path, got["value"])
    assert got["rev"] == head
    assert not plugin.is_relative_to(ROOT / "python")  # the commit's, from its worktree
    assert plugin.parts[-2:] == ("sglang_psa", "__init__.py")
    assert bench == ROOT / "benchmark" / "scheduler" / "evict_ops.py"  # this checkout's
    assert _git("worktree", "list") == trees
