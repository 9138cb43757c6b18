"""Write-back of every full KV block to the host tier, through one of its transports.

`--psa-kv-home tiered`: SGLang's KV pool stays in HBM (the hot tier) and every
block that fills (in prefill or in decode) gets a copy in the host tier, laid
out per (layer, KV head, block) (`HostKVPool`), so a later step can read it
there, or cache single units of it (`unit_cache`), instead of keeping it in HBM.

Who calls what (one scheduler process, one thread; SGLang's overlap loop
prepares batch t+1 after launching forward t, then launches forward t+1):
- the scheduler hooks *plan*, on the host, from request lengths only (no GPU
  reads): `plan_extend` names the blocks an extend batch completes,
  `plan_decode` the blocks earlier decode steps completed; each planned block
  gets a host block id from the request's reservation (`HostBlocks`), recorded in
  the request's `RequestKV` (the table `records`: `mem_cache.request_kv`, whose
  `TieredRequests` parks, resumes and releases requests);
- the attention backend *issues*: after an extend batch's last layer wrote its KV
  (`issue_extend`, every layer at once), and, for decode, before a step's graph replay once
  enough blocks are pending (`issue_decode`), through the transport `path`
  chose (`transports/`: `engine`, `uva` or `dma`), on the copy stream behind an
  event on the compute stream;
- `poll()` (every scheduling round) takes the transport's acknowledgements: a
  block counts as saved, and may be read from the host, only after its job is
  acknowledged (on the engine path, a dead engine is restarted and its jobs redone).

The compute stream waits for the copy stream's last gather (microseconds)
before the next forward, so a page SGLang frees and hands out again is never
overwritten while a gather still reads it. Nothing here synchronises the host
with the GPU on the serving path except back pressure when the staging ring is
full of unacknowledged rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter

import numpy as np
import torch

from sglang_psa.mem_cache.fence import TableFence
from sglang_psa.mem_cache.host_blocks import HostBlocks
from sglang_psa.mem_cache.host_pool import HostKVPool
from sglang_psa.mem_cache.request_kv import RequestKV
from sglang_psa.mem_cache.transports.base import BLOCK, RID, Transport
from sglang_psa.mem_cache.transports.dma import DmaTransport
from sglang_psa.mem_cache.transports.engine import EngineTransport
from sglang_psa.mem_cache.transports.uva import UvaTransport
from sglang_psa.releases import req_row
from sglang_psa.sched.host_timing import timed


def to_device(values, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list (nested lists too) or numpy array as a `dtype` tensor on `device`,
    through pinned memory on CUDA: one small H2D copy, no sync. A list is built in pinned
    memory; an array is copied into it (`torch.tensor(array, pin_memory=True)` raises)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)  # a copy, as on CUDA
    if isinstance(values, np.ndarray):
        t = torch.empty(values.shape, dtype=dtype, pin_memory=True)
        t.copy_(torch.from_numpy(values))
    else:
        t = torch.tensor(values, dtype=dtype, pin_memory=True)
    return t.to(device, non_blocking=True)


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


# A catch-up's share of a planning call (`WriteBack.catch_up_blocks`): 64 MiB, ~1.3 ms of
# PCIe Gen5 (the 0.5B model: 170 blocks of 32 tokens; Llama-3.1-8B's shape: 16).
CATCH_UP_BYTES = 64 << 20


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
        process; a CUDA event is the acknowledgement): a prefill job whose host blocks
        form a few runs is gathered, every layer at once, into a device staging of up to
        `dma_blocks` blocks and copied into the host tier by DMA, one strided copy per
        run for K and one for V; any other job (decode flushes) is written, every layer
        at once, by one kernel through unified addressing (`transports.dma`; without
        `dma_blocks`, every job as `transports.uva`).
        The store benchmark measures both paths."""
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
        self.max_job_rows = min(max_job_rows or staging_rows, staging_rows)
        self.dma_blocks = dma_blocks if path == "uva" else 0
        self.stats = WriteBackStats()
        args = (self.host, self.device, self.stats, self._saved)
        self.transport: Transport
        if path == "engine":
            self.transport = EngineTransport(
                *args,
                staging_rows=staging_rows,
                max_job_rows=self.max_job_rows,
                heartbeat_timeout=heartbeat_timeout,
                slow_ms=engine_slow_ms,
                threads=threads,
            )
        elif self.dma_blocks:
            self.transport = DmaTransport(*args, blocks=self.dma_blocks)
        else:
            self.transport = UvaTransport(*args)
        self.engine = self.transport.engine if path == "engine" else None  # the copy engine
        self.stream = self.transport.stream  # the copy stream (None on CPU)
        self.blocks = HostBlocks(host_blocks)
        # The keeper of saved prefixes (`mem_cache.prefix_index`), fed by acknowledgements;
        # set by the `psa` radix cache, None without one.
        self.index = None
        # The block metadata (`mem_cache.page_meta.PageMeta`, set by the scheduler process):
        # each save copies its page's rows to the host block's, so a block read from the
        # host tier is scored however it left HBM (residency, or SGLang's tree freeing a
        # page no request held, its prefix matched later). None: nothing copied.
        self.meta = None
        self.decode_flush_blocks = decode_flush_blocks
        self._block_bytes = 2 * kv_heads * block_size * head_dim * self.host.k.element_size()
        # Whether blocks are planned for a save (`PSAServing` starts it at
        # `--psa-writeback-start`; on from the start by default). While off, planning
        # only follows each request's row; once on, a request's next plan takes every full
        # block it has, or, after `start(catch_up=True)`, each request's plan takes the
        # blocks it completed since its last plan and, of those from before, what is left
        # of `catch_up_blocks` for the planning call, until a decode call (every running
        # request) has none left (each save holds up the forward after it until its reads
        # of HBM are done: one save of a whole pool's blocks would be a pause).
        self.saving = True
        self.catching_up = False
        self.catch_up_blocks = max(
            decode_flush_blocks, CATCH_UP_BYTES // (self._block_bytes * layers)
        )
        # One record per request the tiered store knows (`mem_cache.request_kv`).
        self.records: dict[object, RequestKV] = {}
        # Ended requests whose issued saves are still in flight (`TieredRequests.release`):
        # out of `records`, holding their host blocks until the last is acknowledged, so
        # the prefix index learns those blocks too; then `on_ended(rec)` releases them.
        self.ending: dict[object, RequestKV] = {}
        self.on_ended: Callable[[RequestKV], None] | None = None
        self._decode: list[tuple] = []  # planned by decode, not issued yet
        self._extend: list[tuple] = []  # planned for the next extend forward
        # Where decode reads a block, by (request-table row, block): 0 from its HBM page,
        # -(host block) - 1 from the host tier (a saved block whose HBM copy is not to be
        # read). The backend gathers it into the step's block table inside the graph.
        rows, blocks = table_shape or (1, 1)
        self.host_loc = torch.zeros(rows, blocks, dtype=torch.int32, device=self.device)
        # Orders rewrites of the tables the decode graph reads after its replay
        # (`mem_cache.fence`): armed by the backend at each decode launch.
        self.fence = TableFence()

    # -- reservations (admission) and the write-back's share of a request -------------
    def reserve(self, rid, tokens: int) -> bool:
        """Reserve the host blocks a request of `tokens` tokens can fill; its record is
        created here (kept only if the reservation holds)."""
        rec = self.records.get(rid) or RequestKV(rid)
        if not self.blocks.reserve(rec, tokens // self.block_size):
            return False
        self.records[rid] = rec
        return True

    def forget(self, rec: RequestKV) -> None:
        """`rec` leaves the tiered store (`TieredRequests.release`; the caller takes it out
        of `records`): its planned, unissued saves are dropped, its row reads HBM again and
        its host blocks and reservation return to the free list."""
        self.leave_row(rec)
        self.drop_plans(rec.rid)
        self.blocks.free(rec)

    def leave_row(self, rec: RequestKV) -> None:
        """`rec` leaves its request-table row: the row's location table reads HBM again."""
        if rec.on_host and rec.row is not None:
            self.fence()
            self.host_loc[rec.row, : len(rec.host)] = 0
        rec.host_read.clear()

    def drop_plans(self, rid, blocks=None) -> None:
        """Planned, unissued saves of `rid` (of its `blocks` only, if given) are dropped
        (SGLang frees their pages, or the blocks switched to another's saved copy)."""
        for plan in (self._decode, self._extend):
            keep = [
                e for e in plan if e[RID] != rid or (blocks is not None and e[BLOCK] not in blocks)
            ]
            self.stats.dropped_blocks += len(plan) - len(keep)
            plan[:] = keep

    def start(self, catch_up: bool = False) -> None:
        """Blocks are planned for a save from now on; with `catch_up`, the blocks filled
        before are spread over planning calls (`catch_up_blocks` a call)."""
        self.saving, self.catching_up = True, catch_up

    # -- planning (scheduler, host only) ---------------------------------------------
    def _budget(self) -> list[int] | None:
        """A planning call's catch-up share: [blocks left, whether a request was cut]."""
        return [self.catch_up_blocks, 0] if self.catching_up else None

    def _caught_up(self, budget: list[int] | None) -> None:
        """After a decode planning call (every running request): none was cut short, so
        none has blocks from before the start left to plan."""
        if budget is not None and not budget[1]:
            self.catching_up = False

    def _plan(self, rid, row: int, full_blocks: int, out: list[tuple], budget=None) -> None:
        rec = self.records.get(rid)
        if rec is not None and rec.row != row and (rec.row is not None or rec.parked):
            self.forget(rec)  # the request moved rows (re-prefilled): its blocks start over
            rec = None
        if rec is None:
            rec = self.records[rid] = RequestKV(rid)
        rec.row = row
        fresh, rec.seen = max(0, full_blocks - rec.seen), full_blocks
        if not self.saving:
            return
        start = rec.planned
        n = full_blocks - start
        if budget is not None and n > fresh:  # catching up: its new blocks, and of the
            if n - fresh > budget[0]:  # older ones what the call has left
                n, budget[1] = fresh + budget[0], 1
            budget[0] -= n - fresh
        if n <= 0:
            return
        out.extend((rid, row, b, h) for b, h in enumerate(self.blocks.take(rec, n), start))
        self.stats.blocks_planned += n

    def plan_extend(self, reqs, seq_lens) -> None:
        """An extend batch is about to run: every block it completes (its requests'
        lengths after it are `seq_lens`) is saved after its last layer wrote it."""
        self.poll()
        bs, budget = self.block_size, self._budget()
        self._extend = []
        for req, n in zip(reqs, seq_lens):
            self._plan(req.rid, int(req_row(req)), int(n) // bs, self._extend, budget)

    def plan_decode(self, reqs, seq_lens) -> None:
        """A decode batch is about to run with lengths `seq_lens` (its new tokens
        included): blocks below the newest token's block are written (their last
        token's KV was written by an earlier forward, already launched)."""
        self.poll()
        bs, budget = self.block_size, self._budget()
        records, saving = self.records, self.saving
        for req, n in zip(reqs, seq_lens):
            full = (int(n) - 1) // bs
            rec = records.get(req.rid)
            if (
                budget is None
                and rec is not None
                and rec.row is not None
                and rec.seen == full
                and (not saving or len(rec.host) >= full)  # (`rec.planned`, inlined)
            ):
                # No block completed since its last plan and none left to plan (at a
                # 32-token block, 31 steps in 32): passed over without reading its row (a
                # running request's row changes only with an extend, which plans it first).
                continue
            self._plan(req.rid, int(req_row(req)), full, self._decode, budget)
        self._caught_up(budget)

    # -- issuing (attention backend, on the forward's stream) -------------------------
    def _tables(self, entries: list[tuple], req_to_token: torch.Tensor) -> torch.Tensor:
        """`[2, n]` on the GPU: the pages of `entries` (SGLang's request table at each
        block's first token, divided by the page size) and their host blocks. One small
        H2D copy, no sync."""
        _, rows, blocks, hosts = zip(*entries)  # (columns at C speed: an extend's hundreds)
        cols = np.array((rows, blocks, hosts), dtype=np.int64)
        cols[1] *= self.block_size
        t = to_device(cols, self.device)
        pages = req_to_token[t[0], t[1]].long() // self.block_size
        return torch.stack([pages, t[2]])

    def before_forward(self) -> None:
        """The forward about to run may overwrite pages an issued gather still reads."""
        self.transport.before_forward()

    @timed("writeback.issue_extend")
    def issue_extend(self, k_bufs, v_bufs, req_to_token: torch.Tensor) -> None:
        """After an extend batch's last layer stored its KV (every layer's is written by
        then, in stream order): save the blocks the batch completes, every layer at once
        (`k_bufs`/`v_bufs`: SGLang's per-layer buffers)."""
        entries, self._extend = self._extend, []
        if not entries:
            return
        tables = self._tables(entries, req_to_token)
        self._copy_meta(tables)  # every layer's metadata of the blocks is written
        plan = self.transport.plan(entries)
        self.transport.issue_layers(
            k_bufs[: self.layers], v_bufs[: self.layers], tables, entries, plan
        )

    @timed("writeback.issue_decode")
    def issue_decode(self, k_bufs, v_bufs, req_to_token: torch.Tensor, force: bool = False) -> None:
        """Before a decode step's replay: save the pending decode blocks of every layer,
        once at least `decode_flush_blocks` are pending (or `force`)."""
        if not self._decode or (len(self._decode) < self.decode_flush_blocks and not force):
            return
        entries, self._decode = self._decode, []
        tables = self._tables(entries, req_to_token)
        self._copy_meta(tables)
        self.transport.issue_layers(k_bufs[: self.layers], v_bufs[: self.layers], tables, entries)

    def _copy_meta(self, tables: torch.Tensor) -> None:
        """The saved blocks' metadata rows (pages `tables[0]`) into their host blocks' rows
        (`tables[1]`), on the forward's stream: before any acknowledgement, so before any
        step reads the block from the host tier. A full block's metadata is final."""
        if self.meta is not None:
            self.meta.copy_rows(tables[0], tables[1] + self.meta.page_rows)

    @property
    def device_bytes(self) -> int:
        """GPU bytes: the staging buffer and the location table."""
        return self.transport.device_bytes + self.host_loc.numel() * self.host_loc.element_size()

    # -- acknowledgements (scheduler) --------------------------------------------------
    def _saved(self, layer: int, entries: list[tuple]) -> None:
        """The transport finished a job of `layer`: a block is saved once its last layer
        is."""
        if layer == self.layers - 1:
            acked: dict[int, RequestKV] = {}
            saved: list[int] = []
            # A job lists each request's blocks in one run (`_plan`): a run is checked
            # against the request's record at once, entry by entry only where it differs.
            for rid, run in groupby(entries, itemgetter(RID)):
                rec = self.records.get(rid) or self.ending.get(rid)
                if rec is None:
                    continue
                _, rows, blocks, hosts = zip(*run)
                b0, n = blocks[0], len(blocks)
                if (
                    rows.count(rec.row) == n
                    and blocks == tuple(range(b0, b0 + n))
                    and tuple(rec.host[b0 : b0 + n]) == hosts
                ):
                    saved.extend(hosts)
                    acked[id(rec)] = rec
                    continue
                for row, b, host in zip(rows, blocks, hosts):
                    # An ack of a request that ended or moved, or of a block it switched
                    # to another's id, names an id that may be someone else's by now:
                    # ignored.
                    if rec.row == row and b < len(rec.host) and rec.host[b] == host:
                        saved.append(host)
                        acked[id(rec)] = rec
            self.blocks.saved[saved] = True
            for rec in acked.values():
                self.blocks.advance(rec)  # saved state is the id's: a leading run
                if self.index is not None:
                    self.index.saved(rec)
            self.stats.blocks_saved += len(entries)
            self.stats.bytes_saved += len(entries) * self._block_bytes * self.layers
        for rid in {e[RID] for e in entries if e[RID] in self.ending}:
            if not self.in_flight(rid):  # its last save, acknowledged (and indexed) above
                rec = self.ending.pop(rid)
                if self.on_ended is not None:
                    self.on_ended(rec)

    def in_flight(self, rid) -> bool:
        """Whether a save of `rid` was issued and not yet acknowledged on every layer."""
        return any(e[RID] == rid for _, entries in self.transport.jobs.values() for e in entries)

    def poll(self) -> None:
        """Take the transport's completions (on the engine path: restart a dead engine
        and redo its jobs)."""
        self.transport.poll()

    def drain(self) -> bool:
        """Wait until every issued save is acknowledged; returns whether any was
        outstanding. Blocks the host: tests, shutdown, and the next chunk of a prompt
        larger than HBM when nothing else can give its pages back (`sched.serving`)."""
        return self.transport.drain()

    # -- reads and reports -------------------------------------------------------------
    def read_from_host(self, rid, blocks: list[int]) -> list[int]:
        """Decode reads `rid`'s `blocks` (indices within the request) from the host tier
        from the next step on; only acknowledged blocks of a request holding a row
        qualify. Returns those switched (`read_many_from_host` for one request)."""
        return self.read_many_from_host({rid: blocks}).get(rid, [])

    def read_many_from_host(self, wanted: dict) -> dict:
        """`read_from_host` for several requests (`wanted`: rid -> blocks) in one copy to
        the device (a decode round's eviction reaches many requests: a copy each cost
        the scheduler's step a launch and an H2D copy per request). Returns rid -> the
        blocks switched, for the requests with any. (`residency.Residency` builds
        eviction on this: it also moves the blocks' metadata rows and gives their pages
        back.)"""
        out, rows, cols, vals = {}, [], [], []
        for rid, blocks in wanted.items():
            rec = self.records.get(rid)
            if rec is None or rec.row is None:
                continue
            ok = [b for b in blocks if b < rec.saved]
            if ok:
                out[rid] = ok
                rows += [rec.row] * len(ok)
                cols += ok
                vals += [-rec.host[b] - 1 for b in ok]
                rec.host_read.update(ok)
        if vals:
            self.fence()
            at = to_device([rows, cols], self.device)
            self.host_loc[at[0], at[1]] = to_device(vals, self.device, torch.int32)
        return out

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's KV over all layers and heads (what a save moves)."""
        return self._block_bytes * self.layers

    def host_strides(self) -> tuple[int, int, int]:
        """The host tier's (block, token, head) strides within one layer, for the kernel."""
        bs, d = self.block_size, self.head_dim
        return bs * d, d, self.blocks.num_blocks * bs * d

    def saved_blocks(self, rid) -> list[int]:
        """Host block ids of `rid`'s acknowledged blocks, in block order."""
        rec = self.records.get(rid)
        return [] if rec is None else rec.host[: rec.saved]

    def report(self) -> dict[str, int | str | None]:
        s = self.stats
        return {
            "blocks_planned": s.blocks_planned,
            "blocks_saved": s.blocks_saved,
            "bytes_saved": s.bytes_saved,
            "save_jobs": s.jobs,
            "save_jobs_dma": s.dma_jobs,
            "dma_copy": self.transport.dma_copy,
            "save_jobs_in_flight": len(self.transport.jobs),
            "blocks_pending": len(self._decode),
            "saving": int(self.saving),
            "catching_up": int(self.catching_up),
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
        self.transport.close()
        self.host.close()


def wait_saved(wb: WriteBack, timeout: float = 30.0, poll_s: float = 0.01) -> None:
    """Poll every `poll_s` until every issued job is acknowledged (tests, benchmarks)."""
    deadline = time.monotonic() + timeout
    while wb.transport.jobs:
        wb.poll()
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{len(wb.transport.jobs)} save jobs unacknowledged after {timeout} s"
            )
        time.sleep(poll_s)
