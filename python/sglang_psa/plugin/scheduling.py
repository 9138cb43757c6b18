"""Working-set admission, retraction and capacity checks inside SGLang's scheduler.

One `PSAServing` per scheduler process (`sched.serving`, part of what
`sched.process.assemble` builds with the `psa` backend) owns an `AdmissionController`
whose capacity is HBM for working sets in units of one (layer, KV head, block). The
hooks below find it with one lookup (`_serving`) and call its methods; with no
`--sparse-mode` there is none and every hook passes straight through.

- `PrefillAdder.add_one_req` (around): a new request is admitted only while the
  working sets of the running ones plus its estimate fit (a prefix it matched in the
  prefix cache counted once with the running requests that share it); otherwise it waits in
  SGLang's queue (the adder stops for this round), never dropped. With nothing
  running it is admitted anyway, so the server cannot stall. At the tiered home
  an admitted request then makes room: saved blocks of running requests leave HBM
  until SGLang's budget holds it.
- `ScheduleBatch.check_decode_mem` (around): before each decode step, the blocks
  the backend read in the last step are recorded as each request's working set;
  if the selected requests' working sets outgrow the cache, SGLang retracts
  (with its own victim policy; the check honours `selected_indices`). At the
  tiered home, pages of saved blocks (then of the unit cache) are given back
  first when the step would find the allocator short (`mem_cache.residency`), as
  they are before a queued prompt is refused for want of pages, and the unit
  cache is refreshed.
- `release_kv_cache` (after): a finished request is forgotten, a retracted one
  keeps its history for when it resumes.
- `Scheduler.abort_request`, `_abort_on_waiting_timeout`, `_abort_on_queued_limit`
  (around): a request SGLang drops from its waiting queue (it releases nothing of a
  waiting request) is released as a finished one is: at the tiered home the host
  blocks a matched request adopted, or a parked one kept, go back.
- `validate_input_length` (after): a request whose KV cannot fit the tiered
  home's host tier, or (KV in HBM only) whose working-set estimate alone exceeds
  the HBM for working sets, is refused with a message naming the flag to raise;
  SGLang turns it into HTTP 400. At the tiered home a working set beyond HBM is
  served, its extra blocks read across PCIe.
"""

from __future__ import annotations

from sglang_psa import releases
from sglang_psa.plugin import host_timing
from sglang_psa.releases import req_prefix_len, req_row
from sglang_psa.sched import prefill_budget
from sglang_psa.sched.host_timing import own_time, timed
from sglang_psa.sched.process import current
from sglang_psa.sched.serving import PSAServing


def _serving() -> PSAServing | None:
    """This scheduler process's admission (`sched.process.current`); None without
    `--sparse-mode`."""
    process = current()
    return None if process is None else process.serving


@own_time("admit")
def around_add_one_req(original, adder, req, has_chunked_req, truncation_align_size):
    serving = _serving()
    if serving is None:
        return original(adder, req, has_chunked_req, truncation_align_size)
    from sglang.srt.managers.schedule_policy import AddReqResult

    running = getattr(adder.running_batch, "reqs", None) or []
    alone = not running and not adder.can_run_list
    max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    was_paused = serving.is_paused(req.rid)
    if _resumes_chunked_strict(adder, req):
        if adder.can_run_list:  # the next round has a whole chunk
            return AddReqResult.OTHER
        serving.unpark(req)  # more than a chunk to compute: prefilled whole
    prefix = None
    if not was_paused:  # a resumed request's prefix is its own
        namespace = (getattr(req, "extra_key", None), releases.req_salt(req))
        prefix = serving.shared_prefix(
            req.rid, req.origin_input_ids, req_prefix_len(req), namespace
        )
    if not serving.try_admit(req.rid, len(req.origin_input_ids), alone, max_new, prefix):
        # It stays queued, and the queue is offered again once it may fit or a request
        # leaves (`PSAServing.retry_queue`, in `around_check_decode_mem`)
        if adder.running_batch is not None:
            adder.running_batch.batch_is_full = True
        return AddReqResult.OTHER
    slack = 2 * serving.cfg.block_size
    staged = serving.stages_prefill and adder.rem_chunk_tokens is not None
    if staged and serving.oversize(_holds(req, prefix=req_prefix_len(req)) + slack):
        result = _add_oversize(original, adder, req, running, serving, slack,
                               has_chunked_req, truncation_align_size)  # fmt: skip
        if req not in adder.can_run_list:
            serving.undo_admit(req.rid, was_paused)
            serving.waited("kv_pages", lambda: "a prompt larger than HBM waits for its first chunk")
        return result
    short = freed = 0
    if serving.tiered and running:  # pages of saved blocks make room
        short, reserve = _budget_short(adder, req, running, slack)
        alloc = adder.token_to_kv_pool_allocator
        freed = serving.make_room(running, short, alloc, cache_first=reserve)
    result = original(adder, req, has_chunked_req, truncation_align_size)
    if req not in adder.can_run_list:
        serving.undo_admit(req.rid, was_paused)
        if result == AddReqResult.NO_TOKEN:  # else the batch was full: no wait of ours
            serving.waited_for_pages(result, short, freed, len(running))
    return result


def _add_oversize(original, adder, req, running, serving, slack, *args):
    """A prompt larger than SGLang's KV pool in HBM, at the tiered home: SGLang's adder
    would never find the budget for it. Its first chunk gets room (saved blocks of the
    running requests leave HBM) and is sized to the pages free; the adder's budget is
    credited for the call, so that it admits the prompt as a chunked one; its later
    chunks get room in `around_add_chunked_req`."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    alloc = adder.token_to_kv_pool_allocator
    page = serving.cfg.block_size
    want = min(int(adder.rem_chunk_tokens), len(req.origin_input_ids)) + slack
    free = serving.room_for_chunk(None, running, alloc, want)
    with _chunk_cap(adder, (free - slack) // page * page, credit=True) as fits:
        if not fits:
            return AddReqResult.OTHER
        original(adder, req, *args)
    return adder.budget_state()


def _holds(req, prefix: int = 0) -> int:
    """The tokens SGLang's adder charges a request against HBM (`held_tokens`), less a
    `prefix` it does not store (a resumed request's, in the host tier)."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    max_new = getattr(req.sampling_params, "max_new_tokens", None) or 0
    return prefill_budget.held_tokens(
        len(req.origin_input_ids), _done(req), prefix, max_new, CLIP_MAX_NEW_TOKENS
    )


def _done(req) -> int:
    """The output a request holds already (a retracted request's, so far)."""
    return len(getattr(req, "output_ids", None) or ())


def _resumes_chunked_strict(adder, req) -> bool:
    """Whether a request resuming with a prefix (`TieredRequests.resume_prefix`) would be
    chunked by SGLang's `ignore_eos` path, which chunks only prompts without a prefix (it
    asserts so). Its few tokens wait a round for a whole chunk; more than a chunk are
    prefilled whole."""
    prefix = req_prefix_len(req)
    if not prefix or req_row(req) is not None:
        return False
    if not (req.sampling_params.ignore_eos and getattr(adder.tree_cache, "disable", True)):
        return False
    left = len(req.full_untruncated_fill_ids) - prefix
    return adder.rem_chunk_tokens is not None and left > adder.rem_chunk_tokens


class _chunk_cap:
    """Inside: the adder's chunk is at most `cap` tokens (the pages free), and with
    `credit` its token budgets are credited beyond any prompt, so that its checks against
    HBM pass; afterwards the budgets are SGLang's again, less what the adder charged."""

    CREDIT = 1 << 50

    def __init__(self, adder, cap: int, credit: bool = False):
        self.adder, self.cap, self.credit = adder, cap, credit

    def __enter__(self) -> bool:
        a = self.adder
        self.orig = a.rem_chunk_tokens
        if self.cap <= 0:
            return False
        self.set = min(self.orig, self.cap)
        a.rem_chunk_tokens = self.set
        if self.credit:
            _shift_offsets(a, -self.CREDIT)
        return True

    def __exit__(self, *exc) -> None:
        a = self.adder
        if self.cap <= 0:
            return
        a.rem_chunk_tokens = self.orig - (self.set - a.rem_chunk_tokens)
        if self.credit:
            _shift_offsets(a, self.CREDIT)


def _shift_offsets(adder, tokens: int) -> None:
    """Add `tokens` to the adder's token budget offsets, what its budget holds back (its
    own in 0.5.17, its `PrefillBudget`'s from 0.5.23 on: `releases.READS`)."""
    for key in ("adder.total_offset", "adder.current_offset"):
        releases.write(adder, key, releases.read(adder, key) + tokens)


@own_time("admit_chunk")
def around_add_chunked_req(original, adder, req):
    """The next chunk of a prompt larger than HBM (tiered home): give back pages of saved
    blocks, its own first, until the chunk fits, and size it to the pages free (SGLang
    adds a chunked request's next chunk whatever its budget says, a whole chunk when that
    budget is spent)."""
    serving = _serving()
    if serving is None or not serving.stages_prefill or adder.rem_chunk_tokens is None:
        return original(adder, req)
    slack = 2 * serving.cfg.block_size
    if not serving.oversize(_holds(req) + slack):
        return original(adder, req)
    running = getattr(adder.running_batch, "reqs", None) or []
    left = len(req.full_untruncated_fill_ids) - req_prefix_len(req)
    want = min(int(adder.rem_chunk_tokens), left) + slack
    alloc = adder.token_to_kv_pool_allocator
    free = serving.room_for_chunk(req, running, alloc, want)
    page = serving.cfg.block_size
    cap = (free - slack) // page * page
    if cap <= 0:  # SGLang adds the chunk regardless: it would not fit
        raise RuntimeError(
            f"sglang-psa: the next chunk of request {req.rid} finds {free} free KV tokens "
            "after every saved block left HBM; raise --max-total-tokens or lower "
            "--chunked-prefill-size"
        )
    with _chunk_cap(adder, cap):
        return original(adder, req)


def after_get_worker_info(result, worker):
    """Tiered home with staged prefill: the longest request is bounded by the model's
    context and the host tier, not by SGLang's KV pool in HBM (SGLang's scheduler and
    tokenizer check prompts against these two fields)."""
    serving = _serving()
    if serving is None or not serving.stages_prefill:  # a tiered home: it has a host tier
        return result
    context = int(worker.model_config.context_len)
    longest = max(result[4], min(context - 1, serving.host_tokens - 1))
    return (*result[:4], longest, longest - 5, *result[6:])


def around_init_req_max_new_tokens(original, scheduler, req):
    """SGLang caps a request's output so that its prompt and output fit its KV pool in
    HBM (a prompt larger than the pool gets no output at all). With staged prefill the
    tiered home holds a request's KV in the host tier, so the cap is the host tier's
    instead (the model's context and the host tier's size still bound it:
    `after_get_worker_info`, `after_validate_input_length`)."""
    serving = _serving()
    if serving is None or not serving.stages_prefill:
        return original(scheduler, req)
    hbm = scheduler.max_total_num_tokens
    scheduler.max_total_num_tokens = max(hbm, serving.host_tokens)
    try:
        return original(scheduler, req)
    finally:
        scheduler.max_total_num_tokens = hbm


def _budget_short(adder, req, running, slack: int) -> tuple[int, int]:
    """`(short, reserve)` (`prefill_budget.room_needed`): the tokens SGLang's prefill
    budget lacks now to take `req` (`slack` spare for page alignment), for `make_room` to
    free at the tiered home, and how many of them only feed the strict path's reservation
    for the running requests' output to come.

    SGLang's adder asks for the prompt plus the clipped output beside the running
    requests' expected growth (`rem_total_tokens`: `budget_shortfall`). A request with
    `ignore_eos`, with prefix caching off (`--disable-radix-cache`), takes a stricter
    path (`strict_shortfall`): every running request's whole remaining output counts
    against today's free pages (`cur_rem_tokens`), not a decayed share, so room made for
    less is refused again and again until their remaining outputs shrink."""
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, IGNORE_EOS_RESERVE_TOKENS

    params = req.sampling_params
    fill = prefill_budget.stored_tokens(len(req.origin_input_ids), _done(req), req_prefix_len(req))
    max_new = getattr(params, "max_new_tokens", None) or 0
    short = prefill_budget.budget_shortfall(
        fill, max_new, slack, int(adder.rem_total_tokens), CLIP_MAX_NEW_TOKENS
    )
    if not (getattr(params, "ignore_eos", False) and getattr(adder.tree_cache, "disable", True)):
        return prefill_budget.room_needed(short, None)
    demands = []  # as the adder counts them: the new request, the running, those added
    for r in [req, *running, *adder.can_run_list]:
        p = r.sampling_params
        ratio = 1.0 if p.ignore_eos else adder.new_token_ratio
        left = (p.max_new_tokens or 0) * ratio - len(r.output_ids)
        demands.append(prefill_budget.Demand(left, len(r.origin_input_ids) + len(r.output_ids)))
    strict = prefill_budget.strict_shortfall(
        fill, slack, demands, int(adder.cur_rem_tokens), IGNORE_EOS_RESERVE_TOKENS
    )
    return prefill_budget.room_needed(short, strict)


@own_time("decode_check")
def around_check_decode_mem(original, batch, selected_indices=None):
    serving = _serving()
    if serving is None:
        return original(batch, selected_indices)
    if serving.tiered and batch.reqs:  # pages for this round and the next ones
        alloc = batch.token_to_kv_pool_allocator
        serving.room_for_decode(batch.reqs, alloc, lambda n: _evict_unheld_prefixes(batch, n))
        serving.refresh(batch.reqs, alloc)
    if getattr(batch, "batch_is_full", False) and serving.retry_queue(batch.reqs):
        # SGLang stops trying queued prompts once one did not fit, until a request
        # leaves; the one refused may fit earlier (or, at the tiered home, saved blocks
        # can still make room for SGLang's pages), so it tries again.
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


def _evict_unheld_prefixes(batch, tokens: int) -> None:
    """Tiered home, a decode step short of pages: prefixes SGLang's tree keeps that no
    running request holds leave HBM first (SGLang's own `evict_from_tree_cache`, which
    plain SGLang's decode check calls too; with the `psa` radix cache they keep their host
    blocks, so a later request reads them from the host tier), and only then saved blocks
    of the running requests (`make_room`). Asked the other way round, a full pool of
    finished requests' prefixes pushed the running requests' blocks off HBM every step
    (seen on the H200, workload f: HBM hit rate 0.77, 0.99 of the pool in use)."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    evict_from_tree_cache(getattr(batch, "tree_cache", None), tokens)


@timed("plan_extend")
def after_prepare_for_extend(result, batch):
    """An extend batch is set up (its requests' lengths after it are known on the host):
    parked requests resume in their rows, the write-back plans the blocks it completes,
    a prefix with blocks off HBM is staged (`PSAServing.plan_extend`)."""
    serving = _serving()
    if serving is not None and serving.tiered and batch.reqs:
        prefix_lens = batch.prefix_lens if serving.stages_prefill else None
        alloc = batch.token_to_kv_pool_allocator
        serving.plan_extend(batch.reqs, batch.seq_lens_cpu.tolist(), prefix_lens, alloc)
    return result


@own_time("decode_alloc")
def around_alloc_for_decode(original, batch, token_per_req):
    """Under `--sparse-mode` the paged decode allocation is one launch
    (`mem_cache.decode_alloc`); where that does not apply, or the pool lacks the pages,
    SGLang's own path (which then reports the shortage as SGLang does)."""
    if _serving() is None:
        return original(batch, token_per_req)
    from sglang_psa.mem_cache import decode_alloc  # SGLang, Triton: in the scheduler only

    if decode_alloc.handles(batch, token_per_req):
        out = decode_alloc.allocate(batch)
        if out is not None:
            return out
    return original(batch, token_per_req)


@timed("plan_decode")
def after_prepare_for_decode(result, batch):
    """A decode batch is set up: the write-back plans the blocks earlier steps completed
    (and takes the copy engine's acknowledgements)."""
    serving = _serving()
    if serving is not None and serving.tiered and batch.reqs:
        alloc = batch.token_to_kv_pool_allocator
        serving.plan_decode(batch.reqs, batch.seq_lens_cpu.tolist(), alloc)
    return result


@own_time("release_pages")
def around_release_page_ids(original, allocator, *page_ids):
    """Tiered home: a request's table entries of blocks whose pages were given back point
    at page 0 (SGLang's padding page, never allocated); it is dropped from every release
    while any block is evicted, and from the first release after a request with evicted
    blocks ended (SGLang may defer its free to the end of a free group):
    `PSAServing.releasable`."""
    serving = _serving()
    if serving is not None:
        page_ids = serving.releasable(page_ids)
    return original(allocator, *page_ids)


@own_time("release")
def around_release_kv_cache(original, req, tree_cache, *args, **kwargs):
    """A finished request is forgotten; a retracted one (SGLang releases it uninserted,
    unfinished: `is_insert`, from 0.5.23 on `checkpoint`, false) keeps its history for
    when it resumes, and at the tiered home with staged prefill its saved blocks, which
    leave HBM before SGLang frees the rest of its KV (`TieredRequests.park`; with the psa
    radix cache its saves in flight are waited for instead, on every release)."""
    serving = _serving()
    if serving is None:
        return original(req, tree_cache, *args, **kwargs)
    insert = args[0] if args else kwargs.get(releases.path("release.insert"), True)
    retracted = not insert and not req.finished()
    if retracted and serving.stages_prefill:
        # (with the psa radix cache nothing is parked, on any release: its saves in flight
        # land and enter the prefix index, which its next match reads)
        serving.park(req, tree_cache.token_to_kv_pool_allocator)  # else prefilled again
    result = original(req, tree_cache, *args, **kwargs)
    serving.release(req.rid, retracted=retracted)
    return result


def around_prefix_kv_indices(original, batch, req):
    """(0.5.23) SGLang reads the slots of a new row's prefix at allocation: a parked
    request resuming from the host tier gets page 0 for each kept token
    (`TieredRequests.prefix_slots`; `resume_prefix` set its prefix's length), any other
    SGLang's own."""
    serving = _serving()
    slots = None if serving is None else serving.parked_prefix_slots(req)
    return original(batch, req) if slots is None else slots


def after_init_next_round_input(result, req, tree_cache=None, cow_mamba=None):
    """A queued request is considered for a prefill: a parked one (retracted, its saved
    blocks in the host tier) gets them as its prefix, so that only the tokens after them
    are computed again (`TieredRequests.resume_prefix`)."""
    serving = _serving()
    if serving is not None and tree_cache is not None:
        serving.resume_prefix(req)
    return result


def after_get_internal_state(result, scheduler, recv_req):
    """`/get_server_info` (and `Engine.get_server_info()`) report PSA's counters, and the KV
    pages neither free nor held by the prefix cache: what the leak tests read. With
    `SGLANG_PSA_HOST_TIMING=1`, every server (plain too) reports its scheduler loop's host
    time (`host_timing`)."""
    host_timing.server_info(result.internal_state)
    serving = _serving()
    if serving is None:
        return result
    total = int(scheduler.max_total_num_tokens)
    available = int(scheduler.token_to_kv_pool_allocator.available_size())
    cached = int(scheduler.tree_cache.evictable_size()) + int(
        getattr(scheduler.tree_cache, "protected_size", lambda: 0)()
    )
    kv = {
        "kv_total_tokens": total,
        "kv_available_tokens": available,
        "kv_cached_tokens": cached,
        "kv_held_tokens": total - available - cached,
        "req_slots_free": int(scheduler.req_to_token_pool.available_size()),
    }
    # Every TP rank answers this request in lockstep: rank 0 reports them all.
    result.internal_state["psa"] = serving.server_info(kv, _memory_bytes())
    return result


def _memory_bytes() -> dict[str, int | None]:
    """This process's GPU memory held by torch's allocator and the pinned host memory
    torch's host allocator holds (the soak test watches both for growth; the host tier,
    page-locked in place, is `writeback.host_tier_bytes`)."""
    import torch

    if not torch.cuda.is_available():
        return {"gpu_reserved_bytes": None, "pinned_bytes": None}
    pinned = getattr(torch.cuda, "host_memory_stats", lambda: {})()
    return {
        "gpu_reserved_bytes": int(torch.cuda.memory_reserved()),
        "pinned_bytes": pinned.get("allocated_bytes.current"),
    }


def _drops_waiting(original, scheduler, *args):
    """Calls SGLang's `original`, which may take requests out of its waiting queue
    without releasing anything of theirs (a waiting request holds no KV in SGLang's
    eyes): those it took out are released here (`PSAServing.dropped`). A matched request
    may hold host blocks of its prefix (the `psa` radix cache adopts them at the match),
    a retracted one its admission entry and, parked, its saved blocks. Returns what
    `original` returns."""
    serving = _serving()
    if serving is None:
        return original(scheduler, *args)
    before = list(scheduler.waiting_queue)
    result = original(scheduler, *args)
    if len(before) != len(scheduler.waiting_queue):
        after = {id(r) for r in scheduler.waiting_queue}
        serving.dropped([r.rid for r in before if id(r) not in after])
    return result


def around_abort_request(original, scheduler, recv_req):
    """SGLang pops an aborted request from its waiting queue without releasing anything
    (it holds no KV): the popped ones are released (`_drops_waiting`), and so is every
    paused request the abort matched that SGLang no longer holds."""
    result = _drops_waiting(original, scheduler, recv_req)
    serving = _serving()
    paused = [] if serving is None else serving.paused_requests()
    if not paused:
        return result
    live = {r.rid for r in scheduler.waiting_queue}
    live.update(r.rid for r in (getattr(scheduler.running_batch, "reqs", None) or []))
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        live.add(chunked.rid)
    abort_all = getattr(recv_req, "abort_all", False)
    for rid in paused:
        if rid in live:
            continue
        if abort_all or str(rid).startswith(recv_req.rid):
            serving.release(rid, retracted=False)
    return result


def around_abort_on_waiting_timeout(original, scheduler):
    """Requests that waited past `SGLANG_REQ_WAITING_TIMEOUT` leave SGLang's waiting queue
    unreleased: released here (`_drops_waiting`)."""
    return _drops_waiting(original, scheduler)


def around_abort_on_queued_limit(original, scheduler, recv_req):
    """A full waiting queue: SGLang refuses `recv_req` (True) or, with priority scheduling,
    pushes a waiting request out, neither released: both are here (`_drops_waiting`; a
    refused request re-queued after a retraction or preemption holds what a waiting one
    does)."""
    refused = _drops_waiting(original, scheduler, recv_req)
    serving = _serving()
    if refused and serving is not None:
        serving.dropped([recv_req.rid])
    return refused


def after_validate_input_length(result, req, max_req_input_len, allow_auto_truncate):
    serving = _serving()
    if serving is None:
        return result
    if result is not None:
        return result
    max_new = getattr(getattr(req, "sampling_params", None), "max_new_tokens", None)
    return serving.reject_reason(len(req.origin_input_ids), max_new)
