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

With `min_run` set, runs of at least that many whole consecutive blocks (what a
prefill into a fresh free list produces) skip the staging ring: per KV head they are one
contiguous range of the pool, so the GPU copies them there directly (one
large D2H copy per head), and the engine only confirms the job after the
flag. Decode tokens and partial blocks go through the ring. Off by default
until it has run on the GPU machine (CPU-tested only so far).

Staging rows are a ring: a new job takes the next free run and, if it would
overwrite rows of a job not yet acknowledged, waits for that job first (back
pressure). If the engine dies, `recover()` restarts it and resubmits every
unacknowledged job from the staging rows, which are still intact.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch

from sglang_psa.engine.copy_engine import FLAG_SLOTS, CopyEngine, EngineDied, SaveJob


class KVSaver:
    def __init__(self, engine: CopyEngine, device: torch.device | str, min_run: int | None = None):
        self.engine = engine
        self.min_run = min_run
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

    def _split(self, segments: list[tuple[int, int, int]]):
        """Direct runs `(row, first block, blocks)` of >= `min_run` whole consecutive
        blocks, and the other segments `(row, segment)`, in row order."""
        bs = self.engine.pool.block_size
        direct, rest, row, i = [], [], 0, 0
        while i < len(segments):
            j = i
            while (
                j < len(segments)
                and segments[j][1:] == (0, bs)
                and (j == i or segments[j][0] == segments[j - 1][0] + 1)
            ):
                j += 1
            if self.min_run is not None and j - i >= self.min_run:
                direct.append((row, segments[i][0], j - i))
                row += (j - i) * bs
                i = j
            else:
                rest.append((row, segments[i]))
                row += segments[i][2]
                i += 1
        return direct, rest

    def save(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, segments: list[tuple[int, int, int]]
    ) -> int:
        """Queue rows `k, v [n, kv_heads, d]` for `(block, offset, count)` segments of `layer`."""
        n = k.shape[0]
        if sum(c for _, _, c in segments) != n:
            raise ValueError(f"segments cover {sum(c for _, _, c in segments)} rows, not {n}")
        direct, rest = self._split(segments)
        n_rest = sum(seg[2] for _, seg in rest)
        r0 = self._reserve(n_rest)
        eng, pool = self.engine, self.engine.pool
        job = SaveJob(layer, r0, [seg for _, seg in rest], gpu_flag=self.stream is not None)
        sk, sv = eng.staged(r0, n_rest)
        cuda = self.stream is not None
        if cuda:
            # The id is fixed before the copies so the flag the GPU writes names this job.
            self.stream.wait_stream(torch.cuda.current_stream())
            job_id = eng.peek_next_id()
            slot = job_id % FLAG_SLOTS
            ctx = torch.cuda.stream(self.stream)
        else:
            ctx = contextlib.nullcontext()
        with ctx:
            # Head-major on the GPU (a cheap transpose): each head's tokens are one run.
            kt, vt = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
            for row, b0, nb in direct:  # straight into the pool: one copy per head
                rows = slice(row, row + nb * pool.block_size)
                for h in range(pool.kv_heads):
                    for dst, src in ((pool.k, kt), (pool.v, vt)):
                        dst[layer, h, b0 : b0 + nb].view(-1, pool.head_dim).copy_(
                            src[h, rows], non_blocking=cuda
                        )
            if rest:
                if direct:  # gather the leftover rows (partial blocks, short runs) on the GPU
                    parts = [slice(row, row + seg[2]) for row, seg in rest]
                    kt = torch.cat([kt[:, r] for r in parts], 1)
                    vt = torch.cat([vt[:, r] for r in parts], 1)
                sk.copy_(kt, non_blocking=cuda)  # one D2H copy each into the staging ring
                sv.copy_(vt, non_blocking=cuda)
            if cuda:
                self._seq[slot].fill_(job_id + 1)
                eng.flags[slot : slot + 1].copy_(self._seq[slot : slot + 1], non_blocking=True)
        if cuda:
            k.record_stream(self.stream)
            v.record_stream(self.stream)
            assert eng.submit(job) == job_id
        else:
            job_id = eng.submit(job)
        self.jobs[job_id] = job
        self.inflight.append((job_id, r0, n_rest))
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
