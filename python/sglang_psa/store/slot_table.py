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
- `score[unit]`: decayed access count (the `frequency` policy's victim order);
- `pins[slot]`: pins of the running step; a pinned slot is never a victim.

`acquire(units)` stamps hits, takes as victims the lowest-ranked unpinned
slots under the policy (free ones first) for the misses, and returns the slots plus
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
    """`policy` orders the victims: `lru` (least recently used) or `frequency` (lowest
    access score; scores grow by one per access and shrink by `decay` per `next_step()`).
    Block reads in sparse attention repeat across steps but not in recency order (one
    step reads ~30% of a request's blocks; see benchmark/store/README.md), so LRU
    thrashes where a frequency score keeps the hot blocks."""

    def __init__(
        self,
        num_units: int,
        num_slots: int,
        device: torch.device | str,
        policy: str = "frequency",
        decay: float = 0.8,
    ):
        if num_slots < 1:
            raise ValueError("the slot cache needs at least one slot (raise --psa-gpu-cache-gb)")
        if policy not in ("lru", "frequency"):
            raise ValueError(f"policy must be lru|frequency, got {policy!r}")
        self.num_units, self.num_slots, self.policy, self.decay = (
            num_units,
            num_slots,
            policy,
            decay,
        )
        self.device = dev = torch.device(device)
        # One extra entry at the end of each table absorbs the writes of masked-off lanes.
        self.slot_of = torch.full((num_units + 1,), -1, dtype=torch.int64, device=dev)
        self.unit_of = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.last_use = torch.full((num_slots + 1,), -1, dtype=torch.int64, device=dev)
        self.score = torch.zeros(num_units + 1, dtype=torch.float32, device=dev)
        self.pins = torch.zeros(num_slots + 1, dtype=torch.int32, device=dev)
        # hits, misses, evictions, bypasses (misses left on the host)
        self.counters = torch.zeros(4, dtype=torch.int64, device=dev)
        self.overflow = torch.zeros((), dtype=torch.bool, device=dev)
        self.clock = 0
        # Scalar writes use index_fill_: `t[idx] = python_scalar` copies the scalar from
        # pageable host memory, which synchronizes the stream (seen in the profiler).

    def lookup(self, units: torch.Tensor) -> torch.Tensor:
        """Slots of `units` (-1 where absent), without touching the policy's state."""
        return self.slot_of[units]

    def next_step(self) -> None:
        """A decode step ended: age the frequency scores."""
        if self.policy == "frequency":
            self.score.mul_(self.decay)

    def _victim_keys(self, in_use: torch.Tensor) -> torch.Tensor:
        """Per slot, lower = evicted first: free slots, then by policy; pinned or used by
        the current call never (infinite)."""
        S = self.num_slots
        unit = self.unit_of[:S]
        if self.policy == "lru":
            key = self.last_use[:S].to(torch.float64)
        else:
            key = self.score[unit.clamp(min=0)].to(torch.float64)
        key = torch.where(unit < 0, -torch.inf, key)
        key = torch.where((self.pins[:S] > 0) | in_use[:S], torch.inf, key)
        return key

    def acquire(self, units: torch.Tensor, pin: bool = False, bypass: bool = False) -> Acquired:
        """Slots for distinct `units` (int64 on the device), admitting the misses.

        With `bypass`, the frequency policy admits a miss only if its score beats the
        victim's; a declined unit gets slot -1 and stays on the host, where the wave
        kernel reads it through UVA. Without it, every unit gets a slot (the loader's
        contract) unless the cache runs out (`overflow`, reported by `check()`).
        """
        n = units.numel()
        if n > self.num_slots:
            raise SlotsExhausted(
                f"{n} units requested at once but the slot cache has {self.num_slots} slots"
            )
        self.clock += 1
        clock, S, U = self.clock, self.num_slots, self.num_units
        units = units.to(torch.int64)
        if self.policy == "frequency":
            # Admission compares the history before this access: a block read for the first
            # time must not displace one that the rest of this step may still read.
            prior = self.score[units].clone()
            self.score.index_add_(0, units, torch.ones(n, device=self.device))
        slot = self.slot_of[units]
        hit = slot >= 0
        miss = ~hit
        in_use = torch.zeros(S + 1, dtype=torch.bool, device=self.device)
        in_use.index_fill_(0, torch.where(hit, slot, S), True)
        key = self._victim_keys(in_use)
        if n * 16 < S:  # few units against many slots: a partial selection is cheaper
            vals, cand = torch.topk(key, n, largest=False, sorted=True)
        else:
            vals, cand = torch.sort(key)
            vals, cand = vals[:n], cand[:n]
        if bypass and self.policy == "frequency":
            # The hottest misses meet the coldest victims first.
            heat = torch.where(miss, prior, -torch.inf)
            rank = torch.empty_like(units)
            rank[torch.argsort(heat, descending=True, stable=True)] = torch.arange(
                n, device=self.device
            )
        else:
            rank = (torch.cumsum(miss, 0) - 1).clamp_(min=0)
        victim, vkey = cand[rank], vals[rank]
        usable = miss & (vkey < torch.inf)
        if bypass and self.policy == "frequency":
            admit = usable & ((prior.to(torch.float64) > vkey) | (vkey == -torch.inf))
        else:
            admit = usable
            self.overflow |= (miss & ~usable).any()
        old = self.unit_of[victim]
        evict = admit & (old >= 0)
        self.slot_of.index_fill_(0, torch.where(evict, old, U), -1)
        self.slot_of[torch.where(admit, units, U)] = victim
        self.unit_of[torch.where(admit, victim, S)] = units
        slots = torch.where(admit, victim, torch.where(hit, slot, -1))
        held = torch.where(slots >= 0, slots, S)
        self.last_use.index_fill_(0, held, clock)
        if pin:
            self.pins.index_add_(0, held, torch.ones_like(held, dtype=torch.int32))
        self.slot_of[U:].fill_(-1)
        self.unit_of[S:].fill_(-1)
        self.pins[S:].fill_(0)
        n_miss, n_admit = miss.sum(), admit.sum()
        self.counters += torch.stack([n - n_miss, n_miss, evict.sum(), n_miss - n_admit])
        # Compact the admitted misses to the front: their lanes go to consecutive positions.
        pos = torch.where(admit, torch.cumsum(admit, 0) - 1, n)
        miss_units = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        miss_slots = torch.zeros(n + 1, dtype=torch.int64, device=self.device)
        miss_units[pos] = units
        miss_slots[pos] = victim
        return Acquired(slots, miss_units[:n], miss_slots[:n], n_admit.to(torch.int32).reshape(1))

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
        self.score.index_fill_(0, units, 0.0)  # a freed block's id may come back as new data
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
        hits, misses, evictions, bypasses = (int(x) for x in self.counters.tolist())
        used = int((self.unit_of[: self.num_slots] >= 0).sum())
        return {
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "bypasses": bypasses,
            "used": used,
        }

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
