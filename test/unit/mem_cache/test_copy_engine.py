"""Copy-engine process: saved rows land in the right blocks; a killed engine is noticed,
its jobs fail loudly, and a restarted engine works."""

import os
import signal
import time

import pytest
import torch

# pyzmq and orjson are dependencies of the package; a bare GPU host may lack them.
pytest.importorskip("zmq", reason="pyzmq is not installed here (pip install sglang-psa)")
pytest.importorskip("orjson", reason="orjson is not installed here (pip install sglang-psa)")

from sglang_psa.mem_cache.copy_engine import CopyEngine, EngineDied, SaveJob  # noqa: E402
from sglang_psa.mem_cache.host_pool import HostKVPool

pytestmark = pytest.mark.slow


@pytest.fixture
def pool():
    p = HostKVPool(
        layers=2, kv_heads=2, num_blocks=8, block_size=4, head_dim=8, dtype=torch.float32, pin=False
    )
    yield p
    p.close()


def test_save_scatters_rows_into_blocks(pool):
    eng = CopyEngine(pool, staging_rows=16)
    try:
        rows = torch.randn(7, 2, 8)
        sk, sv = eng.staged(3, 7)
        sk.copy_(rows.transpose(0, 1))
        sv.copy_(-rows.transpose(0, 1))
        # 7 tokens: last 2 of block 5 (offset 2), then 4 in block 1, then 1 in block 6.
        job = eng.submit(SaveJob(layer=1, row0=3, segments=[(5, 2, 2), (1, 0, 4), (6, 0, 1)]))
        eng.wait(job)
        torch.testing.assert_close(pool.k[1, :, 5, 2:4], rows[0:2].transpose(0, 1))
        torch.testing.assert_close(pool.k[1, :, 1, 0:4], rows[2:6].transpose(0, 1))
        torch.testing.assert_close(pool.v[1, :, 6, 0:1], -rows[6:7].transpose(0, 1))
        assert not pool.k[0].any()  # other layer untouched
        with pytest.raises(ValueError, match="staging ring"):
            eng.submit(SaveJob(layer=0, row0=14, segments=[(0, 0, 4)]))
    finally:
        eng.close()


def test_engine_listens_privately_and_rejects_malformed_commands(pool):
    """The socket sits in a directory only its user can enter; a command with a bad field
    or an index outside the pool is answered with a rejection, never executed."""
    import orjson

    eng = CopyEngine(pool, staging_rows=16)
    try:
        ipc_dir = os.path.dirname(eng._ipc_path)
        assert os.stat(ipc_dir).st_mode & 0o777 == 0o700
        bad = [
            b"not json",
            orjson.dumps({"op": "exec", "job": 1}),
            orjson.dumps(
                {
                    "op": "save",
                    "job": 2,
                    "layer": 9,
                    "row0": 0,
                    "segments": [[0, 0, 4]],
                    "gpu_flag": False,
                }
            ),  # fmt: skip
            orjson.dumps(
                {
                    "op": "save",
                    "job": 3,
                    "layer": 0,
                    "row0": 0,
                    "segments": [[8, 0, 4]],
                    "gpu_flag": False,
                }
            ),  # fmt: skip
            orjson.dumps(
                {
                    "op": "save",
                    "job": 4,
                    "layer": 0,
                    "row0": 14,
                    "segments": [[0, 0, 4]],
                    "gpu_flag": False,
                }
            ),  # fmt: skip
            orjson.dumps(
                {
                    "op": "save",
                    "job": 5,
                    "layer": 0,
                    "row0": 0,
                    "segments": [[0, 0, "4"]],
                    "gpu_flag": False,
                }
            ),  # fmt: skip
        ]
        for msg in bad:
            eng.sock.send(msg)
            assert eng.sock.poll(30_000), "the engine did not answer"
            ack = orjson.loads(eng.sock.recv())
            assert ack["ok"] is False and ack["error"].startswith("rejected"), ack
        assert not pool.k.any() and eng.proc.is_alive()
        eng.wait(eng.submit(SaveJob(layer=0, row0=0, segments=[(2, 0, 4)])))  # still serves
    finally:
        eng.close()
    assert not os.path.exists(ipc_dir)


def test_killed_engine_is_detected_jobs_fail_and_restart_works(pool):
    eng = CopyEngine(pool, staging_rows=64, slow_ms=200)
    try:
        eng.staged(0, 32)[0].fill_(1.0)
        job = eng.submit(SaveJob(layer=0, row0=0, segments=[(b, 0, 4) for b in range(8)]))
        time.sleep(0.3)  # the engine is mid-save
        os.kill(eng.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDied, match=rf"jobs not saved: \[{job}\]"):
            eng.wait(job)
        assert time.monotonic() - t0 < 1.0  # noticed within a second
        assert not pool.k[0, :, 7].any()  # the last block of the killed save never landed
        eng.slow_ms = 0
        eng.restart()
        job2 = eng.submit(SaveJob(layer=0, row0=0, segments=[(7, 0, 4)]))
        eng.wait(job2)
        assert bool((pool.k[0, :, 7] == 1.0).all())
        assert eng.restarts == 1
    finally:
        eng.close()


@pytest.mark.parametrize("threads", [0, 3])
def test_scatter_rows_runs_and_scattered_blocks_match_per_token_reference(threads):
    """Whole-block runs (consecutive ids, short runs, shuffled ids) and partial blocks land
    where a per-token copy puts them."""
    from concurrent.futures import ThreadPoolExecutor

    from sglang_psa.mem_cache.copy_engine import scatter_rows

    g = torch.Generator().manual_seed(threads)
    L, H, N, bs, d = 2, 3, 40, 4, 5
    blocks = [7, 8, 9, 10, 11, 30, 2, 3, 19, 20, 21, 22, 23, 24, 5]
    segs = [(39, 1, 3)] + [(b, 0, bs) for b in blocks] + [(33, 0, 2)]
    n = sum(c for _, _, c in segs)
    sk, sv = torch.randn(2, H, n, d, generator=g)
    pool_k, pool_v = torch.zeros(2, L, H, N, bs, d)
    want_k, want_v = torch.zeros(2, L, H, N, bs, d)
    row = 0
    for b, off, c in segs:
        for t in range(c):
            want_k[1, :, b, off + t] = sk[:, row]
            want_v[1, :, b, off + t] = sv[:, row]
            row += 1
    pool = ThreadPoolExecutor(threads) if threads else None
    scatter_rows(pool_k, pool_v, sk, sv, 1, segs, pool)
    assert torch.equal(pool_k, want_k) and torch.equal(pool_v, want_v)
