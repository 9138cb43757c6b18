"""The admission state of one scheduler process under `--sparse-mode`, and what the
scheduler hooks ask of that process.

One `PSAServing` per scheduler process, built by `sched.process.assemble` with the parts
it calls (given to its constructor, never set afterwards): the `AdmissionController`
whose capacity is HBM for working sets in units of one (layer, KV head, block), at the
tiered home the write-back, residency, the requests' passage through the tiered store
(`TieredRequests`) and the prefill stage, the decode backend's read-outs (working sets,
read fractions, buffer sizes), the TP agreement and the metrics. The scheduler hooks of
`plugin.scheduling` find it through `sched.process.current()` and call its methods only:
each tiered-store step a hook starts is one method here, which calls the part that owns
it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from sglang_psa.config import PSAConfig, flag_name
from sglang_psa.distributed import RankAgreement
from sglang_psa.releases import has, read, req_row
from sglang_psa.sched.admission import AdmissionController, Candidate, SharedPrefix
from sglang_psa.sched.estimates import WorkingSetTracker, always_attended_units
from sglang_psa.sched.host_timing import timed

logger = logging.getLogger(__name__)

# Why a queued request waited a scheduling round (`PSAServing.waits`):
WAIT_REASONS = (
    "working_set",  # the running working sets plus its estimate exceed HBM for them
    "host_tier",  # the tiered home's host tier cannot reserve its whole length yet
    "kv_pages",  # SGLang's own budget refused it (too few KV pages, after make_room)
)
WAIT_LOG_INTERVAL_S = 10.0
# Working-set sizes are recorded (with several TP ranks: agreed) on the first decode step
# and every this many after: the steps between cost the scheduler one count, not a pass
# over the batch (host time the decode loop waits for once a step is ~2 ms). The GPU
# measures each size over the last `PSAConfig.ws_window` steps, whenever it is read.
RECORD_EVERY_STEPS = 8
# A matched prefix counts as shared in whole granules of this many tokens
# (`PSAServing.shared_prefix`): questions about one document match it to depths that
# differ by their first words, and should share one count.
PREFIX_GRANULE_TOKENS = 1024


@dataclass(frozen=True)
class BackendReadouts:
    """What the decode backend publishes for the scheduler, each read without a sync."""

    # Working sets by request-table row as the GPU last published them: (sizes, lengths
    # measured at).
    measure: Callable[[], tuple[Any, Any]] | None = None
    # (blocks read, readable) since start, synced: server info (its fraction and counts)
    read_totals: Callable[[], tuple[int, int]] | None = None
    read_counts: Callable[[], tuple[int, int]] | None = None  # (blocks read, readable)
    hbm_bytes: Callable[[], dict[str, int]] | None = None  # the backend's GPU buffers
    # `--psa-audit-coverage`: the smallest true-mass share read, heads checked (syncs)
    coverage: Callable[[], dict | None] | None = None
    # (rows that ranked, rows in a kept-selection slot) since start, synced: server info
    rank_totals: Callable[[], tuple[int, int]] | None = None
    # Units read, readable and read from the host tier, per layer, synced: server info
    reads_by_layer: Callable[[], dict[str, list[int]]] | None = None


class PSAServing:
    def __init__(
        self,
        cfg: PSAConfig,
        layers: int,
        kv_heads: int,
        hbm_units: int,
        host_tokens: int | None = None,
        *,
        hbm_tokens: int = 0,
        readouts: BackendReadouts | None = None,
        writeback=None,
        residency=None,
        requests=None,
        stage=None,
        agreement: RankAgreement | None = None,
        metrics=None,
    ):
        """Admission over HBM of `hbm_units`, and the parts of this scheduler process it
        calls, given here once (`sched.process.assemble` builds them): `host_tokens`, what
        the tiered home's host tier holds (None: no host tier); `hbm_tokens`, SGLang's KV
        pool in HBM; the decode backend's `readouts`; at the tiered home its `writeback`
        (`mem_cache.writeback.WriteBack`), `residency` (`mem_cache.residency.Residency`)
        and `requests` (`mem_cache.request_kv.TieredRequests`: each request's record in
        the tiered store, parked, resumed and released there) and, where SGLang's Triton
        prefill can read a staged prefix, `stage` (`mem_cache.prefill_stage.PrefillStage`:
        a prompt larger than HBM is served); the TP ranks' `agreement`, through which
        every GPU measurement passes before a decision reads it, so that all ranks decide
        alike (`sglang_psa.distributed`; default: one rank); `metrics` (`PSAMetrics`, with
        `--enable-metrics`)."""
        self.cfg = cfg
        self.layer_heads = layers * kv_heads
        self.host_tokens = host_tokens
        self.hbm_tokens = hbm_tokens
        self.controller = AdmissionController(hbm_units, WorkingSetTracker.from_config(cfg))
        r = readouts or BackendReadouts()
        self.measure, self.read_totals = r.measure, r.read_totals
        self.read_counts, self.hbm_bytes, self.coverage = r.read_counts, r.hbm_bytes, r.coverage
        self.rank_totals, self.reads_by_layer = r.rank_totals, r.reads_by_layer
        self.writeback, self.residency, self.requests = writeback, residency, requests
        if writeback is not None:  # (`--psa-writeback-start`: `start_saving`)
            writeback.saving = cfg.writeback_start >= 1.0
        self.stage = stage
        # The dense prefill backends SGLang runs (`plugin.extend.after_hybrid_init` sets it
        # once SGLang built them): {"prefill": its class, "staged": the one a prefix staged
        # from the host tier runs on, or None}; None before.
        self.prefill_backends: dict | None = None
        self.agreement = agreement or RankAgreement()
        # flush_step calls with running requests (the same count on every TP rank), and
        # rid -> its length when its size was last recorded.
        self._decode_steps = 0
        self._recorded_at: dict = {}
        self.metrics = metrics
        # The last refusal of a queued request by this controller, `(reason, units it
        # needs free)` ("working_set" or "host_tier"), None once one is admitted: SGLang's
        # scheduler is not offered its queue again before then (`retry_queue`).
        self.refused: tuple[str, int] | None = None
        self._refusal_counted = False  # the refusal's own round counted its wait already
        # Scheduling rounds a queued request waited, by reason (`WAIT_REASONS`).
        self.waits = dict.fromkeys(WAIT_REASONS, 0)
        self._wait_logged = -float("inf")
        self._prefix_keys: dict[Hashable, tuple[int, int]] = {}  # rid -> (tokens, hash)

    @property
    def retracts_by_working_set(self) -> bool:
        """Working sets bound admission at every home (a new request waits while the
        running ones' fill HBM); with the KV in HBM only they also force retraction. At
        the tiered home a working set that outgrows HBM is read from the host tier across
        PCIe instead: nothing is retracted for it (SGLang's retraction would free the KV
        and prefill it again), and a request whose working set alone exceeds HBM is
        served, not refused."""
        return self.cfg.kv_home == "hbm"

    @property
    def tiered(self) -> bool:
        """The tiered home: a host tier, and saved blocks that give their HBM pages back
        (`residency`)."""
        return self.residency is not None

    @property
    def prefix_cached(self) -> bool:
        """The tiered home with the `psa` radix cache (its prefix index is set up)."""
        return self.writeback is not None and getattr(self.writeback, "index", None) is not None

    # -- sizes --------------------------------------------------------------------
    def total_units(self, tokens: int) -> int:
        return math.ceil(tokens / self.cfg.block_size) * self.layer_heads

    def estimate(self, tokens: int) -> int:
        blocks = math.ceil(tokens / self.cfg.block_size)
        floor = always_attended_units(self.cfg, blocks, self.layer_heads)
        return self.controller.tracker.estimate_new(self.total_units(tokens), floor)

    def reject_reason(self, prompt_tokens: int, max_new_tokens: int | None) -> str | None:
        need = prompt_tokens + (max_new_tokens or 0)
        if self.host_tokens is not None and need > self.host_tokens:
            return (
                f"the request needs KV for {need} tokens but the host tier holds "
                f"{self.host_tokens} ({flag_name('host_pool_gb')} {self.cfg.host_pool_gb:g}); "
                "send a shorter request or raise the flag"
            )
        if not self.retracts_by_working_set:
            return None
        est = self.estimate(prompt_tokens)
        if est > self.controller.capacity_units:
            return (
                f"the request's estimated working set ({est} block units) exceeds the HBM "
                f"slot cache ({self.controller.capacity_units}); raise "
                f"{flag_name('gpu_cache_gb')}"
            )
        return None

    # -- admission ----------------------------------------------------------------
    def is_paused(self, rid: Hashable) -> bool:
        """Whether `rid` was retracted and waits to be admitted again."""
        return rid in self.controller.paused

    def paused_requests(self) -> list[Hashable]:
        """The retracted requests waiting to be admitted again."""
        return list(self.controller.paused)

    @property
    def deferrals(self) -> int:
        """Scheduling rounds a queued request waited, all reasons."""
        return sum(self.waits.values())

    def waited(self, reason: str, detail: Callable[[], str]) -> None:
        """Count a round a queued request waited for `reason`; say why (`detail()`, built
        only then) in the log at most every `WAIT_LOG_INTERVAL_S` (an operator sees what
        holds the queue back). A queued request waits every scheduling round."""
        self.waits[reason] += 1
        now = time.monotonic()
        if now - self._wait_logged >= WAIT_LOG_INTERVAL_S:
            self._wait_logged = now
            logger.info(
                "sglang-psa: a queued request waits (%s: %s); waits so far %s",
                reason,
                detail(),
                self.waits,
            )

    def waited_for_pages(self, answer, short: int, freed: int, running: int) -> None:
        """SGLang's own budget refused a request admission had taken (`answer`, its
        verdict) after `make_room` freed `freed` of the `short` tokens it lacked from
        `running` requests: a round waited for `kv_pages`."""
        res = self.residency

        def detail() -> str:
            said = f"SGLang answered {getattr(answer, 'name', answer)}"
            if res is None:
                return said
            return (
                f"{said}; {max(short, 0)} tokens short, {freed} freed from {running} "
                f"running ({res.evicted_blocks} blocks evicted, {res.cache.pages} unit-cache "
                "pages)"
            )

        self.waited("kv_pages", detail)

    def shared_prefix(
        self, rid: Hashable, tokens: Sequence[int], prefix_len: int, namespace: Hashable
    ) -> SharedPrefix | None:
        """The cached prefix new request `rid` (prompt `tokens`) shares with other
        requests: its first `prefix_len` tokens, matched in the prefix cache, rounded down
        to `PREFIX_GRANULE_TOKENS` so that questions matching a document to slightly
        different depths count it once; None below one granule. Keyed by the prefix's
        content in its cache `namespace` (extra key and salt), hashed once per request."""
        p = prefix_len // PREFIX_GRANULE_TOKENS * PREFIX_GRANULE_TOKENS
        if p == 0:
            return None
        got = self._prefix_keys.get(rid)
        if got is None or got[0] != p:
            got = self._prefix_keys[rid] = (p, hash((namespace, tuple(tokens[:p]))))
        return SharedPrefix(got, self.total_units(p), self.total_units(len(tokens)))

    def try_admit(
        self,
        rid: Hashable,
        prompt_tokens: int,
        alone: bool,
        max_new_tokens: int | None = None,
        prefix: SharedPrefix | None = None,
    ) -> bool:
        """Admit `rid` if its working set fits beside the running ones (or if `alone`) and,
        with a host tier, the host blocks its whole length can fill are free. `prefix`
        (`shared_prefix`): what it shares with others, counted once among them."""
        if rid in self.controller.running:
            return True
        wb = self.writeback
        tokens = prompt_tokens + (max_new_tokens or 0)
        if wb is not None and not wb.reserve(rid, tokens):
            # blocks of running requests come back as they end
            self.refused, self._refusal_counted = ("host_tier", 0), True
            self.waited(
                "host_tier", lambda: f"{tokens} tokens, {wb.blocks.available} host blocks free"
            )
            return False
        cand = Candidate(rid, prompt_tokens, self.estimate(prompt_tokens), prefix)
        ctl = self.controller
        if ctl.try_admit([cand]).admitted:
            self.refused = None
            return True
        if alone:  # nothing else runs: admit anyway rather than stall the server
            ctl.admit_alone(cand)
            self.refused = None
            return True
        self._release_record(rid, keep_parked=True)
        self.refused = ("working_set", ctl.cost(ctl.load(rid, cand.est_units), prefix))
        self._refusal_counted = True
        self.waited(
            "working_set",
            lambda: (
                f"{len(ctl.running)} running hold {ctl.used_units} units, it needs an "
                f"estimated {cand.est_units}, HBM holds {ctl.capacity_units}"
            ),
        )
        return False

    def undo_admit(self, rid: Hashable, was_paused: bool) -> None:
        """SGLang's own checks refused a request this controller had admitted."""
        if rid not in self.controller.running:
            return
        self._release_record(rid, keep_parked=True)
        stats = self.controller.stats
        if was_paused:
            self.controller.pause(rid)
            stats.retracted -= 1
        else:
            self.controller.finish(rid)
            stats.finished -= 1
        stats.admitted -= 1  # counters read as if the attempt never happened

    # -- decode steps -------------------------------------------------------------
    @timed("serving.flush_step")
    def flush_step(self, reqs: Sequence) -> None:
        """Record the working-set sizes the GPU last published (before the next step), on
        the first step with running requests and every `RECORD_EVERY_STEPS` after. A
        row's value counts only if it was measured at most a window of steps ago for this
        request (its length then is close to the request's now); otherwise the row is
        stale or belongs to the row's previous request. With several TP ranks each row's
        size and length are the largest any rank measured (`agreement`, a collective on
        the host that blocks every rank's scheduler until all arrive). Only steps with
        running requests count: those are the steps every rank takes alike (a call with
        none may come on one rank only, and counting it would put that rank's collective
        on another step than the others', where all would wait). A record counts the
        steps a request decoded since its last (the tokens it gained; at its first, the
        steps behind its output), so its window fills by the steps it decoded."""
        if self.measure is None:
            return
        running = self.controller.running

        def decoding(req) -> bool:
            return req.rid in running and req_row(req) is not None

        if any(map(decoding, reqs)):
            self._decode_steps += 1
            if (self._decode_steps - 1) % RECORD_EVERY_STEPS == 0:
                self._record([r for r in reqs if decoding(r)])
        self._refresh_metrics()

    def _record(self, running: list) -> None:
        sizes, lengths = self.measure()
        rows = np.array([req_row(r) for r in running], dtype=np.int64)
        sizes, lengths = self.agreement.max(np.asarray(sizes)[rows], np.asarray(lengths)[rows])
        window, last = self.cfg.ws_window, self._recorded_at
        self._recorded_at = {}
        for req, size, n in zip(running, sizes.tolist(), lengths.tolist()):
            now = req.seqlen
            if req.rid in last:  # the tokens it gained since
                steps = max(1, now - last[req.rid])
            else:  # its first record: the decode steps behind its output (prefill gave one)
                steps = max(1, len(read(req, "req.output", None) or ()) - 1)
            self._recorded_at[req.rid] = now
            if n > 0 and 0 <= now - n <= window:
                self.controller.on_step_size(req.rid, size, self.total_units(n), steps=steps)

    def _refresh_metrics(self) -> None:
        if self.metrics is not None and self.metrics.due():
            self.metrics.set(self.metric_values())

    def metric_values(self) -> dict[str, float | None]:
        """The Prometheus gauges' values (`sched.metrics`), from host state only."""
        ctl, st = self.controller, self.controller.stats
        fraction = None
        if self.read_counts is not None:
            read, total = self.read_counts()
            fraction = read / total if total else None
        return {
            "blocks_read_fraction": fraction,
            "running_requests": len(ctl.running),
            "paused_requests": len(ctl.paused),
            "working_set_units": ctl.used_units,
            "capacity_units": ctl.capacity_units,
            "admitted_total": st.admitted,
            "retracted_total": st.retracted,
            "finished_total": st.finished,
            "rejected_total": st.rejected,
            "admission_deferrals_total": self.deferrals,
            **{f"admission_waits_{k}_total": n for k, n in self.waits.items()},
            **(_writeback_metrics(self.writeback.report()) if self.writeback else {}),
            **(_residency_metrics(self.residency_report()) if self.residency else {}),
        }

    def fits(self, rids: Iterable[Hashable]) -> bool:
        if not self.retracts_by_working_set:
            return True
        ctl = self.controller
        if ctl.used_units <= ctl.capacity_units:  # all running requests fit: so do these
            return True
        return ctl.used_by(rids) <= ctl.capacity_units

    @timed("serving.make_room")
    def make_room(self, reqs, tokens: int, allocator, cache_first: int = 0) -> int:
        """Tiered home: give back HBM pages of `reqs`' saved blocks until `tokens` more
        tokens fit in SGLang's allocator, the first `cache_first` from the unit cache
        (`Residency.make_room`); returns the tokens freed (0 elsewhere)."""
        if self.residency is None or tokens <= 0:
            return 0
        return self.residency.make_room(reqs, tokens, allocator, cache_first)

    @timed("serving.room_for_decode")
    def room_for_decode(self, reqs, allocator, evict_tree) -> int:
        """Tiered home, before a decode round of `reqs`: pages for it and the next rounds
        (`Residency.room_for_decode`; `evict_tree(tokens)`: SGLang's tree eviction, to
        `tokens` free); returns the tokens freed from `reqs`' blocks (0 elsewhere)."""
        if self.residency is None:
            return 0
        return self.residency.room_for_decode(reqs, allocator, evict_tree)

    @property
    def stages_prefill(self) -> bool:
        """Tiered home with a prefill backend that reads a staged prefix: a prompt larger
        than HBM is served (`mem_cache.prefill_stage`)."""
        return self.stage is not None

    def oversize(self, tokens: int) -> bool:
        """Whether a request holding `tokens` at once outgrows SGLang's KV pool in HBM, so
        that SGLang's own budget would never admit it: at the tiered home it is prefilled
        in chunks whose saved blocks leave HBM (`stages_prefill`)."""
        return self.stages_prefill and tokens >= self.hbm_tokens

    def room_for_chunk(self, req, running, allocator, tokens: int) -> int:
        """Tiered home, a prompt larger than HBM: give back pages of saved blocks (the
        prompt's own and the running requests') until `tokens` (its next chunk and some
        slack) are free; returns the tokens free. When too few blocks are saved yet (the
        last chunks' saves still in flight) it waits for the saves, a host sync on this
        path only, and tries again. `req` is None for a prompt's first chunk."""
        self.start_saving(why="a prompt larger than HBM is prefilled in chunks")
        res = self.residency
        reqs = [*([] if req is None else [req]), *running]
        if tokens > allocator.available_size():
            res.make_room(reqs, tokens - int(allocator.available_size()), allocator)
        if tokens > allocator.available_size() and self.writeback.drain():
            res.make_room(reqs, tokens - int(allocator.available_size()), allocator)
        if req is not None and has("prefix_slots"):
            res.sync_prefix(req)
        return int(allocator.available_size())

    @timed("serving.refresh")
    def refresh(self, reqs, allocator) -> int:
        """Tiered home: the unit cache takes spare pages and brings in the host units the
        last step read; returns the pages it took."""
        return 0 if self.residency is None else self.residency.refresh(reqs, allocator)

    @timed("serving.retry_queue")
    def retry_queue(self, reqs) -> bool:
        """Whether SGLang's scheduler, stopped from offering its queue to the adder after a
        refusal (`batch_is_full`, which SGLang lifts only when a request leaves), should
        offer it again this decode round (running `reqs`): after a working-set refusal
        once the units the refused request needs are free, after a host-tier one not
        before a request leaves, after SGLang's own refusal for pages while running
        requests have blocks that could leave HBM (tiered home). Offered every round
        instead, SGLang matched each queued prompt against the prefix cache every round
        for a refusal that could not change (seen on the H200, workload f_capped: 2.5 ms
        of a 7.5 ms decode round)."""
        if self.refused is None:
            return self.evictable(reqs) > 0
        reason, need = self.refused
        if reason == "working_set" and self.controller.free_units >= need:
            return True
        if self._refusal_counted:  # this round's refusal counted it
            self._refusal_counted = False
        else:  # a round the refused request waits without being tried
            self.waits[reason] += 1
        return False

    def evictable(self, reqs) -> int:
        """Tiered home: blocks of running `reqs` that could leave HBM now (0 elsewhere)."""
        return 0 if self.residency is None else self.residency.evictable(reqs)

    def releasable(self, page_ids: tuple) -> tuple:
        """The pages an allocator release may free (`Residency.releasable`: never page 0,
        where the entries of evicted blocks point); `page_ids` as given elsewhere."""
        return page_ids if self.residency is None else self.residency.releasable(page_ids)

    # -- the tiered store's steps, in the order the hooks take them ------------------
    def start_saving(self, allocator=None, why: str | None = None) -> None:
        """Tiered home: the write-back starts, for good, once less than
        `--psa-writeback-start` of SGLang's KV pool is free in `allocator` (TP ranks'
        allocators move in step, so all ranks start in the same round), or at once for
        `why` (a prompt larger than HBM). Until then blocks live in HBM alone; from then
        on the blocks the running requests filled before are saved over several rounds
        (`WriteBack.start`'s catch-up; at once for a prompt larger than HBM, whose chunks
        need their room now)."""
        wb = self.writeback
        oversize = why is not None
        if wb.saving:
            if oversize and wb.catching_up:  # its chunks' room comes from its own blocks
                wb.start()  # saved in full: the rest of the catch-up at once too
            return
        if why is None:
            if allocator is None or not self.hbm_tokens:
                return
            free = int(allocator.available_size())
            if free >= self.cfg.writeback_start * self.hbm_tokens:
                return
            why = f"{free / self.hbm_tokens:.0%} of the KV pool in HBM is free"
        # A prompt larger than HBM needs its own blocks saved chunk by chunk: no spread.
        wb.start(catch_up=not oversize)
        logger.info("sglang-psa: %s: full blocks are written back to the host tier from now "
                    "on (%s)", why, flag_name("writeback_start"))  # fmt: skip

    def plan_extend(self, reqs, seq_lens: list[int], prefix_lens=None, allocator=None) -> None:
        """Tiered home, an extend batch is set up (`seq_lens`: its lengths after it): its
        parked requests resume in their new rows (`TieredRequests.resume`), the write-back
        plans the blocks it completes (once started: `start_saving`, given SGLang's
        `allocator`), a matched prefix held only in the host tier is read from there
        (`Residency.read_prefix_from_host`), and with staged prefill a prefix with blocks
        off HBM is staged per layer (`PrefillStage.plan_batch`; `prefix_lens` is read only
        then)."""
        if self.stage is not None:
            self.requests.resume(reqs)
        self.start_saving(allocator)
        self.writeback.plan_extend(reqs, seq_lens)
        self.residency.read_prefix_from_host(reqs)
        if self.stage is not None:
            self.stage.plan_batch(reqs, prefix_lens)

    def plan_decode(self, reqs, seq_lens: list[int], allocator=None) -> None:
        """Tiered home, a decode batch is set up: the write-back plans the blocks earlier
        steps completed (once started: `start_saving`, given SGLang's `allocator`), and
        takes the copy engine's acknowledgements."""
        self.start_saving(allocator)
        self.writeback.plan_decode(reqs, seq_lens)

    def park(self, req, allocator) -> None:
        """Tiered home, SGLang retracts `req`: its saved blocks leave HBM and stay its own
        in the host tier (`TieredRequests.park`), before SGLang frees the rest."""
        self.requests.park(req, allocator)

    def resume_prefix(self, req) -> None:
        """SGLang asks its prefix cache for `req`: a parked one gets its kept blocks as
        its prefix (`TieredRequests.resume_prefix`)."""
        if self.parked(req.rid):
            self.requests.resume_prefix(req)

    def parked_prefix_slots(self, req):
        """The slots a resuming parked `req`'s new row gets for its prefix (page 0 for each
        kept token: `TieredRequests.prefix_slots`); None for any other request."""
        return None if self.requests is None else self.requests.prefix_slots(req)

    def unpark(self, req) -> None:
        """Parked `req` is prefilled whole after all (`TieredRequests.unpark`)."""
        self.requests.unpark(req)

    def residency_report(self) -> dict[str, int]:
        """Tiered home: residency's counters, the staged prefills' and the parked and
        resumed requests'."""
        staged = (
            self.stage.report()
            if self.stage is not None
            else {"staged_batches": 0, "staged_host_tokens": 0}
        )
        return {**self.residency.report(), **staged, **self.requests.report()}

    def _read_totals(self) -> dict:
        """Decode's KV blocks read and readable since start, and their fraction (0 before
        any decode step; all None without a decode backend), and the decode rows that
        scored and ranked their blocks against those that held a kept selection (None
        where no selection is kept): a client measures a window by the difference of two
        readings."""
        ranked, slotted = self.rank_totals() if self.rank_totals else (None, None)
        out = {"rows_ranked": ranked, "rows_kept_slot": slotted}
        out["reads_by_layer"] = self.reads_by_layer() if self.reads_by_layer else None
        if self.read_totals is None:
            keys = ("blocks_read_fraction", "blocks_read", "blocks_readable")
            return {**dict.fromkeys(keys), **out}
        read, total = self.read_totals()
        fraction = read / total if total else 0.0
        return {
            "blocks_read_fraction": fraction,
            "blocks_read": read,
            "blocks_readable": total,
            **out,
        }

    def server_info(self, kv: dict, memory: dict) -> dict:
        """This process's `psa` entry of server info: admission's counters, SGLang's KV
        pages and request slots (`kv`, as the hook counts them), the plugin's GPU buffers,
        the process's memory (`memory`), the decode read-outs and the tiered home's
        reports (None elsewhere), from every TP rank (`combine_ranks`: each answers in
        lockstep). An idle server takes the copy engine's acknowledgements here."""
        if self.writeback is not None:
            self.writeback.poll()
        ctl = self.controller
        state = {
            "running": len(ctl.running),
            "paused": len(ctl.paused),
            "used_units": ctl.used_units,
            "capacity_units": ctl.capacity_units,
            "admitted": ctl.stats.admitted,
            "retracted": ctl.stats.retracted,
            "finished": ctl.stats.finished,
            "rejected": ctl.stats.rejected,
            "admission_deferrals": self.deferrals,
            "admission_waits": dict(self.waits),  # the same, by reason
            **kv,
            "plugin_hbm_bytes": self.hbm_bytes() if self.hbm_bytes else None,
            **memory,
            **self._read_totals(),
            # --psa-audit-coverage: {min_true_coverage, heads_checked}, else None
            "coverage_audit": self.coverage() if self.coverage else None,
            "kv_home": self.cfg.kv_home,
            "prefill_backends": self.prefill_backends,
            # Write-back to the host tier (--psa-kv-home tiered), else None.
            "writeback": self.writeback.report() if self.writeback is not None else None,
            # Blocks whose HBM pages were given back, parked and resumed requests (tiered
            # home), else None.
            "residency": self.residency_report() if self.residency is not None else None,
        }
        return combine_ranks(self.agreement.gather(state))

    def parked(self, rid: Hashable) -> bool:
        """Whether retracted `rid` waits with its saved KV in the host tier
        (`TieredRequests.park`)."""
        return self.requests is not None and self.requests.parked(rid)

    def _release_record(self, rid: Hashable, keep_parked: bool) -> None:
        """Tiered home: `rid`'s record in the tiered store goes (`TieredRequests.release`);
        with `keep_parked`, a parked one stays (it waits with its host copy)."""
        if self.requests is not None and not (keep_parked and self.parked(rid)):
            self.requests.release(rid, finished=not keep_parked)

    def release(self, rid: Hashable, retracted: bool) -> None:
        """SGLang released `rid`'s KV. Finished or aborted: admission forgets it and its
        tiered-store record goes. Retracted: it is paused (its working-set history kept
        for when it resumes); a parked one keeps its record, any other is prefilled and
        saved again from scratch."""
        self._release_record(rid, keep_parked=retracted)
        self._prefix_keys.pop(rid, None)
        ctl = self.controller
        if retracted and rid in ctl.running:
            ctl.pause(rid)
        elif rid in ctl.running or rid in ctl.paused:
            ctl.finish(rid)

    def dropped(self, rids: Iterable[Hashable]) -> None:
        """SGLang dropped `rids` from its waiting queue (aborted, timed out, pushed out of
        a full queue) without releasing anything: each is released as an aborted request
        is (`release`): a paused one leaves admission, and at the tiered home its record
        goes with the host blocks it held (a prefix adopted when it was matched, a parked
        request's kept blocks)."""
        for rid in rids:
            self.release(rid, retracted=False)


def _residency_metrics(rep: dict[str, int]) -> dict[str, int]:
    return {
        "blocks_evicted": rep["blocks_evicted"],
        "evictions_total": rep["evictions"],
        "unit_cache_pages": rep["cache_pages"],
        "units_cached_total": rep["units_cached"],
        "units_read_hbm_total": rep["units_read_hbm"],
        "units_read_host_total": rep["units_read_host"],
        "parked_requests": rep["parked_requests"],
        "resumed_total": rep["resumed"],
        "resumed_host_tokens_total": rep["resumed_host_tokens"],
        "resumed_recomputed_tokens_total": rep["resumed_recomputed_tokens"],
    }


def _writeback_metrics(rep: dict[str, int]) -> dict[str, int]:
    return {
        "blocks_saved_total": rep["blocks_saved"],
        "save_bytes_total": rep["bytes_saved"],
        "save_jobs_in_flight": rep["save_jobs_in_flight"],
        "host_blocks_used": rep["host_blocks_used"],
        "copy_engine_restarts_total": rep["engine_restarts"],
    }


# Server-info entries each TP rank holds its own of (its GPU buffers, its host tier and
# copy engine, its unit cache); every other entry is agreed, the same on every rank.
PER_RANK = (
    "plugin_hbm_bytes", "gpu_reserved_bytes", "pinned_bytes", "writeback", "residency",
    "blocks_read", "blocks_readable",
)  # fmt: skip


def combine_ranks(states: list[dict]) -> dict:
    """One server-info entry from every TP rank's (rank order): the agreed entries as
    rank 0 has them, the `PER_RANK` ones summed over the ranks, the read fraction
    averaged (every rank reads the same blocks' count of its own heads), the coverage
    audit's smallest share the smallest of any rank's (each checks its own heads), and with
    several ranks each rank's own entry under `tp_ranks`, the summed keys under
    `tp_summed`."""
    if len(states) == 1:
        return states[0]
    out = dict(states[0])
    for key in PER_RANK:
        out[key] = _sum([s[key] for s in states])
    fractions = [s["blocks_read_fraction"] for s in states]
    if None not in fractions:
        out["blocks_read_fraction"] = sum(fractions) / len(fractions)
    audits = [s.get("coverage_audit") for s in states]
    if all(audits):
        lows = [a["min_true_coverage"] for a in audits if a["min_true_coverage"] is not None]
        out["coverage_audit"] = {
            "min_true_coverage": min(lows) if lows else None,
            "heads_checked": sum(a["heads_checked"] for a in audits),
        }
    out["tp_summed"] = list(PER_RANK)
    out["tp_ranks"] = states
    return out


_IDS = ("engine_pid",)  # per-rank entries that are names, not amounts


def _sum(values: list, key: str = ""):
    """Amounts summed, dicts key by key, anything else (process ids, None) as the list
    by rank."""
    if all(v is None for v in values):  # absent on every rank (no host tier): absent
        return None
    if all(isinstance(v, dict) for v in values):
        return {k: _sum([v.get(k) for v in values], k) for k in values[0]}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if key not in _IDS and all(map(number, values)):
        return sum(values)
    return values
