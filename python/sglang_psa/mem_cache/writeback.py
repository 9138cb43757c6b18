"""Write-back of every full KV block to the host tier, through the copy engine.

`--psa-kv-home tiered`: SGLang's KV pool stays in HBM (the hot tier) and every
block that fills (in prefill or in decode) gets a copy in the host tier, laid
out per (layer, KV head, block) (`HostKVPool`), so a later step can read it
there, or cache single units of it (`unit_cache`), instead of keeping it in HBM.

Who calls what (one scheduler process, one thread; SGLang's overlap loop
prepares batch t+1 after launching forward t, then launches forward t+1):
- the scheduler hooks *plan*, on the host, from request lengths only (no GPU
  reads): `plan_extend` names the blocks an extend batch completes,
  `plan_decode` the blocks earlier decode steps completed; each planned block
  gets a host block id from the request's reservation (`HostBlocks`);
- the attention backend *issues*: after each prefill layer wrote its KV
  (`issue_extend_layer`), and, for decode, before a step's graph replay once
  enough blocks are pending (`issue_decode`). On the copy stream, behind an
  event on the compute stream: one gather kernel puts the layer's planned pages
  head-major into a device staging buffer (`sgl_kernel_ext.writeback`), one
  D2H copy each for K and V moves it into the engine's pinned staging ring,
  the GPU writes the job's completion flag, and the job (layer, ring rows,
  host blocks) goes to the copy-engine process over ZMQ, whose threads scatter
  the rows into host blocks and acknowledge;
- `poll()` (every scheduling round) takes acknowledgements: a block counts as
  saved, and may be read from the host, only after its job is acknowledged. It
  also checks the engine's heartbeat: a dead engine is restarted and every
  unacknowledged job resubmitted from its staging rows, which the ring never
  reuses before the acknowledgement.

The compute stream waits for the copy stream's last gather (microseconds)
before the next forward, so a page SGLang frees and hands out again is never
overwritten while a gather still reads it. Nothing here synchronises the host
with the GPU on the serving path except back pressure when the staging ring is
full of unacknowledged rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from sgl_kernel_ext.writeback import copy_pages_to_units, gather_pages_head_major
from sglang_psa.mem_cache.copy_engine import FLAG_SLOTS, CopyEngine, EngineDied, SaveJob
from sglang_psa.mem_cache.host_pool import HostKVPool
from sglang_psa.mem_cache.strided_copy import StridedCopy
from sglang_psa.plugin.hooks import req_row

logger = logging.getLogger(__name__)


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list (nested lists too) as a `dtype` tensor on `device`, through pinned
    memory on CUDA: one small H2D copy, no sync."""
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


# Persistent programs of the uva path's save kernel: enough to keep PCIe busy, few enough
# to leave the other SMs to the forward it overlaps.
UVA_PROGRAMS = 16
# The uva path moves a prefill job whose host blocks form runs by DMA instead (a gather into
# device staging, then per run one strided copy of every KV head's K and one of V on the
# GPU's copy engines: no SMs taken from the forward) when it takes at most this many
# copies; scattered blocks and decode flushes go through the save kernel.
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


class HostTierFull(RuntimeError):
    """A request needs more host blocks than it reserved and none are free."""


class HostBlocks:
    """Host-tier block ids: a free list with per-request reservations (CPU only).

    A request reserves the blocks its whole length can fill when admitted, so a
    running request never finds the host tier full; it takes ids as its blocks
    fill and returns all of them when it ends. Ids come out smallest first (the free
    list stays sorted), so a prefill's blocks are runs that one strided copy moves.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() gives 0, 1, 2, ...
        self._reserved: dict[object, int] = {}  # rid -> ids reserved, not yet taken
        self._owned: dict[object, list[int]] = {}

    @property
    def available(self) -> int:
        """Free ids not promised to a reservation."""
        return len(self._free) - sum(self._reserved.values())

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def reserve(self, rid, n: int) -> bool:
        """Promise `rid` `n` ids in all (those it owns and holds reserved count) if the
        missing ones are free."""
        extra = n - len(self._owned.get(rid, ())) - self._reserved.get(rid, 0)
        if extra <= 0:
            return True
        if extra > self.available:
            return False
        self._reserved[rid] = self._reserved.get(rid, 0) + extra
        return True

    def give_back(self, rid, ids: list[int]) -> None:
        """`rid` no longer uses `ids` (blocks whose saves were dropped): they return to the
        free list and stay promised to `rid`."""
        if not ids:
            return
        owned = self._owned[rid]
        drop = set(ids)
        owned[:] = [i for i in owned if i not in drop]
        self._free.extend(ids)
        self._free.sort(reverse=True)
        self._reserved[rid] = self._reserved.get(rid, 0) + len(ids)

    def take(self, rid, n: int) -> list[int]:
        """`n` ids for `rid`, from its reservation first."""
        if n == 0:
            return []
        from_res = min(n, self._reserved.get(rid, 0))
        if n - from_res > self.available:
            raise HostTierFull(
                f"request {rid} needs {n} host blocks beyond its reservation; {self.available} free"
            )
        if from_res:
            self._reserved[rid] -= from_res
        ids = [self._free.pop() for _ in range(n)]
        self._owned.setdefault(rid, []).extend(ids)
        return ids

    def release(self, rid) -> int:
        """Return every id and reservation of `rid`; the number of ids returned."""
        self._reserved.pop(rid, None)
        ids = self._owned.pop(rid, [])
        if ids:
            self._free.extend(ids)
            self._free.sort(reverse=True)  # pop() gives the smallest: freed space re-forms runs
        return len(ids)

    def check_integrity(self) -> None:
        owned = [i for ids in self._owned.values() for i in ids]
        every = sorted(owned + self._free)
        assert every == list(range(self.num_blocks)), "a host block is lost or owned twice"
        assert all(v >= 0 for v in self._reserved.values())


PARKED = -1  # the row of a retracted request whose saved blocks stay in the host tier


@dataclass
class _Req:
    row: int  # SGLang's request-table row (PARKED: none, retracted)
    planned: int = 0  # blocks planned for a save, in order
    saved: int = 0  # blocks acknowledged
    host: list[int] = field(default_factory=list)  # host block of each planned block
    on_host: bool = False  # some blocks are read from the host tier (`read_from_host`)


@dataclass
class _Entry:
    rid: object
    row: int
    block: int  # block index within the request
    host: int  # host block id


@dataclass
class WriteBackStats:
    blocks_planned: int = 0
    blocks_saved: int = 0
    bytes_saved: int = 0
    jobs: int = 0
    dma_jobs: int = 0  # uva path: jobs moved by DMA copies
    engine_restarts: int = 0
    resubmitted_jobs: int = 0
    dropped_blocks: int = 0  # planned for requests that ended before the save ran


class WriteBack:
    """The write-back pipeline of one scheduler process (one GPU's layers and heads)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int,
        host_blocks: int,
        staging_rows: int,
        device: torch.device | str,
        *,
        max_job_rows: int | None = None,
        table_shape: tuple[int, int] | None = None,
        decode_flush_blocks: int = 16,
        threads: int = 4,
        heartbeat_timeout: float = 1.0,
        engine_slow_ms: int = 0,
        path: str = "engine",
        dma_blocks: int = 0,
    ):
        """`path`: `engine` (GPU gather, one D2H copy per layer into the pinned staging
        ring, copy-engine process scatter, ZMQ acknowledgement) or `uva` (no engine
        process; a CUDA event is the acknowledgement): a job whose host blocks form a few
        runs is gathered into a device staging of `dma_blocks` blocks and copied into the
        host tier by DMA, one strided copy per run for K and one for V (prefill chunks);
        any other job is written by one kernel through unified addressing (decode
        flushes). The store benchmark measures both paths."""
        if path not in ("engine", "uva"):
            raise ValueError(f"write-back path must be engine or uva, got {path!r}")
        self.path = path
        self.layers, self.heads, self.head_dim = layers, kv_heads, head_dim
        self.block_size, self.dtype = block_size, dtype
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if staging_rows < block_size:
            raise ValueError(f"the staging ring needs at least one block ({block_size} rows)")
        self.host = HostKVPool(
            layers, kv_heads, host_blocks, block_size, head_dim, dtype, shared=path == "engine"
        )
        self.engine = None
        if path == "engine":
            self.engine = CopyEngine(
                self.host,
                staging_rows,
                heartbeat_timeout=heartbeat_timeout,
                slow_ms=engine_slow_ms,
                threads=threads,
            )
        self._uva: deque[tuple[object, int]] = deque()  # (event or None, job id), in order
        self._next_uva = 0
        self.blocks = HostBlocks(host_blocks)
        self.decode_flush_blocks = decode_flush_blocks
        self.stats = WriteBackStats()
        self._reqs: dict[object, _Req] = {}
        self._decode: list[_Entry] = []  # planned by decode, not issued yet
        self._extend: list[_Entry] = []  # planned for the next extend forward
        self._extend_tables: tuple[torch.Tensor, list[_Entry]] | None = None
        self._jobs: dict[int, tuple[SaveJob, list[_Entry]]] = {}  # unacknowledged
        self._ring: deque[tuple[int, int, int]] = deque()  # (job, row0, rows) in ring order
        self._head = 0
        rows = self.max_job_rows = min(max_job_rows or staging_rows, staging_rows)
        self.dma_blocks = dma_blocks if path == "uva" else 0
        if path == "uva":
            rows = dma_blocks * block_size  # the DMA jobs' staging
        self._stage_k = torch.empty(kv_heads * rows * head_dim, dtype=dtype, device=self.device)
        self._stage_v = torch.empty_like(self._stage_k)
        self._copy2d = StridedCopy(self.device) if self.dma_blocks else None
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self._gathered = torch.cuda.Event()
            self._seq = torch.zeros(FLAG_SLOTS, dtype=torch.int64, device=self.device)
        else:
            self.stream = None
        self._block_bytes = 2 * kv_heads * block_size * head_dim * self.host.k.element_size()
        # Where decode reads a block, by (request-table row, block): 0 from its HBM page,
        # -(host block) - 1 from the host tier (a saved block whose HBM copy is not to be
        # read). The backend gathers it into the step's block table inside the graph.
        rows, blocks = table_shape or (1, 1)
        self.host_loc = torch.zeros(rows, blocks, dtype=torch.int32, device=self.device)

    # -- reservations (admission) ---------------------------------------------------
    def reserve(self, rid, tokens: int) -> bool:
        """Reserve the host blocks a request of `tokens` tokens can fill."""
        return self.blocks.reserve(rid, tokens // self.block_size)

    def release(self, rid) -> None:
        """`rid` ended (finished, aborted or retracted): its planned, unissued saves are
        dropped, its row reads HBM again and its host blocks return to the free list.
        Saves already issued complete in order before any later save to the same blocks
        (the engine is FIFO)."""
        r = self._reqs.pop(rid, None)
        if r is not None:
            self._leave_row(r)
        self._drop_plans(rid)
        self.blocks.release(rid)

    def park(self, rid) -> int:
        """`rid` was retracted and keeps its saved blocks in the host tier: its unissued
        saves are dropped (SGLang frees their pages), the host blocks of every block not
        saved go back to the free list (still reserved for it), and its request-table row
        reads HBM again (SGLang gives the row to another request). Returns the blocks
        kept. The caller drains the saves first (`drain`): every issued one is then
        acknowledged, so the kept blocks are exactly the saved ones."""
        r = self._reqs.get(rid)
        if r is None:
            return 0
        if self._jobs:
            raise RuntimeError("WriteBack.park needs every issued save acknowledged (drain)")
        self._drop_plans(rid)
        self._leave_row(r)
        r.row = PARKED
        self.trim(rid, r.saved)
        return r.saved

    def trim(self, rid, blocks: int) -> None:
        """Parked `rid` keeps only its first `blocks` saved blocks; the host blocks of the
        others go back to the free list, still reserved for it."""
        r = self._reqs[rid]
        if r.row != PARKED or blocks > r.saved:
            raise RuntimeError(f"request {rid} is not parked with {blocks} saved blocks")
        self.blocks.give_back(rid, r.host[blocks:])
        del r.host[blocks:]
        r.saved = r.planned = blocks

    def resume(self, rid, row: int) -> None:
        """Parked `rid` got request-table row `row`: decode reads its kept blocks from the
        host tier, and the blocks after them are planned as before."""
        r = self._reqs[rid]
        if r.row != PARKED:
            raise RuntimeError(f"request {rid} is not parked")
        r.row = row
        self.read_from_host(rid, list(range(r.saved)))

    def _leave_row(self, r: _Req) -> None:
        """`r` leaves its request-table row: the row reads HBM again."""
        if r.on_host and r.row != PARKED:
            self.host_loc[r.row, : len(r.host)] = 0
        r.on_host = False

    def _drop_plans(self, rid) -> None:
        for plan in (self._decode, self._extend):
            keep = [e for e in plan if e.rid != rid]
            self.stats.dropped_blocks += len(plan) - len(keep)
            plan[:] = keep

    # -- planning (scheduler, host only) ---------------------------------------------
    def _plan(self, rid, row: int, full_blocks: int, out: list[_Entry]) -> None:
        r = self._reqs.get(rid)
        if r is None or r.row != row:
            if r is not None:  # the request moved rows (re-prefilled): its blocks start over
                self.release(rid)
            r = self._reqs[rid] = _Req(row)
        n = full_blocks - r.planned
        if n <= 0:
            return
        ids = self.blocks.take(rid, n)
        for i, h in enumerate(ids):
            out.append(_Entry(rid, row, r.planned + i, h))
        r.host.extend(ids)
        r.planned = full_blocks
        self.stats.blocks_planned += n

    def plan_extend(self, reqs, seq_lens) -> None:
        """An extend batch is about to run: every block it completes (its requests'
        lengths after it are `seq_lens`) is saved after each layer wrote it."""
        self.poll()
        bs = self.block_size
        self._extend = []
        for req, n in zip(reqs, seq_lens):
            self._plan(req.rid, int(req_row(req)), int(n) // bs, self._extend)

    def plan_decode(self, reqs, seq_lens) -> None:
        """A decode batch is about to run with lengths `seq_lens` (its new tokens
        included): blocks below the newest token's block are written (their last
        token's KV was written by an earlier forward, already launched)."""
        self.poll()
        bs = self.block_size
        for req, n in zip(reqs, seq_lens):
            self._plan(req.rid, int(req_row(req)), (int(n) - 1) // bs, self._decode)

    # -- issuing (attention backend, on the forward's stream) -------------------------
    def _tables(self, entries: list[_Entry], req_to_token: torch.Tensor) -> torch.Tensor:
        """`[2, n]` on the GPU: the pages of `entries` (SGLang's request table at each
        block's first token, divided by the page size) and their host blocks. One small
        H2D copy, no sync."""
        t = to_device([(e.row, e.block * self.block_size, e.host) for e in entries], self.device)
        pages = req_to_token[t[:, 0], t[:, 1]].long() // self.block_size
        return torch.stack([pages, t[:, 2]])

    def before_forward(self) -> None:
        """The forward about to run may overwrite pages an issued gather still reads."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._gathered)

    def issue_extend_layer(
        self, layer: int, k_buf: torch.Tensor, v_buf: torch.Tensor, req_to_token: torch.Tensor
    ) -> None:
        """After extend layer `layer` (0-based) stored its KV: save its planned blocks."""
        if layer == 0:  # the batch's tables and DMA plan, the same for every layer
            e = self._extend
            self._extend_tables = (
                (self._tables(e, req_to_token), e, self._dma_plan(e)) if e else None
            )
            self._extend = []
        if self._extend_tables is None:
            return
        tables, entries, plan = self._extend_tables
        self._issue(layer, k_buf, v_buf, tables, entries, plan)
        if layer == self.layers - 1:
            self._extend_tables = None

    def issue_decode(self, k_bufs, v_bufs, req_to_token: torch.Tensor, force: bool = False) -> None:
        """Before a decode step's replay: save the pending decode blocks of every layer,
        once at least `decode_flush_blocks` are pending (or `force`)."""
        if not self._decode or (len(self._decode) < self.decode_flush_blocks and not force):
            return
        entries, self._decode = self._decode, []
        tables = self._tables(entries, req_to_token)
        for layer in range(self.layers):
            self._issue(layer, k_bufs[layer], v_bufs[layer], tables, entries)

    @property
    def device_bytes(self) -> int:
        """GPU bytes: the staging buffer and the location table."""
        staging = 2 * self._stage_k.numel() * self._stage_k.element_size()
        return staging + self.host_loc.numel() * self.host_loc.element_size()

    def _issue_uva(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries) -> None:
        """`uva` path: one kernel writes the blocks into the host tier; an event marks
        the save complete."""
        job_id, self._next_uva = self._next_uva, self._next_uva + 1
        hk, hv = self.host.k[layer], self.host.v[layer]
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copy_pages_to_units(
                    k_buf, v_buf, tables[0], hk, hv, tables[1], programs=UVA_PROGRAMS
                )
                done = self._gathered = torch.cuda.Event()  # the save's end is the gather's
                done.record(self.stream)
            tables.record_stream(self.stream)
        else:
            copy_pages_to_units(k_buf, v_buf, tables[0], hk, hv, tables[1])
            done = None
        self._uva_job(job_id, layer, done, entries)

    def _uva_job(self, job_id: int, layer: int, done, entries) -> None:
        """A uva-path job issued: saved once `done` (its CUDA event; None: already) has
        completed."""
        self._jobs[job_id] = (SaveJob(layer, 0, []), entries)
        self._uva.append((done, job_id))
        self.stats.jobs += 1

    def _dma_plan(self, entries) -> list[tuple[int, int, list | None]] | None:
        """uva path, a prefill job: its slices `[i, j)` of at most a staging's blocks, each
        with its runs of host blocks if DMA moves it (None: the save kernel does, for more
        than `DMA_MAX_COPIES` copies). None without a staging (or on the engine path)."""
        step = self.dma_blocks
        if not step:
            return None
        plan = []
        for i in range(0, len(entries), step):
            runs = host_runs(entries[i : i + step])
            copies = 2 * len(runs) * (1 if self._copy2d.api == "memcpy2d" else self.heads)
            plan.append((i, i + step, runs if copies <= DMA_MAX_COPIES else None))
        return plan

    def _issue_dma(self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries, runs) -> None:
        """`uva` path, a job of a few runs of host blocks: one gather into the device
        staging, then per run one strided DMA copy of every head's K and one of V
        (`StridedCopy`; a copy per head measured 0.78 of the D2H peak), all on the copy
        stream (which orders the next job's gather after these copies; a second stream
        for the copies with a double staging measured half as fast on the H100); an event
        marks the save complete. (Jobs larger than the staging are split by the caller.)"""
        job_id, self._next_uva = self._next_uva, self._next_uva + 1
        hk, hv = self.host.k[layer], self.host.v[layer]
        bs, n, H, d = self.block_size, len(entries), self.heads, self.head_dim
        dk = self._stage_k[: H * n * bs * d].view(H, n * bs, d)
        dv = self._stage_v[: H * n * bs * d].view(H, n * bs, d)
        done = None
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            gather_pages_head_major(k_buf, v_buf, tables[0], dk, dv, bs)
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
        self._uva_job(job_id, layer, done, entries)
        self.stats.dma_jobs += 1

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

    def _issue(
        self, layer: int, k_buf, v_buf, tables: torch.Tensor, entries: list[_Entry], plan=None
    ):
        """One job: `entries` (at most a job's rows) of one layer. `plan` (prefill chunks,
        `_dma_plan`): the uva path moves runs of host blocks by DMA; decode flushes never
        do (their copies and gathers per layer cost the step more host time than one
        launch)."""
        if self.path == "uva":
            if plan is None:
                return self._issue_uva(layer, k_buf, v_buf, tables, entries)
            for i, j, runs in plan:
                part, t = entries[i:j], tables[:, i:j]
                if runs is not None:
                    self._issue_dma(layer, k_buf, v_buf, t, part, runs)
                else:
                    self._issue_uva(layer, k_buf, v_buf, t, part)
            return
        pages = tables[0]
        step = self.max_job_rows // self.block_size
        if len(entries) > step:
            for i in range(0, len(entries), step):
                self._issue(layer, k_buf, v_buf, tables[:, i : i + step], entries[i : i + step])
            return
        n_rows = len(entries) * self.block_size
        r0 = self._reserve_rows(n_rows)
        H, d = self.heads, self.head_dim
        dk = self._stage_k[: H * n_rows * d].view(H, n_rows, d)
        dv = self._stage_v[: H * n_rows * d].view(H, n_rows, d)
        sk, sv = self.engine.staged(r0, n_rows)
        job = SaveJob(layer, r0, [(e.host, 0, self.block_size) for e in entries])
        if self.cuda:
            job.gpu_flag = True
            job_id = self.engine.peek_next_id()
            slot = job_id % FLAG_SLOTS
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                gather_pages_head_major(k_buf, v_buf, pages, dk, dv, self.block_size)
                self._gathered.record(self.stream)
                sk.copy_(dk, non_blocking=True)
                sv.copy_(dv, non_blocking=True)
                self._seq[slot].fill_(job_id + 1)
                flags = self.engine.flags
                flags[slot : slot + 1].copy_(self._seq[slot : slot + 1], non_blocking=True)
            tables.record_stream(self.stream)
            if self.engine.submit(job) != job_id:
                raise RuntimeError("copy engine job ids went out of step with the flags")
        else:
            gather_pages_head_major(k_buf, v_buf, pages, dk, dv, self.block_size)
            sk.copy_(dk)
            sv.copy_(dv)
            job_id = self.engine.submit(job)
        self._jobs[job_id] = (job, entries)
        self._ring.append((job_id, r0, n_rows))
        self.stats.jobs += 1

    # -- acknowledgements and health (scheduler) ---------------------------------------
    def _retire(self, job_id: int) -> None:
        job, entries = self._jobs.pop(job_id)
        if job.layer == self.layers - 1:  # a block is saved once its last layer is
            for e in entries:
                r = self._reqs.get(e.rid)
                if r is not None and r.row == e.row:
                    r.saved = max(r.saved, e.block + 1)
            self.stats.blocks_saved += len(entries)
            self.stats.bytes_saved += len(entries) * self._block_bytes * self.layers
        while self._ring and self._ring[0][0] not in self._jobs:
            self._ring.popleft()

    def poll(self) -> None:
        """Take the engine's acknowledgements; restart a dead engine and redo its jobs."""
        if self.engine is None:  # uva: a job is saved once its event has completed
            while self._uva and (self._uva[0][0] is None or self._uva[0][0].query()):
                self._retire(self._uva.popleft()[1])
            return
        try:
            self.engine.check_health()
            self.engine.poll()
        except EngineDied as e:
            self._recover(e)
            return
        for job_id in sorted(self.engine.done):
            self.engine.done.discard(job_id)
            if job_id in self._jobs:
                self._retire(job_id)
        if self.engine.failed:
            job_id, why = next(iter(self.engine.failed.items()))
            raise RuntimeError(f"the copy engine refused save job {job_id}: {why}")

    def _wait(self, job_id: int) -> None:
        if self.engine is None:
            while job_id in self._jobs:
                event = self._uva[0][0]
                if event is not None:
                    event.synchronize()
                self._retire(self._uva.popleft()[1])
            return
        try:
            self.engine.wait(job_id)
        except EngineDied as e:
            self._recover(e)
            self.drain()
            return
        self._retire(job_id)

    def drain(self) -> bool:
        """Wait until every issued save is acknowledged; returns whether any was
        outstanding. Blocks the host: tests, shutdown, and the next chunk of a prompt
        larger than HBM when nothing else can give its pages back (`sched.serving`)."""
        waited = bool(self._jobs)
        while self._jobs:
            self._wait(min(self._jobs))
        return waited

    def _recover(self, err: EngineDied) -> None:
        """Restart the engine without waiting for it and resubmit every unacknowledged
        job, in order, from its staging rows (complete: the copy stream is synchronised
        first, the one host sync of this failure path)."""
        logger.error("sglang-psa: %s; restarting the copy engine and redoing its saves", err)
        if self.cuda:
            self.stream.synchronize()
        old = sorted(self._jobs.items())
        self.engine.restart(wait=False)  # the jobs go out on the new engine's first beat
        self.engine.done.clear()
        self.engine.failed.clear()
        self._jobs.clear()
        self._ring.clear()
        for _, (job, entries) in old:
            job.gpu_flag = False
            jid = self.engine.submit(job)
            self._jobs[jid] = (job, entries)
            self._ring.append((jid, job.row0, len(entries) * self.block_size))
        self.stats.engine_restarts += 1
        self.stats.resubmitted_jobs += len(old)

    # -- reads and reports -------------------------------------------------------------
    def read_from_host(self, rid, blocks: list[int]) -> list[int]:
        """Decode reads `rid`'s `blocks` (indices within the request) from the host tier
        from the next step on; only acknowledged blocks qualify. Returns those switched.
        (`residency.Residency` builds eviction on this: it also moves the blocks'
        metadata rows and gives their pages back.)"""
        r = self._reqs.get(rid)
        if r is None:
            return []
        ok = [b for b in blocks if b < r.saved]
        if ok:
            val = to_device([-r.host[b] - 1 for b in ok], self.device, torch.int32)
            self.host_loc[r.row].index_copy_(0, to_device(ok, self.device), val)
            r.on_host = True
        return ok

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's KV over all layers and heads (what a save moves)."""
        return self._block_bytes * self.layers

    def request(self, rid) -> _Req | None:
        """`rid`'s row, saved-block count and host block ids (None: not planned yet)."""
        return self._reqs.get(rid)

    def host_strides(self) -> tuple[int, int, int]:
        """The host tier's (block, token, head) strides within one layer, for the kernel."""
        bs, d = self.block_size, self.head_dim
        return bs * d, d, self.blocks.num_blocks * bs * d

    def saved_blocks(self, rid) -> list[int]:
        """Host block ids of `rid`'s acknowledged blocks, in block order."""
        r = self._reqs.get(rid)
        return [] if r is None else r.host[: r.saved]

    def report(self) -> dict[str, int | str | None]:
        s = self.stats
        return {
            "blocks_planned": s.blocks_planned,
            "blocks_saved": s.blocks_saved,
            "bytes_saved": s.bytes_saved,
            "save_jobs": s.jobs,
            "save_jobs_dma": s.dma_jobs,
            "dma_copy": self._copy2d.api if self._copy2d else None,
            "save_jobs_in_flight": len(self._jobs),
            "blocks_pending": len(self._decode),
            "engine_restarts": s.engine_restarts,
            "engine_pid": self.engine.proc.pid if self.engine else None,
            "resubmitted_jobs": s.resubmitted_jobs,
            "dropped_blocks": s.dropped_blocks,
            "host_blocks_total": self.blocks.num_blocks,
            "host_blocks_used": self.blocks.used,
            "host_tier_bytes": self.host.nbytes,
            "staging_bytes": self._staging_bytes(),
        }

    def _staging_bytes(self) -> int:
        """Pinned staging-ring bytes (the engine path's; the uva path's staging is in
        `device_bytes`)."""
        if self.engine is None:
            return 0
        return 2 * self.engine.stage_k.numel() * self.engine.stage_k.element_size()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.host.close()


def wait_saved(wb: WriteBack, timeout: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll every `poll_s` until every issued job is acknowledged (tests, benchmarks)."""
    deadline = time.monotonic() + timeout
    while wb._jobs:
        wb.poll()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(wb._jobs)} save jobs unacknowledged after {timeout} s")
        time.sleep(poll_s)
