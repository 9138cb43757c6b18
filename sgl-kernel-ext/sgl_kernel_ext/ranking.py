"""Read order of KV blocks from their per-head logits, in one launch.

Replaces a dozen small torch kernels per layer (log-sum-exp, group max, forced
mask, stable descending sort, forced count) with one program per (request, KV
head). The spec is `WaveAttention.rank`'s torch path: criticality = max over
the GQA group of (logit - logsumexp over the request's blocks); sink and tail
blocks first, in block order; then by criticality, descending, ties by block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rank_kernel(
    logit_ptr,
    lengths_ptr,
    order_ptr,
    nforced_ptr,
    Hkv,
    NB,
    sink,
    recent,
    G: tl.constexpr,
    BS: tl.constexpr,
    NBP: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths_ptr + b)
    nblk = (length + BS - 1) // BS
    j = tl.arange(0, NBP)
    inb = j < NB
    crit = tl.full([NBP], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        x = tl.load(logit_ptr + ((b * Hkv + h) * G + g) * NB + j, mask=inb, other=float("-inf"))
        m = tl.max(x, axis=0)
        lse = m + tl.log(tl.sum(tl.exp(x - m), axis=0))
        crit = tl.maximum(crit, x - lse)
    forced = (j < nblk) & ((j < sink) | (j >= nblk - recent))
    key = tl.where(forced, float("inf"), crit)
    key = tl.where(inb, key, float("-inf"))
    # Float order as signed-int order (flip the magnitude bits of negatives), reversed for
    # a descending sort, packed above the block index so ties keep block order.
    bits = key.to(tl.int32, bitcast=True)
    s = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    packed = ((~s).to(tl.int64) << 32) | j.to(tl.int64)
    packed = tl.sort(packed, dim=0)
    idx = (packed & 0xFFFFFFFF).to(tl.int32)
    tl.store(order_ptr + (b * Hkv + h) * NB + j, idx, mask=inb)
    n_forced = tl.sum(forced.to(tl.int32), axis=0)
    tl.store(nforced_ptr + b, n_forced, mask=h == 0)


def rank_blocks(
    logits: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    sink: int,
    recent: int,
    n_kv_heads: int,
    order: torch.Tensor | None = None,
    n_forced: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Order `[B, Hkv, NB]` int32 and forced counts `[B]` int32 from logits `[B, Hq, NB]`
    (float32, -inf past each request's blocks). Pass `order`/`n_forced` to reuse buffers."""
    B, Hq, NB = logits.shape
    G = Hq // n_kv_heads
    if order is None:
        order = torch.empty(B, n_kv_heads, NB, dtype=torch.int32, device=logits.device)
    if n_forced is None:
        n_forced = torch.empty(B, dtype=torch.int32, device=logits.device)
    _rank_kernel[(B, n_kv_heads)](
        logits.contiguous(),
        lengths.to(torch.int32).contiguous(),
        order,
        n_forced,
        n_kv_heads,
        NB,
        sink,
        recent,
        G=G,
        BS=block_size,
        NBP=triton.next_power_of_2(max(NB, 2)),
        num_warps=4 if NB <= 1024 else 8,
    )
    return order, n_forced
