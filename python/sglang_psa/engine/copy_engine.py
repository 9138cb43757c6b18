"""The copy-engine process: scatter staged KV rows into host-pool blocks, off the GPU's path.

The GPU writes a batch's new K/V for one layer with one contiguous D2H copy
into the shared staging ring (`[rows, kv_heads, head_dim]`, K and V); the
engine's CPU copies the rows into their pool blocks. Control travels over ZMQ
as orjson messages; data only through shared memory. Every job is
acknowledged, so a block is never read from the host before its save is
complete. The engine publishes a heartbeat; `check_health()` notices a dead or
stuck engine within `heartbeat_timeout` seconds, fails the jobs in flight with
`EngineDied` (their blocks are not saved), and `restart()` starts a new one.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field

import orjson
import torch
import zmq

from sglang_psa.store.host_pool import HostKVPool


class EngineDied(RuntimeError):
    """The copy engine died or stopped answering; the listed jobs were not saved."""


@dataclass
class SaveJob:
    """Staging rows `row0..row0+n` of `layer` go to `(block, offset, count)` segments in order."""

    layer: int
    row0: int
    segments: list[tuple[int, int, int]]
    job_id: int = field(default=-1)


def _engine_main(
    endpoint: str,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    heartbeat,
    slow_ms: int,
) -> None:
    torch.set_num_threads(1)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            heartbeat.value = time.monotonic()
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(endpoint)
    while True:
        msg = orjson.loads(sock.recv())
        if msg["op"] == "stop":
            break
        row = msg["row0"]
        layer = msg["layer"]
        for block, off, count in msg["segments"]:
            # [count, heads, d] staging rows -> [heads, count, d] in the block.
            pool_k[layer, :, block, off : off + count] = stage_k[row : row + count].transpose(0, 1)
            pool_v[layer, :, block, off : off + count] = stage_v[row : row + count].transpose(0, 1)
            row += count
            if slow_ms:
                time.sleep(slow_ms / 1000)  # tests: widen the window for a mid-save kill
        sock.send(orjson.dumps({"job": msg["job"], "ok": True}))
    stop.set()
    sock.close(linger=0)


class CopyEngine:
    """Client side: owns the staging ring, starts/monitors/restarts the engine process."""

    def __init__(
        self, pool: HostKVPool, staging_rows: int, heartbeat_timeout: float = 1.0, slow_ms: int = 0
    ):
        self.pool = pool
        shape = (staging_rows, pool.kv_heads, pool.head_dim)
        self.stage_k = torch.zeros(shape, dtype=pool.dtype).share_memory_()
        self.stage_v = torch.zeros(shape, dtype=pool.dtype).share_memory_()
        self.timeout = heartbeat_timeout
        self.slow_ms = slow_ms
        self._ids = itertools.count()
        self.pending: dict[int, SaveJob] = {}
        self.done: set[int] = set()
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._zmq = zmq.Context.instance()
        self._start()

    def _start(self) -> None:
        self.sock = self._zmq.socket(zmq.PAIR)
        self._ipc_path = f"/tmp/sglang-psa-engine-{os.getpid()}-{id(self)}-{self.restarts}"
        endpoint = f"ipc://{self._ipc_path}"
        self.sock.bind(endpoint)
        self.heartbeat = self._ctx.Value("d", time.monotonic())
        self.proc = self._ctx.Process(
            target=_engine_main,
            daemon=True,
            name="sglang-psa-copy-engine",
            args=(
                endpoint,
                self.pool.k,
                self.pool.v,
                self.stage_k,
                self.stage_v,
                self.heartbeat,
                self.slow_ms,
            ),
        )
        self.proc.start()
        self._wait_first_beat()

    def _wait_first_beat(self) -> None:
        start = self.heartbeat.value
        deadline = time.monotonic() + 60.0  # a spawned process imports torch first
        while self.heartbeat.value == start:
            if not self.proc.is_alive():
                raise EngineDied(f"copy engine exited at startup (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDied("copy engine did not start within 60 s")
            time.sleep(0.02)

    def submit(self, job: SaveJob) -> int:
        """Queue a save; the staged rows must not be overwritten until `wait()` returns."""
        job.job_id = next(self._ids)
        n = sum(c for _, _, c in job.segments)
        if job.row0 < 0 or job.row0 + n > self.stage_k.shape[0]:
            raise ValueError(f"rows {job.row0}..{job.row0 + n} are outside the staging ring")
        self.pending[job.job_id] = job
        self.sock.send(
            orjson.dumps(
                {
                    "op": "save",
                    "job": job.job_id,
                    "layer": job.layer,
                    "row0": job.row0,
                    "segments": job.segments,
                }
            )
        )
        return job.job_id

    def check_health(self) -> None:
        """Raise `EngineDied` (naming the lost jobs) if the engine is dead or silent."""
        age = time.monotonic() - self.heartbeat.value
        if self.proc.is_alive() and age <= self.timeout:
            return
        lost = sorted(self.pending)
        self.pending.clear()
        why = (
            f"exited with code {self.proc.exitcode}"
            if not self.proc.is_alive()
            else f"silent for {age:.1f} s"
        )
        raise EngineDied(f"copy engine {why}; jobs not saved: {lost}")

    def wait(self, job_id: int) -> None:
        """Block until `job_id` is saved; `EngineDied` if the engine dies first."""
        while job_id not in self.done:
            if self.sock.poll(50):
                ack = orjson.loads(self.sock.recv())
                self.pending.pop(ack["job"], None)
                self.done.add(ack["job"])
            else:
                self.check_health()
                if job_id not in self.pending and job_id not in self.done:
                    raise EngineDied(f"job {job_id} was lost")
        self.done.discard(job_id)

    def restart(self) -> None:
        self.close()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.sock.send(orjson.dumps({"op": "stop"}), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self.proc.join(2.0)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(2.0)
        self.sock.close(linger=0)
        if os.path.exists(self._ipc_path):
            os.unlink(self._ipc_path)
