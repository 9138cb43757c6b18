"""The unit cache's refresh, on the GPU: hot host units into HBM slots, cold ones out.

One launch for every layer, grid (KV head, set); each program decides its set's
positions (shared by the layers) from the stamps the wave kernel wrote and copies
the units it takes from the host tier (UVA reads) into their pages, so the
scheduler never reads a decision back: fixed shape, no host sync. Spec and layout:
`sglang_psa.algo.unit_cache.refresh_ref`.

A program ranks its candidates (layer by layer, in (layer, host block) order) and
its free positions (in position order) by prefix sums, leaves both lists in its own
rows of `scratch`, and pairs the i-th candidate with the i-th free position: the
sequential walk of the reference, in one pass over each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled

# Layer buffers lie a multiple of this many elements apart (`layer_offsets` checks); the
# kernels that add those offsets tell the compiler so, which keeps their loads and stores
# vectorized.
LAYER_ALIGN = tl.constexpr(16)


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
    koff_ptr,
    voff_ptr,
    step_ptr,
    copied_ptr,
    scratch_ptr,
    stamp_stride,
    HB,
    C,
    sets,
    keep,
    L,
    H,
    pool_tok_stride,
    pool_head_stride,
    WAYS: tl.constexpr,
    CAND: tl.constexpr,
    PP: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
):
    h = tl.program_id(0)
    s = tl.program_id(1)
    step = tl.load(step_ptr)
    base = scratch_ptr + (h * sets + s).to(tl.int64) * (2 * PP)
    k = tl.arange(0, CAND)
    hb = s + k * sets
    m = hb < HB
    live = m & (tl.load(live_ptr + hb, mask=m, other=0) != 0)
    # Candidates, layer by layer: rank r (in (layer, host block) order) goes to
    # scratch[r] as `layer * CAND + k`; only the first PP can find a position.
    ncand = 0
    for ly in range(L):
        row = ly * H + h
        st = tl.load(stamps_ptr + row * stamp_stride + hb, mask=live, other=0)
        cached = tl.load(uslot_ptr + row * (HB + 1) + hb, mask=live, other=-1) >= 0
        cand = live & (~cached) & (st >= step) & (st > 0)
        rank = ncand + tl.cumsum(cand.to(tl.int32), axis=0) - 1
        tl.store(base + rank, ly * CAND + k, mask=cand & (rank < PP))
        ncand += tl.sum(cand.to(tl.int32), axis=0)
    # Most sets have no new candidate once the cache is warm: such a program stops here,
    # before the positions' loads and the shared counter's atomic.
    if ncand > 0:
        p = tl.arange(0, PP)
        pm = p < WAYS * L
        pslot = s * WAYS + p // L
        page = tl.load(pages_ptr + pslot, mask=pm, other=0)
        q = pslot * L + p % L
        cur = tl.load(sunit_ptr + h * (C * L + 1) + q, mask=pm & (page > 0), other=-1)
        c0 = tl.maximum(cur, 0)
        cur_st = tl.load(
            stamps_ptr + ((c0 // HB) * H + h) * stamp_stride + c0 % HB, mask=cur >= 0, other=0
        )
        free = pm & (page > 0) & ((cur < 0) | (cur_st <= step - keep))
        frank = tl.cumsum(free.to(tl.int32), axis=0) - 1
        tl.store(base + PP + frank, p, mask=free)
        n = tl.minimum(ncand, tl.sum(free.to(tl.int32), axis=0))
        tl.debug_barrier()  # the lists in scratch, seen by every thread
        tok = tl.arange(0, BS)
        dim = tl.arange(0, D)
        for r in range(n):
            u = tl.load(base + r)
            p1 = tl.load(base + PP + r)
            ul = u // CAND
            uhb = s + (u % CAND) * sets
            l2 = p1 % L
            slot = s * WAYS + p1 // L
            q1 = slot * L + l2
            page1 = tl.load(pages_ptr + slot).to(tl.int64)
            old = tl.load(sunit_ptr + h * (C * L + 1) + q1)
            if old >= 0:
                tl.store(uslot_ptr + ((old // HB) * H + h) * (HB + 1) + old % HB, -1)
            tl.store(sunit_ptr + h * (C * L + 1) + q1, ul * HB + uhb)
            tl.store(uslot_ptr + (ul * H + h) * (HB + 1) + uhb, q1)
            src = ((ul * H + h).to(tl.int64) * HB + uhb) * (BS * D)
            src += (tok * D)[:, None] + dim[None, :]
            dst = ((page1 * BS + tok) * pool_tok_stride + h * pool_head_stride)[:, None]
            dst += dim[None, :]
            kd = tl.multiple_of(tl.load(koff_ptr + l2), LAYER_ALIGN)
            vd = tl.multiple_of(tl.load(voff_ptr + l2), LAYER_ALIGN)
            tl.store(pool_k + kd + dst, tl.load(host_k + src))
            tl.store(pool_v + vd + dst, tl.load(host_v + src))
        tl.atomic_add(copied_ptr, n)  # one atomic per program that had candidates


def layer_offsets(buffers: list[torch.Tensor]) -> list[int]:
    """Each layer buffer's element offset from the first's: a kernel reaches any layer
    from one base pointer. The buffers share dtype, shape and strides (SGLang's pool), and
    lie a multiple of `LAYER_ALIGN` elements apart (torch's allocations are 512-byte
    aligned on CUDA)."""
    b0 = buffers[0]
    size = b0.element_size()
    align = LAYER_ALIGN.value
    for b in buffers:
        if b.dtype != b0.dtype or b.shape != b0.shape or b.stride() != b0.stride():
            raise ValueError("the pool's layer buffers differ in dtype, shape or strides")
        if (b.data_ptr() - b0.data_ptr()) % (align * size):
            raise ValueError(
                f"the pool's layer buffers do not lie a multiple of {align} elements apart"
            )
    return [(b.data_ptr() - b0.data_ptr()) // size for b in buffers]


def layer_offset_tensors(k_bufs, v_bufs, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer_offsets` of the K and of the V buffers as int64 `[L]` tensors on `device`,
    through pinned memory on CUDA (no host sync; the copy runs on the current stream)."""
    device = torch.device(device)
    return tuple(
        torch.tensor(layer_offsets(b), dtype=torch.int64, pin_memory=device.type == "cuda").to(
            device, non_blocking=True
        )
        for b in (k_bufs, v_bufs)
    )


class LayerOffsetCache:
    """`layer_offset_tensors` of the buffers last asked for, made again only when they
    change (SGLang's pool is fixed: one small copy, once), for a caller that launches a
    layered kernel every batch."""

    def __init__(self):
        self._key: tuple | None = None
        self._value: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(self, k_bufs, v_bufs, device) -> tuple[torch.Tensor, torch.Tensor]:
        key = tuple(b.data_ptr() for b in (*k_bufs, *v_bufs))
        if self._key != key:
            self._value = layer_offset_tensors(k_bufs, v_bufs, device)  # no sync
            self._key = key
        return self._value


def scratch_size(kv_heads: int, slots: int, ways: int, layers: int) -> int:
    """int32 elements of `refresh_unit_cache`'s scratch for this cache shape."""
    return kv_heads * (slots // ways) * 2 * _positions(ways, layers)


def _positions(ways: int, layers: int) -> int:
    return triton.next_power_of_2(ways * layers)


def refresh_unit_cache(
    stamps: torch.Tensor,
    live: torch.Tensor,
    unit_slot: torch.Tensor,
    slot_unit: torch.Tensor,
    cache_pages: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    pool_k: list[torch.Tensor],
    pool_v: list[torch.Tensor],
    step: torch.Tensor,
    ways: int,
    keep: int,
    copied: torch.Tensor,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Refresh the unit cache of every layer in place (see the module docstring); `copied
    [1]` (int32, device) gains the units copied in. `stamps [L * Hkv, HB]` may be a
    strided view (the host columns of the stamps); `step [1]` int32 on the device;
    `pool_k/v` the L layers' buffers. `offsets` (int64 `[L]` each, `layer_offsets` of
    `pool_k` and `pool_v` on the device) and `scratch` (int32, `scratch_size`) are
    allocated here when not given (a caller replaying a CUDA graph gives them). Runs on
    CUDA or under Triton's interpreter (the tiered home it serves needs CUDA)."""
    L = len(pool_k)
    LH, HB = stamps.shape
    H = LH // L
    C = cache_pages.shape[0]
    if LH != L * H or C % ways or unit_slot.shape != (LH, HB + 1):
        raise ValueError(
            f"stamps must be [{L} layers x Hkv, HB], unit_slot [{LH}, {HB + 1}], and the "
            f"{C} page slots a multiple of {ways} ways"
        )
    if slot_unit.shape != (H, C * L + 1):
        raise ValueError(f"slot_unit must be [{H}, {C * L + 1}], got {tuple(slot_unit.shape)}")
    if host_k.shape[:3] != (L, H, HB) or not host_k.is_contiguous():
        raise ValueError(f"host units must be a contiguous [{L}, {H}, {HB}, bs, d]")
    if pool_k[0].stride(2) != 1 or pool_k[0].stride() != pool_v[0].stride():
        raise ValueError("the pool's K and V buffers must share strides, head dims contiguous")
    sets = C // ways
    if sets == 0:
        return
    if not triton_enabled(stamps.device):
        raise RuntimeError("the unit cache runs on CUDA (or under TRITON_INTERPRET=1)")
    dev = stamps.device
    if offsets is None:
        offsets = layer_offset_tensors(pool_k, pool_v, dev)
    if scratch is None:
        scratch = torch.empty(scratch_size(H, C, ways, L), dtype=torch.int32, device=dev)
    cand = triton.next_power_of_2(-(-HB // sets))
    _refresh_kernel[(H, sets)](
        stamps, live, unit_slot, slot_unit, cache_pages, host_k, host_v, pool_k[0], pool_v[0],
        offsets[0], offsets[1], step, copied, scratch, stamps.stride(0), HB, C, sets, keep,
        L, H, pool_k[0].stride(0), pool_k[0].stride(1),
        # One warp: with several, Triton 3.6 let warps of one program see different
        # choices from the reductions in a sequential ways loop; one warp per (KV head,
        # set) is still hundreds of programs.
        WAYS=ways, CAND=cand, PP=_positions(ways, L), BS=host_k.shape[3], D=host_k.shape[4],
        num_warps=1,
    )  # fmt: skip
