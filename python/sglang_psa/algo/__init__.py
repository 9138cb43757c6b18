"""Reference PyTorch implementation of the algorithm: the spec kernels are tested against."""

from sglang_psa.algo.attention import (
    SparseResult,
    dense_attention,
    oracle_attention,
    progressive_attention,
    topk_attention,
    true_coverage,
)
from sglang_psa.algo.criticality import bound_logits, criticality, mean_logits
from sglang_psa.algo.metadata import (
    BlockMeta,
    BlockMetaCache,
    as_kept,
    block_metadata,
    bound_codes,
    num_blocks,
    quantize_bounds,
)

__all__ = [
    "BlockMeta",
    "BlockMetaCache",
    "as_kept",
    "SparseResult",
    "block_metadata",
    "bound_logits",
    "criticality",
    "dense_attention",
    "mean_logits",
    "num_blocks",
    "oracle_attention",
    "progressive_attention",
    "bound_codes",
    "quantize_bounds",
    "topk_attention",
    "true_coverage",
]
