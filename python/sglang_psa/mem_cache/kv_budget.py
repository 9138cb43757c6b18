"""HBM and host bytes of the KV under `--sparse-mode`: the per-page block metadata, and
the tiered home's host blocks with their HBM rows (what `plugin.kv_pool` subtracts from
SGLang's pool budget and the backend allocates)."""

from __future__ import annotations

import math

import torch


def metadata_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """Block metadata is kept in the KV dtype (a min or max of bf16 keys is exact in bf16);
    8-bit caches get bf16, which holds every fp8 value exactly."""
    return kv_dtype if torch.empty((), dtype=kv_dtype).element_size() >= 2 else torch.bfloat16


def metadata_bytes_per_token(kv_bytes_per_token: int, kv_dtype: torch.dtype, cfg) -> int:
    """HBM bytes of block metadata per token: per (layer, KV head) per block of
    `block_size` tokens, the key vectors the ranking and the stop rule read (the mean
    for the mean score, min and max for key bounds), in `metadata_dtype`; 8-bit bounds
    (`cfg.bound_bits`) take a byte a channel and a float32 scale per (layer, KV head);
    the certified rule's key codes `cfg.code_bits` bits a channel and token, and a float32
    range per channel."""
    kv_elem = torch.empty((), dtype=kv_dtype).element_size()
    meta_elem = torch.empty((), dtype=metadata_dtype(kv_dtype)).element_size()
    # kv_bytes_per_token = 2 (K, V) x layers x heads x d x kv_elem
    per_vector_token = kv_bytes_per_token // (2 * kv_elem)  # layers x heads x d
    per_block = per_vector_token * (meta_elem if cfg.needs_key_mean else 0)
    if cfg.needs_key_bounds and cfg.bound_bits == 8:
        per_block += 2 * per_vector_token + 4 * max(1, per_vector_token // 32)  # d >= 32
    elif cfg.needs_key_bounds:
        per_block += 2 * per_vector_token * meta_elem
    if cfg.needs_key_codes:  # the certified rule's key codes: planes, and float32 ranges
        per_block += per_vector_token * (cfg.block_size * cfg.code_bits // 8 + 2 * 4)
    return math.ceil(per_block / cfg.block_size)


def host_blocks(cfg, kv_bytes_per_token: int, ranks: int) -> int:
    """Blocks (all layers, this rank's KV heads: `kv_bytes_per_token` is the rank's) that
    one rank's share of the tiered home's host tier holds: `--psa-host-pool-gb` is the
    server's, split evenly over the `ranks` that shard the KV heads."""
    return int(cfg.host_pool_gb * 2**30 / ranks) // (kv_bytes_per_token * cfg.block_size)


def _layer_heads(kv_bytes_per_token: int, kv_dtype: torch.dtype, layers: int) -> int:
    """(layer, KV head) pairs, bounded from above by taking head_dim >= 32."""
    heads_d = kv_bytes_per_token // (2 * torch.empty((), dtype=kv_dtype).element_size() * layers)
    return layers * max(1, heads_d // 32)


def host_row_bytes(
    cfg, kv_bytes_per_token: int, kv_dtype: torch.dtype, layers: int, ranks: int
) -> int:
    """HBM bytes of the tiered home's rows for host blocks: the block metadata, one int32
    last-read stamp and one int32 unit-cache slot per (layer, KV head) of each, and its
    evicted flag (`mem_cache.unit_cache`)."""
    meta = metadata_bytes_per_token(kv_bytes_per_token, kv_dtype, cfg) * cfg.block_size
    stamps_and_slots = 8 * _layer_heads(kv_bytes_per_token, kv_dtype, layers)
    return host_blocks(cfg, kv_bytes_per_token, ranks) * (meta + stamps_and_slots + 1)


def unit_cache_bytes_per_page(
    kv_bytes_per_token: int, kv_dtype: torch.dtype, layers: int, ways: int
) -> int:
    """HBM bytes of the unit cache's tables per page of SGLang's pool (the most pages it
    can take): the unit in each (layer, KV head)'s position, the page, and the refresh's
    scratch (two int32 lists of a set's positions, padded to a power of two, per KV head
    and set of `ways` pages; `sgl_kernel_ext.unit_cache.scratch_size`)."""
    from sgl_kernel_ext.unit_cache import scratch_size

    pairs = _layer_heads(kv_bytes_per_token, kv_dtype, layers)
    scratch = math.ceil(4 * scratch_size(pairs // layers, ways, ways, layers) / ways)  # a set's
    return 4 * pairs + 4 + scratch
