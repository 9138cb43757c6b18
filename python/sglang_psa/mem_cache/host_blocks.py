"""Host-tier block ids: a free list with per-request reservations (`HostBlocks`)."""

from __future__ import annotations


class HostTierFull(RuntimeError):
    """A request needs more host blocks than it reserved and none are free."""


class HostBlocks:
    """Host-tier block ids: a free list with per-request reservations (CPU only).

    A request reserves the blocks its whole length can fill when admitted, so a
    running request never finds the host tier full; it takes ids as its blocks
    fill and returns all of them when it ends. Ids come out smallest first (the free
    list stays sorted), so a prefill's blocks are runs that one strided copy moves.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._reserved: dict[object, int] = {}  # rid -> ids reserved, not yet taken
        self._owned: dict[object, list[int]] = {}

    @property
    def available(self) -> int:
        """Free ids not promised to a reservation."""
        return len(self._free) - sum(self._reserved.values())

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def reserve(self, rid, n: int) -> bool:
        """Promise `rid` `n` ids in all (those it owns and holds reserved count) if the
        missing ones are free."""
        extra = n - len(self._owned.get(rid, ())) - self._reserved.get(rid, 0)
        if extra <= 0:
            return True
        if extra > self.available:
            return False
        self._reserved[rid] = self._reserved.get(rid, 0) + extra
        return True

    def give_back(self, rid, ids: list[int]) -> None:
        """`rid` no longer uses `ids` (blocks whose saves were dropped): they return to the
        free list and stay promised to `rid`."""
        if not ids:
            return
        owned = self._owned[rid]
        drop = set(ids)
        owned[:] = [i for i in owned if i not in drop]
        self._free.extend(ids)
        self._free.sort(reverse=True)
        self._reserved[rid] = self._reserved.get(rid, 0) + len(ids)

    def take(self, rid, n: int) -> list[int]:
        """`n` ids for `rid`, from its reservation first."""
        if n == 0:
            return []
        from_res = min(n, self._reserved.get(rid, 0))
        if n - from_res > self.available:
            raise HostTierFull(
                f"request {rid} needs {n} host blocks beyond its reservation; {self.available} free"
            )
        if from_res:
            self._reserved[rid] -= from_res
        ids = [self._free.pop() for _ in range(n)]
        self._owned.setdefault(rid, []).extend(ids)
        return ids

    def release(self, rid) -> int:
        """Return every id and reservation of `rid`; the number of ids returned."""
        self._reserved.pop(rid, None)
        ids = self._owned.pop(rid, [])
        if ids:
            self._free.extend(ids)
            self._free.sort(reverse=True)  # pop() gives the smallest: freed space re-forms runs
        return len(ids)

    def check_integrity(self) -> None:
        owned = [i for ids in self._owned.values() for i in ids]
        every = sorted(owned + self._free)
        assert every == list(range(self.num_blocks)), "a host block is lost or owned twice"
        assert all(v >= 0 for v in self._reserved.values())
