"""HBM slot cache: LRU order, pinned slots never evicted, counters, random op sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sglang_psa.store import SlotCache


def test_lru_evicts_least_recently_used_unpinned():
    c = SlotCache(3)
    for k in "abc":
        c.insert(k)
    assert c.lookup("a") is not None  # a is now most recent
    c.pin(["b"])
    slot, evicted = c.insert("d")
    assert evicted == "c" and c.lookup("c") is None
    assert c.stats.hits == 1 and c.stats.misses == 1 and c.stats.evictions == 1
    c.check_integrity()


def test_all_pinned_raises_instead_of_evicting():
    c = SlotCache(2)
    c.insert("a")
    c.insert("b")
    c.pin(["a", "b"])
    with pytest.raises(RuntimeError, match="pinned"):
        c.insert("c")
    c.unpin(["a"])
    assert c.insert("c")[1] == "a"
    with pytest.raises(RuntimeError):
        c.drop(["b"])
    c.check_integrity()


class SlotMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.c = SlotCache(5)
        self.pinned: list[int] = []

    @rule(k=st.integers(0, 12))
    def touch(self, k):
        if self.c.lookup(k) is None:
            try:
                _, ev = self.c.insert(k)
            except RuntimeError:
                assert all(key in self.c.pins for key in self.c.lru)
                return
            assert ev is None or ev not in self.c.pins

    @rule(k=st.integers(0, 12))
    def pin(self, k):
        if k in self.c.lru and len(set(self.pinned)) < 4:
            self.c.pin([k])
            self.pinned.append(k)

    @rule()
    def unpin_all(self):
        self.c.unpin(self.pinned)
        self.pinned.clear()

    @rule(k=st.integers(0, 12))
    def drop(self, k):
        if k not in self.c.pins:
            self.c.drop([k])

    @invariant()
    def consistent(self):
        self.c.check_integrity()
        assert all(k in self.c.lru for k in self.pinned)  # pinned keys were never evicted


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
