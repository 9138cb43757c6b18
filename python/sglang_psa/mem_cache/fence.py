"""Orders the scheduler's rewrites of the unit cache and the location table after the
decode step that reads them (the tiered home).

SGLang lets its scheduler's stream run ahead of a decode graph's replay: the stream waits
only for the graph's pre-replay snapshot (0.5.17's read-done event; 0.5.23's in-replay
reads), which covers what SGLang's own backends read. The psa decode graph reads more
during its replay: the unit cache's tables and slot pages in every layer, and the
location table at its start. Eviction is written to be read at any moment (stamps, then
location tables, then request tables, each a complete copy: `Residency.evict_many`), but
the unit cache is not: a slot refilled while a layer reads it would hand that layer
another unit's keys. So each decode launch *arms* the fence with its stream (host side,
`arm`), and every writer of those tables calls the fence first: the first such write of a
scheduling round makes the writing stream wait for the whole step (`wait_stream`, no
host sync), later ones pass. A round that writes none (nothing evicted, no request
released: a steady decode with HBM to spare) keeps SGLang's fast path; before, the tiered
home always waited for the whole step.

Writers: `UnitCache` (grow, shrink, refresh, mark_evicted, forget), `WriteBack`
(read_many_from_host, leave_row) and `Residency.evict_many`. On the CPU it does nothing.
"""

from __future__ import annotations

import torch


class TableFence:
    """`arm(stream)` at each decode launch; `fence()` before each rewrite."""

    def __init__(self):
        self._stream: torch.cuda.Stream | None = None
        self.calls = 0  # rewrites announced, armed or not (tests, diagnostics)
        self.waits = 0  # of those, the ones that waited for a step

    def arm(self, stream) -> None:
        """A decode step was launched on `stream` (None: on the CPU, nothing to order)."""
        self._stream = stream

    def __call__(self) -> None:
        """The caller is about to rewrite a table the last decode step may still read: the
        current stream waits for that step, once per armed step."""
        self.calls += 1
        stream, self._stream = self._stream, None
        if stream is None:
            return
        torch.cuda.current_stream(stream.device).wait_stream(stream)
        self.waits += 1
