"""PSA's counters in SGLang's Prometheus endpoint (`--enable-metrics`).

SGLang runs prometheus_client in multiprocess mode: each process writes its
metrics to files under `PROMETHEUS_MULTIPROC_DIR`, and the HTTP server's
`/metrics` collects them all. The scheduler process creates `PSAMetrics` (one
label, `tp_rank`: with tensor parallelism each rank reports its own series; sum
them over `tp_rank` for the server) and refreshes it between decode steps at
most every `interval_s`, from host-side state only: the admission controller's
counts and device counters copied into pinned memory without a sync (so the
blocks-read fraction is one refresh late). SGLang's own metrics already
cover KV token usage, queue lengths and latencies.

| metric (prefix `sglang_psa:`) | meaning |
|---|---|
| `blocks_read_fraction` | KV blocks decode attention read / blocks it could read, since start |
| `running_requests`, `paused_requests` | requests admitted by working set; retracted ones |
| `working_set_units`, `capacity_units` | their working sets; the HBM budget (layer x KV head x block) |
| `admitted_total`, `retracted_total`, `finished_total`, `rejected_total` | admission events |
| `admission_deferrals_total` | scheduling rounds a queued request waited, all reasons |
| `admission_waits_working_set_total` | ... because the running working sets plus its estimate exceed HBM |
| `admission_waits_host_tier_total` | ... because the host tier cannot reserve its whole length yet (tiered home) |
| `admission_waits_kv_pages_total` | ... because SGLang's budget found too few KV pages (at the tiered home, after saved blocks and unit-cache pages made what room they could) |
| `blocks_saved_total`, `save_bytes_total` | blocks written back to the host tier and acknowledged (`--psa-kv-home tiered`) |
| `save_jobs_in_flight`, `host_blocks_used` | write-back jobs not yet acknowledged; host-tier blocks held |
| `copy_engine_restarts_total` | times a dead copy engine was restarted (its saves redone) |
| `blocks_evicted`, `evictions_total` | tiered home: saved blocks whose HBM page was given back (read from the host tier), now and ever |
| `unit_cache_pages` | tiered home: HBM pages the unit cache holds (one position per (layer, KV head) each, for a unit of any layer) |
| `units_cached_total` | tiered home: host units the unit cache brought into HBM because decode read them |
| `units_read_hbm_total`, `units_read_host_total` | tiered home: (layer, KV head, block) units decode read from HBM and from the host tier (the HBM hit rate) |
| `parked_requests`, `resumed_total` | tiered home: retracted requests waiting with their KV in the host tier; resumptions from it |
| `resumed_host_tokens_total`, `resumed_recomputed_tokens_total` | tiered home: prefix tokens resumptions read from the host tier; tokens they computed again |
"""

from __future__ import annotations

import time

GAUGES = {
    "blocks_read_fraction": "KV blocks decode attention read over blocks it could read",
    "running_requests": "requests running under working-set admission",
    "paused_requests": "retracted requests waiting to resume",
    "working_set_units": "working sets of the running requests (layer x KV head x block)",
    "capacity_units": "HBM budget for working sets (layer x KV head x block)",
    "admitted_total": "admissions (resumptions included)",
    "retracted_total": "retractions",
    "finished_total": "requests that left admission control",
    "rejected_total": "requests refused because they can never fit",
    "admission_deferrals_total": "scheduling rounds a queued request waited for room",
    "admission_waits_working_set_total": "rounds a queued request waited: working sets fill HBM",
    "admission_waits_host_tier_total": "rounds a queued request waited: host tier full",
    "admission_waits_kv_pages_total": "rounds a queued request waited: too few KV pages",
    "blocks_saved_total": "KV blocks written back to the host tier and acknowledged",
    "save_bytes_total": "bytes written back to the host tier and acknowledged",
    "save_jobs_in_flight": "write-back jobs not yet acknowledged by the copy engine",
    "host_blocks_used": "host-tier blocks held by requests",
    "copy_engine_restarts_total": "times a dead copy engine was restarted",
    "blocks_evicted": "tiered home: blocks of running requests read from the host tier, "
    "their HBM pages given back",
    "evictions_total": "tiered home: blocks whose HBM page was given back, ever",
    "unit_cache_pages": "tiered home: HBM pages the unit cache holds",
    "units_cached_total": "tiered home: host units brought into the unit cache, ever",
    "units_read_hbm_total": "tiered home: (layer, KV head, block) units decode read from HBM",
    "units_read_host_total": "tiered home: units decode read from the host tier",
    "parked_requests": "tiered home: retracted requests waiting with their KV in the host tier",
    "resumed_total": "tiered home: retracted requests resumed from the host tier",
    "resumed_host_tokens_total": "tiered home: prefix tokens resumptions read from the host tier",
    "resumed_recomputed_tokens_total": "tiered home: tokens resumptions computed again",
}
PREFIX = "sglang_psa:"


class PSAMetrics:
    """Gauges of one scheduler process. Create only after SGLang has set
    `PROMETHEUS_MULTIPROC_DIR` (it has, in any scheduler process with metrics on)."""

    def __init__(self, tp_rank: int, interval_s: float = 1.0):
        from prometheus_client import Gauge

        self.labels = {"tp_rank": str(tp_rank)}
        self.interval_s = interval_s
        self._last = -float("inf")
        self._gauges = {
            name: Gauge(
                PREFIX + name, doc, labelnames=list(self.labels), multiprocess_mode="mostrecent"
            ).labels(**self.labels)
            for name, doc in GAUGES.items()
        }

    def due(self) -> bool:
        """True at most once per `interval_s` (and the first time)."""
        now = time.monotonic()
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True

    def set(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            if value is not None:
                self._gauges[name].set(value)
