"""One request's state in the tiered store (`RequestKV`), and its passage through it
(`TieredRequests`): where it parks, resumes, shrinks and leaves.

`--psa-kv-home tiered`. Every request the tiered store knows has exactly one
`RequestKV` in one table, `WriteBack.records` (rid -> record). The record is created when
admission reserves the request's host blocks (`WriteBack.reserve`, or when its first
blocks are planned if it reserved none) and leaves the table in `TieredRequests.release`
(the write-back starts a fresh one for a request planned in another row without having
been parked: it was prefilled again). Beyond the saves in flight (planned and issued
blocks, named by rid), the parts keep no per-request state of their own; each reads the
record and writes its own fields:
- `HostBlocks`: `host` and `reserved` (the ids the request holds, those promised to it);
- `WriteBack`: `row` and `saved` (planning and acknowledgements), `on_host` (its row of
  the location table decode reads);
- `Residency`: `evicted` (blocks whose HBM page went back to SGLang's allocator).

A record enters reserved and runs once the write-back plans it in a row; every other
step is `TieredRequests`', which calls the parts in the order the step needs:

    reserved -> running (row, planned, saved, evicted) -> released
                running -> ending (ended with saves in flight and a prefix index:
                           `WriteBack.ending`, its row left, its host blocks kept until
                           they land) -> released
                running -> parked (retracted: saved blocks kept in the host tier, no row)
                parked -> trimmed (a shorter kept prefix) -> running (a new row) | released

Admission's view of the same request (running or paused, its working-set window) is the
scheduler's (`sched.admission`): it exists at every KV home, the tiered store only at this
one. A parked request is paused there until admission takes it again, before it resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from sglang_psa.releases import req_prefix_len, req_row, set_req_prefix


def page0_slots(tokens: int, page_size: int, device) -> torch.Tensor:
    """The request-table entries of `tokens` prefix tokens (whole pages) whose KV is read
    from the host tier: each at its offset in page 0, the page no KV lives in (int64)."""
    return torch.arange(tokens, dtype=torch.int64, device=device) % page_size


@dataclass(eq=False)
class RequestKV:
    """The tiered store's state of one request. Block `b` holds its tokens
    `[b * block_size, (b + 1) * block_size)`.

    Invariants (`TieredRequests.check_integrity`):
    - `host[b]` is the host block that block `b` is saved to, for every planned block, in
      block order (`planned == len(host)`); the request owns these ids, no other does;
    - blocks `[0, saved)` are saved (acknowledged on every layer) and only they may be read
      from the host tier or leave HBM: `saved <= planned`, `evicted` only below `saved`;
    - parked: it holds no request-table row (`row is None`, `on_host` false), it keeps
      exactly its saved blocks (`planned == saved > 0`), all of them off HBM.
    """

    rid: Hashable
    host: list[int] = field(default_factory=list)  # host block of each planned block
    reserved: int = 0  # host blocks promised to it beyond `host`
    saved: int = 0  # blocks [0, saved) are acknowledged
    row: int | None = None  # SGLang's request-table row (None: not planned yet, or parked)
    # the blocks its location-table row sends decode to the host tier for (a host-side
    # copy of that row's nonzero entries: read without a sync)
    host_read: set[int] = field(default_factory=set)
    evicted: np.ndarray | None = None  # bool by block: its HBM page went back (None: never)
    parked: bool = False  # retracted, its saved blocks kept in the host tier
    seen: int = 0  # its full blocks at its last plan (the write-back's catch-up)

    @property
    def on_host(self) -> bool:
        """Whether its location-table row sends decode to the host tier somewhere."""
        return bool(self.host_read)

    @property
    def planned(self) -> int:
        """Blocks planned for a save, in order (each has its host block)."""
        return len(self.host)


class TieredRequests:
    """The passage of each request through the tiered store: `park`, `resume_prefix` and
    `resume`, `trim`, `release`, each the one place that step happens.

    Owns the records' lifecycle (the table is `WriteBack.records`) and the resumption
    counters; calls the write-back (plans, the location table, host blocks) and residency
    (eviction, the unit cache) for their parts. Contract with the scheduler hooks: a
    request is parked before SGLang frees its KV, gets its prefix when SGLang asks its
    prefix cache, resumes once its extend batch is set up (before the write-back plans it),
    and is released after SGLang freed its KV; a parked request is released only when it
    ends (finished or aborted), never when it is merely retracted again.
    """

    def __init__(self, writeback, residency, pool, req_to_token: torch.Tensor, block_size: int):
        """`writeback`/`residency`: the tiered home's (`mem_cache.writeback`,
        `mem_cache.residency`); `pool`: SGLang's KV pool (its `k_buffer`/`v_buffer` by
        layer); `req_to_token`: SGLang's request table."""
        self.wb, self.residency = writeback, residency
        self.records: dict[Hashable, RequestKV] = writeback.records
        self.pool, self.req_to_token, self.block_size = pool, req_to_token, block_size
        # Resumptions from the host tier so far, the prefix tokens they read from there and
        # the tokens they computed again.
        self.resumed = self.resumed_host_tokens = self.resumed_recomputed_tokens = 0
        # Prefix tokens the `psa` radix cache found in the host tier only and left to be
        # computed again, too few to stage a prefill for (`--psa-host-prefix-min-tokens`).
        self.host_match_recomputed_tokens = 0
        # Tokens of blocks SGLang's tree held only in the host tier (page 0) whose pages a
        # request computed them into were given to the tree at its insert.
        self.host_match_taken_tokens = 0
        # Told the rid of every release (the `psa` radix cache forgets what it tracks of
        # the request: a matched request may leave before it is admitted).
        self.listeners: list[Callable[[Hashable], None]] = []
        writeback.on_ended = lambda rec: self._let_go(rec.rid, rec)

    def parked(self, rid: Hashable) -> bool:
        """Whether retracted `rid` waits with its saved KV in the host tier."""
        rec = self.records.get(rid)
        return rec is not None and rec.parked

    @property
    def parked_requests(self) -> int:
        return sum(rec.parked for rec in self.records.values())

    # -- retraction: the KV stays in the host tier ---------------------------------------
    def park(self, req, allocator) -> int:
        """SGLang retracts `req` (a decoding request; SGLang's `Req`): its saved blocks
        leave HBM like evicted ones but stay its own in the host tier, with their metadata,
        so that it resumes with them as a prefix (`resume_prefix`) instead of prefilling
        them again; SGLang then frees the rest of its KV (the blocks not saved, whose pages
        are all it gives back) and its row. Returns the prefix tokens kept (0: none saved,
        or a request of input embeddings, which restarts from its prompt as SGLang's rule
        is; nothing parked).

        The decode blocks waiting for a save are issued now and every issued save is
        waited for (a host sync: retraction is not on the decode step, and SGLang's own
        retraction syncs too), so the kept blocks are exactly the acknowledged ones; what
        it resumes without is its last partial block and the blocks the last step or two
        completed. Its unissued saves are dropped, its old row reads HBM again (SGLang
        gives the row to another request) and the host blocks of blocks not saved go back
        to the free list, still promised to it. With a prefix index nothing is parked (see
        below)."""
        wb = self.wb
        wb.issue_decode(self.pool.k_buffer, self.pool.v_buffer, self.req_to_token, True)
        wb.drain()
        if wb.index is not None:
            # With the prefix cache (the psa radix cache) the saved blocks, all acknowledged
            # now, are the index's: nothing is parked; the request is released and, when
            # admitted again, matched like any other (its prefix read from HBM where the
            # tree holds it, else from the host tier while the index keeps it).
            return 0
        rec = self.records.get(req.rid)
        if rec is None or not rec.saved or getattr(req, "input_embeds", None) is not None:
            return 0
        gone = rec.evicted
        here = [b for b in range(rec.saved) if gone is None or not gone[b]]
        self.residency.evict(req.rid, here, allocator)
        wb.drop_plans(req.rid)
        wb.leave_row(rec)
        rec.row, rec.parked = None, True
        wb.blocks.give_back(rec, rec.saved)
        return rec.saved * self.block_size

    def resume_prefix(self, req) -> bool:
        """Parked `req` is considered for a prefill (SGLang found no prefix for it): its
        prefix is the kept tokens, every one at page 0 in the request table (their KV is
        read from the host tier: `mem_cache.prefill_stage`), so that the prefill computes
        only the tokens after them. Where SGLang needs more of it computed (input
        log-probabilities, by default from the end of the prompt on) the prefix ends at
        the last whole block before that (`trim`); False, and the request unparked
        (prefilled whole, as SGLang would), when no whole block is left. Where the
        release keeps a prefix as a length (0.5.23 on) the length is set here and the
        slots are read at allocation (`prefix_slots`)."""
        rec = self._resuming(req)
        if rec is None:
            return False
        kept = rec.saved * self.block_size
        fill = len(req.full_untruncated_fill_ids)
        limit = fill - 1  # SGLang computes at least the last token (its logits)
        if getattr(req, "return_logprob", False) and req.logprob_start_len >= 0:
            limit = min(limit, req.logprob_start_len)  # (the prompt's length by default)
        if kept > limit:  # the blocks from there on are computed again
            kept = limit // self.block_size * self.block_size
            if not kept:
                self.unpark(req)
                return False
            self.trim(req.rid, kept // self.block_size)
        set_req_prefix(req, self._page0(kept))
        return True

    def prefix_slots(self, req) -> torch.Tensor | None:
        """The request-table entries of parked `req`'s prefix as its new row gets them
        (`resume_prefix` set its length): page 0 for every kept token; None for a request
        that is not parked or holds a row already (SGLang's own slots apply)."""
        return None if self._resuming(req) is None else self._page0(req_prefix_len(req))

    def _resuming(self, req) -> RequestKV | None:
        """Parked `req`'s record while it holds no row yet (it is about to resume), else
        None."""
        rec = self.records.get(req.rid)
        return rec if rec is not None and rec.parked and req_row(req) is None else None

    def _page0(self, tokens: int) -> torch.Tensor:
        return page0_slots(tokens, self.block_size, self.req_to_token.device)

    def trim(self, rid: Hashable, blocks: int) -> None:
        """Parked `rid` keeps only its first `blocks` saved blocks (`0 < blocks <= saved`):
        the others' units leave the unit cache, they count as evicted no more and their
        host blocks go back to the free list, still promised to it. The kept prefix is
        untouched: the same blocks in the same host blocks."""
        rec = self.records.get(rid)
        if rec is None or not rec.parked or not 0 < blocks <= rec.saved:
            raise RuntimeError(f"request {rid} is not parked with {blocks} saved blocks")
        self.residency.forget(rec, blocks)
        self.wb.blocks.give_back(rec, blocks)
        rec.saved = blocks

    def unpark(self, req) -> None:
        """Parked `req` is prefilled whole after all (SGLang's way): its host copy goes
        (`release`) and its prefix is empty."""
        self.release(req.rid)
        set_req_prefix(req, torch.empty((0,), dtype=torch.int64))

    def resume(self, reqs) -> None:
        """An extend batch is set up: its parked requests have their new rows; decode
        reads their kept blocks from the host tier from now on, and the blocks after them
        are planned and saved from the new row as any request's. Raises if a request's
        prefix is not exactly its kept blocks (SGLang changed how it sets up a resumed
        request)."""
        for req in reqs:
            rec = self.records.get(req.rid)
            if rec is None or not rec.parked:
                continue
            kept = rec.saved * self.block_size
            if req_prefix_len(req) != kept:
                raise RuntimeError(
                    f"sglang-psa: parked request {req.rid} resumes with a prefix of "
                    f"{req_prefix_len(req)} tokens, {kept} were kept in the host tier"
                )
            rec.row, rec.parked = int(req_row(req)), False
            self.wb.read_from_host(req.rid, list(range(rec.saved)))
            self.resumed += 1
            self.resumed_host_tokens += kept
            self.resumed_recomputed_tokens += len(req.full_untruncated_fill_ids) - kept

    # -- a shared prefix --------------------------------------------------------------------
    def adopt(self, rid: Hashable, host_ids: list[int]) -> bool:
        """`rid`, new (reserved or unknown, nothing planned), starts with a prefix whose
        blocks are saved in the host tier as `host_ids` (held by other requests or kept
        for the prefix cache): its record holds those same host blocks, shared, not
        copied, all saved; its own blocks are planned after them. False, and nothing
        changes, when the host tier cannot give them (`HostBlocks.adopt`). Releasing it
        later leaves the blocks another holder has."""
        rec = self.records.get(rid) or RequestKV(rid)
        if rec.host or rec.parked or rec.row is not None:
            raise RuntimeError(f"request {rid} adopts a prefix after its blocks were planned")
        if not self.wb.blocks.adopt(rec, list(host_ids)):
            return False
        rec.saved = len(host_ids)
        self.records[rid] = rec
        return True

    # -- the end ---------------------------------------------------------------------------
    def release(self, rid: Hashable, finished: bool = False) -> None:
        """`rid` ended (finished, aborted, retracted without parking, refused at admission,
        or unparked): its record leaves the table and everything it held goes back, once.
        Its evicted blocks' units leave the unit cache (their request-table entries point
        at page 0, which the allocator hook keeps out of SGLang's free; with the last
        evicted block anywhere gone the cache gives its pages back), its unissued saves
        are dropped, its row reads HBM again and its host blocks and reservation return
        to the free list. Saves already issued complete before any later save to the same
        host blocks (each transport keeps issue order). Unknown `rid`: nothing of the
        store's. The listeners hear of every release, of a known `rid` or not (a request
        matched against the prefix cache may hold no record).

        `finished` (it ended, finished or aborted, and will not come back), with a prefix
        index (the psa radix cache): while saves it issued are in flight its record leaves
        the table and its row but keeps its host blocks (`WriteBack.ending`) until the last
        is acknowledged, so the index keeps those blocks too (a chat's next turn finds the
        whole answer); then the rest of the release (`_let_go`)."""
        rec = self.records.pop(rid, None)
        if rec is not None:
            self.residency.forget(rec)
            if finished and self.wb.index is not None and not rec.parked and self.wb.in_flight(rid):
                self.wb.leave_row(rec)
                self.wb.drop_plans(rid)
                self.wb.ending[rid] = rec
                return
        self._let_go(rid, rec)

    def _let_go(self, rid: Hashable, rec: RequestKV | None) -> None:
        """The end of `rid`'s release, at once or once its last save in flight was
        acknowledged (`WriteBack.ending`): its record's unissued saves, row and host blocks
        go (kept ones to the prefix index's LRU), and the listeners hear of it."""
        if rec is not None:
            self.wb.forget(rec)
        for fn in self.listeners:
            fn(rid)

    def report(self) -> dict[str, int]:
        """Retracted requests waiting with their KV in the host tier; resumptions, the
        prefix tokens they read from there and the tokens they computed again; matched
        prefix tokens in the host tier only that were computed again (too few to stage)."""
        return {
            "parked_requests": self.parked_requests,
            "resumed": self.resumed,
            "resumed_host_tokens": self.resumed_host_tokens,
            "resumed_recomputed_tokens": self.resumed_recomputed_tokens,
            "host_match_recomputed_tokens": self.host_match_recomputed_tokens,
            "host_match_taken_tokens": self.host_match_taken_tokens,
        }

    def check_integrity(self) -> None:
        """Every record's invariants (`RequestKV`), and the host blocks' free list against
        all records: no id lost or held twice, reservations summed."""
        for rid, rec in self.records.items():
            assert rec.rid == rid, f"record of {rec.rid!r} filed under {rid!r}"
            assert 0 <= rec.saved <= rec.planned and rec.reserved >= 0, rid
            if rec.evicted is not None:
                assert not rec.evicted[rec.saved :].any(), f"{rid!r}: an unsaved block evicted"
            if rec.row is not None:  # (a sync: tests only)
                loc = self.wb.host_loc[rec.row].nonzero().flatten().tolist()
                assert set(loc) == rec.host_read, f"{rid!r}: host reads {loc}, {rec.host_read}"
            if rec.parked:
                assert rec.row is None and not rec.on_host, f"{rid!r}: parked with a row"
                assert rec.planned == rec.saved > 0, f"{rid!r}: parked beyond its saved blocks"
                assert rec.evicted is not None and rec.evicted[: rec.saved].all(), (
                    f"{rid!r}: a kept block still in HBM"
                )
        for rid, rec in self.wb.ending.items():
            assert rid not in self.records and rec.rid == rid, f"{rid!r}: ending and running"
            assert not rec.on_host and not rec.parked, f"{rid!r}: ending with a row"
        self.wb.blocks.check_integrity([*self.records.values(), *self.wb.ending.values()])
