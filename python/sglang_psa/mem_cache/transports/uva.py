"""`uva` transport: one kernel writes a job's blocks into the host tier through unified
addressing, on the copy stream; a CUDA event is the acknowledgement (no engine process)."""

from __future__ import annotations

from collections import deque

import torch

from sgl_kernel_ext.writeback import copy_pages_to_units
from sglang_psa.mem_cache.transports.base import Transport

# Persistent programs of the uva path's save kernel: enough to keep PCIe busy, few enough
# to leave the other SMs to the forward it overlaps.
UVA_PROGRAMS = 16


class UvaTransport(Transport):
    """Jobs complete in issue order: a job is saved once its event (None: already, on
    CPU) has completed."""

    def __init__(self, *args):
        super().__init__(*args)
        self._uva: deque[tuple[object, int]] = deque()  # (event or None, job id), in order
        self._next_uva = 0

    def _new_job_id(self) -> int:
        job_id, self._next_uva = self._next_uva, self._next_uva + 1
        return job_id

    def issue(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries, plan=None) -> None:
        """One kernel writes the blocks into the host tier; an event marks the save
        complete."""
        job_id = self._new_job_id()
        hk, hv = self.host.k[layer], self.host.v[layer]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_pages_to_units(
                    k_buf, v_buf, tables[0], hk, hv, tables[1], programs=UVA_PROGRAMS
                )
                done = self._gathered = torch.cuda.Event()  # the save's end is the gather's
                done.record(self.stream)
            tables.record_stream(self.stream)
        else:
            copy_pages_to_units(k_buf, v_buf, tables[0], hk, hv, tables[1])
            done = None
        self._issued(job_id, layer, done, entries)

    def _issued(self, job_id: int, layer: int, done, entries) -> None:
        """A job issued: saved once `done` (its CUDA event; None: already) has
        completed."""
        self.jobs[job_id] = (layer, entries)
        self._uva.append((done, job_id))
        self.stats.jobs += 1

    def _retire(self, job_id: int) -> None:
        layer, entries = self.jobs.pop(job_id)
        self.saved(layer, entries)

    def poll(self) -> None:
        """A job is saved once its event has completed."""
        while self._uva and (self._uva[0][0] is None or self._uva[0][0].query()):
            self._retire(self._uva.popleft()[1])

    def _wait(self, job_id: int) -> None:
        while job_id in self.jobs:
            event = self._uva[0][0]
            if event is not None:
                event.synchronize()
            self._retire(self._uva.popleft()[1])
