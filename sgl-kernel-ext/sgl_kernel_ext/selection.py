"""A block selection reused across decode steps: rank every `interval` steps, not every step.

Scoring and ranking cost a decode step a fixed price per layer whatever it reads
(LServe reuses a page selection across queries for the same reason). With a
`SelectionCache` a request's read order of each layer is kept between steps in
a slot of its own, and scoring and ranking run for a request only when its slot
is stale; otherwise the wave kernel reads the kept order. The spec is
`sglang_psa.algo.attention.reuse_order`: the sink blocks and every block from
the tail block at ranking time on are read first (forced), then the kept ranked
blocks in their order, so blocks a request gained since then are always read.
Under psa's stop rule a kept step reads as many ranked blocks as the rule read
when the order was ranked, per (layer, KV head), in one wave (LFPS predicts a
step's budget from past steps likewise): the rule itself is only sound over a
fresh ranking.

One kernel per step (`assign`, recorded into the decode graph before the layers)
maps each batch row to a slot by its request-table row (the tag) and decides,
on the device, which rows rank this step (`fresh`):
- every row on the steps where `step % interval == 0` (the whole batch ranks on
  the same steps, so the steps between pay nothing for it);
- a row whose request has no slot (it joined the batch since), or whose blocks
  changed more than `MAX_NEW_BLOCKS` since it ranked (or shrank).
A row of at most `sink + recent` blocks reads only forced blocks: it never ranks
and takes the scratch slot (the last), as do padding rows. A request that is
prefilled (new, resumed, or its row reused) loses its slot (`invalidate`), so a
row's tag never vouches for another request's order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A kept order serves a request that gained at most this many blocks since it ranked.
MAX_NEW_BLOCKS = 4


@triton.jit
def _rows_vs_slots(
    rows_ptr, lengths_ptr, tags, r0, B, short_blocks, BS: tl.constexpr, RB: tl.constexpr
):
    """Batch rows `[r0, r0 + RB)`: index, in-batch mask, request-table row, blocks, whether
    long enough to keep a selection, and `hit [RB, CP]`: which slot's tag is the row's."""
    b = r0 + tl.arange(0, RB)
    bm = b < B
    row = tl.load(rows_ptr + b, mask=bm, other=-3).to(tl.int32)
    nb = (tl.load(lengths_ptr + b, mask=bm, other=0) + BS - 1) // BS
    long = bm & (nb > short_blocks)
    hit = long[:, None] & (row[:, None] == tags[None, :])
    return b, bm, row, nb, long, hit


@triton.jit
def _assign_kernel(
    rows_ptr,
    lengths_ptr,
    step_ptr,
    tag_ptr,
    ranked_ptr,
    slot_ptr,
    fresh_ptr,
    nbr_ptr,
    count_ptr,
    B,
    C,
    interval,
    short_blocks,
    BS: tl.constexpr,
    RB: tl.constexpr,
    CP: tl.constexpr,
    MAXNEW: tl.constexpr,
    COUNT: tl.constexpr,
):
    """One program. Slots `[0, C - 1)` hold requests (tag: request-table row, -1 free);
    slot `C - 1` is scratch. Pass 1 finds the slots the batch's requests hold; pass 2
    gives each request without one a free slot (the k-th such request the k-th free).
    With COUNT, `count_ptr[0:2]` (int64) gains the rows that rank and the rows in a slot."""
    s = tl.arange(0, CP)
    sm = s < C - 1
    tags = tl.load(tag_ptr + s, mask=sm, other=-2)
    used = tl.zeros([CP], tl.int32)
    for r0 in range(0, B, RB):
        b, bm, row, nb, long, hit = _rows_vs_slots(
            rows_ptr, lengths_ptr, tags, r0, B, short_blocks, BS, RB
        )
        used = tl.maximum(used, tl.max(hit.to(tl.int32), axis=0))
    free = sm & (used == 0)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    every = (tl.load(step_ptr) % interval) == 0
    k0 = 0
    n_fresh = 0
    n_slotted = 0
    for r0 in range(0, B, RB):
        b, bm, row, nb, long, hit = _rows_vs_slots(
            rows_ptr, lengths_ptr, tags, r0, B, short_blocks, BS, RB
        )
        has = tl.max(hit.to(tl.int32), axis=1) > 0
        held = tl.min(tl.where(hit, s[None, :], CP), axis=1)
        # Requests without a slot, numbered in batch order, take the free slots in order.
        need = long & (~has)
        k = k0 + tl.cumsum(need.to(tl.int32), axis=0) - 1
        k0 += tl.sum(need.to(tl.int32), axis=0)
        pick = need[:, None] & free[None, :] & (free_rank[None, :] == k[:, None])
        got = tl.min(tl.where(pick, s[None, :], CP), axis=1)
        slot = tl.where(has, held, got)
        slot = tl.where(long & (slot < C - 1), slot, C - 1)  # short, padding, no room: scratch
        cached = slot < C - 1
        kept = tl.load(ranked_ptr + slot, mask=bm & cached & has, other=0)
        stale = (~has) | (nb < kept) | (nb - kept > MAXNEW) | (every != 0)
        fresh = cached & stale
        # What the wave kernel treats as the blocks at ranking time: all of a short row's.
        nbr = tl.where(cached & (~fresh), kept, nb)
        fresh = fresh.to(tl.int32)
        tl.store(slot_ptr + b, slot, mask=bm)
        tl.store(fresh_ptr + b, fresh, mask=bm)
        tl.store(nbr_ptr + b, nbr, mask=bm)
        mine = bm & (fresh > 0)
        tl.store(tag_ptr + slot, row, mask=mine)
        tl.store(ranked_ptr + slot, nb, mask=mine)
        n_fresh += tl.sum(mine.to(tl.int32), axis=0)
        n_slotted += tl.sum((bm & cached).to(tl.int32), axis=0)
    if COUNT:  # one program: a plain read-modify-write
        tl.store(count_ptr, tl.load(count_ptr) + n_fresh.to(tl.int64))
        tl.store(count_ptr + 1, tl.load(count_ptr + 1) + n_slotted.to(tl.int64))


class SelectionCache:
    """Kept read orders `[layers, slots, Hkv, NB]` int32, the ranked blocks read when
    they were ranked `budget [layers, slots, Hkv]` (psa's stop rule writes it, the steps
    between read that many) and the per-step row map.

    `slots` is the largest batch it serves plus the scratch slot. `assign` (once per
    step) fills the views `slot`, `fresh`, `nbr` of the first `B` rows; the ranking of
    layer `l` writes `order[l]` rows `slot[b]` where `fresh[b]`, and the wave kernel
    reads them. Fixed shapes, no sync: graph-recordable."""

    def __init__(
        self,
        layers: int,
        max_batch: int,
        kv_heads: int,
        max_blocks: int,
        interval: int,
        block_size: int,
        short_blocks: int,
        device: torch.device | str,
    ):
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        dev = torch.device(device)
        self.interval, self.block_size, self.short_blocks = interval, block_size, short_blocks
        self.max_batch = max_batch
        C = max_batch + 1
        self.order = torch.zeros(layers, C, kv_heads, max_blocks, dtype=torch.int32, device=dev)
        # Ranked blocks each slot's (layer, KV head) read when it ranked (the stop rule's).
        self.budget = torch.zeros(layers, C, kv_heads, dtype=torch.int32, device=dev)
        self.tag = torch.full((C,), -1, dtype=torch.int32, device=dev)
        self.ranked = torch.zeros(C, dtype=torch.int32, device=dev)
        self._slot = torch.full((max_batch,), C - 1, dtype=torch.int32, device=dev)
        self._fresh = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self._nbr = torch.zeros(max_batch, dtype=torch.int32, device=dev)

    @property
    def nbytes(self) -> int:
        ts = (self.order, self.budget, self.tag, self.ranked, self._slot, self._fresh, self._nbr)
        return sum(t.numel() * t.element_size() for t in ts)

    def kept(self, layer: int, B: int) -> tuple[torch.Tensor, ...]:
        """`WaveAttention.run(kept=)` for `layer` and the first `B` rows."""
        slot, fresh, nbr = self.rows(B)
        return self.order[layer], slot, fresh, nbr, self.budget[layer]

    def rows(self, B: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(slot, fresh, nbr)` `[B]` int32 views: the step's map of the first B rows."""
        return self._slot[:B], self._fresh[:B], self._nbr[:B]

    def assign(
        self,
        rows: torch.Tensor,
        lengths: torch.Tensor,
        step: torch.Tensor,
        counts: torch.Tensor | None = None,
    ) -> None:
        """Map batch rows (request-table rows `rows [B]`, `lengths [B]`) to slots for the
        step `step [1]` (int32, device). `counts [2]` (int64, device), if given, gains the
        step's rows that rank and its rows in a slot (their ratio: how often a kept
        selection is scored again; 1 / interval when only the interval ranks)."""
        B = rows.shape[0]
        if B > self.max_batch:
            raise ValueError(f"batch {B} exceeds the selection cache's {self.max_batch}")
        C = self.tag.shape[0]
        slot, fresh, nbr = self.rows(B)
        _assign_kernel[(1,)](
            rows, lengths, step, self.tag, self.ranked, slot, fresh, nbr,
            counts if counts is not None else self.ranked,  # (unread without counts)
            B, C, self.interval, self.short_blocks,
            BS=self.block_size, RB=16, CP=triton.next_power_of_2(max(C, 2)),
            MAXNEW=MAX_NEW_BLOCKS, COUNT=counts is not None, num_warps=4,
        )  # fmt: skip

    def invalidate(self, rows: torch.Tensor) -> None:
        """Requests in request-table rows `rows` are being prefilled: their slots are
        freed (no sync; outside the decode graphs)."""
        hit = torch.isin(self.tag, rows.to(self.tag.dtype))
        self.tag.masked_fill_(hit, -1)

    def reset(self) -> None:
        """Forget every slot (after CUDA-graph warmup on dummy batches)."""
        self.tag.fill_(-1)
        self.ranked.zero_()
