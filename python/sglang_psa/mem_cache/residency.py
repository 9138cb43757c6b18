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
2. the block's metadata and last-read stamps move from its page row to the
   host block's row (`PageMeta`/`WorkingSets` keep `pages + host blocks` rows:
   a block is scored and stamped wherever its KV lives);
3. its request-table entries point at page 0 (SGLang's padding page, never
   allocated): nothing reads them, and the allocator hook
   (`plugin.scheduling.around_release_page_ids`) drops page 0 from the
   request's eventual free;
4. the page goes back to SGLang's allocator (`free_segment`: fixed shape, no sync).
A forward already launched reads either copy: both hold the same KV until a
later forward, ordered after these writes, writes the page again.

Victims: the saved blocks of the running requests that the fewest (layer, KV
head) units read lately, by the heat the step publishes (`WorkingSets.heat`:
units that read the block within the last few steps, a step or two old, never
waited for): a page's cost on the host is the units decode reads there. Among
equally read blocks the oldest first. Never the sink blocks or the last
`recent_blocks + 2` full blocks (decode's `last_loc` and the blocks every step
reads). A request not yet measured in its row (a new request, a reused row)
counts as read by every unit: its blocks go last. Prefix sharing is off at this
home (a tree-shared page is not one request's to give back).

Promotion (`promote`, every decode round after `make_room`): evicted blocks that
at least `1 / PROMOTE_SHARE` of the units read lately come back into HBM, up to
`PROMOTE_BYTES` of KV per round, most read first. Their pages come from SGLang's
allocator: spare pages beyond two per running request first, then pages of the
least read HBM blocks, each evicted for a block read by more than twice as many
units (a swap pays only where it cuts reads across PCIe). One launch per layer
copies the host units into the pages
(`sgl_kernel_ext.writeback.copy_units_to_pages`, UVA reads), then the
metadata and stamps rows move back, the request table takes the new pages and
the location table sends decode to them. The host copy stays: the block is
still saved, and a later eviction writes nothing.

Ordering: all of this runs on the scheduler's stream, which SGLang orders
before the next forward. The decode graph reads the request table and the
location table during its replay, so the hook on SGLang's write-after-read
barrier (`plugin.scheduling.around_apply_war_barrier`) makes the scheduler's
stream wait for the whole forward at this home, not only for its pre-replay
snapshot: no table changes under a running step.
"""

from __future__ import annotations

import numpy as np
import torch

from sgl_kernel_ext.writeback import copy_units_to_pages
from sglang_psa.mem_cache.writeback import to_device

# A row's published heat belongs to its request while the length it was measured at
# trails the request's by at most this many tokens (the overlap scheduler runs ahead).
_STALE_TOKENS = 8
PROMOTE_SHARE = 8  # an evicted block read by 1/8 of the units lately comes back
PROMOTE_BYTES = 32 << 20  # KV promoted per scheduling round (about 1 ms of PCIe)


class Residency:
    def __init__(self, writeback, meta, working_sets, req_to_token: torch.Tensor, cfg, pool):
        """`pool`: SGLang's KV pool (`k_buffer`/`v_buffer` by layer), where promotion
        writes."""
        self.wb, self.meta, self.ws = writeback, meta, working_sets
        self.pool = pool
        self.req_to_token = req_to_token
        self.block_size = cfg.block_size
        self.sink = cfg.sink_blocks
        self.keep_recent = cfg.recent_blocks + 2
        self.page_rows = meta.page_rows
        self.max_blocks = working_sets.heat_blocks  # blocks of the longest request
        if not self.max_blocks:
            raise ValueError("residency needs the working sets to publish block heat")
        self.evicted: dict[object, np.ndarray] = {}  # rid -> bool by block: left HBM
        self.evictions = 0  # blocks given back to the allocator, ever
        self.promotions = 0  # blocks brought back into HBM, ever
        self.promote_blocks = max(1, PROMOTE_BYTES // writeback.block_bytes)
        self.promote_min = max(1, working_sets.layers * working_sets.kv_heads // PROMOTE_SHARE)
        self.freeing = False  # inside our own free (no page 0 to drop)
        # A request with evicted blocks ended: its free, which SGLang may defer to the end
        # of a free group, still holds page-0 entries for the allocator hook to drop.
        self.zero_pending = False
        dev = req_to_token.device
        self._offsets = torch.arange(self.block_size, device=dev)

    def release(self, rid) -> None:
        """`rid` ended: its evicted set goes (its entries point at page 0, which the
        allocator hook keeps out of the free)."""
        if self.evicted.pop(rid, None) is not None:
            self.zero_pending = True

    @property
    def evicted_blocks(self) -> int:
        """Blocks of running requests out of HBM now."""
        return sum(int(gone.sum()) for gone in self.evicted.values())

    @property
    def drops_page_zero(self) -> bool:
        """Whether a page release now may carry page-0 entries of evicted blocks."""
        return bool(self.evicted or self.zero_pending) and not self.freeing

    def evictable(self, reqs) -> int:
        """Blocks of `reqs` that may leave HBM now (saved, past the sink, not recent, not
        gone)."""
        return sum(len(got[0]) for got in map(self._candidates, _live(reqs)) if got is not None)

    def _readers(self, row: int, seq_len: int, upto: int, unknown: int) -> np.ndarray:
        """Published readers of blocks `[0, upto)` of the request in `row`; `unknown` where
        the row was not measured for this request (eviction: 255, a request counts as read
        by every unit until it is; promotion: 0, nothing comes back on no evidence)."""
        _, lengths = self.ws.read()
        measured = int(lengths[row])
        heat = self.ws.heat_of(row)
        if heat is None or measured <= 0 or abs(seq_len - measured) > _STALE_TOKENS:
            return np.full(upto, unknown, dtype=np.int64)
        return heat[:upto].astype(np.int64)

    def _candidates(self, req) -> tuple[np.ndarray, np.ndarray] | None:
        """`(blocks, readers)` of `req`'s blocks that may leave HBM now (saved, past the
        sink, not recent, not gone), least read first, then oldest."""
        r = self.wb.request(req.rid)
        if r is None:
            return None
        seq_len = int(req.seqlen)
        upto = min(r.saved, seq_len // self.block_size - self.keep_recent)
        if upto <= self.sink:
            return None
        readers = self._readers(r.row, seq_len, upto, unknown=255)
        ok = np.ones(upto, dtype=bool)
        ok[: self.sink] = False
        gone = self.evicted.get(req.rid)
        if gone is not None:
            ok &= ~gone[:upto]
        blocks = np.flatnonzero(ok)
        order = np.lexsort((blocks, readers[blocks]))
        return blocks[order], readers[blocks][order]

    def _coldest(self, reqs, n: int, below: int | None = None) -> list[tuple[int, object, int]]:
        """Up to `n` `(readers, rid, block)` of `reqs` that may leave HBM, least read first
        (then oldest); only blocks read by fewer than `below` units when given."""
        found = []
        for req in _live(reqs):
            got = self._candidates(req)
            if got is not None:
                blocks, readers = got
                keep = slice(None) if below is None else readers < below
                found += zip(readers[keep][:n].tolist(), [req.rid] * n, blocks[keep][:n].tolist())
        found.sort(key=lambda c: (c[0], c[2]))
        return found[:n]

    def make_room(self, reqs, tokens: int, allocator) -> int:
        """Give back pages of `reqs` (SGLang requests, running) until `tokens` more tokens
        fit; returns the tokens freed (less when too few blocks are saved yet)."""
        want = -(-tokens // self.block_size)
        if want <= 0:
            return 0
        return self._evict_all(self._coldest(reqs, want), allocator)

    def _evict_all(self, victims: list[tuple[int, object, int]], allocator) -> int:
        by_rid: dict[object, list[int]] = {}
        for _, rid, b in victims:
            by_rid.setdefault(rid, []).append(b)
        return sum(self.evict(rid, sorted(bl), allocator) for rid, bl in by_rid.items())

    def evict(self, rid, blocks: list[int], allocator) -> int:
        """Give back the HBM pages of `rid`'s saved `blocks`; returns the tokens freed.
        Metadata first, then the location table, then the request table: a step that
        reads the tables at any point between scores and reads a complete copy."""
        r = self.wb.request(rid)
        blocks = [] if r is None else [b for b in blocks if b < r.saved]
        if not blocks:
            return 0
        bs, dev = self.block_size, self.req_to_token.device
        idx = to_device([b * bs for b in blocks], dev)
        rows = to_device([r.host[b] for b in blocks], dev) + self.page_rows
        table = self.req_to_token[r.row]
        pages = table[idx].long() // bs
        self.meta.copy_rows(pages, rows)
        self.ws.copy_rows(pages, rows)
        self.wb.read_from_host(rid, blocks)
        tokens = (idx[:, None] + self._offsets).flatten()
        freed = table[tokens].clone()
        table.index_put_((tokens,), (tokens % bs).to(table.dtype))  # page 0's slots
        self.freeing = True  # our pages are never page 0: the allocator hook lets them by
        try:
            allocator.free_segment(freed, start_pos=0)
        finally:
            self.freeing = False
        gone = self.evicted.setdefault(rid, np.zeros(self.max_blocks, dtype=bool))
        gone[blocks] = True
        self.evictions += len(blocks)
        return len(blocks) * bs

    def promote(self, reqs, allocator) -> int:
        """Bring evicted blocks of `reqs` that many units read lately back into HBM (see
        the module docstring); returns the blocks promoted."""
        if not self.evicted:  # (a request's entry goes with its last evicted block)
            return 0
        hot = []  # (readers, rid, block)
        live = list(_live(reqs))
        for req in live:
            gone = self.evicted.get(req.rid)
            r = self.wb.request(req.rid)
            if gone is None or r is None:
                continue
            upto = min(int(req.seqlen) // self.block_size, self.max_blocks)
            readers = self._readers(r.row, int(req.seqlen), upto, unknown=0)
            for b in np.flatnonzero(gone[:upto] & (readers >= self.promote_min)):
                hot.append((int(readers[b]), req.rid, int(b)))
        if not hot:
            return 0
        hot.sort(key=lambda h: -h[0])
        hot = hot[: self.promote_blocks]
        bs = self.block_size
        free = min(len(hot), max(0, allocator.available_size() // bs - 2 * len(live)))
        rest = hot[free:]
        if rest:  # swap: each block read by more than twice the units of its victim
            victims = self._coldest(live, len(rest), below=(rest[0][0] + 1) // 2)
            k = 0
            while k < len(victims) and rest[k][0] > 2 * victims[k][0]:
                k += 1
            if k:
                self._evict_all(victims[:k], allocator)
            hot = hot[: free + k]
        hot = hot[: max(0, allocator.available_size() // bs - 2 * len(live))]
        if not hot:
            return 0
        slots = allocator.alloc(len(hot) * bs)
        if slots is None:
            return 0
        self._bring_back([(rid, b) for _, rid, b in hot], slots)
        return len(hot)

    def _bring_back(self, blocks: list[tuple[object, int]], slots: torch.Tensor) -> None:
        """Evicted `(rid, block)`s into the pages of the allocated token `slots`."""
        bs, dev = self.block_size, self.req_to_token.device
        reqs = [self.wb.request(rid) for rid, _ in blocks]
        hosts = to_device([r.host[b] for r, (_, b) in zip(reqs, blocks)], dev)
        pages = slots[::bs] // bs
        for layer, (kb, vb) in enumerate(zip(self.pool.k_buffer, self.pool.v_buffer)):
            copy_units_to_pages(self.wb.host.k[layer], self.wb.host.v[layer], hosts, kb, vb, pages)
        self.meta.copy_rows(hosts + self.page_rows, pages.long())
        self.ws.copy_rows(hosts + self.page_rows, pages.long())
        rows = to_device([r.row for r in reqs], dev)
        cols = to_device([b for _, b in blocks], dev)
        tok_rows = rows.repeat_interleave(bs)
        tok_cols = (cols[:, None] * bs + self._offsets).flatten()
        self.req_to_token.index_put_((tok_rows, tok_cols), slots.to(self.req_to_token.dtype))
        self.wb.host_loc.index_put_((rows, cols), torch.zeros_like(cols, dtype=torch.int32))
        for rid, b in blocks:
            self.evicted[rid][b] = False
        for rid in {rid for rid, _ in blocks}:
            if not self.evicted[rid].any():  # no page-0 entry left in its row
                del self.evicted[rid]
        self.promotions += len(blocks)

    def report(self) -> dict[str, int]:
        hbm, host = self.ws.unit_reads()
        return {
            "blocks_evicted": self.evicted_blocks,
            "evictions": self.evictions,
            "promotions": self.promotions,
            "units_read_hbm": hbm,  # (layer, KV head, block) reads decode served from HBM
            "units_read_host": host,  # ... and from the host tier, across PCIe
        }


def _live(reqs):
    """Requests holding a request-table row and not finished."""
    return (r for r in reqs if getattr(r, "req_pool_idx", None) is not None and not r.finished())
