"""Working-set admission, retraction and rejection through the scheduler hooks, driven with
synthetic requests (the hook functions are called as SGLang's HookRegistry calls them)."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from sglang_psa import releases
from sglang_psa.config import PSAConfig
from sglang_psa.mem_cache.residency import ROOM_HIGH, ROOM_LOW, Residency
from sglang_psa.plugin import scheduling
from sglang_psa.sched import process
from sglang_psa.sched.admission import Candidate
from sglang_psa.sched.serving import RECORD_EVERY_STEPS, PSAServing

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

try:  # the real enum when SGLang is installed; the hook imports it lazily
    from sglang.srt.managers.schedule_policy import AddReqResult
except ImportError:
    AddReqResult = None

BS = 32


@pytest.fixture
def serving(monkeypatch):
    if AddReqResult is None:
        fake = SimpleNamespace(AddReqResult=Enum("AddReqResult", "CONTINUE NO_TOKEN OTHER"))
        monkeypatch.setitem(__import__("sys").modules, "sglang.srt.managers.schedule_policy", fake)
    cfg = PSAConfig(ws_window=2)
    # 2 layers x 2 KV heads = 4 units per block; capacity 100 units; KV in HBM only.
    s = PSAServing(cfg, layers=2, kv_heads=2, hbm_units=100)
    _register(s)
    yield s
    process.register(None)


def _register(serving: PSAServing) -> None:
    """A scheduler process whose hooks call `serving` (what `plugin.scheduling` reads of
    `sched.process.SchedulerProcess`)."""
    process.register(SimpleNamespace(serving=serving))


def _noop(*args, **kwargs):
    return None


def _insert(flag: bool) -> dict:
    """`release_kv_cache`'s insert flag as the installed SGLang names it (`is_insert` in
    0.5.17, keyword-only `checkpoint` from 0.5.23 on)."""
    return {releases.path("release.insert"): flag}


def _req(rid, tokens, pool_idx=None, finished=False):
    return SimpleNamespace(
        rid=rid,
        origin_input_ids=[0] * tokens,
        seqlen=tokens,
        req_pool_idx=pool_idx,
        sampling_params=SimpleNamespace(max_new_tokens=16),
        finished=lambda: finished,
    )


def _adder(running=()):
    return SimpleNamespace(can_run_list=[], running_batch=SimpleNamespace(reqs=list(running)))


def _orig_admits(adder, req, has_chunked_req, truncation_align_size):
    adder.can_run_list.append(req)
    return _result().CONTINUE


def _result():
    import sys

    return sys.modules["sglang.srt.managers.schedule_policy"].AddReqResult


def test_admission_by_working_set_waits_then_admits_and_never_stalls(serving):
    add = scheduling.around_add_one_req
    # Estimate of a new request: default_fraction 0.5 of its units (4 per block).
    a, b, c = _req("a", 640), _req("b", 640), _req("c", 640)  # 20 blocks -> 80 units, est 40
    adder = _adder()
    assert add(_orig_admits, adder, a, False, None) == _result().CONTINUE
    assert add(_orig_admits, adder, b, False, None) == _result().CONTINUE
    assert serving.controller.used_units == 80
    # A third would need 120 > 100: it waits (stays queued), nothing is dropped.
    assert add(_orig_admits, adder, c, False, None) == _result().OTHER
    assert c not in adder.can_run_list and "c" not in serving.controller.running
    # Alone (nothing running or being added), even an oversized request is admitted.
    serving.release("a", retracted=False)
    serving.release("b", retracted=False)
    big = _req("big", 4000)  # est 250 units > 100
    assert add(_orig_admits, _adder(), big, False, None) == _result().CONTINUE
    assert "big" in serving.controller.running
    serving.controller.check_integrity()


def test_a_working_set_refusal_stops_the_queue_until_the_units_are_free(serving):
    """After a working-set refusal SGLang is not offered its queue again (`batch_is_full`)
    until the refused request's units are free: every round before would match each queued
    prompt against the prefix cache for nothing. Those rounds count as waits."""
    add = scheduling.around_add_one_req
    a, b, c = _req("a", 640, pool_idx=1), _req("b", 640, pool_idx=2), _req("c", 640)
    adder = _adder()
    assert add(_orig_admits, adder, a, False, None) == _result().CONTINUE
    assert add(_orig_admits, adder, b, False, None) == _result().CONTINUE
    adder = _adder(running=[a, b])
    assert add(_orig_admits, adder, c, False, None) == _result().OTHER  # 120 > 100
    batch = adder.running_batch
    assert batch.batch_is_full is True and serving.refused == ("working_set", 40)
    for rounds in (1, 2, 3):  # the refusal's round counted once, then one a round
        assert scheduling.around_check_decode_mem(lambda *a: True, batch) is True
        assert batch.batch_is_full is True  # 20 units free of the 40 it needs
        assert serving.waits["working_set"] == rounds
    serving.release("b", retracted=False)  # 60 free (SGLang also lifts it as b leaves)
    batch.reqs = [a]
    assert scheduling.around_check_decode_mem(lambda *a: True, batch) is True
    assert batch.batch_is_full is False and serving.waits["working_set"] == 3
    assert add(_orig_admits, _adder(running=[a]), c, False, None) == _result().CONTINUE
    assert serving.refused is None


def test_a_host_tier_refusal_stops_the_queue_until_a_request_leaves(serving):
    """A queued request the host tier cannot hold waits for a running request to end (its
    host blocks come back): no decode round lifts SGLang's stop before then."""
    serving.writeback = SimpleNamespace(
        reserve=lambda rid, tokens: False, blocks=SimpleNamespace(available=0)
    )
    serving.residency = SimpleNamespace(evictable=lambda reqs: 5)  # blocks could leave HBM
    adder = _adder(running=[_req("a", 640, pool_idx=1)])
    assert add_result(adder, _req("c", 640)) == _result().OTHER
    batch = adder.running_batch
    assert serving.refused == ("host_tier", 0) and batch.batch_is_full is True
    assert serving.retry_queue(batch.reqs) is False  # the refusal's round: counted once
    assert serving.retry_queue(batch.reqs) is False
    assert serving.waits["host_tier"] == 2


def add_result(adder, req):
    return scheduling.around_add_one_req(_orig_admits, adder, req, False, None)


def test_requests_matching_a_cached_document_count_it_once(serving, monkeypatch):
    """Questions about one document that matched it in the prefix cache share its pages:
    admission counts the document once among them, apart per cache namespace."""
    from sglang_psa.sched import serving as serving_mod

    monkeypatch.setattr(serving_mod, "PREFIX_GRANULE_TOKENS", 256)
    add = scheduling.around_add_one_req
    adder = _adder()

    def question(rid, matched, extra_key=None):
        req = _req(rid, 320)  # est 20 of its 40 units
        req.origin_input_ids = [7] * 300 + [hash(rid) % 1000] * 20
        req.prefix_indices = [0] * matched  # 300 matched: 256 shared, 32 units
        req.extra_key = extra_key
        req.sampling_params.ignore_eos = False
        return req

    asked = [("first", 0)] + [(f"q{i}", 300 - i) for i in range(1, 9)]
    for rid, matched in asked:
        assert add(_orig_admits, adder, question(rid, matched), False, None) == _result().CONTINUE
    # first 20 (it computed the document: nothing matched); each question 4 of its own
    # and 16 on the document, whose 32 units q1 and q2 reach: 84 of 100, 180 unshared.
    assert serving.controller.used_units == 20 + 8 * 4 + 32
    other = question("elsewhere", 300, extra_key="tenant-b")  # another namespace: no share
    assert add(_orig_admits, adder, other, False, None) == _result().OTHER
    assert serving.waits["working_set"] == 1
    for rid, _ in asked:
        serving.release(rid, retracted=False)
    serving.dropped(["elsewhere"])  # aborted while queued
    assert serving.controller.used_units == 0 and not serving._prefix_keys
    serving.controller.check_integrity()


@pytest.mark.parametrize("answer,kv_waits", [("NO_TOKEN", 1), ("OTHER", 0)])
def test_sglang_refusing_after_admission_is_rolled_back(serving, answer, kv_waits):
    """SGLang's adder refusing a request the plugin admitted rolls the admission back. Only
    its KV budget's refusal (NO_TOKEN) is a round waited for KV pages; OTHER (the prefill
    batch's tokens are spent) leaves the request for the next batch, as without the plugin."""

    def orig_refuses(adder, req, has_chunked_req, truncation_align_size):
        return getattr(_result(), answer)

    res = scheduling.around_add_one_req(orig_refuses, _adder(), _req("a", 320), False, None)
    assert res == getattr(_result(), answer)
    assert serving.waits == {"working_set": 0, "host_tier": 0, "kv_pages": kv_waits}
    assert not serving.controller.running and serving.controller.used_units == 0
    stats = serving.controller.stats
    assert (stats.admitted, stats.finished, stats.retracted) == (0, 0, 0)
    serving.controller.check_integrity()


def _decode_steps(batch, steps: int) -> None:
    for _ in range(steps):
        scheduling.around_check_decode_mem(lambda *a: True, batch)


def test_a_record_credits_the_steps_a_request_decoded():
    """Recorded every RECORD_EVERY_STEPS steps, a request's window fills by the decode
    steps it made: at its first record those behind its output (the prefill gave one
    token), after that the tokens it gained since its last record."""
    s = PSAServing(PSAConfig(ws_window=12), layers=2, kv_heads=2, hbm_units=10_000)
    sizes, lengths = [0, 30, 30], [0, 0, 0]
    s.measure = lambda: (sizes, lengths)
    old = SimpleNamespace(rid="old", req_pool_idx=1, seqlen=700, output_ids=[0] * 6)
    new = SimpleNamespace(rid="new", req_pool_idx=2, seqlen=641, output_ids=[0])
    for r in (old, new):
        assert s.try_admit(r.rid, 640, alone=False)
    tracker = s.controller.tracker
    for step in range(2 * RECORD_EVERY_STEPS + 1):
        lengths[1:] = [old.seqlen - 1, new.seqlen - 1]  # what the last step measured
        s.flush_step([old, new])
        if step == 0:  # the first record: 5 steps behind old's 6 tokens, 1 for new
            assert (tracker.num_steps("old"), tracker.num_steps("new")) == (5, 1)
        for r in (old, new):
            r.seqlen += 1
            r.output_ids.append(0)
    # two more records, 8 tokens each: old's window is full, new's has 1 + 8 + 8 > 12
    assert tracker.num_steps("old") == tracker.num_steps("new") == 12
    assert tracker.is_warm("new")
    s.controller.check_integrity()


def test_decode_steps_record_working_sets_and_force_retraction(serving):
    adder = _adder()
    reqs = [_req("a", 640, pool_idx=1), _req("b", 640, pool_idx=2)]
    for r in reqs:
        scheduling.around_add_one_req(_orig_admits, adder, r, False, None)
    batch = SimpleNamespace(reqs=reqs)
    # The GPU published one step (by request-table row: sizes, lengths measured at): each
    # request's window holds 60 units of its 80. Row 3 is someone else's.
    sizes, lengths = [0, 60, 60, 5], [0, 639, 640, 900]
    serving.measure = lambda: (sizes, lengths)
    # Windows are not full yet (ws_window=2): load = max(estimate 40, measured 60) = 60 each.
    assert scheduling.around_check_decode_mem(lambda *a: True, batch) is False  # 120 > 100: retract
    assert scheduling.around_check_decode_mem(lambda *a: True, batch, selected_indices=[0]) is True
    assert serving.controller.tracker.size("a") == 60
    # Sizes are recorded every RECORD_EVERY_STEPS steps (the first step recorded): a new
    # value waits for the next record.
    sizes[1] = 50
    _decode_steps(batch, RECORD_EVERY_STEPS - 3)  # steps 3 to 7
    assert serving.controller.tracker.size("a") == 60
    _decode_steps(batch, 2)  # step 9 records
    assert serving.controller.tracker.size("a") == 50
    # A row measured at another length (a new request in a reused row, or a value older
    # than the window) is not taken.
    sizes[1], lengths[1] = 7, 600
    _decode_steps(batch, RECORD_EVERY_STEPS)
    assert serving.controller.tracker.size("a") == 50
    sizes[1], lengths[1] = 60, 639
    _decode_steps(batch, RECORD_EVERY_STEPS)
    assert serving.controller.tracker.size("a") == 60
    # SGLang retracts "b" (release without insert, not finished): paused, history kept.
    scheduling.around_release_kv_cache(_noop, reqs[1], None, **_insert(False))
    assert "b" in serving.controller.paused and serving.controller.tracker.size("b") == 60
    assert (
        scheduling.around_check_decode_mem(lambda *a: True, SimpleNamespace(reqs=reqs[:1])) is True
    )
    # "a" finishes: everything is returned.
    done = _req("a", 640, pool_idx=1, finished=True)
    scheduling.around_release_kv_cache(_noop, done, None, **_insert(True))
    assert "a" not in serving.controller.running and serving.controller.used_units == 0
    # The retracted request resumes through admission with its measured set.
    assert scheduling.around_add_one_req(_orig_admits, _adder(), reqs[1], False, None) == (
        _result().CONTINUE
    )
    assert serving.controller.used_units == 60
    serving.controller.check_integrity()
    # SGLang's own verdict (not enough KV pages) is never overruled.
    assert scheduling.around_check_decode_mem(lambda *a: False, batch) is False


def test_tiered_home_holds_back_by_working_set_but_never_retracts(serving):
    """At the tiered home a new request waits while the running working sets fill HBM, as
    at the HBM home; but working sets that outgrow HBM later are read across PCIe: no
    request is retracted for them (SGLang's retraction would free the KV and prefill it
    again; on the H100 a lone request retracted so was aborted as out of memory)."""
    host = PSAServing(
        PSAConfig(ws_window=2, kv_home="tiered"),
        layers=2,
        kv_heads=2,
        hbm_units=100,
        host_tokens=1 << 20,
    )
    _register(host)
    adder = _adder()
    reqs = [_req(r, 640, pool_idx=i) for i, r in enumerate("abc")]  # est 40 units each
    add = scheduling.around_add_one_req
    assert add(_orig_admits, adder, reqs[0], False, None) == _result().CONTINUE
    assert add(_orig_admits, adder, reqs[1], False, None) == _result().CONTINUE
    assert add(_orig_admits, adder, reqs[2], False, None) == _result().OTHER  # 120 > 100
    assert set(host.controller.running) == {"a", "b"}
    assert host.waits == {"working_set": 1, "host_tier": 0, "kv_pages": 0}
    host.measure = lambda: ([80, 80, 80], [640, 640, 640])
    two = reqs[:2]
    assert scheduling.around_check_decode_mem(lambda *a: True, SimpleNamespace(reqs=two)) is True
    assert host.controller.tracker.size("a") == 80  # measured: 160 > 100, none retracted
    assert scheduling.around_check_decode_mem(lambda *a: False, SimpleNamespace(reqs=two)) is False
    for r in two:
        scheduling.around_release_kv_cache(_noop, _req(r.rid, 640, finished=True), None)
    assert not host.controller.running and host.controller.used_units == 0
    host.controller.check_integrity()


def test_requests_too_large_are_refused_naming_the_flag(serving):
    ok = _req("y", 1000)
    assert scheduling.after_validate_input_length(None, ok, 10**6, False) is None
    small_cache = PSAServing(PSAConfig(), layers=2, kv_heads=2, hbm_units=10)
    _register(small_cache)
    msg = scheduling.after_validate_input_length(None, ok, 10**6, False)
    assert "--psa-gpu-cache-gb" in msg
    # Tiered home: blocks beyond HBM are read from the host tier, so it is served; a
    # request longer than the host tier holds is refused naming its flag.
    tiered = PSAConfig(kv_home="tiered", host_pool_gb=1.0)
    _register(PSAServing(tiered, layers=2, kv_heads=2, hbm_units=10, host_tokens=4096))
    assert scheduling.after_validate_input_length(None, ok, 10**6, False) is None
    too_long = _req("x", 4090)  # + 16 new tokens > 4096 host-tier tokens
    msg = scheduling.after_validate_input_length(None, too_long, 10**6, False)
    assert "--psa-host-pool-gb" in msg and "4106" in msg
    # SGLang's own error message stands as it is.
    assert scheduling.after_validate_input_length("too long", ok, 10, False) == "too long"


def test_without_sparse_mode_every_hook_passes_through():
    process.register(None)
    calls = []

    def orig(adder, req, has_chunked_req, truncation_align_size):
        calls.append((req.rid, has_chunked_req, truncation_align_size))
        return "whatever"

    assert scheduling.around_add_one_req(orig, _adder(), _req("a", 10), True, 64) == "whatever"
    assert calls == [("a", True, 64)]
    assert scheduling.around_check_decode_mem(lambda *a: True, SimpleNamespace(reqs=[])) is True
    assert scheduling.after_validate_input_length(None, _req("a", 10**7), 1, False) is None
    assert scheduling.around_release_kv_cache(lambda *a, **k: "r", _req("a", 1), None) == "r"


def test_server_info_reports_counters_and_held_kv(serving):
    scheduling.around_add_one_req(_orig_admits, _adder(), _req("a", 320), False, None)
    sched = SimpleNamespace(
        max_total_num_tokens=1000,
        token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: 600),
        tree_cache=SimpleNamespace(evictable_size=lambda: 300, protected_size=lambda: 64),
        req_to_token_pool=SimpleNamespace(available_size=lambda: 7),
    )
    out = scheduling.after_get_internal_state(SimpleNamespace(internal_state={}), sched, None)
    psa = out.internal_state["psa"]
    assert psa["running"] == 1 and psa["admitted"] == 1 and psa["used_units"] == 20
    assert psa["kv_held_tokens"] == 1000 - 600 - 364 and psa["req_slots_free"] == 7


def test_a_retracted_request_aborted_while_waiting_is_forgotten(serving):
    """SGLang pops an aborted request from its waiting queue without release_kv_cache: the
    paused entry of a retracted one must go too (else it stays paused forever)."""
    adder = _adder()
    reqs = [_req("a", 640, pool_idx=1), _req("b", 640, pool_idx=2), _req("c", 64, pool_idx=3)]
    for r in reqs:
        scheduling.around_add_one_req(_orig_admits, adder, r, False, None)
    for r in reqs[1:]:  # both retracted: back in SGLang's waiting queue, paused here
        scheduling.around_release_kv_cache(_noop, r, None, **_insert(False))
    assert serving.controller.paused == {"b", "c"}
    sched = SimpleNamespace(
        waiting_queue=[reqs[2]], running_batch=SimpleNamespace(reqs=[reqs[0]]), chunked_req=None
    )
    # Abort "b" (SGLang already popped it) and, by prefix, nothing else that still waits.
    scheduling.around_abort_request(_noop, sched, SimpleNamespace(rid="b", abort_all=False))
    assert serving.controller.paused == {"c"} and "a" in serving.controller.running
    sched.waiting_queue = []
    scheduling.around_abort_request(_noop, sched, SimpleNamespace(rid="", abort_all=True))
    assert not serving.controller.paused and "a" in serving.controller.running
    serving.controller.check_integrity()


def test_a_lone_request_whose_working_set_outgrows_the_cache_is_not_retracted(serving):
    """With nothing else to retract SGLang would abort it as out of memory (HTTP 500)."""
    big = _req("big", 4000, pool_idx=1)  # est 250 units > 100: admitted alone
    scheduling.around_add_one_req(_orig_admits, _adder(), big, False, None)
    serving.measure = lambda: ([0, 300, 0], [0, 4000, 0])
    assert scheduling.around_check_decode_mem(lambda *a: True, SimpleNamespace(reqs=[big])) is True
    assert serving.controller.tracker.size("big") == 300
    # With a second request, outgrowing the cache still asks SGLang to retract.
    other = _req("b", 64, pool_idx=2)
    scheduling.around_add_one_req(_orig_admits, _adder(), other, False, None)
    assert (
        scheduling.around_check_decode_mem(lambda *a: True, SimpleNamespace(reqs=[big, other]))
        is False
    )


@pytest.mark.parametrize("evictable", [0, 5])
def test_tiered_decode_round_retries_queued_prompts_while_blocks_can_leave(serving, evictable):
    """SGLang stops offering queued prompts to the adder once one did not fit, until a
    request leaves. At the tiered home, each decode round lifts that stop while running
    requests still have blocks that could leave HBM, so admission by eviction goes on."""
    calls = []
    serving.residency = _residency(
        make_room=lambda reqs, tokens, alloc, *a: calls.append(("room", tokens)) or 0,
        refresh=lambda reqs, alloc: calls.append(("refresh",)) or 0,
        evictable=lambda reqs: evictable,
    )
    alloc = SimpleNamespace(available_size=lambda: 10 * BS)
    reqs = [_req("a", 100, pool_idx=1), _req("b", 100, pool_idx=2)]
    batch = SimpleNamespace(reqs=reqs, token_to_kv_pool_allocator=alloc, batch_is_full=True)
    assert scheduling.around_check_decode_mem(lambda *a: True, batch) is True
    assert batch.batch_is_full is (evictable == 0)
    assert ("refresh",) in calls


def _residency(**calls):
    """A stand-in for `Residency` with `calls` (`make_room`, `refresh`, `evictable`) and its
    real `room_for_decode` over them."""
    res = SimpleNamespace(block_size=BS, **calls)
    res.room_for_decode = lambda *a: Residency.room_for_decode(res, *a)
    return res


@pytest.mark.parametrize(
    "free, tree_pages, asked_pages", [(1, 8, 0), (1, 1, 4), (ROOM_LOW * 2, 8, None)]
)
def test_tiered_decode_round_evicts_unheld_prefixes_before_running_blocks(
    serving, free, tree_pages, asked_pages
):
    """A decode round of two requests short of pages (fewer than ROOM_LOW a request free)
    frees up to ROOM_HIGH a request: first prefixes SGLang's tree keeps that no running
    request holds (SGLang's own eviction, as plain SGLang's decode check does), and asks
    `make_room` to take running requests' saved blocks off HBM only for what the tree
    could not give. With ROOM_LOW a request free nothing leaves HBM (`asked_pages`
    None): the band keeps rounds from evicting a block each."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    calls = []
    serving.residency = _residency(
        make_room=lambda reqs, tokens, alloc, *a: calls.append(tokens) or 0,
        refresh=lambda reqs, alloc: 0,
        evictable=lambda reqs: 0,
    )
    start = free

    class Alloc:
        free = start  # pages

        def available_size(self):
            return self.free * BS

        def evict_to_free_tokens(self, tree_cache, num_tokens):  # SGLang 0.5.23's path
            tree_cache.evict(EvictParams(num_tokens=num_tokens - self.available_size()))

    class Tree:
        token_to_kv_pool_allocator = alloc = Alloc()
        held = tree_pages  # pages of finished requests' prefixes, unlocked

        def is_chunk_cache(self):
            return False

        def supports_prefix_sharing(self):
            return True

        def evict(self, params):
            n = min(self.held, -(-params.num_tokens // BS))
            self.held -= n
            self.alloc.free += n

        evict_for_alloc = evict

    tree = Tree()
    reqs = [_req("a", 100, pool_idx=1), _req("b", 100, pool_idx=2)]
    batch = SimpleNamespace(
        reqs=reqs, token_to_kv_pool_allocator=tree.alloc, tree_cache=tree, batch_is_full=False
    )
    assert scheduling.around_check_decode_mem(lambda *a: True, batch) is True
    if asked_pages is None:
        assert calls == [] and tree.held == tree_pages
        return
    # short: room for ROOM_HIGH pages a request; the tree gives what it can, running
    # blocks only what is left
    want = ROOM_HIGH * 2
    assert calls == ([asked_pages * BS] if asked_pages else [])
    assert tree.held == max(0, tree_pages - (want - free))
    assert tree.alloc.free + asked_pages == want


def test_a_waiting_request_is_explained_in_the_log_at_most_every_interval(serving, caplog):
    """An operator whose queue does not move reads why in the server log: the reason and
    its numbers, once per interval however many scheduling rounds wait."""
    import logging

    add = scheduling.around_add_one_req
    adder = _adder()
    for r in "ab":
        assert add(_orig_admits, adder, _req(r, 640), False, None) == _result().CONTINUE
    with caplog.at_level(logging.INFO, logger="sglang_psa.sched.serving"):
        for _ in range(3):
            assert add(_orig_admits, adder, _req("c", 640), False, None) == _result().OTHER
    lines = [r.getMessage() for r in caplog.records if "queued request waits" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "working_set" in lines[0] and "80 units" in lines[0] and "holds 100" in lines[0]
    assert serving.waits["working_set"] == 3 and serving.deferrals == 3


class _SGLangReq(SimpleNamespace):
    """What SGLang's real `PrefillAdder.add_one_req` reads of a request."""

    def __init__(self, rid, prompt, max_new, out=0, ignore_eos=True):
        super().__init__(
            rid=rid,
            origin_input_ids=[0] * prompt,
            output_ids=[0] * out,
            full_untruncated_fill_ids=[0] * (prompt + out),
            seqlen=prompt + out,
            last_node=None,
            host_hit_length=0,
            retracted_stain=False,
            sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos),
            finished=lambda: False,
        )
        if releases.has("prefix_slots"):  # 0.5.17: the prefix's slots, a row of its own
            self.prefix_indices, self.req_pool_idx = [], None
        else:  # from 0.5.23 on: the prefix's length, the row in the KV record
            self.prefix_len, self.kv = 0, SimpleNamespace(req_pool_idx=None)
            self.swa_host_hit_length, self.best_match_node = 0, None
            self.auxiliary_swa_host_hit_length = self.mamba_host_hit_length = 0
            self.storage_hit_start, self.storage_hit_length, self.host_loaded_length = None, 0, 0
            self.cache_request_handle, self.host_hit_is_storage = None, False

    def set_extend_range(self, start, end):  # 0.5.17
        self.extend_range = SimpleNamespace(start=start, end=end, length=end - start)

    @property
    def extend_len(self):  # from 0.5.23 on: the extend runs [prefix_len, extend_end)
        return self.extend_end - self.prefix_len

    @property
    def extended(self) -> tuple[int, int]:
        """(first token, tokens) of the extend SGLang's adder set up, in either release."""
        if "extend_range" in vars(self):
            return self.extend_range.start, self.extend_range.length
        return self.prefix_len, self.extend_len

    def needs_host_load_back(self):
        return False

    def __getattr__(self, name):  # from 0.5.23 on the adder asks more of `Req`: its own code
        from sglang.srt.managers.schedule_batch import Req

        attr = getattr(Req, name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if not callable(attr):
            raise AttributeError(name)
        return attr.__get__(self)


def _set_prefix(req, tokens: int) -> None:
    """`req`'s prefix is its first `tokens` tokens, where the installed SGLang keeps it
    (0.5.17: a slot list, here page-0 entries as `TieredRequests.resume_prefix` sets them)."""
    releases.set_req_prefix(req, [0] * tokens)


class _Alloc:
    """SGLang's allocator as its `PrefillAdder` reads it: tokens free (and from 0.5.23 on,
    which asks the allocator for its prefill budget and more, its base class's methods)."""

    page_size, shard_spec = BS, None

    def __init__(self, free: int):
        self.free = free

    def available_size(self):
        return self.free

    def __getattr__(self, name):
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

        return getattr(BaseTokenToKVPoolAllocator, name).__get__(self)


def _real_adder(monkeypatch):
    """SGLang's real `schedule_policy` (skipped without SGLang) and a prefix cache that is
    off, as the tiered home has it."""
    if AddReqResult is None:  # the `serving` fixture's stand-in is no `schedule_policy`
        pytest.skip("SGLang is not installed (README's first command installs it)")
    policy = pytest.importorskip("sglang.srt.managers.schedule_policy")
    for name in ("is_dsa_prefill_cp_in_seq_split", "is_prefill_context_parallel_enabled"):
        # parallel state is not published (0.5.17 asks; later releases may not)
        monkeypatch.setattr(policy, name, lambda: False, raising=False)
    if hasattr(policy, "get_exec"):  # 0.5.23 reads the published config: SGLang's defaults
        features = SimpleNamespace(enable_encoder_swa_bounded_replay=False)
        monkeypatch.setattr(policy, "get_exec", lambda: SimpleNamespace(features=features))
    tree = _Tree(
        disable=True, evictable_size=lambda: 0, supports_mamba=lambda: False,
        is_tree_cache=lambda: False, inc_lock_ref=lambda node: None,
        dec_lock_ref=lambda node, *params: None,
        lock=lambda node: None, unlock=lambda lock: None,  # 0.5.23's
    )  # fmt: skip
    return policy, tree


class _Tree(SimpleNamespace):
    """A prefix cache that is off; from 0.5.23 on the adder asks it more: those answers
    are SGLang's base prefix cache's own."""

    def __getattr__(self, name):
        from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

        attr = getattr(BasePrefixCache, name, None)
        if not callable(attr):
            raise AttributeError(name)
        return attr.__get__(self)


@pytest.mark.parametrize("done", [0, 50], ids=["new", "retracted"])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_tiered_room_is_what_sglangs_own_budget_asks(serving, monkeypatch, ignore_eos, done):
    """At the tiered home with prefix caching off SGLang admits an `ignore_eos` request only
    if every running request's whole remaining output fits the free pages now; the room
    made for a queued prompt is what SGLang's real `PrefillAdder` then accepts, where the
    prompt plus its own output (enough on SGLang's other path) is refused."""
    policy, tree = _real_adder(monkeypatch)
    frees, firsts = [], []

    class Residency:  # frees what it is asked (or `cut` less), as saved blocks would
        evicted_blocks, cache, cut = 0, SimpleNamespace(pages=0), 0

        def make_room(self, reqs, tokens, allocator, cache_first=0):
            frees.append(tokens)
            firsts.append(cache_first)
            allocator.free += tokens - self.cut
            return tokens - self.cut

    serving.cfg = serving.cfg.replace(kv_home="tiered")
    serving.controller.capacity_units = 10**9
    serving.residency = Residency()

    def attempt(free_less_by_old_rule: bool):
        running = [
            _SGLangReq("a", 1000, 900, out=10, ignore_eos=ignore_eos),
            _SGLangReq("b", 1000, 900, out=20, ignore_eos=ignore_eos),
        ]
        adder = policy.PrefillAdder(
            BS, tree, _Alloc(0), SimpleNamespace(reqs=running), 0.4, 16384, 8192
        )
        new = _SGLangReq("c", 1000, 900, out=done, ignore_eos=ignore_eos)  # done: resumed
        old_rule = 1000 + 900 + 2 * BS - int(adder.rem_total_tokens)  # prompt and output
        serving.residency.cut = 0
        if free_less_by_old_rule:  # free only what the prompt-and-output rule asks
            frees.clear()
            serving.make_room = lambda reqs, tokens, alloc, cache_first: Residency.make_room(
                serving.residency, reqs, old_rule, alloc
            )
        res = scheduling.around_add_one_req(
            policy.PrefillAdder.add_one_req, adder, new, False, None
        )
        serving.__dict__.pop("make_room", None)
        return res, new in adder.can_run_list, old_rule

    res, added, old_rule = attempt(False)
    assert added and res != policy.AddReqResult.NO_TOKEN, res
    assert "c" in serving.controller.running
    if ignore_eos:  # the shortest remaining output (880) counts for all three in full
        shortest = min(880, 900 - done)  # of the outputs still to come
        strict = 1000 + done + 2 * BS + (shortest + 1) * 3 + 1
        assert frees[-1] == max(strict, old_rule + done)
        # what only the strict path's reservation asks comes from the unit cache first
        assert firsts[-1] == frees[-1] - (old_rule + done)
        if releases.applies(("0.5.17",)):  # running outputs were charged at new_token_ratio
            assert strict > old_rule + 900
        else:  # from 0.5.23 on an ignore_eos request's output is charged in full there too
            assert old_rule + done >= strict
            return
        serving.release("c", retracted=False)
        res, added, _ = attempt(True)
        assert res == policy.AddReqResult.NO_TOKEN and not added
        assert serving.waits["kv_pages"] == 1 and "c" not in serving.controller.running
    else:  # a resumed request stores its output so far too
        assert frees[-1] == old_rule + done and firsts[-1] == 0


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_a_prompt_larger_than_hbm_is_admitted_in_chunks_that_fit_the_free_pages(
    serving, monkeypatch, ignore_eos
):
    """Tiered home with staged prefill: SGLang's real `PrefillAdder` never admits a prompt
    larger than its KV pool; through the hooks it is admitted as a chunked prompt whose
    first chunk fits the pages made free, and each later chunk gets room (its own saved
    blocks leave HBM, its prefix indices are copied from the row again) and fits too.
    The adder's budgets are SGLang's again afterwards, less what it charged."""
    policy, tree = _real_adder(monkeypatch)
    alloc = _Alloc(1000)
    made, synced = [], []

    class Residency:  # saved blocks give back up to 3000 tokens of pages
        evicted_blocks, cache, give = 0, SimpleNamespace(pages=0), 3000

        def make_room(self, reqs, tokens, allocator, cache_first=0):
            n = min(tokens, self.give)
            made.append(([r.rid for r in reqs], tokens))
            self.give -= n
            allocator.free += n
            return n

        def sync_prefix(self, req):
            synced.append(req.rid)

    wb = SimpleNamespace(reserve=lambda rid, n: True, drain=lambda: False, poll=lambda: None,
                         saving=True, catching_up=False)  # fmt: skip
    serving.cfg = serving.cfg.replace(kv_home="tiered")
    serving.controller.capacity_units = 10**9
    serving.writeback, serving.hbm_tokens = wb, 4096
    serving.residency = Residency()
    running = [_SGLangReq("a", 1000, 900, out=10, ignore_eos=ignore_eos)]
    big = _SGLangReq("big", 10_000, 64, ignore_eos=ignore_eos)

    def adder():
        return policy.PrefillAdder(BS, tree, alloc, SimpleNamespace(reqs=running), 0.4, 16384, 2048)

    serving.stage = None  # without staged prefill: SGLang never admits it
    a = adder()
    res = scheduling.around_add_one_req(policy.PrefillAdder.add_one_req, a, big, False, None)
    assert res == policy.AddReqResult.NO_TOKEN and big not in a.can_run_list
    assert "big" not in serving.controller.running
    serving.stage = object()
    alloc.free, serving.residency.give = 1000, 3000  # as before the refused attempt
    a = adder()
    budgets = (releases.read(a, "adder.total_offset"), releases.read(a, "adder.current_offset"))
    res = scheduling.around_add_one_req(policy.PrefillAdder.add_one_req, a, big, False, None)
    assert big in a.can_run_list and a.new_chunked_req is big, res
    assert made[-1] == (["a"], 2048 + 2 * BS - 1000)  # room for a whole chunk
    assert big.extended[1] == 2048 <= alloc.free - 2 * BS
    assert a.rem_chunk_tokens == 0  # SGLang's 2048, less the chunk
    charged = (
        releases.read(a, "adder.total_offset") - budgets[0],
        releases.read(a, "adder.current_offset") - budgets[1],
    )
    assert 0 < charged[0] < 4096 and 0 < charged[1] < 4096, charged  # no credit left behind
    # the next chunk: 1500 tokens free, saved blocks give back at most 1000 more
    alloc.free, serving.residency.give = 1500, 1000
    _set_prefix(big, 2048)
    a = adder()
    left = scheduling.around_add_chunked_req(policy.PrefillAdder.add_chunked_req, a, big)
    assert left is big and synced == (["big"] if releases.has("prefix_slots") else [])  # 0.5.17
    assert made[-1] == (["big", "a"], 2048 + 2 * BS - 1500)  # its own blocks first
    assert 0 < big.extended[1] <= 2500 - 2 * BS
    assert a.rem_chunk_tokens == 2048 - -(-big.extended[1] // BS) * BS  # paged
    # running requests' reserved output leaves SGLang's budget at nothing: it would add a
    # whole chunk (2048) with 1800 tokens free; the chunk is what the free pages hold
    running.append(_SGLangReq("b", 100, 4000, ignore_eos=ignore_eos))
    alloc.free, serving.residency.give = 1500, 300
    a = adder()
    assert a.rem_total_tokens <= 0
    scheduling.around_add_chunked_req(policy.PrefillAdder.add_chunked_req, a, big)
    assert big.extended[1] == (1800 - 2 * BS) // BS * BS


def test_the_longest_prompt_is_bounded_by_the_host_tier_with_staged_prefill(serving):
    info = (8192, 16384, 64, 100, 8191, 8186, 0, "cuda", None, 64, 32768, 8192)
    worker = SimpleNamespace(model_config=SimpleNamespace(context_len=32768))
    assert scheduling.after_get_worker_info(info, worker) == info  # KV in HBM: SGLang's
    serving.residency, serving.stage = SimpleNamespace(), object()
    serving.host_tokens = 20_000
    out = scheduling.after_get_worker_info(info, worker)
    assert out[4:6] == (19_999, 19_994) and out[:4] == info[:4] and out[6:] == info[6:]
    serving.host_tokens = 10**6
    assert scheduling.after_get_worker_info(info, worker)[4] == 32767  # the context


class _ClipAlloc:
    """SGLang's paged allocator as `init_req_max_new_tokens` asks it (0.5.23 on): its own
    clipping of a request's output to the pool, run as SGLang has it."""

    page_size = BS

    def max_new_tokens_for_memory(self, *args, **kwargs):
        from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

        return BaseTokenToKVPoolAllocator.max_new_tokens_for_memory(self, *args, **kwargs)


def test_the_output_cap_is_the_host_tiers_with_staged_prefill(serving):
    """SGLang's own cap (prompt and output within the pool in HBM) gives a prompt larger
    than the pool no output at all; with staged prefill the host tier bounds it."""
    sched_mod = pytest.importorskip("sglang.srt.managers.scheduler")
    sched = SimpleNamespace(
        max_total_num_tokens=8192, max_req_len=32767, page_size=BS, max_new_tokens_limit=None,
        server_args=SimpleNamespace(dcp_size=1),
        # from 0.5.23 on: the allocator clips the output (`max_new_tokens_for_memory`)
        kv_shard_widening=1, sliding_window_size=None, chunked_prefill_size=None,
        token_to_kv_pool_allocator=_ClipAlloc(),
    )  # fmt: skip
    req = SimpleNamespace(
        rid="big", origin_input_ids=[0] * 20_000,
        sampling_params=SimpleNamespace(max_new_tokens=32, min_new_tokens=0),
    )  # fmt: skip
    run = sched_mod.Scheduler.init_req_max_new_tokens
    scheduling.around_init_req_max_new_tokens(run, sched, req)
    assert req.sampling_params.max_new_tokens == 0  # SGLang's cap, KV in HBM
    serving.residency, serving.host_tokens = SimpleNamespace(), 100_000
    serving.stage = object()
    req.sampling_params.max_new_tokens = 32
    scheduling.around_init_req_max_new_tokens(run, sched, req)
    assert req.sampling_params.max_new_tokens == 32 and sched.max_total_num_tokens == 8192


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_a_resumed_request_is_charged_and_prefilled_only_after_its_kept_prefix(
    serving, monkeypatch, ignore_eos
):
    """A retracted request parked at the tiered home resumes with its kept blocks as its
    prefix: SGLang's real `PrefillAdder` charges and extends only the tokens after them.
    On SGLang's `ignore_eos` path, which cannot chunk a request with a prefix, it waits
    for a round with a whole chunk, and is prefilled whole when even that is too small."""
    policy, tree = _real_adder(monkeypatch)
    kept = 94 * BS

    class Residency:
        evicted_blocks, cache = 0, SimpleNamespace(pages=0)

        def make_room(self, reqs, tokens, allocator, cache_first=0):
            return 0

    class Requests:  # the tiered store's: "c" is parked (with `kept` tokens)
        waiting = {"c"}

        def parked(self, rid):
            return rid in self.waiting

        def unpark(self, req):
            self.waiting.remove(req.rid)
            _set_prefix(req, 0)

    wb = SimpleNamespace(reserve=lambda rid, n: True)
    serving.cfg = serving.cfg.replace(kv_home="tiered")
    serving.controller.capacity_units = 10**9
    serving.writeback, serving.hbm_tokens = wb, 50_000
    serving.residency, serving.requests, serving.stage = Residency(), Requests(), object()
    serving.controller.admit_alone(Candidate("c", 3000, 1))
    serving.controller.pause("c")  # retracted

    def resumed():
        r = _SGLangReq("c", 3000, 200, out=50, ignore_eos=ignore_eos)
        _set_prefix(r, kept)  # `TieredRequests.resume_prefix`
        return r

    def adder(chunk=2048, running=()):
        return policy.PrefillAdder(
            BS, tree, _Alloc(100_000), SimpleNamespace(reqs=list(running)), 0.4, 16384, chunk
        )

    a, c = adder(), resumed()
    res = scheduling.around_add_one_req(policy.PrefillAdder.add_one_req, a, c, False, None)
    assert c in a.can_run_list, res
    assert c.extended == (kept, 3050 - kept)
    assert 16384 - a.rem_input_tokens == -(-(3050 - kept) // BS) * BS  # only the tail
    assert serving.parked("c") and "c" in serving.controller.running
    if not ignore_eos:
        return
    serving.release("c", retracted=True)
    # a chunk smaller than its tail, after another request: it waits, still parked
    a, c = adder(chunk=40), resumed()
    a.can_run_list.append(_SGLangReq("x", 10, 10))
    res = scheduling.around_add_one_req(policy.PrefillAdder.add_one_req, a, c, False, None)
    assert res == policy.AddReqResult.OTHER and c not in a.can_run_list
    assert serving.parked("c") and "c" in serving.controller.paused
    # the same chunk in a fresh round: prefilled whole, chunked from its first token
    a, c = adder(chunk=40), resumed()
    res = scheduling.around_add_one_req(policy.PrefillAdder.add_one_req, a, c, False, None)
    assert c in a.can_run_list and a.new_chunked_req is c
    assert c.extended == (0, 40)
    assert not serving.parked("c")


def test_tiered_retraction_parks_before_sglang_frees_and_resumes_before_planning(serving):
    """The hooks' order: a retracted request's saved blocks leave HBM (parked) before
    SGLang frees its KV, and it stays paused; a finished one is released after; a parked
    request gets its prefix when SGLang asks its prefix cache (not for a chunk's next
    round), and its row before the write-back plans the batch."""
    calls = []

    class Requests:  # the tiered store's passage of each request
        kept: dict = {}

        def parked(self, rid):
            return rid in self.kept

        def park(self, req, allocator):
            calls.append(("park", req.rid, allocator))
            self.kept[req.rid] = 64

        def resume_prefix(self, req):
            calls.append(("prefix", req.rid))

        def resume(self, reqs):
            calls.append(("resume", [r.rid for r in reqs]))
            self.kept.clear()

        def release(self, rid, finished=False):
            calls.append(("release", rid, finished))

    wb = SimpleNamespace(plan_extend=lambda reqs, lens: calls.append(("plan", lens)), saving=True)
    stage = SimpleNamespace(plan_batch=lambda *a: calls.append(("stage",)))
    res = SimpleNamespace(read_prefix_from_host=lambda reqs: calls.append(("host prefix",)))
    serving.residency, serving.writeback, serving.stage = res, wb, stage
    serving.requests = Requests()
    serving.controller.admit_alone(Candidate("a", 100, 1))
    tree = SimpleNamespace(token_to_kv_pool_allocator="alloc")
    a = _req("a", 100, pool_idx=1)
    sglang_frees = lambda *args, **kwargs: calls.append(("sglang frees",))  # noqa: E731
    scheduling.around_release_kv_cache(sglang_frees, a, tree, **_insert(False))
    assert "a" in serving.controller.paused
    assert calls == [("park", "a", "alloc"), ("sglang frees",)]
    assert serving.parked("a")
    calls.clear()
    scheduling.after_init_next_round_input(None, a)  # a chunk's next round: no prefix cache
    scheduling.after_init_next_round_input(None, a, tree)
    assert calls == [("prefix", "a")]
    calls.clear()
    batch = SimpleNamespace(reqs=[a], seq_lens_cpu=SimpleNamespace(tolist=lambda: [130]),
                            prefix_lens=[64], token_to_kv_pool_allocator=None)  # fmt: skip
    scheduling.after_prepare_for_extend(None, batch)
    assert calls == [("resume", ["a"]), ("plan", [130]), ("host prefix",), ("stage",)]
    calls.clear()
    done = _req("a", 100, pool_idx=1, finished=True)
    scheduling.around_release_kv_cache(sglang_frees, done, tree, **_insert(False))
    assert calls == [("sglang frees",), ("release", "a", True)]  # its saves may land


def test_a_resuming_parked_request_gets_page_0_for_its_kept_prefix_at_allocation(serving):
    """SGLang 0.5.23 reads a new row's prefix slots at allocation (`_prefix_kv_indices`, a
    length set at the match): a parked request without a row gets page 0 for each kept
    token (`TieredRequests.prefix_slots`, here the store's answer); any other request,
    and any request on a server without the tiered home, SGLang's own slots."""
    alloc = pytest.importorskip("sglang.srt.mem_cache.allocation")
    original = getattr(alloc, "_prefix_kv_indices", None)
    if original is None:
        pytest.skip(f"sglang=={releases.release()} writes a prefix's slots at the match")
    kv = lambda idx: SimpleNamespace(holds_kv=idx is not None, req_pool_idx=idx)  # noqa: E731
    table = SimpleNamespace(req_to_token=__import__("torch").arange(40).view(2, 20))
    batch = SimpleNamespace(req_to_token_pool=table, tree_cache=None)
    parked = SimpleNamespace(rid="p", prefix_len=8, kv=kv(None))
    other = SimpleNamespace(rid="o", prefix_len=3, kv=kv(1))  # a later chunk: its row
    slots = __import__("torch").arange(8) % 4
    serving.requests = SimpleNamespace(
        prefix_slots=lambda req: slots if req.rid == "p" and req.kv.req_pool_idx is None else None
    )
    assert scheduling.around_prefix_kv_indices(original, batch, parked) is slots
    assert scheduling.around_prefix_kv_indices(original, batch, other).tolist() == [20, 21, 22]
    process.register(None)  # no PSA server: SGLang's own (its tree's, which it lacks here)
    with pytest.raises(AttributeError):
        scheduling.around_prefix_kv_indices(original, batch, parked)


def test_with_the_psa_radix_cache_a_retraction_waits_for_its_saves_on_every_release(serving):
    """With the prefix index (the psa radix cache) a retracted request's saves in flight
    are waited for before SGLang frees its KV (`TieredRequests.park`, which parks nothing
    then), on every release: they enter the index its next match reads."""
    calls = []
    serving.cfg = serving.cfg.replace(kv_home="tiered")
    serving.residency, serving.stage = SimpleNamespace(), SimpleNamespace()
    serving.writeback = SimpleNamespace(index=object())
    serving.requests = SimpleNamespace(
        parked=lambda rid: False,
        park=lambda req, alloc: calls.append(("park", req.rid, alloc)),
        release=lambda rid, finished=False: calls.append(("release", rid, finished)),
    )
    serving.controller.admit_alone(Candidate("a", 100, 1))
    tree = SimpleNamespace(token_to_kv_pool_allocator="alloc")
    sglang_frees = lambda *args, **kwargs: calls.append(("sglang frees",))  # noqa: E731
    a = _req("a", 100, pool_idx=1)
    scheduling.around_release_kv_cache(sglang_frees, a, tree, **_insert(False))
    assert calls == [("park", "a", "alloc"), ("sglang frees",), ("release", "a", False)]
    calls.clear()
    serving.writeback = SimpleNamespace(index=None)  # no prefix cache
    scheduling.around_release_kv_cache(sglang_frees, a, tree, **_insert(False))
    assert [c[0] for c in calls] == ["park", "sglang frees", "release"]


def test_a_parked_request_waiting_for_admission_keeps_its_host_copy(serving):
    """At the tiered home a request that waits for room among the running working sets
    gives back the host blocks it reserved, unless it is parked: that one waits with its
    kept blocks (they are its prefix when it is admitted)."""
    released = []
    serving.cfg = serving.cfg.replace(kv_home="tiered")
    serving.writeback = SimpleNamespace(reserve=lambda rid, n: True)
    serving.requests = SimpleNamespace(
        parked=lambda rid: rid == "p",
        release=lambda rid, finished: released.append((rid, finished)),
    )
    serving.controller.admit_alone(Candidate("a", 640, 90))  # 90 of 100 units in use
    assert not serving.try_admit("p", 640, alone=False)  # est 40 units: waits
    assert not serving.try_admit("q", 640, alone=False)
    assert released == [("q", False)] and serving.waits["working_set"] == 2  # it comes back


def test_the_write_back_starts_once_the_pool_runs_short_and_stays_on(caplog):
    """`--psa-writeback-start 0.25`: a decode or extend round with a quarter or more of
    SGLang's KV pool free plans no save; the first round below starts the write-back,
    says so in the log naming the flag, spreads the blocks filled before over rounds, and
    stays on when the pool frees up again. A prompt larger than HBM starts it at once,
    unspread; the default starts it with the server."""
    planned = []
    wb = SimpleNamespace(
        saving=None,
        plan_decode=lambda reqs, lens: planned.append(("decode", wb.saving)),
        plan_extend=lambda reqs, lens: planned.append(("extend", wb.saving)),
        reserve=lambda rid, n: True, drain=lambda: False,
        start=lambda catch_up=False: vars(wb).update(saving=True, catching_up=catch_up),
    )  # fmt: skip
    res = SimpleNamespace(read_prefix_from_host=_noop, make_room=_noop)
    cfg = PSAConfig(kv_home="tiered", writeback_start=0.25)
    s = PSAServing(cfg, layers=2, kv_heads=2, hbm_units=100, hbm_tokens=1000, writeback=wb,
                   residency=res)  # fmt: skip
    assert wb.saving is False
    alloc = SimpleNamespace(free=600, available_size=lambda: alloc.free)
    s.plan_decode([], [], alloc)
    s.plan_extend([], [], None, alloc)
    alloc.free = 250  # exactly a quarter free: not short yet
    s.plan_decode([], [], alloc)
    assert planned == [("decode", False), ("extend", False), ("decode", False)]
    with caplog.at_level("INFO", logger="sglang_psa.sched.serving"):
        alloc.free = 249
        s.plan_decode([], [], alloc)
    assert planned[-1] == ("decode", True)
    assert wb.catching_up  # the blocks filled before: over several rounds
    assert "--psa-writeback-start" in caplog.text and "25% of the KV pool" in caplog.text
    alloc.free = 1000
    s.plan_extend([], [], None, alloc)
    assert planned[-1] == ("extend", True) and wb.catching_up
    # A prompt larger than HBM during the catch-up: its chunks' room is its own earlier
    # blocks, which a spread catch-up could leave unplanned (no room, no next chunk, no
    # plan): the rest is planned at once.
    s.room_for_chunk(None, [], SimpleNamespace(available_size=lambda: 4096), 100)
    assert wb.saving is True and not wb.catching_up
    # A prompt larger than HBM is prefilled in chunks whose saved blocks leave HBM.
    wb.saving = None
    s2 = PSAServing(cfg, layers=2, kv_heads=2, hbm_units=100, hbm_tokens=1000, writeback=wb,
                    residency=res)  # fmt: skip
    assert wb.saving is False
    s2.room_for_chunk(None, [], SimpleNamespace(available_size=lambda: 4096), 100)
    assert wb.saving is True and not wb.catching_up  # its chunks need their room now
    wb.saving = None
    PSAServing(PSAConfig(kv_home="tiered"), layers=2, kv_heads=2, hbm_units=100,
               hbm_tokens=1000, writeback=wb, residency=res)  # fmt: skip
    assert wb.saving is True
