"""Tiered KV store: host block pool with prefix sharing, HBM slot cache (issue 5, in progress)."""

from sglang_psa.store.block_pool import BlockPool, PoolExhausted
from sglang_psa.store.slot_cache import SlotCache, SlotStats

__all__ = ["BlockPool", "PoolExhausted", "SlotCache", "SlotStats"]
