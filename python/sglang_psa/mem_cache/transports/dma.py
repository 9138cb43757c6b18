"""`dma` transport (the `uva` path with a device staging): a prefill job whose host blocks
form runs is gathered into the staging, then copied into the host tier on the GPU's copy
engines, per run one strided copy of every KV head's K and one of V (no SMs taken from
the forward); scattered blocks and decode flushes go through the uva save kernel."""

from __future__ import annotations

import contextlib

import torch

from sgl_kernel_ext.writeback import gather_pages_head_major
from sglang_psa.mem_cache.strided_copy import StridedCopy
from sglang_psa.mem_cache.transports.uva import UvaTransport

# A prefill job moves by DMA when it takes at most this many copies.
DMA_MAX_COPIES = 32


def host_runs(entries) -> list[tuple[int, int, int]]:
    """`(first entry, first host block, length)` of each run of consecutive host blocks
    in `entries` (in their order)."""
    runs: list[tuple[int, int, int]] = []
    for i, e in enumerate(entries):
        if runs and runs[-1][1] + runs[-1][2] == e.host:
            i0, h0, n = runs[-1]
            runs[-1] = (i0, h0, n + 1)
        else:
            runs.append((i, e.host, 1))
    return runs


class DmaTransport(UvaTransport):
    """The uva transport plus a device staging of `blocks` blocks for DMA jobs; both
    kinds of job complete in issue order on the copy stream, each marked by an event."""

    def __init__(self, *args, blocks: int):
        super().__init__(*args)
        self.dma_blocks = blocks
        self._device_staging(blocks * self.block_size)
        self._order = torch.arange(blocks, device=self.device)  # a job's staging order
        self._copy2d = StridedCopy(self.device)

    @property
    def dma_copy(self) -> str:
        return self._copy2d.api

    def plan(self, entries) -> list[tuple[int, int, list | None]]:
        """A prefill job's slices `[i, j)` of at most a staging's blocks, each with its
        runs of host blocks if DMA moves it (None: the save kernel does, for more than
        `DMA_MAX_COPIES` copies)."""
        step = self.dma_blocks
        plan = []
        for i in range(0, len(entries), step):
            runs = host_runs(entries[i : i + step])
            copies = 2 * len(runs) * (1 if self._copy2d.api == "memcpy2d" else self.heads)
            plan.append((i, i + step, runs if copies <= DMA_MAX_COPIES else None))
        return plan

    def issue(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries, plan=None) -> None:
        """`plan` (prefill chunks): each slice by DMA or the save kernel; decode flushes
        (no plan) never by DMA (their copies and gathers per layer cost the step more
        host time than one launch)."""
        if plan is None:
            return super().issue(layer, k_buf, v_buf, tables, entries)
        for i, j, runs in plan:
            part, t = entries[i:j], tables[:, i:j]
            if runs is not None:
                self._issue_dma(layer, k_buf, v_buf, t, part, runs)
            else:
                super().issue(layer, k_buf, v_buf, t, part)

    def _issue_dma(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries, runs) -> None:
        """A job of a few runs of host blocks, at most a staging's: one gather into the
        staging, then per run one strided DMA copy of every head's K and one of V
        (`StridedCopy`), all on the copy stream (which orders the next job's gather after
        these copies); an event marks the save complete."""
        job_id = self._new_job_id()
        hk, hv = self.host.k[layer], self.host.v[layer]
        bs, H = self.block_size, self.heads
        dk, dv = self._staging_views(len(entries) * bs)
        done = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            order = self._order[: len(entries)]
            gather_pages_head_major(k_buf, v_buf, tables[0], dk, dv, bs, order)
            if self.cuda:
                self._gathered = torch.cuda.Event()  # the pages are free again after this
                self._gathered.record(self.stream)
            for i0, h0, m in runs:
                rows = slice(i0 * bs, (i0 + m) * bs)
                for host, stage in ((hk, dk), (hv, dv)):
                    self._copy2d(
                        host[:, h0 : h0 + m].view(H, -1), stage[:, rows].view(H, -1), self.stream
                    )
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.stream)
        if self.cuda:
            tables.record_stream(self.stream)
        self._issued(job_id, layer, done, entries)
        self.stats.dma_jobs += 1
