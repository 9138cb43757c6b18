"""Working sets counted on the GPU and read by the scheduler a step later, without a sync.

Every (layer, KV head, page) keeps the decode step that last read it (the wave
kernel writes these stamps as it reads). A request's working set is the number
of its own blocks stamped within the last `window` steps. At the start of each
decode step, inside the step's CUDA graph, one kernel counts it for the batch
(`sgl_kernel_ext.working_set`), the sizes and the lengths they were measured at
are stored by request-table row, and one copy moves them to pinned host memory.
The scheduler reads that memory whenever it likes: a value is at most a step or
two old, never waited for, and a row whose length does not match its request's
(a new request in a reused row) is ignored. Pages shared through prefix caching
carry one stamp, so a shared page read by one request counts for all holders:
conservative for admission. At the tiered home a host block has a stamp row of
its own beside the pages' (`num_pages` counts both), as it has block metadata,
and each step also publishes the heat of every block of the batch: how many
(layer, KV head) units read it within the last `HEAT_WINDOW` steps
(`sgl_kernel_ext.working_set.block_readers`), by request-table row and block,
as one byte. Residency keeps the pages most units read in HBM by it.
"""

from __future__ import annotations

import numpy as np
import torch

from sgl_kernel_ext.working_set import block_readers, working_set_parts

HEAT_WINDOW = 4  # steps over which a block's readers are counted


class ReadStamps:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        num_pages: int,
        window: int,
        rows: int,
        block_size: int,
        device: torch.device | str,
        heat_blocks: int = 0,
    ):
        dev = torch.device(device)
        self.layers, self.kv_heads, self.num_pages = layers, kv_heads, num_pages
        self.window, self.block_size = window, block_size
        self.stamps = torch.zeros(layers * kv_heads, num_pages, dtype=torch.int32, device=dev)
        # The decode step counter, on the device (the graph advances it).
        self.step = torch.zeros(1, dtype=torch.int32, device=dev)
        # By request-table row: working-set size, and the length it was measured at.
        self._dev = torch.zeros(2, rows, dtype=torch.int32, device=dev)
        self._host = torch.zeros(2, rows, dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._bufs: dict[int, tuple[torch.Tensor, ...]] = {}
        self._scratch: list[torch.Tensor] = []
        # Heat (tiered home): block readers by request-table row and block.
        self.heat_blocks = heat_blocks
        if heat_blocks:
            pin = dev.type == "cuda"
            # The last batch's heat by batch position, its rows and its size (host memory).
            self._heat_host = torch.zeros(rows, heat_blocks, dtype=torch.uint8, pin_memory=pin)
            self._heat_rows = torch.full((rows,), -1, dtype=torch.int64, pin_memory=pin)
            self._heat_count = torch.zeros(1, dtype=torch.int64, pin_memory=pin)
            self._counts: dict[int, torch.Tensor] = {}  # batch size -> that size, on device

    @property
    def bytes(self) -> int:
        """GPU bytes held: stamps, step counter, sizes by row, per-batch-size scratch."""
        ts = [self.stamps, self.step, self._dev, *(t for b in self._bufs.values() for t in b[:2])]
        ts += self._scratch
        if self.heat_blocks:
            ts += list(self._counts.values())
        return sum(t.numel() * t.element_size() for t in ts)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The stamps of rows `src` (pages) to rows `dst` (int64 device tensors)."""
        self.stamps.index_copy_(1, dst, self.stamps.index_select(1, src))

    def layer_stamps(self, layer: int) -> torch.Tensor:
        """`[Hkv, pages]` stamps of one layer (what the wave kernel writes)."""
        H = self.kv_heads
        return self.stamps[layer * H : (layer + 1) * H]

    def _buffers(self, batch: int):
        got = self._bufs.get(batch)
        if got is None:
            LH = self.layers * self.kv_heads
            dev = self.stamps.device
            got = (
                torch.zeros(batch, LH, dtype=torch.int32, device=dev),
                torch.zeros(batch, dtype=torch.int32, device=dev),
                self._heat_scratch(batch * self.heat_blocks),
            )
            self._bufs[batch] = got
        return got

    def _heat_scratch(self, n: int) -> torch.Tensor:
        """A view of one uint8 scratch shared by every batch size (the blocks' readers,
        capped at 255). A larger batch allocates a larger one; the old stays alive, since
        graphs captured with it hold its address (SGLang captures the largest batch
        first)."""
        if not self._scratch or self._scratch[-1].numel() < n:
            self._scratch.append(torch.zeros(n, dtype=torch.uint8, device=self.stamps.device))
        return self._scratch[-1][:n]

    def begin_step(self, rows: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor) -> None:
        """Measure the batch's working sets as of the last step, publish them to the host
        copy, then advance the step counter. Fixed shapes, no sync: graph-recordable."""
        parts, sizes, heat8 = self._buffers(pages.shape[0])
        working_set_parts(
            self.stamps, pages, lengths, self.step, self.window, self.block_size, parts
        )
        torch.sum(parts, 1, dtype=torch.int32, out=sizes)
        rows = rows.long()
        self._dev[0].index_copy_(0, rows, sizes)
        self._dev[1].index_copy_(0, rows, lengths.to(torch.int32))
        self._host.copy_(self._dev, non_blocking=True)
        if self.heat_blocks:
            self._publish_heat(rows, pages, heat8)
        self.step.add_(1)

    def _publish_heat(self, rows, pages: torch.Tensor, heat8: torch.Tensor) -> None:
        """Readers of the batch's blocks `pages [B, NB]` (units that read each within the
        last `HEAT_WINDOW` steps, up to 255) to the host by batch position, then the
        batch's rows, then its size: `B x NB` bytes a step. Preallocated buffers, no
        sync."""
        B = pages.shape[0]
        count = self._counts.get(B)
        if count is None:
            count = self._counts[B] = torch.full((1,), B, dtype=torch.int64, device=rows.device)
        block_readers(self.stamps, pages, self.step, HEAT_WINDOW, heat8.view(pages.shape))
        self._heat_host[:B].copy_(heat8.view(pages.shape), non_blocking=True)
        self._heat_rows[:B].copy_(rows, non_blocking=True)
        self._heat_count.copy_(count, non_blocking=True)

    def mark(self, layer: int, pages: torch.Tensor, read: torch.Tensor) -> None:
        """Reference path (the kernel stamps as it reads): `read [B, Hkv, NB]` blocks of
        `pages [B, NB]` were read by `layer` in this step."""
        stamps = self.layer_stamps(layer)
        heads = torch.arange(self.kv_heads, device=pages.device)[None, :, None]
        idx = heads * self.num_pages + pages.long()[:, None, :]
        flat = stamps.view(-1)
        flat.index_put_((idx[read],), self.step.expand(int(read.sum())))

    def reset(self) -> None:
        """Forget every stamp and measurement (after CUDA-graph warmup on dummy batches)."""
        self.stamps.zero_()
        self._dev.zero_()
        self._host.zero_()
        if self.heat_blocks:
            self._heat_host.zero_()
            self._heat_rows.fill_(-1)
            self._heat_count.zero_()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`(sizes, lengths)` by request-table row, as last published (host memory; no
        sync, possibly a step old; length 0: never measured)."""
        return self._host[0], self._host[1]

    def heat(self) -> dict[int, np.ndarray]:
        """Request-table row -> `[blocks]` uint8 readers of the blocks of the request in
        that row, for every row the last batch held, as it published them (host memory,
        no sync; read once per decision, not once per row). Trust a row's only where
        `read()`'s length matches the request."""
        n = int(self._heat_count[0])
        heat = self._heat_host.numpy()
        return {row: heat[i] for i, row in enumerate(self._heat_rows[:n].tolist())}


class ReadCounters:
    """What decode read, counted on the GPU: per layer, the (layer, KV head, block) units
    read, the units readable and those read from the host tier (`stats [layers, 3]`, the
    wave kernel adds to its layer's row). The scheduler reads them without a sync through
    a pinned copy that trails by one call; `totals` and `read_fraction` sync (server info
    only). With `audit` (`--psa-audit-coverage`), `coverage [2]` float64 keeps the
    smallest true-mass share a query head's read blocks held and how many heads were
    checked (`attention.coverage_audit` writes it). `ranks [2]`: decode steps' rows that
    scored and ranked their blocks and rows that held a kept selection
    (`SelectionCache.assign` adds to it)."""

    def __init__(self, layers: int, device: torch.device | str, audit: bool = False):
        dev = torch.device(device)
        self.stats = torch.zeros(layers, 3, dtype=torch.int64, device=dev)
        self.ranks = torch.zeros(2, dtype=torch.int64, device=dev)
        self._host = torch.zeros(3, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.coverage = torch.empty(2, dtype=torch.float64, device=dev) if audit else None
        self.reset()

    @property
    def bytes(self) -> int:
        extra = 0 if self.coverage is None else self.coverage.numel() * 8
        return (self.stats.numel() + self.ranks.numel()) * self.stats.element_size() + extra

    def coverage_report(self) -> dict | None:
        """`--psa-audit-coverage`'s result so far (syncs; server info only): the smallest
        share of a query head's true softmax mass its read blocks held (None before any
        step) and the (query head, step, layer) triples checked; None without the audit."""
        if self.coverage is None:
            return None
        low, heads = self.coverage.tolist()
        return {"min_true_coverage": low if heads else None, "heads_checked": int(heads)}

    def read_counts(self) -> tuple[int, int]:
        """(units read, units readable) over all layers as of an earlier call, without a
        sync: returns the last copy and starts the next one (the metrics' refresh)."""
        read, total, _ = self._published()
        return read, total

    def unit_reads(self) -> tuple[int, int]:
        """(units read from HBM, units read from the host tier) over all layers, like
        `read_counts`: the last copy, and the next one started."""
        read, _, host = self._published()
        return read - host, host

    def _published(self) -> tuple[int, int, int]:
        """The per-layer counters summed as last copied to pinned memory (no sync), and
        the next copy started."""
        got = tuple(int(x) for x in self._host.tolist())
        self._host.copy_(self.stats.sum(0), non_blocking=True)
        return got

    def totals(self) -> tuple[int, int]:
        """(units read, units readable) by decode so far, over all layers (syncs; server
        info only): a client takes the difference of two to measure a window."""
        read, total, _ = (int(x) for x in self.stats.sum(0).tolist())
        return read, total

    def by_layer(self) -> dict[str, list[int]]:
        """Units decode read so far per layer: `read`, `readable` and `host` (read from the
        host tier), each a list over the layers (syncs; server info only): where a layer
        reads more than the unit cache holds for it, its host share shows it."""
        read, total, host = self.stats.T.tolist()
        return {"read": read, "readable": total, "host": host}

    def rank_totals(self) -> tuple[int, int]:
        """(rows ranked, rows in a kept-selection slot) by decode so far (syncs; server
        info only)."""
        ranked, slotted = self.ranks.tolist()
        return int(ranked), int(slotted)

    def read_fraction(self) -> float:
        """Fraction of the units decode read so far, over all layers (syncs)."""
        read, total = self.totals()
        return read / total if total else 0.0

    def reset(self) -> None:
        self.stats.zero_()
        self.ranks.zero_()
        if self.coverage is not None:
            self.coverage[0], self.coverage[1] = 1.0, 0.0  # no share seen, no head checked
