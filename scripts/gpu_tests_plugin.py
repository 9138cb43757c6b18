"""pytest plugin of `scripts/gpu_tests.py` (`-p gpu_tests_plugin`, scripts/ on the path):
written the moment each test phase ends, before pytest's summary, which a run cut by the
call's budget never prints:

- `GPU_TESTS_PHASES` (JSON lines): each setup, call and teardown, its outcome and seconds
  (a module fixture's server start counts in the setup of the first test that uses it).
  The runner reads outcomes from here, not from pytest's `-v` lines alone: with
  `--capture=sys` a child process (an engine's scheduler) writes between a test's id and
  its outcome word.
- `GPU_TESTS_FAILURES` (JSON lines): each failure's report.
"""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    """Every phase's outcome and seconds; a failed phase's `E` lines and report's tail."""
    if phases := os.environ.get("GPU_TESTS_PHASES"):
        rec = {"id": report.nodeid, "when": report.when, "outcome": report.outcome,
               "s": report.duration}  # fmt: skip
        if hasattr(report, "wasxfail"):
            rec["xfail"] = True
        if report.skipped and isinstance(report.longrepr, tuple):
            rec["reason"] = str(report.longrepr[2]).removeprefix("Skipped: ")
        with open(phases, "a") as f:
            f.write(json.dumps(rec) + "\n")
    where = os.environ.get("GPU_TESTS_FAILURES")
    if where and report.failed:
        text = report.longreprtext.strip()
        said = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
        message = " / ".join(said)[:1500] if said else text[-1500:]
        with open(where, "a") as f:
            f.write(json.dumps({"id": report.nodeid, "when": report.when, "message": message,
                                "report": text[-6000:]}) + "\n")  # fmt: skip
