"""Where SGLang's KV pool lives and how large it is, under `--sparse-mode`.

- `--psa-kv-home hbm`: the pool stays in GPU memory; its byte budget per token
  grows by the per-page block metadata (mean keys, plus min/max for key bounds).
- `--psa-kv-home tiered`: the pool stays in GPU memory as for `hbm`; the block
  metadata and last-read stamps of every host-tier block (a block whose page was
  given back is still scored) come out of the same HBM budget, so the pool has
  fewer tokens (`host_row_bytes`).
- `--psa-kv-home host`: the pool's K/V buffers are page-locked host memory of
  `--psa-host-pool-gb`, seen by the GPU through unified addressing
  (`store/uva.py`). SGLang's kernels write new KV there and its prefill reads
  prefixes from there; decode reads the blocks PSA selects across PCIe. HBM then
  holds only the block metadata, so the token budget is the host pool's, not
  GPU memory's.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from sglang_psa.config import flag_name

logger = logging.getLogger(__name__)

# HBM bytes set aside for the page cache when the pool is on the host (decided while
# SGLang sizes its pool, read by the backend in the same process).
_slot_cache_bytes: int | None = None


def slot_cache_bytes() -> int | None:
    return _slot_cache_bytes


def _config():
    from sglang_psa.integration.flags import imported

    return imported()


def _host_home(cfg) -> bool:
    return cfg is not None and cfg.kv_home == "host"


def metadata_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """Block metadata is kept in the KV dtype (a min or max of bf16 keys is exact in bf16);
    8-bit caches get bf16, which holds every fp8 value exactly."""
    return kv_dtype if torch.empty((), dtype=kv_dtype).element_size() >= 2 else torch.bfloat16


def metadata_bytes_per_token(kv_bytes_per_token: int, kv_dtype: torch.dtype, cfg) -> int:
    """HBM bytes of block metadata per token: per (layer, KV head) per block of
    `block_size` tokens, the key vectors the ranking and the stop rule read (the mean
    for the mean score, min and max for key bounds), in `metadata_dtype`."""
    n_meta = (2 if cfg.needs_key_bounds else 0) + (1 if cfg.needs_key_mean else 0)
    kv_elem = torch.empty((), dtype=kv_dtype).element_size()
    meta_elem = torch.empty((), dtype=metadata_dtype(kv_dtype)).element_size()
    # kv_bytes_per_token = 2 (K, V) x layers x heads x d x kv_elem
    per_vector_token = kv_bytes_per_token // (2 * kv_elem)  # layers x heads x d
    return math.ceil(per_vector_token * n_meta * meta_elem / cfg.block_size)


def host_blocks(cfg, kv_bytes_per_token: int) -> int:
    """Blocks (all layers and heads) the tiered home's host tier of `--psa-host-pool-gb`
    holds."""
    return int(cfg.host_pool_gb * 2**30) // (kv_bytes_per_token * cfg.block_size)


def host_row_bytes(cfg, kv_bytes_per_token: int, kv_dtype: torch.dtype, layers: int) -> int:
    """HBM bytes of the tiered home's rows for host blocks: the block metadata and one
    int32 last-read stamp per (layer, KV head) of each (heads bounded from above by
    taking head_dim >= 32)."""
    meta = metadata_bytes_per_token(kv_bytes_per_token, kv_dtype, cfg) * cfg.block_size
    heads_d = kv_bytes_per_token // (2 * torch.empty((), dtype=kv_dtype).element_size() * layers)
    stamps = 4 * layers * max(1, heads_d // 32)
    return host_blocks(cfg, kv_bytes_per_token) * (meta + stamps)


def after_compute_cell_size(result, configurator, kvc, num_layers):
    """SGLang sizes its KV pool by HBM bytes per token: with the pool in HBM that is the KV
    plus the block metadata; with the pool on the host only the metadata."""
    cfg = _config()
    if cfg is None or getattr(kvc, "use_mla_backend", False):
        return result
    meta = metadata_bytes_per_token(result, kvc.kv_cache_dtype, cfg)
    configurator._psa_kv_bytes_per_token = result
    configurator._psa_kv_dtype = kvc.kv_cache_dtype
    configurator._psa_layers = num_layers
    if _host_home(cfg):
        return meta
    return result + meta


def after_calculate_pool_sizes(result, configurator, available_bytes, page_size):
    """With the pool on the host, the token budget is what `--psa-host-pool-gb` holds, and
    the HBM SGLang budgeted for KV that the metadata leaves over becomes the page cache
    (or `--psa-gpu-cache-gb` of it)."""
    global _slot_cache_bytes
    cfg = _config()
    per_token = getattr(configurator, "_psa_kv_bytes_per_token", None)
    if cfg is not None and cfg.kv_home == "tiered" and per_token:
        return _tiered_pool_size(cfg, configurator, result, per_token, page_size)
    if not _host_home(cfg) or not per_token:
        return result
    host_tokens = host_blocks(cfg, per_token) * page_size  # one SGLang page = one block
    if host_tokens < page_size:
        raise ValueError(
            f"{flag_name('host_pool_gb')} {cfg.host_pool_gb:g} holds {host_tokens} tokens "
            f"of this model's KV ({per_token} bytes per token): raise it"
        )
    tokens = min(result.max_total_num_tokens, host_tokens)
    left = max(0, int(available_bytes) - tokens * configurator._cell_size)
    if cfg.gpu_cache_gb is not None:
        want = int(cfg.gpu_cache_gb * 2**30)
        if want > left:
            raise ValueError(
                f"{flag_name('gpu_cache_gb')} {cfg.gpu_cache_gb:g} exceeds the "
                f"{left / 2**30:.2f} GiB of GPU memory left for KV after block metadata "
                "(raise --mem-fraction-static or lower it)"
            )
        left = want
    _slot_cache_bytes = left
    logger.info(
        "sglang-psa: KV pool on the host: %d tokens (%.2f GiB pinned, %s %g), "
        "HBM page cache %.2f GiB%s",
        tokens,
        tokens * per_token / 2**30,
        flag_name("host_pool_gb"),
        cfg.host_pool_gb,
        left / 2**30,
        "" if tokens == host_tokens else "; capped by the HBM left for block metadata",
    )
    return dataclasses.replace(result, max_total_num_tokens=tokens)


def _tiered_pool_size(cfg, configurator, result, per_token: int, page_size: int):
    """The tiered home's token budget: SGLang's, less the HBM of the host blocks' rows."""
    rows = host_row_bytes(cfg, per_token, configurator._psa_kv_dtype, configurator._psa_layers)
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
        "%d host blocks (%s %g)",
        tokens, rows / 2**30, host_blocks(cfg, per_token), flag_name("host_pool_gb"),
        cfg.host_pool_gb,
    )  # fmt: skip
    return dataclasses.replace(result, max_total_num_tokens=tokens)


def around_create_buffers_normal(original, pool):
    """Allocate the K/V buffers in registered host memory instead of HBM."""
    cfg = _config()
    layout = getattr(pool, "kv_cache_layout", None)
    if not _host_home(cfg) or getattr(pool, "use_hnd", False) or layout == "vectorized_5d":
        return original(pool)
    from sglang_psa.mem_cache.uva import HostResident

    k_shape, v_shape = pool._kv_buffer_shapes()
    dtype, n = pool.store_dtype, pool.layer_num
    gib = n * (math.prod(k_shape) + math.prod(v_shape)) * dtype.itemsize / 2**30
    logger.info("sglang-psa: allocating and page-locking %.2f GiB of host memory for KV", gib)
    pool._psa_host = (
        HostResident((n, *k_shape), dtype, pool.device),
        HostResident((n, *v_shape), dtype, pool.device),
    )
    k_all, v_all = (h.view for h in pool._psa_host)
    pool.k_buffer = [k_all[i] for i in range(n)]
    pool.v_buffer = [v_all[i] for i in range(n)]
    logger.info(
        "sglang-psa: %d layers of K/V (%.2f GiB) in pinned host memory, read through UVA",
        n,
        sum(h.nbytes for h in pool._psa_host) / 2**30,
    )
    return None
