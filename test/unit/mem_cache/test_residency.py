"""Residency's swap rule with a fake host tier: when no page is spare, an evicted block comes
back only in place of an HBM block read by fewer than half as many units, least read first."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from sglang_psa.mem_cache.residency import Residency

BS, ROW = 4, 2


class _Alloc:
    def __init__(self, free_pages: int):
        self.free = free_pages

    def available_size(self) -> int:
        return self.free * BS

    def alloc(self, n: int) -> torch.Tensor:
        assert n <= self.available_size()
        self.free -= n // BS
        return torch.arange(n)


def test_promotion_swaps_only_for_blocks_read_by_more_than_twice_the_units():
    # One request of 12 full blocks, all saved; blocks 2 and 3 are on the host. Readers
    # (of 8 units) by block: the sink 0 and the last three are never candidates.
    readers = [7, 0, 8, 2, 1, 4, 5, 3, 5, 6, 6, 6]
    heat = np.zeros(16, dtype=np.uint8)
    heat[:12] = readers
    lengths = torch.zeros(4, dtype=torch.int32)
    lengths[ROW] = 12 * BS
    ws = SimpleNamespace(
        read=lambda: (None, lengths),
        heat_of=lambda row: heat if row == ROW else None,
        layers=2,
        kv_heads=4,
        heat_blocks=16,
    )
    wb = SimpleNamespace(
        request=lambda rid: SimpleNamespace(row=ROW, saved=12, host=list(range(12))),
        block_bytes=1 << 20,
    )
    cfg = SimpleNamespace(block_size=BS, sink_blocks=1, recent_blocks=1)
    res = Residency(wb, SimpleNamespace(page_rows=100), ws, torch.zeros(4, 64), cfg, None)
    gone = np.zeros(16, dtype=bool)
    gone[[2, 3]] = True
    res.evicted = {"a": gone}
    alloc = _Alloc(free_pages=2)  # exactly the two pages a running request keeps spare
    evicted, back = [], []

    def evict(rid, blocks, allocator):
        evicted.extend(blocks)
        allocator.free += len(blocks)
        return len(blocks) * BS

    res.evict = evict
    res._bring_back = lambda blocks, slots: back.extend(blocks)
    req = SimpleNamespace(rid="a", req_pool_idx=ROW, seqlen=12 * BS, finished=lambda: False)
    # Block 2 (8 readers) takes the place of block 1 (0); block 3 (2 readers) would need
    # a block read by fewer than one unit, and the next least read, block 4, has one.
    assert res.promote([req], alloc) == 1
    assert evicted == [1] and back == [("a", 2)]
