"""The `psa` radix cache (`PsaRadixCache`, SGLang's `RadixCache` subclassed) over the
tiered store, on CPU: SGLang's real ReqToTokenPool, paged allocator and tree, the real
write-back (the uva path), host blocks, prefix index and request records, driven in the
scheduler's call order (match_prefix -> admit and lock -> prefill -> insert -> decode ->
release -> evict) for requests sharing prefixes, through the installed release's calls:
0.5.17's `cache_unfinished_req` / `cache_finished_req`, 0.5.23's `checkpoint_kv_cache` /
`release_kv_cache` (`sglang.srt.mem_cache.common`, which call `checkpoint`,
`free_kv_row`, `unlock` and `on_release`) and `prefix_device_indices` at allocation.
After every call (docs/prefix-tiered.md): every host id is held by exactly the records
naming it, kept, or free (1); a request's row equals its tree path, whose page-0 blocks
are its own host ids, and right after its insert its indexed blocks are the index's ids
(3); the index keeps prefix starts (5); every HBM page is free, the tree's or one
request's, once; page 0 never reaches the allocator; the tree's sizes count HBM slots
only (6)."""

from __future__ import annotations

import contextlib
import random
from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")
pytest.importorskip(
    "sglang.srt.mem_cache.radix_cache",
    reason="SGLang is not installed here (bash scripts/install_sglang_cpu.sh)",
)
from sglang_psa import releases  # noqa: E402

if not releases.has("psa_radix_cache"):
    pytest.skip(
        f"--radix-cache-backend psa is not offered on SGLang {releases.release()}",
        allow_module_level=True,
    )
CHECKPOINT = releases.has("tree_checkpoint")  # 0.5.23's calls, else 0.5.17's

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402

from sglang_psa.mem_cache import psa_radix_cache  # noqa: E402
from sglang_psa.mem_cache.prefix_index import PrefixIndex  # noqa: E402
from sglang_psa.mem_cache.psa_radix_cache import PsaRadixCache  # noqa: E402
from sglang_psa.mem_cache.request_kv import TieredRequests  # noqa: E402
from sglang_psa.mem_cache.residency import Residency  # noqa: E402
from sglang_psa.mem_cache.writeback import WriteBack, wait_saved  # noqa: E402

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

L, H, D, BS = 2, 1, 8, 4
PAGES, ROWS, CTX, HOST_BLOCKS = 40, 6, 64, 28


class _Req(SimpleNamespace):
    """SGLang's `Req` as the calls here read it (hashed and compared by identity); 0.5.23
    keeps its row and lengths in `kv` (SGLang's `ReqKvInfo`)."""

    __hash__ = object.__hash__
    __eq__ = object.__eq__

    @property
    def row(self) -> int | None:
        return releases.req_row(self)

    @property
    def protected(self) -> int:
        return releases.req_protected_len(self)

    # -- 0.5.23's Req methods and fields as the calls read them
    @property
    def full_untruncated_fill_ids(self):
        return self.origin_input_ids + self.output_ids

    def refresh_fill_ids(self) -> None:
        pass

    def finished(self) -> bool:
        return self.done

    def owned_kv_len(self) -> int:
        return self.kv.kv_committed_len


class _Store:
    """The tiered home's pieces around one `PsaRadixCache`, and the scheduler's calls."""

    def __init__(self, pages: int = PAGES, host_blocks: int = HOST_BLOCKS, min_host: int = 0):
        g = torch.Generator().manual_seed(0)
        kv = lambda: torch.randn((pages + 1) * BS, H, D, generator=g)  # noqa: E731
        self.pool = SimpleNamespace(
            k_buffer=[kv() for _ in range(L)], v_buffer=[kv() for _ in range(L)], size=pages * BS
        )
        self.rtp = ReqToTokenPool(ROWS, CTX, "cpu", False)
        self.alloc = PagedTokenToKVPoolAllocator(pages * BS, BS, torch.float32, "cpu", None, False)
        self.pages = pages
        release = self.alloc._release_page_ids

        self.released: list[int] = []  # every page the allocator took back, in order

        def checked(*page_ids):
            for p in page_ids:
                assert not (p == 0).any(), "page 0 reached the allocator"
                self.released += p.tolist()
            release(*page_ids)

        # as served: the allocator hook's `releasable` first (which, with the psa radix
        # cache, drops nothing: every free leaves page-0 blocks out by itself)
        self.alloc._release_page_ids = lambda *p: checked(*self.res.releasable(p))
        self.wb = WriteBack(L, H, D, torch.float32, BS, host_blocks, 12 * BS, "cpu",
                            path="uva", table_shape=(ROWS, CTX // BS))  # fmt: skip
        ws = SimpleNamespace(
            layers=L, kv_heads=H, heat_blocks=CTX // BS, copy_rows=lambda p, r: None
        )
        meta = SimpleNamespace(page_rows=pages + 1)
        cfg = SimpleNamespace(
            block_size=BS, sink_blocks=1, recent_blocks=1, cold_fraction=0.0, unit_cache_ways=8
        )
        rt = self.rtp.req_to_token
        self.res = Residency(self.wb, meta, ws, rt, cfg, self.pool, None)
        self.tiered = TieredRequests(self.wb, self.res, self.pool, rt, BS)
        self.index = self.wb.index = PrefixIndex(self.wb.blocks, BS)
        params = CacheInitParams(
            disable=False, req_to_token_pool=self.rtp, token_to_kv_pool_allocator=self.alloc,
            page_size=BS,
        )  # fmt: skip
        # Every extension from the host tier is taken here (blocks of 4 tokens: the
        # shortest-extension rule has its own test).
        self.cache = PsaRadixCache(params, self.tiered, self.index, min_host_tokens=min_host)
        self.cache.verify = True  # each page-0 answer from host records against the entries
        self.rows = list(range(ROWS - 1, 0, -1))
        self.live: dict[str, SimpleNamespace] = {}  # matched, not released
        self._patches = contextlib.ExitStack()
        if CHECKPOINT:
            # What `release_kv_cache` reads of the server's configuration (published by
            # the launch, which this test does not run): no speculation, no stripping.
            from unittest import mock

            from sglang.srt.mem_cache import common

            for name, bag in (
                ("get_spec", SimpleNamespace(speculative_algorithm=None)),
                ("get_serving", SimpleNamespace(strip_thinking_cache=False)),
            ):
                self._patches.enter_context(mock.patch.object(common, name, lambda b=bag: b))

    # -- SGLang's request and the scheduler's calls ------------------------------------
    def arrive(self, rid: str, prompt: list[int], max_new: int = 4, salt=None) -> _Req:
        req = _Req(
            rid=rid, origin_input_ids=array("q", prompt), output_ids=array("q"),
            extra_key=None, priority=0, last_node=None, input_embeds=None,
            return_logprob=False, logprob_start_len=-1, max_new=max_new, kv_len=0,
            slots=torch.empty(0, dtype=torch.int64), done=False,
        )  # fmt: skip
        if CHECKPOINT:
            from sglang.srt.managers.schedule_batch import ReqKvInfo

            vars(req).update(
                kv=ReqKvInfo(), prefix_len=0, lock=None, cache_salt=salt, extend_end=0,
                skip_radix_cache_insert=False, finished_len=None,
                _compute_max_prefix_len=lambda n: n - 1,
            )  # fmt: skip
        else:  # 0.5.17's tokenizer carries a cache salt in `extra_key`
            vars(req).update(
                extra_key=salt,
                req_pool_idx=None, cache_protected_len=0,
                prefix_indices=torch.empty(0, dtype=torch.int64),
            )  # fmt: skip
        # A chunk's fill ends at the chunk (`fill_end`; SGLang truncates `fill_ids`).
        req.fill_end = None
        req.get_fill_ids = lambda: (req.origin_input_ids + req.output_ids)[: req.fill_end]
        self.live[rid] = req
        return req

    def host_ids(self, tokens: list[int], blocks: int, salt=None) -> list[int]:
        """The index's host ids of the first `blocks` blocks of `tokens` under `salt`."""
        if CHECKPOINT:
            return self.index.lookup(self.index.hashes(None, tokens, blocks, salt=salt))
        return self.index.lookup(self.index.hashes(salt, tokens, blocks))

    def prefix(self, req) -> torch.Tensor:
        """The slots of `req`'s matched prefix, as its allocation writes them into its row
        (0.5.23: `prefix_device_indices`, the tree's path and page-0 entries after it)."""
        if not CHECKPOINT:
            return req.prefix_indices
        if req.row is not None:
            return self.rtp.req_to_token[req.row, : req.prefix_len]
        return self.cache.prefix_device_indices(req)

    def match(self, req) -> int:
        toks = req.get_fill_ids()
        if CHECKPOINT:  # `Req.init_next_round_input`
            from sglang.srt.mem_cache.common import match_kv_cache

            match_kv_cache(req, self.cache, toks, max_prefix_len=len(toks) - 1)
            req.kv.cache_protected_len = req.prefix_len
            self.check()
            return req.prefix_len
        res = self.cache.match_prefix(
            MatchPrefixParams(key=RadixKey(toks, req.extra_key, limit=len(toks) - 1), req=req)
        )
        req.prefix_indices, req.last_node = res.device_indices, res.last_device_node
        req.cache_protected_len = len(req.prefix_indices)
        self.check()
        return len(req.prefix_indices)

    def _set_row(self, req, row) -> None:
        if CHECKPOINT:
            req.kv.req_pool_idx = row
        else:
            req.req_pool_idx = row

    def _set_len(self, req, n: int) -> None:
        """`req`'s KV is `n` tokens, allocated and computed (0.5.23 counts both)."""
        req.kv_len = n
        if CHECKPOINT:
            req.kv.kv_committed_len = req.kv.kv_allocated_len = n

    def admit(self, req, chunk: int | None = None) -> bool:
        """The adder: the host tier's reservation, the lock, a row with the prefix and new
        pages for the rest of its tokens (a retracted request's include its output), or
        for its first `chunk` tokens (chunked prefill: `extend` gives the rest)."""
        n = len(req.get_fill_ids())
        if not self.wb.reserve(req.rid, n + req.max_new):
            return False
        n = min(n, chunk or n)
        req.fill_end = n if chunk else None
        pre = req.prefix_len if CHECKPOINT else len(req.prefix_indices)
        need = -(-(n - pre) // BS) * BS
        if need > self.alloc.available_size():
            self.cache.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        slots = self.alloc.alloc(need)
        if slots is None:
            self.tiered.release(req.rid)
            return False
        if CHECKPOINT:
            req.lock = self.cache.lock(req.last_node)
        else:
            self.cache.inc_lock_ref(req.last_node)
        prefix = self.prefix(req)  # (0.5.23: `alloc_for_extend`, the path read now)
        assert len(prefix) == pre
        self._set_row(req, self.rows.pop())
        row = self.rtp.req_to_token[req.row]
        row[:pre] = prefix
        row[pre:n] = slots[: n - pre]
        req.slots = slots[n - pre :]  # the last page's spare slots
        self._set_len(req, n)
        self.check()
        return True

    def extend(self, req, upto: int) -> None:
        """A chunked prompt's next chunk, up to token `upto`: its row's prefix is what the
        last chunk left (0.5.17: `prefix_indices`, written into the row again), and row
        positions `[kv_len, upto)` get the last page's spare slots, then new pages;
        prefilled and inserted."""
        row = self.rtp.req_to_token[req.row]
        if not CHECKPOINT:
            self.res.sync_prefix(req)  # (as `PSAServing` does before the chunk)
            row[: len(req.prefix_indices)] = req.prefix_indices
        req.fill_end = upto if upto < len(req.origin_input_ids) else None
        need = upto - req.kv_len
        more = -(-max(0, need - len(req.slots)) // BS) * BS
        if more > self.alloc.available_size():
            self.cache.evict(EvictParams(num_tokens=more - self.alloc.available_size()))
        slots = torch.cat([req.slots, self.alloc.alloc(more)]) if more else req.slots
        row[req.kv_len : upto] = slots[:need]
        req.slots = slots[need:]
        self._set_len(req, upto)
        self.check()
        self.prefill(req)

    def insert(self, req) -> None:
        """SGLang caches running `req` (a chunk's end, or after its prefill)."""
        if CHECKPOINT:
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            req.extend_end = req.kv_len
            checkpoint_kv_cache(req, self.cache)
        else:
            self.cache.cache_unfinished_req(req)
        self.check(inserted=req)

    def prefill(self, req, ack: bool = True, insert: bool = True) -> None:
        """The extend of `req` alone (`prefill_batch`)."""
        self.prefill_batch([req], ack, insert)

    def prefill_batch(self, reqs, ack: bool = True, insert: bool = True) -> None:
        """An extend batch: saves planned and issued; blocks adopted beyond the tree's
        pages read from the host tier (the extend hook's part); SGLang then caches each
        request."""
        wb = self.wb
        wb.plan_extend(reqs, [req.kv_len for req in reqs])
        self.res.read_prefix_from_host(reqs)  # as PSAServing.plan_extend calls it
        for req in reqs:
            rec = self.tiered.records.get(req.rid)
            zero = (self.rtp.req_to_token[req.row, : req.kv_len : BS] < BS).nonzero()
            zero = zero.flatten().tolist()
            if zero:  # read from the host tier and off HBM, so staging reads them too
                assert rec.evicted is not None and rec.evicted[zero].all(), (req.rid, zero)
                assert (wb.host_loc[rec.row, zero] < 0).all(), (req.rid, zero)
        wb.before_forward()
        wb.issue_extend(self.pool.k_buffer, self.pool.v_buffer, self.rtp.req_to_token)
        if ack:
            self.ack()
        if insert:
            for req in reqs:
                self.insert(req)

    def decode(self, req, tokens: list[int]) -> None:
        for t in tokens:
            req.output_ids.append(t)
            if req.kv_len % BS == 0:
                page = self.alloc.alloc(BS)
                if page is None:
                    self.cache.evict(EvictParams(num_tokens=BS))
                    page = self.alloc.alloc(BS)
                req.slots = page
            self.rtp.req_to_token[req.row, req.kv_len] = req.slots[0]
            req.slots = req.slots[1:]
            self._set_len(req, req.kv_len + 1)
            self.wb.plan_decode([req], [req.kv_len])
            self.check()
        self.wb.issue_decode(self.pool.k_buffer, self.pool.v_buffer, self.rtp.req_to_token, True)

    def ack(self) -> None:
        wait_saved(self.wb)
        self.check()

    def _release(self, req, insert: bool) -> None:
        """`release_kv_cache`: SGLang caches the request (`insert`) and frees its row."""
        row = req.row
        if CHECKPOINT:
            from sglang.srt.mem_cache.common import release_kv_cache

            release_kv_cache(req, self.cache, checkpoint=insert)
            assert req.row is None and req.lock is None
        else:
            self.cache.cache_finished_req(req, is_insert=insert, kv_len_to_handle=req.kv_len)
            req.req_pool_idx = None
        self.rows.append(row)
        self.alloc.free(req.slots) if len(req.slots) and req.kv_len % BS == 0 else None

    def finish(self, req) -> None:
        """SGLang caches the finished request, frees its row, then the tiered store
        releases it."""
        req.done = True
        self._release(req, insert=True)
        self.tiered.release(req.rid, finished=True)
        del self.live[req.rid]
        self.check()

    def retract(self, req) -> None:
        """SGLang's retraction (`release_kv_cache` uninserted): the tiered store's park,
        SGLang frees what the request holds beyond the tree, the request is released
        (retracted: not finished) and waits with its tokens."""
        assert self.tiered.park(req, self.alloc) == 0  # with the index: nothing parked
        self._release(req, insert=False)
        req.slots = req.slots[:0]
        if CHECKPOINT:  # `Req.reset_for_retract`
            req.prefix_len = req.kv.cache_protected_len = req.kv.cache_inserted_len = 0
            req.kv.kv_committed_len = 0
            req.last_node = None
        else:
            req.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.tiered.release(req.rid)
        self.check()

    def evict(self, tokens: int) -> int:
        free = self.alloc.available_size()
        got = self.cache.evict(EvictParams(num_tokens=tokens)).num_tokens_evicted
        assert self.alloc.available_size() - free == got, "evicted tokens are not HBM slots"
        assert got >= tokens or not self.cache.evictable_leaves
        self.check()
        return got

    # -- the invariants ---------------------------------------------------------------
    def _path(self, node):
        vals, ids = [], []
        while node is not self.cache.root_node:
            vals.append(node.value)
            ids.append(node.psa_host or [None] * (len(node.value) // BS))
            node = node.parent
        vals.reverse()
        ids.reverse()
        flat = [i for part in ids for i in part]
        return (torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)), flat

    def check(self, inserted=None) -> None:
        self.tiered.check_integrity()  # (1) holders, kept, free; reservations
        self.index.check_integrity()  # (2, 5) saved, kept prefix starts
        assert self.index.orphans == 0, "a prefix lost its start before its end"
        self.cache.check_integrity()  # (4, 6) page-0 blocks named; HBM sizes
        rt = self.rtp.req_to_token
        owned: list[int] = []
        for req in self.live.values():
            if req.row is None:
                continue
            row = rt[req.row]
            path, ids = self._path(req.last_node)
            # (3) the row's prefix is the tree's path; page-0 blocks are the request's ids
            assert torch.equal(row[: len(path)], path), f"{req.rid}: row and tree diverge"
            assert (row[len(path) : req.protected] < BS).all()
            rec = self.tiered.records.get(req.rid)
            for b, i in enumerate(ids):
                if i is not None:
                    assert rec is not None and rec.host[b] == i, f"{req.rid}: block {b}"
            if req is inserted and rec is not None:
                hashes = self.index.request_hashes(req.rid, min(len(path) // BS, rec.planned))
                known = self.index.lookup(hashes)
                assert rec.host[: len(known)] == known, f"{req.rid}: a duplicate kept"
            if rec is not None and rec.row is not None:
                # Decode never reads page 0: a block there is read from the host tier.
                full = req.kv_len // BS
                zero = (row[: full * BS : BS] < BS).nonzero().flatten().tolist()
                loc = self.wb.host_loc[req.row]
                assert [int(loc[b]) for b in zero] == [-rec.host[b] - 1 for b in zero], (
                    f"{req.rid}: blocks {zero} at page 0 not read from the host tier"
                )
                # ... and the unit cache may hold their units (else every step reads all
                # of them across PCIe)
                cold = [b for b in zero if not self.res.cache.live[rec.host[b]]]
                assert not cold, f"{req.rid}: blocks {cold} read from the host tier, uncacheable"
            own = row[req.protected : req.kv_len]
            owned += sorted(set((own[own >= BS] // BS).tolist()))
            owned += sorted(set((req.slots // BS).tolist()) - set((own // BS).tolist()))
        tree: list[int] = []
        stack = list(self.cache.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            v = n.value[::BS]
            tree += (v[v >= BS] // BS).tolist()
        if hasattr(self.alloc, "get_all_free_pages"):  # 0.5.23: free and staged
            free = self.alloc.get_all_free_pages().tolist()
        else:
            free = torch.cat([self.alloc.free_pages, self.alloc.release_pages]).tolist()
        every = free + tree + owned
        assert sorted(every) == list(range(1, self.pages + 1)), "a page lost or held twice"
        assert self.cache.evictable_size() + self.cache.protected_size() == len(tree) * BS


@contextlib.contextmanager
def _store(**kw):
    s = _Store(**kw)
    try:
        with s._patches:
            yield s
    finally:
        s.wb.close()


STEM = list(range(100, 112))  # three blocks


def test_a_request_finishing_with_saves_in_flight_keeps_its_blocks_for_the_index():
    """A request that ends while saves it issued are in flight keeps its host blocks,
    rowless and out of the table, until the last is acknowledged: then the index names
    them (kept in the LRU) and a later request with that prefix reads them from the host
    tier. Ended before any ack, nothing of it is indexed yet and nothing is freed."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a, ack=False)
        held = list(s.tiered.records["a"].host)
        s.finish(a)
        assert "a" not in s.tiered.records and s.wb.ending["a"].host == held
        hashes = s.index.hashes(None, STEM + [1, 2, 3, 4], 4)
        assert s.index.lookup(hashes) == [] and (s.wb.blocks.refs[held] == 1).all()
        s.ack()
        assert not s.wb.ending and (s.wb.blocks.refs[held] == 0).all()
        assert s.index.lookup(hashes) == held[:4]  # every full prompt block, kept
        s.evict(10**6)
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9, 9, 9])
        assert s.match(b) == 3 * BS and s.tiered.records["b"].host == held[:3]
        assert s.admit(b)
        s.prefill(b)


def test_with_nothing_saved_a_match_hashes_nothing_then_extends_from_the_index():
    """Before any save is acknowledged (the write-back not started: `--psa-writeback-
    start`) the index is empty: a queued prompt's match, asked every scheduling round, is
    the tree's and hashes none of its blocks. Once a's blocks are acknowledged and HBM let
    them go, b's match hashes its blocks and extends the tree's match from the index."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        for _ in range(3):
            assert s.match(a) == 0
        assert len(s.index) == 0 and s.index._tracked["a"][2] == []  # nothing hashed
        assert s.admit(a)
        s.prefill(a)
        s.finish(a)
        assert len(s.index) == 4
        s.evict(10**6)
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9, 9, 9])
        assert s.match(b) == 3 * BS and len(s.index._tracked["b"][2]) >= 3


def test_before_the_write_back_starts_the_tree_works_as_sglangs_and_then_saves():
    """The write-back not started (`WriteBack.saving` off): requests share a prefix the
    tree holds in HBM, finish, decode and leave HBM with every invariant held after every
    call, and nothing reaches the host tier (a prefix the tree evicted is computed again,
    as plain SGLang does). Started mid-flight, the running request's plans take the
    blocks it filled before, one a plan (the catch-up's share, made small), and a later
    request reads them from the host tier."""
    with _store() as s:
        s.wb.saving = False
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        s.decode(a, [7, 8, 9])
        b = s.arrive("b", STEM + [6, 6, 6, 6, 6])
        assert s.match(b) == 3 * BS and s.admit(b)  # the tree's HBM pages of a's prompt
        s.prefill(b)
        s.finish(a)
        assert s.wb.report()["blocks_planned"] == 0 and len(s.index) == 0
        assert s.wb.blocks.used == 0
        s.finish(b)
        s.evict(10**6)
        c = s.arrive("c", STEM + [1, 2, 3, 4, 5])
        assert s.match(c) == 0  # evicted unsaved: computed again
        assert s.admit(c)
        s.prefill(c)
        s.wb.catch_up_blocks = 1
        s.wb.start(catch_up=True)  # as the pool running short starts it
        s.decode(c, [4] * 6)  # a block a plan, from its first, until none is left behind
        assert not s.wb.catching_up
        s.ack()
        full = (len(c.origin_input_ids) + len(c.output_ids) - 1) // BS  # (the newest's block
        assert s.tiered.records["c"].saved == full == 5  # is written by the next step)
        s.finish(c)
        s.evict(10**6)
        d = s.arrive("d", STEM + [9, 9, 9, 9, 9, 9, 9])
        assert s.match(d) == 3 * BS and s.tiered.records["d"].host  # from the host tier
        assert s.admit(d)
        s.prefill(d)


def test_requests_of_two_cache_salts_share_no_host_block():
    """The same tokens under two cache salts (0.5.23: `Req.cache_salt`, which keys SGLang's
    tree and the index's hashes; 0.5.17 carries a salt in `extra_key`) share nothing: b,
    salted apart from a, matches none of a's blocks, in HBM or in the host tier, and saves
    its own; once HBM let them go, each salt's next request adopts its own salt's host
    blocks, and an unsalted one none."""
    prompt = STEM + [1, 2, 3, 4, 5]
    with _store() as s:
        a = s.arrive("a", prompt, salt="x")
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        b = s.arrive("b", prompt, salt="y")
        assert s.match(b) == 0 and s.admit(b)  # a's pages are in HBM: not b's
        s.prefill(b)
        rec_a, rec_b = s.tiered.records["a"], s.tiered.records["b"]
        assert len(rec_a.host) == len(rec_b.host) == 4 and not set(rec_a.host) & set(rec_b.host)
        assert (s.wb.blocks.refs[rec_a.host + rec_b.host] == 1).all()
        a_ids, b_ids = list(rec_a.host), list(rec_b.host)
        s.finish(a)
        s.finish(b)
        assert s.host_ids(prompt, 4, "x") == a_ids and s.host_ids(prompt, 4, "y") == b_ids
        assert s.host_ids(prompt, 4) == []
        s.evict(10**6)  # host tier only
        for rid, salt, ids in (("c", "y", b_ids), ("d", "x", a_ids)):
            r = s.arrive(rid, prompt, salt=salt)
            assert s.match(r) == 4 * BS and (s.prefix(r) < BS).all()
            assert s.tiered.records[rid].host == ids
        assert (s.wb.blocks.refs[a_ids + b_ids] == 1).all()
        e = s.arrive("e", prompt)
        assert s.match(e) == 0 and "e" not in s.tiered.records
        assert s.admit(s.live["c"]) and s.admit(e)
        s.prefill(s.live["c"])
        s.prefill(e)
        assert not set(s.tiered.records["e"].host) & set(a_ids + b_ids)
        for rid in ("c", "e"):
            s.finish(s.live[rid])
        s.tiered.release("d")
        del s.live["d"]
        s.check()
        assert s.wb.blocks.reserved == 0 and (s.wb.blocks.refs[a_ids + b_ids] == 0).all()


def test_a_chunked_prompt_is_inserted_chunk_by_chunk_over_a_host_only_prefix():
    """b's prompt, prefilled in two chunks ending mid-block, starts with a stem the tree
    let go of HBM (host only, adopted at the match). Each chunk's insert puts its whole
    blocks in the tree (the stem at page 0 with its host ids, b's own blocks in HBM); the
    partial block stays b's, in its row past the tree's part, and the next chunk goes
    on from it. A request arriving between the chunks shares the stem and b's first
    block; after b finishes its blocks are the index's, kept, and nothing is held."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a), s.finish(a)
        s.evict(10**6)
        stem = s.host_ids(STEM, 3)
        b = s.arrive("b", STEM + [9] * 9)
        assert s.match(b) == 3 * BS and s.admit(b, chunk=4 * BS + 2)
        assert (s.prefix(b) < BS).all() and s.tiered.records["b"].host == stem
        s.prefill(b)  # the first chunk, inserted at 16 tokens (18 computed)
        rec_b, row = s.tiered.records["b"], s.rtp.req_to_token[b.row]
        assert b.protected == 4 * BS and rec_b.host[:3] == stem and rec_b.saved == 4
        assert (row[: 3 * BS] < BS).all() and (row[3 * BS : 4 * BS + 2] >= BS).all()
        assert [s.cache._host_nodes[i] for i in stem] == [b.last_node] * 3
        c = s.arrive("c", STEM + [9] * 5)
        assert s.match(c) == 4 * BS and s.tiered.records["c"].host == rec_b.host[:4]
        s.extend(b, len(b.origin_input_ids))  # the second chunk: 21 tokens, 5 blocks
        assert b.protected == 5 * BS and rec_b.saved == 5
        assert (row[3 * BS : 5 * BS + 1] >= BS).all()
        s.decode(b, [7, 7])
        s.ack()
        ids = list(rec_b.host)
        s.finish(b)
        assert s.host_ids(STEM + [9] * 9 + [7, 7], 5) == ids[:5]
        s.tiered.release("c")
        del s.live["c"]
        s.check()
        assert s.wb.blocks.reserved == 0 and (s.wb.blocks.refs[ids] == 0).all()
        assert set(ids[:5]) <= set(s.wb.blocks.lru)


def test_a_retracted_request_frees_its_own_pages_but_none_at_page_0():
    """a's decoded blocks beyond its tree path leave HBM (residency: page 0 in its row);
    retracted, it is released uninserted (0.5.17: `cache_finished_req(is_insert=False)`;
    0.5.23: `release_kv_cache(checkpoint=False)`, whose frees outside the tree go through
    `free_kv_row`): the allocator takes back exactly its pages still in HBM past the tree,
    each once, and never page 0; matched again, its evicted blocks come from the host tier."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5], max_new=40)
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        s.decode(a, list(range(200, 200 + 2 * BS)))  # blocks 4 and 5, beyond the tree
        s.ack()
        rec, row = s.tiered.records["a"], s.rtp.req_to_token[a.row]
        assert a.protected == 4 * BS and rec.saved == 6
        s.released = []
        assert s.res.evict("a", [4], s.alloc) == BS
        assert (row[4 * BS : 5 * BS] < BS).all() and rec.evicted[4]
        own = sorted(set((row[5 * BS : a.kv_len] // BS).tolist()))
        s.released = []
        s.retract(a)
        assert s.released == own, (s.released, own)  # block 5's page and the tail's
        assert s.match(a) == 6 * BS and (s.prefix(a)[: 4 * BS] >= BS).all()
        assert (s.prefix(a)[4 * BS :] < BS).all()
        assert s.admit(a)
        s.prefill(a)
        s.finish(a)


def test_a_retracted_request_is_matched_again_from_the_index_not_parked():
    """With the tree on, retraction parks nothing: the saves in flight land (indexed), the
    request is released, and when admitted again its prompt and decoded blocks are its
    match: from the host tier once HBM let them go."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5], max_new=40)
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a, ack=False)
        s.decode(a, list(range(200, 200 + 2 * BS)))  # two more full blocks, unacked
        s.retract(a)
        assert "a" not in s.tiered.records and not s.tiered.parked("a") and not s.wb.ending
        full = a.kv_len // BS
        hashes = s.index.hashes(None, list(a.get_fill_ids())[: full * BS], full)
        ids = s.index.lookup(hashes)
        assert len(ids) == full  # every full block, prompt and decoded, indexed and kept
        s.evict(10**6)
        assert s.match(a) == full * BS and s.tiered.records["a"].host == ids
        assert (s.prefix(a) < BS).all()  # read from the host tier
        assert s.admit(a)
        s.prefill(a)
        s.decode(a, [7, 7, 7])
        s.ack()
        s.finish(a)


def test_a_request_ending_with_nothing_in_flight_is_released_at_once():
    """No save in flight when it ends: the release is immediate (nothing waits)."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        s.finish(a)
        assert not s.wb.ending and "a" not in s.tiered.records


def test_a_prefix_evicted_from_hbm_is_read_from_the_host_tier_and_shared():
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        s.decode(a, [6, 7, 8])
        s.ack()
        s.finish(a)
        a_ids = s.index.lookup(s.index.hashes(None, STEM + [1, 2, 3, 4], 4))
        assert len(a_ids) == 4  # a's prompt blocks, saved, kept beyond its end
        # HBM runs short: the tree lets every page go; the index keeps the blocks.
        s.evict(10**6)
        assert s.cache.evictable_size() == 0 and s.alloc.available_size() == PAGES * BS
        # b shares the stem: its prefix is a's blocks, read from the host tier (page 0).
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9, 9, 9])
        assert s.match(b) == 3 * BS
        assert (s.prefix(b) < BS).all() and b.last_node is s.cache.root_node
        rec_b = s.tiered.records["b"]
        assert rec_b.host == a_ids[:3] and rec_b.saved == 3
        assert not s.res.cache.live[a_ids].any()  # no one reads them: nothing to cache
        assert s.admit(b)
        s.prefill(b, ack=False)  # its insert puts the stem in the tree at page 0
        # b reads the stem from the host tier: its units may be cached, as an evicted
        # block's (else decode read every one of them across PCIe at every step).
        assert rec_b.host_read == {0, 1, 2} and rec_b.evicted[:3].all()
        assert s.res.cache.live[a_ids[:3]].all() and s.res.left_hbm[a_ids[:3]].all()
        # Four blocks in the tree, three at page 0: the sizes count b's own page only.
        assert s.cache.evictable_size() == 0 and s.cache.protected_size() == BS
        assert super(PsaRadixCache, s.cache).protected_size() == 4 * BS
        s.ack()
        # c arrives while b runs: the tree's path (page 0, then b's own page) is shared.
        c = s.arrive("c", STEM + [9, 9, 9, 9, 1])
        assert s.match(c) == 4 * BS
        assert s.tiered.records["c"].host == s.tiered.records["b"].host[:4]
        assert s.admit(c)
        s.prefill(c)
        s.finish(b)
        assert s.res.cache.live[a_ids[:3]].all()  # c still reads them
        s.finish(c)
        assert not s.res.cache.live[a_ids].any() and not s.res.left_hbm[a_ids].any()
        # The host tier takes the stem back: the tree node naming it at page 0 is cut,
        # its descendant (b's block 3, in HBM) deleted and its page freed.
        assert s.cache._host_nodes
        s.wb.blocks.evict_lru(HOST_BLOCKS)
        s.check()
        assert not s.cache._host_nodes and len(s.index) == 0
        s.evict(10**6)
        assert s.alloc.available_size() == PAGES * BS
        assert s.wb.blocks.used == 0 and s.wb.blocks.reserved == 0


def test_a_flush_drops_the_host_tiers_kept_prefixes_with_the_tree():
    """SGLang's `/flush_cache` (idle: nothing held) resets the tree and the allocator:
    the prefixes the host tier kept go too (stale after a weight update), so a later
    request with the same prefix matches nothing and computes it again; the freed ids
    are not counted as the host tier's evictions, and the store works on afterwards."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        assert s.match(a) == 0 and s.admit(a)
        s.prefill(a)
        s.finish(a)
        s.evict(10**6)
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9, 9, 9])  # the stem read from the host tier
        assert s.match(b) == 3 * BS and s.admit(b)
        s.prefill(b)
        s.finish(b)
        assert len(s.index) >= 4 and s.wb.blocks.cached == len(s.index)
        assert s.cache._host_nodes  # the tree names the stem's host ids at page 0
        s.cache.reset()
        s.alloc.clear()
        assert len(s.index) == 0 and s.wb.blocks.cached == 0 and s.wb.blocks.used == 0
        assert s.wb.blocks.evicted == 0 and not s.cache._host_nodes
        assert s.wb.blocks.available == HOST_BLOCKS
        s.check()
        c = s.arrive("c", STEM + [9, 9, 9, 9, 9, 9, 9])
        assert s.match(c) == 0
        assert s.admit(c)
        s.prefill(c)
        s.finish(c)
        assert len(s.index) == 4  # c's own prompt blocks, saved and kept


@pytest.mark.parametrize("hbm_blocks", [0, 2])
def test_a_host_tier_run_shorter_than_the_minimum_is_computed_again(hbm_blocks):
    """With `min_host_tokens` of 3 blocks: a stem of 3 saved blocks whose first
    `hbm_blocks` stayed in HBM extends b's match by 3 blocks (taken: read from the host
    tier) or by 1 (declined: b computes that block again, counted once however often b is
    matched, holds no extra host id, and its duplicate switches to the index's id at its
    insert)."""
    with _store(min_host=3 * BS) as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a), s.finish(a)
        a_ids = s.index.lookup(s.index.hashes(None, STEM, 3))
        if hbm_blocks:  # z shares the first two blocks: the tree splits there
            z = s.arrive("z", STEM[: 2 * BS] + [50] * 5)
            s.match(z), s.admit(z), s.prefill(z), s.finish(z)
            s.evict(3 * BS)  # the two leaves go, the first two blocks stay in HBM
        else:
            s.evict(10**6)
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9])
        declined = hbm_blocks > 0
        want = hbm_blocks if declined else 3
        assert s.match(b) == want * BS and s.match(b) == want * BS  # matched twice
        assert (s.prefix(b) < BS).sum() == (0 if declined else 3 * BS)
        assert s.tiered.records["b"].host == a_ids[:want]
        assert s.tiered.host_match_recomputed_tokens == (BS if declined else 0)
        assert s.tiered.report()["host_match_recomputed_tokens"] == (BS if declined else 0)
        assert s.admit(b)
        s.prefill(b)  # b computes what it did not take; its insert switches it
        assert s.tiered.records["b"].host[:3] == a_ids
        s.finish(b)


@pytest.mark.parametrize("hbm_blocks", [0, 1])
def test_a_refused_adoption_cuts_the_match_before_the_host_tier(hbm_blocks):
    """The stem waits in the tree with its host blocks kept, unheld, its first
    `hbm_blocks` in HBM and the rest at page 0; with every host block promised
    elsewhere, reviving them is refused: the match stops before the first block at page 0,
    and a later round, with room, adopts the whole prefix."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a), s.finish(a)
        a_ids = s.index.lookup(s.index.hashes(None, STEM, 3))
        if hbm_blocks:  # z shares the first block: the tree splits there
            z = s.arrive("z", STEM[:BS] + [50] * 5)
            s.match(z), s.admit(z), s.prefill(z), s.finish(z)
            s.evict(4 * BS)  # the two leaves go, the first block stays in HBM
        else:
            s.evict(10**6)
        b = s.arrive("b", STEM + [9, 9, 9, 9, 9])
        assert s.match(b) == 3 * BS and s.admit(b)
        assert (s.prefix(b)[hbm_blocks * BS :] < BS).all()
        assert (s.prefix(b)[: hbm_blocks * BS] >= BS).all()
        s.prefill(b)
        s.finish(b)
        assert len(s.cache._host_nodes) == 3 - hbm_blocks and s.wb.blocks.cached >= 3
        assert s.wb.reserve("x", s.wb.blocks.available * BS)  # every block promised
        c = s.arrive("c", STEM + [9, 9, 9, 9, 7])
        assert s.match(c) == hbm_blocks * BS and "c" not in s.tiered.records
        s.tiered.release("x")
        assert s.match(c) == 4 * BS and s.tiered.records["c"].host[:3] == a_ids
        s.tiered.release("c")
        del s.live["c"]
        s.check()


def _both_compute_the_stem(s):
    """Requests e and f over the same stem, both matched (nothing cached) and admitted
    before either prefilled: both compute the stem."""
    e = s.arrive("e", STEM + [5, 5])
    f = s.arrive("f", STEM + [6, 6])
    for r in (e, f):
        assert s.match(r) == 0 and s.admit(r)
    return e, f


def test_duplicate_blocks_switch_to_the_indexed_ids():
    """e and f both computed the stem; e's saves are acknowledged first. At f's insert
    SGLang frees f's duplicate pages and rewrites its row with e's; f's host blocks switch
    to e's indexed ids and its own go free, their late acknowledgements ignored."""
    with _store() as s:
        e, f = _both_compute_the_stem(s)
        s.prefill(e)  # acknowledged: e's blocks are the index's
        s.prefill(f, ack=False, insert=False)
        rec_e, rec_f = s.tiered.records["e"], s.tiered.records["f"]
        own = list(rec_f.host)
        assert len(own) == 3 and not set(own) & set(rec_e.host)
        s.insert(f)
        assert rec_f.host == rec_e.host[:3] and (s.wb.blocks.refs[rec_e.host[:3]] == 2).all()
        assert (s.wb.blocks.refs[own] == 0).all()
        s.ack()  # f's saves to its old ids complete: ignored
        assert not s.wb.blocks.saved[own].any() and rec_f.saved == 3
        s.finish(f)
        s.finish(e)
        s.evict(10**6)
        assert s.alloc.available_size() == PAGES * BS


@pytest.mark.parametrize("end", ["retract", "finish"])
def test_a_released_request_switches_its_duplicates_so_its_own_blocks_enter_the_index(end):
    """e and f computed the stem in one batch, both inserted before any save of theirs
    landed; the one whose stem the index did not take (x) keeps its duplicates past its
    last insert, and its decoded blocks chain on them. Released, retracted (uninserted)
    or finished (inserted), x's duplicates switch to the index's ids first, so its own
    saved blocks enter the index after them: matched again, its whole history (or, for a
    later request, its tokens) comes from the host tier."""
    with _store() as s:
        e, f = _both_compute_the_stem(s)
        s.prefill_batch([e, f], ack=False)  # one batch, both inserted
        assert s.host_ids(STEM, 1) == []  # before any save landed
        s.decode(e, [1, 2, 3, 4, 5, 6, 7])  # blocks 3 and 4 complete
        s.decode(f, [1, 2, 3, 4, 5, 6, 7])
        s.ack()
        stem = s.host_ids(STEM, 3)
        assert len(stem) == 3
        x = next(r for r in (e, f) if s.tiered.records[r.rid].host[:3] != stem)
        toks = list(x.get_fill_ids())
        assert len(s.host_ids(toks, 5)) == 3  # its own blocks wait behind its duplicates
        other = f if x is e else e
        if end == "retract":
            s.retract(x)
        else:
            s.finish(x)
            x = s.arrive("y", toks)
        ids = s.host_ids(toks, 5)
        assert ids[:3] == stem and len(ids) == 5
        s.finish(other)
        s.evict(10**6)
        assert s.match(x) == 5 * BS and s.tiered.records[x.rid].host == ids
        s.tiered.release(x.rid)
        del s.live[x.rid]
        s.check()


def test_a_prefix_read_from_the_host_tier_takes_the_pages_another_request_computed():
    """b matched the stem in the host tier only (page 0 in its row) while f, admitted
    before the stem was cached, computes it: f's insert puts the stem in the tree with
    f's pages; b's insert finds them and its row's prefix becomes the tree's (f's pages),
    no longer read from the host tier."""
    with _store() as s:
        e, f = _both_compute_the_stem(s)
        s.prefill(e)
        s.finish(e)
        s.evict(10**6)  # the stem: host tier only
        stem = s.host_ids(STEM, 3)
        b = s.arrive("b", STEM + [9] * 5)
        assert s.match(b) == 3 * BS and s.tiered.records["b"].host == stem
        s.prefill(f)  # f's duplicates switch to the stem's ids
        assert s.tiered.records["f"].host[:3] == stem
        assert s.admit(b)
        assert (s.prefix(b) < BS).all()  # matched before f's insert: page 0
        s.prefill(b)
        row = s.rtp.req_to_token[b.row]
        pages = s.rtp.req_to_token[f.row, : 3 * BS]
        assert torch.equal(row[: 3 * BS], pages) and (pages >= BS).all()
        s.finish(b)
        s.finish(f)


def test_acks_after_the_insert_switch_at_the_next_insert():
    """f's duplicates acknowledged before e's: f's blocks are indexed first; e switches at
    its next insert (a chunk)."""
    with _store() as s:
        e, f = _both_compute_the_stem(s)
        s.prefill(f)
        s.prefill(e)
        rec_e, rec_f = s.tiered.records["e"], s.tiered.records["f"]
        assert rec_e.host[:3] == rec_f.host[:3]
        s.decode(e, [1, 2, 3])
        s.ack()
        s.insert(e)
        s.finish(e)
        s.finish(f)


def _scheduler(waiting, tree_cache, **kw):
    """What SGLang's `Scheduler.abort_request`, `_abort_on_queued_limit` and (0.5.17)
    `_abort_on_waiting_timeout` / (0.5.23) `_poll_timeout_aborts` read of their scheduler
    (no disaggregation, one pipeline stage, nothing running); 0.5.23's own
    `send_abort_output` and `_release_aborted_request`."""
    import types

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler

    sent = []
    sched = SimpleNamespace(
        waiting_queue=list(waiting), chunked_req=None, running_batch=None, last_batch=None,
        enable_hicache_storage=False, enable_hierarchical_cache=False,
        disaggregation_mode=DisaggregationMode.NULL, dllm_config=None,
        grammar_manager=SimpleNamespace(abort_requests=lambda r: None),
        ps=SimpleNamespace(pp_size=1), sent=sent,
        ipc_channels=SimpleNamespace(
            send_to_tokenizer=SimpleNamespace(send_output=lambda out, req: sent.append(req.rid))
        ),
        tree_cache=tree_cache, mm_receiver=None, rust_server=None,
        beam_coordinator=SimpleNamespace(retire_group=lambda r: None),
        collect_inflight_reqs=lambda: [],
        **kw,
    )  # fmt: skip
    if CHECKPOINT:
        for name in ("send_abort_output", "_release_aborted_request"):
            setattr(sched, name, types.MethodType(getattr(Scheduler, name), sched))
    return sched


def test_matched_requests_dropped_from_the_waiting_queue_are_released(monkeypatch):
    """Requests matched against the stem (host-only: each adopts its host blocks) leave
    SGLang's waiting queue unadmitted, through SGLang's own abort, waiting timeout and
    full-queue paths wrapped in the plugin's hooks: each is released (its holds return to
    the LRU, the index stops tracking it, its row is not looked at for page 0); those
    still waiting keep theirs."""
    from sglang.srt.managers.scheduler import Scheduler

    from sglang_psa.config import PSAConfig
    from sglang_psa.plugin import scheduling
    from sglang_psa.sched import process
    from sglang_psa.sched.serving import PSAServing

    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a), s.finish(a)
        s.evict(10**6)  # the stem is in the host tier only, kept
        stem = s.index.lookup(s.index.hashes(None, STEM, 3))
        assert len(stem) == 3 and set(stem) <= set(s.wb.blocks.lru)
        serving = PSAServing(
            PSAConfig(), layers=L, kv_heads=H, hbm_units=10**6, host_tokens=HOST_BLOCKS * BS,
            writeback=s.wb, residency=s.res, requests=s.tiered,
        )  # fmt: skip
        process.register(SimpleNamespace(serving=serving))
        try:
            reqs = {}
            for rid in ("b", "c", "d", "e", "f"):
                reqs[rid] = r = s.arrive(rid, STEM + [ord(rid)] * 3)
                r.mamba_pool_idx, r.priority = None, 0
                r.session = r.cache_request_handle = None  # (what 0.5.23's abort reads)
                r.weight_version_events = []
                r.release_mm_inputs_on_abort = lambda: None
                r.time_stats = SimpleNamespace(
                    wait_queue_entry_time=1.0,
                    trace_ctx=SimpleNamespace(abort=lambda **kw: None),
                )
                assert s.match(r) == 3 * BS and (s.prefix(r) < BS).all()
            assert (s.wb.blocks.refs[stem] == 5).all() and not set(stem) & set(s.wb.blocks.lru)
            assert {"b", "c", "d", "e", "f"} <= s.cache._maybe_page0

            def gone(*rids):
                for rid in rids:
                    assert rid not in s.tiered.records and rid not in s.index._tracked
                    assert rid not in s.cache._maybe_page0
                    del s.live[rid]
                s.check()

            if CHECKPOINT:  # the abort's report to the tokenizer (`_make_abort_req`)
                monkeypatch.setattr(
                    "sglang.srt.managers.scheduler.get_serving",
                    lambda: SimpleNamespace(weight_version="default"),
                )
            sched = _scheduler(reqs.values(), s.cache, max_queued_requests=4,
                               enable_priority_scheduling=True,
                               schedule_low_priority_values_first=True)  # fmt: skip
            # abort_request pops "b" from the queue.
            scheduling.around_abort_request(
                Scheduler.abort_request,
                sched,
                SimpleNamespace(rid="b", abort_all=False, finished_reason=None),
            )
            assert sched.sent == ["b"] and reqs["b"] not in sched.waiting_queue
            gone("b")
            assert (s.wb.blocks.refs[stem] == 4).all()
            # "c" waited past SGLANG_REQ_WAITING_TIMEOUT; the others arrived just now.
            import time

            monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "0.001")
            reqs["c"].time_stats.wait_queue_entry_time = 1e-9
            for rid in "def":
                reqs[rid].time_stats = SimpleNamespace(
                    wait_queue_entry_time=time.perf_counter() + 1000,
                    trace_ctx=reqs["c"].time_stats.trace_ctx,
                )
            if CHECKPOINT:  # 0.5.23: the timeout is an abort
                for abort in Scheduler._poll_timeout_aborts(sched):
                    scheduling.around_abort_request(Scheduler.abort_request, sched, abort)
            else:
                scheduling.around_abort_on_waiting_timeout(
                    Scheduler._abort_on_waiting_timeout, sched
                )
            assert [r.rid for r in sched.waiting_queue] == ["d", "e", "f"]
            gone("c")
            # A full queue: "d", the least preferred, is pushed out by a new request of a
            # higher priority; then "f" (taken out to come back, as a retracted request
            # does) is refused.
            sched.max_queued_requests = 3
            new = SimpleNamespace(rid="g", priority=-1, time_stats=reqs["b"].time_stats)
            reqs["d"].priority = 1
            assert not scheduling.around_abort_on_queued_limit(
                Scheduler._abort_on_queued_limit, sched, new
            )
            assert [r.rid for r in sched.waiting_queue] == ["e", "f"]
            gone("d")
            sched.waiting_queue.append(new)
            sched.waiting_queue.remove(reqs["f"])
            sched.max_queued_requests = 2
            assert scheduling.around_abort_on_queued_limit(
                Scheduler._abort_on_queued_limit, sched, reqs["f"]
            )
            gone("f")
            # "e" still waits with its prefix; admitted, it runs and finishes as usual.
            assert s.tiered.records["e"].host == stem and (s.wb.blocks.refs[stem] == 1).all()
            assert s.admit(reqs["e"])
            s.prefill(reqs["e"])
            s.finish(reqs["e"])
            assert set(stem) <= set(s.wb.blocks.lru) and s.wb.blocks.reserved == 0
            assert not s.index._tracked and not s.cache._maybe_page0
        finally:
            process.register(None)


def test_residency_evicts_a_shared_block_for_every_holder():
    """a and b share a's prompt through the tree (one page per block, both rows and the
    tree name it, both hold its host id). Residency gives back the pages of blocks 1 and
    2: both requests read them from the host tier (location table, request-table entries
    at page 0, `evicted`), the tree's entries go to page 0 with their host ids, the
    allocator takes each page back once. A block of b's own (beyond the tree) leaves for
    b alone; at b's insert its node names it at page 0."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a)
        b = s.arrive("b", STEM + [1, 2, 3, 4] + [9] * 9)
        assert s.match(b) == 4 * BS and s.admit(b)
        s.prefill(b)
        rec_a, rec_b = s.tiered.records["a"], s.tiered.records["b"]
        assert rec_a.host[:4] == rec_b.host[:4]
        rt = s.rtp.req_to_token
        pages = (rt[a.row, [BS, 2 * BS]] // BS).tolist()
        assert pages == (rt[b.row, [BS, 2 * BS]] // BS).tolist() and min(pages) > 0
        free, s.released = s.alloc.available_size(), []
        assert s.res.evict("a", [1, 2], s.alloc) == 2 * BS
        s.check()
        assert sorted(s.released) == sorted(pages), "a shared page freed other than once"
        assert s.alloc.available_size() == free + 2 * BS
        ids = rec_a.host[1:3]
        for req in (a, b):
            rec = s.tiered.records[req.rid]
            row = rt[req.row]
            assert (row[BS : 3 * BS] < BS).all() and (row[:BS] >= BS).all()
            assert s.wb.host_loc[req.row, 1:3].tolist() == [-i - 1 for i in ids]
            assert s.wb.host_loc[req.row, 0] == 0
            assert rec.evicted[1:3].all() and not rec.evicted[0] and not rec.evicted[3:].any()
        assert {s.cache._host_nodes[i] for i in ids} == {a.last_node}
        assert s.res.left_hbm[ids].all() and s.res.evictions == 2
        assert {"a", "b"} <= s.cache._maybe_page0
        # Evicting them again (for b) frees nothing.
        assert s.res.evict("b", [1, 2], s.alloc) == 0 and not s.released[4:]
        # b's block 6, written by decode (saved, beyond the tree): b's alone.
        s.decode(b, [7, 7, 7, 7])
        s.ack()
        assert rec_b.saved == 7 and b.protected == 6 * BS
        own = int(rt[b.row, 6 * BS]) // BS
        s.released = []
        assert s.res.evict("b", [6], s.alloc) == BS and s.released == [own]
        s.check()
        assert rec_b.evicted[6] and (rec_a.evicted is None or not rec_a.evicted[4:].any())
        s.insert(b)  # b's tail enters the tree, block 6 at page 0
        assert s.cache._host_nodes[rec_b.host[6]] is b.last_node
        assert len(b.last_node.key) == BS and s.released == [own]
        s.decode(a, [5])
        s.finish(a)
        s.finish(b)
        assert (s.wb.blocks.refs[rec_a.host] == 0).all() and s.wb.blocks.reserved == 0
        s.wb.blocks.evict_lru(HOST_BLOCKS)  # the host tier takes them back: the tree is cut
        s.check()
        s.evict(10**6)
        assert s.alloc.available_size() == PAGES * BS and not s.cache._host_nodes


@pytest.mark.parametrize("order", ["ab", "ba"])
def test_one_eviction_of_several_requests_equals_evicting_them_in_turn(order):
    """A decode round's victims leave HBM in one call (`Residency.evict_many`): where a
    and b share blocks 1-2 through the tree and b has its own blocks 4-5, evicting both
    requests' blocks at once gives the tables, location tables, pages freed (each once),
    `evicted` flags and the tree's page-0 entries of evicting one request's, then the
    other's."""
    wanted = {"a": [1, 2], "b": [1, 2, 4, 5]}
    wanted = {rid: wanted[rid] for rid in order}
    with _store() as one, _store() as turn:
        for s in (one, turn):
            a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
            s.match(a), s.admit(a), s.prefill(a)
            b = s.arrive("b", STEM + [1, 2, 3, 4] + [9] * 9)
            assert s.match(b) == 4 * BS and s.admit(b)
            s.prefill(b)
            s.ack()
            assert s.tiered.records["b"].saved == 6
            s.released = []
        got = one.res.evict_many(wanted, one.alloc)
        want = sum(turn.res.evict(rid, bl, turn.alloc) for rid, bl in wanted.items())
        one.check(), turn.check()
        assert got == want == 4 * BS  # blocks 1-2 once (for both), b's 4-5
        assert len(set(one.released)) == 4 and sorted(one.released) == sorted(turn.released)
        assert torch.equal(one.rtp.req_to_token, turn.rtp.req_to_token)
        assert torch.equal(one.wb.host_loc, turn.wb.host_loc)
        for rid in "ab":
            assert (one.tiered.records[rid].evicted == turn.tiered.records[rid].evicted).all()
        assert (one.res.left_hbm == turn.res.left_hbm).all()
        assert sorted(one.cache._host_nodes) == sorted(turn.cache._host_nodes)
        assert one.res.evictions == turn.res.evictions == 4
        assert one.alloc.available_size() == turn.alloc.available_size()


def test_many_blocks_of_one_tree_node_leave_hbm_in_one_write():
    """Nine blocks of a prompt the tree holds in one node leave HBM at once (as a new
    chunk's room is made): the node's entries of exactly those blocks go to page 0 (one
    indexed write, `_SLICE_WRITES`), the row equals the tree's path (`check`), the rest
    keep their pages."""
    with _store() as s:
        a = s.arrive("a", list(range(500, 500 + 14 * BS)) + [1, 2])
        s.match(a), s.admit(a), s.prefill(a)
        s.ack()
        node = a.last_node
        assert s.tiered.records["a"].saved == 14 and len(node.key) == 14 * BS
        before = node.value.clone()
        gone = [1, 2, 3, 5, 6, 8, 9, 11, 12]
        assert len(gone) > psa_radix_cache._SLICE_WRITES
        assert s.res.evict("a", gone, s.alloc) == len(gone) * BS
        s.check()
        for b in range(14):
            got = node.value[b * BS : (b + 1) * BS]
            want = torch.arange(BS) if b in gone else before[b * BS : (b + 1) * BS]
            assert torch.equal(got, want.to(got.dtype)), b


def test_a_host_run_the_tree_holds_at_page_0_is_computed_again_into_the_tree():
    """With a minimum above every host run: a and b share a's prompt through the tree,
    residency takes blocks 1 and 2 off HBM (the tree's entries at page 0), both finish. c's
    match stops before block 1 (the run is computed again, counted); c's insert gives the
    tree c's pages for blocks 1 and 2 (nothing at page 0 is left, c's pages are not freed
    as duplicates, c holds the index's host ids), and d then matches the whole prompt in
    HBM."""
    with _store(min_host=100 * BS) as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a)
        b = s.arrive("b", STEM + [1, 2, 3, 4] + [9] * 9)
        assert s.match(b) == 4 * BS and s.admit(b)
        s.prefill(b)
        ids = s.tiered.records["a"].host[:4]
        assert s.res.evict("a", [1, 2], s.alloc) == 2 * BS
        s.finish(a), s.finish(b)
        assert set(ids[1:3]) <= set(s.cache._host_nodes)
        c = s.arrive("c", STEM + [1, 2, 3, 4] + [8] * 9)
        assert s.match(c) == BS  # block 0 in HBM; the run from block 1 is computed again
        assert s.tiered.host_match_recomputed_tokens > 0 and (s.prefix(c) >= BS).all()
        assert s.admit(c)
        s.released = []
        s.prefill(c)  # (inserted: `prefill` checks the invariants after every call)
        rt = s.rtp.req_to_token
        mine = (rt[c.row, BS : 3 * BS : BS] // BS).tolist()
        assert not set(ids[1:3]) & set(s.cache._host_nodes), "still at page 0 in the tree"
        assert not set(mine) & set(s.released), "a page the tree took was freed"
        assert s.tiered.records["c"].host[:4] == ids
        assert s.tiered.report()["host_match_taken_tokens"] == 2 * BS
        assert not s.wb.host_loc[c.row, :4].any()  # c reads them from HBM
        d = s.arrive("d", STEM + [1, 2, 3, 4] + [7] * 9)
        assert s.match(d) >= 4 * BS and (s.prefix(d)[: 4 * BS] >= BS).all()
        assert (s.prefix(d)[BS : 3 * BS : BS] // BS).tolist() == mine
        assert s.admit(d)
        s.prefill(d)
        s.finish(c), s.finish(d)
        s.check()


def test_a_switched_block_that_left_hbm_moves_its_units():
    """f computed the stem after e (e's ids indexed, f's acknowledged duplicates), and its
    block 1 left HBM before its insert: the insert switches it to e's id; the unit cache
    forgets f's old id (free again) and may hold e's id's units (off HBM for f)."""
    with _store() as s:
        e, f = _both_compute_the_stem(s)
        s.prefill(e)
        s.prefill(f, insert=False)
        rec_e, rec_f = s.tiered.records["e"], s.tiered.records["f"]
        own = rec_f.host[1]
        assert rec_f.saved == 3 and own != rec_e.host[1]
        assert s.res.evict("f", [1], s.alloc) == BS
        live = s.res.cache.live
        assert s.res.left_hbm[own] and live[own] == 1
        s.insert(f)
        new = rec_f.host[1]
        assert new == rec_e.host[1] and s.wb.blocks.refs[own] == 0
        assert not s.res.left_hbm[own] and live[own] == 0
        assert s.res.left_hbm[new] and live[new] == 1 and rec_f.evicted[1]
        assert s.wb.host_loc[f.row, 1] == -new - 1
        s.finish(f)
        s.finish(e)


def test_residency_keeps_a_shared_page_a_waiting_match_names():
    """c was matched through a's node but not admitted (its prefix names the page), and a
    lock the holders do not account for (the adder's own) holds it too: the page stays."""
    with _store() as s:
        a = s.arrive("a", STEM + [1, 2, 3, 4, 5])
        s.match(a), s.admit(a), s.prefill(a)
        c = s.arrive("c", STEM + [1, 2, 3, 4, 6])
        assert s.match(c) == 4 * BS
        assert s.res.evict("a", [1, 2], s.alloc) == 0
        s.check()
        s.tiered.release("c")
        del s.live["c"]
        s.cache.inc_lock_ref(a.last_node)  # a lock of no holder
        assert s.res.evict("a", [1, 2], s.alloc) == 0
        s.cache.dec_lock_ref(a.last_node)
        assert s.res.evict("a", [1, 2], s.alloc) == 2 * BS
        s.check()
        s.finish(a)


@pytest.mark.parametrize(
    "seed, residency, min_host, late",
    [(seed, residency, 0, None) for seed in range(4) for residency in (False, True)]
    + [(seed, True, 3 * BS, None) for seed in (4, 6, 9, 11)]
    + [(seed, True, 0, 5) for seed in (12, 14, 15, 16)],
)
def test_random_requests_sharing_prefixes_keep_the_invariants(seed, residency, min_host, late):
    """Requests over three stems, admitted before earlier ones prefilled (duplicates to
    switch), HBM and the host tier both short (tree nodes evicted, kept blocks taken back
    and the tree cut), acknowledgements late or early, running requests retracted and
    matched again, long prompts prefilled in chunks ending anywhere (inserted chunk by
    chunk); with `residency`, saved blocks of running and chunked requests leave HBM too
    (shared ones for every holder, each page freed once); with `min_host`, host runs
    shorter than it are computed again and the tree takes their pages at the insert; with
    `late`, the write-back starts at that step (`--psa-writeback-start`) and catches up a
    block a plan."""
    rng, more = random.Random(seed), random.Random(-seed)
    stems = [[rng.randrange(1000) for _ in range(3 * BS)] for _ in range(3)]
    with _store(pages=24, host_blocks=16, min_host=min_host) as s:
        if late is not None:
            s.wb.saving, s.wb.catch_up_blocks = False, 1
        waiting: list = []
        admitted: list = []
        running: list = []
        chunking: list = []  # prefilled up to a chunk's end, more to come
        evicted = chunks = 0
        for step in range(150):
            if step == late:
                s.wb.start(catch_up=True)
            op = rng.choice(
                ["arrive", "admit", "prefill", "decode", "finish", "retract", "evict", "host"]
                + ["ack", "chunk"]
                + ["resid"] * 2 * residency
            )
            if op == "arrive" and len(waiting) < 3:
                stem = rng.choice(stems)[: rng.choice([BS, 2 * BS, 3 * BS])]
                tail = [rng.randrange(1000) for _ in range(rng.randint(1, 2 * BS))]
                waiting.append(s.arrive(f"r{step}", stem + tail, max_new=rng.randint(1, 6)))
            elif op == "admit" and waiting and s.rows:
                req = waiting[0]
                pre, n = s.match(req), len(req.get_fill_ids())
                cut = rng.random() < 0.3 and not req.output_ids and n - pre > BS + 1
                if s.admit(req, chunk=rng.randint(pre + 1, n - 1) if cut else None):
                    admitted.append(waiting.pop(0))
            elif op == "prefill" and admitted:
                req = admitted.pop(rng.randrange(len(admitted)))
                s.prefill(req, ack=rng.random() < 0.5)
                (running if req.fill_end is None else chunking).append(req)
            elif op == "chunk" and chunking:
                req = chunking.pop(rng.randrange(len(chunking)))
                full = len(req.origin_input_ids)
                s.extend(req, min(full, req.kv_len + rng.randint(1, 2 * BS)))
                (running if req.fill_end is None else chunking).append(req)
                chunks += 1
            elif op == "decode" and running:
                req = rng.choice(running)
                if len(req.output_ids) < req.max_new:
                    s.decode(req, [rng.randrange(1000)])
            elif op == "finish" and running:
                s.finish(running.pop(rng.randrange(len(running))))
            elif op == "retract" and running:  # it waits again, to be matched anew
                req = running.pop(rng.randrange(len(running)))
                s.retract(req)
                waiting.append(req)
            elif op == "evict":
                s.evict(rng.randint(1, 3) * BS)
            elif op == "host":  # the host tier needs room: the oldest kept blocks go
                s.wb.blocks.evict_lru(rng.randint(1, 3))
                s.check()
            elif op == "ack":
                s.ack()
            elif op == "resid" and running + chunking:
                # a decode round's victims: blocks of one request, and of others drawn
                # apart (`more`), all in one call
                wanted, live = {}, running + chunking
                req = rng.choice(live)
                for r in [req] + more.sample(live, len(live) - 1):
                    rec = s.tiered.records.get(r.rid)
                    if r.rid not in wanted and rec is not None and rec.saved:
                        draw = rng if r is req else more
                        blocks = draw.sample(range(rec.saved), draw.randint(1, rec.saved))
                        wanted[r.rid] = sorted(blocks)
                if wanted:
                    free, s.released = s.alloc.available_size(), []
                    got = s.res.evict_many(wanted, s.alloc)
                    assert len(s.released) == len(set(s.released)) == got // BS
                    assert s.alloc.available_size() - free == got
                    evicted += got // BS
                    s.check()
        for req in admitted:
            s.prefill(req)
            (running if req.fill_end is None else chunking).append(req)
        for req in chunking:
            s.extend(req, len(req.origin_input_ids))
            running.append(req)
        for req in running:
            s.finish(req)
        for req in waiting:  # matched, never admitted: their adopted prefixes go back
            s.tiered.release(req.rid)
            del s.live[req.rid]
        s.ack()  # a finished request's saves in flight hold its blocks until they land
        s.wb.blocks.evict_lru(16)
        s.check()
        assert s.wb.blocks.used == 0 and not s.cache._host_nodes
        s.evict(10**6)
        assert s.alloc.available_size() == 24 * BS
        assert bool(evicted) == residency, "residency evicted nothing"
        assert chunks, "no prompt was prefilled in chunks"
        # with a minimum, host runs were cut from matches and computed again
        assert bool(s.tiered.host_match_recomputed_tokens) == bool(min_host)


def test_the_backend_registers_with_sglang():
    from sglang.srt.mem_cache import registry

    psa_radix_cache.register()
    psa_radix_cache.register()  # once
    assert registry.get_radix_cache_factory("psa") is psa_radix_cache.factory
    with pytest.raises(ValueError, match="psa-kv-home tiered"):
        psa_radix_cache.factory(SimpleNamespace(params=None))


def test_the_factory_takes_the_host_prefix_minimum_from_the_flag(monkeypatch):
    """`--psa-host-prefix-min-tokens` reaches the tree SGLang builds through its factory
    (what the minimum does: `test_a_host_tier_run_shorter_than_the_minimum_is_computed_again`);
    without it the tree keeps the config's default."""
    from sglang_psa.config import PSAConfig
    from sglang_psa.sched import process

    cfg = PSAConfig(kv_home="tiered", host_prefix_min_tokens=3 * BS)
    with _store() as s:
        monkeypatch.setattr(process, "current", lambda: SimpleNamespace(requests=s.tiered, cfg=cfg))
        cache = psa_radix_cache.factory(SimpleNamespace(params=_params(s)))
        assert isinstance(cache, PsaRadixCache) and cache.min_host_tokens == 3 * BS
        assert PsaRadixCache(_params(s), s.tiered, s.index).min_host_tokens == 512


def _params(s):
    return CacheInitParams(
        disable=False, req_to_token_pool=s.rtp, token_to_kv_pool_allocator=s.alloc, page_size=BS
    )


def test_overrides_match_sglang_radix_cache():
    """Each override takes what SGLang's method takes (the hook table's check)."""
    import inspect

    from sglang.srt.mem_cache.radix_cache import RadixCache

    for name, params in psa_radix_cache.OVERRIDES[releases.release()]:
        theirs = list(inspect.signature(getattr(RadixCache, name)).parameters)
        ours = list(inspect.signature(getattr(PsaRadixCache, name)).parameters)
        assert theirs == list(params), (name, theirs)
        assert ours[: len(params)] == list(params), (name, ours)
