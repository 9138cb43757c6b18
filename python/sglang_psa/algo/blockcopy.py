"""Reference for the block gather/scatter kernels: plain indexed copy."""

from __future__ import annotations

import torch


def gather_blocks_ref(src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor,
                      dst_idx: torch.Tensor) -> torch.Tensor:
    """`dst[dst_idx[i]] = src[src_idx[i]]` on a copy of `dst`, which is returned."""
    out = dst.clone()
    out[dst_idx.long().cpu()] = src[src_idx.long().cpu()].to(out.device)
    return out
