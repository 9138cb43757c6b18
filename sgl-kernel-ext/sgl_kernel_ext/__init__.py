"""Triton kernels of sglang-psa (references in `sglang_psa.algo`)."""

from sgl_kernel_ext.gather import BlockCopier, gather_blocks, scatter_blocks
from sgl_kernel_ext.metadata import page_meta_from_locs, page_meta_from_table
from sgl_kernel_ext.scoring import block_scores
from sgl_kernel_ext.wave_attention import WaveAttention, WaveResult

__all__ = [
    "BlockCopier",
    "WaveAttention",
    "WaveResult",
    "block_scores",
    "gather_blocks",
    "page_meta_from_locs",
    "page_meta_from_table",
    "scatter_blocks",
]
