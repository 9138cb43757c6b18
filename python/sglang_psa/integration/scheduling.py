"""Working-set admission, retraction and capacity checks inside SGLang's scheduler.

One `PSAServing` per scheduler process (created with the `psa` backend) owns
an `AdmissionController` whose capacity is the HBM slot cache in units of one
(layer, KV head, block). The hooks below consult it; with no `--sparse-mode`
there is none and every hook passes straight through.

- `PrefillAdder.add_one_req` (around): a new request is admitted only while the
  working sets of the running ones plus its estimate fit; otherwise it waits in
  SGLang's queue (the adder stops for this round), never dropped. With nothing
  running it is admitted anyway, so the server cannot stall.
- `ScheduleBatch.check_decode_mem` (around): before each decode step, the blocks
  the backend read in the last step are recorded as each request's working set;
  if the selected requests' working sets outgrow the cache, SGLang retracts
  (with its own victim policy; the check honours `selected_indices`). At the
  tiered home, pages of saved blocks are given back first when the step would
  find the allocator short (`mem_cache.residency`), as they are before a queued
  prompt is refused for want of pages.
- `release_kv_cache` (after): a finished request is forgotten, a retracted one
  keeps its history for when it resumes.
- `validate_input_length` (after): a request whose KV cannot fit the host pool,
  or (KV in HBM) whose working-set estimate alone exceeds the slot cache, is
  refused with a message naming the flag to raise; SGLang turns it into HTTP
  400. With the KV on the host a working set beyond the page cache is served,
  its extra blocks read across PCIe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

from sglang_psa.config import PSAConfig, flag_name
from sglang_psa.sched import AdmissionController, Candidate, WorkingSetTracker
from sglang_psa.sched.working_set import always_attended_units


class PSAServing:
    def __init__(
        self,
        cfg: PSAConfig,
        layers: int,
        kv_heads: int,
        hbm_units: int,
        host_tokens: int | None = None,
    ):
        """`host_tokens`: what the tiered home's host tier holds (None: no host tier)."""
        self.cfg = cfg
        self.layer_heads = layers * kv_heads
        self.host_tokens = host_tokens
        self.controller = AdmissionController(hbm_units, WorkingSetTracker.from_config(cfg))
        # The backend's working sets by request-table row, as the GPU last published them
        # (host memory, read without a sync): (sizes, lengths measured at).
        self.measure: Callable[[], tuple[Any, Any]] | None = None
        self.read_fraction: Callable[[], float] | None = None  # the backend's, for server info
        # The backend's (blocks read, blocks readable) as last copied to the host, no sync.
        self.read_counts: Callable[[], tuple[int, int]] | None = None
        self.metrics = None  # PSAMetrics with --enable-metrics
        self.hbm_bytes: Callable[[], dict[str, int]] | None = None  # the backend's buffers
        self.writeback = None  # mem_cache.writeback.WriteBack with --psa-kv-home tiered
        self.residency = None  # mem_cache.residency.Residency, the same home
        self.deferrals = 0  # scheduling rounds a queued request waited for working-set room

    @property
    def gates_by_working_set(self) -> bool:
        """With the KV in HBM only, working sets bound admission and force retraction.
        At the tiered home a working set beyond HBM is read from the host tier across
        PCIe, so nothing waits or is retracted for it (SGLang's own token budget still
        applies)."""
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
        if not self.gates_by_working_set:
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
    def try_admit(
        self, rid: Hashable, prompt_tokens: int, alone: bool, max_new_tokens: int | None = None
    ) -> bool:
        """Admit `rid` if its working set fits beside the running ones (or if `alone`) and,
        with a host tier, the host blocks its whole length can fill are free."""
        if rid in self.controller.running:
            return True
        wb = self.writeback
        if wb is not None and not wb.reserve(rid, prompt_tokens + (max_new_tokens or 0)):
            self.deferrals += 1  # blocks of running requests come back as they end
            return False
        cand = Candidate(rid, prompt_tokens, self.estimate(prompt_tokens))
        if not self.gates_by_working_set:  # tracked for server info, never held back
            self.controller.admit_alone(cand)
            return True
        if self.controller.try_admit([cand]).admitted:
            return True
        if alone:  # nothing else runs: admit anyway rather than stall the server
            self.controller.admit_alone(cand)
            return True
        if wb is not None:
            wb.release(rid)
        self.deferrals += 1
        return False

    def undo_admit(self, rid: Hashable, was_paused: bool) -> None:
        """SGLang's own checks refused a request this controller had admitted."""
        if rid not in self.controller.running:
            return
        if self.writeback is not None:
            self.writeback.release(rid)
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
        stale or belongs to the row's previous request."""
        if self.measure is None:
            return
        sizes, lengths = self.measure()
        window = self.cfg.ws_window
        for req in reqs:
            row = getattr(req, "req_pool_idx", None)
            if row is None or req.rid not in self.controller.running:
                continue
            n = int(lengths[row])
            if n > 0 and 0 <= req.seqlen - n <= window:
                self.controller.on_step_size(req.rid, int(sizes[row]), self.total_units(n))
        if self.metrics is not None and self.metrics.due():
            self.metrics.set(self.metric_values())

    def metric_values(self) -> dict[str, float | None]:
        """The Prometheus gauges' values (`integration.metrics`), from host state only."""
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
            **(_writeback_metrics(self.writeback.report()) if self.writeback else {}),
            **(_residency_metrics(self.residency.report()) if self.residency else {}),
        }

    def fits(self, rids: Iterable[Hashable]) -> bool:
        if not self.gates_by_working_set:
            return True
        ctl = self.controller
        load = sum(ctl.load(r, ctl.running[r]) for r in rids if r in ctl.running)
        return load <= ctl.capacity_units

    def make_room(self, reqs, tokens: int, allocator) -> int:
        """Tiered home: give back HBM pages of `reqs`' saved blocks until `tokens` more
        tokens fit in SGLang's allocator; returns the tokens freed (0 elsewhere)."""
        if self.residency is None or tokens <= 0:
            return 0
        return self.residency.make_room(reqs, tokens, allocator)

    def promote(self, reqs, allocator) -> int:
        """Tiered home: bring evicted blocks the last step read back into HBM."""
        return 0 if self.residency is None else self.residency.promote(reqs, allocator)

    def release(self, rid: Hashable, retracted: bool) -> None:
        if self.residency is not None:
            self.residency.release(rid)
        if self.writeback is not None:  # a retracted request is prefilled and saved again
            self.writeback.release(rid)
        ctl = self.controller
        if retracted and rid in ctl.running:
            ctl.pause(rid)
        elif rid in ctl.running or rid in ctl.paused:
            ctl.finish(rid)


def _residency_metrics(rep: dict[str, int]) -> dict[str, int]:
    return {
        "blocks_evicted": rep["blocks_evicted"],
        "evictions_total": rep["evictions"],
        "promotions_total": rep["promotions"],
        "units_read_hbm_total": rep["units_read_hbm"],
        "units_read_host_total": rep["units_read_host"],
    }


def _writeback_metrics(rep: dict[str, int]) -> dict[str, int]:
    return {
        "blocks_saved_total": rep["blocks_saved"],
        "save_bytes_total": rep["bytes_saved"],
        "save_jobs_in_flight": rep["save_jobs_in_flight"],
        "host_blocks_used": rep["host_blocks_used"],
        "copy_engine_restarts_total": rep["engine_restarts"],
    }


_current: PSAServing | None = None


def current() -> PSAServing | None:
    return _current


def install(serving: PSAServing | None) -> None:
    global _current
    _current = serving


# --- hooks (registered in `integration.hooks`) -------------------------------------


def around_add_one_req(original, adder, req, has_chunked_req, truncation_align_size):
    serving = current()
    if serving is None:
        return original(adder, req, has_chunked_req, truncation_align_size)
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult

    running = getattr(adder.running_batch, "reqs", None) or []
    alone = not running and not adder.can_run_list
    max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    if serving.residency is not None and running:  # tiered: pages of saved blocks make room
        # what the adder will ask of its budget: the prompt, the clipped output, slack
        need = len(req.origin_input_ids) + min(max_new or 0, CLIP_MAX_NEW_TOKENS)
        need += 2 * serving.cfg.block_size
        alloc = adder.token_to_kv_pool_allocator
        serving.make_room(running, need - int(adder.rem_total_tokens), alloc)
    was_paused = req.rid in serving.controller.paused
    if not serving.try_admit(req.rid, len(req.origin_input_ids), alone, max_new):
        return AddReqResult.OTHER  # stays queued; retried on the next scheduling round
    result = original(adder, req, has_chunked_req, truncation_align_size)
    if req not in adder.can_run_list:
        serving.undo_admit(req.rid, was_paused)
    return result


def around_check_decode_mem(original, batch, selected_indices=None):
    serving = current()
    if serving is None:
        return original(batch, selected_indices)
    if serving.residency is not None and batch.reqs:  # a page per request, twice over
        alloc = batch.token_to_kv_pool_allocator
        need = 2 * len(batch.reqs) * serving.cfg.block_size
        serving.make_room(batch.reqs, need - int(alloc.available_size()), alloc)
        serving.promote(batch.reqs, alloc)
        if batch.batch_is_full and serving.residency.evictable(batch.reqs):
            # SGLang stops trying queued prompts once one did not fit, until a request
            # leaves; here saved blocks can still make room, so it tries again.
            batch.batch_is_full = False
    result = original(batch, selected_indices)
    if not result:
        return result
    serving.flush_step(batch.reqs)
    reqs = batch.reqs if selected_indices is None else [batch.reqs[i] for i in selected_indices]
    if len(reqs) <= 1:
        # Nothing left to retract: SGLang would abort a lone request as out of memory
        # (HTTP 500). Its KV is in HBM, so it is served, as a lone request is admitted.
        return True
    return serving.fits(r.rid for r in reqs)


def around_apply_war_barrier(original, scheduler):
    """Tiered home: the scheduler's stream waits for the whole last forward, not only for
    its pre-replay snapshot: the decode graph reads the request and location tables
    during its replay, and eviction and promotion rewrite them on that stream."""
    serving = current()
    if serving is not None and serving.residency is not None:
        runner = scheduler.model_worker.war_fastpath_runner
        runner.war_fastpath_read_done_event = None  # SGLang's whole-forward wait instead
    return original(scheduler)


def after_prepare_for_extend(result, batch):
    """An extend batch is set up (its requests' lengths after it are known on the host):
    the write-back plans the blocks it completes."""
    serving = current()
    if serving is not None and serving.writeback is not None and batch.reqs:
        serving.writeback.plan_extend(batch.reqs, batch.seq_lens_cpu.tolist())
    return result


def after_prepare_for_decode(result, batch):
    """A decode batch is set up: the write-back plans the blocks earlier steps completed
    (and takes the copy engine's acknowledgements)."""
    serving = current()
    if serving is not None and serving.writeback is not None and batch.reqs:
        serving.writeback.plan_decode(batch.reqs, batch.seq_lens_cpu.tolist())
    return result


def around_release_page_ids(original, allocator, *page_ids):
    """Tiered home: a request's table entries of blocks whose pages were given back point
    at page 0 (SGLang's padding page, never allocated); it is dropped from every release
    while any block is evicted, and from the first release after a request with evicted
    blocks ended (SGLang may defer its free to the end of a free group). (A boolean mask
    syncs, as SGLang's own free already does with `unique`; releases are not on the
    decode step.)"""
    serving = current()
    res = None if serving is None else serving.residency
    if res is not None and res.drops_page_zero:
        page_ids = tuple(p[p != 0] for p in page_ids)
        res.zero_pending = False
    return original(allocator, *page_ids)


def after_release_kv_cache(result, req, tree_cache, is_insert=True):
    serving = current()
    if serving is not None:
        serving.release(req.rid, retracted=not is_insert and not req.finished())
    return result


def after_get_internal_state(result, scheduler, recv_req):
    """`/get_server_info` (and `Engine.get_server_info()`) report PSA's counters, and the KV
    pages neither free nor held by the prefix cache: what the leak tests read."""
    serving = current()
    if serving is None:
        return result
    ctl = serving.controller
    if serving.writeback is not None:  # an idle server still takes acknowledgements here
        serving.writeback.poll()
    total = int(scheduler.max_total_num_tokens)
    available = int(scheduler.token_to_kv_pool_allocator.available_size())
    cached = int(scheduler.tree_cache.evictable_size()) + int(
        getattr(scheduler.tree_cache, "protected_size", lambda: 0)()
    )
    result.internal_state["psa"] = {
        "running": len(ctl.running),
        "paused": len(ctl.paused),
        "used_units": ctl.used_units,
        "capacity_units": ctl.capacity_units,
        "admitted": ctl.stats.admitted,
        "retracted": ctl.stats.retracted,
        "finished": ctl.stats.finished,
        "rejected": ctl.stats.rejected,
        "admission_deferrals": serving.deferrals,
        "kv_total_tokens": total,
        "kv_available_tokens": available,
        "kv_cached_tokens": cached,
        "kv_held_tokens": total - available - cached,
        "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
        "plugin_hbm_bytes": serving.hbm_bytes() if serving.hbm_bytes else None,
        **_memory_bytes(),
        "blocks_read_fraction": serving.read_fraction() if serving.read_fraction else None,
        "kv_home": serving.cfg.kv_home,
        # Write-back to the host tier (--psa-kv-home tiered), else None.
        "writeback": serving.writeback.report() if serving.writeback is not None else None,
        # Blocks whose HBM pages were given back (tiered home), else None.
        "residency": serving.residency.report() if serving.residency is not None else None,
    }
    return result


def _memory_bytes() -> dict[str, int | None]:
    """This process's GPU memory held by torch's allocator and its pinned host memory
    (the soak test watches both for growth)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu_reserved_bytes": None, "pinned_bytes": None}
    pinned = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return {
        "gpu_reserved_bytes": int(torch.cuda.memory_reserved()),
        "pinned_bytes": pinned.get("allocated_bytes.current"),
    }


def after_abort_request(result, scheduler, recv_req):
    """SGLang pops an aborted request from its waiting queue without releasing anything
    (it holds no KV); a retracted one is still paused here: forget every paused request
    the abort matched that SGLang no longer holds."""
    serving = current()
    if serving is None or not serving.controller.paused:
        return result
    live = {r.rid for r in scheduler.waiting_queue}
    live.update(r.rid for r in (getattr(scheduler.running_batch, "reqs", None) or []))
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        live.add(chunked.rid)
    abort_all = getattr(recv_req, "abort_all", False)
    for rid in list(serving.controller.paused):
        if rid in live:
            continue
        if abort_all or str(rid).startswith(recv_req.rid):
            serving.release(rid, retracted=False)
    return result


def after_validate_input_length(result, req, max_req_input_len, allow_auto_truncate):
    serving = current()
    if serving is None:
        return result
    if result is not None:
        return result
    max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    return serving.reject_reason(len(req.origin_input_ids), max_new)
