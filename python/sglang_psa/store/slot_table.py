"""The slot table on the GPU: which KV units have an HBM slot, with LRU eviction, no host sync.

A *unit* is one block of one (layer, KV head): global id
`(layer * kv_heads + head) * num_blocks + block`, the row of the host pool
viewed as `[layers * kv_heads * num_blocks, block_size * head_dim]`. Block ids
come from `BlockPool`, so requests sharing a prefix share units and slots.

`SlotCache` is the host-side model of the same policy; this table keeps the
state in device tensors so a decode step can look up, admit and evict
thousands of units per layer with a few fixed-size kernels and no `.item()`:

- `slot_of[unit]`: its slot or -1; `unit_of[slot]`: its unit or -1 (free);
- `last_use[slot]`: the `acquire` call that last touched it (-1: free);
- `pins[slot]`: pins of the running step; a pinned slot is never a victim.

`acquire(units)` stamps hits, takes as victims the least recently used
unpinned slots (free ones first) for the misses, and returns the slots plus
the compacted (unit, slot) list of misses and its length as a device scalar,
which `BlockCopier.run(count=...)` consumes. When no unpinned slot is left for
a miss, `overflow` is set on the device and `check()` raises; the caller
checks at a point where it syncs anyway. Units passed to one call must be
distinct (the wave planner produces distinct units).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class SlotsExhausted(RuntimeError):
    """More units were needed at once than unpinned slots exist."""


@dataclass
class Acquired:
    slots: torch.Tensor  # [n] int64: the slot of every requested unit
    miss_units: torch.Tensor  # [n] int64: the first `n_miss` entries are the units to load
    miss_slots: torch.Tensor  # [n] int64: ... and the slots to load them into
    n_miss: torch.Tensor  # [1] int32, on the device


class DeviceSlotTable:
    def __init__(self, num_units: int, num_slots: int, device: torch.device | str):
        if num_slots < 1:
            raise ValueError("the slot cache needs at least one slot (raise --psa-gpu-cache-gb)")
        self.num_units, self.num_slots = num_units, num_slots
        self.device = dev = torch.device(device)
        # One extra entry at the end of each table absorbs the writes of masked-off lanes.
        self.slot_of = torch.full((num_units + 1,), -1, dtype=torch.int64, device=dev)
        self.unit_of = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.pins = torch.zeros(num_slots + 1, dtype=torch.int32, device=dev)
        self.counters = torch.zeros(3, dtype=torch.int64, device=dev)  # hits, misses, evictions
        self.overflow = torch.zeros((), dtype=torch.bool, device=dev)
        self.clock = 0
        # Scalar writes use index_fill_: `t[idx] = python_scalar` copies the scalar from
        # pageable host memory, which synchronizes the stream (seen in the profiler).

    def lookup(self, units: torch.Tensor) -> torch.Tensor:
        """Slots of `units` (-1 where absent), without touching LRU state."""
        return self.slot_of[units]

    def acquire(self, units: torch.Tensor, pin: bool = False) -> Acquired:
        """Slots for distinct `units` (int64 on the device), admitting the misses."""
        n = units.numel()
        if n > self.num_slots:
            raise SlotsExhausted(
                f"{n} units requested at once but the slot cache has {self.num_slots} slots"
            )
        self.clock += 1
        clock, S, U = self.clock, self.num_slots, self.num_units
        units = units.to(torch.int64)
        slot = self.slot_of[units]
        hit = slot >= 0
        miss = ~hit
        self.last_use.index_fill_(0, torch.where(hit, slot, S), clock)
        # Victims: free slots (-1) first, then least recently used; pinned ones never.
        age = torch.where(self.pins[:S] > 0, torch.iinfo(torch.int64).max, self.last_use[:S])
        if n * 16 < S:  # few units against many slots: a partial selection is cheaper
            vals, cand = torch.topk(age, n, largest=False, sorted=True)
        else:
            vals, cand = torch.sort(age)
            vals, cand = vals[:n], cand[:n]
        rank = (torch.cumsum(miss, 0) - 1).clamp_(min=0)
        victim = cand[rank]
        self.overflow |= (miss & (vals[rank] >= clock)).any()
        old = self.unit_of[victim]
        evict = miss & (old >= 0)
        self.slot_of.index_fill_(0, torch.where(evict, old, U), -1)
        self.slot_of[torch.where(miss, units, U)] = victim
        self.unit_of[torch.where(miss, victim, S)] = units
        slots = torch.where(miss, victim, slot)
        self.last_use.index_fill_(0, slots, clock)
        if pin:
            self.pins.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self.slot_of[U:].fill_(-1)
        self.unit_of[S:].fill_(-1)
        n_miss = miss.sum()
        self.counters += torch.stack([n - n_miss, n_miss, evict.sum()])
        # Compact the misses to the front: lane i of a miss goes to position rank[i].
        pos = torch.where(miss, rank, n)
        miss_units = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        miss_slots = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        miss_units[pos] = units
        miss_slots[pos] = victim
        return Acquired(slots, miss_units[:n], miss_slots[:n], n_miss.to(torch.int32).reshape(1))

    def pin(self, slots: torch.Tensor) -> None:
        self.pins.index_add_(0, slots.to(torch.int64), torch.ones_like(slots, dtype=torch.int32))

    def unpin(self, slots: torch.Tensor) -> None:
        self.pins.index_add_(0, slots.to(torch.int64), -torch.ones_like(slots, dtype=torch.int32))

    def drop_units(self, units: torch.Tensor) -> None:
        """Free the slots of `units` (e.g. a freed request's blocks); absent units are ignored."""
        units = units.to(torch.int64)
        slot = self.slot_of[units]
        held = slot >= 0
        idx = torch.where(held, slot, self.num_slots)
        self.unit_of.index_fill_(0, idx, -1)
        self.last_use.index_fill_(0, idx, -1)
        self.slot_of.index_fill_(0, torch.where(held, units, self.num_units), -1)
        self.slot_of[self.num_units :].fill_(-1)
        self.unit_of[self.num_slots :].fill_(-1)

    def check(self) -> None:
        """Raise `SlotsExhausted` if an earlier `acquire` ran out of unpinned slots (syncs)."""
        if bool(self.overflow):
            self.overflow.zero_()
            raise SlotsExhausted(
                f"all {self.num_slots} slots were pinned or in use by the same step; "
                "a step needs more blocks resident at once than the slot cache holds"
            )

    @property
    def stats(self) -> dict[str, int]:
        hits, misses, evictions = (int(x) for x in self.counters.tolist())
        used = int((self.unit_of[: self.num_slots] >= 0).sum())
        return {"hits": hits, "misses": misses, "evictions": evictions, "used": used}

    def check_integrity(self) -> None:
        """slot_of and unit_of are inverse maps; pins are non-negative and on held slots."""
        slot_of = self.slot_of[: self.num_units].cpu()
        unit_of = self.unit_of[: self.num_slots].cpu()
        pins = self.pins[: self.num_slots].cpu()
        held = (slot_of >= 0).nonzero().flatten()
        assert torch.equal(unit_of[slot_of[held]], held), "slot_of and unit_of disagree"
        used = (unit_of >= 0).nonzero().flatten()
        assert torch.equal(slot_of[unit_of[used]], used), "a slot names a unit that is elsewhere"
        assert int((pins < 0).sum()) == 0, "a slot was unpinned more often than pinned"
        assert int((pins[unit_of < 0] > 0).sum()) == 0, "a free slot is pinned"
        assert int(self.slot_of[self.num_units]) == -1 and int(self.unit_of[self.num_slots]) == -1
