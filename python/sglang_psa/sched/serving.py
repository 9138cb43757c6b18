"""The admission state of one scheduler process under `--sparse-mode`.

One `PSAServing` per scheduler process, assembled whole by the `psa` backend (its
constructor names everything the process owns: the `AdmissionController` whose capacity
is HBM for working sets in units of one (layer, KV head, block), the backend's tiered-home
parts (write-back, residency, the requests' passage through the tiered store) and
read-outs (working sets, read fractions, buffer sizes), the TP agreement, the metrics)
and installed once; the scheduler hooks of `plugin.scheduling` find it through
`current()`.
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
from sglang_psa.releases import has, req_row
from sglang_psa.sched.admission import AdmissionController, Candidate
from sglang_psa.sched.estimates import WorkingSetTracker, always_attended_units

logger = logging.getLogger(__name__)

# Why a queued request waited a scheduling round (`PSAServing.waits`):
WAIT_REASONS = (
    "working_set",  # the running working sets plus its estimate exceed HBM for them
    "host_tier",  # the tiered home's host tier cannot reserve its whole length yet
    "kv_pages",  # SGLang's own budget refused it (too few KV pages, after make_room)
)
WAIT_LOG_INTERVAL_S = 10.0


@dataclass(frozen=True)
class BackendReadouts:
    """What the decode backend publishes for the scheduler, each read without a sync."""

    # Working sets by request-table row as the GPU last published them: (sizes, lengths
    # measured at).
    measure: Callable[[], tuple[Any, Any]] | None = None
    read_fraction: Callable[[], float] | None = None  # blocks read / readable, server info
    read_counts: Callable[[], tuple[int, int]] | None = None  # (blocks read, readable)
    hbm_bytes: Callable[[], dict[str, int]] | None = None  # the backend's GPU buffers


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
        agreement: RankAgreement | None = None,
        metrics=None,
    ):
        """Everything one scheduler process owns under `--sparse-mode`, given here (the
        backend assembles it): `host_tokens`, what the tiered home's host tier holds (None:
        no host tier); `hbm_tokens`, SGLang's KV pool in HBM; the backend's `readouts`;
        at the tiered home its `writeback` (`mem_cache.writeback.WriteBack`),
        `residency` (`mem_cache.residency.Residency`) and `requests`
        (`mem_cache.request_kv.TieredRequests`: each request's record in the tiered store,
        parked, resumed and released there); the TP ranks' `agreement`, through
        which every GPU measurement passes before a decision reads it, so that all ranks
        decide alike (`sglang_psa.distributed`; default: one rank); `metrics`
        (`PSAMetrics`, with `--enable-metrics`)."""
        self.cfg = cfg
        self.layer_heads = layers * kv_heads
        self.host_tokens = host_tokens
        self.hbm_tokens = hbm_tokens
        self.controller = AdmissionController(hbm_units, WorkingSetTracker.from_config(cfg))
        r = readouts or BackendReadouts()
        self.measure, self.read_fraction = r.measure, r.read_fraction
        self.read_counts, self.hbm_bytes = r.read_counts, r.hbm_bytes
        self.writeback, self.residency, self.requests = writeback, residency, requests
        self.agreement = agreement or RankAgreement()
        self.metrics = metrics
        # Scheduling rounds a queued request waited, by reason (`WAIT_REASONS`).
        self.waits = dict.fromkeys(WAIT_REASONS, 0)
        self._wait_logged = -float("inf")

    @property
    def retracts_by_working_set(self) -> bool:
        """Working sets bound admission at every home (a new request waits while the
        running ones' fill HBM); with the KV in HBM only they also force retraction. At
        the tiered home a working set that outgrows HBM is read from the host tier across
        PCIe instead: nothing is retracted for it (SGLang's retraction would free the KV
        and prefill it again), and a request whose working set alone exceeds HBM is
        served, not refused."""
        return self.cfg.kv_home == "hbm"

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

    def try_admit(
        self, rid: Hashable, prompt_tokens: int, alone: bool, max_new_tokens: int | None = None
    ) -> bool:
        """Admit `rid` if its working set fits beside the running ones (or if `alone`) and,
        with a host tier, the host blocks its whole length can fill are free."""
        if rid in self.controller.running:
            return True
        wb = self.writeback
        tokens = prompt_tokens + (max_new_tokens or 0)
        if wb is not None and not wb.reserve(rid, tokens):
            # blocks of running requests come back as they end
            self.waited(
                "host_tier", lambda: f"{tokens} tokens, {wb.blocks.available} host blocks free"
            )
            return False
        cand = Candidate(rid, prompt_tokens, self.estimate(prompt_tokens))
        if self.controller.try_admit([cand]).admitted:
            return True
        if alone:  # nothing else runs: admit anyway rather than stall the server
            self.controller.admit_alone(cand)
            return True
        self._release_record(rid, keep_parked=True)
        ctl = self.controller
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
    def flush_step(self, reqs: Sequence) -> None:
        """Record the working-set sizes the GPU last published (before the next step). A
        row's value counts only if it was measured at most a window of steps ago for this
        request (its length then is close to the request's now); otherwise the row is
        stale or belongs to the row's previous request. With several TP ranks each row's
        size and length are the largest any rank measured (`agreement`)."""
        if self.measure is None:
            return
        running = [r for r in reqs if req_row(r) is not None and r.rid in self.controller.running]
        if running:
            sizes, lengths = self.measure()
            rows = np.array([req_row(r) for r in running], dtype=np.int64)
            sizes, lengths = self.agreement.max(np.asarray(sizes)[rows], np.asarray(lengths)[rows])
            window = self.cfg.ws_window
            for req, size, n in zip(running, sizes.tolist(), lengths.tolist()):
                if n > 0 and 0 <= req.seqlen - n <= window:
                    self.controller.on_step_size(req.rid, size, self.total_units(n))
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
        load = sum(ctl.load(r, ctl.running[r]) for r in rids if r in ctl.running)
        return load <= ctl.capacity_units

    def make_room(self, reqs, tokens: int, allocator, cache_first: int = 0) -> int:
        """Tiered home: give back HBM pages of `reqs`' saved blocks until `tokens` more
        tokens fit in SGLang's allocator, the first `cache_first` from the unit cache
        (`Residency.make_room`); returns the tokens freed (0 elsewhere)."""
        if self.residency is None or tokens <= 0:
            return 0
        return self.residency.make_room(reqs, tokens, allocator, cache_first)

    @property
    def stages_prefill(self) -> bool:
        """Tiered home with a prefill backend that reads a staged prefix: a prompt larger
        than HBM is served (`mem_cache.prefill_stage`)."""
        return self.residency is not None and self.residency.stage is not None

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
        res = self.residency
        reqs = [*([] if req is None else [req]), *running]
        if tokens > allocator.available_size():
            res.make_room(reqs, tokens - int(allocator.available_size()), allocator)
        if tokens > allocator.available_size() and self.writeback.drain():
            res.make_room(reqs, tokens - int(allocator.available_size()), allocator)
        if req is not None and has("prefix_slots"):
            res.sync_prefix(req)
        return int(allocator.available_size())

    def refresh(self, reqs, allocator) -> int:
        """Tiered home: the unit cache takes spare pages and brings in the host units the
        last step read; returns the pages it took."""
        return 0 if self.residency is None else self.residency.refresh(reqs, allocator)

    def residency_report(self) -> dict[str, int]:
        """Tiered home: residency's counters and the parked and resumed requests'."""
        return {**self.residency.report(), **self.requests.report()}

    def parked(self, rid: Hashable) -> bool:
        """Whether retracted `rid` waits with its saved KV in the host tier
        (`TieredRequests.park`)."""
        return self.requests is not None and self.requests.parked(rid)

    def _release_record(self, rid: Hashable, keep_parked: bool) -> None:
        """Tiered home: `rid`'s record in the tiered store goes (`TieredRequests.release`);
        with `keep_parked`, a parked one stays (it waits with its host copy)."""
        if self.requests is not None and not (keep_parked and self.parked(rid)):
            self.requests.release(rid)

    def release(self, rid: Hashable, retracted: bool) -> None:
        """SGLang released `rid`'s KV. Finished or aborted: admission forgets it and its
        tiered-store record goes. Retracted: it is paused (its working-set history kept
        for when it resumes); a parked one keeps its record, any other is prefilled and
        saved again from scratch."""
        self._release_record(rid, keep_parked=retracted)
        ctl = self.controller
        if retracted and rid in ctl.running:
            ctl.pause(rid)
        elif rid in ctl.running or rid in ctl.paused:
            ctl.finish(rid)


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
PER_RANK = ("plugin_hbm_bytes", "gpu_reserved_bytes", "pinned_bytes", "writeback", "residency")


def combine_ranks(states: list[dict]) -> dict:
    """One server-info entry from every TP rank's (rank order): the agreed entries as
    rank 0 has them, the `PER_RANK` ones summed over the ranks, the read fraction
    averaged (every rank reads the same blocks' count of its own heads), and with
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
    out["tp_summed"] = list(PER_RANK)
    out["tp_ranks"] = states
    return out


_IDS = ("engine_pid",)  # per-rank entries that are names, not amounts


def _sum(values: list, key: str = ""):
    """Amounts summed, dicts key by key, anything else (process ids, None) as the list
    by rank."""
    if all(isinstance(v, dict) for v in values):
        return {k: _sum([v.get(k) for v in values], k) for k in values[0]}
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if key not in _IDS and all(map(number, values)):
        return sum(values)
    return values


_current: PSAServing | None = None


def current() -> PSAServing | None:
    return _current


def install(serving: PSAServing | None) -> None:
    global _current
    _current = serving
