"""What SGLang's prefill adder charges a request against HBM, as plain arithmetic.

The tiered home makes room (saved blocks leave HBM) before SGLang's adder checks its
token budget; these functions say how much room that check will want. They take numbers,
not SGLang objects: `plugin.scheduling` reads them from SGLang's request and adder.
Tokens throughout; `clip` is SGLang's cap on the output it charges up front
(`CLIP_MAX_NEW_TOKENS`), `reserve` what its strict path keeps per running request
(`IGNORE_EOS_RESERVE_TOKENS`).
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Demand(NamedTuple):
    """A request as the adder's strict path plays it forward."""

    left: float  # output tokens still to come (scaled by the adder's new-token ratio)
    held: int  # tokens it holds now (prompt and output so far)


def stored_tokens(prompt: int, done: int, prefix: int) -> int:
    """The tokens a request's prefill stores in HBM: its prompt and the `done` output of a
    retracted request, less a `prefix` it does not store (a resumed request's, kept in the
    host tier)."""
    return prompt + done - prefix


def held_tokens(prompt: int, done: int, prefix: int, max_new: int, clip: int) -> int:
    """The tokens the adder charges a request: what its prefill stores (`stored_tokens`)
    and its output still to come, clipped."""
    return stored_tokens(prompt, done, prefix) + min(max(max_new - done, 0), clip)


def budget_shortfall(fill: int, max_new: int, slack: int, rem_total: int, clip: int) -> int:
    """Tokens the adder's budget `rem_total` lacks for a prefill storing `fill` tokens:
    once added, the whole clipped `max_new` is charged, whatever is done; `slack` spare
    for page alignment. Negative: room to spare."""
    return fill + min(max_new, clip) + slack - rem_total


def strict_shortfall(
    fill: int, slack: int, demands: list[Demand], cur_rem: int, reserve: int
) -> int:
    """Tokens the free pages `cur_rem` lack on the strict path (`ignore_eos` with prefix
    caching off): every request (`demands`: the new one, the running ones, those added
    this round) is played forward to the end of its output, shortest first, each freeing
    what it holds as it ends, and the new prefill of `fill` tokens is admitted only if the
    free tokens never run out on the way: while the i shortest have ended, the others each
    still need their output and `reserve` more."""
    live = sorted((d for d in demands if d.left > 0), key=lambda d: d.left)
    need, ended, n = 0.0, 0, len(live)
    for i, d in enumerate(live):
        need = max(need, fill + slack - ended + (d.left + reserve) * (n - i))
        ended += d.held
    return math.ceil(need) + 1 - cur_rem


def room_needed(short: int, strict: int | None) -> tuple[int, int]:
    """`(short, reserve)` for `make_room`: the larger shortfall, and how much of it only
    feeds the strict path's reservation for output to come (pages nothing takes before
    the next round, so they may come from the unit cache, which grows back into them).
    `strict` None: not the strict path."""
    if strict is None:
        return short, 0
    return max(short, strict), max(strict - max(short, 0), 0)
