"""The GPU-resident slot table against the host LRU model (`SlotCache`) and its invariants.

Runs on CPU tensors in CI and on CUDA tensors on the GPU machine: the table is
plain torch ops, so the same code is the device path.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.store.slot_cache import SlotCache
from sglang_psa.store.slot_table import DeviceSlotTable, SlotsExhausted

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _resident(t: DeviceSlotTable) -> set[int]:
    return set((t.slot_of[: t.num_units] >= 0).nonzero().flatten().tolist())


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(
    seq=st.lists(st.tuples(st.integers(0, 23), st.booleans()), min_size=1, max_size=80),
    num_slots=st.integers(1, 8),
)
def test_single_unit_accesses_follow_exact_lru(device, seq, num_slots):
    """One unit per call: residency, hits and evictions equal the host LRU model's."""
    table = DeviceSlotTable(24, num_slots, device, policy="lru")
    model = SlotCache(num_slots)
    hits = 0
    for unit, pin_and_release in seq:
        got = table.acquire(torch.tensor([unit], device=device), pin=pin_and_release)
        if model.lookup(unit) is None:
            model.insert(unit)
            assert int(got.n_miss) == 1 and int(got.miss_units[0]) == unit
        else:
            hits += 1
            assert int(got.n_miss) == 0
        assert int(table.slot_of[unit]) == int(got.slots[0])
        if pin_and_release:
            table.unpin(got.slots)
        assert _resident(table) == set(model.lru)
        table.check_integrity()
    stats = table.stats
    assert stats["hits"] == hits == model.stats.hits
    assert stats["evictions"] == model.stats.evictions
    table.check()


@pytest.mark.parametrize("policy", ["lru", "frequency"])
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None)
@given(data=st.data(), num_slots=st.integers(4, 16))
def test_batched_acquire_keeps_invariants_and_never_evicts_pins(device, policy, data, num_slots):
    U = 40
    table = DeviceSlotTable(U, num_slots, device, policy=policy)
    pinned: dict[int, int] = {}  # unit -> slot
    for _ in range(data.draw(st.integers(1, 12))):
        free_for_use = num_slots - len(pinned)
        k = data.draw(st.integers(0, max(0, free_for_use)))
        units = data.draw(st.lists(st.integers(0, U - 1), min_size=k, max_size=k, unique=True))
        units = [u for u in units if u not in pinned]
        before = table.slot_of[:U].clone()
        got = table.acquire(torch.tensor(units, dtype=torch.int64, device=device))
        table.check()
        n_miss = int(got.n_miss)
        want_miss = [u for u in units if int(before[u]) < 0]
        assert n_miss == len(want_miss)
        assert sorted(got.miss_units[:n_miss].tolist()) == sorted(want_miss)
        # Every requested unit is resident at the returned slot, and so is every pin.
        for u, s in zip(units, got.slots.tolist()):
            assert int(table.slot_of[u]) == s
        for u, s in pinned.items():
            assert int(table.slot_of[u]) == s, "a pinned unit was evicted"
        assert len(set(got.slots.tolist())) == len(units)
        # Missed units went to the slots listed for them (what the loader copies into).
        for u, s in zip(got.miss_units[:n_miss].tolist(), got.miss_slots[:n_miss].tolist()):
            assert int(table.unit_of[s]) == u
        table.check_integrity()
        if units and data.draw(st.booleans()):
            u = units[0]
            s = int(table.slot_of[u])
            table.pin(torch.tensor([s], device=device))
            pinned[u] = s
        if pinned and data.draw(st.booleans()):
            u, s = pinned.popitem()
            table.unpin(torch.tensor([s], device=device))
    table.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_lru_victims_are_the_oldest_and_overflow_is_reported(device):
    t = DeviceSlotTable(10, 3, device, policy="lru")
    for u in (0, 1, 2):
        t.acquire(torch.tensor([u], device=device))
    t.acquire(torch.tensor([0], device=device))  # 1 is now the oldest, then 2
    got = t.acquire(torch.tensor([5, 6], device=device))
    assert _resident(t) == {0, 5, 6}
    assert int(got.n_miss) == 2 and t.stats["evictions"] == 2
    # All three slots in use by one call: a fourth distinct unit cannot fit.
    with pytest.raises(SlotsExhausted, match="4 units"):
        t.acquire(torch.tensor([0, 5, 6, 7], device=device))
    # Pinned slots plus this call's hits leave no victim: reported, not silently evicted.
    t.pin(t.lookup(torch.tensor([0, 5], device=device)))
    t.acquire(torch.tensor([6, 7], device=device))
    with pytest.raises(SlotsExhausted, match="pinned"):
        t.check()
    t.check()  # the flag is cleared once reported


@pytest.mark.parametrize("device", DEVICES)
def test_drop_units_frees_slots(device):
    t = DeviceSlotTable(10, 4, device)
    t.acquire(torch.tensor([1, 2, 3], device=device))
    t.drop_units(torch.tensor([2, 9], device=device))
    assert _resident(t) == {1, 3} and t.stats["used"] == 2
    got = t.acquire(torch.tensor([4, 5], device=device))
    assert int(got.n_miss) == 2 and t.stats["evictions"] == 0  # two free slots, no eviction
    t.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_frequency_policy_keeps_hot_units_and_bypasses_one_off_reads(device):
    """Hot units read every step stay resident; cold units read once are declined (left on
    the host) once the cache is full of hotter ones, where LRU would let them evict."""
    t = DeviceSlotTable(100, 4, device, policy="frequency", decay=0.8)
    hot = torch.tensor([0, 1, 2, 3], device=device)
    t.acquire(hot)
    t.next_step()
    for step in range(10):
        got = t.acquire(hot, bypass=True)
        assert int(got.n_miss) == 0 and bool((got.slots >= 0).all())
        cold = torch.tensor([10 + 2 * step, 11 + 2 * step], device=device)
        got = t.acquire(cold, bypass=True)
        assert got.slots.tolist() == [-1, -1] and int(got.n_miss) == 0  # read from the host
        t.next_step()
    st = t.stats
    assert st["bypasses"] == 20 and st["evictions"] == 0 and st["used"] == 4
    # Without bypass every unit gets a slot: the coldest resident ones are evicted.
    got = t.acquire(torch.tensor([50, 51], device=device))
    assert bool((got.slots >= 0).all()) and t.stats["evictions"] == 2
    t.check_integrity()


@pytest.mark.parametrize("device", DEVICES)
def test_frequency_scores_decay_so_a_new_hot_set_takes_over(device):
    t = DeviceSlotTable(100, 2, device, policy="frequency", decay=0.9)
    old, new = torch.tensor([0, 1], device=device), torch.tensor([7, 8], device=device)
    for _ in range(3):
        t.acquire(old, bypass=True)
        t.next_step()
    admitted = []
    for _ in range(6):  # the old set is no longer read; the new one every step
        admitted.append(int(t.acquire(new, bypass=True).n_miss))
        t.next_step()
    assert admitted == [0, 0, 0, 2, 0, 0]  # declined until hotter than the decaying old set
    assert sorted(t.slot_of[:100].ne(-1).nonzero().flatten().tolist()) == [7, 8]
    t.drop_units(new)
    assert float(t.score[7]) == 0.0 and t.stats["used"] == 0
    t.check_integrity()
