"""The unit cache: single (layer, KV head, block) units of evicted blocks, kept in HBM.

At the tiered home a block evicted from HBM (`mem_cache.residency`) lives on the
host, and decode reads each of its units there across PCIe unless the unit
cache holds it. Decode reads few units of a block (each (layer, KV head) ranks
blocks on its own), so HBM filled with single units holds far more of what is
read than whole pages would: one page taken from SGLang's allocator gives one
slot to every (layer, KV head) at once (slot `s` of layer `l`, head `h` is page
`cache_pages[s]`, layer `l`, head `h`: the very place SGLang's pool keeps that
head of that page's tokens, so the wave kernel reads a slot as it reads a page).

State, all on the GPU (fixed shapes: `max_pages` slots per (layer, KV head)):
- `cache_pages [C]` int32: the page behind each slot (0: none yet, unusable);
- `unit_slot [L * Hkv, HB + 1]` int32: each host block's slot, or -1 (the last
  column is a scratch target for scatters of -1);
- `slot_unit [L * Hkv, C + 1]` int32: the inverse, -1 for an empty slot;
- `live [HB]` uint8: the block is evicted (its home is the host; only such
  blocks' units are cached, so a cached unit never goes stale: an evicted block
  is full and saved, and nothing writes it until its request ends).

The cache is set-associative (`WAYS` slots per set by default, `--psa-unit-cache-ways`;
host block `hb` in set `hb % sets`), so the refresh decides each set on its own: one
launch per layer (`sgl_kernel_ext.unit_cache`) brings in every host unit the last step
read that is not cached yet, into a way that is empty or whose unit no step read within
the last `KEEP` steps, and copies its K and V from the host tier. No decision comes back
to the host: the scheduler only knows how many pages the cache holds.

On CUDA the refresh's launches (one per layer) are captured once into a CUDA graph
and replayed every round after (its tensors never move): a Python launch per layer
cost the scheduler about 1.3 ms of each decode round at 24 layers (seen on the H200,
workload f_capped), replay a few microseconds.

Pages come from SGLang's allocator (`grow`) and go back (`shrink`) when SGLang
needs them or the last evicted block is gone; slots are filled and dropped
spread over the sets (position `p` is way `p // sets` of set `p % sets`).
Dropping a slot, or forgetting a released block's units, uncaches before it
unmaps: a step that reads the tables meanwhile finds either the slot's page
(still intact: only a later forward writes a freed page) or the host copy.
"""

from __future__ import annotations

import logging

import torch

from sgl_kernel_ext.unit_cache import refresh_unit_cache
from sglang_psa.config import PSAConfig
from sglang_psa.mem_cache.writeback import to_device

logger = logging.getLogger(__name__)

WAYS = PSAConfig.unit_cache_ways  # slots per set, by default
KEEP = 4  # a cached unit read within this many steps stays


class UnitCache:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        host_blocks: int,
        max_pages: int,
        block_size: int,
        device: torch.device | str,
        graph: bool = True,
        ways: int = WAYS,
    ):
        """`graph`: on CUDA, replay the refresh from a CUDA graph (off: launch it each
        round, as on the CPU); `ways`: slots per set (`--psa-unit-cache-ways`)."""
        dev = torch.device(device)
        self.layers, self.kv_heads, self.host_blocks = layers, kv_heads, host_blocks
        self.block_size = block_size
        self.ways = ways
        self.sets = max(1, max_pages // ways)
        C = self.sets * ways
        LH = layers * kv_heads
        kw = dict(dtype=torch.int32, device=dev)
        self.cache_pages = torch.zeros(C, **kw)
        self.unit_slot = torch.full((LH, host_blocks + 1), -1, **kw)
        self.slot_unit = torch.full((LH, C + 1), -1, **kw)
        self.live = torch.zeros(host_blocks, dtype=torch.uint8, device=dev)
        self.copied = torch.zeros(1, **kw)  # units brought in, ever (device counter)
        self.copied_host = torch.zeros(1, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self.pages = 0  # slots filled (pages taken from SGLang's allocator), from position 0
        self._offsets = torch.arange(block_size, device=dev)
        self._graph_on = graph and dev.type == "cuda"
        self._graph = None  # (the captured refresh, the identity of the tensors it reads)

    @property
    def capacity(self) -> int:
        """Slots per (layer, KV head): the most pages the cache can hold."""
        return self.cache_pages.shape[0]

    @property
    def bytes(self) -> int:
        ts = (self.cache_pages, self.unit_slot, self.slot_unit, self.live, self.copied)
        return sum(t.numel() * t.element_size() for t in ts)

    def _slots(self, first: int, n: int) -> torch.Tensor:
        w = self.ways
        slots = [(p % self.sets) * w + p // self.sets for p in range(first, first + n)]
        return to_device(slots, self.cache_pages.device)

    def layer(self, lid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(unit_slot [Hkv, HB + 1], cache_pages [C])` of one layer, for the wave kernel."""
        H = self.kv_heads
        return self.unit_slot[lid * H : (lid + 1) * H], self.cache_pages

    def grow(self, pages: torch.Tensor) -> None:
        """Take `pages` (device, int, from SGLang's allocator) as new slots of every
        (layer, KV head); at most `capacity - pages` of them."""
        n = pages.numel()
        if self.pages + n > self.capacity:
            raise ValueError(f"{n} pages more than the {self.capacity - self.pages} free slots")
        slots = self._slots(self.pages, n)
        self.cache_pages.index_copy_(0, slots, pages.to(torch.int32))
        self.pages += n

    def shrink(self, n: int) -> torch.Tensor:
        """Drop the `n` most recently filled slots of every (layer, KV head): their units
        are uncached, then the slots unmapped. Returns the token slots of the pages they
        held (device), for SGLang's allocator."""
        n = min(n, self.pages)
        if n <= 0:
            return self._offsets[:0]
        self.pages -= n
        slots = self._slots(self.pages, n)
        pages = self.cache_pages.index_select(0, slots).long()
        units = self.slot_unit.index_select(1, slots)  # [LH, n] host blocks or -1
        units = torch.where(units < 0, self.host_blocks, units)
        self.unit_slot.scatter_(1, units.long(), -1)
        self.slot_unit.index_fill_(1, slots, -1)
        self.cache_pages.index_fill_(0, slots, 0)
        return (pages[:, None] * self.block_size + self._offsets).flatten()

    def mark_evicted(self, host_blocks: torch.Tensor) -> None:
        """`host_blocks` (device) left HBM: their units may be cached from now on."""
        self.live.index_fill_(0, host_blocks.long(), 1)

    def forget(self, host_blocks: torch.Tensor) -> None:
        """`host_blocks` (device) are released: uncache their units, free their slots."""
        if host_blocks.numel() == 0:
            return
        hbs = host_blocks.long()
        self.live.index_fill_(0, hbs, 0)
        slots = self.unit_slot.index_select(1, hbs)  # [LH, n] slots or -1
        self.unit_slot.index_fill_(1, hbs, -1)
        slots = torch.where(slots < 0, self.capacity, slots)
        self.slot_unit.scatter_(1, slots.long(), -1)

    def refresh(self, stamps: torch.Tensor, page_rows: int, step: torch.Tensor, host, pool):
        """Bring in the host units the last step read, one launch per layer. `stamps
        [L * Hkv, page_rows + HB]` (`ReadStamps.stamps`), `host.k/v[l]` the host tier's
        layer `l` `[Hkv, HB, bs, d]`, `pool.k_buffer/v_buffer[l]` SGLang's."""
        if not self.pages:
            return
        key = (stamps.data_ptr(), page_rows, step.data_ptr(), id(host), id(pool))
        if self._graph is not None and self._graph[1] == key:
            self._graph[0].replay()
        else:
            self._launch(stamps, page_rows, step, host, pool)  # compiles, the first time
            self._capture(key, stamps, page_rows, step, host, pool)
        # (outside the graph: a copy into pinned memory records an event at capture)
        self.copied_host.copy_(self.copied, non_blocking=True)

    def _capture(self, key, stamps, page_rows, step, host, pool) -> None:
        """The refresh's launches as a CUDA graph for the next rounds (`refresh`)."""
        if not self._graph_on:
            return
        try:
            graph = _captured(lambda: self._launch(stamps, page_rows, step, host, pool))
        except RuntimeError as e:  # the same results, launched per layer: said once
            self._graph_on = False
            logger.warning(
                "sglang-psa: the unit cache's refresh could not be captured into a CUDA "
                "graph (%s); it is launched layer by layer every decode round",
                e,
            )
            return
        self._graph = (graph, key)

    def _launch(self, stamps: torch.Tensor, page_rows: int, step: torch.Tensor, host, pool):
        H = self.kv_heads
        for lid in range(self.layers):
            rows = slice(lid * H, (lid + 1) * H)
            refresh_unit_cache(
                stamps[rows, page_rows:],
                self.live,
                self.unit_slot[rows],
                self.slot_unit[rows],
                self.cache_pages,
                host.k[lid],
                host.v[lid],
                pool.k_buffer[lid],
                pool.v_buffer[lid],
                step,
                self.ways,
                KEEP,
                self.copied,
            )


def _captured(launch) -> torch.cuda.CUDAGraph:
    """`launch()` (kernels on the current stream, no allocation) captured into a CUDA
    graph, from a side stream and for this thread only (SGLang's other threads may use
    the device meanwhile); nothing runs until it is replayed."""
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            launch()
        finally:
            graph.capture_end()
    return graph
