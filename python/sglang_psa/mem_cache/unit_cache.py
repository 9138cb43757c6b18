"""The unit cache: single (layer, KV head, block) units of evicted blocks, kept in HBM.

At the tiered home a block evicted from HBM (`mem_cache.residency`) lives on the
host, and decode reads each of its units there across PCIe unless the unit
cache holds it. Decode reads few units of a block (each (layer, KV head) ranks
blocks on its own), so HBM filled with single units holds far more of what is
read than whole pages would. A page taken from SGLang's allocator gives one
position to every (layer, KV head): position `q = c * L + l2` of head `h` is page
`cache_pages[c]`, head `h` of layer `l2`'s buffer (the very place SGLang's pool
keeps that head of that page's tokens, so the wave kernel reads a position as it
reads a page, through the offset from its own layer's buffer to `l2`'s). A unit of
any layer may take any of its head's positions: layers read very unequal shares
of their blocks, and positions tied to their layer left a heavy layer's units on
the host while light layers' positions stayed empty.

State, all on the GPU (fixed shapes: `max_pages` page slots):
- `cache_pages [C]` int32: the page behind each page slot (0: none yet, unusable);
- `unit_slot [L * Hkv, HB + 1]` int32: each host block's position per (layer, KV
  head), or -1 (the last column is a scratch target for scatters of -1);
- `slot_unit [Hkv, C * L + 1]` int32: the inverse, `layer * HB + hb` or -1 for an
  empty position (the last column: scratch);
- `live [HB]` uint8: the block is evicted (its home is the host; only such
  blocks' units are cached, so a cached unit never goes stale: an evicted block
  is full and saved, and nothing writes it until its request ends);
- `k_shift, v_shift [L, L]` int64: element offsets between the layers' buffers
  (row `l`: from layer `l`'s buffer to each layer's), set from the pool on the
  first refresh (no unit is cached before it).

The cache is set-associative per KV head (`WAYS` page slots per set by default,
`--psa-unit-cache-ways`, so `WAYS * L` positions; host block `hb`'s units, of every
layer, in set `hb % sets`), so the refresh decides each set on its own: one launch
(`sgl_kernel_ext.unit_cache`) brings in every host unit the last step read that is
not cached yet, into a position that is empty or whose unit no step read within the
last `KEEP` steps, and copies its K and V from the host tier. No decision comes back
to the host: the scheduler only knows how many pages the cache holds.

On CUDA the refresh's launch is captured once into a CUDA graph and replayed every
round after (its tensors never move): Python launches per round cost the scheduler
about 1.3 ms of each decode round at 24 launches (seen on the H200, workload
f_capped), replay a few microseconds.

Pages come from SGLang's allocator (`grow`) and go back (`shrink`) when SGLang
needs them or the last evicted block is gone; page slots are filled and dropped
spread over the sets (fill order `p` is way `p // sets` of set `p % sets`).
Dropping a page slot, or forgetting a released block's units, uncaches before it
unmaps: a step that reads the tables meanwhile finds either the slot's page
(still intact: only a later forward writes a freed page) or the host copy.
"""

from __future__ import annotations

import logging

import torch

from sgl_kernel_ext.unit_cache import layer_offsets, refresh_unit_cache, scratch_size
from sglang_psa.config import PSAConfig
from sglang_psa.mem_cache.writeback import to_device

logger = logging.getLogger(__name__)

WAYS = PSAConfig.unit_cache_ways  # page slots per set, by default
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
        fence=None,
    ):
        """`graph`: on CUDA, replay the refresh from a CUDA graph (off: launch it each
        round, as on the CPU); `ways`: page slots per set (`--psa-unit-cache-ways`);
        `fence`: called before every rewrite of the tables or slots a decode step reads
        (`mem_cache.fence.TableFence`; None: none)."""
        dev = torch.device(device)
        self.layers, self.kv_heads, self.host_blocks = layers, kv_heads, host_blocks
        self.block_size = block_size
        self.ways = ways
        self.sets = max(1, max_pages // ways)
        C = self.sets * ways
        L, H = layers, kv_heads
        kw = dict(dtype=torch.int32, device=dev)
        self.cache_pages = torch.zeros(C, **kw)
        self.unit_slot = torch.full((L * H, host_blocks + 1), -1, **kw)
        self.slot_unit = torch.full((H, C * L + 1), -1, **kw)
        self.live = torch.zeros(host_blocks, dtype=torch.uint8, device=dev)
        self.copied = torch.zeros(1, **kw)  # units brought in, ever (device counter)
        self.copied_host = torch.zeros(1, dtype=torch.int32, pin_memory=dev.type == "cuda")
        # The pool's layer offsets (`bind`): from layer 0 for the refresh, between every
        # two layers for the wave kernel.
        self._offsets = torch.zeros(2, L, dtype=torch.int64, device=dev)
        self.k_shift = torch.zeros(L, L, dtype=torch.int64, device=dev)
        self.v_shift = torch.zeros(L, L, dtype=torch.int64, device=dev)
        self._bound = None  # the pool whose offsets are set
        self._scratch = torch.empty(scratch_size(H, C, ways, L), **kw)
        self.pages = 0  # page slots filled (pages taken from SGLang's allocator)
        self._tokens = torch.arange(block_size, device=dev)
        self._layer_pos = torch.arange(L, device=dev)
        self._graph_on = graph and dev.type == "cuda"
        self._graph = None  # (the captured refresh, the identity of the tensors it reads)
        # Refreshes replayed from the graph and launched from Python (a capture, or every
        # round where capture failed): server info shows which path the rounds took.
        self.replays = self.launches = 0
        self._fence = fence or (lambda: None)

    @property
    def capacity(self) -> int:
        """Page slots: the most pages the cache can hold."""
        return self.cache_pages.shape[0]

    @property
    def bytes(self) -> int:
        ts = (self.cache_pages, self.unit_slot, self.slot_unit, self.live, self.copied,
              self._scratch, self._offsets, self.k_shift, self.v_shift)  # fmt: skip
        return sum(t.numel() * t.element_size() for t in ts)

    def _slots(self, first: int, n: int) -> torch.Tensor:
        w = self.ways
        slots = [(p % self.sets) * w + p // self.sets for p in range(first, first + n)]
        return to_device(slots, self.cache_pages.device)

    def layer(self, lid: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """`(unit_slot [Hkv, HB + 1], cache_pages [C], (k_shift, v_shift) [L])` of one
        layer, for the wave kernel."""
        H = self.kv_heads
        rows = self.unit_slot[lid * H : (lid + 1) * H]
        return rows, self.cache_pages, (self.k_shift[lid], self.v_shift[lid])

    def bind(self, pool) -> None:
        """Set the layer offsets of `pool` (`k_buffer`/`v_buffer`, one per layer): once,
        before the first refresh, and again only if another pool is given."""
        if self._bound is pool:
            return
        offs = [layer_offsets(pool.k_buffer), layer_offsets(pool.v_buffer)]
        if len(offs[0]) != self.layers:
            raise ValueError(f"the pool has {len(offs[0])} layers, the unit cache {self.layers}")
        o = to_device(offs, self._offsets.device)  # (no sync: a refresh may run under
        self._offsets.copy_(o)  # the sync debug mode)
        self.k_shift.copy_(o[0][None, :] - o[0][:, None])
        self.v_shift.copy_(o[1][None, :] - o[1][:, None])
        self._bound = pool

    def grow(self, pages: torch.Tensor) -> None:
        """Take `pages` (device, int, from SGLang's allocator) as new page slots, each a
        position of every (layer, KV head); at most `capacity - pages` of them."""
        n = pages.numel()
        if self.pages + n > self.capacity:
            raise ValueError(f"{n} pages more than the {self.capacity - self.pages} free slots")
        self._fence()
        slots = self._slots(self.pages, n)
        self.cache_pages.index_copy_(0, slots, pages.to(torch.int32))
        self.pages += n

    def shrink(self, n: int) -> torch.Tensor:
        """Drop the `n` most recently filled page slots: the units in their positions are
        uncached, then the slots unmapped. Returns the token slots of the pages they held
        (device), for SGLang's allocator."""
        n = min(n, self.pages)
        if n <= 0:
            return self._tokens[:0]
        self._fence()
        self.pages -= n
        slots = self._slots(self.pages, n)
        pages = self.cache_pages.index_select(0, slots).long()
        L, H, HB = self.layers, self.kv_heads, self.host_blocks
        pos = (slots[:, None] * L + self._layer_pos).flatten()
        units = self.slot_unit.index_select(1, pos).long()  # [Hkv, n * L]: l * HB + hb
        heads = torch.arange(H, device=units.device)[:, None]
        flat = ((units // HB) * H + heads) * (HB + 1) + units % HB
        flat = torch.where(units < 0, HB, flat)  # row 0's scratch column
        self.unit_slot.view(-1).index_fill_(0, flat.flatten(), -1)
        self.slot_unit.index_fill_(1, pos, -1)
        self.cache_pages.index_fill_(0, slots, 0)
        return (pages[:, None] * self.block_size + self._tokens).flatten()

    def mark_evicted(self, host_blocks: torch.Tensor) -> None:
        """`host_blocks` (device) left HBM: their units may be cached from now on."""
        self._fence()
        self.live.index_fill_(0, host_blocks.long(), 1)

    def forget(self, host_blocks: torch.Tensor) -> None:
        """`host_blocks` (device) are released: uncache their units, free their slots."""
        if host_blocks.numel() == 0:
            return
        self._fence()
        hbs = host_blocks.long()
        self.live.index_fill_(0, hbs, 0)
        pos = self.unit_slot.index_select(1, hbs).long()  # [L * Hkv, n] positions or -1
        self.unit_slot.index_fill_(1, hbs, -1)
        H, width = self.kv_heads, self.slot_unit.shape[1]
        heads = torch.arange(pos.shape[0], device=pos.device)[:, None] % H
        flat = torch.where(pos < 0, width - 1, heads * width + pos)  # head 0's scratch column
        self.slot_unit.view(-1).index_fill_(0, flat.flatten(), -1)

    def refresh(self, stamps: torch.Tensor, page_rows: int, step: torch.Tensor, host, pool):
        """Bring in the host units the last step read, in one launch. `stamps [L * Hkv,
        page_rows + HB]` (`ReadStamps.stamps`), `host.k/v` the host tier `[L, Hkv, HB,
        bs, d]`, `pool.k_buffer/v_buffer` SGLang's layers."""
        if not self.pages:
            return
        self._fence()
        key = (stamps.data_ptr(), page_rows, step.data_ptr(), id(host), id(pool))
        if self._graph is not None and self._graph[1] == key:
            self._graph[0].replay()
            self.replays += 1
        else:
            self.launches += 1
            self.bind(pool)
            self._launch(stamps, page_rows, step, host, pool)  # compiles, the first time
            self._capture(key, stamps, page_rows, step, host, pool)
        # (outside the graph: a copy into pinned memory records an event at capture)
        self.copied_host.copy_(self.copied, non_blocking=True)

    def _capture(self, key, stamps, page_rows, step, host, pool) -> None:
        """The refresh's launch as a CUDA graph for the next rounds (`refresh`)."""
        if not self._graph_on:
            return
        try:
            graph = _captured(lambda: self._launch(stamps, page_rows, step, host, pool))
        except RuntimeError as e:  # the same results, launched each round: said once
            self._graph_on = False
            logger.warning(
                "sglang-psa: the unit cache's refresh could not be captured into a CUDA "
                "graph (%s); it is launched every decode round",
                e,
            )
            return
        self._graph = (graph, key)

    def _launch(self, stamps: torch.Tensor, page_rows: int, step: torch.Tensor, host, pool):
        refresh_unit_cache(
            stamps[:, page_rows:],
            self.live,
            self.unit_slot,
            self.slot_unit,
            self.cache_pages,
            host.k,
            host.v,
            pool.k_buffer,
            pool.v_buffer,
            step,
            self.ways,
            KEEP,
            self.copied,
            offsets=(self._offsets[0], self._offsets[1]),
            scratch=self._scratch,
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
