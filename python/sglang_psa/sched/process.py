"""Everything one scheduler process owns under `--sparse-mode`, assembled in one place.

SGLang runs one scheduler process per TP rank. Under `--sparse-mode` that process owns
the parts below, each built once, in this order, by `assemble` (from SGLang's KV pool,
page allocator, request table, server args and TP size) and never completed from
outside afterwards; `SchedulerProcess` holds them, frozen:

| part | class | owns |
|---|---|---|
| `cfg` | `config.PSAConfig` | every knob |
| `meta` | `mem_cache.page_meta.PageMeta` | block metadata, a row per page (and per host block) |
| `stamps` | `mem_cache.read_stamps.ReadStamps` | last-read stamps, published working sets and heat |
| `counters` | `mem_cache.read_stamps.ReadCounters` | units decode read, per layer |
| `agreement` | `distributed.RankAgreement` | the TP ranks' agreement on what decisions read |
| `writeback` | `mem_cache.writeback.WriteBack` | host tier, saves, location table, the records |
| `residency` | `mem_cache.residency.Residency` | eviction of saved blocks, the unit cache |
| `requests` | `mem_cache.request_kv.TieredRequests` | each request's park, resume, trim, release |
| `stage` | `mem_cache.prefill_stage.PrefillStage` | prefill over a prefix that left HBM |
| `metrics` | `sched.metrics.PSAMetrics` | the Prometheus gauges (`--enable-metrics`) |
| `serving` | `sched.serving.PSAServing` | admission, and the scheduler hooks' calls |

The tiered store (`writeback` to `stage`) exists at `--psa-kv-home tiered` only, the
stage only over SGLang's token-major pool (which a Triton prefill reads per token:
SGLang's, or one built beside it for the staged batches), `metrics` only with
`--enable-metrics`; each is None otherwise.

Who holds what: the `psa` decode backend calls `assemble` once, in its constructor,
and reads `meta`, `stamps`, `counters`, `writeback`, `residency` and `stage`; the plugin
`register`s the result when SGLang builds that backend; the scheduler hooks
(`plugin.scheduling`, `plugin.extend`) find it with `current()` and call `serving` (and
`stage`), never a part behind it; so does the `psa` radix cache's factory
(`mem_cache.psa_radix_cache`, for `requests`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang_psa.config import PSAConfig, PSAConfigError
from sglang_psa.distributed import RankAgreement, kv_ranks
from sglang_psa.mem_cache import kv_budget
from sglang_psa.sched.serving import BackendReadouts, PSAServing

if TYPE_CHECKING:  # imported by `assemble`: the hooks import this module in every SGLang
    # process at plugin load, which stays free of the kernels these modules import
    from sglang_psa.mem_cache.page_meta import PageMeta
    from sglang_psa.mem_cache.prefill_stage import PrefillStage
    from sglang_psa.mem_cache.read_stamps import ReadCounters, ReadStamps
    from sglang_psa.mem_cache.request_kv import TieredRequests
    from sglang_psa.mem_cache.residency import Residency
    from sglang_psa.mem_cache.writeback import WriteBack


@dataclass(frozen=True)
class SchedulerProcess:
    """The parts of one scheduler process (module docstring: what each owns), wired to
    one another at construction: `serving` holds this `writeback`, `residency`,
    `requests`, `stage`, `agreement` and `metrics`; `residency` reads this `meta` and
    `stamps` and counts with `counters`; `requests` and `stage` act on this `writeback`."""

    cfg: PSAConfig
    meta: PageMeta
    stamps: ReadStamps
    counters: ReadCounters
    agreement: RankAgreement
    writeback: WriteBack | None
    residency: Residency | None
    requests: TieredRequests | None
    stage: PrefillStage | None
    metrics: object | None  # sched.metrics.PSAMetrics
    serving: PSAServing


def assemble(
    cfg: PSAConfig,
    pool,
    req_to_token: torch.Tensor,
    allocator=None,
    *,
    server_args=None,
    context_len: int = 0,
    tp_size: int = 1,
    tp_rank: int = 0,
    hbm_bytes: Callable[[], dict[str, int]] | None = None,
) -> SchedulerProcess:
    """Build every part of this scheduler process, in the order of the module docstring's
    table. `pool`: SGLang's KV pool (`MHATokenToKVPool`: its layers' buffers, sizes,
    `start_layer`); `req_to_token`: SGLang's request table; `allocator`: SGLang's page
    allocator (residency gives pages back to it; None: the one the hooks pass in first);
    `server_args`: SGLang's (read: `chunked_prefill_size`, `enable_metrics`);
    `context_len`: the model's; `tp_size`/`tp_rank`: this process's
    TP group (`--tp` > 1 without SGLang's TP group set up raises); `hbm_bytes`: the
    decode backend's report of its GPU buffers, for server info.

    Raises `PSAConfigError` naming the flag when the host tier holds no block or cannot
    be set up, or when the GPU has no room for the block metadata and stamps."""
    from sglang_psa.mem_cache.page_meta import PageMeta
    from sglang_psa.mem_cache.prefill_stage import PrefillStage, reads_token_major
    from sglang_psa.mem_cache.read_stamps import ReadCounters, ReadStamps
    from sglang_psa.mem_cache.request_kv import TieredRequests
    from sglang_psa.mem_cache.residency import Residency

    bs = cfg.block_size
    tiered = cfg.kv_home == "tiered"
    device = pool.k_buffer[0].device
    num_pages = (pool.size + bs) // bs  # SGLang's pool rows: its tokens and a padding page
    table_shape = (req_to_token.shape[0], -(-req_to_token.shape[1] // bs))  # page columns
    host_blocks = 0
    if tiered:  # block metadata and stamps keep a row per host block
        ranks = kv_ranks()  # each rank holds its share of the host tier
        host_blocks = kv_budget.host_blocks(cfg, _kv_bytes_per_token(pool), ranks)
        if host_blocks < 1:
            raise PSAConfigError("host_pool_gb", "holds no KV block of this model: raise it")
    try:  # (the metadata is in SGLang's KV budget: `plugin.kv_pool`)
        meta = PageMeta(
            pool.layer_num, num_pages, pool.head_num, pool.head_dim, bs,
            mean=cfg.needs_key_mean, bounds=cfg.needs_key_bounds,
            key_dtype=kv_budget.metadata_dtype(pool.dtype), device=device,
            host_rows=host_blocks, bound_bits=cfg.bound_bits,
            code_bits=cfg.code_bits if cfg.needs_key_codes else 0,
        )  # fmt: skip
        stamps = ReadStamps(
            pool.layer_num, pool.head_num, num_pages + host_blocks, cfg.ws_window,
            req_to_token.shape[0], bs, device,
            heat_blocks=table_shape[1] if tiered else 0,  # residency's heat
        )  # fmt: skip
        counters = ReadCounters(pool.layer_num, device, audit=cfg.audit_coverage)
    except torch.OutOfMemoryError as e:
        raise PSAConfigError(
            "sparse_mode",
            "not enough GPU memory for the block metadata and working-set buffers: lower "
            f"--mem-fraction-static or --max-total-tokens ({e})",
        ) from e
    agreement = RankAgreement.from_sglang(tp_size)  # ranks decide from agreed values
    writeback = residency = requests = stage = None
    if tiered:
        writeback = _writeback(cfg, pool, server_args, context_len, device, table_shape,
                               host_blocks)  # fmt: skip
        writeback.meta = meta  # each save leaves its metadata in the host block's row
        residency = Residency(
            writeback, meta, stamps, req_to_token, cfg, pool, allocator,
            unit_reads=counters.unit_reads, agreement=agreement,
        )  # fmt: skip
        requests = TieredRequests(writeback, residency, pool, req_to_token, bs)
        # Decided before SGLang builds the prefill backend (it builds the decode backend
        # first): SGLang's Triton prefill reads a staging per token, or one built beside
        # another backend for the staged batches (`plugin.extend.after_hybrid_init` checks).
        if reads_token_major(pool):
            stage = PrefillStage(writeback, pool, bs, pool.start_layer)
    metrics = None
    if getattr(server_args, "enable_metrics", False):
        from sglang_psa.sched.metrics import PSAMetrics

        metrics = PSAMetrics(tp_rank)
    serving = PSAServing(
        cfg,
        layers=pool.layer_num,
        kv_heads=pool.head_num,
        hbm_units=hbm_units(cfg, pool),
        host_tokens=host_blocks * bs if tiered else None,
        hbm_tokens=int(pool.size),
        readouts=BackendReadouts(
            stamps.read,
            counters.totals,
            counters.read_counts,
            hbm_bytes,
            counters.coverage_report,  # None without --psa-audit-coverage
            counters.rank_totals if cfg.keeps_selection else None,
            counters.by_layer,
        ),
        writeback=writeback,
        residency=residency,
        requests=requests,
        stage=stage,
        agreement=agreement,
        metrics=metrics,
    )
    return SchedulerProcess(
        cfg, meta, stamps, counters, agreement, writeback, residency, requests, stage, metrics,
        serving,
    )  # fmt: skip


def hbm_units(cfg: PSAConfig, pool) -> int:
    """HBM capacity for working sets in (layer, KV head, block) units: `--psa-gpu-cache-gb`
    when given, else SGLang's whole KV pool (everything resident: no extra constraint)."""
    unit_bytes = 2 * cfg.block_size * pool.head_dim * pool.dtype.itemsize
    if cfg.gpu_cache_gb is not None:
        return max(1, int(cfg.gpu_cache_gb * (1 << 30)) // unit_bytes)
    return max(1, pool.size // cfg.block_size) * pool.layer_num * pool.head_num


def _kv_bytes_per_token(pool) -> int:
    """K and V bytes of one token over all layers and heads (what SGLang's cell holds)."""
    return 2 * pool.layer_num * pool.head_num * pool.head_dim * pool.store_dtype.itemsize


def _writeback(
    cfg: PSAConfig, pool, server_args, context_len: int, device, table_shape, host_blocks: int
) -> WriteBack:
    """The host tier and its write-back (`--psa-kv-home tiered`). `engine`: the device
    staging holds one job (a prefill's blocks of one layer, up to the context), the
    pinned ring four such jobs, so prefill runs ahead of the engine by a few layers.
    `uva`: the device staging holds a prefill chunk's blocks of one layer, moved by
    DMA. The location table has the shape of the request table's page columns."""
    from sglang_psa.mem_cache.writeback import WriteBack

    chunk = int(getattr(server_args, "chunked_prefill_size", 0) or 0)
    job_rows = -(-max(context_len, chunk, cfg.block_size) // cfg.block_size) * cfg.block_size
    dma_blocks = -(-(chunk if chunk > 0 else cfg.max_inject_tokens) // cfg.block_size)
    try:
        return WriteBack(
            pool.layer_num, pool.head_num, pool.head_dim, pool.store_dtype, cfg.block_size,
            host_blocks, 4 * job_rows, device, max_job_rows=job_rows,
            table_shape=tuple(table_shape),
            threads=max(2, min(8, (os.cpu_count() or 4) // (2 * kv_ranks()))),
            path=cfg.writeback, dma_blocks=dma_blocks,
        )  # fmt: skip
    except (RuntimeError, torch.OutOfMemoryError) as e:
        raise PSAConfigError(
            "host_pool_gb",
            f"the host tier of {cfg.host_pool_gb:g} GiB or its copy engine could not be "
            f"set up ({e}); lower it or free host memory",
        ) from e


_process: SchedulerProcess | None = None


def register(process: SchedulerProcess | None) -> None:
    """The scheduler hooks of this process use `process` from now on (None: none, every
    hook passes straight through). The plugin registers what the `psa` backend
    assembled when SGLang builds it."""
    global _process
    _process = process


def current() -> SchedulerProcess | None:
    """This scheduler process's parts (`register`), or None without `--sparse-mode`.

    A lookup rather than a handle passed in, because SGLang calls several hooks with no
    object that leads to ours, and its objects have no place for a plugin's state:
    `validate_input_length` gets a request and two numbers, `release_kv_cache` a request
    and the prefix cache, `Req.init_next_round_input` a request, the Triton prefill's
    `forward_extend` a backend that knows nothing of the decode one, the radix cache
    factory SGLang's cache parameters. A scheduler process runs one scheduler (one TP
    rank), so the process is the key: this module's slot."""
    return _process
