"""The unit cache's refresh kernel against its reference (`algo.unit_cache.refresh_ref`):
the same slots taken, the same units uncached, the same K/V copied into the pool pages,
at real shapes (head_dim 64 and 128, 2-8 KV heads, > 512 host blocks)."""

import pytest
import torch

from sgl_kernel_ext.unit_cache import refresh_unit_cache
from sglang_psa.algo.unit_cache import refresh_ref


def _state(heads, d, host_blocks, slots, ways, dev, seed):
    g = torch.Generator().manual_seed(seed)
    bs, step, pages = 32, 50, slots + 40
    P = pages + host_blocks  # the layer's stamp rows: pages, then host blocks
    stamps = torch.randint(0, step + 1, (heads, P), generator=g, dtype=torch.int32)
    # a third of the host units read by the last step, some never read
    hot = torch.rand(heads, host_blocks, generator=g) < 0.3
    stamps[:, pages:][hot] = step
    live = (torch.rand(host_blocks, generator=g) < 0.8).to(torch.uint8)
    cache_pages = torch.randperm(pages - 1, generator=g)[:slots].add(1).to(torch.int32)
    cache_pages[torch.rand(slots, generator=g) < 0.1] = 0  # positions without a page
    unit_slot = torch.full((heads, host_blocks + 1), -1, dtype=torch.int32)
    slot_unit = torch.full((heads, slots + 1), -1, dtype=torch.int32)
    sets = slots // ways
    for h in range(heads):  # a valid occupancy: live units in their own set
        for slot in range(slots):
            if cache_pages[slot] > 0 and torch.rand(1, generator=g) < 0.5:
                s = slot // ways
                options = [
                    b for b in range(s, host_blocks, sets) if live[b] and unit_slot[h, b] < 0
                ]
                if options:
                    b = options[int(torch.randint(len(options), (1,), generator=g))]
                    unit_slot[h, b], slot_unit[h, slot] = slot, b
    host_k = torch.randn(heads, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    host_v = torch.randn(heads, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    pool_k = torch.randn(pages * bs, heads, d, generator=g).to(torch.bfloat16)
    pool_v = torch.randn(pages * bs, heads, d, generator=g).to(torch.bfloat16)
    t = dict(
        stamps=stamps, live=live, unit_slot=unit_slot, slot_unit=slot_unit,
        cache_pages=cache_pages, host_k=host_k, host_v=host_v, pool_k=pool_k, pool_v=pool_v,
    )  # fmt: skip
    return {k: v.to(dev) for k, v in t.items()}, step, pages


@pytest.mark.parametrize("heads,d,ways", [(2, 64, 8), (8, 128, 4), (4, 64, 8), (2, 64, 16)])
def test_refresh_matches_reference(kernel_device, heads, d, ways):
    host_blocks, slots = 700, 96
    got, step, pages = _state(heads, d, host_blocks, slots, ways, kernel_device, heads * d)
    want = {k: v.cpu().clone() for k, v in got.items()}
    copied = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    stamps = got.pop("stamps")
    refresh_unit_cache(
        stamps[:, pages:], **got,
        step=torch.tensor([step], dtype=torch.int32, device=kernel_device),
        ways=ways, keep=4, copied=copied,
    )  # fmt: skip
    n = refresh_ref(want.pop("stamps")[:, pages:], **want, step=step, ways=ways, keep=4)
    assert n > 0 and int(copied) == n
    for name in ("unit_slot", "slot_unit"):
        assert torch.equal(got[name].cpu(), want[name]), name
    for name in ("pool_k", "pool_v"):
        diff = (got[name].cpu() != want[name]).any(-1)  # [rows, heads]
        where = sorted({(int(r) // 32, int(h)) for r, h in diff.nonzero().tolist()})
        slot_of = {int(p): i for i, p in enumerate(want["cache_pages"].tolist()) if p > 0}
        assert not where, f"{name}: (page, head) differ {where[:8]}, their slots " + str(
            [(slot_of.get(p), int(want["slot_unit"][h, slot_of[p]]) if p in slot_of else None)
             for p, h in where[:8]]
        )  # fmt: skip


def test_a_cached_unit_is_a_copy_of_its_host_unit(kernel_device):
    """After a refresh every unit it brought in sits in its slot's page exactly as on the
    host, and unit_slot and slot_unit are inverse maps."""
    got, step, pages = _state(2, 64, 600, 64, 8, kernel_device, 7)
    before = got["slot_unit"].cpu().clone()
    copied = torch.zeros(1, dtype=torch.int32, device=kernel_device)
    stamps = got.pop("stamps")
    refresh_unit_cache(
        stamps[:, pages:], **got,
        step=torch.tensor([step], dtype=torch.int32, device=kernel_device),
        ways=8, keep=4, copied=copied,
    )  # fmt: skip
    t = {k: v.cpu() for k, v in got.items()}
    bs, new = 32, 0
    for h in range(2):
        for slot in range(64):
            hb = int(t["slot_unit"][h, slot])
            if hb < 0:
                continue
            assert int(t["unit_slot"][h, hb]) == slot
            page = int(t["cache_pages"][slot])
            if hb != before[h, slot]:  # brought in by this refresh
                rows = slice(page * bs, (page + 1) * bs)
                assert torch.equal(t["pool_k"][rows, h], t["host_k"][h, hb])
                assert torch.equal(t["pool_v"][rows, h], t["host_v"][h, hb])
                new += 1
    assert new == int(copied) > 0


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
