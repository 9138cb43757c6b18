"""Reference of the unit cache's refresh: which host units take which HBM slots.

The tiered home caches single (layer, KV head, block) units of evicted blocks in
HBM (`sglang_psa.mem_cache.unit_cache`). For one layer the cache is `[Hkv, C]`
slots, set-associative: slot `s` belongs to set `s // ways`, and host block `hb`
may only live in set `hb % sets`. Slot `s` of every head is backed by the pool
page `cache_pages[s]` (0: no page, the slot is unusable).

`refresh_ref` is the spec of `sgl_kernel_ext.unit_cache.refresh_unit_cache`, one
(head, set) at a time:
- candidates: host blocks of the set that are evicted (`live[hb]`), not cached for
  this head, and read by the last step (`stamps[h, hb] >= step`, stamps > 0); most
  recently read first, ties by the smaller host block;
- the set's ways in order: a way with a page takes the best remaining candidate if
  it is empty or its unit was not read within the last `keep` steps (stamp <=
  step - keep); the old unit is uncached, the new one's K and V are copied from the
  host tier into the slot's page at head `h`.
"""

from __future__ import annotations

import torch


def refresh_ref(
    stamps: torch.Tensor,
    live: torch.Tensor,
    unit_slot: torch.Tensor,
    slot_unit: torch.Tensor,
    cache_pages: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    step: int,
    ways: int,
    keep: int,
) -> int:
    """Refresh one layer in place; returns the units copied in.

    `stamps [Hkv, HB]` int32 (the host blocks' rows of the layer's stamps), `live [HB]`
    (nonzero: evicted, home on the host), `unit_slot [Hkv, HB + 1]` int32 (slot or -1;
    the last column is scratch), `slot_unit [Hkv, C + 1]` int32 (host block or -1; the
    last column is scratch), `cache_pages [C]` int32, `host_k/v [Hkv, HB, bs, d]`,
    `pool_k/v [tokens, Hkv, d]` (one layer of SGLang's pool)."""
    Hkv, HB = stamps.shape
    C = cache_pages.shape[0]
    sets = C // ways
    bs = host_k.shape[2]
    copied = 0
    for h in range(Hkv):
        for s in range(sets):
            cands = [
                hb
                for hb in range(s, HB, sets)
                if live[hb] and unit_slot[h, hb] < 0 and stamps[h, hb] >= step and stamps[h, hb] > 0
            ]
            cands.sort(key=lambda hb: (-int(stamps[h, hb]), hb))
            for w in range(ways):
                slot = s * ways + w
                page = int(cache_pages[slot])
                if page <= 0 or not cands:
                    continue
                cur = int(slot_unit[h, slot])
                if cur >= 0 and int(stamps[h, cur]) > step - keep:
                    continue
                hb = cands.pop(0)
                if cur >= 0:
                    unit_slot[h, cur] = -1
                slot_unit[h, slot] = hb
                unit_slot[h, hb] = slot
                rows = slice(page * bs, (page + 1) * bs)
                pool_k[rows, h] = host_k[h, hb].to(pool_k.device)
                pool_v[rows, h] = host_v[h, hb].to(pool_v.device)
                copied += 1
    return copied
