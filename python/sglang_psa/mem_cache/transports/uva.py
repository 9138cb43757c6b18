"""`uva` transport: one kernel writes a job's blocks into the host tier through unified
addressing, on the copy stream; a CUDA event is the acknowledgement (no engine process)."""

from __future__ import annotations

from collections import deque

import torch

from sgl_kernel_ext.unit_cache import LayerOffsetCache
from sgl_kernel_ext.writeback import copy_layers_to_units
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
        # The pool's per-layer element offsets, made once (the copy stream waits for the
        # compute stream, which copies them, before the launch that reads them).
        self._layer_offsets = LayerOffsetCache()

    def _new_job_id(self) -> int:
        job_id, self._next_uva = self._next_uva, self._next_uva + 1
        return job_id

    def issue_layers(self, k_bufs, v_bufs, tables: torch.Tensor, entries, plan=None) -> None:
        """Every layer's blocks in one launch of the kernel and one event, acknowledged
        as one job of the last layer (whose acknowledgement is what counts a block
        saved): a save costs the host one launch, not one a layer."""
        job_id = self._new_job_id()
        offsets = self._layer_offsets(k_bufs, v_bufs, self.device)
        done = self._on_copy_stream(
            tables,
            lambda: copy_layers_to_units(
                k_bufs,
                v_bufs,
                tables[0],
                self.host.k,
                self.host.v,
                tables[1],
                programs=self._programs,
                offsets=offsets,
            ),
        )
        self._issued(job_id, len(k_bufs) - 1, done, entries)

    @property
    def _programs(self) -> int | None:
        return UVA_PROGRAMS if self.cuda else None

    def _on_copy_stream(self, tables: torch.Tensor, launch):
        """Run `launch` behind the compute stream on the copy stream; returns the event
        marking its end (None on CPU, where it ran in place)."""
        if not self.cuda:
            launch()
            return None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            launch()
            done = self._gathered = torch.cuda.Event()  # the save's end is the gather's
            done.record(self.stream)
        tables.record_stream(self.stream)
        return done

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
