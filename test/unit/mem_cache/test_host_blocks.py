"""Host-tier block ids shared by requests and kept for a prefix cache (`HostBlocks`):
holders counted against a separate model after every operation, a held id never free or
handed out again, kept ids leaving least recently released first and a prefix's end before
its start, and requests adopting and releasing prefixes in any order returning each id
once."""

from __future__ import annotations

import random

import pytest

from sglang_psa.mem_cache.host_blocks import HostBlocks, HostTierFull
from sglang_psa.mem_cache.request_kv import RequestKV


def test_a_shared_block_is_freed_by_its_last_holder():
    hb = HostBlocks(8)
    a, b = RequestKV("a"), RequestKV("b")
    assert hb.reserve(a, 4) and hb.take(a, 3) == [0, 1, 2]
    assert hb.adopt(b, [0, 1]) and b.host == [0, 1]
    assert hb.refs[:3].tolist() == [2, 2, 1] and hb.used == 3
    hb.check_integrity([a, b])
    assert hb.free(a) == 3
    assert hb.refs[:3].tolist() == [1, 1, 0] and hb.used == 2  # b still holds 0 and 1
    assert 0 not in hb._free and 1 not in hb._free and 2 in hb._free
    assert hb.available == 6
    hb.check_integrity([b])
    hb.free(b)
    assert hb.used == 0 and hb.available == 8 and not hb.lru
    hb.check_integrity([])


def test_kept_blocks_wait_in_release_order_and_go_oldest_first():
    gone: list[int] = []
    hb = HostBlocks(8, on_evict=gone.extend)
    a, b = RequestKV("a"), RequestKV("b")
    assert hb.take(a, 3) == [0, 1, 2] and hb.take(b, 2) == [3, 4]
    hb.keep([0, 1, 2, 3, 4])
    hb.free(a)
    assert list(hb.lru) == [2, 1, 0]  # the prefix's last block first: it leaves first
    hb.free(b)
    assert list(hb.lru) == [2, 1, 0, 4, 3] and hb.used == 0 and hb.available == 8
    c = RequestKV("c")
    assert hb.adopt(c, [0, 1])  # a later request revives a kept prefix
    assert list(hb.lru) == [2, 4, 3] and hb.refs[:2].tolist() == [1, 1]
    assert hb.evict_lru(2) == [2, 4] and gone == [2, 4]
    assert list(hb.lru) == [3] and not hb.kept[[2, 4]].any()
    hb.check_integrity([c])
    # The free list runs out first, then the oldest kept block is taken back.
    d = RequestKV("d")
    assert hb.take(d, 5) == [2, 4, 5, 6, 7] and list(hb.lru) == [3]
    assert hb.take(d, 1) == [3] and gone == [2, 4, 3] and hb.evicted == 3
    with pytest.raises(HostTierFull):
        hb.take(d, 1)
    hb.check_integrity([c, d])
    hb.free(c)
    assert list(hb.lru) == [1, 0]  # still kept: c released them
    hb.unkeep([0, 1])
    assert not hb.lru and sorted(hb._free) == [0, 1]
    hb.check_integrity([d])


def test_adoption_never_leaves_the_reservations_short():
    hb = HostBlocks(6)
    a, b, c = RequestKV("a"), RequestKV("b"), RequestKV("c")
    assert hb.take(a, 3) == [0, 1, 2]
    hb.keep([0, 1, 2])
    hb.free(a)
    assert hb.available == 6 and hb.reserve(b, 6) and hb.available == 0
    assert not hb.adopt(c, [0, 1])  # reviving them would break b's promise
    assert c.host == [] and list(hb.lru) == [2, 1, 0]
    assert hb.adopt(b, [0, 1]) and b.reserved == 4 and hb.available == 0  # its own promise pays
    assert not hb.adopt(c, [5])  # neither held nor kept: not a saved block
    with pytest.raises(RuntimeError, match="neither held nor kept"):
        hb.share([5], c)
    with pytest.raises(RuntimeError, match="more often than it held"):
        hb.release([2], c)
    with pytest.raises(RuntimeError, match="only a held"):
        hb.keep([5])
    hb.check_integrity([b, c])
    assert hb.take(b, 4) == [2, 3, 4, 5]  # the free ones and the oldest kept block
    hb.check_integrity([b, c])


def test_a_release_it_cannot_make_changes_nothing():
    """A release naming a block its record does not hold (held by others, or named twice)
    raises before any holder or count changes, wherever in the list the bad id is."""
    hb = HostBlocks(8)
    a, b, c = RequestKV("a"), RequestKV("b"), RequestKV("c")
    assert hb.take(a, 3) == [0, 1, 2]
    assert hb.adopt(b, [0, 1, 2]) and hb.adopt(c, [0, 1])
    before = (hb.refs.copy(), {i: hb.holders(i) for i in range(3)})
    for bad in ([0, 1, 2], [0, 0], [2, 1, 1]):  # c never held 2; an id twice
        with pytest.raises(RuntimeError, match="more often than it held"):
            hb.release(bad, c)
        assert (hb.refs == before[0]).all()
        assert {i: hb.holders(i) for i in range(3)} == before[1]
    hb.check_integrity([a, b, c])
    assert hb.release([0, 1], c) == 0 and hb.holders(0) == (a, b)
    assert hb.release([2], b) == 0 and hb.holders(2) == (a,)
    c.host, b.host = [], [0, 1]
    hb.check_integrity([a, b, c])
    assert hb.free(a) == 3 and hb.refs[:3].tolist() == [1, 1, 0] and 2 in hb._free
    hb.check_integrity([b, c])


def test_give_back_promises_only_what_returned():
    hb = HostBlocks(6)
    a, b = RequestKV("a"), RequestKV("b")
    assert hb.reserve(a, 4) and hb.take(a, 4) == [0, 1, 2, 3]
    assert hb.adopt(b, [0, 1, 2])
    hb.give_back(a, 1)  # trimmed to its first block; b still holds 1 and 2
    assert a.host == [0] and a.reserved == 1 and hb.refs[:4].tolist() == [2, 1, 1, 0]
    hb.check_integrity([a, b])


class _Keeper:
    """A prefix cache's view: chains of kept ids (each a prefix's blocks in order). The
    host tier may take back only a chain's last kept block."""

    def __init__(self):
        self.chains: list[list[int]] = []

    def evicted(self, ids: list[int]) -> None:
        for i in ids:
            for chain in self.chains:
                if i in chain:
                    assert chain[-1] == i, f"host block {i} taken back before its prefix's end"
                    chain.pop()
        self.chains = [c for c in self.chains if c]


class _Model:
    """What `HostBlocks` must hold, kept separately: holders by id, the LRU order, which
    ids are free, and how often each went free."""

    def __init__(self, n: int):
        self.refs = [0] * n
        self.kept = [False] * n
        self.lru: list[int] = []
        self.free = set(range(n))
        self.freed = [0] * n  # times each id went free since it was last taken

    def hold(self, ids, fresh: bool):
        for i in ids:
            if fresh:  # a kept one was taken back first (`evicted`)
                assert i in self.free and self.refs[i] == 0, i
                self.free.discard(i)
                self.freed[i] = 0
            elif i in self.lru:
                self.lru.remove(i)
            self.refs[i] += 1

    def drop(self, ids):
        for i in reversed(ids):
            assert self.refs[i] > 0
            self.refs[i] -= 1
            if self.refs[i] == 0:
                self._unheld(i)

    def _unheld(self, i):
        if self.kept[i]:
            self.lru.append(i)
        else:
            self.free.add(i)
            self.freed[i] += 1

    def evicted(self, ids):
        for i in ids:
            assert self.lru and self.lru[0] == i, "not the oldest kept block"
            self.lru.pop(0)
            self.kept[i] = False
            self.free.add(i)
            self.freed[i] += 1


def _check(hb: HostBlocks, model: _Model, live: dict[str, RequestKV]) -> None:
    assert hb.refs.tolist() == model.refs
    assert list(hb.lru) == model.lru
    assert set(hb._free) == model.free
    assert max(model.freed) <= 1, "a host block went free twice"
    assert all(model.refs[i] == 0 for i in hb._free), "a held host block is free"
    hb.check_integrity(live.values())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_adopting_and_releasing_in_any_order_frees_each_block_once(seed):
    rng = random.Random(seed)
    n = 48
    keeper, model = _Keeper(), _Model(n)

    def on_evict(ids):
        model.evicted(ids)
        keeper.evicted(ids)

    hb = HostBlocks(n, on_evict=on_evict)
    live: dict[str, RequestKV] = {}
    for step in range(600):
        op = rng.choice(["start", "start", "grow", "keep", "trim", "end", "end", "evict"])
        if op == "start":
            rec = RequestKV(f"r{step}")
            # A prefix from a kept chain or from a running request, as the tree would give.
            sources = [c for c in keeper.chains] + [r.host for r in live.values() if r.host]
            prefix = []
            if sources and rng.random() < 0.7:
                src = rng.choice(sources)
                prefix = list(src[: rng.randint(1, len(src))])
            if not hb.reserve(rec, len(prefix) + rng.randint(0, 8)):
                continue
            if prefix:
                if hb.adopt(rec, prefix):
                    model.hold(prefix, fresh=False)
                else:
                    assert all(hb.refs[i] > 0 or i in hb.lru for i in prefix)
                    assert rec.host == []
            live[rec.rid] = rec
        elif op == "grow" and live:
            rec = live[rng.choice(sorted(live))]
            k = rng.randint(1, 4)
            free_before, evicted_before = len(hb._free), hb.evicted
            try:
                ids = hb.take(rec, k)
            except HostTierFull:
                assert k - min(k, rec.reserved) > hb.available
                continue
            # Kept ids are taken back only for what the free list lacks.
            assert hb.evicted - evicted_before == max(0, k - free_before)
            model.hold(ids, fresh=True)
        elif op == "keep" and live:
            rec = live[rng.choice(sorted(live))]
            if rec.host:
                chain = rec.host[: rng.randint(1, len(rec.host))]
                hb.keep(chain)
                for i in chain:
                    model.kept[i] = True
                keeper.chains.append(list(chain))
        elif op == "trim" and live:
            rec = live[rng.choice(sorted(live))]
            if rec.host:
                keep = rng.randint(0, len(rec.host) - 1)
                tail = rec.host[keep:]
                hb.give_back(rec, keep)
                model.drop(tail)
        elif op == "end" and live:
            rec = live.pop(rng.choice(sorted(live)))
            ids = list(rec.host)
            assert hb.free(rec) == len(ids)
            model.drop(ids)
        elif op == "evict":
            hb.evict_lru(rng.randint(1, 3))
        _check(hb, model, live)
    for rid in sorted(live, key=lambda _: rng.random()):
        rec = live.pop(rid)
        ids = list(rec.host)
        hb.free(rec)
        model.drop(ids)
        _check(hb, model, live)
    assert hb.used == 0 and hb.reserved == 0
    hb.evict_lru(n)
    _check(hb, model, live)
    assert sorted(hb._free) == list(range(n)) and not keeper.chains
