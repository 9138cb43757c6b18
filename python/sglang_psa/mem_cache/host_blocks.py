"""Host-tier block ids: the free list and the reservations against it (`HostBlocks`)."""

from __future__ import annotations

from collections.abc import Iterable

from sglang_psa.mem_cache.request_kv import RequestKV


class HostTierFull(RuntimeError):
    """A request needs more host blocks than it reserved and none are free."""


class HostBlocks:
    """Host-tier block ids: a free list, and requests' reservations against it (CPU only).

    A request's ids and its reservation live in its record (`RequestKV.host`, `.reserved`);
    this class keeps the free list and the sum of the reservations. A request reserves the
    blocks its whole length can fill when admitted, so a running request never finds the
    host tier full; it takes ids as its blocks fill (appended to `host`, in block order)
    and returns all of them when it ends (`free`). Ids come out smallest first (the free
    list stays sorted), so a prefill's blocks are runs that one strided copy moves.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self.reserved = 0  # ids promised to requests, not yet taken (their `reserved`, summed)

    @property
    def available(self) -> int:
        """Free ids not promised to a reservation."""
        return len(self._free) - self.reserved

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def reserve(self, rec: RequestKV, n: int) -> bool:
        """Promise `rec` `n` ids in all (those it holds and those already promised count)
        if the missing ones are free."""
        extra = n - len(rec.host) - rec.reserved
        if extra <= 0:
            return True
        if extra > self.available:
            return False
        self._promise(rec, extra)
        return True

    def take(self, rec: RequestKV, n: int) -> list[int]:
        """`n` ids for `rec`, from its reservation first, appended to `rec.host`."""
        if n == 0:
            return []
        from_res = min(n, rec.reserved)
        if n - from_res > self.available:
            raise HostTierFull(
                f"request {rec.rid} needs {n} host blocks beyond its reservation; "
                f"{self.available} free"
            )
        self._promise(rec, -from_res)
        ids = [self._free.pop() for _ in range(n)]
        rec.host.extend(ids)
        return ids

    def give_back(self, rec: RequestKV, keep: int) -> None:
        """`rec` keeps only its first `keep` ids (the saves of the others were dropped):
        the others return to the free list and stay promised to it."""
        ids = rec.host[keep:]
        if not ids:
            return
        del rec.host[keep:]
        self._put(ids)
        self._promise(rec, len(ids))

    def free(self, rec: RequestKV) -> int:
        """Every id and the reservation of `rec` return (it ended); the number of ids
        returned. A second call returns nothing."""
        self._promise(rec, -rec.reserved)
        ids, rec.host = rec.host, []
        self._put(ids)
        return len(ids)

    def _promise(self, rec: RequestKV, n: int) -> None:
        rec.reserved += n
        self.reserved += n

    def _put(self, ids: list[int]) -> None:
        if ids:
            self._free.extend(ids)
            self._free.sort(reverse=True)  # pop() gives the smallest: freed space re-forms runs

    def check_integrity(self, records: Iterable[RequestKV]) -> None:
        """Against every live request's record: each id is free or held by exactly one
        request, and the reservations sum to what the free list keeps back."""
        records = list(records)
        owned = [i for rec in records for i in rec.host]
        every = sorted(owned + self._free)
        assert every == list(range(self.num_blocks)), "a host block is lost or owned twice"
        assert all(rec.reserved >= 0 for rec in records)
        assert self.reserved == sum(rec.reserved for rec in records), "reservations drifted"
