"""Reference for the block gather/scatter kernels: plain indexed copy."""

from __future__ import annotations

import torch


def gather_blocks_ref(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> torch.Tensor:
    """`dst[dst_idx[i]] = src[src_idx[i]]` on a copy of `dst`, which is returned.

    Works across devices (host pool -> HBM slots and back) so tests can compare
    a kernel's in-place result with it.
    """
    out = dst.clone()
    out[dst_idx.long().to(out.device)] = src[src_idx.long().to(src.device)].to(out.device)
    return out
