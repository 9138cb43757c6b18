"""The load half of the pipeline: bring KV units into HBM slots on a copy stream.

While wave k attends its blocks on the compute stream, `load()` admits and
gathers wave k+1's missing units on the loader's own CUDA stream; the compute
stream waits for exactly that work through an event (`Ticket.wait()`), never
for the whole device. A wave's units are pinned until the compute stream has
finished with them (`release()` orders the unpin after the consumer's event),
so a concurrent prefetch can never evict a slot a running kernel reads. The
same call, unpinned, prefetches a request's working set before its step.

All slot-table updates go through one loader, so they are ordered on its
stream. Without CUDA everything runs in program order on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_psa.store.slot_store import SlotStore
from sglang_psa.store.slot_table import Acquired


@dataclass
class Ticket:
    got: Acquired
    done: torch.cuda.Event | None

    @property
    def slots(self) -> torch.Tensor:
        return self.got.slots

    def wait(self) -> None:
        """Order the current stream after this load (no host wait)."""
        if self.done is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.done)
        for t in (self.got.slots, self.got.miss_units, self.got.miss_slots, self.got.n_miss):
            t.record_stream(stream)


class Loader:
    def __init__(self, store: SlotStore):
        self.store = store
        self.stream = torch.cuda.Stream(store.device) if store.device.type == "cuda" else None

    def load(self, units: torch.Tensor, pin: bool = True) -> Ticket:
        """Start making distinct global `units` resident; pinned until `release()` if `pin`.

        The load starts after the work queued so far on the current stream (which
        produced `units`), so call it before queueing the wave it should overlap:
        rank, `load(next wave)`, attend the current wave.
        """
        if self.stream is None:
            return Ticket(self.store.promote_units(units, pin), None)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            units.record_stream(self.stream)
            got = self.store.promote_units(units, pin)
            done = torch.cuda.Event()
            done.record(self.stream)
        return Ticket(got, done)

    def prefetch(self, units: torch.Tensor) -> Ticket:
        """Working-set prefetch: load without pinning, so it only uses what LRU can spare."""
        return self.load(units, pin=False)

    def release(self, ticket: Ticket) -> None:
        """Unpin a wave's slots once the work queued so far on the current stream is done."""
        if self.stream is None:
            self.store.table.unpin(ticket.slots)
            return
        consumer = torch.cuda.Event()
        consumer.record(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(consumer)
            self.store.table.unpin(ticket.slots)

    def synchronize(self) -> None:
        """Host wait for all loads (tests, shutdown), then surface a slot overflow."""
        if self.stream is not None:
            self.stream.synchronize()
        self.store.table.check()
