"""Reference of the unit cache's refresh: which host units take which HBM slots.

The tiered home caches single (layer, KV head, block) units of evicted blocks in
HBM (`sglang_psa.mem_cache.unit_cache`). A pool page `cache_pages[c]` taken by the
cache (0: none, the page slot is unusable) gives one position to every (layer, KV
head): position `q = c * L + l2` of head `h` is page `cache_pages[c]`, head `h` of
layer `l2`'s buffer in SGLang's pool. The positions are shared by the layers: a
unit of layer `l` may sit in another layer's buffer, so a layer that reads many
blocks uses the positions of layers that read few. The cache is set-associative
per KV head: page slot `c` belongs to set `c // ways` (its `ways * L` positions in
the order `(way, layer)`), and a unit of host block `hb`, of any layer, may only
live in set `hb % sets`.

`refresh_ref` is the spec of `sgl_kernel_ext.unit_cache.refresh_unit_cache`, one
(head, set) at a time:
- candidates: units of the set's host blocks that are evicted (`live[hb]`), not
  cached, and read by the last step (`stamps[l * Hkv + h, hb] >= step`, stamps > 0),
  in the order (layer, host block);
- the set's positions in order: a position whose page slot has a page takes the next
  candidate if it is empty or its unit was not read within the last `keep` steps
  (stamp <= step - keep); the old unit is uncached, the new one's K and V are copied
  from the host tier into the position's page, head and layer buffer.
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
    pool_k: list[torch.Tensor],
    pool_v: list[torch.Tensor],
    step: int,
    ways: int,
    keep: int,
) -> int:
    """Refresh every layer in place; returns the units copied in.

    `stamps [L * Hkv, HB]` int32 (the host blocks' columns of every layer's stamps),
    `live [HB]` (nonzero: evicted, home on the host), `unit_slot [L * Hkv, HB + 1]` int32
    (the unit's position or -1; the last column is scratch), `slot_unit [Hkv, C * L + 1]`
    int32 (the unit in each position as `layer * HB + hb`, or -1; the last column is
    scratch), `cache_pages [C]` int32, `host_k/v [L, Hkv, HB, bs, d]`, `pool_k/v` the L
    layers' `[tokens, Hkv, d]` buffers of SGLang's pool."""
    LH, HB = stamps.shape
    L = len(pool_k)
    H = LH // L
    C = cache_pages.shape[0]
    sets = C // ways
    bs = host_k.shape[3]
    copied = 0
    for h in range(H):
        for s in range(sets):
            cands = [
                (ly, hb)
                for ly in range(L)
                for hb in range(s, HB, sets)
                if live[hb]
                and unit_slot[ly * H + h, hb] < 0
                and stamps[ly * H + h, hb] >= step
                and stamps[ly * H + h, hb] > 0
            ]
            for w in range(ways):
                page = int(cache_pages[s * ways + w])
                for l2 in range(L):
                    if page <= 0 or not cands:
                        continue
                    q = (s * ways + w) * L + l2
                    cur = int(slot_unit[h, q])
                    if cur >= 0:
                        cl, chb = divmod(cur, HB)
                        if int(stamps[cl * H + h, chb]) > step - keep:
                            continue
                        unit_slot[cl * H + h, chb] = -1
                    ly, hb = cands.pop(0)
                    slot_unit[h, q] = ly * HB + hb
                    unit_slot[ly * H + h, hb] = q
                    rows = slice(page * bs, (page + 1) * bs)
                    pool_k[l2][rows, h] = host_k[ly, h, hb].to(pool_k[l2].device)
                    pool_v[l2][rows, h] = host_v[ly, h, hb].to(pool_v[l2].device)
                    copied += 1
    return copied
