"""Memory flags pushed to their limits on a live server (GPU machine): each setting either
fails at startup with an error naming the flag, or serves a full load of long requests
to the end; never an out-of-memory error in the middle of serving."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

# (extra flags, the flag a startup error must name)
CASES = [
    (["--mem-fraction-static", "0.97"], "--mem-fraction-static"),
    (["--psa-kv-home", "tiered", "--psa-host-pool-gb", "100000"], "--psa-host-pool-gb"),
]
OOM = ("out of memory", "OutOfMemoryError", "CUDA error")


def _serve_or_refuse(tmp_path, extra: list[str], port: int) -> tuple[str, str]:
    """('refused', log) if the server exits at startup, else ('served', log) after a
    load of 16 concurrent 20K-token requests that must all finish."""
    log = tmp_path / "server.log"
    try:
        with probes.live_server(extra, port, log) as (s, proc):
            _load(s, proc)
    except SystemExit:
        return "refused", log.read_text()
    return "served", log.read_text()


def _load(s: probes.Server, proc) -> None:
    """16 concurrent 20K-token requests: every one answered, the server still up."""
    codes: list[int] = []

    def one(i: int) -> None:
        codes.append(s.generate(probes.prompt(20_000, seed=i), 64).status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    time.sleep(1)
    assert proc.poll() is None, "the server died under load"
    assert codes == [200] * 16, codes


@pytest.mark.parametrize(
    "extra, flag", CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else None
)
def test_memory_flags_at_their_limits_refuse_at_startup_or_serve(tmp_path, extra, flag):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    outcome, text = _serve_or_refuse(tmp_path, extra, 30141)
    if outcome == "refused":
        tail = text[-4000:]
        assert flag in tail, f"the startup error does not name {flag}:\n{tail}"
    else:
        hits = [m for m in OOM if m in text]
        assert not hits, f"served, but the log shows {hits}"
