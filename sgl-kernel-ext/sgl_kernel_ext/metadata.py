"""Block metadata (mean, per-channel min and max of the keys) for many blocks, one launch.

When tail blocks fill during decode, or a prefill writes whole blocks, their
summaries are computed on the GPU in a single launch for the whole batch
(spec: `sglang_psa.algo.block_metadata`). Keys are stored as units
`[num_units, block_size, d]`; `counts[i]` tokens at the start of unit
`unit_idx[i]` are valid; the summaries go to row `meta_idx[i]` of the
float32 outputs `[num_meta, d]`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _block_meta_kernel(
    k_ptr, unit_idx, counts, mean_ptr, min_ptr, max_ptr, meta_idx, BS: tl.constexpr, D: tl.constexpr
):
    i = tl.program_id(0)
    u = tl.load(unit_idx + i).to(tl.int64)
    c = tl.load(counts + i)
    m = tl.load(meta_idx + i).to(tl.int64)
    t = tl.arange(0, BS)
    d = tl.arange(0, D)
    valid = (t < c)[:, None]
    k = tl.load(k_ptr + u * BS * D + t[:, None] * D + d[None, :], mask=valid, other=0.0)
    k = k.to(tl.float32)
    tl.store(mean_ptr + m * D + d, tl.sum(k, axis=0) / c.to(tl.float32))
    tl.store(min_ptr + m * D + d, tl.min(tl.where(valid, k, float("inf")), axis=0))
    tl.store(max_ptr + m * D + d, tl.max(tl.where(valid, k, float("-inf")), axis=0))


def block_meta_update(
    k_units: torch.Tensor,
    unit_idx: torch.Tensor,
    counts: torch.Tensor,
    mean: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    meta_idx: torch.Tensor,
) -> None:
    """Summaries of units `unit_idx` (first `counts` tokens each, 1..block_size) into row
    `meta_idx` of `mean/kmin/kmax`. Torch fallback without CUDA or interpreter."""
    n = unit_idx.numel()
    if n == 0:
        return
    _, bs, d = k_units.shape
    if os.environ.get("TRITON_INTERPRET") == "1" or k_units.is_cuda:
        _block_meta_kernel[(n,)](k_units, unit_idx, counts, mean, kmin, kmax, meta_idx, BS=bs, D=d)
        return
    k = k_units[unit_idx.long()].float()
    valid = (torch.arange(bs)[None, :] < counts[:, None].long())[..., None]
    c = counts.float()[:, None]
    rows = meta_idx.long()
    mean[rows] = (k * valid).sum(1) / c
    kmin[rows] = torch.where(valid, k, torch.inf).amin(1)
    kmax[rows] = torch.where(valid, k, -torch.inf).amax(1)
