"""How large SGLang's KV pool is under `--sparse-mode`; the pool stays in GPU memory.

- `--psa-kv-home hbm`: the pool's byte budget per token grows by the per-page
  block metadata (mean keys, plus min/max for key bounds).
- `--psa-kv-home tiered`: as for `hbm`; the block metadata, last-read stamps and
  unit-cache slots of every host-tier block (a block whose page was given back is
  still scored) and the unit cache's per-page table come out of the same HBM
  budget, so the pool has fewer tokens (`host_row_bytes`, `unit_cache_bytes_per_page`).
"""

from __future__ import annotations

import dataclasses
import logging
import weakref

from sglang_psa.config import flag_name
from sglang_psa.distributed import kv_ranks
from sglang_psa.mem_cache.kv_budget import (
    host_blocks,
    host_row_bytes,
    metadata_bytes_per_token,
    unit_cache_bytes_per_page,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _CellShape:
    """What `_compute_cell_size` saw, kept for the same configurator's pool sizing."""

    kv_bytes_per_token: int  # SGLang's own cell size, without the block metadata
    kv_dtype: object
    layers: int


# Configurator -> the shape its cell size was computed for. Kept beside SGLang's object,
# never written onto it; an entry goes when its configurator does.
_shapes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _config():
    from sglang_psa.plugin.flags import imported

    return imported()


def after_compute_cell_size(result, configurator, kvc, num_layers):
    """SGLang sizes its KV pool by HBM bytes per token: the KV plus the block metadata."""
    cfg = _config()
    if cfg is None or getattr(kvc, "use_mla_backend", False):
        return result
    meta = metadata_bytes_per_token(result, kvc.kv_cache_dtype, cfg)
    _shapes[configurator] = _CellShape(result, kvc.kv_cache_dtype, num_layers)
    return result + meta


def after_calculate_pool_sizes(result, configurator, available_bytes, page_size):
    """At the tiered home the token budget leaves HBM for the host blocks' rows."""
    cfg = _config()
    shape = _shapes.get(configurator)
    if cfg is not None and cfg.kv_home == "tiered" and shape and shape.kv_bytes_per_token:
        return _tiered_pool_size(cfg, configurator, result, shape, page_size)
    return result


def _tiered_pool_size(cfg, configurator, result, shape: _CellShape, page_size: int):
    """The tiered home's token budget: SGLang's, less the HBM of the host blocks' rows."""
    per_token, dtype, layers = shape.kv_bytes_per_token, shape.kv_dtype, shape.layers
    ranks = kv_ranks()
    rows = host_row_bytes(cfg, per_token, dtype, layers, ranks)
    pages = result.max_total_num_tokens // page_size + 1
    rows += pages * unit_cache_bytes_per_page(per_token, dtype, layers, cfg.unit_cache_ways)
    cut = -(-rows // configurator._cell_size)
    tokens = (result.max_total_num_tokens - cut) // page_size * page_size
    if tokens < 4 * page_size:
        raise ValueError(
            f"{flag_name('host_pool_gb')} {cfg.host_pool_gb:g}: the block metadata of that "
            f"many host blocks ({rows / 2**30:.2f} GiB of HBM) leaves no room for the KV "
            "pool; lower it or raise --mem-fraction-static"
        )
    logger.info(
        "sglang-psa: tiered KV: %d tokens in HBM; %.2f GiB of HBM hold the metadata of "
        "%d host blocks (%s %g, split over %d ranks)",
        tokens, rows / 2**30, host_blocks(cfg, per_token, ranks), flag_name("host_pool_gb"),
        cfg.host_pool_gb, ranks,
    )  # fmt: skip
    return dataclasses.replace(result, max_total_num_tokens=tokens)
