"""HBM copies of hot KV pages of a host-resident SGLang pool (`--psa-kv-home host`).

One cache of equal slots serves all layers; a slot holds one (layer, page) with
all its KV heads, in SGLang's own page layout, so the wave kernel reads a block
from its slot or, through UVA, from the host page with the same strides.

Placement is direct-mapped (a unit's slot is a hash of it) so that lookup,
admission and invalidation are fixed-size tensor ops: no host sync, no sort.
Admission follows the frequency policy of the store's slot table: a page read
from the host this step replaces the slot's occupant only if its decayed read
count is higher. Only full pages are cached: the tail page still changes every
step, and a full page changes only when SGLang frees it and hands it out again,
which the allocator hook reports (`invalidate`).
"""

from __future__ import annotations

import torch

from sgl_kernel_ext.gather import BlockCopier

_HASH = 0x9E3779B1  # Knuth's multiplicative constant: neighbours spread over the slots


class PageCache:
    def __init__(
        self,
        layers: int,
        num_pages: int,
        page_elems: int,
        dtype: torch.dtype,
        num_slots: int,
        device: torch.device | str,
        decay: float = 0.8,
    ):
        if num_slots < 1:
            raise ValueError("the page cache needs at least one slot")
        self.layers, self.P, self.S = layers, num_pages, num_slots
        self.page_elems, self.decay = page_elems, decay
        dev = torch.device(device)
        self.k = torch.zeros(num_slots, page_elems, dtype=dtype, device=dev)
        self.v = torch.zeros_like(self.k)
        # tag[slot]: the (layer, page) unit it holds, -1 if none; index S is a scratch lane.
        self.tag = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.score = torch.zeros(layers * num_pages + 1, dtype=torch.float32, device=dev)
        # hits, host reads, admissions, invalidations (device counters: read on demand)
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        self._counters_host = torch.zeros(4, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.copier = BlockCopier(page_elems, dtype, dev)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def _slot(self, units: torch.Tensor) -> torch.Tensor:
        return (units * _HASH) % self.S

    def locate(self, layer: int, pages: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Per block of `pages [B, NB]`: its slot if cached, else -(page) - 1 (read the
        host page through UVA). Only full pages can be cached."""
        units = layer * self.P + pages
        slot = self._slot(units)
        hit = full & (self.tag[slot] == units)
        return torch.where(hit, slot, -pages - 1).to(torch.int32)

    def admit(
        self,
        layer: int,
        pages: torch.Tensor,
        read: torch.Tensor,
        full: torch.Tensor,
        loc: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
    ) -> None:
        """After a layer's attention: count the reads of `pages [B, NB]` (`read`, any head)
        and copy full pages read from the host into the cache where their history beats
        the occupant's. `k_pool`/`v_pool` are the layer's host-resident page buffers."""
        units = (layer * self.P + pages).reshape(-1)
        read = read.reshape(-1)
        self.score.index_add_(0, units, read.to(torch.float32))
        read_host = read & (loc.reshape(-1) < 0)
        from_host = read_host & full.reshape(-1)
        slot = self._slot(units)
        occ = self.tag[slot]
        occ_score = torch.where(
            occ >= 0, self.score[occ.clamp(min=0)], torch.full_like(self.score[:1], -1.0)
        )
        cand = from_host & (self.score[units] > occ_score)
        # Lanes that want the same slot: the scatter keeps one, read back who won.
        self.tag.index_copy_(0, torch.where(cand, slot, self.S), torch.where(cand, units, -1))
        self.tag[self.S] = -1
        win = cand & (self.tag[slot] == units)
        n = units.numel()
        pos = torch.where(win, torch.cumsum(win, 0) - 1, n)
        src = torch.zeros(n + 1, dtype=torch.int64, device=units.device)
        dst = torch.zeros(n + 1, dtype=torch.int64, device=units.device)
        src[pos] = pages.reshape(-1)
        dst[pos] = slot
        count = win.sum().reshape(1)
        for pool, cache in ((k_pool, self.k), (v_pool, self.v)):
            self.copier.run(pool.reshape(-1, self.page_elems), src[:n], cache, dst[:n], count)
        host_reads = read_host.sum()
        hits = read.sum() - host_reads
        self.counters[:3] += torch.stack([hits, host_reads, count[0]])

    def invalidate(self, pages: torch.Tensor) -> None:
        """SGLang handed `pages` out again (new keys): drop them from every layer. `pages`
        may repeat (one entry per allocated token); each dropped slot counts once."""
        pages = pages.reshape(-1).to(torch.int64)
        units = (torch.arange(self.layers, device=pages.device)[:, None] * self.P + pages).reshape(
            -1
        )
        slot = self._slot(units)
        held = self.tag[slot] == units
        cached = (self.tag[: self.S] >= 0).sum()
        self.tag.index_copy_(0, torch.where(held, slot, self.S), torch.full_like(units, -1))
        self.tag[self.S] = -1
        self.score[units] = 0.0
        self.counters[3] += cached - (self.tag[: self.S] >= 0).sum()

    def next_step(self) -> None:
        self.score.mul_(self.decay)

    def read_counters(self) -> dict[str, int]:
        """Hits, host reads and the bytes those moved across PCIe, as of an earlier call,
        without a sync: returns the last copy and starts the next (the metrics' refresh)."""
        hits, host, admitted, _ = (int(x) for x in self._counters_host.tolist())
        self._counters_host.copy_(self.counters, non_blocking=True)
        page_bytes = 2 * self.page_elems * self.k.element_size()  # K and V of one page
        return {
            "hbm_hits": hits,
            "host_reads": host,
            "pcie_read_bytes": (host + admitted) * page_bytes,
        }

    def stats(self) -> dict[str, int]:
        hits, host, admitted, dropped = (int(x) for x in self.counters.tolist())
        return {
            "slots": self.S,
            "cached": int((self.tag[: self.S] >= 0).sum()),
            "hits": hits,
            "host_reads": host,
            "admitted": admitted,
            "invalidated": dropped,
        }

    def check_integrity(self) -> None:
        """Every held unit sits in its own hashed slot."""
        tag = self.tag[: self.S]
        held = torch.nonzero(tag >= 0).flatten()
        assert torch.equal(self._slot(tag[held]), held), "a unit sits in a foreign slot"
        assert int(self.tag[self.S]) == -1
