"""Host block pool: prefix sharing, exhaustion without side effects, random op sequences."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_psa.store import BlockPool, PoolExhausted


def test_shared_prefix_shares_full_blocks_only():
    pool = BlockPool(16, 4)
    a = pool.allocate(list(range(10)))  # 2 full blocks + tail of 2
    b = pool.allocate(list(range(8)) + [99, 98, 97])  # same 2 full blocks, own tail
    assert a.blocks[:2] == b.blocks[:2] and a.blocks[2] != b.blocks[2]
    assert pool.num_free == 16 - 4
    pool.check_integrity([a, b])
    pool.free_table(a)
    assert pool.num_free == 16 - 3  # a's tail only; shared blocks still held by b
    pool.free_table(b)
    assert pool.num_free == 16
    pool.check_integrity()


def test_exhaustion_is_an_error_for_the_asker_and_changes_nothing():
    pool = BlockPool(3, 4)
    a = pool.allocate(list(range(8)))
    before = (list(pool.free), list(pool.ref), dict(pool.by_hash))
    with pytest.raises(PoolExhausted, match="need 2 host blocks, 1 free"):
        pool.allocate(list(range(100, 108)))
    assert (list(pool.free), list(pool.ref), dict(pool.by_hash)) == before
    pool.allocate(list(range(8)))  # a shared prefix still fits
    pool.check_integrity()
    pool.free_table(a)


def test_sealed_tail_becomes_shareable():
    pool = BlockPool(8, 4)
    a = pool.allocate([1, 2, 3])
    with pytest.raises(ValueError):
        pool.seal(a, [1, 2, 3])
    pool.seal(a, [1, 2, 3, 4])
    b = pool.allocate([1, 2, 3, 4, 5])
    assert b.blocks[0] == a.blocks[0]
    pool.check_integrity([a, b])


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / append / seal / free sequences keep every invariant."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(24, 4)
        self.tables = []

    @rule(prefix=st.integers(0, 2), n=st.integers(1, 14), salt=st.integers(0, 3))
    def allocate(self, prefix, n, salt):
        tokens = [prefix * 100 + i for i in range(n // 2)] + [
            salt * 7 + i for i in range(n - n // 2)
        ]
        free_before = self.pool.num_free
        need = self.pool.blocks_needed(tokens)
        try:
            t = self.pool.allocate(tokens)
        except PoolExhausted:
            assert need > free_before and self.pool.num_free == free_before
            return
        assert self.pool.num_free == free_before - need
        self.tables.append(t)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        t = self.tables.pop(i % len(self.tables))
        self.pool.free_table(t)

    @precondition(lambda self: self.tables)
    @rule(i=st.integers(0, 100), tok=st.integers(0, 5))
    def seal_or_append(self, i, tok):
        t = self.tables[i % len(self.tables)]
        if len(t.hashes) == len(t.blocks) - 1:
            self.pool.seal(t, [tok] * 4)
        elif self.pool.num_free:
            self.pool.append_block(t)

    @invariant()
    def consistent(self):
        self.pool.check_integrity(self.tables)

    def teardown(self):
        for t in self.tables:
            self.pool.free_table(t)
        assert self.pool.num_free == self.pool.num_blocks  # nothing leaks
        self.pool.check_integrity()


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
