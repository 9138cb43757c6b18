"""Residency with a fake host tier and allocator, and a real unit cache: when SGLang needs
pages, cold blocks leave HBM first and unit-cache pages only after; when the last evicted
block is gone, the cache gives every page back; the cache's tables stay inverse maps."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_psa.mem_cache.fence import TableFence
from sglang_psa.mem_cache.request_kv import RequestKV, TieredRequests
from sglang_psa.mem_cache.residency import COLD_EVERY, ROOM_HIGH, ROOM_LOW, Residency
from sglang_psa.mem_cache.unit_cache import WAYS, UnitCache

BS, ROW, LAYERS, HKV, HB = 4, 2, 2, 2, 64


class _Alloc:
    def __init__(self, free_pages: list[int]):
        self.free = list(free_pages)

    def available_size(self) -> int:
        return len(self.free) * BS

    def alloc(self, n: int) -> torch.Tensor:
        pages, self.free = self.free[: n // BS], self.free[n // BS :]
        return (torch.tensor(pages)[:, None] * BS + torch.arange(BS)).flatten()

    def free_segment(self, tokens: torch.Tensor, start_pos: int) -> None:
        assert start_pos == 0 and tokens.numel() % BS == 0
        self.free += (tokens[::BS] // BS).tolist()


def _residency(readers: list[int], cold_fraction: float = 0.0, ways: int = WAYS):
    heat = np.zeros(16, dtype=np.uint8)
    heat[: len(readers)] = readers
    lengths = torch.zeros(4, dtype=torch.int32)
    lengths[ROW] = len(readers) * BS
    ws = SimpleNamespace(
        read=lambda: (None, lengths),
        heat=lambda: {ROW: heat},
        layers=LAYERS,
        kv_heads=HKV,
        heat_blocks=16,
        stamps=None,
        step=None,
    )
    r = RequestKV("a", host=list(range(10, 10 + len(readers))), saved=len(readers), row=ROW)
    refs = np.zeros(HB, dtype=np.int32)
    refs[r.host] = 1  # held by "a" alone
    blocks = SimpleNamespace(num_blocks=HB, refs=refs)
    wb = SimpleNamespace(records={"a": r}, blocks=blocks, host=None, fence=TableFence())
    cfg = SimpleNamespace(
        block_size=BS, sink_blocks=1, recent_blocks=1, cold_fraction=cold_fraction,
        unit_cache_ways=ways,
    )  # fmt: skip
    pool = SimpleNamespace(size=63 * BS)
    res = Residency(wb, SimpleNamespace(page_rows=100), ws, torch.zeros(4, 64), cfg, pool, None)
    return res, r


def _recording_evict(res, alloc_pages_from: int):
    gone_order = []

    def evict(rid, blocks, allocator):
        gone_order.extend(blocks)
        rec = res.records[rid]
        if rec.evicted is None:
            rec.evicted = np.zeros(16, dtype=bool)
        rec.evicted[blocks] = True
        allocator.free += [alloc_pages_from + b for b in blocks]
        return len(blocks) * BS

    res.evict_many = lambda wanted, alloc: sum(evict(r, bl, alloc) for r, bl in wanted.items())
    return gone_order


def test_make_room_takes_cold_blocks_first_then_cache_pages():
    # 10 full blocks; candidates are blocks 1-6 (the sink and the last three stay).
    res, r = _residency([7, 0, 8, 2, 1, 4, 5, 3, 5, 6])
    gone_order = _recording_evict(res, 40)
    alloc = _Alloc([])
    res.cache.grow(torch.tensor([20, 21, 22]))
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=10 * BS, finished=lambda: False)
    # 3 pages: the three least read candidates (readers 0, 1, 2), the cache untouched
    assert res.make_room([req], 3 * BS, alloc) == 3 * BS
    assert sorted(gone_order) == [1, 3, 4] and res.cache.pages == 3
    # 5 more: the other three candidates, then the two most recently taken cache pages
    assert res.make_room([req], 5 * BS, alloc) == 5 * BS
    assert sorted(gone_order) == [1, 2, 3, 4, 5, 6] and res.cache.pages == 1
    assert sorted(alloc.free) == [21, 22, 41, 42, 43, 44, 45, 46]
    assert int(res.cache.cache_pages[res.cache._slots(0, 1)[0]]) == 20


def test_room_sglang_only_reserves_comes_from_the_cache_first():
    """Room for the running requests' future output (SGLang's strict admission reserves
    it; decode's own make_room serves it here) takes cache pages, which grow back the next
    round, before it evicts a block; the rest still takes cold blocks first."""
    res, r = _residency([7, 0, 8, 2, 1, 4, 5, 3, 5, 6])
    gone_order = _recording_evict(res, 40)
    alloc = _Alloc([])
    res.cache.grow(torch.tensor([20, 21, 22]))
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=10 * BS, finished=lambda: False)
    # 4 pages, 2 of them reserve: two cache pages, then the least read block (readers 0)
    # and the next (readers 1)
    assert res.make_room([req], 4 * BS, alloc, cache_first=2 * BS) == 4 * BS
    assert sorted(gone_order) == [1, 4] and res.cache.pages == 1
    # reserve beyond the cache: its last page, then blocks
    assert res.make_room([req], 3 * BS, alloc, cache_first=3 * BS) == 3 * BS
    assert res.cache.pages == 0 and sorted(gone_order) == [1, 3, 4, 5]


@pytest.mark.parametrize("cold_fraction, cold", [(0.5, [1, 4]), (0.0, [])])
def test_while_blocks_are_evicted_cold_resident_blocks_become_cache_pages(cold_fraction, cold):
    """2 layers x 2 KV heads: 4 units a block. With `cold_fraction` 0.5 and no page to
    spare beyond ROOM_HIGH a request, a resident saved block read lately by fewer than 2
    units leaves HBM at the next refresh and its page joins the unit cache; 0 leaves
    blocks in HBM until SGLang needs pages. With pages to spare, no block leaves: the
    cache takes them, one per evicted block at most. The pass for cold blocks runs at most
    every COLD_EVERY refreshes: a block turning cold waits for the next."""
    res, r = _residency([4, 0, 4, 2, 1, 3, 4, 3, 4, 4], cold_fraction)
    gone_order = _recording_evict(res, 40)
    r.evicted = np.zeros(16, dtype=bool)
    r.evicted[6] = True  # a block already on the host: the cache is in use
    res.cache.refresh = lambda *a: None  # (the kernel has its own tests)
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=10 * BS, finished=lambda: False)
    roomy = _Alloc(list(range(30, 30 + ROOM_HIGH + 3)))  # 3 pages beyond ROOM_HIGH
    assert res.refresh([req], roomy) == 1 and gone_order == []  # one block is evicted
    alloc = _Alloc(list(range(30, 30 + ROOM_HIGH)))  # none to spare
    taken = res.refresh([req], alloc)
    assert sorted(gone_order) == cold
    assert taken == len(cold)  # the pages the cold blocks gave back
    assert res.cache.pages == 1 + taken
    # nothing new is cold: the next refresh evicts nothing more
    assert res.refresh([req], alloc) == 0 and sorted(gone_order) == cold
    if not cold:
        return
    res.ws.heat()[ROW][5] = 0  # block 5 turns cold: left until COLD_EVERY rounds passed
    for _ in range(COLD_EVERY - 2):
        assert res.refresh([req], alloc) == 0 and sorted(gone_order) == cold
    assert res.refresh([req], alloc) == 1 and sorted(gone_order) == sorted(cold + [5])


def test_decode_rooms_for_rounds_to_come_only_when_short():
    """Fewer than ROOM_LOW pages a running request free: the tree's unheld prefixes go
    first, then the coldest saved blocks, up to ROOM_HIGH a request; at ROOM_LOW or more,
    nothing is asked of either."""
    res, r = _residency([7, 0, 8, 2, 1, 4, 5, 3, 5, 6])
    gone_order = _recording_evict(res, 40)
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=10 * BS, finished=lambda: False)
    tree = []
    alloc = _Alloc(list(range(30, 30 + ROOM_LOW)))
    assert res.room_for_decode([req], alloc, tree.append) == 0
    assert tree == [] and gone_order == []
    alloc = _Alloc([30])  # short: the tree is asked for ROOM_HIGH pages free, gives one
    evict_tree = lambda n: tree.append(n) or alloc.free.append(31)  # noqa: E731
    freed = res.room_for_decode([req], alloc, evict_tree)
    assert tree == [ROOM_HIGH * BS] and freed == (ROOM_HIGH - 2) * BS
    assert sorted(gone_order) == [1, 4][: ROOM_HIGH - 2]  # the least read saved blocks
    assert alloc.available_size() == ROOM_HIGH * BS


def test_the_last_release_drains_the_cache_and_forgets_its_units():
    res, r = _residency([7, 0, 8, 2, 1, 4, 5, 3, 5, 6])
    alloc = _Alloc([30, 31, 32, 33, 34, 35, 36, 37, 38, 39])
    res.allocator = alloc
    r.evicted = np.zeros(16, dtype=bool)
    r.evicted[[1, 2]] = True
    res.cache.mark_evicted(torch.tensor([11, 12]))
    res.left_hbm[[11, 12]] = True
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=10 * BS, finished=lambda: False)
    res.cache.refresh = lambda *a: None  # (the kernel has its own tests)
    assert res.refresh([req], alloc) == 2  # a page per evicted block, of 8 to spare
    assert res.cache.pages == 2 and len(alloc.free) == 8
    # Units of host blocks 11 and 12 sit in positions of layer-head 0 and 3 (layer 1,
    # head 1), in another layer's buffer for the second.
    cache = res.cache
    for lh, hb, pos in ((0, 11, 3 * WAYS * LAYERS), (3, 12, 0)):
        ly, h = divmod(lh, HKV)
        cache.unit_slot[lh, hb], cache.slot_unit[h, pos] = pos, ly * HB + hb
    res.wb.forget = lambda rec: None  # (the write-back's share: test_request_kv.py)
    TieredRequests(res.wb, res, None, res.req_to_token, BS).release("a")
    assert not (cache.unit_slot >= 0).any() and not (cache.slot_unit >= 0).any()
    assert not cache.live.any() and cache.pages == 0 and not cache.cache_pages.any()
    assert sorted(alloc.free) == list(range(30, 40))
    assert res.zero_pending


def test_the_unit_cache_has_the_configured_ways():
    """`--psa-unit-cache-ways` reaches the cache: its sets hold that many slots, as many
    slots in all (whole sets) as the pool has pages."""
    for ways in (WAYS, 16):
        cache = _residency([1, 2, 3], ways=ways)[0].cache
        assert cache.ways == ways and cache.capacity == 64 // ways * ways


@pytest.mark.parametrize("ways", [WAYS, 16])
def test_shrink_uncaches_the_units_of_the_slots_it_drops(ways):
    """Every position of every filled page slot holds a unit (of a layer other than the
    position's, for half of them); shrinking drops exactly the units of the dropped page
    slots' positions, and the tables stay inverse maps."""
    L, H = LAYERS, HKV
    c = UnitCache(L, H, 4 * ways * L * H, 4 * ways, BS, "cpu", ways=ways)
    assert c.sets == 4 and c.capacity == 4 * ways
    c.grow(torch.arange(1, 1 + 3 * ways))
    slots = c._slots(0, c.pages).tolist()
    last_pages = sorted(int(c.cache_pages[s]) for s in slots[-5:])
    hb = 0
    for slot in slots:
        for h in range(H):
            for l2 in range(L):
                ly = (l2 + hb) % L  # the unit's layer: the position's, or the other one
                pos = slot * L + l2
                c.unit_slot[ly * H + h, hb], c.slot_unit[h, pos] = pos, ly * c.host_blocks + hb
                hb += 1
    dropped = c.shrink(5)
    assert dropped.numel() == 5 * BS and c.pages == 3 * ways - 5
    kept = {slot * L + l2 for slot in c._slots(0, c.pages).tolist() for l2 in range(L)}
    held = set()
    for lh in range(L * H):
        for b in (c.unit_slot[lh, :-1] >= 0).nonzero().flatten().tolist():
            pos = int(c.unit_slot[lh, b])
            held.add((lh % H, pos))
            assert int(c.slot_unit[lh % H, pos]) == (lh // H) * c.host_blocks + b
    assert held == {(h, pos) for h in range(H) for pos in kept}
    occupied = {
        (h, p) for h in range(H) for p in (c.slot_unit[h, :-1] >= 0).nonzero().flatten().tolist()
    }
    assert occupied == held
    assert sorted((dropped[::BS] // BS).tolist()) == last_pages
    assert not c.cache_pages[slots[-5:]].any()


def test_forget_uncaches_a_released_blocks_units_in_every_layer_and_position():
    L, H, HB_ = LAYERS, HKV, 48
    c = UnitCache(L, H, HB_, 16, BS, "cpu", ways=WAYS)
    c.grow(torch.arange(1, 9))
    c.mark_evicted(torch.tensor([5, 6, 7]))
    placed = [(0, 0, 5, 3), (1, 1, 5, 0), (1, 0, 6, 9), (0, 1, 7, 17)]  # (ly, h, hb, pos)
    for ly, h, hb, pos in placed:
        c.unit_slot[ly * H + h, hb], c.slot_unit[h, pos] = pos, ly * HB_ + hb
    c.forget(torch.tensor([5, 7]))
    assert (c.unit_slot[:, [5, 7]] == -1).all() and not c.live[[5, 7]].any()
    left = [
        (h, p) for h in range(H) for p in (c.slot_unit[h, :-1] >= 0).nonzero().flatten().tolist()
    ]
    assert left == [(0, 9)] and int(c.unit_slot[1 * H + 0, 6]) == 9 and c.live[6] == 1


@pytest.mark.parametrize("layers,heads,d,ways", [(24, 2, 64, 8), (32, 8, 128, 16), (28, 4, 128, 1)])
def test_the_pool_budget_covers_the_unit_caches_tables_per_page(layers, heads, d, ways):
    """`unit_cache_bytes_per_page`, which SGLang's pool gives up per page at the tiered
    home, covers what the cache allocates per page: positions, pages and the refresh's
    scratch (the host blocks' columns are in `host_row_bytes`)."""
    from sglang_psa.mem_cache.kv_budget import unit_cache_bytes_per_page

    pages = 1000
    c = UnitCache(layers, heads, 1, pages, BS, "cpu", ways=ways)
    per_page = (c.slot_unit, c.cache_pages, c._scratch)
    used = sum(t.numel() * t.element_size() for t in per_page)
    kv_bytes_per_token = 2 * layers * heads * d * 2  # bf16
    budget = pages * unit_cache_bytes_per_page(kv_bytes_per_token, torch.bfloat16, layers, ways)
    assert used <= budget < 5 * used  # (heads bounded from above: head_dim >= 32)


def test_the_unit_cache_reads_the_pools_layer_offsets_and_refuses_a_pool_it_cannot_read():
    """`bind` sets the element offsets between the pool's layer buffers (what the wave
    kernel adds to read a unit in another layer's buffer); a pool whose layer count or
    buffer shapes differ from the cache's, or whose buffers lie a distance apart the
    kernels cannot vectorize, is refused with the reason."""
    bufs = [torch.zeros(64, HKV, 8) for _ in range(LAYERS)]
    c = UnitCache(LAYERS, HKV, 16, 8, BS, "cpu")
    c.bind(SimpleNamespace(k_buffer=bufs, v_buffer=bufs[::-1]))
    step = (bufs[1].data_ptr() - bufs[0].data_ptr()) // 4
    assert c.k_shift.tolist() == [[0, step], [-step, 0]]
    assert c.v_shift.tolist() == [[0, -step], [step, 0]]
    with pytest.raises(ValueError, match="the pool has 3 layers, the unit cache 2"):
        three = bufs + bufs[:1]
        UnitCache(LAYERS, HKV, 16, 8, BS, "cpu").bind(
            SimpleNamespace(k_buffer=three, v_buffer=three)
        )
    odd = [bufs[0], torch.zeros(32, HKV, 8)]
    with pytest.raises(ValueError, match="differ in dtype, shape or strides"):
        UnitCache(LAYERS, HKV, 16, 8, BS, "cpu").bind(SimpleNamespace(k_buffer=odd, v_buffer=odd))
    # Buffers 8 elements apart: the kernels' vectorized reads of another layer's buffer
    # assume multiples of 16, so such a pool is refused, not read wrongly.
    flat = torch.zeros(2 * 64 * HKV * 8 + 8)
    near = [flat[: 64 * HKV * 8].view(64, HKV, 8), flat[8 : 8 + 64 * HKV * 8].view(64, HKV, 8)]
    with pytest.raises(ValueError, match="multiple of 16 elements apart"):
        UnitCache(LAYERS, HKV, 16, 8, BS, "cpu").bind(SimpleNamespace(k_buffer=near, v_buffer=near))


def _reference_coldest(reqs, lengths, heats, records, sink, keep, bs, n):
    """Victims block by block, as the rules state them: a request's saved blocks past the
    sink and before its last `keep`, not evicted, with its published readers (255 where
    its row was measured at another length), least read first, then the oldest block,
    then the earlier request."""
    found = []
    for i, q in enumerate(reqs):
        rec = records[q.rid]
        span = max(0, q.seqlen // bs - keep)
        fresh = abs(q.seqlen - int(lengths[rec.row])) <= 8 and int(lengths[rec.row]) > 0
        for b in range(sink, min(rec.saved, span)):
            if rec.evicted is not None and rec.evicted[b]:
                continue
            readers = int(heats[rec.row][b]) if fresh else 255
            found.append((readers, b, i, q.rid))
    found.sort()
    return [(r, rid, b) for r, b, _, rid in found[:n]], len(found)


def test_victims_over_many_requests_match_the_rules_block_by_block():
    """The flat candidate set (`_candidates`, one pass over a batch) picks what the rules
    pick block by block, at the tiered home's scale: 40 requests of up to 600 blocks,
    some with evicted blocks, saves still in flight, a stale measurement, or too short
    to give any block."""
    rng = np.random.default_rng(7)
    n_req, bs, nb = 40, 32, 600
    lengths = torch.zeros(n_req + 2, dtype=torch.int32)
    heats, records, reqs = {}, {}, []
    for i in range(n_req):
        row, blocks = i + 1, int(rng.integers(1, nb))
        seqlen = blocks * bs + int(rng.integers(0, bs))
        heats[row] = rng.integers(0, 9, nb + 8).astype(np.uint8)  # few readers: many ties
        lengths[row] = seqlen - (40 if i % 7 == 3 else int(rng.integers(0, 4)))  # i%7==3: stale
        rec = RequestKV(
            f"r{i}", host=list(range(blocks)), saved=int(rng.integers(0, blocks + 1)), row=row
        )
        if i % 3 == 0:
            rec.evicted = rng.random(nb + 8) < 0.2
        records[rec.rid] = rec
        reqs.append(
            SimpleNamespace(rid=rec.rid, req_pool_idx=row, seqlen=seqlen, finished=lambda: False)
        )
    ws = SimpleNamespace(
        read=lambda: (None, lengths), heat=lambda: heats, layers=LAYERS,
        kv_heads=HKV, heat_blocks=nb + 8, stamps=None, step=None,
    )  # fmt: skip
    blocks = SimpleNamespace(num_blocks=HB, refs=np.zeros(HB, dtype=np.int32))
    wb = SimpleNamespace(records=records, blocks=blocks, host=None, fence=TableFence())
    cfg = SimpleNamespace(
        block_size=bs, sink_blocks=1, recent_blocks=1, cold_fraction=0.5, unit_cache_ways=8
    )
    res = Residency(
        wb, SimpleNamespace(page_rows=100), ws, torch.zeros(4, 64), cfg,
        SimpleNamespace(size=63 * bs), None,
    )  # fmt: skip
    shuffled = [reqs[i] for i in rng.permutation(n_req)]  # ties follow the batch's order
    for n in (0, 1, 17, 500, 100_000):
        want, total = _reference_coldest(shuffled, lengths, heats, records, 1, 3, bs, n)
        assert res._coldest(shuffled, n) == want
    assert res.evictable(shuffled) == total > 1000
    # refresh's cold blocks: every candidate read by fewer than half the units (2 of 4)
    gone = []
    res.evict_many = lambda wanted, alloc: (
        gone.extend((rid, b) for rid, bl in wanted.items() for b in bl) or 0
    )
    res.cache.refresh = lambda *a: None  # (the kernel has its own tests)
    res.refresh(shuffled, _Alloc([]))
    cold = {
        (rid, b)
        for r, rid, b in _reference_coldest(shuffled, lengths, heats, records, 1, 3, bs, total)[0]
        if r < 2
    }
    assert len(gone) == len(cold) > 0 and set(gone) == cold


def _bench_stand_in(batch: int, prompt: int):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "scheduler"))
    import residency_step  # (its stand-in round: the benchmark times what is checked here)

    return residency_step.stand_in(batch, prompt)


def _may_leave(s) -> list[tuple[int, int, int]]:
    """Reference: (readers, block, request index) of every block of the stand-in's requests
    that may leave HBM (saved, past the sink, not among the recent, not gone), by loops."""
    res, out = s.res, []
    for i, q in enumerate(s.reqs):
        rec = s.records[q.rid]
        span = q.seqlen // res.block_size - res.keep_recent
        for b in range(span):
            gone = rec.evicted is not None and b < len(rec.evicted) and rec.evicted[b]
            if res.sink <= b < rec.saved and not gone:
                out.append((int(s.heat[rec.row][b]), b, i))
    return out


@pytest.mark.parametrize("batch,prompt", [(3, 2048), (13, 28_000)])
def test_the_coldest_blocks_are_the_least_read_then_oldest_at_the_benchmarks_shape(batch, prompt):
    """The benchmark's round (benchmark/scheduler/residency_step.py: workload b's batch 13
    of 28K prompts, a third of the requests with blocks gone) through the vectorised
    candidate pass, against loops over every block."""
    s = _bench_stand_in(batch, prompt)
    want = sorted(_may_leave(s))
    assert s.res.evictable(s.reqs) == len(want)
    for n in (1, 2 * batch, len(want) + 5):
        got = s.res._coldest(s.reqs, n)
        assert [(r, s.reqs[i].rid, b) for r, b, i in want[:n]] == got


@pytest.mark.parametrize("tree", [False, True])
def test_a_release_drops_page_0_unless_the_psa_radix_cache_left_it_out(tree):
    """While a block is evicted its request's row points at page 0, which SGLang's free of
    that row would hand to the allocator: the release hook drops it (a boolean mask, a
    sync). With the psa radix cache every free leaves page-0 blocks out by itself from
    host-side records (`_HbmOnly`; the store asserts it, test_psa_radix_cache), so a
    release passes untouched, without a sync."""
    res, r = _residency([7, 0, 8, 2, 1, 4, 5, 3, 5, 6])
    r.evicted = np.zeros(16, dtype=bool)
    r.evicted[3] = True
    if tree:
        res.sharing = object()
    pages = (torch.tensor([5, 0, 9]), torch.tensor([0]))
    got = res.releasable(pages)
    if tree:
        assert got is pages
    else:
        assert [p.tolist() for p in got] == [[5, 9], []]
