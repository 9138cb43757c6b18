"""HBM slot cache: which (request, layer, KV head, block) units have a GPU slot, LRU.

The GPU holds one tensor of equal slots shared by all layers; this object is
its bookkeeping. A slot pinned by the running step is never evicted; when no
unpinned slot is left, `insert` raises instead of evicting live data. Hits,
misses and evictions are counted for the benchmarks and for the scheduler's
working-set estimate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass


@dataclass
class SlotStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class SlotCache:
    """`num_slots` slots; keys are any hashable unit id, e.g. (req, layer, head, block)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        self.lru: OrderedDict[Hashable, int] = OrderedDict()  # key -> slot, oldest first
        self.free = list(range(num_slots - 1, -1, -1))
        self.pins: dict[Hashable, int] = {}
        self.stats = SlotStats()

    def lookup(self, key: Hashable) -> int | None:
        """Slot of `key` (counted as hit or miss) and mark it recently used."""
        slot = self.lru.get(key)
        if slot is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        self.lru.move_to_end(key)
        return slot

    def insert(self, key: Hashable) -> tuple[int, Hashable | None]:
        """A slot for `key` (which must be absent); returns (slot, evicted key or None)."""
        if key in self.lru:
            raise KeyError(f"{key!r} already has slot {self.lru[key]}")
        evicted = None
        if self.free:
            slot = self.free.pop()
        else:
            victim = next((k for k in self.lru if k not in self.pins), None)
            if victim is None:
                raise RuntimeError(f"all {self.num_slots} slots are pinned by the running step")
            slot = self.lru.pop(victim)
            evicted = victim
            self.stats.evictions += 1
        self.lru[key] = slot
        return slot, evicted

    def pin(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            if k not in self.lru:
                raise KeyError(f"cannot pin {k!r}: no slot")
            self.pins[k] = self.pins.get(k, 0) + 1

    def unpin(self, keys: Iterable[Hashable]) -> None:
        for k in keys:
            n = self.pins[k] - 1
            if n:
                self.pins[k] = n
            else:
                del self.pins[k]

    def drop(self, keys: Iterable[Hashable]) -> None:
        """Release the slots of finished units (e.g. a freed request); pinned ones raise."""
        for k in keys:
            if k in self.pins:
                raise RuntimeError(f"{k!r} is pinned and cannot be dropped")
            slot = self.lru.pop(k, None)
            if slot is not None:
                self.free.append(slot)

    @property
    def used(self) -> int:
        return len(self.lru)

    def check_integrity(self) -> None:
        slots = list(self.lru.values())
        assert len(set(slots)) == len(slots), "two keys share a slot"
        assert not set(slots) & set(self.free), "a used slot is also free"
        assert len(slots) + len(self.free) == self.num_slots, "slots leaked"
        assert all(k in self.lru for k in self.pins), "a pinned key has no slot"
        assert all(n > 0 for n in self.pins.values())
