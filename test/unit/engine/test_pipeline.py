"""Load pipeline: the loader's slots hold the host bytes and pinned wave units survive
prefetches (the save half is the serving path's write-back, test/unit/mem_cache).

Runs with CPU tensors in CI and with CUDA tensors (loader stream) on the GPU machine.
"""

import pytest
import torch

pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang_psa.engine import Loader  # noqa: E402
from sglang_psa.store.host_pool import HostKVPool  # noqa: E402
from sglang_psa.store.slot_store import SlotStore  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L, H, NB, BS, D = 3, 2, 24, 4, 8


@pytest.mark.parametrize("dev", DEVICES)
def test_loader_waves_read_host_bytes_and_pins_survive_prefetch(dev):
    pool = HostKVPool(L, H, NB, BS, D, dtype=torch.float32, pin=dev == "cuda")
    pool.k.copy_(torch.randn(pool.k.shape))
    pool.v.copy_(torch.randn(pool.v.shape))
    store = SlotStore(pool, num_slots=12, device=dev)
    loader = Loader(store)
    g = torch.Generator().manual_seed(2)
    for _ in range(6):
        units = torch.randperm(L * H * NB, generator=g)[:5].to(dev)
        if dev == "cuda":
            x = torch.randn(2048, 2048, device=dev)
            x = x @ x  # compute queued before the load; the load must not wait for the host
        wave = loader.load(units)
        nxt = loader.prefetch(torch.randperm(L * H * NB, generator=g)[:7].to(dev))
        wave.wait()
        got_k = store.k_slots[wave.slots].flatten(1)
        assert torch.equal(got_k.cpu(), pool.k.view(-1, BS * D)[units.cpu()])
        assert torch.equal(
            store.v_slots[wave.slots].flatten(1).cpu(), pool.v.view(-1, BS * D)[units.cpu()]
        )
        nxt.wait()
        loader.release(wave)
    loader.synchronize()
    store.table.check_integrity()
    assert int(store.table.pins.sum()) == 0
    stats = store.table.stats
    assert stats["hits"] + stats["misses"] == 6 * 12
    pool.close()
