"""Sizing SGLang's KV pool under --sparse-mode: block metadata is counted in the HBM
budget; at the tiered home the host blocks' metadata rows come out of it too."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from sglang_psa.config import PSAConfig
from sglang_psa.plugin import flags, kv_pool

PER_TOKEN = 2 * 24 * 2 * 64 * 2  # K+V x layers x kv heads x d x bf16 = 12288 bytes
KVC = SimpleNamespace(kv_cache_dtype=torch.bfloat16, use_mla_backend=False)


@dataclass
class PoolConfig:  # the fields of SGLang's MemoryPoolConfig the hook reads
    max_total_num_tokens: int


class Configurator:  # SGLang's pool configurators are plain classes (hashable, weakref-able)
    pass


@pytest.fixture(autouse=True)
def _no_config(monkeypatch):
    monkeypatch.delenv(flags.ENV_VAR, raising=False)
    yield
    flags.export(None)


def test_hbm_budget_counts_block_metadata():
    conf = Configurator()
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24) == PER_TOKEN
    # Metadata is kept in the KV dtype (bf16 here): one key vector per block is
    # 24 layers x 2 heads x 64 x 2 B per 32 tokens = 192 B per token.
    flags.export(PSAConfig(score="mean"))  # the mean key only
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24) == PER_TOKEN + 192
    # The certified rule: mean, min, max, and its key codes: 5 bits a channel and token
    # (24 x 2 x 64 x 5 / 8 = 1920 B) and a float32 range per channel and block
    # (24 x 2 x 64 x 8 B per 32 tokens = 768 B).
    flags.export(PSAConfig(score="mean", stop_rule="certified", bound_bits=16))
    want = PER_TOKEN + 3 * 192 + 1920 + 768
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24) == want
    flags.export(PSAConfig(bound_bits=16))  # the bound ranks: min and max, no mean
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24) == PER_TOKEN + 2 * 192
    # The default keeps them as 8-bit codes: a byte a channel, a float32 scale per
    # (layer, head) and block: (2 x 3072 + 4 x 96) B per 32 tokens.
    flags.export(PSAConfig())
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24) == PER_TOKEN + 204
    flags.export(PSAConfig(bound_bits=16))
    fp8 = SimpleNamespace(kv_cache_dtype=torch.float8_e4m3fn, use_mla_backend=False)
    # An fp8 cache (half the KV bytes) keeps bf16 metadata: the same 2 x 192 B per token.
    assert kv_pool.after_compute_cell_size(PER_TOKEN // 2, conf, fp8, 24) == PER_TOKEN // 2 + 384
    # The pool in HBM: the token budget is SGLang's own.
    assert (
        kv_pool.after_calculate_pool_sizes(PoolConfig(1000), conf, 0, 32).max_total_num_tokens
        == 1000
    )
    mla = SimpleNamespace(kv_cache_dtype=torch.bfloat16, use_mla_backend=True)
    assert kv_pool.after_compute_cell_size(PER_TOKEN, conf, mla, 24) == PER_TOKEN


def test_tiered_home_takes_the_host_blocks_metadata_from_the_pool_and_names_the_flag():
    conf = Configurator()
    flags.export(PSAConfig(kv_home="tiered", host_pool_gb=1.0, bound_bits=16))
    conf._cell_size = kv_pool.after_compute_cell_size(PER_TOKEN, conf, KVC, 24)
    assert conf._cell_size == PER_TOKEN + 2 * 192  # the pool's own tokens carry metadata
    blocks = 2**30 // (PER_TOKEN * 32)  # 2730 host blocks of 32 tokens
    got = kv_pool.after_calculate_pool_sizes(PoolConfig(10**6), conf, 0, 32)
    cut = 10**6 - got.max_total_num_tokens
    # At least each host block's metadata (2 x 192 B per token), one int32 stamp and one
    # int32 unit-cache slot per (layer, KV head) and its evicted flag, and per page of the
    # pool the unit cache's position table (an int32 per (layer, KV head) and its page)
    # and its refresh's scratch (two int32 per KV head and position of a set of 8 pages,
    # 8 x 24 positions padded to 256); at most a page and the heads' upper bound
    # (d >= 32) more.
    pages = 10**6 // 32 + 1
    scratch = 2 * 4 * 256 // 8  # bytes a page, per KV head
    least = blocks * (32 * 2 * 192 + 8 * 24 * 2 + 1) + pages * (4 * 24 * 2 + 4 + 2 * scratch)
    most = blocks * (32 * 2 * 192 + 8 * 24 * 4 + 1) + pages * (4 * 24 * 4 + 4 + 4 * scratch)
    most += 32 * conf._cell_size
    assert least <= cut * conf._cell_size <= most + conf._cell_size
    assert got.max_total_num_tokens % 32 == 0
    flags.export(PSAConfig(kv_home="tiered", host_pool_gb=64.0, bound_bits=16))
    with pytest.raises(ValueError, match="--psa-host-pool-gb"):
        kv_pool.after_calculate_pool_sizes(PoolConfig(10**5), conf, 0, 32)
