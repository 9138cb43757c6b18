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
   host block's row (`PageMeta`/`ReadStamps` keep `pages + host blocks` rows:
   a block is scored and stamped wherever its KV lives);
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
counts as read by every unit: its blocks go last. Prefix sharing is off at this
home (a tree-shared page is not one request's to give back).

The unit cache (`mem_cache.unit_cache`): an evicted block does not come back
whole. HBM pages the allocator can spare (beyond two per running request) become
slots of the unit cache, which holds the single (layer, KV head) units of evicted
blocks that decode reads; `refresh`, every decode round, grows it and brings in
the units the last step read from the host. While any block is evicted, `refresh`
also evicts the resident blocks that few units read lately (`--psa-cold-fraction`):
decode reads a few units of most blocks, so HBM holds more of what it reads as
single units than as whole pages. When SGLang needs pages, cold blocks
leave first (their hot units come back as units), then cache pages; when the last
evicted block is gone the cache gives every page back.

Ordering: all of this runs on the scheduler's stream, which SGLang orders
before the next forward. The decode graph reads the request table and the
location table during its replay, so the hook on SGLang's write-after-read
barrier (`plugin.scheduling.around_apply_war_barrier`) makes the scheduler's
stream wait for the whole forward at this home, not only for its pre-replay
snapshot: no table changes under a running step.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from sglang_psa.distributed import RankAgreement
from sglang_psa.mem_cache.unit_cache import UnitCache
from sglang_psa.mem_cache.writeback import to_device
from sglang_psa.releases import req_row

# A row's published heat belongs to its request while the length it was measured at
# trails the request's by at most this many tokens (the overlap scheduler runs ahead).
_STALE_TOKENS = 8


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
        self.evicted: dict[object, np.ndarray] = {}  # rid -> bool by block: left HBM
        # Retracted requests whose saved blocks stay in the host tier: rid -> the prefix
        # tokens they resume with (`park`); and the resumptions so far, with the tokens
        # they read from the host tier and the tokens they computed again.
        self.parked: dict[object, int] = {}
        self.resumed = self.resumed_host_tokens = self.resumed_recomputed_tokens = 0
        self.evictions = 0  # blocks given back to the allocator, ever
        self.allocator = allocator
        self.unit_reads = unit_reads or (lambda: (0, 0))
        self.agreement = agreement or RankAgreement()
        self.cache = UnitCache(
            working_sets.layers,
            working_sets.kv_heads,
            writeback.blocks.num_blocks,
            (pool.size + self.block_size) // self.block_size,
            self.block_size,
            req_to_token.device,
        )
        # Prefill over a prefix that left HBM (`mem_cache.prefill_stage`); set when the
        # prefill backend can read a staged prefix (SGLang's Triton backend), else None
        # and a chunked prompt's blocks stay in HBM.
        self.stage = None
        self.freeing = False  # inside our own free (no page 0 to drop)
        # A request with evicted blocks ended: its free, which SGLang may defer to the end
        # of a free group, still holds page-0 entries for the allocator hook to drop.
        self.zero_pending = False
        dev = req_to_token.device
        self._offsets = torch.arange(self.block_size, device=dev)

    # -- retraction: the KV stays in the host tier ---------------------------------------
    def park(self, req, allocator) -> int:
        """SGLang retracts `req` (a decoding request): its saved blocks leave HBM like
        evicted ones but stay its own in the host tier, with their metadata, so that it
        resumes with them as an evicted prefix instead of prefilling it again
        (`resume_prefix`); SGLang then frees the rest of its KV (the blocks not saved, whose
        pages are all it gives back) and its row. Returns the prefix tokens kept (0: none
        saved, nothing parked). The decode blocks waiting for a save are saved now, and it
        waits for every issued save (a host sync: retraction is not on the decode step,
        and SGLang's own retraction syncs too); what it resumes without is its last
        partial block and the blocks the last step or two completed."""
        self.wb.issue_decode(self.pool.k_buffer, self.pool.v_buffer, self.req_to_token, True)
        self.wb.drain()
        r = self.wb.request(req.rid)
        if r is None or not r.saved or getattr(req, "input_embeds", None) is not None:
            return 0  # (a request of input embeddings restarts from its prompt: SGLang's rule)
        gone = self.evicted.get(req.rid)
        here = [b for b in range(r.saved) if gone is None or not gone[b]]
        self.evict(req.rid, here, allocator)
        kept = self.wb.park(req.rid) * self.block_size
        self.parked[req.rid] = kept
        return kept

    def resume_prefix(self, req) -> bool:
        """Parked `req` is considered for a prefill (SGLang found no prefix for it): its
        prefix is the kept tokens, every one at page 0 in the request table (their KV is
        read from the host tier: `mem_cache.prefill_stage`), so that the prefill computes
        only the tokens after them. Where SGLang needs more of it computed (input
        log-probabilities, by default from the end of the prompt on) the prefix ends at
        the last whole block before that; False, and the request unparked (prefilled
        whole, as SGLang would), when no whole block is left."""
        kept = self.parked.get(req.rid)
        if kept is None or req_row(req) is not None:
            return False
        fill = len(req.full_untruncated_fill_ids)
        limit = fill - 1  # SGLang computes at least the last token (its logits)
        if getattr(req, "return_logprob", False) and req.logprob_start_len >= 0:
            limit = min(limit, req.logprob_start_len)  # (the prompt's length by default)
        if kept > limit:  # the blocks from there on are computed again
            kept = limit // self.block_size * self.block_size
            if not kept:
                self.unpark(req)
                return False
            self._trim(req.rid, kept // self.block_size)
        dev = self.req_to_token.device
        req.prefix_indices = torch.arange(kept, dtype=torch.int64, device=dev) % self.block_size
        return True

    def _trim(self, rid, blocks: int) -> None:
        """Parked `rid` keeps only its first `blocks` blocks: the others' units leave the
        unit cache and their host blocks go back (still reserved for it)."""
        r = self.wb.request(rid)
        dropped = r.host[blocks : r.saved]
        self.cache.forget(to_device(dropped, self.req_to_token.device))
        self.evicted[rid][blocks:] = False
        self.wb.trim(rid, blocks)
        self.parked[rid] = blocks * self.block_size

    def unpark(self, req) -> None:
        """Parked `req` is prefilled whole after all (SGLang's way): its host copy goes."""
        self.release(req.rid)
        self.wb.release(req.rid)
        req.prefix_indices = torch.empty((0,), dtype=torch.int64)

    def resume(self, reqs) -> None:
        """An extend batch is set up: its parked requests have their rows; decode reads
        their kept blocks from the host tier from now on."""
        for req in reqs:
            kept = self.parked.pop(req.rid, None)
            if kept is None:
                continue
            if len(req.prefix_indices) != kept:
                raise RuntimeError(
                    f"sglang-psa: parked request {req.rid} resumes with a prefix of "
                    f"{len(req.prefix_indices)} tokens, {kept} were kept in the host tier"
                )
            self.wb.resume(req.rid, int(req_row(req)))
            self.resumed += 1
            self.resumed_host_tokens += kept
            self.resumed_recomputed_tokens += len(req.full_untruncated_fill_ids) - kept

    def release(self, rid) -> None:
        """`rid` ended: its evicted set goes (its entries point at page 0, which the
        allocator hook keeps out of the free), its units leave the unit cache, and with
        the last evicted block gone the cache gives its pages back."""
        self.parked.pop(rid, None)
        gone = self.evicted.pop(rid, None)
        if gone is None:
            return
        self.zero_pending = True
        r = self.wb.request(rid)
        if r is not None:
            hbs = [r.host[b] for b in np.flatnonzero(gone).tolist() if b < len(r.host)]
            self.cache.forget(to_device(hbs, self.req_to_token.device))
        if not self.evicted:
            self._free(self.cache.shrink(self.cache.pages))

    def sync_prefix(self, req) -> None:
        """A chunked prompt's blocks may have left HBM after SGLang copied its request-table
        row into `req.prefix_indices` (which the next chunk writes back into the row):
        copy the row again, so that it keeps the page-0 entries of the given-back blocks
        and never names a page that went back to the allocator."""
        n = len(getattr(req, "prefix_indices", ()))
        if n and req.rid in self.evicted:
            row = self.req_to_token[req_row(req), :n]
            req.prefix_indices = row.to(dtype=torch.int64, copy=True)

    @property
    def evicted_blocks(self) -> int:
        """Blocks of admitted requests out of HBM now (parked ones' included)."""
        return sum(int(gone.sum()) for gone in self.evicted.values())

    @property
    def drops_page_zero(self) -> bool:
        """Whether a page release now may carry page-0 entries of evicted blocks."""
        return bool(self.evicted or self.zero_pending) and not self.freeing

    def evictable(self, reqs) -> int:
        """Blocks of `reqs` that may leave HBM now (saved, past the sink, not recent, not
        gone)."""
        return sum(len(blocks) for _, blocks, _ in self._candidates(reqs))

    def _readers(self, row: int, seq_len: int, upto: int) -> np.ndarray:
        """Published readers of blocks `[0, upto)` of the request in `row`; 255 where the
        row was not measured for this request (read by every unit until it is)."""
        _, lengths = self.ws.read()
        measured = int(lengths[row])
        heat = self.ws.heat_of(row)
        if heat is None or measured <= 0 or abs(seq_len - measured) > _STALE_TOKENS:
            return np.full(upto, 255, dtype=np.int64)
        return heat[:upto].astype(np.int64)

    def _candidates(self, reqs) -> list[tuple[object, np.ndarray, np.ndarray]]:
        """`(rid, blocks, readers)` per request of `reqs` with blocks that may leave HBM
        now (saved, past the sink, not recent, not gone), least read first, then oldest.
        Readers and saved counts are agreed over the TP ranks (`sglang_psa.distributed`): the
        most readers and the fewest acknowledged saves of any rank, so that every rank
        evicts the same blocks and its allocator stays in step."""
        reqs = [(q, r) for q in _live(reqs) if (r := self.wb.request(q.rid)) is not None]
        spans = [max(0, int(q.seqlen) // self.block_size - self.keep_recent) for q, _ in reqs]
        heat = [self._readers(r.row, int(q.seqlen), n) for (q, r), n in zip(reqs, spans)]
        (heat,), (saved,) = self.agreement.max_min(
            [np.concatenate(heat) if heat else np.zeros(0)], [[r.saved for _, r in reqs]]
        )
        out, at = [], 0
        for (q, _), span, done in zip(reqs, spans, saved.tolist()):
            readers, at = heat[at : at + span], at + span
            upto = min(done, span)
            if upto <= self.sink:
                continue
            ok = np.ones(upto, dtype=bool)
            ok[: self.sink] = False
            gone = self.evicted.get(q.rid)
            if gone is not None:
                ok &= ~gone[:upto]
            blocks = np.flatnonzero(ok)
            order = np.lexsort((blocks, readers[blocks]))
            out.append((q.rid, blocks[order], readers[blocks][order]))
        return out

    def _coldest(self, reqs, n: int) -> list[tuple[int, object, int]]:
        """Up to `n` `(readers, rid, block)` of `reqs` that may leave HBM, least read first
        (then oldest)."""
        found = []
        for rid, blocks, readers in self._candidates(reqs):
            found += zip(readers[:n].tolist(), [rid] * n, blocks[:n].tolist())
        found.sort(key=lambda c: (c[0], c[2]))
        return found[:n]

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
        self._free(freed, allocator)
        self.cache.mark_evicted(rows - self.page_rows)
        gone = self.evicted.setdefault(rid, np.zeros(self.max_blocks, dtype=bool))
        gone[blocks] = True
        self.evictions += len(blocks)
        return len(blocks) * bs

    def refresh(self, reqs, allocator) -> int:
        """Every decode round, while blocks are evicted: saved blocks of `reqs` that
        fewer than `cold_fraction` of their units read lately leave HBM too (a page
        kept for a block serves its few readers; as cache slots it serves one hot unit
        per (layer, KV head)); the unit cache takes the pages the allocator can spare
        beyond two per running request, then brings in the host units the last step
        read (`UnitCache.refresh`, no sync). Returns the pages taken."""
        self.allocator = allocator
        if not self.evicted:
            return 0
        if self.cold_readers:  # cold resident blocks: their pages serve more as slots
            cold = [
                (r, rid, b)
                for rid, blocks, readers in self._candidates(reqs)
                for b, r in zip(blocks.tolist(), readers.tolist())
                if r < self.cold_readers
            ]
            self._evict_all(cold, allocator)
        bs = self.block_size
        spare = allocator.available_size() // bs - 2 * sum(1 for _ in _live(reqs))
        n = min(spare, self.cache.capacity - self.cache.pages)
        if n > 0:
            slots = allocator.alloc(n * bs)
            if slots is None:
                n = 0
            else:
                self.cache.grow(slots[::bs] // bs)
        self.cache.refresh(self.ws.stamps, self.page_rows, self.ws.step, self.wb.host, self.pool)
        return n

    def report(self) -> dict[str, int]:
        """Counters for server info and metrics, from host memory (no sync; the device
        counters as last copied, a step or two old)."""
        hbm, host = self.unit_reads()
        return {
            "blocks_evicted": self.evicted_blocks,
            "evictions": self.evictions,
            "cache_pages": self.cache.pages,
            "units_cached": int(self.cache.copied_host[0]),  # host units brought in
            "units_read_hbm": hbm,  # (layer, KV head, block) reads decode served from HBM
            "units_read_host": host,  # ... and from the host tier, across PCIe
            # extend batches whose prefix was staged from the host tier (a prompt larger
            # than HBM), and the host tokens they staged (per layer)
            "staged_batches": self.stage.batches if self.stage else 0,
            "staged_host_tokens": self.stage.host_tokens if self.stage else 0,
            # retracted requests waiting with their KV in the host tier; resumptions, the
            # prefix tokens they read from there and the tokens they computed again
            "parked_requests": len(self.parked),
            "resumed": self.resumed,
            "resumed_host_tokens": self.resumed_host_tokens,
            "resumed_recomputed_tokens": self.resumed_recomputed_tokens,
        }


def _live(reqs):
    """Requests holding a request-table row and not finished."""
    return (r for r in reqs if req_row(r) is not None and not r.finished())
