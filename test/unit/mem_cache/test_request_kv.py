"""Each request's record in the tiered store and its passage (`mem_cache.request_kv`), with
the real write-back (the uva path, on CPU), residency and unit cache, and fakes of SGLang's
pool, allocator and requests: park keeps exactly the saved blocks, in the same host blocks,
and a resume reads those blocks from the new row; a trim keeps the prefix; release returns
everything a request held, once; every step keeps the records' invariants."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang_psa.mem_cache.request_kv import TieredRequests  # noqa: E402
from sglang_psa.mem_cache.residency import Residency  # noqa: E402
from sglang_psa.mem_cache.writeback import WriteBack, wait_saved  # noqa: E402
from sglang_psa.releases import has, req_prefix_len  # noqa: E402

# How a resumed request's prefix is set follows the installed SGLang release: CI runs these
# on every release.
pytestmark = pytest.mark.sglang

L, H, D, BS = 2, 2, 64, 32
PAGES, ROWS, CTX, HOST_BLOCKS = 48, 4, 16 * BS, 40


class _Pool:
    """SGLang's side: per-layer token-major K/V buffers and the request table; pages handed
    out from the top."""

    def __init__(self, device: str):
        g = torch.Generator().manual_seed(0)
        kv = lambda: torch.randn(PAGES * BS, H, D, generator=g).to(device)  # noqa: E731
        self.k_buffer = [kv() for _ in range(L)]
        self.v_buffer = [kv() for _ in range(L)]
        self.size = (PAGES - 1) * BS  # page 0 is SGLang's padding page
        self.req_to_token = torch.zeros(ROWS, CTX, dtype=torch.int64, device=device)
        self.free = list(range(1, PAGES))
        self.lens = [0] * ROWS

    def write(self, row: int, n: int) -> None:
        """Append `n` tokens to request-table row `row` (a page per block)."""
        for t in range(self.lens[row], self.lens[row] + n):
            if t % BS == 0:
                page = self.free.pop()
                self.req_to_token[row, t : t + BS] = page * BS + torch.arange(BS)
        self.lens[row] += n

    def pages(self, row: int, blocks) -> list[int]:
        return [int(self.req_to_token[row, b * BS]) // BS for b in blocks]


class _Alloc:
    """SGLang's allocator as residency gives pages back to it."""

    def __init__(self):
        self.freed: list[int] = []

    def free_segment(self, tokens: torch.Tensor, start_pos: int) -> None:
        assert start_pos == 0 and tokens.numel() % BS == 0
        self.freed += (tokens[::BS] // BS).tolist()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


@contextlib.contextmanager
def _store(device: str = "cpu", **kw):
    """A tiered store: write-back (the uva path unless `path` says otherwise), residency
    (metadata and stamps rows not modelled) and the requests' passage; the records'
    invariants are checked at the end."""
    pool = _Pool(device)
    kw = {"path": "uva", **kw}
    wb = WriteBack(L, H, D, torch.float32, BS, HOST_BLOCKS, 12 * BS, device,
                   table_shape=(ROWS, CTX // BS), **kw)  # fmt: skip
    ws = SimpleNamespace(
        layers=L, kv_heads=H, heat_blocks=CTX // BS, copy_rows=lambda pages, rows: None
    )
    meta = SimpleNamespace(page_rows=PAGES)
    cfg = SimpleNamespace(
        block_size=BS, sink_blocks=1, recent_blocks=1, cold_fraction=0.0, unit_cache_ways=8
    )
    res = Residency(wb, meta, ws, pool.req_to_token, cfg, pool, None)
    reqs = TieredRequests(wb, res, pool, pool.req_to_token, BS)
    try:
        yield wb, pool, res, reqs
        reqs.check_integrity()
    finally:
        wb.close()


def _req(rid: str, row: int | None, fill: int = 0, **kw):
    """SGLang's request as the store reads it (`fill`: its prompt and output so far)."""
    fields = dict(
        rid=rid, req_pool_idx=row, input_embeds=None, full_untruncated_fill_ids=[0] * fill,
        return_logprob=False, logprob_start_len=-1, prefix_indices=torch.empty(0),
    )  # fmt: skip
    return SimpleNamespace(**{**fields, **kw})


def _prefix(reqs: TieredRequests, req) -> torch.Tensor:
    """The slots a resumed `req`'s new row gets for its prefix: set at the match on SGLang
    0.5.17 (`Req.prefix_indices`), read at allocation from 0.5.23 on (`prefix_slots`)."""
    return req.prefix_indices if has("prefix_slots") else reqs.prefix_slots(req)


def _extend(wb: WriteBack, pool: _Pool, req, n: int) -> None:
    """One extend of `n` tokens of `req`: plan, then its saves are issued."""
    pool.write(req.req_pool_idx, n)
    wb.plan_extend([req], [pool.lens[req.req_pool_idx]])
    wb.before_forward()
    wb.issue_extend(pool.k_buffer, pool.v_buffer, pool.req_to_token)


def _running(wb, pool, rid: str, row: int, tokens: int):
    """A request admitted with room for 8 blocks and prefilled with `tokens`, its saves
    acknowledged."""
    req = _req(rid, row)
    assert wb.reserve(rid, 8 * BS)
    _extend(wb, pool, req, tokens)
    wait_saved(wb)
    return req


def _host_copy(wb: WriteBack, pool: _Pool, page: int, hb: int) -> bool:
    """Whether host block `hb` holds the KV of page `page`, every layer and head."""
    sl = slice(page * BS, (page + 1) * BS)
    return all(
        torch.equal(wb.host.k[layer, :, hb], pool.k_buffer[layer][sl].transpose(0, 1).cpu())
        and torch.equal(wb.host.v[layer, :, hb], pool.v_buffer[layer][sl].transpose(0, 1).cpu())
        for layer in range(L)
    )


def test_park_keeps_the_saved_blocks_and_resume_reads_them_from_the_new_row(device):
    """After a prefill of 3 blocks and a decode block planned but not issued, `park` issues
    and waits for every save and keeps all 4 blocks, in the host blocks they were planned
    in; they leave HBM (entries at page 0, pages back to the allocator), the old row reads
    HBM again, the host blocks beyond them stay promised. The kept tokens are the resumed
    request's prefix, and its new row's location table points at those same host blocks;
    the blocks after them are saved from the new row."""
    with _store(device, decode_flush_blocks=100) as (wb, pool, res, reqs):
        alloc = _Alloc()
        a = _req("a", 0)
        assert wb.reserve("a", 8 * BS)
        _extend(wb, pool, a, 3 * BS + 4)
        for _ in range(BS):
            pool.write(0, 1)
            wb.plan_decode([a], [pool.lens[0]])
        assert wb.report()["blocks_pending"] == 1  # block 3 planned, not issued
        assert wb.read_from_host("a", [1, 2]) == [1, 2]  # acknowledged by the plan's poll
        rec, free_before = wb.records["a"], wb.blocks.available
        host_before, pages = list(rec.host), pool.pages(0, range(4))
        assert reqs.park(a, alloc) == 4 * BS
        assert wb.saved_blocks("a") == host_before and rec.parked and rec.row is None
        assert all(_host_copy(wb, pool, p, hb) for p, hb in zip(pages, host_before))
        assert wb.report()["blocks_pending"] == 0 and not wb.transport.jobs
        assert not wb.host_loc[0].any()  # the old row reads HBM (SGLang reuses it)
        assert sorted(alloc.freed) == sorted(pages) and rec.evicted[:4].all()
        assert torch.equal(pool.req_to_token[0, : 4 * BS].cpu(), torch.arange(4 * BS) % BS)
        assert wb.blocks.used == 4 and wb.blocks.available == free_before  # still promised
        assert wb.reserve("a", 8 * BS) and wb.blocks.available == free_before  # no double
        reqs.check_integrity()
        # SGLang resets it and asks its prefix cache: the kept tokens are its prefix.
        q = _req("a", None, fill=5 * BS + 6)
        assert reqs.resume_prefix(q)
        assert torch.equal(_prefix(reqs, q).cpu(), torch.arange(4 * BS) % BS)
        q.req_pool_idx = 3
        reqs.resume([_req("b", 1), q])  # "b" is no parked request: left as it is
        assert not rec.parked and rec.row == 3 and "b" not in wb.records
        assert wb.host_loc[3, :4].tolist() == [-h - 1 for h in host_before]
        assert not wb.host_loc[3, 4:].any()
        rep = reqs.report()
        assert rep["resumed"] == 1 and rep["resumed_host_tokens"] == 4 * BS
        assert rep["resumed_recomputed_tokens"] == BS + 6
        reqs.resume([q])  # resumed already: nothing changes
        assert reqs.report()["resumed"] == 1
        # The resumed prefill computes the tokens after the kept blocks into row 3.
        pool.req_to_token[3, : 4 * BS] = pool.req_to_token[0, : 4 * BS]
        pool.lens[3] = 4 * BS
        _extend(wb, pool, q, BS + 6)
        wait_saved(wb)
        assert wb.saved_blocks("a")[:4] == host_before and len(wb.saved_blocks("a")) == 5
        assert _host_copy(wb, pool, pool.pages(3, [4])[0], wb.saved_blocks("a")[4])


@pytest.mark.parametrize("path", ["uva", "engine"])
def test_park_waits_for_issued_saves_and_keeps_exactly_the_saved_blocks(device, path):
    """Saves issued and not yet acknowledged (the engine's slowed down) are waited for:
    every block they complete is kept. A trim to fewer blocks gives the others' host
    blocks back, still promised to the request."""
    with _store(device, path=path, engine_slow_ms=50) as (wb, pool, res, reqs):
        a = _req("a", 0)
        assert wb.reserve("a", 8 * BS)
        _extend(wb, pool, a, 2 * BS)
        assert wb.transport.jobs and wb.records["a"].saved == 0  # issued, not acknowledged
        assert reqs.park(a, _Alloc()) == 2 * BS
        assert not wb.transport.jobs and len(wb.saved_blocks("a")) == 2
        free = wb.blocks.available
        reqs.trim("a", 1)  # the second block is computed again: its host block goes back
        assert len(wb.saved_blocks("a")) == 1 and wb.blocks.used == 1
        assert wb.blocks.available == free and wb.records["a"].planned == 1


def test_a_trimmed_prefix_keeps_its_first_blocks_in_the_same_host_blocks():
    """Input log-probabilities from a position inside the kept prefix: the prefix ends at
    the last whole block before it; those blocks keep their host blocks and stay off HBM
    (their units cacheable), the later ones leave the unit cache, count as evicted no more
    and give their host blocks back, still promised. A trim never grows the prefix."""
    with _store() as (wb, pool, res, reqs):
        a = _running(wb, pool, "a", 0, 4 * BS + 3)
        reqs.park(a, _Alloc())
        kept, free = wb.saved_blocks("a"), wb.blocks.available
        assert res.cache.live[kept].all()
        q = _req("a", None, fill=6 * BS, return_logprob=True, logprob_start_len=2 * BS + 5)
        assert reqs.resume_prefix(q)
        assert torch.equal(_prefix(reqs, q), torch.arange(2 * BS) % BS)
        rec = wb.records["a"]
        assert wb.saved_blocks("a") == kept[:2] and rec.parked
        assert rec.evicted[:4].tolist() == [True, True, False, False]
        assert res.cache.live[kept[:2]].all() and not res.cache.live[kept[2:]].any()
        assert wb.blocks.used == 2 and wb.blocks.available == free
        with pytest.raises(RuntimeError, match="not parked with 3 saved blocks"):
            reqs.trim("a", 3)


def test_release_returns_everything_a_request_held_once():
    """A running request with an evicted block and unissued saves, and a parked one, end:
    their records leave the table, their host blocks and reservations return, their rows
    read HBM, their units leave the unit cache, their unissued saves are dropped, and the
    allocator hook is told to drop their page-0 entries. A second release changes
    nothing."""
    with _store(decode_flush_blocks=100) as (wb, pool, res, reqs):
        alloc = _Alloc()
        a = _running(wb, pool, "a", 0, 4 * BS + 3)
        b = _running(wb, pool, "b", 1, 3 * BS + 1)
        reqs.park(a, alloc)
        assert res.evict("b", [1], alloc) == BS and wb.host_loc[1].any()
        for _ in range(BS):
            pool.write(1, 1)
            wb.plan_decode([b], [pool.lens[1]])
        assert wb.report()["blocks_pending"] == 1 and not res.zero_pending
        reqs.check_integrity()
        reqs.release("b")
        assert res.zero_pending and wb.stats.dropped_blocks == 1
        assert "b" not in wb.records and not wb.host_loc[1].any()
        assert res.evicted.keys() == {"a"} and wb.blocks.used == 4
        reqs.release("a")
        assert not wb.records and not res.evicted and not res.cache.live.any()
        assert wb.blocks.used == 0 and wb.blocks.available == HOST_BLOCKS
        assert not wb.host_loc.any() and wb.report()["blocks_pending"] == 0
        reqs.release("a")
        reqs.release("b")
        assert wb.blocks.used == 0 and wb.blocks.available == HOST_BLOCKS


def test_an_adopted_prefix_is_shared_and_outlives_the_request_that_saved_it():
    """A request adopting another's saved prefix holds the same host blocks (nothing
    copied, its reservation shrinks by them) and saves only its own blocks after them.
    Releasing the first request leaves the shared blocks held; a block one holder evicted
    keeps its units in the unit cache until its last holder ends; then every id is
    free once."""
    with _store() as (wb, pool, res, reqs):
        alloc = _Alloc()
        _running(wb, pool, "a", 0, 4 * BS + 3)
        kept = wb.saved_blocks("a")
        assert wb.reserve("b", 8 * BS) and wb.records["b"].reserved == 8
        assert reqs.adopt("b", kept[:3])
        rec = wb.records["b"]
        assert rec.host == kept[:3] and rec.saved == 3 and rec.reserved == 5
        assert wb.blocks.refs[kept].tolist() == [2, 2, 2, 1] and wb.blocks.used == 4
        reqs.check_integrity()
        with pytest.raises(RuntimeError, match="after its blocks were planned"):
            reqs.adopt("b", kept[:1])
        # Its extend computes the tokens after the prefix into row 1 (which names the
        # prefix's pages, as SGLang writes a matched prefix into a request's row).
        pool.req_to_token[1, : 3 * BS] = pool.req_to_token[0, : 3 * BS]
        pool.lens[1] = 3 * BS
        _extend(wb, pool, _req("b", 1), BS + 5)
        wait_saved(wb)
        assert rec.host[:3] == kept[:3] and rec.saved == 4 and rec.host[3] not in kept
        assert _host_copy(wb, pool, pool.pages(1, [3])[0], rec.host[3])
        assert wb.stats.blocks_planned == 5  # a's 4 and b's own one
        reqs.check_integrity()
        reqs.release("a")
        assert wb.blocks.refs[kept].tolist() == [1, 1, 1, 0]
        assert kept[3] in wb.blocks._free and not set(kept[:3]) & set(wb.blocks._free)
        reqs.check_integrity()
        # b alone holds block 1 now: it may leave HBM; c adopts the prefix with it.
        assert res.evict("b", [1], alloc) == BS and res.cache.live[kept[1]]
        assert reqs.adopt("c", kept[:3]) and wb.blocks.refs[kept[1]] == 2
        reqs.release("b")  # c still reads block 1 from the host tier: its units stay
        assert res.cache.live[kept[1]] and wb.blocks.refs[kept[:3]].tolist() == [1, 1, 1]
        reqs.check_integrity()
        reqs.release("c")  # the last holder: the units go before the id is free
        assert not res.cache.live.any() and not res.left_hbm.any()
        assert not wb.records and wb.blocks.used == 0 and not wb.blocks.refs.any()
        assert sorted(wb.blocks._free) == list(range(HOST_BLOCKS))


def test_a_parked_request_resumes_with_its_evicted_and_resident_blocks_alike():
    """Blocks evicted while it ran stay as they are; park evicts every other saved block
    (the sink and the recent ones too: the whole kept prefix is read from the host tier);
    the resumed request's prefix is all of them and the counters say what it read from
    the host tier and what it computed again."""
    with _store() as (wb, pool, res, reqs):
        alloc = _Alloc()
        a = _running(wb, pool, "a", 0, 8 * BS + 3)
        pages = pool.pages(0, range(8))
        assert res.evict("a", [3, 4], alloc) == 2 * BS
        alloc.freed.clear()
        assert reqs.park(a, alloc) == 8 * BS
        assert sorted(alloc.freed) == sorted(pages[b] for b in (0, 1, 2, 5, 6, 7))
        assert reqs.parked("a") and reqs.report()["parked_requests"] == 1
        q = _req("a", None, fill=10 * BS + 5)
        assert reqs.resume_prefix(q)
        assert torch.equal(_prefix(reqs, q), torch.arange(8 * BS) % BS)
        q.req_pool_idx = 3
        reqs.resume([_req("b", 1), q])
        assert not reqs.parked("a")
        rep = reqs.report()
        assert rep["resumed"] == 1 and rep["resumed_host_tokens"] == 8 * BS
        assert rep["resumed_recomputed_tokens"] == 2 * BS + 5
        assert rep["parked_requests"] == 0
        assert res.evicted["a"][:8].all()  # staged prefill reads them from the host tier


def test_a_request_without_saved_blocks_or_of_input_embeddings_is_not_parked():
    with _store() as (wb, pool, res, reqs):
        assert wb.reserve("a", 8 * BS)
        assert reqs.park(_req("a", 0), _Alloc()) == 0  # nothing saved yet
        b = _running(wb, pool, "b", 1, 2 * BS)
        assert reqs.park(_req("b", 1, input_embeds=torch.zeros(1)), _Alloc()) == 0
        assert not reqs.parked("a") and not reqs.parked("b")
        assert wb.records["b"].row == 1 and b.req_pool_idx == 1  # untouched


def test_a_prefix_with_no_whole_block_before_the_logprob_start_is_prefilled_whole():
    """No whole kept block before the first token SGLang must compute: the host copy goes
    (unparked, released) and the request is prefilled whole from its first token."""
    with _store() as (wb, pool, res, reqs):
        a = _running(wb, pool, "a", 0, 3 * BS + 3)
        reqs.park(a, _Alloc())
        q = _req("a", None, fill=4 * BS, return_logprob=True, logprob_start_len=BS - 1)
        assert not reqs.resume_prefix(q)
        assert "a" not in wb.records and not res.evicted and wb.blocks.used == 0
        assert req_prefix_len(q) == 0
        reqs.resume([q])  # nothing to resume
        assert reqs.report()["resumed"] == 0


def test_a_resumed_prefix_that_does_not_match_the_kept_one_is_refused():
    with _store() as (wb, pool, res, reqs):
        a = _running(wb, pool, "a", 0, 2 * BS + 1)
        reqs.park(a, _Alloc())
        q = _req("a", 1, fill=3 * BS)
        with pytest.raises(RuntimeError, match="resumes with a prefix of 0 tokens, 64 were"):
            reqs.resume([q])
        assert reqs.parked("a")  # nothing changed


def test_the_records_invariants_hold_the_table_to_the_free_list():
    """`check_integrity` catches a host block held twice and a parked record with a row."""
    with _store() as (wb, pool, res, reqs):
        _running(wb, pool, "a", 0, 2 * BS)
        reqs.check_integrity()
        rec = wb.records["a"]
        rec.host.append(rec.host[0])
        with pytest.raises(AssertionError, match="owned twice"):
            reqs.check_integrity()
        rec.host.pop()
        rec.parked, rec.evicted = True, np.arange(CTX // BS) < rec.saved
        with pytest.raises(AssertionError, match="parked with a row"):
            reqs.check_integrity()
        rec.parked, rec.evicted = False, None
