"""Tensor parallelism on CPU: two real ranks (processes joined by a gloo group, as SGLang's
TP CPU group joins its schedulers) fed different local measurements take the same
admission and eviction decisions, the ones a single rank takes from the agreed values;
each rank sizes its host tier from its share; server info sums what is per rank."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from sglang_psa.config import PSAConfig
from sglang_psa.distributed import RankAgreement
from sglang_psa.mem_cache import kv_budget
from sglang_psa.mem_cache.fence import TableFence
from sglang_psa.mem_cache.request_kv import RequestKV
from sglang_psa.mem_cache.residency import Residency
from sglang_psa.sched.serving import (
    PER_RANK,
    RECORD_EVERY_STEPS,
    BackendReadouts,
    PSAServing,
    combine_ranks,
)

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

BS = 32
TOKENS = 640  # 20 blocks; 2 layers x 2 KV heads: 80 units per request


def _in_two_ranks(tmp_path, fn, *args) -> list:
    """`fn(agreement, rank, *args)` in two processes of one gloo group; results by rank."""
    ctx = mp.get_context("fork")  # CPU only: nothing of CUDA to inherit
    out = ctx.Queue()
    init = f"file://{tmp_path / 'rendezvous'}"

    def rank_main(rank: int) -> None:
        try:
            # a collective one rank waits in alone fails in 30 s instead of hanging
            dist.init_process_group(
                "gloo", init_method=init, rank=rank, world_size=2,
                timeout=datetime.timedelta(seconds=30),
            )  # fmt: skip
            agreement = RankAgreement(dist.group.WORLD, 2)
            out.put((rank, fn(agreement, rank, *args)))
            dist.destroy_process_group()
        except BaseException as e:  # report, do not hang the other rank's parent
            out.put((rank, e))

    procs = [ctx.Process(target=rank_main, args=(r,)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    for r in (0, 1):
        if isinstance(got[r], BaseException):
            raise AssertionError(f"rank {r} failed: {got[r]!r}")
    return [got[0], got[1]]


# -- admission -------------------------------------------------------------------------
def _req(i: int):
    return SimpleNamespace(rid=f"r{i}", seqlen=TOKENS, req_pool_idx=i, finished=lambda: False)


def _counted_serving(agreement, sizes, lengths, hbm_units: int) -> tuple[PSAServing, list]:
    """A PSAServing reading this rank's `sizes` and `lengths`, and a list that grows by
    one at each agreement (a collective with several ranks)."""
    s = PSAServing(
        PSAConfig(ws_window=2), layers=2, kv_heads=2, hbm_units=hbm_units,
        readouts=BackendReadouts(measure=lambda: (sizes, lengths)), agreement=agreement,
    )  # fmt: skip
    calls = []
    agree = agreement.max
    agreement.max = lambda *a: calls.append(1) or agree(*a)
    return s, calls


def _admissions(agreement: RankAgreement, rank: int, units_by_rank: list[int]) -> list:
    """Eight requests arrive one per round; each round the running ones decode a step,
    measured on this rank's heads as `units_by_rank[rank]` units each."""
    sizes = torch.zeros(8, dtype=torch.int64)
    lengths = torch.zeros(8, dtype=torch.int64)
    s, calls = _counted_serving(agreement, sizes, lengths, hbm_units=100)
    reqs, log = [_req(i) for i in range(8)], []
    for i, req in enumerate(reqs):
        running = [r for r in reqs if r.rid in s.controller.running]
        log.append(s.try_admit(req.rid, TOKENS, alone=not running))
        for r in reqs[: i + 1]:
            if r.rid in s.controller.running:
                sizes[r.req_pool_idx] = units_by_rank[rank]
                lengths[r.req_pool_idx] = TOKENS
        # two agreed steps: the running requests' sets are warm (`ws_window` 2)
        for _ in range(2 * RECORD_EVERY_STEPS):
            s.flush_step(reqs)
        log.append(s.controller.used_units)
    s.controller.check_integrity()
    # sizes are recorded (several ranks: in a collective) every RECORD_EVERY_STEPS steps
    assert len(calls) == 8 * 2
    return log


def test_ranks_measuring_different_working_sets_admit_the_same_requests(tmp_path):
    units = [20, 45]  # what each rank measures on its own KV heads
    ranks = _in_two_ranks(tmp_path, _admissions, units)
    assert ranks[0] == ranks[1]
    # ... and what they agree on is the larger working set: a single rank fed it decides
    # alike, while each rank alone would have admitted differently.
    alone = [_admissions(RankAgreement(), r, units) for r in (0, 1)]
    assert ranks[0] == alone[1]
    assert alone[0] != alone[1], "the scenario must separate the ranks' local decisions"


def _idle_calls_on_one_rank(agreement: RankAgreement, rank: int) -> tuple:
    """Two running requests decode 4 x RECORD_EVERY_STEPS steps; rank 1's scheduler also
    calls flush_step with no running request now and then (a call the other rank does
    not make). Returns (collectives, units held)."""
    sizes = torch.full((2,), 10 + 30 * rank, dtype=torch.int64)
    lengths = torch.full((2,), TOKENS, dtype=torch.int64)
    s, calls = _counted_serving(agreement, sizes, lengths, hbm_units=400)
    reqs = [_req(i) for i in range(2)]
    for r in reqs:
        assert s.try_admit(r.rid, TOKENS, alone=False)
    for step in range(4 * RECORD_EVERY_STEPS):
        s.flush_step(reqs)
        if rank == 1 and step % 3 == 0:
            s.flush_step([])  # nothing running: no step of any request
    return len(calls), s.controller.used_units


def test_a_call_with_no_running_request_on_one_rank_does_not_shift_its_agreements(tmp_path):
    """Ranks meet in each agreement although one of them made extra calls with nothing
    running (counted, they would put its collectives on other steps: a hang on the GPUs)."""
    ranks = _in_two_ranks(tmp_path, _idle_calls_on_one_rank)
    assert ranks[0] == ranks[1] and ranks[0][0] == 4, ranks


# -- eviction ---------------------------------------------------------------------------
class _Alloc:
    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, tokens: torch.Tensor, start_pos: int) -> None:
        self.freed += (tokens[::4] // 4).tolist()


def _victims(agreement: RankAgreement, rank: int, readers_by_rank, saved_by_rank) -> list:
    """The blocks `make_room` would give back for 3 pages, from this rank's heat and
    acknowledged saves (`Residency._coldest`, whose inputs are agreed)."""
    bs, n = 4, len(readers_by_rank[0])
    heat = np.zeros(16, dtype=np.uint8)
    heat[:n] = readers_by_rank[rank]
    lengths = torch.zeros(4, dtype=torch.int32)
    lengths[2] = n * bs
    ws = SimpleNamespace(
        read=lambda: (None, lengths),
        heat=lambda: {2: heat},
        layers=2,
        kv_heads=2,
        heat_blocks=16,
    )
    r = RequestKV("a", host=list(range(10, 10 + n)), saved=saved_by_rank[rank], row=2)
    wb = SimpleNamespace(
        records={"a": r}, blocks=SimpleNamespace(num_blocks=64), fence=TableFence()
    )
    cfg = SimpleNamespace(
        block_size=bs, sink_blocks=1, recent_blocks=1, cold_fraction=0, unit_cache_ways=8
    )
    res = Residency(
        wb, SimpleNamespace(page_rows=100), ws, torch.zeros(4, 64), cfg,
        SimpleNamespace(size=63 * bs), None,
    )  # fmt: skip
    res.agreement = agreement
    req = SimpleNamespace(rid="a", req_pool_idx=2, seqlen=n * bs, finished=lambda: False)
    return [(rid, b) for _, rid, b in res._coldest([req], 3)]


def test_ranks_with_different_heat_and_saves_evict_the_same_blocks(tmp_path):
    # 10 full blocks: candidates are blocks 1-6 (the sink and the last three stay).
    readers = [[7, 0, 8, 2, 1, 4, 5, 3, 5, 6], [7, 6, 0, 0, 9, 1, 0, 3, 5, 6]]
    saved = [10, 5]  # rank 1 has acknowledged blocks 0-4 only
    ranks = _in_two_ranks(tmp_path, _victims, readers, saved)
    assert ranks[0] == ranks[1]
    # the hottest view of each block, among blocks saved on both ranks: 1:6 2:8 3:2 4:9
    assert sorted(b for _, b in ranks[0]) == [1, 2, 3]
    hottest = [list(np.maximum(*map(np.array, readers)))] * 2
    assert ranks[0] == _victims(RankAgreement(), 0, hottest, [min(saved)] * 2)
    alone = [_victims(RankAgreement(), r, readers, saved) for r in (0, 1)]
    assert alone[0] != alone[1], "the scenario must separate the ranks' local choices"


# -- sizing and server info --------------------------------------------------------------
def test_each_rank_holds_its_share_of_the_host_tier():
    cfg = PSAConfig(kv_home="tiered", host_pool_gb=3.0)
    whole = 2 * 24 * 2 * 64 * 2  # bytes per token, Qwen2.5-0.5B: 2 KV heads
    one = kv_budget.host_blocks(cfg, whole, 1)
    per_rank = kv_budget.host_blocks(cfg, whole // 2, 2)  # one KV head per rank
    assert per_rank == one  # every rank holds the same tokens as one GPU would
    assert 2 * per_rank * (whole // 2) * cfg.block_size <= 3 * 2**30  # the flag's bytes
    rows = [kv_budget.host_row_bytes(cfg, whole // 2, torch.bfloat16, 24, r) for r in (1, 2)]
    assert rows[1] < rows[0]


def _rank_state(rank: int) -> dict:
    return {
        "running": 3,
        "kv_held_tokens": 0,
        "blocks_read_fraction": 0.2 + 0.1 * rank,
        "blocks_read": 20 + 10 * rank,
        "blocks_readable": 100,
        "plugin_hbm_bytes": {"block_metadata": 100, "working_sets": 10 + rank},
        "gpu_reserved_bytes": 1000,
        "pinned_bytes": 50,
        "writeback": {"blocks_saved": 7 + rank, "engine_pid": 4000 + rank},
        "residency": {"evictions": rank},
    }


def test_server_info_reports_agreed_entries_once_and_sums_per_rank_ones(tmp_path):
    states = _in_two_ranks(tmp_path, lambda agreement, rank: agreement.gather(_rank_state(rank)))
    assert states[0] == states[1] == [_rank_state(0), _rank_state(1)]
    info = combine_ranks(states[0])
    assert info["running"] == 3 and info["kv_held_tokens"] == 0
    assert info["plugin_hbm_bytes"] == {"block_metadata": 200, "working_sets": 21}
    assert info["writeback"] == {"blocks_saved": 15, "engine_pid": [4000, 4001]}
    assert info["gpu_reserved_bytes"] == 2000 and info["residency"] == {"evictions": 1}
    assert info["blocks_read_fraction"] == pytest.approx(0.25)
    assert (info["blocks_read"], info["blocks_readable"]) == (50, 200)  # each rank's heads
    assert info["tp_summed"] == list(PER_RANK) and info["tp_ranks"] == states[0]
    assert combine_ranks([_rank_state(0)]) == _rank_state(0)  # one rank: as it is
    # at the hbm home there is no host tier: absent on every rank stays absent (found at
    # --tp 2 on two GPUs, where the serving benchmark reads residency counters)
    hbm = [dict(_rank_state(r), residency=None, writeback=None) for r in (0, 1)]
    assert combine_ranks(hbm)["residency"] is None and combine_ranks(hbm)["writeback"] is None


def test_the_sglang_internals_the_agreement_relies_on_are_there():
    """`from_sglang` and `kv_ranks` read SGLang's TP group (its gloo CPU group and
    size) and its attention TP size; outside a running server they mean one rank."""
    from sglang_psa.distributed import kv_ranks, tp_rank

    # Outside a running server: one rank, whether or not SGLang is installed.
    assert RankAgreement.from_sglang().world_size == 1 and kv_ranks() == 1 and tp_rank() == 0
    # ... but a server started with --tp 2 must find its TP group, or fail loudly: ranks
    # that decided alone would hang in the next collective.
    with pytest.raises(RuntimeError, match="--tp 2"):
        RankAgreement.from_sglang(tp_size=2)
    parallel_state = pytest.importorskip(
        "sglang.srt.distributed.parallel_state",
        reason="SGLang is not installed (README's first command installs it)",
    )
    GroupCoordinator = parallel_state.GroupCoordinator
    from sglang.srt.runtime_context import ParallelContext

    fields = GroupCoordinator.__annotations__
    missing = [f for f in ("cpu_group", "world_size", "rank_in_group") if f not in fields]
    assert not missing, f"SGLang's GroupCoordinator lost {missing}: update sglang_psa.distributed"
    assert isinstance(getattr(ParallelContext, "attn_tp_size", None), property), (
        "SGLang's ParallelContext.attn_tp_size is gone: update sglang_psa.distributed.kv_ranks"
    )
    assert isinstance(getattr(ParallelContext, "tp_group", None), property), (
        "SGLang's ParallelContext.tp_group is gone: update RankAgreement.from_sglang"
    )
    assert RankAgreement.from_sglang().world_size == 1 and kv_ranks() == 1


def test_the_metrics_rank_is_this_process_rank_in_sglangs_tp_group(monkeypatch):
    """`tp_rank` (the `tp_rank` label of PSA's metrics) is the rank in SGLang's TP group
    of a running server, 0 where none is set up (SGLang's ModelRunner has no `tp_rank`
    attribute to read instead)."""
    import sys
    import types

    from sglang_psa.distributed import tp_rank

    group = types.SimpleNamespace(rank_in_group=1, world_size=2)
    context = types.SimpleNamespace(get_parallel=lambda: types.SimpleNamespace(tp_group=group))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    assert tp_rank() == 1

    def not_set_up():
        raise RuntimeError("parallel name 'tp_group' has not been written in this process")

    context.get_parallel = not_set_up
    assert tp_rank() == 0
