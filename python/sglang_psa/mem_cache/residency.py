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

Victims: among running requests, the oldest saved blocks past the sink blocks,
never the last `recent_blocks + 2` full blocks (decode's `last_loc` and the
blocks every step reads), taken round-robin from the requests with the most
blocks still in HBM. Prefix sharing is off at this home (a tree-shared page is
not one request's to give back). Limits: no promotion back to HBM yet, and the
choice ignores how often a block is read.
"""

from __future__ import annotations

import torch


class Residency:
    def __init__(self, writeback, meta, working_sets, req_to_token: torch.Tensor, cfg):
        self.wb, self.meta, self.ws = writeback, meta, working_sets
        self.req_to_token = req_to_token
        self.block_size = cfg.block_size
        self.sink = cfg.sink_blocks
        self.keep_recent = cfg.recent_blocks + 2
        self.page_rows = meta.page_rows
        self.evicted: dict[object, set[int]] = {}  # rid -> evicted block indices
        self.evictions = 0  # blocks given back to the allocator, ever
        self.freeing = False  # inside our own free (no page 0 to drop)
        dev = req_to_token.device
        self._offsets = torch.arange(self.block_size, device=dev)

    @property
    def evicted_blocks(self) -> int:
        return sum(len(s) for s in self.evicted.values())

    def release(self, rid) -> None:
        """`rid` ended: its evicted set goes (its entries point at page 0, which the
        allocator hook keeps out of the free)."""
        self.evicted.pop(rid, None)

    def candidates(self, rid, seq_len: int) -> list[int]:
        """Blocks of `rid` that may leave HBM now, oldest first."""
        r = self.wb.request(rid)
        if r is None:
            return []
        full = seq_len // self.block_size
        upto = min(r.saved, full - self.keep_recent)
        gone = self.evicted.get(rid, ())
        return [b for b in range(self.sink, upto) if b not in gone]

    def make_room(self, reqs, tokens: int, allocator) -> int:
        """Give back pages of `reqs` (SGLang requests, running) until `tokens` more tokens
        fit; returns the tokens freed (less when too few blocks are saved yet)."""
        want = -(-tokens // self.block_size)
        if want <= 0:
            return 0
        pools = []
        for req in reqs:
            if getattr(req, "req_pool_idx", None) is None or req.finished():
                continue
            c = self.candidates(req.rid, int(req.seqlen))
            if c:
                pools.append((req.rid, c))
        picked: dict[object, list[int]] = {}
        pools.sort(key=lambda p: -len(p[1]))
        i = 0
        while want > 0 and pools:
            rid, c = pools[i % len(pools)]
            picked.setdefault(rid, []).append(c.pop(0))
            want -= 1
            if not c:
                pools.pop(i % len(pools))
            else:
                i += 1
        return sum(self.evict(rid, blocks, allocator) for rid, blocks in picked.items())

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
        self.evicted.setdefault(rid, set()).update(blocks)
        self.evictions += len(blocks)
        return len(blocks) * bs

    def report(self) -> dict[str, int]:
        return {"blocks_evicted": self.evicted_blocks, "evictions": self.evictions}
