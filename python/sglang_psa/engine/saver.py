"""The save half of the pipeline: new KV from HBM to the host pool, off the compute path.

Per layer, the new K/V rows of a batch (`[n, kv_heads, head_dim]`, already
contiguous as attention produced them) go to the copy engine's pinned staging
ring with one D2H copy each on the saver's CUDA stream, which starts when the
compute stream has produced them (an event, not a device sync). Behind the
copy, the same stream writes the job's completion flag into shared pinned
memory; the engine waits for that flag, scatters the rows into pool blocks
with its CPU threads and acknowledges. So the host never blocks on the GPU,
and a block is read from the host only after its job is acknowledged
(`is_saved` / `wait`); until then the caller keeps the HBM copy.

Staging rows are a ring: a new job takes the next free run and, if it would
overwrite rows of a job not yet acknowledged, waits for that job first (back
pressure). If the engine dies, `recover()` restarts it and resubmits every
unacknowledged job from the staging rows, which are still intact.
"""

from __future__ import annotations

from collections import deque

import torch

from sglang_psa.engine.copy_engine import FLAG_SLOTS, CopyEngine, EngineDied, SaveJob


class KVSaver:
    def __init__(self, engine: CopyEngine, device: torch.device | str):
        self.engine = engine
        self.device = torch.device(device)
        self.rows = engine.staging_rows
        self.head = 0
        self.inflight: deque[tuple[int, int, int]] = deque()  # (job, row0, n), ring order
        self.jobs: dict[int, SaveJob] = {}
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self._seq = torch.zeros(FLAG_SLOTS, dtype=torch.int64, device=self.device)
        else:
            self.stream = None

    def _reserve(self, n: int) -> int:
        if n > self.rows:
            raise ValueError(
                f"a save of {n} rows exceeds the staging ring ({self.rows} rows); save it in parts"
            )
        r0 = 0 if self.head + n > self.rows else self.head
        overlapping = [j for j, a, m in self.inflight if a < r0 + n and r0 < a + m]
        if overlapping:  # the engine saves in order: the newest one covers the rest
            self.wait(overlapping[-1])
            for j in overlapping[:-1]:
                self.wait(j)
        self.head = r0 + n
        return r0

    def _retire(self, job: int) -> None:
        self.jobs.pop(job, None)
        self.inflight = deque(e for e in self.inflight if e[0] in self.jobs)

    def save(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int, int]]
    ) -> int:
        """Queue rows `k, v [n, kv_heads, d]` for `(block, offset, count)` segments of `layer`."""
        n = k.shape[0]
        if sum(c for _, _, c in segments) != n:
            raise ValueError(f"segments cover {sum(c for _, _, c in segments)} rows, not {n}")
        r0 = self._reserve(n)
        eng = self.engine
        job = SaveJob(layer, r0, segments, gpu_flag=self.stream is not None)
        sk, sv = eng.staged(r0, n)
        if self.stream is None:
            sk.copy_(k.transpose(0, 1))
            sv.copy_(v.transpose(0, 1))
            job_id = eng.submit(job)
        else:
            # The id is fixed before the copy so the flag the GPU writes names this job.
            self.stream.wait_stream(torch.cuda.current_stream())
            job_id = eng.peek_next_id()
            slot = job_id % FLAG_SLOTS
            with torch.cuda.stream(self.stream):
                # Head-major on the GPU (a cheap transpose), then one D2H copy each.
                sk.copy_(k.transpose(0, 1).contiguous(), non_blocking=True)
                sv.copy_(v.transpose(0, 1).contiguous(), non_blocking=True)
                self._seq[slot].fill_(job_id + 1)
                eng.flags[slot : slot + 1].copy_(self._seq[slot : slot + 1], non_blocking=True)
            k.record_stream(self.stream)
            v.record_stream(self.stream)
            assert eng.submit(job) == job_id
        self.jobs[job_id] = job
        self.inflight.append((job_id, r0, n))
        return job_id

    def is_saved(self, job: int) -> bool:
        if self.engine.is_saved(job):
            self.engine.done.discard(job)
            self._retire(job)
        return job not in self.jobs

    def wait(self, job: int) -> None:
        if job in self.jobs:
            self.engine.wait(job)
            self._retire(job)

    def drain(self) -> None:
        """Wait for every queued save (end of a prefill, shutdown, tests)."""
        for job in list(self.jobs):
            self.wait(job)

    def recover(self) -> list[int]:
        """After `EngineDied`: restart the engine and resubmit the unacknowledged jobs.

        Their staging rows are untouched (the ring never reuses rows of a job
        that is not acknowledged) and their GPU copies had completed or will,
        so the retry saves the same bytes. Returns the new job ids.
        """
        old = sorted(self.jobs.items())
        self.engine.restart()
        self.jobs.clear()
        self.inflight.clear()
        new = []
        for _, job in old:
            if job.gpu_flag:
                self.stream.synchronize()  # rows are complete; the new ids need no flags
                job.gpu_flag = False
            jid = self.engine.submit(job)
            n = sum(c for _, _, c in job.segments)
            self.jobs[jid] = job
            self.inflight.append((jid, job.row0, n))
            new.append(jid)
        return new


__all__ = ["KVSaver", "EngineDied"]
