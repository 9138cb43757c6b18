"""benchmark/reliability/probes.py on CPU, against stand-in servers: the copy-engine kill
(which rank's engine is killed, how lost and changed completions are counted) and the
prefix-sharing faults (what each accepts and what fails it)."""

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
        return {"output_ids": self._ids, "meta_info": {"cached_tokens": 2}}


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
    assert rep["cached_tokens"] == [2, 2, 0]  # the killed run's, per prompt (a failure: 0)
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


def test_kill_prompts_share_a_stem_only_when_asked():
    plain, shared = probes.kill_prompts(), probes.kill_prompts(stem=4096)
    assert [len(p) for p in plain] == [len(p) for p in shared] == [6000 + 512 * i for i in range(8)]
    assert len({tuple(p[:4096]) for p in shared}) == 1 and len({tuple(p[:64]) for p in plain}) == 8
    assert len({tuple(p[4096:4160]) for p in shared}) == 8  # each goes on its own way


class _Answer:
    def __init__(self, ids, cached=0, finish="length"):
        self.status_code, self._ids, self._cached, self._finish = 200, ids, cached, finish

    def json(self):
        meta = {"cached_tokens": self._cached, "finish_reason": {"type": self._finish}}
        return {"output_ids": self._ids, "meta_info": meta}


class _PrefixServer:
    """A document's answers: computed, from HBM, then after the flood (`cold`); at the
    tiered home the flood leaves its prefix in the host tier (`cold_cached`)."""

    max_total_tokens = 40000

    def __init__(self, home, cold_ids, cold_cached):
        self.home, self.cold_ids, self.cold_cached, self.docs = home, cold_ids, cold_cached, 0
        self.doc = None

    def generate(self, ids, new, rid=None):
        if self.doc is None:
            self.doc = ids
        if ids != self.doc:  # the flood
            return _Answer([5] * new)
        self.docs += 1
        if self.docs == 3:
            return _Answer(self.cold_ids[:new], self.cold_cached)
        return _Answer([1, 2, 3, 4] + [9] * (new - 4), 0 if self.docs == 1 else 5984)

    def psa_state(self):
        return {"kv_home": self.home}

    def leaks(self):
        return {"running": 0, "kv_held_tokens": 0}

    def healthy(self):
        return True


@pytest.mark.parametrize(
    "home,cold_ids,cold_cached,ok",
    [
        ("tiered", [1, 2, 3, 4] + [8] * 12, 5984, True),  # later tokens may round apart
        ("tiered", [1, 2, 3, 4] + [9] * 12, 0, False),  # recomputed, not read from the host
        ("tiered", [1, 7, 3, 4] + [9] * 12, 5984, False),  # a wrong answer
        ("hbm", [1, 2, 3, 4] + [9] * 12, 0, True),  # evicted and recomputed: nothing kept
        ("hbm", [6, 2, 3, 4] + [9] * 12, 0, False),
    ],
)
def test_a_prefix_evicted_then_asked_again_needs_its_answer_and_the_host_tier(
    home, cold_ids, cold_cached, ok
):
    s = _PrefixServer(home, cold_ids, cold_cached)
    o = probes.prefix_evicted_then_reread(s)
    assert o.ok is ok, o
    assert s.docs == 3 and o.detail["flood_prompts"] == 14  # twice the 40K the server holds


class _SharedServer:
    """Requests that run 2.5 s unless aborted first (`honours_aborts`); a request without a
    rid (the later one with the stem) finishes at once with `cached` tokens cached."""

    def __init__(self, honours_aborts=True, cached=4064):
        import threading

        self.aborted, self.honours, self.cached = set(), honours_aborts, cached
        self.lock = threading.Lock()

    def generate(self, ids, new, rid=None):
        import time

        if rid is None:
            return _Answer([1] * new, self.cached)
        end = time.time() + 2.5
        while time.time() < end:
            with self.lock:
                if rid in self.aborted:
                    return _Answer([1], 0, "abort")
            time.sleep(0.02)
        return _Answer([1] * new, 0)

    def abort(self, rid=None):
        if self.honours:
            with self.lock:
                self.aborted.add(rid)
        return 200

    psa_state = _PrefixServer.psa_state
    leaks = _PrefixServer.leaks
    healthy = _PrefixServer.healthy


@pytest.mark.parametrize(
    "server,ok",
    [
        (_SharedServer(), True),
        (_SharedServer(honours_aborts=False), False),  # the aborted ones ran to the end
        (_SharedServer(cached=0), False),  # the stem was not kept
    ],
)
def test_requests_sharing_a_prefix_four_aborted_the_rest_finish_the_stem_kept(server, ok):
    o = probes.shared_prefix_aborts(server)
    assert o.ok is ok, o
    assert len(o.detail["ends"]) == 8


class _Done:
    """A /generate answer: `ids`, its finish reason, completion tokens and cached tokens."""

    def __init__(self, ids, finish="length", cached=0, status=200):
        self.status_code, self._ids, self._finish, self._cached = status, ids, finish, cached
        self.text = "" if status == 200 else "refused"

    def json(self):
        meta = {"finish_reason": {"type": self._finish}, "cached_tokens": self._cached,
                "completion_tokens": len(self._ids)}  # fmt: skip
        return {"output_ids": self._ids, "meta_info": meta}


class _RetractServer:
    """Requests run to `new` tokens (one of them cut short when `short`); `retracts`
    retractions counted while they run."""

    max_total_tokens = 40000

    def __init__(self, retracts=3, short=False):
        self.retracts, self.short, self.retracted, self.calls = retracts, short, 0, 0

    def generate(self, ids, new, rid=None):
        self.calls += 1
        self.retracted = self.retracts  # seen before the requests end
        n = new - 1 if self.short and self.calls == 3 else new
        return _Done([1] * n, cached=4064)

    def psa_state(self):
        return {"retracted": self.retracted, "kv_home": "hbm"}

    leaks = _PrefixServer.leaks
    healthy = _PrefixServer.healthy


@pytest.mark.parametrize(
    "server,ok",
    [
        (_RetractServer(), True),
        (_RetractServer(retracts=0), False),  # the load never outgrew the KV
        (_RetractServer(short=True), False),  # a request ended short of its length
    ],
)
def test_retraction_with_a_shared_prefix_needs_retractions_and_every_length(server, ok):
    o = probes.retract_shared_prefix(server)
    assert o.ok is ok, o
    # 8 requests that need 1.3x the KV beyond the 4096-token stem, then the stem again
    assert o.detail["new_tokens"] == -(-13 * (40000 - 4096) // 80) and server.calls == 9


class _StormServer(_SharedServer):
    """The document's answer is [1, 2, 3, 4, ...] (after the storm: `after`); a request
    with a rid runs as `_SharedServer`'s do (2.5 s unless aborted first)."""

    max_total_tokens = 40000

    def __init__(self, after=(1, 2, 3, 4), honours_aborts=True):
        super().__init__(honours_aborts)
        self.after, self.asked, self.ask, self.home = list(after), 0, None, "tiered"

    def generate(self, ids, new, rid=None):
        if rid is not None:
            return super().generate(ids, new, rid)
        if self.ask is None:
            self.ask = ids
        if ids != self.ask:  # the flood
            return _Answer([5] * new)
        self.asked += 1
        head = [1, 2, 3, 4] if self.asked < 3 else self.after
        return _Answer(head + [9] * (new - 4))


@pytest.mark.parametrize(
    "server,ok",
    [
        (_StormServer(), True),
        (_StormServer(after=(1, 2, 7, 4)), False),  # the document's answer changed
        (_StormServer(honours_aborts=False), False),  # nothing was aborted
    ],
)
def test_an_abort_storm_on_an_evicted_prefix_aborts_and_keeps_the_answer(server, ok):
    o = probes.abort_storm_staged_prefill(server)
    assert o.ok is ok, o
    assert server.asked == 3 and sum(o.detail["ends"].values()) == 24


class _HostTierServer:
    """A tiered home of `blocks` host blocks, each prompt saving its blocks (none when
    `saves` is False); the prompt numbered `refuse` gets a 4xx. `blocks=None`: the HBM
    home (no host tier)."""

    def __init__(self, blocks=1000, saves=True, refuse=None):
        import threading

        self.blocks, self.saves, self.refuse = blocks, saves, refuse
        self.saved, self.prompts, self.lock = 0, 0, threading.Lock()

    def generate(self, ids, new, rid=None, timeout=None):
        from sglang_psa.config import PSAConfig

        with self.lock:
            self.prompts += 1
            if self.saves:
                self.saved += len(ids) // PSAConfig().block_size
            if self.prompts == self.refuse:
                return _Done([], status=400)
        return _Done([1] * new)

    def psa_state(self):
        if self.blocks is None:
            return {"writeback": None}
        return {"writeback": {"host_blocks_total": self.blocks, "blocks_saved": self.saved}}

    leaks = _PrefixServer.leaks
    healthy = _PrefixServer.healthy


@pytest.mark.parametrize(
    "server,ok",
    [
        (_HostTierServer(), True),
        (_HostTierServer(saves=False), False),  # the tier never filled
        (_HostTierServer(refuse=7), False),  # a prompt refused
        (_HostTierServer(blocks=None), True),  # the HBM home: a load of as many prompts
    ],
)
def test_the_host_tier_full_answers_every_prompt_and_saves_past_its_size(server, ok):
    from sglang_psa.config import PSAConfig

    block = PSAConfig().block_size
    o = probes.host_tier_full(server, prompt_tokens=10 * block, concurrent=4)
    assert o.ok is ok, o
    holds = 1000 * block if server.blocks else 4 * 2**30 // probes.KV_BYTES_PER_TOKEN
    assert o.detail["prompts"] == -(-int(1.6 * holds) // (10 * block))
    assert server.prompts == o.detail["prompts"] + 1  # and one asked again
