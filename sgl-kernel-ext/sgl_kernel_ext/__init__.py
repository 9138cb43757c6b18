"""Triton kernels of sglang-psa (references in `sglang_psa.algo`)."""

from sgl_kernel_ext.metadata import page_meta_from_locs, page_meta_from_table
from sgl_kernel_ext.scoring import block_scores
from sgl_kernel_ext.wave_attention import WaveAttention, WaveResult

__all__ = [
    "WaveAttention",
    "WaveResult",
    "block_scores",
    "page_meta_from_locs",
    "page_meta_from_table",
]
