"""The tiered home's table fence (`mem_cache.fence`): a decode launch arms it, the first
rewrite of a table the step reads makes the writing stream wait for that step, later
ones pass; the unit cache announces every rewrite before it writes."""

import pytest
import torch

from sglang_psa.mem_cache import fence as fence_mod
from sglang_psa.mem_cache.fence import TableFence
from sglang_psa.mem_cache.unit_cache import UnitCache


class _Stream:
    def __init__(self, name):
        self.name, self.device, self.waited = name, torch.device("cpu"), []

    def wait_stream(self, other):
        self.waited.append(other.name)


def test_the_first_rewrite_after_a_launch_waits_for_it_and_later_ones_pass(monkeypatch):
    current = _Stream("scheduler")
    monkeypatch.setattr(fence_mod.torch.cuda, "current_stream", lambda device=None: current)
    f = TableFence()
    f()  # nothing launched: nothing to wait for
    assert current.waited == [] and (f.calls, f.waits) == (1, 0)
    f.arm(_Stream("forward"))
    f()
    f()
    assert current.waited == ["forward"] and (f.calls, f.waits) == (3, 1)
    f.arm(_Stream("forward-2"))  # the next step
    f()
    assert current.waited == ["forward", "forward-2"] and f.waits == 2
    f.arm(None)  # a step on the CPU: nothing to order
    f()
    assert f.waits == 2


def _cache(fence):
    L, H, HB, pages, bs = 2, 2, 16, 12, 4
    return UnitCache(L, H, HB, pages, bs, "cpu", ways=4, fence=fence)


@pytest.mark.parametrize(
    "mutate",
    ["grow", "shrink", "mark_evicted", "forget"],
)
def test_the_unit_cache_announces_each_rewrite_before_it_writes(mutate):
    """Each mutator calls the fence while every table is still as it was (so the wait is
    ordered before the first write), and a call that changes nothing does not call it."""
    seen, before = [], []

    def tables():
        return [
            t.clone() for t in (cache.cache_pages, cache.unit_slot, cache.slot_unit, cache.live)
        ]

    def fence():
        if before:  # (setting the cache up calls it too)
            seen.append(all(torch.equal(a, b) for a, b in zip(tables(), before)))

    cache = _cache(fence)
    cache.grow(torch.tensor([5, 7, 9]))
    cache.mark_evicted(torch.tensor([1, 2]))
    cache.unit_slot[0, 1] = 3  # a cached unit, so that forget has one to drop
    cache.slot_unit[0, 3] = 1
    before[:] = tables()
    if mutate == "grow":
        cache.grow(torch.tensor([11]))
        cache.grow(torch.tensor([], dtype=torch.int64))
    elif mutate == "shrink":
        cache.shrink(0)
        assert seen == []
        cache.shrink(2)
    elif mutate == "mark_evicted":
        cache.mark_evicted(torch.tensor([4]))
    else:
        cache.forget(torch.tensor([], dtype=torch.int64))
        assert seen == []
        cache.forget(torch.tensor([1]))
    assert not all(torch.equal(a, b) for a, b in zip(tables(), before))  # it did write
    assert seen and seen[0], "the fence came after a write"


def test_a_refresh_with_no_page_taken_writes_nothing_and_waits_for_nothing():
    calls = []
    cache = _cache(lambda: calls.append(1))
    cache.refresh(None, 0, None, None, None)  # no page: returns before reading anything
    assert calls == []
