"""The `psa` radix cache: SGLang's `RadixCache` with the tiered store's part of prefix
caching (`--psa-kv-home tiered`, `--radix-cache-backend psa`; docs/prefix-tiered.md).

Each override calls SGLang's method and adds the tiered store's part:
- `match_prefix`: SGLang's device match, extended by the keeper (`PrefixIndex`) with the
  saved blocks that follow it (host-only: their entries at page 0, as a parked request
  resumes); a request (`params.req`) adopts the host ids of its whole matched prefix
  (`TieredRequests.adopt`). Where it cannot (the host tier's reservations are short), the
  match stops before the first block it would read from the host tier; an extension
  shorter than `--psa-host-prefix-min-tokens` is not taken (computed again).
  From 0.5.23 on a match is a length (`device_prefix_len`), extended the same way, and
  SGLang reads its slots at allocation (`prefix_device_indices`: the tree's path, then
  the extension's entries at page 0).
- the insert (0.5.17: `cache_unfinished_req` / `cache_finished_req`; 0.5.23:
  `checkpoint`, each chunk and at release): after SGLang's insert (its duplicate pages
  freed, the row rewritten with the tree's pages), the request's blocks that the index
  names with another id switch to that id (`HostBlocks.switch`; their unissued saves
  dropped) and its own saved blocks the index lacks enter it; the row's prefix is the
  tree's (a host-only block another request computed meanwhile reads its page).
- 0.5.23's release: `free_kv_row` (the row's frees outside the tree) skips entries at
  page 0 as the tree's own frees do; `on_release` drops the request's state (released
  uninserted, a retraction or an abort: its blocks are switched as at an insert first).
- `evict`: SGLang's LRU eviction, repeated until `num_tokens` HBM slots are free; entries
  at page 0 never reach the allocator. `evictable_size` / `protected_size` count HBM
  slots only (page-0 tokens per node move between the two in the lock walks).
- the host tier taking a kept block back (`PrefixIndex.listeners`): the tree node holding
  it at page 0 is cut there, its descendants deleted (none is locked: a lock means a
  holder of the whole path).

- residency giving back a page the tree shares (`sharers`, `left_hbm`): who maps it
  (the holders of its host id whose path passes the node: all of the node's locks, no
  request matched through it waiting), and the node's entry at page 0.
- a request released (`TieredRequests.listeners`, dropped from the waiting queue too):
  the index stops tracking it.

Tree nodes carry `psa_host`: per block of the node, the host id of a block at page 0
(None where the block has an HBM page), or None for a node with no block at page 0.
The page size is the PSA block size. The prefix index's namespace is the request's
`extra_key` and its cache salt (0.5.23 keys its tree by both; 0.5.17 has the salt in
`extra_key`).
"""

from __future__ import annotations

import contextlib
from bisect import bisect_right

import torch
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache, TreeNode

from sglang_psa.config import PSAConfig
from sglang_psa.mem_cache.prefix_index import JoinedTokens, PrefixIndex
from sglang_psa.mem_cache.request_kv import TieredRequests, page0_slots
from sglang_psa.mem_cache.residency import AT_PAGE0
from sglang_psa.mem_cache.writeback import to_device
from sglang_psa.releases import has, req_protected_len, req_row, req_salt
from sglang_psa.sched.host_timing import timed

BACKEND = "psa"

# The release caches requests through `checkpoint` / `free_kv_row` / `on_release` and
# matches a prefix as a length (0.5.23), not through `cache_*_req` with its slots (0.5.17).
_CHECKPOINT = has("tree_checkpoint")

_SHARED = (
    ("__init__", ("self", "params")),
    ("reset", ("self",)),
    ("match_prefix", ("self", "params")),
    ("evict", ("self", "params")),
    ("inc_lock_ref", ("self", "node")),
    ("dec_lock_ref", ("self", "node", "params")),
    ("evictable_size", ("self",)),
    ("protected_size", ("self",)),
    ("_split_node", ("self", "key", "child", "split_len")),
    ("_delete_leaf", ("self", "node")),
)
# Per release, SGLang's `RadixCache` methods overridden here, with the parameters each
# override passes on to `super()` (in order); the test checks them against SGLang's.
OVERRIDES: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "0.5.17": _SHARED
    + (
        ("cache_unfinished_req", ("self", "req", "chunked")),
        ("cache_finished_req", ("self", "req", "is_insert", "kv_len_to_handle")),
        ("_insert_helper", ("self", "node", "key", "value", "priority", "chunked")),
    ),
    "0.5.23": _SHARED
    + (
        ("checkpoint", ("self", "req", "up_to")),
        ("free_kv_row", ("self", "kv", "ranges")),
        ("on_release", ("self", "req", "checkpointed")),
        ("prefix_device_indices", ("self", "req")),
        ("_insert_helper", ("self", "node", "key", "value", "priority", "inserted_len")),
    ),
}


class _HbmOnly:
    """SGLang's allocator as the tree's frees see it: entries at page 0 are not freed, nor
    pages the tree took from the inserting request. `page0(free_index, start_pos)` names
    the segment's blocks at page 0 and those it keeps (two sets; block `b` holds positions
    `[b * page, (b + 1) * page)` of the segment's frame) from host-side records, so the
    runs between them are freed as slices, without reading the entries; `verify` checks
    the page-0 set against the entries (a sync: tests)."""

    def __init__(self, allocator, page_size: int, page0, verify: bool = False):
        self._alloc, self._ps, self._page0, self._verify = allocator, page_size, page0, verify

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        n, ps = free_index.numel(), self._ps
        zero, kept = self._page0(free_index, start_pos) if n else (set(), set())
        if self._verify:
            want = [(start_pos + i) // ps in zero for i in range(n)]
            assert (free_index < ps).tolist() == want, f"page-0 entries at {start_pos}: {zero}"
        skip = zero | kept
        i = 0
        while i < n:  # the runs of blocks not skipped
            j = i
            while j < n and (start_pos + j) // ps not in skip:
                j = min(n, ((start_pos + j) // ps + 1) * ps - start_pos)
            if j > i:
                self._alloc.free_segment(free_index[i:j], start_pos=start_pos + i)
            i = min(n, ((start_pos + j) // ps + 1) * ps - start_pos) if j < n else n

    def free_segments(self, segments) -> None:
        for idx, start in segments:
            self.free_segment(idx, start_pos=start)

    def __getattr__(self, name):
        return getattr(self._alloc, name)


# A node with more blocks leaving HBM at once than this gets its page-0 entries in one
# indexed write (a copy of the block numbers to the device and the write) instead of a
# slice write a block.
_SLICE_WRITES = 2


class PsaRadixCache(RadixCache):
    """SGLang's radix cache over the tiered store's host blocks (see the module doc)."""

    def __init__(
        self,
        params,
        requests: TieredRequests,
        index: PrefixIndex,
        min_host_tokens: int = PSAConfig.host_prefix_min_tokens,
    ):
        """`min_host_tokens`: the shortest extension of a match from the host tier
        (`--psa-host-prefix-min-tokens`; shorter runs are computed again)."""
        super().__init__(params)
        if self.page_size != index.block_size or self.is_eagle:
            raise ValueError(
                f"the psa radix cache needs page size = PSA block size ({index.block_size}) "
                f"and no EAGLE bigram keys (page size {self.page_size}, eagle {self.is_eagle})"
            )
        self.requests, self.index = requests, index
        self.min_host_tokens = min_host_tokens
        self._short: set = set()  # rids whose short host-tier run was declined (counted)
        self.wb = requests.wb
        self.blocks = self.wb.blocks
        self._inserting = None  # the record whose row SGLang inserts
        self._taken: set[int] = set()  # its blocks whose pages the tree took (that insert)
        # Page-0 entries are known from host-side records, never read from the GPU;
        # `verify` (tests) checks each such answer against the entries (a sync).
        self.verify = False
        self._maybe_page0: set = set()  # rids whose rows may have entries at page 0
        self._reqs: dict = {}  # rid -> SGLang's request, from its first match to its release
        index.listeners.append(self._cut)
        requests.listeners.append(self._forget)
        requests.residency.sharing = self  # a page the tree shares leaves HBM for all

    def reset(self):
        """A new tree (construction, and SGLang's `/flush_cache`, which runs only when
        no request is held): the host tier's kept prefixes go with it, as the hierarchical
        cache's flush clears its host pool: every kept block without a holder is freed
        and the index forgets it (not counted as evictions)."""
        super().reset()
        self.root_node.psa_host = None
        self._p0_evictable = self._p0_protected = 0  # page-0 tokens in unlocked/locked nodes
        self._host_nodes: dict[int, TreeNode] = {}  # host id at page 0 -> its tree node
        if getattr(self, "index", None) is not None:  # not at construction
            blocks = self.index.blocks
            blocks.evict_lru(len(blocks.lru), count=False)

    # -- sizes: HBM slots only ----------------------------------------------------------
    def evictable_size(self):
        return super().evictable_size() - self._p0_evictable

    def protected_size(self):
        return super().protected_size() - self._p0_protected

    def _p0(self, node: TreeNode) -> int:
        ids = getattr(node, "psa_host", None)
        return 0 if ids is None else self.page_size * sum(i is not None for i in ids)

    def inc_lock_ref(self, node: TreeNode):
        if not self.disable:
            n = node
            while n != self.root_node:
                if n.lock_ref == 0 and (p := self._p0(n)):
                    self._p0_evictable -= p
                    self._p0_protected += p
                n = n.parent
        return super().inc_lock_ref(node)

    def dec_lock_ref(self, node: TreeNode, params=None):
        if not self.disable:
            n = node
            while n != self.root_node:
                if n.lock_ref == 1 and (p := self._p0(n)):
                    self._p0_evictable += p
                    self._p0_protected -= p
                n = n.parent
        return super().dec_lock_ref(node, params)

    # -- tree structure: page-0 blocks follow their nodes -------------------------------
    if _CHECKPOINT:

        def _insert_helper(self, node, key, value, priority=0, inserted_len=0):
            return self._psa_insert(node, key, value, priority, inserted_len)

    else:

        def _insert_helper(self, node, key, value, priority=0, chunked=False):
            return self._psa_insert(node, key, value, priority, chunked)

    def _psa_insert(self, node, key, value, priority, rest):
        """SGLang's `_insert_helper` (`rest`: its fifth argument, `chunked` in 0.5.17,
        `inserted_len` from 0.5.23 on); the node it creates for the key's tail names the
        inserting request's blocks at page 0."""
        prefix_len, last = super()._insert_helper(node, key, value, priority, rest)
        if not hasattr(last, "psa_host"):  # SGLang created it for the key's tail
            last.psa_host = None
            rec = self._inserting
            if rec is not None and rec.rid in self._maybe_page0:
                ps = self.page_size
                start = (len(key) - len(last.key)) // ps
                # The node's blocks are the request's own (the tree ended before them,
                # and its lock keeps the path to its protected length): at page 0 where
                # they left HBM, or were read from the host tier (`evicted`).
                gone = rec.evicted
                zero = [
                    gone is not None and start + j < len(gone) and bool(gone[start + j])
                    for j in range(len(last.key) // ps)
                ]
                if self.verify:
                    assert (last.value[::ps] < ps).tolist() == zero, (rec.rid, start, zero)
                if any(zero):
                    last.psa_host = [rec.host[start + j] if z else None for j, z in enumerate(zero)]
                    for i in last.psa_host:
                        if i is not None:
                            assert i not in self._host_nodes, f"host block {i} twice in the tree"
                            self._host_nodes[i] = last
                    self._p0_evictable += self._p0(last)
        return prefix_len, last

    def _split_node(self, key, child, split_len):
        new = super()._split_node(key, child, split_len)
        ids = getattr(child, "psa_host", None)
        new.psa_host = None
        if ids is not None:
            k = split_len // self.page_size
            head, tail = ids[:k], ids[k:]
            new.psa_host = head if any(i is not None for i in head) else None
            child.psa_host = tail if any(i is not None for i in tail) else None
            for i in head:
                if i is not None:
                    self._host_nodes[i] = new
        return new

    def _delete_leaf(self, node):
        super()._delete_leaf(node)
        self._p0_evictable -= self._p0(node)
        for i in getattr(node, "psa_host", None) or ():
            if i is not None:
                del self._host_nodes[i]

    @contextlib.contextmanager
    def _hbm_frees(self):
        """SGLang's frees within skip page 0 (entries of blocks read from the host tier)."""
        alloc = self.token_to_kv_pool_allocator
        if self._maybe_page0 or self._host_nodes or self._taken:
            nodes = {id(n.value): n for n in set(self._host_nodes.values())}
            page0 = lambda idx, start: self._page0_freed(nodes, idx, start)  # noqa: E731
            self.token_to_kv_pool_allocator = _HbmOnly(alloc, self.page_size, page0, self.verify)
        try:
            yield
        finally:
            self.token_to_kv_pool_allocator = alloc

    # -- the scheduler's calls ----------------------------------------------------------
    def match_prefix(self, params) -> MatchResult:
        return self._match_host(params, super().match_prefix(params))

    @timed("match_prefix")
    def _match_host(self, params, res: MatchResult) -> MatchResult:
        """`match_prefix`'s own part: SGLang's tree matched `res`; the prefix index extends
        it with blocks held in the host tier (every queued prompt is matched each round
        SGLang offers its queue)."""
        req = params.req
        if self.disable or req is None:
            return res
        self._reqs[req.rid] = req
        rec = self.requests.records.get(req.rid)
        if rec is not None and (rec.row is not None or rec.parked):
            return res  # running or parked: its blocks are its own already
        ps, key = self.page_size, params.key
        self._track(req)
        if len(self.index) == 0 and not self._host_nodes and (rec is None or not rec.host):
            return res  # nothing saved to extend it with (`--psa-writeback-start`): no hashing
        # The saved run of the key's blocks: beyond the device match it is read from the
        # host tier; short of it (a device block not saved yet) only the run is adopted.
        want = self.index.lookup(self.index.request_hashes(req.rid, len(key) // ps))
        device = _match_len(res) // ps
        extra = max(0, len(want) - device)
        # The host run: from the first block the tree holds at page 0 (else the end of
        # the device match) to the end of the index's extension. A run shorter than
        # `min_host_tokens` is computed again (the match cut before it); the tree then
        # takes the pages it is computed into (`_take_computed`, at the insert).
        first0 = self._first_page0(res) if self._host_nodes else device
        run = max(len(want), device) - first0
        if 0 < run * ps < self.min_host_tokens:
            if req.rid not in self._short:  # (a waiting request is matched every round)
                self._short.add(req.rid)
                self.requests.host_match_recomputed_tokens += run * ps
            want, extra = want[:first0], 0
            res = self._cut_match(res, first0)
        if rec is not None and rec.host == want:
            ok = True
        else:
            if rec is not None and rec.host:  # an earlier round adopted another prefix
                self.blocks.give_back(rec, 0)
                rec.saved = 0
            ok = not want or self.requests.adopt(req.rid, want)
        if not ok:  # (the match's first page-0 block is `first0`, cut or not)
            return self._cut_match(res, first0)
        if not extra:
            return res
        self._maybe_page0.add(req.rid)
        if _CHECKPOINT:  # SGLang reads the slots at allocation (`prefix_device_indices`)
            return res._replace(device_prefix_len=res.device_prefix_len + extra * ps)
        page0 = page0_slots(extra * ps, ps, res.device_indices.device)
        return res._replace(device_indices=torch.cat([res.device_indices, page0]))

    def prefix_device_indices(self, req) -> torch.Tensor:
        """(0.5.23) The slots of `req`'s matched prefix (`req.prefix_len`, its locked
        `req.last_node`): the tree's path, then the blocks the index extended the match
        with, at page 0."""
        path = self.path_device_indices(req.last_node)
        n = req.prefix_len
        if len(path) >= n:
            return path[:n]
        ps = self.page_size
        assert len(path) % ps == 0 and n % ps == 0, (req.rid, len(path), n)
        self._verify_page0(path, self._page0_blocks(req.last_node))
        return torch.cat([path.to(torch.int64), page0_slots(n - len(path), ps, path.device)])

    def cache_unfinished_req(self, req, chunked=False):
        """(0.5.17) SGLang's insert of a running request, then the tiered store's part."""
        rec = self._before_insert(req, len(req.get_fill_ids()) // self.page_size)
        try:
            with self._hbm_frees():
                super().cache_unfinished_req(req, chunked)
        finally:
            self._inserting, self._taken = None, set()
        if rec is not None and not self.disable:
            self._after_insert(req, rec)

    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        """(0.5.17) SGLang's insert (`is_insert`) and frees of an ending request, then its
        blocks switch to the index's ids (inserted or not)."""
        rec = self._before_insert(req, kv_len_to_handle // self.page_size if is_insert else 0)
        try:
            with self._hbm_frees():
                super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        finally:
            self._inserting, self._taken = None, set()
        self._maybe_page0.discard(req.rid)
        self._reqs.pop(req.rid, None)
        if rec is not None and not self.disable:
            self._share(req, rec, kv_len_to_handle // self.page_size)
        # (the index tracks its tokens until its release: saves in flight still land)

    def checkpoint(self, req, *, up_to: int, **kwargs):
        """(0.5.23) SGLang's insert of `req`'s row up to `up_to` (a chunk, or at release),
        then the tiered store's part: a finished request's blocks switch to the index's
        ids (as `cache_finished_req`), a running one's too, its row's prefix the tree's
        (as `cache_unfinished_req`)."""
        rec = self._before_insert(req, up_to // self.page_size)
        try:
            with self._hbm_frees():
                super().checkpoint(req, up_to=up_to, **kwargs)
        finally:
            self._inserting, self._taken = None, set()
        if rec is None or self.disable:
            return
        if req.finished():
            self._share(req, rec, up_to // self.page_size)
        else:
            self._after_insert(req, rec)

    def free_kv_row(self, kv, ranges):
        """(0.5.23) SGLang frees row positions `ranges` of `kv`'s row (outside the tree):
        the request's entries at page 0 (its blocks that left HBM) are skipped, as in the
        tree's own frees."""
        row = kv.req_pool_idx
        rec = next((r for r in self.requests.records.values() if r.row == row), None)
        prev, self._inserting = self._inserting, rec
        if rec is not None and rec.evicted is not None:
            self._maybe_page0.add(rec.rid)
        try:
            with self._hbm_frees():
                super().free_kv_row(kv, ranges)
        finally:
            self._inserting = prev

    def on_release(self, req, *, checkpointed: bool) -> None:
        """(0.5.23) `req` left (its row freed, its lock dropped; the tiered store releases
        it next): its state here goes. Released uninserted (`checkpointed` false: a
        retraction or an abort), its blocks switch to the index's ids first, as 0.5.17's
        `cache_finished_req(is_insert=False)` does, so its saves still landing enter the
        index along the chain."""
        super().on_release(req, checkpointed=checkpointed)
        self._maybe_page0.discard(req.rid)
        self._reqs.pop(req.rid, None)
        rec = self.requests.records.get(req.rid)
        if not checkpointed and rec is not None and not self.disable:
            self._share(req, rec, rec.planned)

    def _before_insert(self, req, blocks: int):
        """SGLang inserts `req`'s row, its first `blocks` blocks: its record (None: not at
        the tiered store), set as the one inserting, its row looked at for page 0 where
        blocks left HBM; the tree's page-0 blocks it computed again take its pages."""
        rec = self._inserting = self.requests.records.get(req.rid)
        self._taken = set()
        if rec is not None and rec.evicted is not None:
            self._maybe_page0.add(req.rid)  # (residency gave pages of its blocks back)
        if rec is not None and rec.row is not None and self._host_nodes and not self.disable:
            self._take_computed(req, rec, blocks)
        return rec

    def _take_computed(self, req, rec, blocks: int) -> None:
        """Blocks of `req` past its protected length that it computed (a host run the
        match declined, `min_host_tokens`) where SGLang's tree holds the same prefix at
        page 0: the tree's entry takes the request's page, so the block is in HBM for
        every later match, and SGLang's free of the request's duplicates skips it
        (`_taken`). Only at a node no request locks: a lock means a holder whose row
        names the tree's entry (page 0). The host id stays the index's (the request
        switches to it in `_share`); its units leave the unit cache with its last holder
        (`Residency.forget`), as before."""
        ps, row = self.page_size, req_row(req)
        first = req_protected_len(req) // ps
        gone = rec.evicted
        hashes = self.index.request_hashes(req.rid, blocks)
        table = self.req_to_token_pool.req_to_token
        at: dict[int, tuple] = {}  # id(node) -> (node, host id -> its block in the node)
        for b in range(first, len(hashes)):
            h = self.index.get(hashes[b])
            node = None if h is None else self._host_nodes.get(h)
            if node is None or node.lock_ref or (gone is not None and b < len(gone) and gone[b]):
                continue
            if id(node) not in at:
                at[id(node)] = (node, {i: k for k, i in enumerate(node.psa_host) if i is not None})
            k = at[id(node)][1][h]
            node.value[k * ps : (k + 1) * ps] = table[row, b * ps : (b + 1) * ps]
            node.psa_host[k] = None
            del self._host_nodes[h]
            self._p0_evictable -= ps
            self._taken.add(b)
            self.requests.host_match_taken_tokens += ps
        for node, _ in at.values():  # (a node with no block left at page 0 names none)
            if all(i is None for i in node.psa_host):
                node.psa_host = None

    def _after_insert(self, req, rec) -> None:
        """After SGLang's insert of running `req` (its lock moved to its new `last_node`):
        its row's prefix is the tree's, its blocks switch to the index's ids, and the
        tree's entries at page 0 on its path are read from the host tier."""
        n = req_protected_len(req)
        if req.rid in self._maybe_page0:
            # The row's prefix is the tree's: SGLang rewrote it from the old protected
            # length on; before it, a block read from the host tier may have been
            # computed by another request meanwhile (the tree has its page).
            slots = self.path_device_indices(req.last_node) if _CHECKPOINT else req.prefix_indices
            self.req_to_token_pool.write((req_row(req), slice(0, n)), slots[:n])
        self._share(req, rec, n // self.page_size)
        if self._host_nodes and rec.row is not None:
            # SGLang rewrote the row with the tree's entries, some at page 0 (blocks it
            # computed that the tree has only in the host tier): decode reads them there.
            zero = self._page0_blocks(req.last_node)
            if zero:
                self._maybe_page0.add(req.rid)
                self.wb.read_from_host(req.rid, zero)

    def evict(self, params: EvictParams) -> EvictResult:
        if self.disable:
            return super().evict(params)
        want, freed = params.num_tokens, 0
        with self._hbm_frees():
            while freed < want and self.evictable_leaves:
                before = self.evictable_size()
                res = super().evict(EvictParams(num_tokens=want - freed))
                freed += before - self.evictable_size()
                if not res.num_tokens_evicted:
                    break
        return EvictResult(num_tokens_evicted=freed)

    # -- the tiered store's part --------------------------------------------------------
    def _forget(self, rid) -> None:
        """`rid` was released (`TieredRequests.release`: finished, aborted, or dropped
        from SGLang's waiting queue after a match): the index stops tracking its tokens
        and its row has no entries at page 0 to look for."""
        self.index.untrack(rid)
        self._short.discard(rid)
        self._maybe_page0.discard(rid)
        self._reqs.pop(rid, None)

    def _track(self, req) -> None:
        """The index hashes `req`'s blocks in its namespace (extra key and cache salt)."""
        self.index.track(
            req.rid,
            req.extra_key,
            lambda: JoinedTokens(req.origin_input_ids, req.output_ids),
            salt=req_salt(req),
        )

    def _path_slots(self, node: TreeNode) -> torch.Tensor:
        """The tree's slots on the path to `node`, on either release (0.5.23's own
        `path_device_indices` serves where only 0.5.23 runs; 0.5.17 lacks it)."""
        vals = [n.value for n in self._nodes(node)]
        return torch.cat(vals) if vals else torch.empty(0, dtype=torch.int64)

    def _nodes(self, node: TreeNode) -> list[TreeNode]:
        """The tree path from the root's child to `node`."""
        out = []
        while node is not None and node is not self.root_node:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def _page0_freed(self, nodes: dict, free_index: torch.Tensor, start_pos: int) -> tuple:
        """The blocks at page 0 of a segment SGLang frees inside an override, and those
        whose pages stay: a tree node's value (`nodes`: those with page-0 entries, by
        their value's identity), else a stretch of the inserting request's row from
        `start_pos` on, which holds its own blocks (the tree's lie before its protected
        length): at page 0 where they are `evicted`, kept where the tree took them
        (`_taken`)."""
        node = nodes.get(id(free_index))
        if node is not None and node.value is free_index:
            return {k for k, i in enumerate(node.psa_host) if i is not None}, set()
        rec, ps = self._inserting, self.page_size
        first, end = start_pos // ps, -(-(start_pos + free_index.numel()) // ps)
        kept = {b for b in self._taken if first <= b < end}  # the tree's pages now
        gone = None if rec is None else rec.evicted
        if gone is None:
            return set(), kept
        return {b for b in range(first, min(len(gone), end)) if gone[b]}, kept

    def page0_prefix(self, req) -> list[int]:
        """For residency, when `req`'s extend is set up (`Residency.read_prefix_from_host`):
        the blocks of its matched prefix at page 0 (held only in the host tier): the
        tree's entries there on its path, then the blocks the index extended the match
        with (their entries at page 0 up to the row's part the tree owns, which is the
        match before its first insert); from the tree, no GPU read (`verify`: the row)."""
        own = req_protected_len(req)
        if not own or not (req.rid in self._maybe_page0 or self._host_nodes):
            return []
        path = sum(len(n.key) for n in self._nodes(req.last_node)) // self.page_size
        zero = self._page0_blocks(req.last_node)
        zero += range(path, own // self.page_size)
        if self.verify and req_row(req) is not None:
            self._verify_page0(self.req_to_token_pool.req_to_token[req_row(req), :own], zero)
        return zero

    def _verify_page0(self, slots: torch.Tensor, zero: list[int]) -> None:
        """With `verify`: `zero` is every block of `slots` (block-aligned) at page 0."""
        if self.verify:
            ps = self.page_size
            got = (slots[::ps] < ps).nonzero().flatten().tolist()
            assert got == zero, f"page-0 blocks {got}, named {zero}"

    def _page0_blocks(self, node: TreeNode) -> list[int]:
        """The blocks of the tree path to `node` at page 0 (from the nodes' `psa_host`)."""
        out, at = [], 0
        for n in self._nodes(node):
            if n.psa_host is not None:
                out += [at + k for k, i in enumerate(n.psa_host) if i is not None]
            at += len(n.key) // self.page_size
        return out

    def sharers(self, rec, blocks: list[int]) -> dict:
        """For residency (`Residency.evict`): who maps each of `rec`'s `blocks` (saved, not
        `evicted`) to the same HBM page, as `b -> (records, (node, k) or None)`. Beyond
        `rec`'s tree path the page is its own (`[rec]`, None), or none at all
        (`AT_PAGE0`: a block of its matched prefix read from the host tier, before its
        first insert); on the path it is at page 0 where the tree's is (`AT_PAGE0`), else
        the page is block `k`
        of tree `node`, mapped by every request whose path passes the node, each holding
        the index's host id for it (invariant 3): the records holding that id whose path
        passes the node. Left out (the page stays in HBM for now) where the tree could not
        switch every request mapping it: a lock the holders do not account for (a request
        that computed the block itself and holds its own host id until its next insert, or
        the adder's own lock), a request matched through the node but not admitted (its
        prefix names the page), a holder whose saves do not reach the block yet, or a host
        id the index does not name."""
        out: dict = {}
        req = self._reqs.get(rec.rid)
        if self.disable or req is None:
            return {b: ([rec], None) for b in blocks}
        ps = self.page_size
        path = self._nodes(req.last_node)
        starts, at = [], 0
        for node in path:
            starts.append(at)
            at += len(node.key) // ps
        # Before its first insert, a prefix's blocks after the tree's are at page 0.
        pre = req_protected_len(req) // ps
        waiting = None  # nodes on the paths of requests matched, not admitted
        paths: dict = {}  # rid -> ids of the nodes on its path (walked once a call)
        runs: dict = {}  # id(record) -> its saved run (`HostBlocks.advance`), once a call
        # (a prompt's eviction asks hundreds of blocks: the loop reads each once, locally)
        reqs, names, holders_of, advance = (
            self._reqs,
            self.index.names,
            self.blocks.holders,
            self.blocks.advance,
        )

        def run_of(q) -> int:
            run = runs.get(id(q))
            if run is None:
                run = runs[id(q)] = advance(q)
            return run

        def holding(b: int, h: int, node) -> list | None:
            """The requests mapping the page of block `b` (host id `h`) of `node`, if
            the tree can switch them all; else None."""
            holders, mine, nid = [], False, id(node)
            for q in holders_of(h):
                r = reqs.get(q.rid)
                if q.row is None or r is None:
                    continue
                ids = paths.get(q.rid)
                if ids is None:
                    ids = paths[q.rid] = set(map(id, self._nodes(r.last_node)))
                if nid not in ids:
                    continue
                if run_of(q) <= b:
                    return None
                holders.append(q)
                mine = mine or q is rec
            return holders if mine and len(holders) == node.lock_ref else None

        host, alone = rec.host, [rec]  # (one list for its own pages: read only)
        for b in blocks:
            if b >= at:
                out[b] = ([rec], AT_PAGE0 if b < pre else None)
                continue
            j = bisect_right(starts, b) - 1  # the path node holding block b
            node, k, h = path[j], b - starts[j], host[b]
            if node.psa_host is not None and node.psa_host[k] is not None:
                out[b] = ([rec], AT_PAGE0)  # the tree has it at page 0: so has its row
                continue
            if not names(h):
                continue
            if waiting is None:
                waiting = set()
                for rid, r in reqs.items():
                    q = self.requests.records.get(rid)
                    if q is None or q.row is None:
                        waiting.update(map(id, self._nodes(r.last_node)))
            if id(node) in waiting:
                continue
            if node.lock_ref == 1:
                # `rec`'s lock alone: an admitted request on the node's path locks it, so
                # no other maps the page (most of a prompt's blocks; `verify` checks it)
                held = alone if run_of(rec) > b else None
                if self.verify:
                    assert held == holding(b, h, node), (rec.rid, b, "a lone holder's page")
            else:
                held = holding(b, h, node)
            if held is not None:
                out[b] = (held, (node, k))
        return out

    def left_hbm(self, entries: list, rids: list) -> None:
        """Residency gave back pages the tree held: `entries`, `((node, k), host id)`,
        block `k` of `node` is at page 0 from now on, read from the host tier at that id;
        the requests `rids` have blocks at page 0 (their inserts look for them)."""
        ps, by_node, page0 = self.page_size, {}, None
        for (node, k), _ in entries:
            by_node.setdefault(id(node), (node, []))[1].append(k)
        for node, ks in by_node.values():  # (every node's value: one dtype, one device)
            v = node.value
            if page0 is None:
                page0 = torch.arange(ps, dtype=v.dtype, device=v.device)
            if len(ks) <= _SLICE_WRITES:  # a launch a block
                for k in ks:
                    v[k * ps : (k + 1) * ps] = page0
            else:  # a prompt's many blocks: one copy to the device, one indexed write
                v.view(-1, ps)[to_device(ks, v.device)] = page0
        for (node, k), h in entries:
            if node.psa_host is None:
                node.psa_host = [None] * (len(node.key) // ps)
            assert node.psa_host[k] is None and h not in self._host_nodes, h
            node.psa_host[k] = h
            self._host_nodes[h] = node
            if node.lock_ref:
                self._p0_protected += ps
            else:
                self._p0_evictable += ps
        self._maybe_page0.update(rids)

    def _share(self, req, rec, blocks: int) -> None:
        """`rec`'s first `blocks` blocks are in the tree: those the index names with
        another id switch to it; its saved blocks the index lacks enter it."""
        self._track(req)
        n = min(blocks, rec.planned)
        ids = self.index.lookup(self.index.request_hashes(req.rid, n))
        moves = []  # (block, its old id)
        for b, i in enumerate(ids):
            if rec.host[b] != i:
                old = rec.host[b]
                if not self.blocks.switch(rec, b, i):
                    break
                moves.append((b, old))
        switched = [b for b, _ in moves]
        if switched:
            self.wb.drop_plans(req.rid, set(switched))
            self.requests.residency.switched(rec, moves)
        self.blocks.advance(rec)
        self.index.saved(rec)
        if rec.row is not None and switched:
            # Decode reads these blocks from the host tier where it did: at the new ids.
            self.wb.read_from_host(req.rid, [b for b in switched if b in rec.host_read])

    def _first_page0(self, res: MatchResult) -> int:
        """The first block of a match at page 0 (its length in blocks if none): SGLang's
        match is the tree's path, whose page-0 blocks the nodes name."""
        zero = self._page0_blocks(res.last_device_node)
        if self.verify:
            self._verify_page0(self._path_slots(res.last_device_node), zero)
        return zero[0] if zero else _match_len(res) // self.page_size

    def _cut_match(self, res: MatchResult, blocks: int) -> MatchResult:
        """`res` cut to its first `blocks` blocks (the tree split at the boundary)."""
        ps, end = self.page_size, blocks * self.page_size
        if end >= _match_len(res):
            return res
        node, stop = res.last_device_node, _match_len(res)  # node: [stop - len, stop)
        while node is not self.root_node and stop - len(node.key) >= end:
            stop -= len(node.key)
            node = node.parent
        start = stop - len(node.key)
        if node is not self.root_node and end - start < len(node.key):
            node = self._split_node(node.key, node, end - start)
        assert end % ps == 0
        if _CHECKPOINT:
            cut = {"device_prefix_len": end}
        else:
            cut = {"device_indices": res.device_indices[:end]}
        return res._replace(
            **cut,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
        )

    def _cut(self, ids: list[int]) -> None:
        """The host tier took `ids` back: a node holding one at page 0 is cut there and
        the rest of it, with its descendants, deleted (their HBM pages freed)."""
        for i in ids:
            node = self._host_nodes.get(i)
            if node is None:
                continue
            k = node.psa_host.index(i)
            if k:
                self._split_node(node.key, node, k * self.page_size)
            self._delete_subtree(node)

    def _delete_subtree(self, top: TreeNode) -> None:
        order, stack = [], [top]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        with self._hbm_frees():
            for n in reversed(order):  # leaves first
                if n.lock_ref:
                    raise RuntimeError("a locked tree node lost a host block at page 0")
                self.token_to_kv_pool_allocator.free_segment(n.value, start_pos=0)
                self._delete_leaf(n)
                if _CHECKPOINT:
                    self.kv_events.record_remove(n)
                else:
                    self._record_remove_event(n)

    def check_integrity(self) -> None:
        """The tree's page-0 blocks: each names a kept or held host id the index has, the
        node map agrees, and the sizes count HBM slots only (recounted from the tree)."""
        ps = self.page_size
        ev = pr = 0
        seen = {}
        stack = list(self.root_node.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            zero = (n.value[::ps] < ps).tolist()
            ids = getattr(n, "psa_host", None) or [None] * len(zero)
            assert [i is not None for i in ids] == zero, "a page-0 block without its host id"
            hbm = len(n.key) - ps * sum(zero)
            if n.lock_ref:
                pr += hbm
            else:
                ev += hbm
            for i in ids:
                if i is not None:
                    seen[i] = n
                    assert self.blocks.refs[i] > 0 or i in self.blocks.lru, i
                    assert self.index._hash.get(i) is not None, f"host block {i} not indexed"
        assert seen == self._host_nodes, "the page-0 node map drifted"
        assert (ev, pr) == (self.evictable_size(), self.protected_size()), (
            f"HBM sizes {(self.evictable_size(), self.protected_size())}, tree has {(ev, pr)}"
        )


def _match_len(res: MatchResult) -> int:
    """The tokens of a match on the device (a length from 0.5.23 on, slots before)."""
    return res.device_prefix_len if _CHECKPOINT else len(res.device_indices)


def factory(ctx) -> PsaRadixCache:
    """SGLang's `RadixCacheFactory` for `--radix-cache-backend psa`: the tree over this
    process's tiered store (its keeper made here, fed by the write-back)."""
    from sglang_psa.sched.process import current

    process = current()
    requests = None if process is None else process.requests
    if requests is None:
        raise ValueError(
            "--radix-cache-backend psa needs --psa-kv-home tiered (the tiered store was "
            "not set up when SGLang built its tree cache)"
        )
    wb = requests.wb
    if wb.index is None:
        wb.index = PrefixIndex(wb.blocks, wb.block_size)
    return PsaRadixCache(
        ctx.params, requests, wb.index, min_host_tokens=process.cfg.host_prefix_min_tokens
    )


def register() -> None:
    """Registers the `psa` backend with SGLang's radix cache registry (once)."""
    from sglang.srt.mem_cache import registry

    if BACKEND not in registry.registered_radix_cache_backends():
        registry.register_radix_cache_backend(BACKEND, factory)
