"""One scheduler process assembled on CPU from SGLang's own KV pool, request table and page
allocator (`sched.process.assemble`): every part is there, each wired to the same
instances as its neighbours (the backend's write-back is the admission's, the stage
reads that write-back, residency reads the backend's metadata and stamps); the result
is frozen; the plugin registers what the backend assembled and the hooks find exactly
that; the KV in HBM only, or a prefill other than SGLang's Triton one, leaves the
tiered parts or the stage out."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.memory_pool",
    reason="SGLang is not installed here (bash scripts/install_sglang_cpu.sh)",
)
pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

from sglang_psa.config import PSAConfig  # noqa: E402
from sglang_psa.mem_cache.prefill_stage import PrefillStage  # noqa: E402
from sglang_psa.mem_cache.read_stamps import ReadCounters, ReadStamps  # noqa: E402
from sglang_psa.mem_cache.request_kv import TieredRequests  # noqa: E402
from sglang_psa.mem_cache.residency import Residency  # noqa: E402
from sglang_psa.mem_cache.writeback import WriteBack  # noqa: E402
from sglang_psa.plugin import extend, scheduling  # noqa: E402
from sglang_psa.sched import process  # noqa: E402
from sglang_psa.sched.serving import PSAServing  # noqa: E402

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

BS, HKV, D, LAYERS, PAGES = 32, 2, 16, 2, 64
TIERED = PSAConfig(kv_home="tiered", host_pool_gb=0.01, writeback="uva")


@pytest.fixture(autouse=True)
def _no_leftover_process():
    yield
    process.register(None)


def _runner(cfg: PSAConfig, prefill: str = "triton"):
    """SGLang's model runner as the `psa` backend reads it: its real KV pool, request
    table and page allocator on CPU, its server args as the plugin leaves them."""
    kv = MHATokenToKVPool(
        PAGES * BS, BS, torch.float32, HKV, D, LAYERS, "cpu", False, enable_alt_stream=False
    )
    req = ReqToTokenPool(8, 1024, "cpu", False)
    alloc = PagedTokenToKVPoolAllocator(kv.size, BS, torch.float32, "cpu", kv, False)
    server_args = SimpleNamespace(
        _psa_config=cfg, prefill_attention_backend=prefill, attention_backend=prefill,
        decode_attention_backend="psa", chunked_prefill_size=256, enable_metrics=False,
    )  # fmt: skip
    return SimpleNamespace(
        server_args=server_args, req_to_token_pool=req, token_to_kv_pool=kv,
        token_to_kv_pool_allocator=alloc, page_size=BS, use_mla_backend=False,
        sliding_window_size=None, tp_size=1, tp_rank=0,
        model_config=SimpleNamespace(context_len=1024),
    )  # fmt: skip


@pytest.mark.parametrize("prefill", ["triton", "fa3"])
def test_a_tiered_scheduler_process_is_assembled_whole_and_wired_to_itself(prefill):
    """Whatever SGLang's prefill backend: its staged batches run on a Triton one built
    beside it (`plugin.extend.after_hybrid_init`), so the stage is always assembled."""
    r = _runner(TIERED, prefill)
    pool, table = r.token_to_kv_pool, r.req_to_token_pool.req_to_token
    alloc = r.token_to_kv_pool_allocator
    p = process.assemble(TIERED, pool, table, alloc, server_args=r.server_args, context_len=1024)
    try:
        assert isinstance(p.stamps, ReadStamps) and isinstance(p.counters, ReadCounters)
        assert isinstance(p.writeback, WriteBack) and isinstance(p.residency, Residency)
        assert isinstance(p.requests, TieredRequests) and isinstance(p.stage, PrefillStage)
        assert isinstance(p.serving, PSAServing) and p.metrics is None and p.cfg is TIERED
        s = p.serving  # admission calls exactly these parts
        assert s.writeback is p.writeback and s.residency is p.residency
        assert s.requests is p.requests and s.stage is p.stage and s.stages_prefill
        assert s.agreement is p.agreement and s.metrics is None
        assert s.measure == p.stamps.read and s.read_counts == p.counters.read_counts
        assert s.read_totals == p.counters.totals
        res, wb = p.residency, p.writeback  # residency evicts what the decode step reads
        assert res.wb is wb and res.records is wb.records
        assert res.meta is p.meta and res.ws is p.stamps and res.allocator is alloc
        assert res.agreement is p.agreement and res.unit_reads == p.counters.unit_reads
        assert res.req_to_token is table and res.pool is pool
        reqs = p.requests  # each request's passage goes through the same parts
        assert reqs.wb is wb and reqs.residency is res and reqs.records is wb.records
        assert reqs.pool is pool and reqs.req_to_token is table
        assert p.stage.wb is wb and p.stage.pool is pool  # the stage reads this host tier
        assert p.stage.first_layer == pool.start_layer
        # sizes: a row per page and host block, a location-table row per request row
        host_blocks = s.host_tokens // BS
        assert p.meta.page_rows == (pool.size + BS) // BS and host_blocks > 0
        assert p.stamps.num_pages == p.meta.page_rows + host_blocks
        assert tuple(wb.host_loc.shape) == tuple(table[:, ::BS].shape)
        assert wb.blocks.num_blocks == host_blocks and p.stamps.heat_blocks == table.shape[1] // BS
        with pytest.raises(dataclasses.FrozenInstanceError):
            p.stage = None  # nothing is completed from outside
        reqs.check_integrity()
    finally:
        p.writeback.close()


def test_the_backend_reads_the_parts_the_plugin_registers_for_the_hooks():
    """SGLang builds the decode backend through the plugin: the backend assembles the
    process once and reads its parts; the hooks then find that same process."""
    from sglang_psa.plugin.plugin import _create_backend

    r = _runner(TIERED)
    backend = _create_backend(r)
    p = backend.process
    try:
        assert process.current() is p and scheduling._serving() is p.serving
        assert backend.writeback is p.writeback is p.serving.writeback
        assert backend.residency is p.residency and backend.stage is p.stage is not None
        assert backend.meta is p.meta and backend.ws is p.stamps
        assert backend.counters is p.counters and backend.stats is p.counters.stats
        assert p.serving.hbm_bytes == backend.hbm_bytes  # server info's report
        assert backend.hbm_bytes()["working_sets"] == p.stamps.bytes + p.counters.bytes
        # the Triton prefill's hook stages through the process's stage, none other
        seen = []
        layer = SimpleNamespace(layer_id=0)
        run = lambda *a, **k: seen.append(a[0]) or "out"  # noqa: E731
        assert extend.around_triton_forward_extend(run, "triton", 0, 0, 0, layer, None) == "out"
        assert seen == ["triton"] and p.stage.plan is None  # nothing planned: untouched
    finally:
        p.writeback.close()


def test_what_a_home_does_not_have_is_none():
    """The KV in HBM only: no tiered store, no stage."""
    cfg = PSAConfig()
    r = _runner(cfg)
    p = process.assemble(
        cfg, r.token_to_kv_pool, r.req_to_token_pool.req_to_token,
        r.token_to_kv_pool_allocator, server_args=r.server_args, context_len=1024,
    )  # fmt: skip
    try:
        assert p.stage is None and p.serving.stage is None and not p.serving.stages_prefill
        tiered = cfg.kv_home == "tiered"
        for part in (p.writeback, p.residency, p.requests):
            assert (part is not None) is tiered
        assert p.serving.tiered is tiered and (p.serving.host_tokens is not None) is tiered
        assert p.stamps.heat_blocks == (1024 // BS if tiered else 0)
    finally:
        if p.writeback is not None:
            p.writeback.close()
