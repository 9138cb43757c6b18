"""pytest plugin of `scripts/gpu_tests.py` (`-p gpu_tests_plugin`, scripts/ on the path):
each failure's report appended to the JSON-lines file `GPU_TESTS_FAILURES` the moment it
fails, before pytest's summary, which a run cut by the call's budget never prints; and
each test's setup, call and teardown seconds to `GPU_TESTS_TIMES` as each ends (a module
fixture's server start counts in the setup of the first test that uses it)."""

from __future__ import annotations

import json
import os


def pytest_runtest_logreport(report) -> None:
    """Every phase's seconds; a failed setup, call or teardown: its id, `E` lines and
    report's tail."""
    if times := os.environ.get("GPU_TESTS_TIMES"):
        with open(times, "a") as f:
            f.write(json.dumps({"id": report.nodeid, "s": report.duration}) + "\n")
    where = os.environ.get("GPU_TESTS_FAILURES")
    if where and report.failed:
        text = report.longreprtext.strip()
        said = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
        message = " / ".join(said)[:1500] if said else text[-1500:]
        with open(where, "a") as f:
            f.write(json.dumps({"id": report.nodeid, "when": report.when, "message": message,
                                "report": text[-6000:]}) + "\n")  # fmt: skip
