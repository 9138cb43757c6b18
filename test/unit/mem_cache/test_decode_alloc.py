"""Under `--sparse-mode` a decode batch's paged KV slots come from one launch
(`mem_cache.decode_alloc`, through the `alloc_for_decode` hook): driven side by side with
SGLang's own `alloc_for_decode` on the same batch (its Triton kernel under the
interpreter), it gives the same slots, the same request-to-token table, the same free
pages left and the same tree-cache eviction; what it does not handle, and a pool short
of pages, go to SGLang's path, errors included."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="SGLang is not installed")

from sglang.srt.mem_cache.allocation import alloc_for_decode  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402

from sglang_psa.plugin import scheduling  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmark" / "scheduler"))
import alloc_step  # noqa: E402  (its stand-in batch: the benchmark's baseline is checked here)

pytestmark = pytest.mark.sglang


def _batch(bs, seed, need_sort=False, spare_pages=600, device="cpu"):
    return alloc_step.fake_batch(
        bs, seed, device=device, need_sort=need_sort, spare_pages=spare_pages
    )


def _twins(*args, **kw):
    return _batch(*args, **kw), _batch(*args, **kw)  # the same seed: the same batch


@pytest.fixture
def sparse(monkeypatch):
    monkeypatch.setattr(scheduling, "_serving", lambda: object())  # --sparse-mode on


@pytest.fixture(autouse=True)
def _dcp_off(monkeypatch):
    """No server set the process's arguments, which SGLang's page size asks on a machine
    with CUDA (whether decode context parallelism is on), whatever device the test's
    tensors are on: the page size as the alloc benchmark gives it
    (`alloc_step.tree_page_size`; the same where that question is not asked)."""
    from sglang.srt.mem_cache import allocation

    monkeypatch.setattr(allocation, "_alloc_page_size", alloc_step.tree_page_size, raising=False)


def _ours(batch):
    calls = []

    def sglang_path(b, n):
        calls.append(n)
        return alloc_for_decode(b, n)

    return scheduling.around_alloc_for_decode(sglang_path, batch, 1), calls


@pytest.mark.parametrize("bs,need_sort", [(1, False), (32, False), (32, True), (200, False)])
def test_the_same_slots_table_and_free_pages_as_sglangs_path(
    sparse, monkeypatch, kernel_device, bs, need_sort
):
    """On CPU both kernels run under Triton's interpreter; on a GPU both compiled."""
    ours, theirs = _twins(bs, seed=bs, need_sort=need_sort, device=kernel_device)
    want = alloc_for_decode(theirs, 1)
    got, fell_back = _ours(ours)
    assert fell_back == []  # served by the one launch
    assert torch.equal(got, want)
    assert torch.equal(ours.req_to_token_pool.req_to_token, theirs.req_to_token_pool.req_to_token)
    assert torch.equal(
        ours.token_to_kv_pool_allocator.free_pages, theirs.token_to_kv_pool_allocator.free_pages
    )
    assert ours.evicted == theirs.evicted
    assert [vars(r.kv) for r in ours.reqs] == [vars(r.kv) for r in theirs.reqs]


def test_a_short_pool_evicts_as_sglang_does_and_fails_on_its_path(sparse):
    ours, theirs = _twins(32, seed=5, spare_pages=2)  # ~11 requests open a page
    with pytest.raises(RuntimeError, match="out of memory") as want:
        alloc_for_decode(theirs, 1)
    with pytest.raises(RuntimeError, match="out of memory") as got:
        _ours(ours)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]
    assert ours.evicted and ours.evicted[0] == theirs.evicted[0]  # the shortfall, asked once


def test_what_it_does_not_handle_is_sglangs_path(sparse, monkeypatch):
    b = _batch(4, seed=1)
    b.model_config.is_encoder_decoder = True
    assert not scheduling_handles(b)
    b = _batch(4, seed=1)

    class Widened(PagedTokenToKVPoolAllocator):
        pass

    b.token_to_kv_pool_allocator.__class__ = Widened
    assert not scheduling_handles(b)
    assert not scheduling_handles(_batch(4, seed=1), token_per_req=2)
    b = _batch(4, seed=1)
    b.seq_lens_cpu = None  # no host copy of the lengths: nothing to count pages from
    assert not scheduling_handles(b)
    assert scheduling_handles(_batch(4, seed=1))
    monkeypatch.setattr(scheduling, "_serving", lambda: None)  # plain SGLang: its own path
    assert (
        scheduling.around_alloc_for_decode(lambda b, n: "sglang", _batch(4, seed=1), 1) == "sglang"
    )


def scheduling_handles(batch, token_per_req=1) -> bool:
    from sglang_psa.mem_cache import decode_alloc

    return decode_alloc.handles(batch, token_per_req)


def test_the_alloc_benchmark_runs_both_paths_through_its_steps():
    """`benchmark/scheduler/alloc_step.py` on CPU (the interpreter): every step of both
    paths finds its pages and its row's room, from 16K-token requests up."""
    from sglang.srt.mem_cache import allocation

    from sglang_psa.mem_cache import decode_alloc

    for path in (lambda b: allocation.alloc_for_decode(b, 1), decode_alloc.allocate):
        times = alloc_step.host_us(path, bs=4, steps=40, warmup=2, device="cpu")
        assert len(times) == 40 and min(times) > 0
