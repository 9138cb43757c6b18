"""benchmark/reliability/probes.py's copy-engine kill on CPU, against a stand-in server:
which rank's engine is killed, and how lost and changed completions are counted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmark" / "reliability"))

import probes  # noqa: E402


class _Response:
    def __init__(self, ids, status=200):
        self.status_code, self._ids = status, ids
        self.text = "" if status == 200 else "boom"

    def json(self):
        return {"output_ids": self._ids}


class _TwoRankServer:
    """Two ranks' engines (pids 10, 11); after a kill the killed rank's engine restarts as
    pid 99. The killed run's second completion differs and its third fails."""

    def __init__(self):
        self.pids, self.restarts, self.run, self.calls = [10, 11], 0, 0, 0

    def post(self, path, timeout=None):
        assert path == "/flush_cache"
        self.run += 1
        return _Response([])

    def psa_state(self):
        wb = {
            "engine_pid": list(self.pids), "engine_restarts": self.restarts,
            "save_jobs_in_flight": 0, "blocks_saved": 5, "dropped_blocks": 1,
            "blocks_planned": 6, "host_blocks_used": 0,
        }  # fmt: skip
        return {"writeback": wb, "residency": {"units_read_host": 3 * self.run}}

    def generate(self, ids, new):
        self.calls += 1
        if self.run == 2 and ids[0] == 3:
            return _Response(None, status=500)
        if self.run == 2 and ids[0] == 2:
            return _Response([7] * new)
        return _Response([1] * new)


def test_engine_kill_kills_the_ranks_engine_and_counts_lost_and_changed(monkeypatch):
    s = _TwoRankServer()
    killed = []

    def kill(pid, sig):
        killed.append(pid)
        s.pids[s.pids.index(pid)] = 99
        s.restarts += 1

    monkeypatch.setattr("os.kill", kill)
    monkeypatch.setattr(probes.time, "sleep", lambda _s: None)
    rep = probes.engine_kill(s, [[1], [2], [3]], new=4, rank=1)
    assert killed == [11] and rep["killed_pid"] == 11
    assert rep["engine_pid_before"] == [10, 11] and rep["engine_pid_after"] == [10, 99]
    assert (rep["requests"], rep["baseline_complete"]) == (3, 3)
    assert (rep["lost"], rep["changed"], rep["engine_restarts"]) == (1, 1, 1)
    assert rep["units_read_host"] == 0 and rep["settled"]  # 5 saved + 1 dropped of 6 planned
    s2 = _TwoRankServer()
    monkeypatch.setattr("os.kill", lambda pid, sig: killed.append(pid))
    s2.psa_state = lambda: {
        "writeback": dict(_TwoRankServer().psa_state()["writeback"], engine_pid=42),
        "residency": {"units_read_host": 0},
    }
    assert probes.engine_kill(s2, [[1]], new=2)["killed_pid"] == 42  # one rank: its pid
    with pytest.raises(AssertionError):
        s2.post = lambda path, timeout=None: _Response(None, status=503)
        probes.engine_kill(s2, [[1]], new=2)
