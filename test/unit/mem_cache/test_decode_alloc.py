"""Under `--sparse-mode` a decode batch's paged KV slots come from one launch
(`mem_cache.decode_alloc`, through the `alloc_for_decode` hook): driven side by side with
SGLang's own `alloc_for_decode` on the same batch (its Triton kernel under the
interpreter), it gives the same slots, the same request-to-token table, the same free
pages left and the same tree-cache eviction; what it does not handle, and a pool short
of pages, go to SGLang's path, errors included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.allocation", reason="SGLang is not installed")

from sglang.srt.mem_cache.allocation import alloc_for_decode  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402

from sglang_psa.plugin import scheduling  # noqa: E402

pytestmark = pytest.mark.sglang
PAGE = 32


def _batch(bs, seed, need_sort=False, spare_pages=600):
    """`bs` decoding requests on pages of their own, a third at a page boundary; the
    allocator's free list shuffled (`spare_pages` of them)."""
    g = torch.Generator().manual_seed(seed)
    rows_total, width = bs + 8, 24 * PAGE
    pages = bs * 24 + spare_pages + 1
    alloc = PagedTokenToKVPoolAllocator(pages * PAGE, PAGE, torch.float32, "cpu", None, need_sort)
    order = torch.randperm(pages - 1, generator=g) + 1
    rows = torch.randperm(rows_total, generator=g)[:bs]
    lens = torch.randint(1, width - 1, (bs,), generator=g)
    edge = torch.rand(bs, generator=g) < 0.33
    lens[edge] = (lens[edge] // PAGE).clamp(min=1) * PAGE
    table = torch.zeros(rows_total, width, dtype=torch.int32)
    k = 0
    for r, n in zip(rows.tolist(), lens.tolist()):
        for p in range((n + PAGE - 1) // PAGE):
            table[r, p * PAGE : (p + 1) * PAGE] = torch.arange(PAGE) + int(order[k]) * PAGE
            k += 1
        table[r, n:] = 0
    alloc.free_pages = order[k : k + spare_pages].clone()
    evicted = []
    tree = SimpleNamespace(
        page_size=PAGE,
        token_to_kv_pool_allocator=alloc,
        is_chunk_cache=lambda: False,
        supports_prefix_sharing=lambda: True,
        evict=lambda params: evicted.append(params.num_tokens),  # 0.5.17
        evict_for_alloc=lambda params, **kw: evicted.append(params.num_tokens),  # 0.5.23
        pretty_print=lambda: None,
        available_and_evictable_str=lambda: "(test pool)",
    )
    pool = SimpleNamespace(req_to_token=table, _aux_cache=None)
    pool.alloc_aux_to_lengths = lambda **kw: None  # 0.5.23: no auxiliary cache here
    pool.write = lambda idx, values: pool.req_to_token.__setitem__(idx, values)
    reqs = [
        SimpleNamespace(kv=SimpleNamespace(kv_allocated_len=n, kv_committed_len=n))
        for n in lens.tolist()
    ]
    return SimpleNamespace(
        reqs=reqs,
        seq_lens=lens.clone(),
        seq_lens_cpu=lens.clone(),
        req_pool_indices=rows,
        req_to_token_pool=pool,
        tree_cache=tree,
        token_to_kv_pool_allocator=alloc,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        hisparse_coordinator=None,
        device="cpu",
        req_pool_indices_cpu=rows.clone(),
        maybe_evict_swa=lambda: None,
        evicted=evicted,
    )


def _twins(*args, **kw):
    return _batch(*args, **kw), _batch(*args, **kw)  # the same seed: the same batch


@pytest.fixture
def sparse(monkeypatch):
    monkeypatch.setattr(scheduling, "_serving", lambda: object())  # --sparse-mode on


def _ours(batch):
    calls = []

    def sglang_path(b, n):
        calls.append(n)
        return alloc_for_decode(b, n)

    return scheduling.around_alloc_for_decode(sglang_path, batch, 1), calls


@pytest.mark.parametrize("bs,need_sort", [(1, False), (32, False), (32, True), (200, False)])
def test_the_same_slots_table_and_free_pages_as_sglangs_path(sparse, bs, need_sort):
    ours, theirs = _twins(bs, seed=bs, need_sort=need_sort)
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
    assert scheduling.around_alloc_for_decode(lambda b, n: "sglang", _batch(4, seed=1), 1) == "sglang"


def scheduling_handles(batch, token_per_req=1) -> bool:
    from sglang_psa.mem_cache import decode_alloc

    return decode_alloc.handles(batch, token_per_req)
