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

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import orjson
import torch
import zmq

from sglang_psa.mem_cache.host_pool import HostKVPool, register_host, unregister_host


class EngineDied(RuntimeError):
    """The copy engine died or stopped answering; the listed jobs were not saved."""


class SaveFailed(RuntimeError):
    """The engine refused or failed a save (bad segments); the message says why."""


# Completion flags the GPU writes after a job's D2H copy (`transports.engine`): job j waits
# for flags[j % FLAG_SLOTS] == j + 1. At most FLAG_SLOTS jobs are in flight.
FLAG_SLOTS = 1024
START_TIMEOUT_S = 60.0  # a spawned engine imports torch before its first heartbeat


@dataclass
class SaveJob:
    """Staging rows `row0..row0+n` of `layer` go to `(block, offset, count)` segments in order.

    `gpu_flag`: the rows are written by an asynchronous GPU copy; the engine waits
    for its completion flag in shared memory before reading them.
    """

    layer: int
    row0: int
    segments: list[tuple[int, int, int]]
    job_id: int = field(default=-1)
    gpu_flag: bool = False


def staged(stage: torch.Tensor, row0: int, n: int, heads: int, d: int) -> torch.Tensor:
    """The `[heads, n, d]` view of a job's rows in a flat staging ring.

    A job's rows are stored head-major (the GPU transposes before its one D2H
    copy), so each head's tokens are one contiguous run and the engine's work
    is plain memcpy into pool blocks.
    """
    return stage[row0 * heads * d : (row0 + n) * heads * d].view(heads, n, d)


def scatter_rows(pool_k, pool_v, sk, sv, layer: int, segments, workers=None) -> None:
    """Copy a job's staged `[heads, n, d]` K/V into `(block, offset, count)` pool segments.

    Runs of whole blocks move with one indexed copy per (head, K|V), spread over
    `workers` (a thread pool; torch releases the GIL while copying); partial
    blocks with slices.
    """
    bs = pool_k.shape[3]
    tasks = []
    row, i = 0, 0
    while i < len(segments):
        block, off, count = segments[i]
        if not (0 <= off and count >= 1 and off + count <= bs):
            raise SaveFailed(f"segment {segments[i]} does not fit a {bs}-token block")
        j = i
        while j < len(segments) and segments[j][1] == 0 and segments[j][2] == bs:
            j += 1
        if j - i >= 2:
            blocks = [seg[0] for seg in segments[i:j]]
            n = (j - i) * bs
            for pool, stage in ((pool_k, sk), (pool_v, sv)):
                for h in range(stage.shape[0]):
                    src = stage[h, row : row + n].view(j - i, bs, -1)
                    tasks.append((pool[layer, h], blocks, src))
            row, i = row + n, j
            continue
        pool_k[layer, :, block, off : off + count] = sk[:, row : row + count]
        pool_v[layer, :, block, off : off + count] = sv[:, row : row + count]
        row, i = row + count, i + 1
    if workers is None or len(tasks) < 2:
        for t in tasks:
            _copy_blocks(t)
    else:
        list(workers.map(_copy_blocks, tasks))


def _copy_blocks(task) -> None:
    """`dst[blocks] = src` for one (head, K|V): a slice copy per run of consecutive block
    ids (a fresh free list hands out runs), one indexed copy for the rest."""
    dst, blocks, src = task
    start = 0
    for k in range(1, len(blocks) + 1):
        if k == len(blocks) or blocks[k] != blocks[k - 1] + 1:
            if k - start >= 4 or k == len(blocks) and start == 0:
                dst[blocks[start] : blocks[k - 1] + 1].copy_(src[start:k])
            else:
                dst.index_copy_(0, torch.tensor(blocks[start:k]), src[start:k])
            start = k


def check_message(msg, layers: int, blocks: int, staging_rows: int) -> None:
    """Validate a control message before the engine touches memory for it: its fields,
    types and every index (layer, staging rows, pool blocks) in range. Raises SaveFailed."""

    def is_int(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(msg, dict) or msg.get("op") not in ("save", "stop"):
        raise SaveFailed("message is not a save or stop command")
    if msg["op"] == "stop":
        return
    job, layer, row0, segs = (msg.get(k) for k in ("job", "layer", "row0", "segments"))
    if not (is_int(job) and job >= 0 and isinstance(msg.get("gpu_flag"), bool)):
        raise SaveFailed("job id or gpu_flag missing or malformed")
    if not (is_int(layer) and 0 <= layer < layers):
        raise SaveFailed(f"layer {layer!r} outside 0..{layers - 1}")
    if not (isinstance(segs, list) and segs):
        raise SaveFailed("segments missing")
    for seg in segs:
        if not (isinstance(seg, list) and len(seg) == 3 and all(map(is_int, seg))):
            raise SaveFailed(f"segment {seg!r} is not [block, offset, count]")
        if not 0 <= seg[0] < blocks:
            raise SaveFailed(f"block {seg[0]} outside the pool's {blocks}")
    n = sum(seg[2] for seg in segs)
    if not (is_int(row0) and row0 >= 0 and row0 + n <= staging_rows):
        raise SaveFailed(f"rows {row0!r}+{n} outside the staging ring's {staging_rows}")


def _engine_main(
    endpoint: str,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    stage_k: torch.Tensor,
    stage_v: torch.Tensor,
    flags: torch.Tensor,
    heartbeat,
    slow_ms: int,
    threads: int,
) -> None:
    torch.set_num_threads(1)  # parallelism comes from the pool of copy threads
    workers = ThreadPoolExecutor(threads, thread_name_prefix="psa-scatter")
    heads, d = pool_k.shape[1], pool_k.shape[4]
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            heartbeat.value = time.monotonic()
            time.sleep(0.05)

    threading.Thread(target=beat, daemon=True).start()
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(endpoint)
    staging_rows = stage_k.numel() // (heads * d)
    while True:
        msg = None
        try:
            msg = orjson.loads(sock.recv())
            check_message(msg, pool_k.shape[0], pool_k.shape[2], staging_rows)
        except (orjson.JSONDecodeError, SaveFailed) as e:  # answered, never executed
            job = msg.get("job") if isinstance(msg, dict) else None
            sock.send(orjson.dumps({"job": job, "ok": False, "error": f"rejected: {e}"}))
            continue
        if msg["op"] == "stop":
            break
        job = msg["job"]
        if msg["gpu_flag"]:
            slot = job % FLAG_SLOTS
            while int(flags[slot]) != job + 1:  # the GPU's D2H copy has not landed yet
                time.sleep(20e-6)
        try:
            n = sum(seg[2] for seg in msg["segments"])
            sk = staged(stage_k, msg["row0"], n, heads, d)
            sv = staged(stage_v, msg["row0"], n, heads, d)
            if slow_ms:  # tests: one segment at a time, slowly, to allow a mid-save kill
                row = 0
                for seg in msg["segments"]:
                    rows = slice(row, row + seg[2])
                    scatter_rows(pool_k, pool_v, sk[:, rows], sv[:, rows], msg["layer"], [seg])
                    row += seg[2]
                    time.sleep(slow_ms / 1000)
            else:
                scatter_rows(pool_k, pool_v, sk, sv, msg["layer"], msg["segments"], workers)
            sock.send(orjson.dumps({"job": job, "ok": True}))
        except Exception as e:  # a bad job must not kill the engine; the client raises it
            sock.send(orjson.dumps({"job": job, "ok": False, "error": f"{type(e).__name__}: {e}"}))
    stop.set()
    workers.shutdown()
    sock.close(linger=0)


class CopyEngine:
    """Client side: owns the staging ring, starts/monitors/restarts the engine process."""

    def __init__(
        self,
        pool: HostKVPool,
        staging_rows: int,
        heartbeat_timeout: float = 1.0,
        slow_ms: int = 0,
        threads: int = 4,
        pin: bool | None = None,
    ):
        self.pool = pool
        self.staging_rows = staging_rows
        size = staging_rows * pool.kv_heads * pool.head_dim
        self.stage_k = torch.zeros(size, dtype=pool.dtype).share_memory_()
        self.stage_v = torch.zeros(size, dtype=pool.dtype).share_memory_()
        self.flags = torch.zeros(FLAG_SLOTS, dtype=torch.int64).share_memory_()
        self._registered: list[torch.Tensor] = []
        if pin if pin is not None else torch.cuda.is_available():
            for t in (self.stage_k, self.stage_v, self.flags):
                register_host(t)
                self._registered.append(t)
        self.timeout = heartbeat_timeout
        self.slow_ms = slow_ms
        self.threads = threads
        self._next_id = 0
        self.pending: dict[int, SaveJob] = {}
        self.done: set[int] = set()
        self.failed: dict[int, str] = {}
        self.restarts = 0
        self._ctx = mp.get_context("spawn")
        self._zmq = zmq.Context.instance()
        self._ipc_dir = ""
        self._start()

    def _start(self, wait: bool = True) -> None:
        self.sock = self._zmq.socket(zmq.PAIR)
        # The socket lives in a directory only this user can enter (mkdtemp: mode 0700).
        if not os.path.isdir(self._ipc_dir):
            self._ipc_dir = tempfile.mkdtemp(prefix="sglang-psa-engine-")
        self._ipc_path = os.path.join(self._ipc_dir, f"engine-{self.restarts}")
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
                self.flags,
                self.heartbeat,
                self.slow_ms,
                self.threads,
            ),
        )
        self.proc.start()
        self._first_beat = self.heartbeat.value
        self._started_at = time.monotonic()
        self._outbox: list[bytes] = []  # commands sent before the engine is up
        if wait:
            self._wait_first_beat()
            self._first_beat = None

    def _starting(self) -> bool:
        """The engine (started without waiting) has not beaten yet. Once it has, the
        commands held back meanwhile go out, in order."""
        if self._first_beat is None:
            return False
        if self.heartbeat.value == self._first_beat:
            return True
        self._first_beat = None
        outbox, self._outbox = self._outbox, []
        for msg in outbox:
            self._send(msg)
        return False

    def _wait_first_beat(self) -> None:
        start = self.heartbeat.value
        deadline = time.monotonic() + START_TIMEOUT_S  # a spawned process imports torch
        while self.heartbeat.value == start:
            if not self.proc.is_alive():
                raise EngineDied(f"copy engine exited at startup (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise EngineDied(f"copy engine did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)

    def submit(self, job: SaveJob) -> int:
        """Queue a save; the staged rows must not be overwritten until `wait()` returns."""
        n = sum(c for _, _, c in job.segments)
        if job.row0 < 0 or job.row0 + n > self.staging_rows:
            raise ValueError(f"rows {job.row0}..{job.row0 + n} are outside the staging ring")
        while len(self.pending) >= FLAG_SLOTS:  # flag slots are reused modulo FLAG_SLOTS
            self.wait(min(self.pending))
        job.job_id = self._next_id
        self._next_id += 1
        self.pending[job.job_id] = job
        msg = orjson.dumps(
            {
                "op": "save",
                "job": job.job_id,
                "layer": job.layer,
                "row0": job.row0,
                "segments": job.segments,
                "gpu_flag": job.gpu_flag,
            }
        )
        if self._starting():  # a PAIR socket with no peer yet would block the sender
            self._outbox.append(msg)
        else:
            self._send(msg)
        return job.job_id

    def _send(self, msg: bytes) -> None:
        """Send without ever blocking on a dead engine: a PAIR socket whose peer is gone
        blocks its sender for ever, so wait for room in 50 ms slices and check health
        between them (`EngineDied`, this job among the lost, if the engine is dead)."""
        while True:
            try:
                self.sock.send(msg, zmq.NOBLOCK)
                return
            except zmq.Again:
                self.check_health()
                self.sock.poll(50, zmq.POLLOUT)

    def staged(self, row0: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[kv_heads, n, head_dim]` K and V views of staging rows `row0..row0+n`."""
        H, d = self.pool.kv_heads, self.pool.head_dim
        return staged(self.stage_k, row0, n, H, d), staged(self.stage_v, row0, n, H, d)

    def peek_next_id(self) -> int:
        """The id the next `submit` assigns (a GPU completion flag is written under it)."""
        return self._next_id

    def check_health(self) -> None:
        """Raise `EngineDied` (naming the lost jobs) if the engine is dead or silent (a
        starting engine has `START_TIMEOUT_S` for its first beat: it imports torch)."""
        if self.proc.is_alive() and self._starting():
            if time.monotonic() - self._started_at <= START_TIMEOUT_S:
                return
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

    def _take_ack(self) -> None:
        ack = orjson.loads(self.sock.recv())
        self.pending.pop(ack["job"], None)
        if ack["ok"]:
            self.done.add(ack["job"])
        else:
            self.failed[ack["job"]] = ack["error"]

    def poll(self) -> None:
        """Take every acknowledgement already there, without blocking."""
        while self.sock.poll(0):
            self._take_ack()

    def is_saved(self, job_id: int) -> bool:
        self.poll()
        return job_id in self.done

    def wait(self, job_id: int) -> None:
        """Block until `job_id` is saved; `EngineDied` if the engine dies first,
        `SaveFailed` if the engine rejected the job."""
        while job_id not in self.done:
            if job_id in self.failed:
                raise SaveFailed(f"save job {job_id} failed: {self.failed.pop(job_id)}")
            if self.sock.poll(50):
                self._take_ack()
            else:
                self.check_health()
                if job_id not in self.pending and job_id not in self.done:
                    if job_id not in self.failed:
                        raise EngineDied(f"job {job_id} was lost")
        self.done.discard(job_id)

    def restart(self, wait: bool = True) -> None:
        """A new engine process. `wait=False` returns at once (the serving path must not
        stall while it imports torch); commands sent meanwhile go out on its first beat."""
        self._stop()
        self.restarts += 1
        self._start(wait)

    def close(self) -> None:
        """Stop the engine and release the staging ring's page-locking."""
        self._stop()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
        while self._registered:
            unregister_host(self._registered.pop())

    def _stop(self) -> None:
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
