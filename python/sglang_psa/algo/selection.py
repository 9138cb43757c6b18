"""Reference of the per-step slot map of a selection kept across decode steps.

Spec of `sgl_kernel_ext.selection` (the `assign` kernel): which batch rows rank this
step and where each row's kept read order lives. The read order itself is
`sglang_psa.algo.attention.reuse_order`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_NEW_BLOCKS = 4  # a kept order serves a request that gained at most this many blocks


@dataclass
class SlotState:
    """Slots `[0, C - 1)` hold requests: `tag` (request-table row, -1 free) and `ranked`
    (its blocks when it ranked); slot `C - 1` is scratch."""

    tag: list[int]
    ranked: list[int]


def assign_slots(
    state: SlotState,
    rows: list[int],
    lengths: list[int],
    step: int,
    interval: int,
    short_blocks: int,
    block_size: int,
) -> tuple[list[int], list[int], list[int]]:
    """`(slot, fresh, nbr)` per batch row, updating `state` as the kernel does.

    A row of more than `short_blocks` blocks keeps the slot tagged with its request
    row, else takes the first free slot (free: held by no row of this batch), in batch
    order. It ranks (`fresh`) on steps where `step % interval == 0`, when it had no
    slot, or when its blocks shrank or grew by more than `MAX_NEW_BLOCKS` since it
    ranked. Short rows (all blocks forced) take the scratch slot and never rank. `nbr`:
    the blocks at ranking time (a fresh or short row: its blocks now)."""
    C = len(state.tag)
    nbs = [-(-n // block_size) for n in lengths]
    long = [n > short_blocks for n in nbs]
    held = {t: s for s, t in enumerate(state.tag[: C - 1]) if t >= 0}
    used = {held[r] for r, lg in zip(rows, long) if lg and r in held}
    free = [s for s in range(C - 1) if s not in used]
    every = step % interval == 0
    tags0, ranked0 = list(state.tag), list(state.ranked)
    slots, fresh, nbr = [], [], []
    for r, nb, lg in zip(rows, nbs, long):
        if not lg:
            slots.append(C - 1)
            fresh.append(0)
            nbr.append(nb)
            continue
        has = r in held
        s = held[r] if has else free.pop(0)
        kept = ranked0[s]
        f = every or not has or nb < kept or nb - kept > MAX_NEW_BLOCKS
        slots.append(s)
        fresh.append(int(f))
        nbr.append(nb if f else kept)
        if f:
            tags0[s], ranked0[s] = r, nb
    state.tag[:], state.ranked[:] = tags0, ranked0
    return slots, fresh, nbr


def invalidate(state: SlotState, rows: torch.Tensor | list[int]) -> None:
    """Requests in request-table `rows` are prefilled: their slots are freed."""
    gone = set(int(r) for r in rows)
    state.tag[:] = [-1 if t in gone else t for t in state.tag]
