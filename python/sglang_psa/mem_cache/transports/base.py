"""The interface every write-back transport implements (`WriteBack` picks one per `path`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from sglang_psa.mem_cache.host_pool import HostKVPool

# A planned block, an entry of `entries`: (rid, request-table row, block index within the
# request, host block id). A plain tuple, not a class: Python's collector untracks a tuple
# of untracked values (rids are strings) at its first young collection, so blocks waiting
# for their save never reach its oldest generation, whose growth starts full collections
# (hundreds of ms on the scheduler's thread, with SGLang's heap); an instance a block did.
RID, ROW, BLOCK, HOST = range(4)


class Transport(ABC):
    """Moves a layer's planned blocks from SGLang's KV buffers into the host tier.

    - `issue_layers(k_bufs, v_bufs, tables, entries, plan)` runs on the host once every
      layer wrote its KV (a prefill batch after its last layer, a decode flush before a
      replay): `k_bufs`/`v_bufs` are the layers' token-major buffers, `tables` is `[2,
      n]` on the device (each entry's page, then its host block), `entries` the `n`
      planned blocks (tuples: `RID`, `ROW`, `BLOCK`, `HOST`) in order, and `plan` what
      `plan(entries)` returned (prefill batches; None for decode flushes). On CUDA the
      copies run on `stream` behind the compute stream; issuing only waits on the host
      for back pressure (staging rows still in use).
    - A job's blocks count as saved only once its copy completed: the transport then
      calls `saved(layer, entries)`, from `poll`, `drain` or a back-pressure wait.
    - `poll()` takes the completed jobs without waiting for the others; `drain()` blocks
      until every issued job is saved and returns whether any was outstanding; `jobs`
      holds the issued, unsaved ones; `close()` frees what the transport started (not
      the host tier, which is the write-back's).
    - `before_forward()` makes the compute stream wait for the last gather, so a page
      SGLang hands out again is never overwritten while a copy still reads it.
    - Errors: what the transport can recover from it recovers inside `poll`/`drain`
      (the engine: a dead process is restarted, logged, and its unacknowledged jobs
      resubmitted); anything else raises from the call that meets it (`RuntimeError`
      for a job the engine refused, CUDA errors from the event waits). A job that
      failed is never reported saved.
    """

    dma_copy: str | None = None  # the strided copy's API, where DMA copies run

    def __init__(
        self,
        host: HostKVPool,
        device: torch.device,
        stats,
        saved: Callable[[int, list], None],
    ):
        """`stats`: the write-back's `WriteBackStats`, whose job counters this counts."""
        self.host, self.device, self.stats, self.saved = host, device, stats, saved
        self.block_size, self.heads, self.head_dim = host.block_size, host.kv_heads, host.head_dim
        self.cuda = device.type == "cuda"
        self.jobs: dict[int, tuple] = {}  # job id -> (the job, its entries), unsaved
        self._stage_k = self._stage_v = None
        if self.cuda:
            self.stream = torch.cuda.Stream(device)
            self._gathered = torch.cuda.Event()
        else:
            self.stream = None

    def plan(self, entries: list) -> list | None:
        """How a prefill batch's `entries` split into jobs."""
        return None

    @abstractmethod
    def issue_layers(self, k_bufs, v_bufs, tables: torch.Tensor, entries, plan=None) -> None:
        """Start saving `entries` of every layer (see the class docstring)."""

    @abstractmethod
    def poll(self) -> None:
        """Report every completed job saved, without blocking."""

    @abstractmethod
    def _wait(self, job_id: int) -> None:
        """Block until job `job_id` (and every job before it) is reported saved."""

    def drain(self) -> bool:
        """Wait until every issued save is acknowledged; returns whether any was
        outstanding."""
        waited = bool(self.jobs)
        while self.jobs:
            self._wait(min(self.jobs))
        return waited

    def before_forward(self) -> None:
        """The forward about to run may overwrite pages an issued gather still reads."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._gathered)

    def _device_staging(self, rows: int) -> None:
        """A device staging of `rows` rows of every KV head, for K and for V."""
        n = self.heads * rows * self.head_dim
        self._stage_k = torch.empty(n, dtype=self.host.dtype, device=self.device)
        self._stage_v = torch.empty_like(self._stage_k)

    def _staging_views(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[heads, rows, head_dim]` K and V views of a job's device staging."""
        H, d = self.heads, self.head_dim
        return (
            self._stage_k[: H * rows * d].view(H, rows, d),
            self._stage_v[: H * rows * d].view(H, rows, d),
        )

    @property
    def device_bytes(self) -> int:
        """GPU bytes of the device staging."""
        if self._stage_k is None:
            return 0
        return 2 * self._stage_k.numel() * self._stage_k.element_size()

    def close(self) -> None:
        """Free what the transport started."""
        return None
