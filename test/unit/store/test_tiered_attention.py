"""Store + kernels end to end: KV in the host pool, some blocks promoted to HBM slots,
wave attention over the mixed location table equals the reference on the dense KV."""

import pytest
import torch

from sglang_psa.algo import block_metadata, progressive_attention
from sglang_psa.config import PSAConfig
from sglang_psa.store import BlockPool
from sglang_psa.store.host_pool import HostKVPool
from sglang_psa.store.slot_store import SlotStore, slots_for_budget


def test_an_empty_host_pool_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="host-pool-gb"):
        HostKVPool(2, 2, 0, 16, 64, pin=False)


def test_slot_cache_sizing_from_flag_or_free_memory():
    pool = HostKVPool(2, 2, 4, 32, 128, pin=False)  # a slot = 2 x 8 KiB
    assert slots_for_budget(pool, 1.0, free_bytes=4 << 30) == (1 << 30) // (16 << 10)
    assert slots_for_budget(pool, None, free_bytes=1 << 30, free_fraction=0.25) == (
        (1 << 28) // (16 << 10)
    )
    with pytest.raises(ValueError, match="--psa-gpu-cache-gb 8.*only 2.0 GiB"):
        slots_for_budget(pool, 8.0, free_bytes=2 << 30)
    with pytest.raises(ValueError, match="less than one"):
        slots_for_budget(pool, None, free_bytes=1000)
    store = SlotStore.from_budget(pool, "cpu", gpu_cache_gb=0.001)
    assert store.num_slots == int(0.001 * (1 << 30)) // (16 << 10)


def test_wave_attention_over_host_pool_and_slots(kernel_device):
    from sgl_kernel_ext.wave_attention import WaveAttention

    dev = kernel_device
    L, H, bs, d, G = 2, 2, 16, 16, 2
    g = torch.Generator().manual_seed(0)
    pool = HostKVPool(L, H, 40, bs, d, dtype=torch.float32, pin=dev == "cuda")
    alloc = BlockPool(40, bs)
    lengths = [150, 70]
    tables = [alloc.allocate(list(range(n))) for n in lengths]  # shared prefix blocks
    T = max(lengths)
    k = torch.randn(2, H, T, d, generator=g)
    v = torch.randn(2, H, T, d, generator=g)
    k[1, :, :64], v[1, :, :64] = k[0, :, :64], v[0, :, :64]  # the shared prefix has equal KV
    layer = 1
    for b, t in enumerate(tables):
        pool.write_tokens(layer, t.blocks, k[b, :, : lengths[b]], v[b, :, : lengths[b]])
    store = SlotStore(pool, num_slots=6, device=dev)
    store.promote(
        layer, [(0, tables[0].blocks[0]), (1, tables[0].blocks[3]), (0, tables[1].blocks[4])]
    )
    nb = -(-T // bs)
    loc = store.location_table(layer, [t.blocks for t in tables], nb)
    # Blocks 0-3 (64 tokens) are shared, so the two promoted shared units show up in both
    # requests' tables: 2 + 3 resident entries.
    assert tables[0].blocks[:4] == tables[1].blocks[:4]
    valid = (
        torch.arange(nb)[None, None, :]
        < torch.tensor([len(t.blocks) for t in tables])[:, None, None]
    )
    assert int(((loc.cpu() >= 0) & valid).sum()) == 5

    cfg = PSAConfig(
        threshold=0.95, block_size=bs, wave_blocks=2, wave_growth=1.5, max_wave_blocks=8
    )
    q = torch.randn(2, H * G, d, generator=g)
    lens = torch.tensor(lengths)
    ref = progressive_attention(q, k, v, lens, cfg)
    meta = block_metadata(k, lens, bs)
    host_k, host_v = pool.layer_units(layer)
    wa = WaveAttention.from_config(cfg).plan(2, H * G, H, d, nb, dev)
    res = wa.run(
        q.to(dev),
        store.k_slots,
        store.v_slots,
        loc,
        lens.to(dev),
        *(m.to(dev) for m in meta[:3]),
        k_host=host_k,
        v_host=host_v,
    )
    assert torch.equal(res.read_mask().cpu(), ref.read)
    torch.testing.assert_close(res.out.cpu(), ref.out, atol=2e-4, rtol=2e-4)
    stats = store.table.stats
    assert stats["misses"] == 3 and stats["used"] == 3
    store.table.check_integrity()
    # The promoted units hold exactly the host pool's bytes.
    for head, blk in [(0, tables[0].blocks[0]), (1, tables[0].blocks[3])]:
        slot = int(store.table.slot_of[store.units(layer, head, blk)])
        assert torch.equal(store.k_slots[slot].cpu(), pool.k[layer, head, blk])
        assert torch.equal(store.v_slots[slot].cpu(), pool.v[layer, head, blk])
    # Freeing a request's own (unshared) blocks frees their slots in every layer; the
    # shared prefix stays resident for the other request.
    own = tables[1].blocks[4:]
    assert alloc.free_table(tables[1]) == own
    store.drop_blocks(own)
    assert store.table.stats["used"] == 2
    store.table.check_integrity()
    alloc.check_integrity(tables[:1])
    pool.close()
