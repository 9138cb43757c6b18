"""`--psa-kv-home tiered` on a live server (GPU machine): the copy engine killed while
requests are served and written back is noticed and restarted, its unacknowledged saves
are redone, the completions equal those of an unkilled run, and every host block returns
afterwards. Twice: with HBM for KV as large as SGLang makes it, and capped below each
prompt, where saved blocks leave HBM and decode (at threshold 1: every block) reads them
back from the host tier, so a redone save that wrote wrong data changes the
completions."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

ARGS = [
    "--psa-kv-home", "tiered", "--psa-writeback", "engine", "--psa-host-pool-gb", "4",
    "--max-running-requests", "8",
]  # fmt: skip
CAPPED = [
    "--max-total-tokens", "4096", "--chunked-prefill-size", "2048", "--context-length", "32768",
    "--psa-threshold", "1",
]  # fmt: skip
PROMPTS = [probes.prompt(6000 + 512 * i, seed=i) for i in range(8)]


@pytest.fixture(scope="module", params=["uncapped", "capped"])
def server(request, tmp_path_factory):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    log = tmp_path_factory.mktemp("server") / "server.log"
    capped = request.param == "capped"
    with probes.live_server(ARGS + CAPPED * capped, 30131 + capped, log) as (s, _):
        s.capped = capped
        yield s


def _run_all(s: probes.Server, during=None) -> list[list[int]]:
    """The prompts one after another (greedy, so batches and numerics are the same in
    every run), `during()` called in parallel; the output ids."""
    side = threading.Thread(target=during) if during is not None else None
    if side is not None:
        side.start()
    out = []
    for p in PROMPTS:
        r = s.generate(p, 96)
        out.append(r.json()["output_ids"] if r.status_code == 200 else r.text)
    if side is not None:
        side.join(60)
    return out


def _writeback(s: probes.Server) -> dict:
    return s.psa_state()["writeback"]


def test_engine_killed_mid_save_is_restarted_and_completions_are_unchanged(server):
    assert server.post("/flush_cache", timeout=60).status_code == 200
    want = _run_all(server)
    assert all(isinstance(o, list) and len(o) == 96 for o in want), want
    before = _writeback(server)
    assert before["blocks_saved"] > 0 and before["engine_restarts"] == 0

    def kill_during_prefill():
        time.sleep(0.3)  # the first requests' saves are under way
        os.kill(_writeback(server)["engine_pid"], signal.SIGKILL)

    assert server.post("/flush_cache", timeout=60).status_code == 200
    host_reads = server.psa_state()["residency"]["units_read_host"]
    got = _run_all(server, during=kill_during_prefill)
    res = server.psa_state()["residency"]
    print("residency after the kill:", res)
    if server.capped:
        assert res["units_read_host"] > host_reads, "nothing was read back from the host tier"
    after = _writeback(server)
    print("write-back after the kill:", after)
    assert after["engine_restarts"] == 1, after
    assert after["engine_pid"] != before["engine_pid"]
    same = sum(a == b for a, b in zip(got, want))
    assert same == len(want), f"{same}/{len(want)} completions equal the unkilled run's"
    deadline = time.time() + 60
    while _writeback(server)["save_jobs_in_flight"] and time.time() < deadline:
        time.sleep(0.5)
    rep = _writeback(server)
    assert rep["save_jobs_in_flight"] == 0
    assert rep["blocks_saved"] + rep["dropped_blocks"] == rep["blocks_planned"], rep
    assert rep["host_blocks_used"] == 0, rep  # every request ended: every host block back
