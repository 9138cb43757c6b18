"""The unit cache's refresh kernel against its reference (`algo.unit_cache.refresh_ref`):
the same positions taken, the same units uncached, the same K/V copied into the pool
pages of the positions' layers, at real shapes (head_dim 64 and 128, 2-8 KV heads,
> 512 host blocks)."""

import pytest
import torch

from sgl_kernel_ext.unit_cache import refresh_unit_cache
from sglang_psa.algo.unit_cache import refresh_ref


def _state(layers, heads, d, host_blocks, slots, ways, dev, seed, hot=0.3):
    """A cache mid-flight: stamps of every (layer, head), a valid occupancy (units of live
    blocks in their own set's positions, of any layer), pool buffers per layer."""
    g = torch.Generator().manual_seed(seed)
    L, H, bs, step, pages = layers, heads, 32, 50, slots + 40
    P = pages + host_blocks  # each (layer, head)'s stamp columns: pages, then host blocks
    stamps = torch.randint(0, step + 1, (L * H, P), generator=g, dtype=torch.int32)
    read = torch.rand(L * H, host_blocks, generator=g) < hot  # units the last step read
    stamps[:, pages:][read] = step
    live = (torch.rand(host_blocks, generator=g) < 0.8).to(torch.uint8)
    cache_pages = torch.randperm(pages - 1, generator=g)[:slots].add(1).to(torch.int32)
    cache_pages[torch.rand(slots, generator=g) < 0.1] = 0  # page slots without a page
    unit_slot = torch.full((L * H, host_blocks + 1), -1, dtype=torch.int32)
    slot_unit = torch.full((H, slots * L + 1), -1, dtype=torch.int32)
    sets = slots // ways
    for h in range(H):
        for q in range(slots * L):
            c = q // L
            if cache_pages[c] > 0 and torch.rand(1, generator=g) < 0.5:
                s = c // ways
                options = [
                    (ly, b)
                    for ly in range(L)
                    for b in range(s, host_blocks, sets)
                    if live[b] and unit_slot[ly * H + h, b] < 0
                ]
                if options:
                    ly, b = options[int(torch.randint(len(options), (1,), generator=g))]
                    unit_slot[ly * H + h, b], slot_unit[h, q] = q, ly * host_blocks + b
    host_k = torch.randn(L, H, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    host_v = torch.randn(L, H, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    pool_k = [torch.randn(pages * bs, H, d, generator=g).to(torch.bfloat16) for _ in range(L)]
    pool_v = [torch.randn(pages * bs, H, d, generator=g).to(torch.bfloat16) for _ in range(L)]
    t = dict(
        stamps=stamps, live=live, unit_slot=unit_slot, slot_unit=slot_unit,
        cache_pages=cache_pages, host_k=host_k, host_v=host_v,
    )  # fmt: skip
    t = {k: v.to(dev) for k, v in t.items()}
    t["pool_k"] = [x.to(dev) for x in pool_k]
    t["pool_v"] = [x.to(dev) for x in pool_v]
    return t, step, pages


def _clone(t):
    return {k: [x.cpu().clone() for x in v] if isinstance(v, list) else v.cpu().clone()
            for k, v in t.items()}  # fmt: skip


def _refresh(got, pages, step, ways, dev):
    copied = torch.zeros(1, dtype=torch.int32, device=dev)
    stamps = got.pop("stamps")
    refresh_unit_cache(
        stamps[:, pages:], **got,
        step=torch.tensor([step], dtype=torch.int32, device=dev),
        ways=ways, keep=4, copied=copied,
    )  # fmt: skip
    got["stamps"] = stamps
    return int(copied)


@pytest.mark.parametrize(
    "layers,heads,d,ways,hot",
    [(3, 2, 64, 8, 0.3), (2, 8, 128, 4, 0.3), (4, 4, 64, 8, 0.05), (3, 2, 64, 16, 0.3)],
)
def test_refresh_matches_reference(kernel_device, layers, heads, d, ways, hot):
    """`hot` 0.3: more candidates than free positions in most sets (the first ones win,
    in (layer, host block) order); 0.05: fewer."""
    host_blocks, slots = 700, 96
    got, step, pages = _state(layers, heads, d, host_blocks, slots, ways, kernel_device,
                              heads * d + layers, hot)  # fmt: skip
    want = _clone(got)
    n = _refresh(got, pages, step, ways, kernel_device)
    ref = refresh_ref(want.pop("stamps")[:, pages:], **want, step=step, ways=ways, keep=4)
    assert ref > 0 and n == ref
    for name in ("unit_slot", "slot_unit"):
        assert torch.equal(got[name].cpu(), want[name]), name
    for name in ("pool_k", "pool_v"):
        for lid in range(layers):
            diff = (got[name][lid].cpu() != want[name][lid]).any(-1)  # [rows, heads]
            where = sorted({(int(r) // 32, int(h)) for r, h in diff.nonzero().tolist()})
            assert not where, f"{name}[{lid}]: (page, head) differ {where[:8]}"


def test_a_cached_unit_is_a_copy_of_its_host_unit(kernel_device):
    """After a refresh every unit it brought in sits in its position's page and layer
    buffer exactly as on the host, units of a layer sit in other layers' buffers too, and
    unit_slot and slot_unit are inverse maps."""
    L, H, HB, C = 3, 2, 600, 64
    got, step, pages = _state(L, H, 64, HB, C, 8, kernel_device, 7)
    before = got["slot_unit"].cpu().clone()
    copied = _refresh(got, pages, step, 8, kernel_device)
    t = _clone(got)
    bs, new, foreign = 32, 0, 0
    for h in range(H):
        for q in range(C * L):
            code = int(t["slot_unit"][h, q])
            if code < 0:
                continue
            ly, hb = divmod(code, HB)
            assert int(t["unit_slot"][ly * H + h, hb]) == q
            page, l2 = int(t["cache_pages"][q // L]), q % L
            if code != before[h, q]:  # brought in by this refresh
                rows = slice(page * bs, (page + 1) * bs)
                assert torch.equal(t["pool_k"][l2][rows, h], t["host_k"][ly, h, hb])
                assert torch.equal(t["pool_v"][l2][rows, h], t["host_v"][ly, h, hb])
                new += 1
                foreign += l2 != ly
    assert new == copied > 0 and foreign > 0
    for lh in range(L * H):  # every cached unit's position holds it
        for hb in (t["unit_slot"][lh, :-1] >= 0).nonzero().flatten().tolist():
            q = int(t["unit_slot"][lh, hb])
            assert int(t["slot_unit"][lh % H, q]) == (lh // H) * HB + hb


def test_one_heavy_layer_fills_the_light_layers_positions(kernel_device):
    """The point of shared positions: a layer that reads more units of a set than it has
    ways is cached whole while the other layers read nothing there."""
    L, H, HB, C, ways = 4, 2, 512, 32, 4
    got, step, pages = _state(L, H, 64, HB, C, ways, kernel_device, 11, hot=0.0)
    got["unit_slot"].fill_(-1)
    got["slot_unit"].fill_(-1)
    got["cache_pages"].copy_(torch.arange(1, C + 1, dtype=torch.int32))
    got["live"].fill_(1)
    st = got["stamps"][:, pages:]
    st.fill_(1)
    sets = C // ways
    heavy = torch.arange(0, 3 * ways * sets)  # 3 x ways blocks of each set, layer 2 only
    st[2 * H : 3 * H, heavy.to(kernel_device)] = step
    n = _refresh(got, pages, step, ways, kernel_device)
    assert n == H * heavy.numel()
    assert (got["unit_slot"][2 * H : 3 * H, heavy.to(kernel_device)] >= 0).all()


@pytest.mark.gpu
def test_the_refresh_replayed_from_its_cuda_graph_matches_launching_it_each_round():
    """`UnitCache.refresh` on CUDA replays the launches it captured on its first round:
    over rounds whose reads, evicted blocks, pages and released blocks change between
    them, its tables, pool pages and count stay those of a cache that launches every
    round."""
    from types import SimpleNamespace

    from sglang_psa.mem_cache.unit_cache import UnitCache

    L, H, HB, bs, d, pages, dev = 3, 2, 600, 32, 64, 80, "cuda"
    g = torch.Generator().manual_seed(3)
    host = SimpleNamespace(
        k=torch.randn(L, H, HB, bs, d, generator=g).to(dev, torch.bfloat16),
        v=torch.randn(L, H, HB, bs, d, generator=g).to(dev, torch.bfloat16),
    )

    def pool():
        return SimpleNamespace(
            k_buffer=[torch.zeros(pages * bs, H, d, dtype=torch.bfloat16, device=dev)
                      for _ in range(L)],
            v_buffer=[torch.zeros(pages * bs, H, d, dtype=torch.bfloat16, device=dev)
                      for _ in range(L)],
        )  # fmt: skip

    caches = [UnitCache(L, H, HB, 32, bs, dev, graph=graph) for graph in (True, False)]
    pools = [pool(), pool()]
    stamps = torch.zeros(L * H, pages + HB, dtype=torch.int32, device=dev)
    step = torch.zeros(1, dtype=torch.int32, device=dev)
    for r in range(1, 6):
        step.fill_(10 * r)
        hot = torch.rand(L * H, HB, generator=g) < 0.3
        stamps[:, pages:].copy_(torch.where(hot, 10 * r, 0).to(stamps))
        for c, p in zip(caches, pools):
            c.mark_evicted(torch.arange(r * 50, r * 50 + 200, device=dev))
            if r == 1:
                c.grow(torch.arange(1, 17, device=dev))
            if r == 3:
                c.shrink(4)
            if r == 4:
                c.forget(torch.arange(50, 120, device=dev))
            c.refresh(stamps, pages, step, host, p)
        torch.cuda.synchronize()
        a, b = caches
        assert a._graph is not None and b._graph is None
        for name in ("cache_pages", "unit_slot", "slot_unit", "live", "copied"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (r, name)
        for lid in range(L):
            assert torch.equal(pools[0].k_buffer[lid], pools[1].k_buffer[lid]), (r, lid)
            assert torch.equal(pools[0].v_buffer[lid], pools[1].v_buffer[lid]), (r, lid)
    assert int(caches[0].copied) > 0
    # the counts server info reports: one launch (captured), then replays; or all launched
    assert (caches[0].launches, caches[0].replays) == (1, 4)
    assert (caches[1].launches, caches[1].replays) == (5, 0)
