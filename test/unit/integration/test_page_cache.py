"""The HBM page cache over a host-resident pool: pages read from the host are admitted
by read frequency, cached pages are found again, tail pages are never cached, handed-out
pages are dropped, and a cached slot always holds its page's current bytes."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.integration.page_cache import PageCache

L, P, BS, H, D = 2, 16, 4, 2, 8
E = BS * H * D


def _pool(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(P * BS, H, D, generator=g) for _ in range(L)], [
        torch.randn(P * BS, H, D, generator=g) for _ in range(L)
    ]


def _coherent(cache: PageCache, kp, vp):
    cache.check_integrity()
    for slot in torch.nonzero(cache.tag[: cache.S] >= 0).flatten().tolist():
        unit = int(cache.tag[slot])
        layer, page = divmod(unit, P)
        assert torch.equal(cache.k[slot], kp[layer].view(P, E)[page]), (slot, unit)
        assert torch.equal(cache.v[slot], vp[layer].view(P, E)[page]), (slot, unit)


def _step(cache, layer, pages, read, full, kp, vp):
    loc = cache.locate(layer, pages, full)
    cache.admit(layer, pages, read, full, loc, kp[layer], vp[layer])
    return loc


def test_pages_read_from_the_host_are_cached_and_found_again():
    kp, vp = _pool()
    cache = PageCache(L, P, E, torch.float32, num_slots=64, device="cpu")
    pages = torch.tensor([[3, 7, 9, 12]])
    full = torch.tensor([[True, True, True, False]])  # the tail page is still filling
    read = torch.ones_like(full)
    loc = _step(cache, 1, pages, read, full, kp, vp)
    assert loc.tolist() == [[-4, -8, -10, -13]]  # all from the host
    loc = cache.locate(1, pages, full)
    assert (loc[0, :3] >= 0).all() and int(loc[0, 3]) == -13  # the tail never cached
    assert (cache.locate(0, pages, full) < 0).all()  # another layer's pages are other units
    _coherent(cache, kp, vp)
    st_ = cache.stats()
    assert (st_["admitted"], st_["host_reads"], st_["hits"]) == (3, 4, 0)
    _step(cache, 1, pages, read, full, kp, vp)
    assert cache.stats()["hits"] == 3


def test_a_colder_page_does_not_displace_a_hotter_one_and_invalidation_drops_it():
    kp, vp = _pool()
    cache = PageCache(L, P, E, torch.float32, num_slots=1, device="cpu")  # one slot
    full = torch.tensor([[True]])
    hot, cold = torch.tensor([[5]]), torch.tensor([[6]])
    for _ in range(3):
        _step(cache, 0, hot, full, full, kp, vp)
    _step(cache, 0, cold, full, full, kp, vp)  # read once: its count 1 < the hot page's
    assert int(cache.locate(0, hot, full)[0, 0]) == 0
    assert int(cache.locate(0, cold, full)[0, 0]) == -7
    # SGLang frees page 5 and hands it out again with new keys.
    kp[0].view(P, E)[5] = 0.5
    # The hook passes one page per allocated token: a page repeats, and counts once.
    cache.invalidate(torch.tensor([5 * BS + 1, 5 * BS + 2, 5 * BS + 3]) // BS)
    assert int(cache.locate(0, hot, full)[0, 0]) == -6
    assert cache.stats()["invalidated"] == 1
    _coherent(cache, kp, vp)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, L - 1),
            st.lists(st.integers(0, P - 1), min_size=1, max_size=6),
            st.booleans(),
        ),
        min_size=1,
        max_size=25,
    ),
    st.integers(1, 9),
)
def test_cached_slots_always_hold_the_current_page(ops, slots):
    kp, vp = _pool(1)
    cache = PageCache(L, P, E, torch.float32, num_slots=slots, device="cpu")
    for layer, page_list, rewrite in ops:
        pages = torch.tensor([page_list])
        full = torch.ones_like(pages, dtype=torch.bool)
        if rewrite:  # the first page is handed out again: new bytes, then the hook
            p = page_list[0]
            for t in (kp, vp):
                for lay in range(L):
                    t[lay].view(P, E)[p] += 1.0
            cache.invalidate(torch.tensor([p]))
        _step(cache, layer, pages, full, full, kp, vp)
        cache.next_step()
        _coherent(cache, kp, vp)
