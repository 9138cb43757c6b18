"""HBM slots holding copies of host-pool units, and the block tables the wave kernel reads.

One `k_slots/v_slots [num_slots, block_size, head_dim]` pair serves all
layers. `SlotCache` decides which (layer, head, block) units are resident;
`promote` brings missing units in with one gather launch; `location_table`
writes, per layer, `[B, kv_heads, max_blocks]` int32: the slot of a resident
unit, else `-(host unit + 1)` so the kernel reads it from the host pool.
"""

from __future__ import annotations

import torch

from sgl_kernel_ext.gather import BlockCopier
from sglang_psa.store.host_pool import HostKVPool
from sglang_psa.store.slot_cache import SlotCache


class SlotStore:
    def __init__(self, pool: HostKVPool, num_slots: int, device: torch.device | str):
        self.pool, self.device = pool, torch.device(device)
        shape = (num_slots, pool.block_size, pool.head_dim)
        self.k_slots = torch.zeros(shape, dtype=pool.dtype, device=self.device)
        self.v_slots = torch.zeros_like(self.k_slots)
        self.cache = SlotCache(num_slots)
        unit = pool.block_size * pool.head_dim
        self.copier = BlockCopier(unit, pool.dtype, self.device)

    def promote(self, layer: int, head_blocks: list[tuple[int, int]]) -> list[int]:
        """Slots for the (head, block) units of `layer`, gathering the missing ones at once.

        Units already resident are only marked recently used. Raises if every
        slot is pinned by the running step.
        """
        slots, src, dst = [], [], []
        for head, block in head_blocks:
            key = (layer, head, block)
            slot = self.cache.lookup(key)
            if slot is None:
                slot, _ = self.cache.insert(key)
                src.append(self.pool.unit(head, block))
                dst.append(slot)
            slots.append(slot)
        if src:
            s = torch.tensor(src, dtype=torch.int64, device=self.device)
            d = torch.tensor(dst, dtype=torch.int64, device=self.device)
            for host, slots_t in zip(self.pool.layer_units(layer), (self.k_slots, self.v_slots)):
                self.copier.run(host.flatten(1), s, slots_t.flatten(1), d)
        return slots

    def location_table(
        self, layer: int, block_tables: list[list[int]], max_blocks: int
    ) -> torch.Tensor:
        """`[B, kv_heads, max_blocks]` int32: slot if resident, else -(host unit + 1).

        Entries past a request's last block are 0; the kernel never reads them.
        """
        H = self.pool.kv_heads
        loc = torch.zeros(len(block_tables), H, max_blocks, dtype=torch.int32)
        for b, blocks in enumerate(block_tables):
            for h in range(H):
                for j, blk in enumerate(blocks):
                    slot = self.cache.lru.get((layer, h, blk))
                    loc[b, h, j] = slot if slot is not None else -(self.pool.unit(h, blk) + 1)
        return loc.to(self.device)
