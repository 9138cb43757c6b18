"""Block metadata (mean, per-channel min and max of the keys) for many blocks, one launch.

When tail blocks fill during decode, or a prefill writes whole blocks, their
summaries are computed on the GPU in a single launch for the whole batch
(spec: `sglang_psa.algo.block_metadata`). Keys are stored as units
`[num_units, block_size, d]`; `counts[i]` tokens at the start of unit
`unit_idx[i]` are valid; the summaries go to row `meta_idx[i]` of the
outputs `[num_meta, d]` (float32, or the KV dtype: min and max are exact in it).
One program per unit reads the whole unit as one tile and reduces it in float32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _block_meta_kernel(
    k_ptr,
    unit_idx,
    counts,
    mean_ptr,
    min_ptr,
    max_ptr,
    meta_idx,
    unit_stride,
    tok_stride,
    BS: tl.constexpr,
    D: tl.constexpr,
    BS_P: tl.constexpr,
    D_P: tl.constexpr,
):
    i = tl.program_id(0)
    u = tl.load(unit_idx + i).to(tl.int64)
    c = tl.load(counts + i).to(tl.int32)
    m = tl.load(meta_idx + i).to(tl.int64)
    t = tl.arange(0, BS_P)
    d = tl.arange(0, D_P)
    dm = d < D
    valid = (t < c)[:, None] & dm[None, :]
    k = tl.load(k_ptr + u * unit_stride + t[:, None] * tok_stride + d[None, :], mask=valid)
    k = k.to(tl.float32)
    tl.store(mean_ptr + m * D + d, tl.sum(tl.where(valid, k, 0.0), axis=0) / c, mask=dm)
    tl.store(min_ptr + m * D + d, tl.min(tl.where(valid, k, float("inf")), axis=0), mask=dm)
    tl.store(max_ptr + m * D + d, tl.max(tl.where(valid, k, float("-inf")), axis=0), mask=dm)


def block_meta_update(
    k_units: torch.Tensor,
    unit_idx: torch.Tensor,
    counts: torch.Tensor,
    mean: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    meta_idx: torch.Tensor,
) -> None:
    """Summaries of units `unit_idx` (first `counts` tokens each, 1..block_size) into rows
    `meta_idx` of the contiguous floating `mean/kmin/kmax` `[num_meta, d]`, one launch.

    Without CUDA and outside the Triton interpreter this is the same computation
    in torch (identical up to float32 summation order).
    """
    n = unit_idx.numel()
    if n == 0:
        return
    _, bs, d = k_units.shape
    for name, t in (("mean", mean), ("kmin", kmin), ("kmax", kmax)):
        if not t.is_floating_point() or t.dim() != 2 or t.shape[1] != d or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous floating [num_meta, {d}] tensor")
    if counts.numel() != n or meta_idx.numel() != n:
        raise ValueError(f"unit_idx, counts and meta_idx must have equal length ({n})")
    if k_units.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        if k_units.stride(2) != 1:
            raise ValueError("k_units must have contiguous channels (stride 1 on the last dim)")
        _block_meta_kernel[(n,)](
            k_units,
            unit_idx,
            counts,
            mean,
            kmin,
            kmax,
            meta_idx,
            k_units.stride(0),
            k_units.stride(1),
            BS=bs,
            D=d,
            BS_P=triton.next_power_of_2(bs),
            D_P=triton.next_power_of_2(d),
        )
        return
    k = k_units[unit_idx.long()].float()
    valid = (torch.arange(bs, device=k.device)[None, :] < counts[:, None].long())[..., None]
    rows = meta_idx.long()
    mean[rows] = ((k * valid).sum(1) / counts.float()[:, None]).to(mean.dtype)
    kmin[rows] = torch.where(valid, k, torch.inf).amin(1).to(kmin.dtype)
    kmax[rows] = torch.where(valid, k, -torch.inf).amax(1).to(kmax.dtype)
