"""Read order of KV blocks from their per-head logits: a chunked sort, one or two launches.

The spec is `WaveAttention.rank`'s torch path: criticality = max over the GQA group
of (logit - logsumexp over the request's blocks); sink and tail blocks first, in
block order; then by criticality, descending, ties by block.

One program per (request, KV head) sorting a whole row leaves most SMs idle. Instead
each row is cut into chunks of `C`
blocks: one program per (request, KV head, chunk) sorts its chunk in registers,
and a second launch places every element at its global rank = its rank in its own
chunk + its count of smaller elements in each other chunk (binary searches). Keys
are unique (the block index is packed under the float key), so ranks are too.
Rows of at most `C` blocks need only the first launch. The row's log-sum-exp comes
from per-chunk (max, sum of exp) partials the scoring kernel writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rank_chunk_kernel(
    logit_ptr,
    part_ptr,
    lengths_ptr,
    sorted_ptr,
    order_ptr,
    nforced_ptr,
    loc_ptr,
    rloc_ptr,
    fresh_ptr,
    orow_ptr,
    Hkv,
    NB,
    NP,
    sink,
    recent,
    G: tl.constexpr,
    BS: tl.constexpr,
    C: tl.constexpr,
    NPP: tl.constexpr,
    DIRECT: tl.constexpr,
    LOC: tl.constexpr,
    PB: tl.constexpr,
    SKIP_PAST: tl.constexpr,
    MAPPED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    orow = b
    if MAPPED:  # a kept selection: rank only fresh rows, into their slot's order row
        if tl.load(fresh_ptr + b) == 0:
            return
        orow = tl.load(orow_ptr + b)
    length = tl.load(lengths_ptr + b)
    nblk = (length + BS - 1) // BS
    if SKIP_PAST:  # a chunk wholly past the request's blocks: nothing to write
        if c * C >= nblk:
            return
    i = tl.arange(0, C)
    j = c * C + i
    inb = j < NB
    p = tl.arange(0, NPP)
    pm = p < NP
    if PB > 0:  # partials of chunks past the request's blocks were not written
        pm = pm & (p * PB < nblk)
    crit = tl.full([C], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        row = (b * Hkv + h) * G + g
        # The row's log-sum-exp from its partial (max, sum of exp) pairs.
        pmax = tl.load(part_ptr + (row * NP + p) * 2, mask=pm, other=float("-inf"))
        psum = tl.load(part_ptr + (row * NP + p) * 2 + 1, mask=pm, other=0.0)
        m = tl.max(pmax, axis=0)
        lse = m + tl.log(tl.sum(tl.where(pmax == float("-inf"), 0.0, psum * tl.exp(pmax - m)), 0))
        x = tl.load(logit_ptr + row * NB + j, mask=inb & (j < nblk), other=float("-inf"))
        crit = tl.maximum(crit, x - lse)
    forced = (j < nblk) & ((j < sink) | (j >= nblk - recent))
    key = tl.where(forced, float("inf"), crit)
    key = tl.where(j < nblk, key, float("-inf"))  # past the request: padding, in block order
    # Float order as signed-int order (flip the magnitude bits of negatives), reversed for
    # an ascending sort to give descending keys, packed above the block index so ties keep
    # block order (and padding, -inf with the largest indices, sorts last).
    bits = key.to(tl.int32, bitcast=True)
    s = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = ((~s).to(tl.int64) << 32) | j.to(tl.int64)
    if c * C < nblk:  # a chunk past the request's blocks is all padding, already in order
        packed = tl.sort(packed, dim=0)
    if DIRECT:  # the row is one chunk: its sorted order is the answer
        idx = (packed & 0xFFFFFFFF).to(tl.int32)
        tl.store(order_ptr + (orow * Hkv + h) * NB + i, idx, mask=inb)
        if LOC:
            where = tl.load(loc_ptr + (b * Hkv + h) * NB + idx, mask=inb)
            tl.store(rloc_ptr + (b * Hkv + h) * NB + i, where, mask=inb)
    else:
        tl.store(sorted_ptr + ((b * Hkv + h) * tl.num_programs(2) + c) * C + i, packed)
    # sink and tail blocks, overlapping when the request is short
    tl.store(nforced_ptr + b, tl.minimum(nblk, sink + recent), mask=(h == 0) & (c == 0))


@triton.jit
def _rank_merge_kernel(
    sorted_ptr,
    order_ptr,
    loc_ptr,
    rloc_ptr,
    lengths_ptr,
    fresh_ptr,
    orow_ptr,
    Hkv,
    NB,
    BS: tl.constexpr,
    C: tl.constexpr,
    LOG2C: tl.constexpr,
    LOC: tl.constexpr,
    SKIP_PAST: tl.constexpr,
    MAPPED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    orow = b
    if MAPPED:
        if tl.load(fresh_ptr + b) == 0:
            return
        orow = tl.load(orow_ptr + b)
    nch = tl.num_programs(2)
    base = sorted_ptr + (b * Hkv + h) * nch * C
    # Only chunks holding the request's blocks are counted: a chunk past them is padding,
    # which sorts after every block and keeps block order (its elements stay in place).
    length = tl.load(lengths_ptr + b)
    nvalid = tl.cdiv((length + BS - 1) // BS, C)
    if SKIP_PAST:  # ... and with SKIP_PAST it was never sorted nor is it written
        if c >= nvalid:
            return
    i = tl.arange(0, C)
    x = tl.load(base + c * C + i)
    pos = i + tl.where(c >= nvalid, c * C, 0)
    for c2 in range(0, tl.where(c < nvalid, tl.minimum(nvalid, nch), 0)):
        if c2 != c:
            other = base + c2 * C
            # Branchless lower bound: how many of the other chunk's keys are below x.
            lo = tl.zeros([C], tl.int32)
            for k in tl.static_range(LOG2C):
                step = C >> (k + 1)
                lo = tl.where(tl.load(other + lo + step - 1) < x, lo + step, lo)
            lo += (tl.load(other + lo) < x).to(tl.int32)
            pos += lo
    idx = (x & 0xFFFFFFFF).to(tl.int32)
    tl.store(order_ptr + (orow * Hkv + h) * NB + pos, idx, mask=idx < NB)
    if LOC:
        where = tl.load(loc_ptr + (b * Hkv + h) * NB + idx, mask=idx < NB)
        tl.store(rloc_ptr + (b * Hkv + h) * NB + pos, where, mask=idx < NB)


def logit_partials(logits: torch.Tensor) -> torch.Tensor:
    """`[B, Hq, 1, 2]` (max, sum of exp below it) of each row: the partials `rank_blocks`
    combines, for callers whose scoring did not write them."""
    m = logits.amax(-1, keepdim=True)
    s = torch.where(logits == -torch.inf, 0.0, (logits - m).exp()).sum(-1, keepdim=True)
    return torch.stack([m, s], -1).float().contiguous()


def rank_blocks(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    sink: int,
    recent: int,
    n_kv_heads: int,
    order: torch.Tensor | None = None,
    n_forced: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    chunk_blocks: int = 512,
    loc: torch.Tensor | None = None,
    ranked_loc: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    partial_blocks: int = 0,
    skip_past_length: bool = False,
    fresh: torch.Tensor | None = None,
    order_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order `[B, Hkv, NB]` int32 and forced counts `[B]` int32 from logits `[B, Hq, NB]`
    (float32, -inf past each request's blocks). `partials [B, Hq, P, 2]` are the rows'
    (max, sum of exp) over P chunks (`block_scores(partials=...)`); without them they are
    computed here. Pass `order`/`n_forced` to reuse buffers. With a block table `loc`
    `[B, Hkv, NB]` int32, `ranked_loc [B, Hkv, NB]` int32 receives it in read order
    (`loc.gather(-1, order)`), so the wave kernel finds a ranked block's K/V with one
    load fewer on its critical path. `scratch` (int64, `rank_scratch_numel` elements)
    holds the sorted chunks; without it one is allocated per call.
    `partial_blocks` > 0: partial `p` covers blocks `[p * partial_blocks, ...)` and those
    wholly past a request's blocks are ignored (`block_scores(skip_past_length=True)`
    leaves them unwritten; so are its logits there: keys past a request's blocks are
    never read). `skip_past_length`: only the chunks of `chunk_blocks` holding a
    request's blocks are written to `order`/`ranked_loc`; past them the buffers keep
    what they held (the wave kernel never reads past a request's blocks).
    A kept selection (`sgl_kernel_ext.selection`): with `fresh [B]` and `order_rows [B]`
    (int32) only rows with `fresh` rank, writing row `order_rows[b]` of `order`
    (`[slots, Hkv, NB]`); the others are left as they were (no `loc`)."""
    B, Hq, NB = logits.shape
    G = Hq // n_kv_heads
    dev = logits.device
    mapped = fresh is not None
    if mapped and (order is None or order_rows is None or loc is not None):
        raise ValueError("a kept selection ranks into `order` rows `order_rows`, without loc")
    if order is None:
        order = torch.empty(B, n_kv_heads, NB, dtype=torch.int32, device=dev)
    if n_forced is None:
        n_forced = torch.empty(B, dtype=torch.int32, device=dev)
    if partials is None:
        partials = logit_partials(logits)
    if chunk_blocks < 2 or chunk_blocks & (chunk_blocks - 1):
        raise ValueError(f"chunk_blocks must be a power of two >= 2, got {chunk_blocks}")
    C, nch = _chunks(NB, chunk_blocks)
    direct = nch == 1
    if direct:
        scratch = order
    elif scratch is None or scratch.numel() < B * n_kv_heads * nch * C:
        scratch = torch.empty(B * n_kv_heads * nch * C, dtype=torch.int64, device=dev)
    NP = partials.shape[2]
    lengths32 = lengths.to(torch.int32).contiguous()
    has_loc = loc is not None
    if has_loc:
        if loc.shape != (B, n_kv_heads, NB) or loc.dtype != torch.int32:
            raise ValueError(f"loc must be [{B}, {n_kv_heads}, {NB}] int32")
        if ranked_loc is None or ranked_loc.shape != loc.shape or ranked_loc.dtype != loc.dtype:
            raise ValueError(f"with loc, pass ranked_loc [{B}, {n_kv_heads}, {NB}] int32 to fill")
        loc = loc.contiguous()
    loc_args = (loc, ranked_loc) if has_loc else (order, order)
    map_args = (fresh, order_rows) if mapped else (n_forced, n_forced)
    _rank_chunk_kernel[(B, n_kv_heads, nch)](
        logits.contiguous(), partials.contiguous(), lengths32, scratch, order, n_forced,
        *loc_args, *map_args, n_kv_heads, NB, NP, sink, recent,
        G=G, BS=block_size, C=C, NPP=triton.next_power_of_2(max(NP, 2)), DIRECT=direct,
        LOC=has_loc, PB=partial_blocks, SKIP_PAST=skip_past_length, MAPPED=mapped,
        num_warps=4 if C <= 1024 else 8,
    )  # fmt: skip
    if not direct:
        _rank_merge_kernel[(B, n_kv_heads, nch)](
            scratch, order, *loc_args, lengths32, *map_args, n_kv_heads, NB,
            BS=block_size, C=C, LOG2C=C.bit_length() - 1, LOC=has_loc,
            SKIP_PAST=skip_past_length, MAPPED=mapped, num_warps=4,
        )  # fmt: skip
    return order, n_forced


def _chunks(n_blocks: int, chunk_blocks: int) -> tuple[int, int]:
    """Blocks per sorted chunk and chunks per row."""
    C = min(chunk_blocks, triton.next_power_of_2(max(n_blocks, 2)))
    return C, triton.cdiv(n_blocks, C)


def rank_scratch_numel(batch: int, n_kv_heads: int, n_blocks: int, chunk_blocks: int = 512) -> int:
    """Elements of the int64 scratch `rank_blocks` needs for this shape (0: none)."""
    C, nch = _chunks(n_blocks, chunk_blocks)
    return 0 if nch == 1 else batch * n_kv_heads * nch * C
