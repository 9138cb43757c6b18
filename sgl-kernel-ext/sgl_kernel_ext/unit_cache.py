"""The unit cache's refresh, on the GPU: hot host units into HBM slots, cold ones out.

One launch per layer, grid (KV head, set); each program decides its set's ways
from the stamps the wave kernel wrote and copies the units it takes from the host
tier (UVA reads) into their pages, so the scheduler never reads a decision back:
fixed shape, no host sync. Spec and layout: `sglang_psa.algo.unit_cache.refresh_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled


@triton.jit
def _refresh_kernel(
    stamps_ptr,
    live_ptr,
    uslot_ptr,
    sunit_ptr,
    pages_ptr,
    host_k,
    host_v,
    pool_k,
    pool_v,
    step_ptr,
    copied_ptr,
    stamp_stride,
    HB,
    C,
    sets,
    keep,
    pool_tok_stride,
    pool_head_stride,
    host_head_stride,
    WAYS: tl.constexpr,
    CAND: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
):
    h = tl.program_id(0)
    s = tl.program_id(1)
    step = tl.load(step_ptr)
    k = tl.arange(0, CAND)
    hb = s + k * sets
    m = hb < HB
    live = tl.load(live_ptr + hb, mask=m, other=0) != 0
    st = tl.load(stamps_ptr + h * stamp_stride + hb, mask=m & live, other=0)
    cached = tl.load(uslot_ptr + h * (HB + 1) + hb, mask=m & live, other=-1) >= 0
    score = tl.where(m & live & (~cached) & (st >= step) & (st > 0), st, -1)
    tok = tl.arange(0, BS)
    dim = tl.arange(0, D)
    n = 0
    # Most sets have no new candidate once the cache is warm: such a program stops after
    # the scan, before the ways' loads and reductions and the shared counter's atomic
    # (thousands of programs per layer).
    if tl.max(score, axis=0) > 0:
        for w in range(WAYS):
            best = tl.max(score, axis=0)
            if best > 0:
                slot = s * WAYS + w
                page = tl.load(pages_ptr + slot).to(tl.int64)
                cur = tl.load(sunit_ptr + h * (C + 1) + slot)
                cur_st = tl.load(stamps_ptr + h * stamp_stride + tl.maximum(cur, 0))
                free = (cur < 0) | (cur_st <= step - keep)
                if (page > 0) & free:
                    # The first candidate at the best stamp, as a min-reduction: defined for
                    # ties (every unit the last step read has the same stamp) and the same in
                    # every thread.
                    bi = tl.min(tl.where(score == best, k, CAND), axis=0)
                    new = s + bi * sets
                    score = tl.where(k == bi, -1, score)
                    if cur >= 0:
                        tl.store(uslot_ptr + h * (HB + 1) + cur, -1)
                    tl.store(sunit_ptr + h * (C + 1) + slot, new)
                    tl.store(uslot_ptr + h * (HB + 1) + new, slot)
                    src = h.to(tl.int64) * host_head_stride
                    src += (new.to(tl.int64) * BS + tok)[:, None] * D
                    dst = (page * BS + tok)[:, None] * pool_tok_stride + h * pool_head_stride
                    tl.store(pool_k + dst + dim[None, :], tl.load(host_k + src + dim[None, :]))
                    tl.store(pool_v + dst + dim[None, :], tl.load(host_v + src + dim[None, :]))
                    n += 1
        tl.atomic_add(copied_ptr, n)  # one atomic per program that had candidates


def refresh_unit_cache(
    stamps: torch.Tensor,
    live: torch.Tensor,
    unit_slot: torch.Tensor,
    slot_unit: torch.Tensor,
    cache_pages: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    step: torch.Tensor,
    ways: int,
    keep: int,
    copied: torch.Tensor,
) -> None:
    """Refresh one layer's unit cache in place (see the module docstring); `copied [1]`
    (int32, device) gains the units copied in. `stamps [Hkv, HB]` may be a strided view
    (the host rows of the layer's stamps); `step [1]` int32 on the device. Runs on CUDA
    or under Triton's interpreter (the tiered home it serves needs CUDA)."""
    Hkv, HB = stamps.shape
    C = cache_pages.shape[0]
    if C % ways or unit_slot.shape != (Hkv, HB + 1) or slot_unit.shape != (Hkv, C + 1):
        raise ValueError(
            f"unit_slot must be [{Hkv}, {HB + 1}], slot_unit [{Hkv}, {C + 1}], and the "
            f"{C} slots a multiple of {ways} ways"
        )
    if host_k.shape[:2] != (Hkv, HB) or not host_k.is_contiguous() or pool_k.stride(2) != 1:
        raise ValueError("host units must be a contiguous [Hkv, HB, bs, d]; pool dims contiguous")
    sets = C // ways
    if sets == 0:
        return
    if not triton_enabled(stamps.device):
        raise RuntimeError("the unit cache runs on CUDA (or under TRITON_INTERPRET=1)")
    cand = triton.next_power_of_2(-(-HB // sets))
    _refresh_kernel[(Hkv, sets)](
        stamps, live, unit_slot, slot_unit, cache_pages, host_k, host_v, pool_k, pool_v,
        step, copied, stamps.stride(0), HB, C, sets, keep,
        pool_k.stride(0), pool_k.stride(1), host_k.stride(0),
        # One warp: with several, Triton 3.6 let warps of one program see different
        # choices from the reductions in the ways loop and copy parts of different units;
        # one warp per (KV head, set) is still hundreds of programs per layer.
        WAYS=ways, CAND=cand, BS=host_k.shape[2], D=host_k.shape[3], num_warps=1,
    )  # fmt: skip
    return
