"""Data parallelism (GPU machine): two `--sparse-mode psa` servers behind SGLang's own
`sglang-router` serve a concurrent load through it, `/generate` and the OpenAI API, with
no request failed, both servers serving, and nothing held afterwards on either. On a
machine with one GPU both servers share it; with two, one server per GPU, as the README's
two commands run them."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]
# Its servers cap their memory and KV pool: `scripts/gpu_tests.py --server-jobs 2` may run
# this file beside another that says so.
SERVERS_SHARE_THE_GPU = True

N, NEW, PORTS, ROUTER = 24, 32, (30191, 30192), 30190
# Each server's KV pool capped: sharing one GPU, the two start at once, and SGLang sizes a
# pool by the memory free when it looks; uncapped, the first took 40 GB of an H200 while the
# second loaded its weights, which SGLang then refused to start ("Loaded weights leave no GPU
# memory for the KV cache"). 96K tokens hold the load's 8 running requests of up to 12K.
ARGS = [
    "--mem-fraction-static", "0.3", "--max-total-tokens", "98304",
    "--max-running-requests", "8", "--cuda-graph-max-bs-decode", "8",
]  # fmt: skip


def test_two_psa_servers_behind_sglang_router_serve_a_concurrent_load(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    torch = pytest.importorskip("torch")
    gpus = torch.cuda.device_count()
    with contextlib.ExitStack() as stack:
        specs = [
            # two GPUs: one server each; one GPU: both share it
            ([*ARGS, *(["--base-gpu-id", str(k)] if gpus >= 2 else [])], port,
             tmp_path / f"worker{k}.log")
            for k, port in enumerate(PORTS)
        ]  # fmt: skip
        servers = stack.enter_context(probes.live_servers(specs))
        before = [s.psa_state()["finished"] for s, _ in servers]
        url, router = stack.enter_context(
            probes.router([s.url for s, _ in servers], ROUTER, tmp_path / "router.log")
        )
        load = probes.mixed_load(url, N, NEW, chats=4, long_every=6)
        print(f"router: {N + 4} requests on {gpus} GPU(s), failed: {load['failures']}")
        assert load["failed"] == 0, load["failures"]
        served = [s.psa_state()["finished"] - b for (s, _), b in zip(servers, before)]
        print(f"requests each server finished: {served}")
        assert all(n >= N // 4 for n in served), served  # round robin: both served
        for s, proc in servers:
            assert not any(s.leaks().values())
            assert proc.poll() is None, "a server died"
        assert router.poll() is None, "the router died"
