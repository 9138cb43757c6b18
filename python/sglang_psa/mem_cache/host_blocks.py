"""Host-tier block ids: holders, the prefixes kept without one, the free list and the
reservations against it (`HostBlocks`)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from sglang_psa.mem_cache.request_kv import RequestKV


class HostTierFull(RuntimeError):
    """A request needs more host blocks than it reserved and none are free."""


class HostBlocks:
    """Host-tier block ids (CPU only): who holds each, which are kept for a prefix cache,
    the free list, and requests' reservations against it.

    An id is in exactly one of three states:
    - *held*: `refs[id] > 0` holders (requests: the id is in their `RequestKV.host`). A
      held id is never freed and never handed out again. A prefix shared by several
      requests is saved once and held by each (`adopt`), not copied;
    - *kept*: no holder, but a prefix cache (the keeper, `keep`) names it: its KV is a
      saved prefix block a later request may adopt. Kept ids wait in least-recently-released
      order (`lru`) and leave it when adopted again or when the host tier needs room
      (`evict_lru`, oldest first; the keeper is told through `on_evict`). A request's
      blocks are released last block first, so a prefix's later blocks leave before its
      earlier ones and what stays kept of a prefix is always its start;
    - *free*: neither held nor kept.

    A request reserves the blocks its whole length can fill when admitted, so a running
    request never finds the host tier full: kept ids count as available (they are freed
    on demand), and `reserved <= len(free) + len(lru)` always. It takes ids as its blocks
    fill (appended to `host`, in block order) and returns its holds when it ends
    (`free`). Ids come out smallest first (the free list stays sorted), so a prefill's
    blocks are runs that one strided copy moves; kept ids are taken only when the free
    list is empty.
    """

    def __init__(self, num_blocks: int, on_evict: Callable[[list[int]], None] | None = None):
        """`on_evict(ids)`: the keeper forgets ids the host tier took back from `lru`."""
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self.reserved = 0  # ids promised to requests, not yet taken (their `reserved`, summed)
        self.refs = np.zeros(num_blocks, dtype=np.int32)  # holders of each id
        # id -> the records holding it (`refs` of them): residency switches every holder
        # of a block that leaves HBM (`holders`). One holder is the record itself, several
        # a tuple: an id held once (nearly all) allocates no container, so a server saving
        # a million blocks adds no million objects for Python's collector to scan.
        self._holders: dict[int, RequestKV | tuple[RequestKV, ...]] = {}
        self.kept = np.zeros(num_blocks, dtype=bool)  # named by the keeper
        # Acknowledged on every layer (`WriteBack`): saved state belongs to the id, so a
        # block saved for one holder is saved for all. Cleared when the id goes free.
        self.saved = np.zeros(num_blocks, dtype=bool)
        self.lru: OrderedDict[int, None] = OrderedDict()  # kept, unheld; oldest first
        self.on_evict = on_evict
        self.evicted = 0  # kept ids the host tier took back, ever

    @property
    def available(self) -> int:
        """Ids a request may still be promised: free or kept without a holder, less the
        reservations."""
        return len(self._free) + len(self.lru) - self.reserved

    @property
    def used(self) -> int:
        """Ids held by a request."""
        return self.num_blocks - len(self._free) - len(self.lru)

    @property
    def cached(self) -> int:
        """Ids kept for a prefix cache with no holder."""
        return len(self.lru)

    # -- a request's reservation and its own blocks ---------------------------------------
    def reserve(self, rec: RequestKV, n: int) -> bool:
        """Promise `rec` `n` ids in all (those it holds and those already promised count)
        if the missing ones are available."""
        extra = n - len(rec.host) - rec.reserved
        if extra <= 0:
            return True
        if extra > self.available:
            return False
        self._promise(rec, extra)
        return True

    def take(self, rec: RequestKV, n: int) -> list[int]:
        """`n` fresh ids for `rec`, from its reservation first, appended to `rec.host`,
        each held by `rec` alone: free ids first, then kept ones, oldest first."""
        if n == 0:
            return []
        from_res = min(n, rec.reserved)
        if n - from_res > self.available:
            raise HostTierFull(
                f"request {rec.rid} needs {n} host blocks beyond its reservation; "
                f"{self.available} free"
            )
        self._promise(rec, -from_res)
        if n > len(self._free):
            self.evict_lru(n - len(self._free))
        ids = [self._free.pop() for _ in range(n)]
        self.refs[ids] = 1
        self._holders.update(zip(ids, [rec] * n))
        rec.host.extend(ids)
        return ids

    def adopt(self, rec: RequestKV, ids: list[int]) -> bool:
        """`rec`, holding nothing yet, starts with a prefix whose blocks are `ids` (held by
        other requests or kept): each gains `rec` as a holder; nothing is copied. Its
        reservation shrinks by the blocks it no longer takes. False, and nothing changes,
        when an id is neither held nor kept (its KV is not a saved block) or when reviving
        kept ids would leave the reservations short."""
        if rec.host:
            raise RuntimeError(f"request {rec.rid} adopts a prefix after taking blocks")
        unheld = self._unheld_of(ids)  # (an id in `lru` has no holder)
        if not all(i in self.lru for i in unheld):
            return False
        spare = min(len(ids), rec.reserved)
        if len(unheld) > self.available + spare:
            return False
        self._promise(rec, -spare)
        self._hold(ids, unheld, rec)
        rec.host.extend(ids)
        return True

    def switch(self, rec: RequestKV, b: int, other: int) -> bool:
        """`rec`'s block `b` is a duplicate of `other` (held or kept, saved): `rec` holds
        `other` instead and lets its own id go (free unless another holder or the keeper
        has it). Its blocks before `b` must already be shared with `other`'s holders (a
        prefix is switched from its start). False, and nothing changes, when reviving a
        kept `other` would leave the reservations short."""
        own = rec.host[b]
        if own == other:
            return True
        if self.refs[other] == 0 and other not in self.lru:
            raise RuntimeError(f"host block {other} is neither held nor kept")
        if self.refs[other] == 0 and self.refs[own] > 1 and self.available <= 0:
            return False
        self.share([other], rec)
        rec.host[b] = other
        self.release([own], rec)
        return True

    def advance(self, rec: RequestKV) -> int:
        """`rec.saved` grows over the leading run of its ids that are saved; returns it.
        (An extend's acknowledgement saves hundreds at once: one array read, not one a
        block.)"""
        n, ids = rec.saved, rec.host
        if n < len(ids) and self.saved[ids[n]]:
            ok = self.saved[ids[n:]]
            rec.saved = n + (len(ok) if ok.all() else int(ok.argmin()))
        return rec.saved

    def give_back(self, rec: RequestKV, keep: int) -> None:
        """`rec` keeps only its first `keep` ids (the saves of the others were dropped,
        or it is trimmed): it stops holding the others, and those no other holder has
        return (free or kept) and stay promised to it."""
        ids = rec.host[keep:]
        if not ids:
            return
        del rec.host[keep:]
        self._promise(rec, self.release(ids, rec))

    def free(self, rec: RequestKV) -> int:
        """`rec` ended: it stops holding its ids and its reservation returns; the number
        of ids it held. Ids another request holds stay; kept ones wait in `lru`. A second
        call returns nothing."""
        self._promise(rec, -rec.reserved)
        ids, rec.host = rec.host, []
        self.release(ids, rec)
        return len(ids)

    # -- holders and the keeper ----------------------------------------------------------
    def share(self, ids: Iterable[int], rec: RequestKV) -> None:
        """Each of `ids` (held or kept) gains `rec` as a holder (the caller puts them in
        its `host`); a kept one leaves `lru`."""
        ids = list(ids)
        unheld = self._unheld_of(ids)
        bad = [i for i in unheld if i not in self.lru]
        if bad:
            raise RuntimeError(f"host blocks {bad[:8]} are neither held nor kept")
        self._hold(ids, unheld, rec)

    def _hold(self, ids: list[int], unheld: list[int], rec: RequestKV) -> None:
        """`share` once checked: `unheld` are the ids of `ids` without a holder, all kept."""
        for i in unheld:
            self.lru.pop(i, None)  # (an id named twice in `ids` leaves once)
        holders = self._holders
        for i in ids:
            held = holders.get(i)
            if held is None:
                holders[i] = rec
            else:
                holders[i] = (*held, rec) if type(held) is tuple else (held, rec)
        np.add.at(self.refs, ids, 1)

    def release(self, ids: Iterable[int], rec: RequestKV) -> int:
        """Each of `ids` (in block order; the caller took them out of its `host`) loses
        holder `rec`; one left with none waits in `lru` if kept, else is free. The last
        block goes first, so a prefix's earlier blocks stay kept longer. Returns the ids
        left with no holder."""
        ids = list(ids)
        holders = self._holders
        # Each id's holders without `rec` (None: none left), all checked before any changes
        # (one pass: a block a prefix shares is released by each of its many holders).
        after: list = []
        for i in ids:
            held = holders.get(i)
            if held is rec:
                after.append(None)
            elif type(held) is tuple and rec in held:  # (a RequestKV equals itself only)
                k = held.index(rec)
                after.append(held[1 - k] if len(held) == 2 else held[:k] + held[k + 1 :])
            else:
                break
        if len(after) != len(ids) or len(set(ids)) != len(ids):
            raise RuntimeError(f"{rec.rid!r} releases a host block more often than it held it")
        for i, rest in zip(ids, after):
            if rest is None:
                del holders[i]
            else:
                holders[i] = rest
        self.refs[ids] -= 1  # (the ids are distinct)
        gone = [i for i, rest in zip(reversed(ids), reversed(after)) if rest is None]
        self._unheld(gone)
        return len(gone)

    def _unheld_of(self, ids: list[int]) -> list[int]:
        """The ids of `ids` no request holds (kept or free), in order."""
        if not ids:
            return []
        arr = np.asarray(ids, dtype=np.int64)
        return arr[self.refs[arr] == 0].tolist()

    def holders(self, i: int) -> Sequence[RequestKV]:
        """The records holding host block `i` (none if it is kept or free), as a tuple."""
        held = self._holders.get(i, ())
        return held if type(held) is tuple else (held,)

    def keep(self, ids: Iterable[int]) -> None:
        """The keeper names `ids` (held, saved blocks of a prefix): once no request holds
        one it waits in `lru` instead of the free list."""
        ids = list(ids)
        if (self.refs[ids] <= 0).any():
            raise RuntimeError("only a held host block can be kept")
        self.kept[ids] = True

    def unkeep(self, ids: Iterable[int]) -> None:
        """The keeper forgets `ids`: those without a holder are free."""
        ids = [i for i in ids if self.kept[i]]
        self.kept[ids] = False
        unheld = [i for i in ids if i in self.lru]
        for i in unheld:
            del self.lru[i]
        self._put(unheld)

    def evict_lru(self, n: int, *, count: bool = True) -> list[int]:
        """Frees the `n` (at most) kept ids released longest ago; the keeper forgets them
        (`on_evict`). Returns them. `count=False`: not counted in `evicted` (a flushed
        prefix cache, not host pressure)."""
        ids = []
        while self.lru and len(ids) < n:
            i, _ = self.lru.popitem(last=False)
            ids.append(i)
        if ids:
            self.kept[ids] = False
            self._put(ids)
            self.evicted += len(ids) if count else 0
            if self.on_evict is not None:
                self.on_evict(ids)
        return ids

    def _unheld(self, ids: list[int]) -> None:
        for i in ids:
            if self.kept[i]:
                self.lru[i] = None
        self._put([i for i in ids if not self.kept[i]])

    def _promise(self, rec: RequestKV, n: int) -> None:
        rec.reserved += n
        self.reserved += n

    def _put(self, ids: list[int]) -> None:
        if ids:
            self.saved[ids] = False
            self._free.extend(ids)
            self._free.sort(reverse=True)  # pop() gives the smallest: freed space re-forms runs

    def check_integrity(self, records: Iterable[RequestKV]) -> None:
        """Against every live request's record: each id is held exactly by the records
        naming it (no record names one twice), kept without a holder, or free; the
        reservations sum to what is promised and never exceed what is available."""
        records = list(records)
        holders = np.zeros(self.num_blocks, dtype=np.int32)
        for rec in records:
            assert len(set(rec.host)) == len(rec.host), (
                f"{rec.rid!r}: a host block owned twice by one request"
            )
            np.add.at(holders, rec.host, 1)
        assert (holders == self.refs).all(), "a host block's holders drifted"
        named = {}
        for rec in records:
            for i in rec.host:
                named.setdefault(i, set()).add(id(rec))
        have = {i: {id(q) for q in self.holders(i)} for i in self._holders}
        assert have == named and all(len(self.holders(i)) == self.refs[i] for i in self._holders), (
            "the holders named by host block drifted from the records"
        )
        assert all(type(h) is not tuple or len(h) > 1 for h in self._holders.values()), (
            "a host block's one holder kept in a container"
        )
        free, lru = set(self._free), set(self.lru)
        assert len(free) == len(self._free), "a free host block listed twice"
        assert not free & lru, "a host block both free and kept"
        held = set(np.flatnonzero(self.refs).tolist())
        assert free | lru | held == set(range(self.num_blocks)), "a host block is lost"
        assert not (free | lru) & held, "a held host block is free or waits in the LRU"
        assert all(self.kept[i] for i in lru) and not any(self.kept[i] for i in free)
        assert not any(self.saved[i] for i in free), "a free host block counts as saved"
        assert all(rec.reserved >= 0 for rec in records)
        assert self.reserved == sum(rec.reserved for rec in records), "reservations drifted"
        assert self.reserved <= len(free) + len(lru), "more promised than available"
