"""Reference for the write-back's page gather kernel: plain indexed copy."""

from __future__ import annotations

import torch


def gather_pages_head_major_ref(
    k_src: torch.Tensor, v_src: torch.Tensor, pages: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages `pages [n]` of one layer `[tokens, heads, d]`, head-major: `[heads, n*bs, d]`
    where row `i*bs + t` of head `h` is token `t` of page `pages[i]` (the write-back's
    staging layout: each head's blocks one contiguous run)."""
    out = []
    for src in (k_src, v_src):
        blocks = [src[int(p) * block_size : (int(p) + 1) * block_size] for p in pages.tolist()]
        rows = torch.cat(blocks) if blocks else src[:0]
        out.append(rows.permute(1, 0, 2).contiguous())
    return out[0], out[1]
