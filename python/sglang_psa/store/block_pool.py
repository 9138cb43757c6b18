"""Host-pool block accounting: free list, reference counts, chained hashes for prefix sharing.

Every full KV block of a request is a host block id. Requests whose prompts
share a prefix share the blocks of that prefix: a full block is identified by
the hash of (previous block's hash, this block's tokens), so equal prefixes map
to equal chains. A shared block lives while any request (or the prefix cache)
holds a reference; allocation and freeing are O(1) per block. Running out of
blocks raises `PoolExhausted` for the request that asked and changes nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


class PoolExhausted(RuntimeError):
    """The host pool has fewer free blocks than a request needs; nothing was allocated."""


def chain_hash(prev: int | None, tokens: Sequence[int]) -> int:
    return hash((prev, tuple(tokens)))


@dataclass
class BlockTable:
    """One request's blocks in order; `hashes[i]` is the chain hash of full block i."""

    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class BlockPool:
    """`num_blocks` host blocks of `block_size` tokens each."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.by_hash: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def _chain(self, tokens: Sequence[int]) -> list[int | None]:
        """Per block of `tokens`: its chain hash if full, None for a partial tail."""
        hashes, prev = [], None
        for i in range(0, len(tokens), self.block_size):
            chunk = tokens[i : i + self.block_size]
            if len(chunk) == self.block_size:
                prev = chain_hash(prev, chunk)
                hashes.append(prev)
            else:
                hashes.append(None)
        return hashes

    def blocks_needed(self, tokens: Sequence[int]) -> int:
        """New blocks an `allocate(tokens)` would take, after prefix sharing."""
        return sum(h is None or h not in self.by_hash for h in self._chain(tokens))

    def can_allocate(self, tokens: Sequence[int]) -> bool:
        return self.blocks_needed(tokens) <= self.num_free

    def allocate(self, tokens: Sequence[int]) -> BlockTable:
        """Blocks for a prompt, reusing every full block of a known prefix chain."""
        if not self.can_allocate(tokens):
            raise PoolExhausted(
                f"need {self.blocks_needed(tokens)} host blocks, "
                f"{self.num_free} free of {self.num_blocks}"
            )
        table = BlockTable()
        for h in self._chain(tokens):
            if h is None:
                bid = self._take()  # partial tail: private until it fills
            else:
                bid = self.by_hash.get(h)
                if bid is None:
                    bid = self._take()
                    self.by_hash[h], self.hash_of[bid] = bid, h
                else:
                    self.ref[bid] += 1
                table.hashes.append(h)
            table.blocks.append(bid)
        return table

    def append_block(self, table: BlockTable) -> int:
        """A new private block at the end of `table` (decode crossed a block boundary)."""
        if not self.free:
            raise PoolExhausted(f"no free host block (pool of {self.num_blocks})")
        bid = self._take()
        table.blocks.append(bid)
        return bid

    def seal(self, table: BlockTable, tokens_of_last_block: Sequence[int]) -> None:
        """The tail block filled: give it its chain hash so later prompts can share it."""
        if len(tokens_of_last_block) != self.block_size:
            raise ValueError("only a full block can be sealed")
        if len(table.hashes) != len(table.blocks) - 1:
            raise ValueError("the table has no unsealed tail block")
        h = chain_hash(table.hashes[-1] if table.hashes else None, tokens_of_last_block)
        bid = table.blocks[-1]
        if h not in self.by_hash:
            self.by_hash[h], self.hash_of[bid] = bid, h
        table.hashes.append(h)

    def free_table(self, table: BlockTable) -> list[int]:
        """Drop the request's references; blocks nobody holds return to the free list.

        Returns those blocks, whose HBM slots the store must release too.
        """
        released = []
        for bid in table.blocks:
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                h = self.hash_of.pop(bid, None)
                if h is not None and self.by_hash.get(h) == bid:
                    del self.by_hash[h]
                self.free.append(bid)
                released.append(bid)
        table.blocks.clear()
        table.hashes.clear()
        return released

    def _take(self) -> int:
        bid = self.free.popleft()
        self.ref[bid] = 1
        return bid

    def check_integrity(self, tables: Sequence[BlockTable] = ()) -> None:
        """Invariants; with all live `tables`, also that reference counts match them."""
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        for bid in range(self.num_blocks):
            assert (self.ref[bid] == 0) == (bid in free), f"block {bid}: ref {self.ref[bid]}"
            assert self.ref[bid] >= 0
        for h, bid in self.by_hash.items():
            assert self.ref[bid] > 0 and self.hash_of.get(bid) == h, f"stale hash for {bid}"
        if tables:
            counts = [0] * self.num_blocks
            for t in tables:
                for bid in t.blocks:
                    counts[bid] += 1
            assert counts == self.ref, "reference counts differ from the live tables"
