"""HBM residency of the tiered home: saved blocks give their HBM page back when HBM runs short.

`--psa-kv-home tiered` writes every full block to the host tier (`writeback`).
When SGLang's allocator runs short (a queued prompt does not fit, or a decode
step needs pages), the scheduler hooks call `Residency.make_room`: it picks
saved blocks of running (decoding) requests, switches decode to their host
copies and hands their pages back to SGLang's allocator. Capacity is then the
host tier's; decode reads the evicted blocks it selects across PCIe.

What one eviction does, all on the scheduler's stream (ordered before the next
forward, which waits for that stream), with no host sync:
1. the request's location table (`WriteBack.host_loc`) sends the wave kernel to
   the host copy of each block (only acknowledged saves qualify);
2. the block's last-read stamps move from its page row to the host block's row
   (`PageMeta`/`ReadStamps` keep `pages + host blocks` rows: a block is scored and
   stamped wherever its KV lives; its metadata is there since its save, `WriteBack`);
3. its request-table entries point at page 0 (SGLang's padding page, never
   allocated): nothing reads them, and the allocator hook
   (`plugin.scheduling.around_release_page_ids`) drops page 0 from the
   request's eventual free;
4. the page goes back to SGLang's allocator (`free_segment`: fixed shape, no sync).
A forward already launched reads either copy: both hold the same KV until a
later forward, ordered after these writes, writes the page again.

Victims: the saved blocks of the running requests that the fewest (layer, KV
head) units read lately, by the heat the step publishes (`ReadStamps.heat`:
units that read the block within the last few steps, a step or two old, never
waited for): a page's cost on the host is the units decode reads there. Among
equally read blocks the oldest first. Never the sink blocks or the last
`recent_blocks + 2` full blocks (decode's `last_loc` and the blocks every step
reads). A request not yet measured in its row (a new request, a reused row)
counts as read by every unit: its blocks go last. With the `psa` radix cache
(`sharing`), a page SGLang's tree shares leaves HBM for every request mapping it and
for the tree at once, or not at all (`PsaRadixCache.sharers`, `left_hbm`).

The unit cache (`mem_cache.unit_cache`): an evicted block does not come back
whole. HBM pages the allocator can spare (beyond ROOM_HIGH per running request, at
most one per evicted block) become slots of the unit cache, which holds the single
(layer, KV head) units of evicted blocks that decode reads; `refresh`, every decode
round, grows it and brings in the units the last step read from the host. While any
block is evicted and HBM has no page to spare, `refresh` also evicts (every
COLD_EVERY rounds) the resident blocks that few units read lately
(`--psa-cold-fraction`): decode reads a few units of most blocks, so HBM holds more of
what it reads as single units than as whole pages. (Uncapped, the cache once took every
spare page and the cold blocks followed, so SGLang's tree gave up the shared documents it
held: seen on the H200, workload f.) When SGLang needs pages, cold blocks leave first
(their hot units come back as units), then cache pages; when the last evicted block is
gone the cache gives every page back.

Ordering: all of this runs on the scheduler's stream, which SGLang orders
before the next forward but lets run ahead of the last one's replay. Eviction
is written to be read at any moment (`evict_many`); the unit cache is not, so
every write of its tables or slots, and of the location table, first waits for
the last decode step (`mem_cache.fence`): no slot changes under a running step.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from sglang_psa.distributed import RankAgreement
from sglang_psa.mem_cache.unit_cache import UnitCache
from sglang_psa.mem_cache.writeback import to_device
from sglang_psa.releases import req_row
from sglang_psa.sched.host_timing import timed

# `sharing.sharers` (the psa radix cache): a block its request maps to page 0 already (read
# from the host tier since its match), which leaves HBM for it with no page to free.
AT_PAGE0 = "page 0"

# A row's published heat belongs to its request while the length it was measured at
# trails the request's by at most this many tokens (the overlap scheduler runs ahead).
_STALE_TOKENS = 8

# Free pages a decode round keeps for each running request (a round takes at most one
# page a request), a band wide: the decode check makes room when fewer than ROOM_LOW a
# request are free, and then for ROOM_HIGH (`room_for_decode`); the unit cache takes only
# pages beyond ROOM_HIGH (`refresh`). Without the band every page a request filled was
# made room for in its own round: at workload b's shape 44% of rounds evicted one block,
# ~60 tensor operations each on the scheduler's thread; with it one round in about a
# block's worth of tokens evicts a page per request at once
# (benchmark/scheduler/decode_round.py).
ROOM_LOW, ROOM_HIGH = 2, 3
# Rounds at least between passes of `refresh` over the resident blocks for cold ones (a
# pass walks every saved block of every running request; a block turns cold over many
# steps).
COLD_EVERY = 8


class Residency:
    def __init__(
        self,
        writeback,
        meta,
        working_sets,
        req_to_token: torch.Tensor,
        cfg,
        pool,
        allocator,
        unit_reads=None,
        agreement: RankAgreement | None = None,
    ):
        """`pool`: SGLang's KV pool (`k_buffer`/`v_buffer` by layer), where the unit cache
        lives; `allocator`: SGLang's page allocator, which the cache takes pages from and
        gives them back to (the one the scheduler hooks pass in, once they have);
        `unit_reads()`: (units decode read from HBM, from the host tier) as the backend
        last published them without a sync (default: none); `agreement`: the TP ranks'
        (`sglang_psa.distributed`; default: one rank)."""
        self.wb, self.meta, self.ws = writeback, meta, working_sets
        self.records = writeback.records  # each request's `RequestKV` (`evicted` is ours)
        self.pool = pool
        self.req_to_token = req_to_token
        self.block_size = cfg.block_size
        self.sink = cfg.sink_blocks
        self.keep_recent = cfg.recent_blocks + 2
        # Readers below which a resident block is cold (`refresh`); 0: never proactively.
        units = working_sets.layers * working_sets.kv_heads
        self.cold_readers = math.ceil(cfg.cold_fraction * units)
        self.page_rows = meta.page_rows
        self.max_blocks = working_sets.heat_blocks  # blocks of the longest request
        if not self.max_blocks:
            raise ValueError("residency needs the working sets to publish block heat")
        self.evictions = 0  # blocks given back to the allocator, ever
        self.allocator = allocator
        self.unit_reads = unit_reads or (lambda: (0, 0))
        self.agreement = agreement or RankAgreement()
        # Host blocks that left HBM for some holder: the unit cache may hold their units
        # until the last holder lets them go (`forget`).
        self.left_hbm = np.zeros(writeback.blocks.num_blocks, dtype=bool)
        self.cache = UnitCache(
            working_sets.layers,
            working_sets.kv_heads,
            writeback.blocks.num_blocks,
            (pool.size + self.block_size) // self.block_size,
            self.block_size,
            req_to_token.device,
            ways=cfg.unit_cache_ways,
            fence=writeback.fence,
        )
        if hasattr(pool, "k_buffer"):  # SGLang's pool: its layer offsets now, so a pool the
            self.cache.bind(pool)  # cache cannot read fails at startup, not mid-serving
        self.freeing = False  # inside our own free (no page 0 to drop)
        # refresh calls while blocks are evicted, and the one of the last cold pass
        self._rounds, self._cold_at = 0, -COLD_EVERY
        # Who else maps a block's HBM page: the `psa` radix cache, where SGLang's tree
        # shares pages between requests (`sharers`, `left_hbm`); None: its request alone.
        self.sharing = None
        # A request with evicted blocks ended: its free, which SGLang may defer to the end
        # of a free group, still holds page-0 entries for the allocator hook to drop.
        self.zero_pending = False
        dev = req_to_token.device
        self._offsets = torch.arange(self.block_size, device=dev)

    def forget(self, rec, start: int = 0) -> None:
        """Blocks `start...` of `rec` are no longer its (`TieredRequests.trim`), or `rec`
        ended (`start` 0, `TieredRequests.release`): they count as evicted no more, and the
        units of those whose last holder `rec` is (a shared prefix's stay while another
        request holds them) leave the unit cache, whoever evicted them. An ended request's
        row still holds page-0 entries for its evicted blocks, which the allocator hook
        drops from its free (`zero_pending`); with the last evicted block of any request
        gone the cache gives its pages back. Called before the host blocks are let go."""
        gone = rec.evicted
        refs = self.wb.blocks.refs
        hbs = [h for h in rec.host[start:] if refs[h] <= 1 and self.left_hbm[h]]
        if gone is None and not hbs:
            return
        if gone is not None:
            if start == 0:
                rec.evicted = None
                self.zero_pending = True
            gone[start:] = False
        self.left_hbm[hbs] = False
        self.cache.forget(to_device(hbs, self.req_to_token.device))
        if not self.any_evicted:
            self._free(self.cache.shrink(self.cache.pages))

    def switched(self, rec, moves: list[tuple[int, int]]) -> None:
        """`rec`'s blocks switched host ids (`HostBlocks.switch`, `moves`: `(block, old
        id)`; a duplicate let go for the index's copy): units cached for an old id that no
        request holds any more leave the unit cache (the id may be handed out again), and
        a block off HBM for `rec` is off HBM at its new id."""
        dev = self.req_to_token.device
        refs = self.wb.blocks.refs
        gone = [old for _, old in moves if self.left_hbm[old] and refs[old] == 0]
        if gone:
            self.left_hbm[gone] = False
            self.cache.forget(to_device(gone, dev))
        off = rec.evicted
        new = [rec.host[b] for b, _ in moves if off is not None and off[b]]
        if new:
            self._cacheable(new)

    def sync_prefix(self, req) -> None:
        """A chunked prompt's blocks may have left HBM after SGLang copied its request-table
        row into `req.prefix_indices` (which the next chunk writes back into the row):
        copy the row again, so that it keeps the page-0 entries of the given-back blocks
        and never names a page that went back to the allocator."""
        n = len(getattr(req, "prefix_indices", ()))
        rec = self.records.get(req.rid)
        if n and rec is not None and rec.evicted is not None:
            row = self.req_to_token[req_row(req), :n]
            req.prefix_indices = row.to(dtype=torch.int64, copy=True)

    @property
    def evicted(self) -> dict[object, np.ndarray]:
        """rid -> bool by block (the block's HBM page went back) of every request that
        evicted a block and has not ended (parked ones included)."""
        return {rid: rec.evicted for rid, rec in self.records.items() if rec.evicted is not None}

    @property
    def any_evicted(self) -> bool:
        return any(rec.evicted is not None for rec in self.records.values())

    @property
    def evicted_blocks(self) -> int:
        """Blocks of admitted requests out of HBM now (parked ones' included)."""
        return sum(int(gone.sum()) for gone in self.evicted.values())

    @property
    def drops_page_zero(self) -> bool:
        """Whether a page release now may carry page-0 entries of evicted blocks."""
        return (self.any_evicted or self.zero_pending) and not self.freeing

    def releasable(self, page_ids: tuple) -> tuple:
        """`page_ids` (SGLang's allocator release, device tensors) less page 0 while a
        release may carry page-0 entries of evicted blocks (`drops_page_zero`); such a
        release takes the pending ones of an ended request along (`zero_pending`). The
        boolean mask syncs, as SGLang's `free` of the chunk cache (no prefix cache) does
        with `unique` anyway. With the `psa` radix cache (`sharing`) every KV free passes
        the tree's allocator, which leaves blocks at page 0 out from host-side records
        (`psa_radix_cache._HbmOnly`): nothing to drop, and no sync (b on the H200 released
        pages 1,064 times, 0.88 ms each, mostly waiting for the GPU; the test store
        asserts that no release reaches the allocator with page 0, test_psa_radix_cache)."""
        if self.sharing is not None or not self.drops_page_zero:
            return page_ids
        self.zero_pending = False
        return tuple(p[p != 0] for p in page_ids)

    def evictable(self, reqs) -> int:
        """Blocks of `reqs` that may leave HBM now (saved, past the sink, not recent, not
        gone)."""
        return len(self._candidates(reqs).blocks)

    @staticmethod
    def _readers(lengths, heat: dict, row: int, seq_len: int, upto: int) -> np.ndarray:
        """Published readers (uint8) of blocks `[0, upto)` of the request in `row`
        (`lengths`: the measured length of each row, `ws.read()`'s; `heat`: `ws.heat()`);
        255 where the row was not measured for this request (read by every unit until it
        is). A view of the published heat where there is one."""
        measured = int(lengths[row])
        heat = heat.get(row)
        if heat is None or measured <= 0 or abs(seq_len - measured) > _STALE_TOKENS:
            return np.full(upto, 255, dtype=np.uint8)
        return heat[:upto]

    def _candidates(self, reqs) -> _Candidates:
        """The blocks of `reqs` that may leave HBM now (saved, past the sink, not recent,
        not gone), as flat arrays in one pass over the requests (a decode round asks at
        batch 50 of 16K prompts about 25,000 blocks, several times: a loop per block or
        per request costs milliseconds of the scheduler's step). Readers and saved counts
        are agreed over the TP ranks (`sglang_psa.distributed`): the most readers and the
        fewest acknowledged saves of any rank, so that every rank evicts the same blocks
        and its allocator stays in step."""
        live = [
            (q, r)
            for q in _live(reqs)
            if (r := self.records.get(q.rid)) is not None and r.row is not None
        ]
        bs, keep = self.block_size, self.keep_recent
        spans = np.array([max(0, int(q.seqlen) // bs - keep) for q, _ in live], dtype=np.int64)
        lengths = np.asarray(self.ws.read()[1])  # host memory: one view, not a read a row
        published = self.ws.heat()
        heat = [
            self._readers(lengths, published, r.row, int(q.seqlen), int(n))
            for (q, r), n in zip(live, spans)
        ]
        (heat,), (saved,) = self.agreement.max_min(
            [np.concatenate(heat).astype(np.int64) if heat else np.zeros(0, dtype=np.int64)],
            [[r.saved for _, r in live]],
        )
        total = int(spans.sum())
        if total == 0:
            return _Candidates.empty()
        who = np.repeat(np.arange(len(live)), spans)  # request index of each position
        pos = np.arange(total) - np.repeat(np.cumsum(spans) - spans, spans)  # block number
        ok = (pos >= self.sink) & (pos < np.repeat(np.minimum(saved, spans), spans))
        gone = [
            np.zeros(n, dtype=bool) if r.evicted is None else _padded(r.evicted, int(n))
            for (_, r), n in zip(live, spans)
        ]
        ok &= ~np.concatenate(gone)
        return _Candidates([q.rid for q, _ in live], who[ok], pos[ok], heat[ok])

    def _coldest(self, reqs, n: int) -> list[tuple[int, object, int]]:
        """Up to `n` `(readers, rid, block)` of `reqs` that may leave HBM, least read first,
        then oldest (ties: in `reqs`' order)."""
        c = self._candidates(reqs)
        n = min(max(n, 0), len(c.blocks))
        if n == 0:
            return []
        # one sort key: readers (< 2^8), then block (< 2^32), then request (< 2^23)
        key = (c.readers << 55) | (c.blocks << 23) | c.who
        pick = np.argpartition(key, n - 1)[:n]  # the n smallest keys, unordered
        pick = pick[np.argsort(key[pick])]
        readers, who, blocks = (a[pick].tolist() for a in (c.readers, c.who, c.blocks))
        return [(r, c.rids[w], b) for r, w, b in zip(readers, who, blocks)]

    def make_room(self, reqs, tokens: int, allocator, cache_first: int = 0) -> int:
        """Give back pages of `reqs` (SGLang requests, running) until `tokens` more tokens
        fit: cold blocks first, then unit-cache pages; returns the tokens freed (less
        when too few blocks are saved yet and the cache is empty). The first `cache_first`
        tokens come from the cache while it has pages: room SGLang only reserves (the
        running requests' future output, which decode's own `make_room` serves at this
        home) is back in the cache the next round, where an evicted block stays out."""
        self.allocator = allocator
        want = -(-tokens // self.block_size)
        if want <= 0:
            return 0
        first = min(-(-max(cache_first, 0) // self.block_size), want, self.cache.pages)
        if first > 0:
            self._free(self.cache.shrink(first), allocator)
        freed = first * self.block_size
        if want > first:
            freed += self._evict_all(self._coldest(reqs, want - first), allocator)
        short = want - freed // self.block_size
        if short > 0 and self.cache.pages:
            n = min(short, self.cache.pages)
            self._free(self.cache.shrink(n), allocator)
            freed += n * self.block_size
        return freed

    def _free(self, tokens: torch.Tensor, allocator=None) -> None:
        """Give the pages of `tokens` (device, whole pages) back to SGLang's allocator."""
        if tokens.numel() == 0:
            return
        self.freeing = True  # our pages are never page 0: the allocator hook lets them by
        try:
            (allocator or self.allocator).free_segment(tokens, start_pos=0)
        finally:
            self.freeing = False

    def _evict_all(self, victims: list[tuple[int, object, int]], allocator) -> int:
        by_rid: dict[object, list[int]] = {}
        for _, rid, b in victims:
            by_rid.setdefault(rid, []).append(b)
        return self.evict_many({rid: sorted(bl) for rid, bl in by_rid.items()}, allocator)

    def read_prefix_from_host(self, reqs) -> None:
        """An extend batch is set up (each request's row planned): the blocks of a matched
        prefix that SGLang's tree holds only in the host tier (page 0 in the request's row;
        `sharing.page0_prefix`) are read from there by decode (the location table
        switches) and count as `evicted`, so a staged prefill reads them from the host
        tier too (`PrefillStage.plan_batch`). Nothing without the psa radix cache."""
        if self.sharing is None:
            return
        for req in reqs:
            blocks = self.sharing.page0_prefix(req)
            rec = self.records.get(req.rid)
            if blocks and rec is not None:
                self._read_at_page0(rec, blocks)

    def _read_at_page0(self, rec, blocks: list[int]) -> None:
        """`rec`'s `blocks`, at page 0 in its row already, are read from the host tier
        (those it saved) and count as off HBM: no page to move or free. Their units may
        be cached from now on, as an evicted block's (`left_hbm`, the unit cache's
        `live`; `forget` drops them with their last holder): without that, decode read
        every unit of a prefix matched in the host tier across PCIe at every step."""
        switched = self.wb.read_from_host(rec.rid, blocks)
        self._mark(rec, switched)
        if switched:
            self._cacheable([rec.host[b] for b in switched])

    def _cacheable(self, hosts: list[int], on_device: torch.Tensor | None = None) -> None:
        """Host blocks `hosts` are read from the host tier: their units may be cached
        (`left_hbm`, the unit cache's `live`) until their last holder ends (`forget`).
        `on_device`: the same ids on the device, where the caller has them."""
        self.left_hbm[hosts] = True
        if on_device is None:
            on_device = to_device(hosts, self.req_to_token.device)
        self.cache.mark_evicted(on_device)

    def evict(self, rid, blocks: list[int], allocator) -> int:
        """Give back the HBM pages of `rid`'s saved `blocks`; returns the tokens freed
        (`evict_many` for one request)."""
        return self.evict_many({rid: blocks}, allocator)

    def evict_many(self, wanted: dict, allocator) -> int:
        """Give back the HBM pages of the saved blocks of several requests (`wanted`: rid
        -> blocks, taken in that order); returns the tokens freed. A page SGLang's tree
        shares (`sharing`) leaves HBM for every request mapping it and for the tree: each
        holder's location table and request-table entries switch (`evicted`), the tree's
        entry goes to page 0; the stamps move once (their rows are per host block; the
        metadata is there since the save) and the page is freed once, also where two of
        `wanted`'s requests name it. A block whose page a request shares that cannot be
        switched now stays (`sharers`). Stamps first, then the location tables, then the
        request tables: a step that reads the tables at any point between scores and
        reads a complete copy. All requests' blocks move in one pass on the device (one
        copy to it, one launch per table, one free): a decode round's eviction reaches
        many requests, and a pass each costs the scheduler's thread ~58 tensor operations
        per request (benchmark/scheduler/evict_ops.py)."""
        plans = []  # (record, its blocks leaving HBM, who maps each)
        taken: set[tuple[int, int]] = set()  # (id(holder), block) of shared pages switched
        holders: dict[int, tuple[object, list[int]]] = {}  # id(record) -> its blocks here
        for rid, blocks in wanted.items():
            r = self.records.get(rid)
            if r is None or r.row is None:
                continue
            blocks = [b for b in blocks if b < r.saved]
            if r.evicted is not None and blocks:
                blocks = [b for b, g in zip(blocks, r.evicted[blocks].tolist()) if not g]
            if taken:
                blocks = [b for b in blocks if (id(r), b) not in taken]
            if self.sharing is None:
                at = {b: ([r], None) for b in blocks}
            else:
                at = self.sharing.sharers(r, blocks)
                marked = [b for b in blocks if at.get(b, (0, 0))[1] == AT_PAGE0]
                if marked:  # at page 0 for `r` since its match
                    self._read_at_page0(r, marked)
                blocks = [b for b in blocks if b in at and at[b][1] != AT_PAGE0]
            if not blocks:
                continue
            plans.append((r, blocks, at))
            mine = holders.setdefault(id(r), (r, []))[1]
            for b in blocks:
                who = at[b][0]
                if len(who) == 1 and who[0] is r:  # its own page (most of a prompt's)
                    mine.append(b)
                    continue
                for q in who:
                    holders.setdefault(id(q), (q, []))[1].append(b)
                    taken.add((id(q), b))
        if not plans:
            return 0
        self.wb.fence()  # the stamps' rows move first; the step may still read them
        bs, dev = self.block_size, self.req_to_token.device
        rows, cols, hosts = [], [], []
        for r, blocks, _ in plans:
            rows += [r.row] * len(blocks)
            cols += [b * bs for b in blocks]
            hosts += [r.host[b] for b in blocks]
        h_rows, h_cols = [], []
        for q, blocks in holders.values():
            h_rows += [q.row] * len(blocks)
            h_cols += [b * bs for b in blocks]
        n, m = len(rows), len(h_rows)
        flat = to_device(rows + cols + hosts + h_rows + h_cols, dev)
        rows, cols, host = flat[:n], flat[n : 2 * n], flat[2 * n : 3 * n]
        pages = self.req_to_token[rows, cols].long() // bs
        self.ws.copy_rows(pages, host + self.page_rows)
        self.wb.read_many_from_host({q.rid: blocks for q, blocks in holders.values()})
        freed = self.req_to_token[
            rows[:, None].expand(-1, bs).flatten(), (cols[:, None] + self._offsets).flatten()
        ]
        h_rows = flat[3 * n : 3 * n + m, None].expand(-1, bs).flatten()
        h_cols = (flat[3 * n + m :, None] + self._offsets).flatten()
        self.req_to_token[h_rows, h_cols] = (h_cols % bs).to(self.req_to_token.dtype)  # page 0
        if self.sharing is not None:
            self.sharing.left_hbm(
                [(at[b][1], r.host[b]) for r, bl, at in plans for b in bl if at[b][1] is not None],
                [q.rid for q, _ in holders.values()],
            )
        self._free(freed, allocator)
        self._cacheable(hosts, host)
        for q, blocks in holders.values():
            self._mark(q, blocks)
        self.evictions += n
        return n * bs

    def _mark(self, rec, blocks: list[int]) -> None:
        """`rec`'s `blocks` are off HBM for it (`RequestKV.evicted`)."""
        if rec.evicted is None:
            rec.evicted = np.zeros(self.max_blocks, dtype=bool)
        rec.evicted[blocks] = True

    def room_for_decode(self, reqs, allocator, evict_tree) -> int:
        """Before a decode round of running `reqs`: when fewer than ROOM_LOW pages a
        request are free, free up to ROOM_HIGH a request, first the prefixes SGLang's
        tree keeps that no running request holds (`evict_tree(tokens)`: SGLang's own
        tree eviction, to `tokens` free), then saved blocks of `reqs` (`make_room`);
        between the two nothing leaves HBM. Returns the tokens `make_room` freed."""
        page_each = len(reqs) * self.block_size  # tokens: a page for each request
        if allocator.available_size() >= ROOM_LOW * page_each:
            return 0
        want = ROOM_HIGH * page_each
        evict_tree(want)
        short = want - int(allocator.available_size())
        return self.make_room(reqs, short, allocator) if short > 0 else 0

    def refresh(self, reqs, allocator) -> int:
        """Every decode round, while blocks are evicted: the unit cache takes pages the
        allocator can spare beyond ROOM_HIGH per running request, up to one page per
        evicted block (that many hold every unit of every evicted block; pages beyond go
        back, to SGLang's tree and new prompts), then brings in the host units the last
        step read (`UnitCache.refresh`, no sync). Only when HBM has no page to spare, and
        every COLD_EVERY rounds, saved blocks of `reqs` that fewer than `cold_fraction` of
        their units read lately leave HBM first (a page kept for a block serves its few
        readers; as cache slots it serves one hot unit per (layer, KV head)): with pages
        free, evicting them gains nothing and sends their prefix's next readers to the
        host tier. Returns the pages taken."""
        self.allocator = allocator
        if not self.any_evicted:
            return 0
        bs = self.block_size
        reserve = ROOM_HIGH * sum(1 for _ in _live(reqs))
        spare = allocator.available_size() // bs - reserve
        self._rounds += 1
        if self.cold_readers and spare <= 0 and self._rounds - self._cold_at >= COLD_EVERY:
            self._cold_at = self._rounds
            if self._evict_cold(reqs, allocator):
                spare = allocator.available_size() // bs - reserve
        n = self._resize_cache(spare, allocator)
        self._refresh_units()
        return n

    @timed("residency.evict_cold")
    def _evict_cold(self, reqs, allocator) -> bool:
        """Saved blocks of `reqs` read by fewer than `cold_readers` lately leave HBM (their
        pages serve more as unit-cache slots); returns whether any left."""
        c = self._candidates(reqs)
        cold = c.readers < self.cold_readers
        who, blocks = c.who[cold].tolist(), c.blocks[cold].tolist()
        readers = c.readers[cold].tolist()
        victims = [(r, c.rids[w], b) for r, w, b in zip(readers, who, blocks)]
        if victims:
            self._evict_all(victims, allocator)
        return bool(victims)

    @timed("residency.resize_cache")
    def _resize_cache(self, spare: int, allocator) -> int:
        """The unit cache gives back pages beyond one per evicted block, then takes up to
        `spare` toward that; returns the pages taken."""
        bs, need = self.block_size, self.evicted_blocks
        if self.cache.pages > need:
            self._free(self.cache.shrink(self.cache.pages - need), allocator)
        n = min(spare, self._cache_short(need))
        if n > 0:
            slots = allocator.alloc(n * bs)
            if slots is None:
                n = 0
            else:
                self.cache.grow(slots[::bs] // bs)
        return max(n, 0)

    @timed("unit_cache.refresh")
    def _refresh_units(self) -> None:
        """The host units the last step read, into the cache (`UnitCache.refresh`)."""
        self.cache.refresh(self.ws.stamps, self.page_rows, self.ws.step, self.wb.host, self.pool)

    def _cache_short(self, need: int) -> int:
        """Pages the unit cache would still take toward `need` (one per evicted block),
        within its capacity."""
        return min(self.cache.capacity - self.cache.pages, need - self.cache.pages)

    def report(self) -> dict[str, int]:
        """Counters for server info and metrics, from host memory (no sync; the device
        counters as last copied, a step or two old)."""
        hbm, host = self.unit_reads()
        return {
            "blocks_evicted": self.evicted_blocks,
            "evictions": self.evictions,
            "cache_pages": self.cache.pages,
            "units_cached": int(self.cache.copied_host[0]),  # host units brought in
            # the unit cache's refreshes: replayed from a CUDA graph, launched from Python
            "cache_refresh_replays": self.cache.replays,
            "cache_refresh_launches": self.cache.launches,
            "units_read_hbm": hbm,  # (layer, KV head, block) reads decode served from HBM
            "units_read_host": host,  # ... and from the host tier, across PCIe
        }


class _Candidates(NamedTuple):
    """Blocks that may leave HBM (`Residency._candidates`), flat and in no order: the
    request of each (`rids[who]`), its block number and its readers (int64)."""

    rids: list
    who: np.ndarray
    blocks: np.ndarray
    readers: np.ndarray

    @classmethod
    def empty(cls) -> _Candidates:
        none = np.zeros(0, dtype=np.int64)
        return cls([], none, none, none)


def _padded(gone: np.ndarray, n: int) -> np.ndarray:
    """`gone[:n]`, padded with False to `n` (a request's evicted flags, by block); a view
    where `gone` is that long (it is sized for the longest request)."""
    if len(gone) >= n:
        return gone[:n]
    out = np.zeros(n, dtype=bool)
    m = min(n, len(gone))
    out[:m] = gone[:m]
    return out


def _live(reqs):
    """Requests holding a request-table row and not finished."""
    return (r for r in reqs if req_row(r) is not None and not r.finished())
