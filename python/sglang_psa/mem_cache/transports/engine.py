"""`engine` transport: on the copy stream, one gather kernel puts a job's pages head-major
into a device staging (`sgl_kernel_ext.writeback`), one D2H copy each for K and V moves
it into the copy engine's pinned staging ring, the GPU writes the job's completion flag,
and the job (layer, ring rows, host blocks) goes to the copy-engine process over ZMQ,
whose threads scatter the rows into host blocks and acknowledge. A dead engine is
restarted and every unacknowledged job resubmitted from its ring rows, which the ring
never reuses before the acknowledgement."""

from __future__ import annotations

import logging
from collections import deque

import torch

from sgl_kernel_ext.writeback import gather_pages_head_major
from sglang_psa.mem_cache.copy_engine import FLAG_SLOTS, CopyEngine, EngineDied, SaveJob
from sglang_psa.mem_cache.transports.base import HOST, Transport

logger = logging.getLogger(__name__)


class EngineTransport(Transport):
    """A job is saved once the engine acknowledged it; jobs of at most `max_job_rows`
    rows, ring rows reused only after their job's acknowledgement."""

    def __init__(
        self,
        *args,
        staging_rows: int,
        max_job_rows: int,
        heartbeat_timeout: float,
        slow_ms: int,
        threads: int,
    ):
        super().__init__(*args)
        self.engine = CopyEngine(
            self.host,
            staging_rows,
            heartbeat_timeout=heartbeat_timeout,
            slow_ms=slow_ms,
            threads=threads,
        )
        self.max_job_rows = max_job_rows
        self._ring: deque[tuple[int, int, int]] = deque()  # (job, row0, rows) in ring order
        self._head = 0
        self._device_staging(max_job_rows)
        self._order = torch.arange(max_job_rows // self.block_size, device=self.device)
        if self.cuda:
            self._seq = torch.zeros(FLAG_SLOTS, dtype=torch.int64, device=self.device)

    def _reserve_rows(self, n: int) -> int:
        """Ring rows for a job of `n` rows, waiting for the engine if they are in use."""
        rows = self.engine.staging_rows
        r0 = 0 if self._head + n > rows else self._head
        while self._ring and self._overlaps(self._ring[0], r0, n):
            self._wait(self._ring[0][0])
        self._head = r0 + n
        return r0

    @staticmethod
    def _overlaps(entry, r0: int, n: int) -> bool:
        _, a, m = entry
        return a < r0 + n and r0 < a + m

    def issue_layers(self, k_bufs, v_bufs, tables: torch.Tensor, entries, plan=None) -> None:
        """Each layer in turn, one job per `max_job_rows` rows of `entries`."""
        step = self.max_job_rows // self.block_size
        for layer, (k_buf, v_buf) in enumerate(zip(k_bufs, v_bufs)):
            for i in range(0, len(entries), step):
                self._issue(layer, k_buf, v_buf, tables[:, i : i + step], entries[i : i + step])

    def _issue(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries) -> None:
        """One job: a gather into the device staging, a D2H copy into the ring, the
        job to the engine."""
        pages = tables[0]
        n_rows = len(entries) * self.block_size
        r0 = self._reserve_rows(n_rows)
        dk, dv = self._staging_views(n_rows)
        order = self._order[: len(entries)]  # the staging's block order
        sk, sv = self.engine.staged(r0, n_rows)
        job = SaveJob(layer, r0, [(e[HOST], 0, self.block_size) for e in entries])
        job_id = self.engine.peek_next_id()
        if self.cuda:
            job.gpu_flag = True
            slot = job_id % FLAG_SLOTS
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                gather_pages_head_major(k_buf, v_buf, pages, dk, dv, self.block_size, order)
                self._gathered.record(self.stream)
                sk.copy_(dk, non_blocking=True)
                sv.copy_(dv, non_blocking=True)
                self._seq[slot].fill_(job_id + 1)
                flags = self.engine.flags
                flags[slot : slot + 1].copy_(self._seq[slot : slot + 1], non_blocking=True)
            tables.record_stream(self.stream)
        else:
            gather_pages_head_major(k_buf, v_buf, pages, dk, dv, self.block_size, order)
            sk.copy_(dk)
            sv.copy_(dv)
        self.jobs[job_id] = (job, entries)  # before the send: a dead engine redoes it
        self._ring.append((job_id, r0, n_rows))
        self.stats.jobs += 1
        try:
            if self.engine.submit(job) != job_id:
                raise RuntimeError("copy engine job ids went out of step with the flags")
        except EngineDied as e:
            self._recover(e)

    def _retire(self, job_id: int) -> None:
        job, entries = self.jobs.pop(job_id)
        self.saved(job.layer, entries)
        while self._ring and self._ring[0][0] not in self.jobs:
            self._ring.popleft()

    def poll(self) -> None:
        """Take the engine's acknowledgements; restart a dead engine and redo its jobs.
        Raises `RuntimeError` if the engine refused a job."""
        try:
            self.engine.check_health()
            self.engine.poll()
        except EngineDied as e:
            self._recover(e)
            return
        for job_id in sorted(self.engine.done):
            self.engine.done.discard(job_id)
            if job_id in self.jobs:
                self._retire(job_id)
        if self.engine.failed:
            job_id, why = next(iter(self.engine.failed.items()))
            raise RuntimeError(f"the copy engine refused save job {job_id}: {why}")

    def _wait(self, job_id: int) -> None:
        try:
            self.engine.wait(job_id)
        except EngineDied as e:
            self._recover(e)
            self.drain()
            return
        self._retire(job_id)

    def _recover(self, err: EngineDied) -> None:
        """Restart the engine without waiting for it and resubmit every unacknowledged
        job, in order, from its staging rows (complete: the copy stream is synchronised
        first, the one host sync of this failure path)."""
        logger.error("sglang-psa: %s; restarting the copy engine and redoing its saves", err)
        if self.cuda:
            self.stream.synchronize()
        old = sorted(self.jobs.items())
        self.engine.restart(wait=False)  # the jobs go out on the new engine's first beat
        self.engine.done.clear()
        self.engine.failed.clear()
        self.jobs.clear()
        self._ring.clear()
        for _, (job, entries) in old:
            job.gpu_flag = False
            jid = self.engine.submit(job)
            self.jobs[jid] = (job, entries)
            self._ring.append((jid, job.row0, len(entries) * self.block_size))
        self.stats.engine_restarts += 1
        self.stats.resubmitted_jobs += len(old)

    def close(self) -> None:
        self.engine.close()
