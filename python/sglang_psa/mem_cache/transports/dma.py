"""`dma` transport (the `uva` path with a device staging): a prefill batch's blocks whose
host blocks form runs are gathered, every layer at once, into the staging, then copied into
the host tier on the GPU's copy engines, per run one strided copy of every (layer, KV head)
slab's K and one of V (no SMs taken from the forward); scattered blocks and decode flushes
go through the uva save kernel."""

from __future__ import annotations

import contextlib

import torch

from sgl_kernel_ext.writeback import copy_layers_to_units
from sglang_psa.mem_cache.strided_copy import StridedCopy
from sglang_psa.mem_cache.transports.base import HOST
from sglang_psa.mem_cache.transports.uva import UvaTransport

# A prefill job moves by DMA when it takes at most this many copies.
DMA_MAX_COPIES = 32
# The device staging holds a job's blocks of every layer, K and V: at most this many bytes,
# outside SGLang's KV budget (a job then takes fewer blocks: at 32-token blocks, 16 at
# Llama-3.1-8B's shape, 170 at Qwen2.5-0.5B's, whose 8K-token chunks take two jobs).
DMA_STAGING_BYTES = 64 << 20


def host_runs(entries) -> list[tuple[int, int, int]]:
    """`(first entry, first host block, length)` of each run of consecutive host blocks
    in `entries` (in their order)."""
    runs: list[tuple[int, int, int]] = []
    for i, e in enumerate(entries):
        if runs and runs[-1][1] + runs[-1][2] == e[HOST]:
            i0, h0, n = runs[-1]
            runs[-1] = (i0, h0, n + 1)
        else:
            runs.append((i, e[HOST], 1))
    return runs


class DmaTransport(UvaTransport):
    """The uva transport plus a device staging of every layer's blocks of a job (at most
    `blocks` blocks, and at most `DMA_STAGING_BYTES`) for DMA jobs; both kinds of job
    complete in issue order on the copy stream, each marked by an event."""

    def __init__(self, *args, blocks: int):
        super().__init__(*args)
        L, H = self.host.layers, self.heads
        block_bytes = 2 * L * H * self.block_size * self.head_dim * self.host.k.element_size()
        self.dma_blocks = max(1, min(blocks, DMA_STAGING_BYTES // block_bytes))
        self._device_staging(L * self.dma_blocks * self.block_size)
        self._order = torch.arange(self.dma_blocks, device=self.device)  # a job's staging order
        self._copy2d = StridedCopy(self.device)

    @property
    def dma_copy(self) -> str:
        return self._copy2d.api

    def plan(self, entries) -> list[tuple[int, int, list | None]]:
        """A prefill batch's slices `[i, j)` of at most a staging's blocks, each with its
        runs of host blocks if DMA moves it (None: the save kernel does, for more than
        `DMA_MAX_COPIES` copies)."""
        step = self.dma_blocks
        rows = 1 if self._copy2d.api == "memcpy2d" else self.host.layers * self.heads
        plan = []
        for i in range(0, len(entries), step):
            runs = host_runs(entries[i : i + step])
            plan.append((i, i + step, runs if 2 * len(runs) * rows <= DMA_MAX_COPIES else None))
        return plan

    def issue_layers(self, k_bufs, v_bufs, tables: torch.Tensor, entries, plan=None) -> None:
        """`plan` (prefill batches): each slice by DMA or the save kernel, every layer at
        once; decode flushes (no plan) never by DMA (a gather and copies cost the step
        more host time than the save kernel's one launch)."""
        if plan is None:
            return super().issue_layers(k_bufs, v_bufs, tables, entries)
        for i, j, runs in plan:
            part, t = entries[i:j], tables[:, i:j]
            if runs is not None:
                self._issue_dma(k_bufs, v_bufs, t, part, runs)
            else:
                super().issue_layers(k_bufs, v_bufs, t, part)

    def _issue_dma(self, k_bufs, v_bufs, tables: torch.Tensor, entries, runs) -> None:
        """A job of a few runs of host blocks, at most a staging's: one gather of every
        layer into the staging (`[layers, heads, blocks, bs, head_dim]`), then per run one
        strided DMA copy of every (layer, head) slab's K and one of V (`StridedCopy`), all
        on the copy stream (which orders the next job's gather after these copies); an
        event marks the save complete, acknowledged as one job of the last layer."""
        job_id = self._new_job_id()
        L, H, n = len(k_bufs), self.heads, len(entries)
        unit = self.block_size * self.head_dim  # elements of one head's block
        size = L * H * n * unit
        dk = self._stage_k[:size].view(L, H, n, self.block_size, self.head_dim)
        dv = self._stage_v[:size].view_as(dk)
        offsets = self._layer_offsets(k_bufs, v_bufs, self.device)
        done = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            order = self._order[:n]
            copy_layers_to_units(k_bufs, v_bufs, tables[0], dk, dv, order, offsets=offsets)
            if self.cuda:
                self._gathered = torch.cuda.Event()  # the pages are free again after this
                self._gathered.record(self.stream)
            for i0, h0, m in runs:
                for host, stage in ((self.host.k, dk), (self.host.v, dv)):
                    self._copy2d(
                        host.view(L * H, -1)[:, h0 * unit : (h0 + m) * unit],
                        stage.view(L * H, -1)[:, i0 * unit : (i0 + m) * unit],
                        self.stream,
                    )
            if self.cuda:
                done = torch.cuda.Event()
                done.record(self.stream)
        if self.cuda:
            tables.record_stream(self.stream)
        self._issued(job_id, L - 1, done, entries)
        self.stats.dma_jobs += 1
