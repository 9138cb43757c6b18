"""The keeper of saved prefixes (`PrefixIndex`): chained block hashes -> host ids, fed only
by acknowledged saves, against a model keyed by the token prefixes themselves. Lookups
return the longest saved prefix; an id the host tier's LRU takes back leaves the index,
which never names a free id; what stays indexed of a prefix is its start."""

from __future__ import annotations

import hashlib
import random
from array import array

import numpy as np
import pytest

from sglang_psa.mem_cache.host_blocks import HostBlocks
from sglang_psa.mem_cache.prefix_index import (
    JoinedTokens,
    PrefixIndex,
    RecentChains,
    _common_blocks,
    chain_hashes,
    seed,
    token_bytes,
)
from sglang_psa.mem_cache.request_kv import RequestKV

BS = 4


def _ack(hb: HostBlocks, index: PrefixIndex, rec: RequestKV, blocks) -> None:
    """What `WriteBack._saved` does with an acknowledgement."""
    for b in blocks:
        hb.saved[rec.host[b]] = True
    hb.advance(rec)
    index.saved(rec)


def _start(hb, index, rid, tokens, extra_key=None) -> RequestKV:
    rec = RequestKV(rid)
    index.track(rid, extra_key, lambda: tokens)
    return rec


def test_a_prompt_and_its_output_hash_as_their_join():
    """A request's tokens read as its prompt then its output (`JoinedTokens`, no copy)
    hash, from any known prefix of blocks, as the joined list does; slices and items
    across the seam are the list's."""
    prompt, output = list(range(100, 111)), [7, 8, 9, 10, 11]  # the seam inside block 2
    joined, view = prompt + output, JoinedTokens(prompt, output)
    assert len(view) == len(joined) and list(view) == joined
    for a, b in ((0, 16), (3, 11), (11, 16), (9, 14), (12, 99), (-5, None)):
        assert view[a:b] == joined[a:b], (a, b)
    assert view[11] == joined[11] and view[-1] == joined[-1]
    with pytest.raises(IndexError):
        view[len(joined)]
    full = chain_hashes("k", joined, BS, 4)
    assert len(full) == 4
    for known in range(4):
        assert chain_hashes("k", view, BS, 4, known=full[:known]) == full


def test_a_block_hash_is_blake2b_of_the_previous_hash_and_its_int64_tokens():
    """The definition, whatever holds the tokens (SGLang's lists, the test's arrays, a
    prompt and output joined across a block): hash `b` = blake2b-128(hash `b - 1` ||
    block `b`'s tokens as little-endian int64), hash `-1` the namespace's seed."""
    import struct

    tokens = [3, 70000, 5, 2**40, 9, 1, 0, 8, 6, 6, 6, 6]
    prev, want = seed("k"), []
    for b in range(3):
        block = struct.pack("<4q", *tokens[b * BS : (b + 1) * BS])
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        want.append(prev)
    joined = JoinedTokens(array("q", tokens[:6]), array("q", tokens[6:]))
    for held in (tokens, array("q", tokens), joined, JoinedTokens(tokens, [])):
        assert chain_hashes("k", held, BS, 3) == want, type(held)
        assert chain_hashes("k", held, BS, 3, known=want[:1]) == want
    assert token_bytes(joined, 5, 7) == struct.pack("<2q", *tokens[5:7])  # the seam


def test_chained_hashes_name_a_prefix_and_its_namespace():
    a = chain_hashes(None, list(range(12)), BS, 3)
    b = chain_hashes(None, list(range(8)) + [9, 9, 9, 9], BS, 3)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert chain_hashes("lora", list(range(12)), BS, 3)[0] != a[0]
    assert chain_hashes(None, list(range(12)), BS, 3, known=a[:1]) == a
    assert len(chain_hashes(None, list(range(10)), BS, 5)) == 2  # whole blocks only
    # A cache salt is a namespace of its own, apart from any extra key; unsalted hashes
    # are those of the extra key alone (as before salts were hashed).
    toks = list(range(12))
    x = chain_hashes(None, toks, BS, 3, salt="x")
    assert chain_hashes(None, toks, BS, 3, salt=None) == a
    assert len({x[0], a[0], chain_hashes(None, toks, BS, 3, salt="y")[0]}) == 3
    assert chain_hashes("x", toks, BS, 3)[0] != x[0]
    assert chain_hashes("lora", toks, BS, 3, salt="x")[0] not in (x[0], a[0])
    first = hashlib.blake2b(array("q", toks[:BS]).tobytes(), digest_size=16).digest()
    assert a[0] == first != x[0]


def test_only_acknowledged_saves_enter_and_lookups_take_the_longest_prefix():
    hb = HostBlocks(16)
    index = PrefixIndex(hb, BS)
    toks = list(range(20))
    a = _start(hb, index, "a", toks)
    hb.take(a, 4)
    assert index.lookup(chain_hashes(None, toks, BS, 5)) == []
    _ack(hb, index, a, [1])  # block 0 not acknowledged yet: nothing enters
    assert a.saved == 0 and len(index) == 0
    _ack(hb, index, a, [0])
    assert a.saved == 2 and index.lookup(chain_hashes(None, toks, BS, 5)) == [0, 1]
    assert hb.kept[[0, 1]].all() and not hb.kept[[2, 3]].any()
    # Another prompt sharing two blocks, then diverging, finds those two only.
    other = toks[:8] + [99] * 12
    assert index.lookup(chain_hashes(None, other, BS, 5)) == [0, 1]
    assert index.lookup(chain_hashes("salt", toks, BS, 5)) == []
    # b computed the same blocks itself: its duplicates stay out of the index until it
    # switches to the index's ids, then its own further blocks enter.
    b = _start(hb, index, "b", toks)
    hb.take(b, 3)
    _ack(hb, index, b, [0, 1, 2])
    assert b.host == [4, 5, 6] and len(index) == 2
    assert hb.switch(b, 0, 0) and hb.switch(b, 1, 1) and b.host == [0, 1, 6]
    index.saved(b)
    assert index.lookup(chain_hashes(None, toks, BS, 5)) == [0, 1, 6]
    index.check_integrity()
    hb.check_integrity([a, b])
    # A lookup ends at the first block the index lacks, whatever it names after it.
    h = chain_hashes(None, toks, BS, 5)
    assert index.lookup([h[0], b"absent", h[2]]) == [0]
    assert index.lookup([b"absent", *h]) == [] and index.lookup([]) == []


def test_a_run_of_new_blocks_enters_as_a_chain_and_a_named_id_stops_it():
    """An extend's acknowledgement enters its run at once: each block chained to the one
    before, the first to the indexed prefix; a run with an id the index already names is
    walked block by block and stops there."""
    hb = HostBlocks(32)
    index = PrefixIndex(hb, BS)
    toks = list(range(40))
    a = _start(hb, index, "a", toks)
    hb.take(a, 10)
    _ack(hb, index, a, [0, 1])
    _ack(hb, index, a, range(2, 10))  # a run of 8 new blocks below two indexed
    h = chain_hashes(None, toks, BS, 10)
    assert index.lookup(h) == a.host and index._parent[h[2]] == h[1]
    assert [index._parent[x] for x in h[3:]] == h[2:9] and index._kids(h[9]) == ()
    assert all(index._kids(x) == (y,) for x, y in zip(h, h[1:]))
    index.check_integrity()
    # b's own blocks after a's first two; its block 3 holds an id the index names (a's
    # block 5, as an id switched by mistake would): b's run enters up to it
    other = toks[:8] + [99] * 24
    b = _start(hb, index, "b", other)
    assert hb.adopt(b, a.host[:2])
    b.saved = 2
    hb.take(b, 4)
    hb.share([a.host[5]], b)
    b.host[3] = a.host[5]
    _ack(hb, index, b, [2])
    _ack(hb, index, b, [4, 5])
    hb.advance(b)
    index.saved(b)
    g = chain_hashes(None, other, BS, 6)
    assert index.lookup(g) == b.host[:3]
    index.check_integrity()


def test_a_new_request_takes_the_hashes_of_the_whole_blocks_it_shares_and_no_more():
    """`RecentChains`: a request sharing a document with an earlier one reuses the hashes
    of their common whole blocks; every hash equals the one computed from scratch, in its
    namespace, whatever the other request did after."""
    hb = HostBlocks(8)
    index = PrefixIndex(hb, BS)
    n = RecentChains.MIN_BLOCKS + 8
    doc = list(range(1000, 1000 + n * BS))
    reqs = {
        "q1": (None, doc + [1] * 8),
        "q2": (None, doc + [2] * 8),  # the same document, another question
        "mid": (None, doc[: 5 * BS + 2] + [7] * (n * BS)),  # differs inside block 5
        "salted": ("k", doc + [3] * 8),  # another namespace: nothing to reuse
        "short": (None, doc[: 4 * BS]),  # below MIN_BLOCKS: hashed, never stored
    }
    reused = []
    for rid, (key, toks) in reqs.items():
        index.track(rid, key, lambda toks=toks: array("q", toks))
        before = index.recent.reused
        got = index.request_hashes(rid, len(toks) // BS)
        assert got == chain_hashes(key, toks, BS, len(toks) // BS), rid
        reused.append(index.recent.reused - before)
    assert reused == [0, n - 1, 4, 0, 0]  # (the first block is hashed: it is the key)
    # q1's output blocks extend its own list (a decode acknowledgement); a later request
    # borrows from the last one hashed from its first block (`mid`: 5 whole blocks)
    q1 = reqs["q1"][1] + [9] * (3 * BS)
    index.track("q1", None, lambda: array("q", q1))
    assert index.request_hashes("q1", len(q1) // BS) == chain_hashes(None, q1, BS, len(q1) // BS)
    q3 = doc + [1] * 8 + [8] * (2 * BS)
    index.track("q3", None, lambda: array("q", q3))
    before = index.recent.reused
    assert index.request_hashes("q3", len(q3) // BS) == chain_hashes(None, q3, BS, len(q3) // BS)
    assert index.recent.reused - before == 4


@pytest.mark.parametrize("seed_", range(3))
def test_common_blocks_are_the_whole_blocks_before_the_first_difference(seed_):
    rng = random.Random(seed_)
    for _ in range(200):
        a = np.array([rng.randrange(3) for _ in range(rng.randrange(0, 40))], dtype=np.int64)
        b = np.array([rng.randrange(3) for _ in range(rng.randrange(0, 40))], dtype=np.int64)
        if rng.random() < 0.5:  # often a long shared start
            k = rng.randrange(0, len(a) + 1)
            b = np.concatenate([a[:k], b])
        m = min(len(a), len(b))
        first = next((i for i in range(m) if a[i] != b[i]), m)
        for chunk in (1, 3, 7, 2048):
            assert _common_blocks(a, b, BS, chunk) == first // BS, (a, b, chunk)


def test_an_evicted_block_leaves_the_index_deeper_blocks_first():
    gone: list[int] = []
    hb = HostBlocks(6, on_evict=gone.extend)
    index = PrefixIndex(hb, BS)
    toks = list(range(16))
    a = _start(hb, index, "a", toks)
    hb.take(a, 4)
    _ack(hb, index, a, range(4))
    hb.free(a)
    assert list(hb.lru) == [3, 2, 1, 0]
    index.check_integrity()
    c = RequestKV("c")
    hb.take(c, 3)  # two free ids, then the oldest kept: the prefix's last block
    assert gone == [3] and index.lookup(chain_hashes(None, toks, BS, 4)) == [0, 1, 2]
    hb.take(c, 2)
    assert gone == [3, 2, 1] and index.lookup(chain_hashes(None, toks, BS, 4)) == [0]
    assert index.orphans == 0
    index.check_integrity()
    hb.check_integrity([c])


class _Model:
    """The index as it must be: token prefix (whole blocks) -> host id, fed by the same
    acknowledgements, emptied by the same evictions."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}

    def saved(self, rec, tokens):
        for b in range(rec.saved):
            key = tuple(tokens[: (b + 1) * BS])
            i = self.ids.get(key)
            if i is None:
                if rec.host[b] in self.ids.values():
                    break
                self.ids[key] = rec.host[b]
            elif i != rec.host[b]:
                break

    def evicted(self, ids):
        for key in [k for k, i in self.ids.items() if i in ids]:
            for deeper in [k for k in self.ids if k[: len(key)] == key]:
                del self.ids[deeper]

    def lookup(self, tokens):
        out = []
        for b in range(len(tokens) // BS):
            i = self.ids.get(tuple(tokens[: (b + 1) * BS]))
            if i is None:
                break
            out.append(i)
        return out


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_requests_keep_the_index_a_set_of_saved_prefix_starts(seed):
    rng = random.Random(seed)
    n = 24
    model = _Model()
    hb = HostBlocks(n, on_evict=model.evicted)
    index = PrefixIndex(hb, BS)
    stems = [[rng.randrange(3) for _ in range(6 * BS)] for _ in range(5)]
    live: dict[str, tuple[RequestKV, list[int]]] = {}
    for step in range(500):
        op = rng.choice(["start", "start", "grow", "ack", "ack", "switch", "end", "end", "evict"])
        if op == "start":
            stem = rng.choice(stems)
            toks = stem[: rng.randint(1, len(stem))] + [rng.randrange(50) for _ in range(8)]
            rid = f"r{step}"
            rec = _start(hb, index, rid, toks)
            blocks = len(toks) // BS
            prefix = index.lookup(chain_hashes(None, toks, BS, blocks))
            assert prefix == model.lookup(toks)
            if not hb.reserve(rec, blocks):
                index.untrack(rid)
                continue
            if prefix:
                assert hb.adopt(rec, prefix)
                rec.saved = len(prefix)
            live[rid] = (rec, toks)
        elif op == "grow" and live:
            rec, toks = live[rng.choice(sorted(live))]
            k = min(rng.randint(1, 3), len(toks) // BS - rec.planned)
            if k > 0:
                hb.take(rec, k)
        elif op == "ack" and live:
            rec, toks = live[rng.choice(sorted(live))]
            pending = [b for b in range(rec.planned) if not hb.saved[rec.host[b]]]
            if pending:
                _ack(hb, index, rec, rng.sample(pending, rng.randint(1, len(pending))))
                model.saved(rec, toks)
        elif op == "switch" and live:  # the radix cache finds rec's blocks saved already
            rec, toks = live[rng.choice(sorted(live))]
            ids = index.lookup(index.request_hashes(rec.rid, rec.planned))
            for b, i in enumerate(ids):
                if not hb.switch(rec, b, i):
                    break
            hb.advance(rec)
            index.saved(rec)
            model.saved(rec, toks)
        elif op == "end" and live:
            rec, _ = live.pop(rng.choice(sorted(live)))
            hb.free(rec)
            index.untrack(rec.rid)
        elif op == "evict":
            hb.evict_lru(rng.randint(1, 3))
        # The index equals the model, names no free id, and keeps prefix starts.
        assert {index._hash[i]: i for i in index._hash} == index._ids
        assert sorted(index._hash) == sorted(model.ids.values())
        for toks in stems:
            hashes = chain_hashes(None, toks, BS, len(toks) // BS)
            assert index.lookup(hashes) == model.lookup(toks)
        assert index.orphans == 0
        index.check_integrity()
        hb.check_integrity([r for r, _ in live.values()])
    assert hb.evicted > 0, "the run never made the host tier take kept blocks back"


def test_saved_blocks_add_no_object_a_block_for_pythons_collector():
    """A server saves millions of blocks; an object a block for Python's cyclic collector
    (a holder list per host id, a child set per index entry) made its full collections
    scan them all, pauses of hundreds of ms on the scheduler's thread (the tiered home's
    host time). Taking, acknowledging and indexing 4,000 blocks of one request adds no
    tracked object a block; a second request sharing the prefix, then releasing it, and
    a branch under it keep the index's maps exact (`check_integrity`)."""
    import gc

    n = 4000
    hb = HostBlocks(2 * n + 8)
    index = PrefixIndex(hb, BS)
    toks = list(range(n * BS))
    a = _start(hb, index, "a", toks)
    index.request_hashes("a", n)  # (the hashes are bytes: not tracked)
    gc.collect()
    before = len(gc.get_objects())
    hb.take(a, n)
    _ack(hb, index, a, range(n))
    gc.collect()
    assert len(index) == n
    assert len(gc.get_objects()) - before < 64
    b = _start(hb, index, "b", toks[: 8 * BS] + [0] * (4 * BS))  # 8 blocks shared, 4 own
    assert hb.adopt(b, index.lookup(index.request_hashes("b", 12)))
    assert b.host == a.host[:8]
    hb.take(b, 4)
    _ack(hb, index, b, range(8, 12))
    assert len(index) == n + 4  # block 8 branches: two entries chained below block 7's
    index.check_integrity()
    hb.free(b)
    hb.check_integrity([a])
    assert len(hb.evict_lru(4)) == 4  # b's own blocks, released last: the branch goes
    assert len(index) == n and index.orphans == 0
    index.check_integrity()
