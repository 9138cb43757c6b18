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
   (`integration.scheduling.around_release_page_ids`) drops page 0 from the
   request's eventual free;
4. the page goes back to SGLang's allocator (`free_segment`: fixed shape, no sync).
A forward already launched reads either copy: both hold the same KV until a
later forward, ordered after these writes, writes the page again.

Victims: the coldest saved blocks of the running requests, by the heat the
step publishes (`WorkingSets.heat`: steps since any layer and head last read the
block, a step or two old, never waited for); among equally cold blocks the
oldest first. Never the sink blocks or the last `recent_blocks + 2` full blocks
(decode's `last_loc` and the blocks every step reads). A request not yet
measured in its row (a new request, a reused row) counts as just read: its
blocks go after the cold ones. Prefix sharing is off at this home (a
tree-shared page is not one request's to give back). Limit: no promotion back
to HBM yet; an evicted block is read across PCIe for the rest of its request.
"""

from __future__ import annotations

import numpy as np
import torch

# A row's published heat belongs to its request while the length it was measured at
# trails the request's by at most this many tokens (the overlap scheduler runs ahead).
_STALE_TOKENS = 8


class Residency:
    def __init__(self, writeback, meta, working_sets, req_to_token: torch.Tensor, cfg):
        self.wb, self.meta, self.ws = writeback, meta, working_sets
        self.req_to_token = req_to_token
        self.block_size = cfg.block_size
        self.sink = cfg.sink_blocks
        self.keep_recent = cfg.recent_blocks + 2
        self.page_rows = meta.page_rows
        self.max_blocks = working_sets.heat_blocks  # blocks of the longest request
        if not self.max_blocks:
            raise ValueError("residency needs the working sets to publish block heat")
        self.evicted: dict[object, np.ndarray] = {}  # rid -> bool by block: left HBM
        self.evicted_blocks = 0  # blocks out of HBM now
        self.evictions = 0  # blocks given back to the allocator, ever
        self.freeing = False  # inside our own free (no page 0 to drop)
        dev = req_to_token.device
        self._offsets = torch.arange(self.block_size, device=dev)

    def release(self, rid) -> None:
        """`rid` ended: its evicted set goes (its entries point at page 0, which the
        allocator hook keeps out of the free)."""
        gone = self.evicted.pop(rid, None)
        if gone is not None:
            self.evicted_blocks -= int(gone.sum())

    def _ages(self, row: int, seq_len: int, upto: int) -> np.ndarray:
        """Published ages of blocks `[0, upto)` of the request in `row` (0 where the row
        was not measured for this request: a request counts as just read until it is)."""
        _, lengths = self.ws.read()
        measured = int(lengths[row])
        if measured <= 0 or abs(seq_len - measured) > _STALE_TOKENS:
            return np.zeros(upto, dtype=np.int64)
        return self.ws.heat()[row, :upto].numpy().astype(np.int64)

    def scores(self, rid, seq_len: int) -> np.ndarray | None:
        """Eviction order of `rid`'s blocks: higher goes first (colder, then older);
        -1 for blocks that may not leave HBM now (not saved, sink, recent, gone)."""
        r = self.wb.request(rid)
        if r is None:
            return None
        upto = min(r.saved, seq_len // self.block_size - self.keep_recent)
        if upto <= self.sink:
            return None
        b = np.arange(upto)
        s = self._ages(r.row, seq_len, upto) * self.max_blocks + (self.max_blocks - 1 - b)
        s[: self.sink] = -1
        gone = self.evicted.get(rid)
        if gone is not None:
            s[gone[:upto]] = -1
        return s

    def make_room(self, reqs, tokens: int, allocator) -> int:
        """Give back pages of `reqs` (SGLang requests, running) until `tokens` more tokens
        fit; returns the tokens freed (less when too few blocks are saved yet)."""
        want = -(-tokens // self.block_size)
        if want <= 0:
            return 0
        rids, parts = [], []
        for req in reqs:
            if getattr(req, "req_pool_idx", None) is None or req.finished():
                continue
            s = self.scores(req.rid, int(req.seqlen))
            if s is not None:
                rids.append(req.rid)
                parts.append(s)
        if not parts:
            return 0
        flat = np.concatenate(parts)
        k = min(want, int((flat >= 0).sum()))
        if k == 0:
            return 0
        top = np.argpartition(-flat, k - 1)[:k]
        starts = np.cumsum([0] + [len(p) for p in parts])
        owner = np.searchsorted(starts, top, side="right") - 1
        freed = 0
        for i in np.unique(owner):
            blocks = sorted(int(t - starts[i]) for t in top[owner == i])
            freed += self.evict(rids[i], blocks, allocator)
        return freed

    def evict(self, rid, blocks: list[int], allocator) -> int:
        """Give back the HBM pages of `rid`'s saved `blocks`; returns the tokens freed."""
        blocks = self.wb.read_from_host(rid, blocks)
        if not blocks:
            return 0
        r = self.wb.request(rid)
        bs, dev = self.block_size, self.req_to_token.device
        pin = dev.type == "cuda"
        idx = torch.tensor([b * bs for b in blocks], dtype=torch.int64, pin_memory=pin)
        hosts = torch.tensor([r.host[b] for b in blocks], dtype=torch.int64, pin_memory=pin)
        idx = idx.to(dev, non_blocking=True)
        rows = hosts.to(dev, non_blocking=True) + self.page_rows
        table = self.req_to_token[r.row]
        pages = table[idx].long() // bs
        self.meta.copy_rows(pages, rows)
        self.ws.copy_rows(pages, rows)
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
        self.evicted_blocks += len(blocks)
        self.evictions += len(blocks)
        return len(blocks) * bs

    def report(self) -> dict[str, int]:
        return {"blocks_evicted": self.evicted_blocks, "evictions": self.evictions}
