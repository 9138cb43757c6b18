"""The keeper of saved prefix blocks (`PrefixIndex`): chained block hashes -> host ids.

`--psa-kv-home tiered` with the `psa` radix cache (`mem_cache.psa_radix_cache`). Block
`b` of a request is named by `hash(namespace, tokens of blocks 0..b)` (each hash chains
the previous one, as nano-vllm's block manager keys blocks), so an entry does not depend
on SGLang's tree: the namespace is the request's `extra_key` and, where SGLang keys its
tree by it too (0.5.23), its cache salt (`seed`), so requests of different salts never
share a host block; a node split, merge or deletion changes nothing here, and a node SGLang
deletes when it leaves HBM keeps its host blocks in the index.

Only acknowledged saves enter (`saved`, called by the write-back's acknowledgement), and
only along a chain the index already has with the same host ids: block `b` of a record
enters if blocks `0..b-1` are the index's entries for their hashes *and* the record holds
those very ids. So every entry's parent entry is held by every holder of the entry (a
holder holds a whole prefix), a prefix's later blocks are released no later than its
earlier ones, and the host tier's LRU (`HostBlocks.evict_lru`) takes a prefix's end
before its start: what stays indexed of a prefix is its start (docs/prefix-tiered.md,
invariant 5). A request that saved a duplicate of an indexed block keeps it out of the
index; the radix cache switches it to the index's id (`HostBlocks.switch`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from itertools import takewhile

import numpy as np

from sglang_psa.mem_cache.host_blocks import HostBlocks
from sglang_psa.mem_cache.request_kv import RequestKV


def seed(extra_key: str | None, salt: str | None = None) -> bytes:
    """The start of a namespace's hash chain: `extra_key`'s bytes without a salt (the
    hashes of unsalted requests do not depend on salting), else a digest of both."""
    base = (extra_key or "").encode()
    if salt is None:
        return base
    h = hashlib.blake2b(b"cache_salt\0" + salt.encode() + b"\0", digest_size=16)
    h.update(base)
    return h.digest()


class JoinedTokens(Sequence):
    """Two token lists read as one (a request's prompt, then its output), without copying
    them into one: a request's next block is hashed from its slice alone (joining a 28K
    prompt to its output for every block a decode step saves copied the whole prompt)."""

    __slots__ = ("head", "tail")

    def __init__(self, head: Sequence[int], tail: Sequence[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, i):
        n = len(self.head)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("JoinedTokens slices with step 1 only")
            if stop <= n:
                return list(self.head[start:stop])
            if start >= n:
                return list(self.tail[start - n : stop - n])
            return list(self.head[start:]) + list(self.tail[: stop - n])
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.head[i] if i < n else self.tail[i - n]


def chain_hashes(
    extra_key: str | None,
    tokens: Sequence[int],
    block_size: int,
    blocks: int,
    known: Sequence[bytes] = (),
    salt: str | None = None,
) -> list[bytes]:
    """The chained hashes of the first `blocks` whole blocks of `tokens` (at most as many
    as there are) in the namespace of `extra_key` and `salt`, reusing `known` (the
    hashes of a prefix of them)."""
    out = list(known[:blocks])
    _chain_onto(out, extra_key, salt, tokens, block_size, blocks)
    return out


def _chain_onto(out: list[bytes], extra_key, salt, tokens, block_size: int, blocks: int) -> None:
    """`out` (the chained hashes of a prefix of `tokens`' blocks) grown in place to the
    first `blocks` whole blocks (at most as many as there are)."""
    blocks = min(blocks, len(tokens) // block_size)
    first = len(out)
    if blocks > first:
        data = token_bytes(tokens, first * block_size, blocks * block_size)
        _chain_bytes(out, out[-1] if out else seed(extra_key, salt), data, 8 * block_size)


def _chain_bytes(out: list[bytes], prev: bytes, data: bytes, step: int) -> None:
    """Append the chained hashes of `data`'s blocks (`step` bytes each) after `prev`."""
    digest = hashlib.blake2b
    # blake2b(previous hash || the block's int64 tokens), one call a block: a waiting 28K
    # prompt's first match hashes 875 blocks on the scheduler's thread (0.84 ms on a 2-core
    # host, against 1.67 ms with a hasher updated per block and the tokens as a list)
    for b in range(0, len(data), step):
        prev = digest(prev + data[b : b + step], digest_size=16).digest()
        out.append(prev)


def token_bytes(tokens: Sequence[int], start: int, stop: int) -> bytes:
    """`tokens[start:stop]` as int64 bytes (an array's or a `JoinedTokens` of arrays'
    slices copied as they are, not through a list of Python ints)."""
    if isinstance(tokens, JoinedTokens):
        n = len(tokens.head)
        parts = [(tokens.head, start, min(stop, n)), (tokens.tail, max(start - n, 0), stop - n)]
        return b"".join(token_bytes(t, a, b) for t, a, b in parts if b > a)
    part = tokens[start:stop]
    if isinstance(part, array) and part.typecode == "q":
        return part.tobytes()
    return array("q", part).tobytes()


class RecentChains:
    """The hashes of the last request hashed from each first block, with its tokens: a new
    request whose tokens share whole blocks with it takes their hashes (the tokens
    compared, so the same hashes it would compute) and hashes only the rest. Every
    question on a shared document, every turn of a conversation, otherwise hashes the
    whole shared prefix again at its first match (a 16K document: 512 blake2b calls, ~0.7
    ms on the scheduler's thread). Keyed by the first block's chained hash, so by
    namespace too; the `size` most recent first blocks are kept (each holds its
    request's token bytes: 224 KB at 28K tokens)."""

    MIN_BLOCKS = 16  # below this a request hashes faster than the lookup pays

    def __init__(self, size: int = 32):
        self.size = size
        self._by_first: OrderedDict[bytes, tuple[np.ndarray, list[bytes]]] = OrderedDict()
        self.reused = 0  # hashes taken from another request instead of computed

    def hash_onto(self, out: list[bytes], extra_key, salt, tokens, block_size: int,
                  blocks: int) -> None:  # fmt: skip
        """`_chain_onto` for an empty `out`, reusing a recent request's shared blocks."""
        n = min(blocks, len(tokens) // block_size)
        if out or n < self.MIN_BLOCKS:
            _chain_onto(out, extra_key, salt, tokens, block_size, blocks)
            return
        step = 8 * block_size
        data = token_bytes(tokens, 0, n * block_size)
        _chain_bytes(out, seed(extra_key, salt), data[:step], step)
        mine = np.frombuffer(data, dtype=np.int64)
        hit = self._by_first.get(out[0])
        same = 1  # blocks of `out` so far
        if hit is not None:
            theirs, hashes = hit
            same = max(_common_blocks(mine, theirs, block_size), 1)
            out.extend(hashes[1:same])
            self.reused += same - 1
        _chain_bytes(out, out[-1], data[same * step :], step)
        self._by_first[out[0]] = (mine, out)  # (`out` only grows: a prefix of it stays valid)
        self._by_first.move_to_end(out[0])
        if len(self._by_first) > self.size:
            self._by_first.popitem(last=False)


def _common_blocks(a: np.ndarray, b: np.ndarray, block_size: int, chunk: int = 2048) -> int:
    """The whole blocks `a` and `b` begin with in common, compared a chunk at a time (a
    prompt that shares only a short stem costs one chunk)."""
    m = min(len(a), len(b))
    i = 0
    while i < m:
        j = min(i + chunk, m)
        diff = np.flatnonzero(a[i:j] != b[i:j])
        if len(diff):
            return (i + int(diff[0])) // block_size
        i = j
    return m // block_size


class PrefixIndex:
    """Chained block hash -> host id of an acknowledged save, the host tier's keeper.

    Every id it names is kept (`HostBlocks.keep`): held by requests, or waiting unheld in
    the host tier's LRU. When the LRU takes ids back (`HostBlocks.on_evict`) their
    entries leave, with any entry chained below them (none while prefix order holds;
    counted in `orphans`), and the listeners (the radix cache cutting tree nodes at page
    0) hear of every id that left. The index never names a free id.

    Requests are tracked by rid with a source of their tokens (`track`), so that an
    acknowledgement arriving during decode (no radix call in between) can hash the
    blocks it saved.
    """

    def __init__(self, blocks: HostBlocks, block_size: int):
        self.blocks, self.block_size = blocks, block_size
        self._ids: dict[bytes, int] = {}  # chained hash -> host id
        self._hash: dict[int, bytes] = {}  # host id -> its hash
        self._parent: dict[bytes, bytes | None] = {}
        # hash -> its chained entries: the one child itself (nearly every entry's), a set of
        # several (no container a block: a million saved blocks add no million sets for
        # Python's collector to scan)
        self._children: dict[bytes, bytes | set[bytes]] = {}
        # rid -> ((extra_key, salt), token source, hashes computed so far)
        self._tracked: dict[Hashable, tuple[tuple, Callable[[], Sequence[int]], list]] = {}
        self._walked: dict[Hashable, int] = {}  # rid -> its leading blocks the index names
        self.recent = RecentChains()  # a new request's hashes of a prefix another hashed
        self.listeners: list[Callable[[list[int]], None]] = []
        self.orphans = 0  # entries that left because an earlier block's entry left first
        chained = blocks.on_evict

        def on_evict(ids: list[int]) -> None:
            if chained is not None:
                chained(ids)
            self.on_evict(ids)

        blocks.on_evict = on_evict

    def __len__(self) -> int:
        return len(self._ids)

    # -- lookups ----------------------------------------------------------------------
    def hashes(
        self, extra_key: str | None, tokens: Sequence[int], blocks: int, salt: str | None = None
    ) -> list[bytes]:
        return chain_hashes(extra_key, tokens, self.block_size, blocks, salt=salt)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """Host ids of the longest indexed prefix of `hashes`, in block order. (Every
        queued request is matched each scheduling round: the lookups run in C, not a
        Python loop, and stop at the first block the index lacks: a queued prompt the
        index holds nothing of costs one lookup, not one a block.)"""
        ids = self._ids
        return list(map(ids.__getitem__, takewhile(ids.__contains__, hashes)))

    def get(self, h: bytes) -> int | None:
        return self._ids.get(h)

    def names(self, i: int) -> bool:
        """Whether host id `i` is an entry (an acknowledged, kept save of a prefix)."""
        return i in self._hash

    # -- requests and their acknowledgements --------------------------------------------
    def track(
        self,
        rid: Hashable,
        extra_key: str | None,
        tokens: Callable[[], Sequence[int]],
        salt: str | None = None,
    ):
        """`rid`'s blocks are hashed from `tokens()` (its tokens so far) in the namespace
        of `extra_key` and `salt` when saved."""
        ns = (extra_key, salt)
        old = self._tracked.get(rid)
        known = old[2] if old is not None and old[0] == ns else []
        self._tracked[rid] = (ns, tokens, known)

    def untrack(self, rid: Hashable) -> None:
        self._tracked.pop(rid, None)
        self._walked.pop(rid, None)

    def request_hashes(self, rid: Hashable, blocks: int) -> list[bytes]:
        """Chained hashes of `rid`'s first `blocks` blocks (fewer when its tokens are
        fewer, none when untracked)."""
        known, n = self._known(rid, blocks)
        return known[:n]

    def _known(self, rid: Hashable, blocks: int) -> tuple[list[bytes], int]:
        """`rid`'s hashes list, grown in place to `blocks` blocks where its tokens reach,
        and how many of its first entries are asked for (no copy: an acknowledgement
        during decode adds a block to a list of hundreds)."""
        t = self._tracked.get(rid)
        if t is None:
            return [], 0
        (extra_key, salt), tokens, known = t
        if len(known) < blocks:
            self.recent.hash_onto(known, extra_key, salt, tokens(), self.block_size, blocks)
        return known, min(blocks, len(known))

    def saved(self, rec: RequestKV) -> int:
        """`rec`'s saved blocks (`[0, rec.saved)`, acknowledged) enter the index where it
        lacks them, along the chain of its ids the index names; returns the blocks added.
        A block whose hash the index names with another id stops the walk (`rec` holds a
        duplicate until the radix cache switches it)."""
        hashes, n = self._known(rec.rid, rec.saved)  # (the first n are rec's saved blocks')
        # Resume after the blocks known to be the index's already (each acknowledgement
        # would walk the whole request again): valid while the last of them still is
        # (a holder of an indexed id holds the index's ids before it).
        start = self._walked.get(rec.rid, 0)
        if start and (
            start > n
            or start > len(rec.host)
            or self._ids.get(hashes[start - 1]) != rec.host[start - 1]
        ):
            start = 0
        added = []
        parent = hashes[start - 1] if start else None
        b = start
        for b in range(start, n):
            h = hashes[b]
            i = self._ids.get(h)
            if i is None:
                if self._add_run(hashes[b:n], rec.host[b:n], parent):
                    added.extend(rec.host[b:n])
                    b = n
                    break
                own = rec.host[b]
                if own in self._hash:  # (an id names one block's content only)
                    break
                self._add(h, own, parent)
                added.append(own)
            elif i != rec.host[b]:
                break
            parent = h
        else:
            b = n
        self._walked[rec.rid] = b
        if added:
            self.blocks.keep(added)
        return len(added)

    def _add_run(self, hashes: list[bytes], ids: list[int], parent: bytes | None) -> bool:
        """A run of new blocks, each chained to the one before (the first to `parent`),
        entered at once where the index names none of `hashes` and none of `ids` (an
        extend's acknowledgement: hundreds of blocks); False, nothing entered, otherwise
        (`saved` walks those block by block)."""
        if len(hashes) < 2 or any(map(self._ids.__contains__, hashes)):
            return False
        if any(map(self._hash.__contains__, ids)):
            return False
        self._add(hashes[0], ids[0], parent)
        self._ids.update(zip(hashes, ids))
        self._hash.update(zip(ids, hashes))
        self._parent.update(zip(hashes[1:], hashes))
        self._children.update(zip(hashes, hashes[1:]))  # each one's single child
        return True

    def _add(self, h: bytes, i: int, parent: bytes | None) -> None:
        self._ids[h], self._hash[i], self._parent[h] = i, h, parent
        if parent is not None:
            kids = self._children.get(parent)
            if kids is None:
                self._children[parent] = h
            elif type(kids) is set:
                kids.add(h)
            elif kids != h:
                self._children[parent] = {kids, h}

    # -- the host tier takes ids back ---------------------------------------------------
    def on_evict(self, ids: list[int]) -> None:
        """The host tier freed `ids` (kept, unheld): their entries leave, and any chained
        below them (those ids are unkept: free if unheld)."""
        gone: list[int] = []
        orphaned: list[int] = []
        for i in ids:
            h = self._hash.get(i)
            if h is not None:
                self._remove(h, gone, orphaned, top=True)
        if orphaned:
            self.orphans += len(orphaned)
            self.blocks.unkeep(orphaned)
        for fn in self.listeners:
            fn(gone + orphaned)

    def _remove(self, h: bytes, gone: list[int], orphaned: list[int], top: bool) -> None:
        stack = [(h, top)]
        while stack:
            h, top = stack.pop()
            i = self._ids.pop(h)
            del self._hash[i]
            parent = self._parent.pop(h)
            kids = self._children.get(parent) if parent is not None else None
            if kids == h:
                del self._children[parent]
            elif type(kids) is set:
                kids.discard(h)
                if len(kids) == 1:
                    self._children[parent] = kids.pop()
            (gone if top else orphaned).append(i)
            stack.extend((c, False) for c in self._kids(h))
            self._children.pop(h, None)

    def _kids(self, h: bytes) -> tuple[bytes, ...] | set[bytes]:
        """The entries chained below `h`."""
        kids = self._children.get(h, ())
        return (kids,) if type(kids) is bytes else kids

    def check_integrity(self) -> None:
        """Hash <-> id one to one; every named id kept (held or in the LRU: never free)
        and saved; every entry's parent indexed (a prefix keeps its start)."""
        assert len(self._ids) == len(self._hash), "the index's maps drifted"
        free = set(self.blocks._free)
        for h, i in self._ids.items():
            assert self._hash[i] == h, f"host block {i} named under two hashes"
            assert i not in free, f"the index names free host block {i}"
            assert self.blocks.kept[i], f"indexed host block {i} is not kept"
            assert self.blocks.refs[i] > 0 or i in self.blocks.lru, i
            assert self.blocks.saved[i], f"indexed host block {i} was never acknowledged"
            p = self._parent[h]
            assert p is None or p in self._ids, f"host block {i} indexed without its prefix"
            assert p is None or h in self._kids(p), f"host block {i} not among its parent's"
        assert all(self._parent.get(c) == p for p in self._children for c in self._kids(p)), (
            "a chained entry listed under another parent"
        )
        assert all(type(k) is bytes or len(k) > 1 for k in self._children.values()), (
            "an entry's one child kept in a container"
        )
        kept = set(map(int, self.blocks.kept.nonzero()[0]))
        assert kept == set(self._hash), "a kept host block the index does not name"
