"""Save and load pipeline: KV saved through the staging ring lands exactly where the
reference writer puts it (also across ring wrap-around and an engine killed mid-save);
the loader's slots hold the host bytes and pinned wave units survive prefetches.

Runs with CPU tensors in CI and with CUDA tensors (async D2H copy + GPU-written
completion flags, loader stream) on the GPU machine.
"""

import os
import signal
import time

import pytest
import torch

pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang_psa.engine import CopyEngine, EngineDied, KVSaver, Loader, SaveFailed  # noqa: E402
from sglang_psa.store import BlockPool  # noqa: E402
from sglang_psa.store.host_pool import HostKVPool  # noqa: E402
from sglang_psa.store.slot_store import SlotStore  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
L, H, NB, BS, D = 3, 2, 24, 4, 8


def _segments(blocks: list[int], start: int, n: int) -> list[tuple[int, int, int]]:
    """(block, offset, count) runs for token positions start..start+n of a request."""
    segs, pos = [], start
    while pos < start + n:
        off = pos % BS
        count = min(BS - off, start + n - pos)
        segs.append((blocks[pos // BS], off, count))
        pos += count
    return segs


@pytest.fixture(params=DEVICES)
def rig(request):
    dev = request.param
    pool = HostKVPool(L, H, NB, BS, D, dtype=torch.float32, pin=dev == "cuda")
    ref = HostKVPool(L, H, NB, BS, D, dtype=torch.float32, pin=False)
    eng = CopyEngine(pool, staging_rows=24, pin=dev == "cuda", threads=2)
    yield dev, pool, ref, eng
    eng.close()
    pool.close()


@pytest.mark.parametrize("min_run", [2, 1000])  # with direct block runs / all via the ring
def test_saves_match_reference_across_ring_wraparound(rig, min_run):
    dev, pool, ref, eng = rig
    saver = KVSaver(eng, dev, min_run=min_run)
    alloc = BlockPool(NB, BS)
    g = torch.Generator().manual_seed(0)
    lengths = [37, 13, 22]  # chunks of 10 and the rest: partial blocks at both ends
    tables = [alloc.allocate(list(range(n))) for n in lengths]
    jobs = []
    for t, n in zip(tables, lengths):
        for start in range(0, n, 10):
            m = min(10, n - start)
            for layer in range(L):
                k, v = torch.randn(2, m, H, D, generator=g)
                ref.write_tokens(layer, t.blocks, k.transpose(0, 1), v.transpose(0, 1), start)
                kd, vd = k.to(dev), v.to(dev)
                jobs.append(saver.save(layer, kd, vd, _segments(t.blocks, start, m)))
    saver.drain()
    assert all(saver.is_saved(j) for j in jobs) and not saver.jobs
    assert torch.equal(pool.k, ref.k) and torch.equal(pool.v, ref.v)
    # A save whose segments do not match its rows, or do not fit a block, is refused clearly.
    with pytest.raises(ValueError, match="segments cover"):
        saver.save(
            0, torch.zeros(3, H, D, device=dev), torch.zeros(3, H, D, device=dev), [(0, 0, 2)]
        )
    bad = saver.save(
        0, torch.zeros(5, H, D, device=dev), torch.zeros(5, H, D, device=dev), [(0, 2, 5)]
    )
    with pytest.raises(SaveFailed, match="does not fit"):
        saver.wait(bad)
    eng.check_health()  # the engine survived the bad job


def test_engine_killed_mid_save_is_recovered_without_corruption(rig):
    dev, pool, ref, eng = rig
    eng.close()
    eng.slow_ms = 150
    eng.restart()
    saver = KVSaver(eng, dev)
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 16, H, D, generator=g)
    segs = [(b, 0, BS) for b in (3, 9, 4, 11)]
    job = saver.save(2, k.to(dev), v.to(dev), segs)
    time.sleep(0.25)
    os.kill(eng.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(EngineDied, match="jobs not saved"):
        saver.wait(job)
    assert time.monotonic() - t0 < 1.0
    assert not saver.is_saved(job)  # never reported saved
    eng.slow_ms = 0
    (retry,) = saver.recover()
    saver.wait(retry)
    for i, b in enumerate((3, 9, 4, 11)):
        assert torch.equal(pool.k[2, :, b], k[i * BS : (i + 1) * BS].transpose(0, 1))
        assert torch.equal(pool.v[2, :, b], v[i * BS : (i + 1) * BS].transpose(0, 1))


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
