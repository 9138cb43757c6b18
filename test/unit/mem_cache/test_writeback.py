"""Write-back to the host tier (`--psa-kv-home tiered`): every block a prefill chunk or
decode steps complete lands, per (layer, KV head, block), in its host block; nothing is
counted saved before the engine acknowledged it; a killed engine is restarted and its
saves redone; ended requests return their host blocks."""

import threading
import time

import numpy as np
import pytest
import torch

pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang_psa.mem_cache.host_blocks import HostBlocks, HostTierFull  # noqa: E402
from sglang_psa.mem_cache.request_kv import RequestKV  # noqa: E402
from sglang_psa.mem_cache.writeback import WriteBack, to_device, wait_saved  # noqa: E402

pytestmark = pytest.mark.slow

L, H, D, BS = 3, 2, 64, 32
PAGES, ROWS, CTX = 64, 4, 16 * BS


class FakeReq:
    def __init__(self, rid, row):
        self.rid, self.req_pool_idx = rid, row


class FakePool:
    """SGLang's side: per-layer token-major K/V buffers and the request table, pages
    handed out in a shuffled order."""

    def __init__(self, device):
        g = torch.Generator().manual_seed(0)
        self.k = [torch.zeros(PAGES * BS, H, D, device=device) for _ in range(L)]
        self.v = [torch.zeros(PAGES * BS, H, D, device=device) for _ in range(L)]
        self.req_to_token = torch.zeros(ROWS, CTX, dtype=torch.int64, device=device)
        self.free = (torch.randperm(PAGES - 1, generator=g) + 1).tolist()
        self.lens = [0] * ROWS
        self.g = g

    def write(self, row, n):
        """Append `n` tokens of fresh KV to request-table row `row` (all layers)."""
        for t in range(self.lens[row], self.lens[row] + n):
            if t % BS == 0:
                page = self.free.pop()
                self.req_to_token[row, t : t + BS] = page * BS + torch.arange(BS)
            slot = int(self.req_to_token[row, t])
            for layer in range(L):
                self.k[layer][slot] = torch.randn(H, D, generator=self.g).to(self.k[layer])
                self.v[layer][slot] = torch.randn(H, D, generator=self.g).to(self.v[layer])
        self.lens[row] += n

    def block(self, layer, row, b):
        page = int(self.req_to_token[row, b * BS]) // BS
        sl = slice(page * BS, (page + 1) * BS)
        return self.k[layer][sl].transpose(0, 1).cpu(), self.v[layer][sl].transpose(0, 1).cpu()


def check_saved(wb, pool, rid, row, n_blocks):
    host = wb.saved_blocks(rid)
    assert len(host) == n_blocks
    for b, hb in enumerate(host):
        for layer in range(L):
            k, v = pool.block(layer, row, b)
            assert torch.equal(wb.host.k[layer, :, hb], k), (layer, b)
            assert torch.equal(wb.host.v[layer, :, hb], v), (layer, b)


def extend(wb, pool, reqs_and_tokens):
    """One extend batch: plan, the forward writes every layer, then the backend issues."""
    reqs = [r for r, _ in reqs_and_tokens]
    for r, n in reqs_and_tokens:
        pool.write(r.req_pool_idx, n)
    wb.plan_extend(reqs, [pool.lens[r.req_pool_idx] for r in reqs])
    wb.before_forward()
    wb.issue_extend(pool.k, pool.v, pool.req_to_token)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    return request.param


def make(device, **kw):
    return WriteBack(L, H, D, torch.float32, BS, 40, 12 * BS, device, **kw)


def end(wb, rid) -> None:
    """`rid` ends: the write-back's share of `TieredRequests.release`."""
    wb.forget(wb.records.pop(rid))


PATHS = {
    "engine": dict(path="engine"),
    "uva": dict(path="uva"),
    "uva-dma": dict(path="uva", dma_blocks=2),
}


def test_to_device_takes_lists_and_numpy_arrays_and_copies_them(device):
    """A save's tables and a staged prefill's rows reach the device from lists and numpy
    arrays (on CUDA through pinned memory: a numpy array pinned where it is made raised
    in a live server), as a copy of the given dtype."""
    arr = np.arange(6, dtype=np.int64).reshape(2, 3)
    for values in (arr, arr.tolist()):
        t = to_device(values, torch.device(device), torch.int32)
        assert t.dtype == torch.int32 and t.device.type == device
        assert t.cpu().tolist() == [[0, 1, 2], [3, 4, 5]]
    t = to_device(arr, torch.device(device))
    arr[0, 0] = 99  # the tensor is a copy
    assert t.dtype == torch.int64 and int(t[0, 0]) == 0


@pytest.mark.parametrize("path", list(PATHS))
def test_prefill_chunks_and_decode_blocks_reach_their_host_blocks(device, path):
    """`uva-dma`: a prefill chunk's runs of host blocks move by DMA through a 2-block
    staging (chunks split over it); decode flushes go through the save kernel."""
    wb = make(device, decode_flush_blocks=2, **PATHS[path])
    pool = FakePool(device)
    a, b = FakeReq("a", 0), FakeReq("b", 2)
    try:
        assert wb.reserve("a", CTX) and wb.reserve("b", CTX)
        extend(wb, pool, [(a, 3 * BS + 5), (b, 2 * BS)])  # a: 3 full blocks + 5 tokens
        extend(wb, pool, [(a, 2 * BS + 1)])  # a's chunk 2 completes blocks 3 and 4
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, 5)
        check_saved(wb, pool, "b", 2, 2)
        # Decode: one token per step; a block counts once the step after it is planned.
        for _ in range(2 * BS):
            for r in (a, b):
                pool.write(r.req_pool_idx, 1)
            wb.plan_decode([a, b], [pool.lens[0], pool.lens[2]])
            wb.before_forward()
            wb.issue_decode(pool.k, pool.v, pool.req_to_token)
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, (pool.lens[0] - 1) // BS)
        check_saved(wb, pool, "b", 2, (pool.lens[2] - 1) // BS)
        rep = wb.report()
        full = (pool.lens[0] - 1) // BS + (pool.lens[2] - 1) // BS
        assert rep["blocks_saved"] == rep["blocks_planned"] == full == 7 + 3
        assert rep["save_jobs_in_flight"] == 0 and rep["engine_restarts"] == 0
        assert (rep["engine_pid"] is None) == (path != "engine")
        assert (rep["save_jobs_dma"] > 0) == (path == "uva-dma")
        # Only the engine maps the host tier from its process: the uva tier is private.
        assert wb.host.k.is_shared() == wb.host.v.is_shared() == (path == "engine")
        end(wb, "a")
        end(wb, "b")
        assert wb.blocks.used == 0 and wb.blocks.available == 40
        wb.blocks.check_integrity(wb.records.values())
    finally:
        wb.close()


class RowCountingReq(FakeReq):
    """A request whose row reads are counted (`reads`: its rid per read)."""

    def __init__(self, rid, row, reads):
        self.reads = reads
        super().__init__(rid, row)

    @property
    def req_pool_idx(self):
        self.reads.append(self.rid)
        return self._row

    @req_pool_idx.setter
    def req_pool_idx(self, row):
        self._row = row


def test_decode_planning_reads_a_row_only_for_a_request_with_a_block_to_plan():
    """A decode plan's host cost: a running request whose newest token completed no block
    since its last plan (31 of every 32 steps) is passed over without reading its row;
    one that did is planned, and every block still reaches its host block."""
    wb = make("cpu", decode_flush_blocks=2)
    pool = FakePool("cpu")
    reads: list[str] = []
    a, b = RowCountingReq("a", 0, reads), RowCountingReq("b", 2, reads)
    try:
        assert wb.reserve("a", CTX) and wb.reserve("b", CTX)
        extend(wb, pool, [(a, 2 * BS + 5), (b, BS + 30)])
        for step in range(2 * BS):
            for r in (a, b):
                pool.write(r._row, 1)
            reads.clear()
            lens = [pool.lens[0], pool.lens[2]]
            wb.plan_decode([a, b], lens)
            wb.before_forward()
            wb.issue_decode(pool.k, pool.v, pool.req_to_token)
            # a request's row is read where its token before the newest closed a block
            want = [r.rid for r, n in zip((a, b), lens) if (n - 1) % BS == 0]
            assert reads == want, (step, lens)
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, (pool.lens[0] - 1) // BS)
        check_saved(wb, pool, "b", 2, (pool.lens[2] - 1) // BS)
    finally:
        wb.close()


def test_a_killed_engine_is_restarted_and_its_saves_redone(device):
    """The engine dies in the middle of a slow save: the next poll notices it, restarts
    it without waiting for it and resubmits every unacknowledged job; the host blocks
    end up right."""
    wb = make(device, engine_slow_ms=30, heartbeat_timeout=0.5)
    pool = FakePool(device)
    a = FakeReq("a", 1)
    try:
        assert wb.reserve("a", CTX)
        extend(wb, pool, [(a, 6 * BS)])
        wb.engine.proc.kill()
        wb.engine.proc.join(5)
        wb.engine.slow_ms = 0  # the restarted engine works at full speed
        wb.poll()
        # The poll came back before the new engine's first beat (it imports torch): the
        # scheduler is not held while it starts; the redone jobs wait in its outbox.
        assert wb.engine._starting() and len(wb.engine._outbox) == wb.stats.resubmitted_jobs
        assert wb.stats.engine_restarts == 1 and wb.stats.resubmitted_jobs >= 1
        wait_saved(wb)
        check_saved(wb, pool, "a", 1, 6)
    finally:
        wb.close()


def test_a_save_issued_after_the_engine_died_does_not_block_the_scheduler(device):
    """The engine dies in the middle of an extend's forward, after the step's poll (seen
    at `--tp 2`): a PAIR socket whose peer is gone blocks its sender for ever, so issuing
    the batch's saves must itself notice the death, restart the engine and redo every
    unacknowledged save (the earlier batch's included)."""
    wb = make(device, heartbeat_timeout=0.5)
    pool = FakePool(device)
    a, b = FakeReq("a", 1), FakeReq("b", 2)
    assert wb.reserve("a", CTX) and wb.reserve("b", CTX)
    extend(wb, pool, [(a, 3 * BS)])
    pool.write(b.req_pool_idx, 2 * BS)
    wb.plan_extend([b], [pool.lens[b.req_pool_idx]])
    wb.before_forward()
    wb.engine.proc.kill()
    wb.engine.proc.join(5)
    time.sleep(0.5)  # the socket has seen its peer go

    issuing = threading.Thread(
        target=lambda: wb.issue_extend(pool.k, pool.v, pool.req_to_token), daemon=True
    )
    issuing.start()
    issuing.join(20)
    assert not issuing.is_alive(), "issuing a save to a dead copy engine blocked"
    try:
        assert wb.stats.engine_restarts == 1
        wait_saved(wb)
        check_saved(wb, pool, "a", 1, 3)
        check_saved(wb, pool, "b", 2, 2)
    finally:
        wb.close()


def test_blocks_of_ended_requests_return_and_unissued_saves_are_dropped(device):
    wb = make(device, decode_flush_blocks=100)
    pool = FakePool(device)
    a = FakeReq("a", 0)
    try:
        assert wb.reserve("a", 8 * BS)
        extend(wb, pool, [(a, 2 * BS)])
        for _ in range(BS + 1):
            pool.write(0, 1)
            wb.plan_decode([a], [pool.lens[0]])
        assert wb.report()["blocks_pending"] == 1  # below the flush size: not issued
        end(wb, "a")
        assert wb.stats.dropped_blocks == 1
        wait_saved(wb)
        assert wb.blocks.used == 0
        wb.blocks.check_integrity(wb.records.values())
    finally:
        wb.close()


def test_an_acknowledgement_counts_only_the_blocks_each_record_still_names():
    """A job's entries, a run a request: a run that matches its record is saved at once;
    a request that moved rows, or a block switched to another id since, is not."""
    wb = make("cpu")
    try:
        recs = []
        for row, rid in enumerate("abc"):
            assert wb.reserve(rid, 4 * BS)
            rec = wb.records[rid]
            rec.row = row
            wb.blocks.take(rec, 4)
            recs.append(rec)
        a, b, c = recs
        entries = [("a", 0, k, a.host[k]) for k in range(4)]
        entries += [("b", 9, k, b.host[k]) for k in range(2)]  # b's row is 1 now
        entries += [("c", 2, 0, c.host[0]), ("c", 2, 1, 999), ("c", 2, 2, c.host[2])]
        entries += [("gone", 3, 0, 7)]  # a request that ended: no record
        wb._saved(wb.layers - 1, entries)
        assert (a.saved, b.saved, c.saved) == (4, 0, 1)
        assert wb.blocks.saved[a.host].all() and not wb.blocks.saved[b.host].any()
        assert wb.blocks.saved[[c.host[0], c.host[2]]].all()
        assert not wb.blocks.saved[[c.host[1], c.host[3]]].any()
        wb._saved(wb.layers - 1, [("c", 2, 1, c.host[1]), ("c", 2, 3, c.host[3])])
        assert c.saved == 4  # a run with a gap, checked entry by entry
    finally:
        wb.close()


def test_host_blocks_reserve_take_free():
    hb = HostBlocks(10)
    a, b, c = RequestKV("a"), RequestKV("b"), RequestKV("c")
    assert hb.reserve(a, 6) and not hb.reserve(b, 5) and hb.reserve(b, 4)
    assert hb.take(a, 3) == [0, 1, 2] == a.host  # ascending runs from a fresh list
    assert hb.available == 0
    with pytest.raises(HostTierFull):
        hb.take(c, 1)
    assert hb.take(b, 4) == [3, 4, 5, 6]
    assert hb.free(a) == 3 and hb.available == 6  # its ids and its reservation
    assert hb.free(a) == 0 and hb.available == 6  # once
    hb.check_integrity([b, c])
    assert hb.take(c, 3) == [0, 1, 2]


def test_host_blocks_reservation_is_a_total_and_given_back_ids_stay_promised():
    hb = HostBlocks(10)
    a, b = RequestKV("a"), RequestKV("b")
    assert hb.reserve(a, 4) and hb.take(a, 3) == [0, 1, 2]
    assert hb.reserve(a, 4) and hb.available == 6  # it owns 3 and holds 1: nothing more
    assert hb.reserve(a, 6) and hb.available == 4
    hb.give_back(a, 1)
    assert a.host == [0] and hb.used == 1 and hb.available == 4  # free again, promised to a
    assert not hb.reserve(b, 5) and hb.reserve(b, 4)
    assert hb.take(a, 5) == [1, 2, 3, 4, 5]  # within its promise, smallest first
    assert hb.take(b, 4) == [6, 7, 8, 9] and hb.available == 0
    hb.check_integrity([a, b])


def test_host_runs_decide_dma_or_the_save_kernel(device, monkeypatch):
    """A job of few runs of host blocks moves by DMA; one of scattered blocks (more than
    `DMA_MAX_COPIES` copies) through the save kernel; both land in their host blocks."""
    from sglang_psa.mem_cache.transports import dma

    # 12 runs take 24 strided copies (CUDA) or 144 per-(layer, head) ones: over it either way.
    monkeypatch.setattr(dma, "DMA_MAX_COPIES", 23)
    wb = make(device, path="uva", dma_blocks=16)
    pool = FakePool(device)
    a = FakeReq("a", 0)
    try:
        # A fragmented free list: odd ids are handed out first, one apart.
        wb.blocks._free = [i for i in range(0, 40, 2)][::-1] + [i for i in range(1, 40, 2)][::-1]
        assert wb.reserve("a", CTX)
        extend(wb, pool, [(a, 12 * BS)])
        host = wb.records["a"].host
        assert len(dma.host_runs([("r", 1, b, h) for b, h in enumerate(host)])) == 12
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, 12)
        assert wb.stats.dma_jobs == 0
        end(wb, "a")
        assert wb.blocks.take(RequestKV("y"), 5) == [0, 1, 2, 3, 4]  # freed ids re-form runs
    finally:
        wb.close()


def test_the_dma_staging_holds_every_layer_within_its_byte_cap(device, monkeypatch):
    """A DMA job gathers every layer of its blocks into the staging; the staging's bytes
    are capped (`DMA_STAGING_BYTES`), so a model with many layers takes fewer blocks a
    job: here one block of the 16 asked for, each job one run; every block lands."""
    from sglang_psa.mem_cache.transports import dma

    block_bytes = 2 * L * H * BS * D * 4  # K and V of one block, every layer, float32
    monkeypatch.setattr(dma, "DMA_STAGING_BYTES", 2 * block_bytes - 1)
    wb = make(device, path="uva", dma_blocks=16)
    pool = FakePool(device)
    a = FakeReq("a", 0)
    try:
        assert wb.transport.dma_blocks == 1
        assert wb.transport.device_bytes == block_bytes
        assert wb.reserve("a", CTX)
        extend(wb, pool, [(a, 5 * BS)])
        assert wb.stats.dma_jobs == 5 == wb.stats.jobs
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, 5)
    finally:
        wb.close()


@pytest.mark.gpu
@pytest.mark.parametrize("path", list(PATHS))
def test_decode_planning_issuing_and_polling_never_sync_the_host(path):
    """What the tiered home adds around each decode step (plan, the wait for the last
    gather, the flush of pending blocks with their metadata rows, taking
    acknowledgements) runs with CUDA's sync debug mode set to error."""
    from sglang_psa.mem_cache.page_meta import PageMeta

    wb = make("cuda", decode_flush_blocks=2, **PATHS[path])
    pool = FakePool("cuda")
    wb.meta = PageMeta(L, PAGES, H, D, BS, mean=True, bounds=True, key_dtype=torch.float32,
                       device="cuda", host_rows=40)  # fmt: skip
    wb.meta.kmax.copy_(torch.randn_like(wb.meta.kmax))
    a = FakeReq("a", 0)
    try:
        assert wb.reserve("a", CTX)
        extend(wb, pool, [(a, 2 * BS)])
        pool.write(0, 4 * BS)  # the KV the steps below "decode" (written beforehand)
        wait_saved(wb)
        start = 2 * BS
        wb.plan_decode([a], [start + 1])  # compile and warm outside the check
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        torch.cuda.set_sync_debug_mode("error")
        try:
            for n in range(start + 2, start + 4 * BS):
                wb.plan_decode([a], [n])
                wb.before_forward()
                wb.issue_decode(pool.k, pool.v, pool.req_to_token)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, (start + 4 * BS - 2) // BS)
        for b, hb in enumerate(wb.saved_blocks("a")):  # metadata rows followed the saves
            page = int(pool.req_to_token[0, b * BS]) // BS
            assert torch.equal(wb.meta.kmax[:, PAGES + hb], wb.meta.kmax[:, page]), b
    finally:
        wb.close()


@pytest.mark.gpu
def test_the_private_host_tier_is_page_locked_at_its_own_size():
    """The uva path's host tier is page-locked in place, exactly its size: torch's pinned
    allocator rounds each allocation up to a power of two (an 82 GiB tier asked for 128
    GiB and failed on the 128 GiB GPU machine)."""
    from sglang_psa.mem_cache.host_pool import HostKVPool

    stats = torch.cuda.host_memory_stats
    before = stats().get("allocated_bytes.current", 0)
    pool = HostKVPool(3, 2, 1000, BS, 128, torch.bfloat16, shared=False)  # 2 x 46.9 MiB
    try:
        assert pool.pinned and pool.nbytes == 2 * 3 * 2 * 1000 * BS * 128 * 2
        assert stats().get("allocated_bytes.current", 0) == before  # not torch's allocator
        # An asynchronous copy lands in it and reads back (the uva kernels: test above).
        src = torch.arange(BS * 128, device="cuda", dtype=torch.float32).bfloat16()
        pool.k[2, 1, 999].view(-1).copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(pool.k[2, 1, 999].view(-1).cuda(), src)
    finally:
        pool.close()
    assert not pool.pinned


@pytest.mark.parametrize("api", ["memcpy2d", "per-row"])
def test_strided_copy_moves_every_row_and_nothing_else(device, api):
    """A run of host blocks of every head (rows a slab apart) from the staging (rows a
    job apart): each row lands, the bytes between rows stay. On CUDA the default is one
    `cudaMemcpy2DAsync` from torch's runtime (`memcpy2d`); `per-row` is the fallback."""
    from sglang_psa.mem_cache.strided_copy import StridedCopy

    if device == "cpu" and api == "memcpy2d":
        pytest.skip("memcpy2d is the CUDA path; the CPU copies row by row")
    dev = torch.device(device)
    copy = StridedCopy(dev)
    assert copy.api == ("memcpy2d" if device == "cuda" else "per-row")
    if api == "per-row":
        copy._fn, copy.api = None, "per-row"
    heads, blocks, n = 4, 10, 6
    host = torch.full((heads, blocks, BS, D), -1.0, pin_memory=device == "cuda")
    stage = torch.randn(heads, n * BS, D, device=dev)
    stream = torch.cuda.Stream() if device == "cuda" else None
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    # Staging blocks 1..4 (4 blocks) into host blocks 5..8 of every head.
    copy(host[:, 5:9].view(heads, -1), stage[:, BS : 5 * BS].view(heads, -1), stream)
    if stream is not None:
        stream.synchronize()
    want = torch.full_like(host, -1.0)
    want[:, 5:9] = stage[:, BS : 5 * BS].view(heads, 4, BS, D).cpu()
    assert torch.equal(host, want)
    with pytest.raises(ValueError, match="strided copy"):
        copy(host[:, 5:9].view(heads, -1), stage[:, :BS].view(heads, -1), stream)


def test_until_saving_starts_nothing_is_planned_then_every_full_block_is(device):
    """`--psa-writeback-start`: while `saving` is off, extends and decode steps plan no
    save (each request's row is still followed) and issue none; started at once, a
    request's next plan takes every full block it has from its first, and they land."""
    wb = make(device, decode_flush_blocks=2, path="uva")
    wb.saving = False
    pool = FakePool(device)
    a, b = FakeReq("a", 0), FakeReq("b", 2)
    try:
        assert wb.reserve("a", CTX) and wb.reserve("b", CTX)
        extend(wb, pool, [(a, 3 * BS + 5), (b, 2 * BS)])
        for _ in range(BS):
            for r in (a, b):
                pool.write(r.req_pool_idx, 1)
            wb.plan_decode([a, b], [pool.lens[0], pool.lens[2]])
            wb.issue_decode(pool.k, pool.v, pool.req_to_token)
        rep = wb.report()
        assert rep["blocks_planned"] == rep["save_jobs"] == rep["saving"] == 0
        assert wb.records["a"].row == 0 and wb.records["b"].row == 2
        assert wb.records["a"].planned == wb.records["b"].planned == 0
        wb.start()  # at once (a prompt larger than HBM starts it so)
        for r in (a, b):
            pool.write(r.req_pool_idx, 1)
        wb.plan_decode([a, b], [pool.lens[0], pool.lens[2]])
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        wait_saved(wb)
        check_saved(wb, pool, "a", 0, (pool.lens[0] - 1) // BS)
        check_saved(wb, pool, "b", 2, (pool.lens[2] - 1) // BS)
        assert wb.report()["blocks_saved"] == (pool.lens[0] - 1) // BS + (pool.lens[2] - 1) // BS
        end(wb, "a")
        end(wb, "b")
        assert wb.blocks.used == 0
    finally:
        wb.close()


def test_blocks_waiting_for_their_save_are_nothing_for_pythons_collector():
    """A decode block waits for its save until 16 are pending (many steps); an object a
    block then reached the collector's oldest generation, whose growth starts full
    collections (hundreds of ms on the scheduler's thread with SGLang's heap). Planned
    blocks are tuples the collector untracks at its first young collection, and the
    request's host ids hold no container of their own."""
    import gc

    wb = make("cpu", decode_flush_blocks=1000, path="uva")
    pool = FakePool("cpu")
    a = FakeReq("a", 0)
    try:
        assert wb.reserve("a", CTX)
        pool.write(0, 12 * BS + 1)
        wb.plan_decode([a], [pool.lens[0]])
        assert len(wb._decode) == 12
        gc.collect(0)
        assert not any(map(gc.is_tracked, wb._decode))
        rec = wb.records["a"]
        assert all(h is rec for h in wb.blocks._holders.values())  # no list of one
    finally:
        wb.close()


def test_a_late_start_saves_the_blocks_filled_before_over_several_rounds(device):
    """Started by the pool running short (`start(catch_up=True)`), each plan takes the
    blocks its request completed since its last plan (a prompt extended now is saved as
    at any time) and, of the blocks filled before, at most what is left of
    `catch_up_blocks` for the call (one save of them all would hold up the next forward
    for its whole copy), until a decode call (every running request) leaves none behind;
    then planning is as usual, and every block lands in its host block."""
    wb = make(device, decode_flush_blocks=2, path="uva")
    wb.saving = False
    wb.catch_up_blocks = 3
    pool = FakePool(device)
    a, b, c = FakeReq("a", 0), FakeReq("b", 2), FakeReq("c", 3)
    try:
        assert wb.reserve("a", 10 * BS) and wb.reserve("b", 10 * BS) and wb.reserve("c", 8 * BS)
        extend(wb, pool, [(a, 5 * BS + 7), (b, 4 * BS)])
        wb.start(catch_up=True)
        extend(wb, pool, [(c, 4 * BS + 3)])  # a new prompt: its 4 blocks, not 3
        assert wb.records["c"].planned == 4 and wb.catching_up
        reqs = (a, b, c)
        lens = lambda: [pool.lens[r.req_pool_idx] for r in reqs]  # noqa: E731
        per_call, rounds = [], 0
        while wb.catching_up:
            for r in reqs:
                pool.write(r.req_pool_idx, 1)
            before = wb.stats.blocks_planned
            wb.plan_decode(reqs, lens())
            per_call.append(wb.stats.blocks_planned - before)
            wb.issue_decode(pool.k, pool.v, pool.req_to_token)
            rounds += 1
            assert rounds < 10
        assert per_call == [3, 3, 3]  # the 5 + 4 blocks filled before, 3 a call
        full = lambda row: (pool.lens[row] - 1) // BS  # noqa: E731
        assert [wb.records[r.rid].planned for r in reqs] == [full(0), full(2), full(3)]
        for _ in range(BS):  # as usual now: each block as it completes
            for r in reqs:
                pool.write(r.req_pool_idx, 1)
            wb.plan_decode(reqs, lens())
            wb.issue_decode(pool.k, pool.v, pool.req_to_token)
        assert not wb.catching_up
        wb.issue_decode(pool.k, pool.v, pool.req_to_token, force=True)
        wait_saved(wb)
        for r in reqs:
            check_saved(wb, pool, r.rid, r.req_pool_idx, full(r.req_pool_idx))
    finally:
        wb.close()
