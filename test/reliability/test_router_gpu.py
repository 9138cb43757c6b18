"""Data parallelism (GPU machine): two `--sparse-mode psa` servers behind SGLang's own
`sglang-router` serve a concurrent load through it, `/generate` and the OpenAI API, with
no request failed, both servers serving, and nothing held afterwards on either. On a
machine with one GPU both servers share it (each with a third of its memory); with two,
one server per GPU, as the README's two commands run them."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

N, NEW, PORTS, ROUTER = 24, 32, (30191, 30192), 30190
ARGS = ["--mem-fraction-static", "0.3", "--max-running-requests", "8", "--cuda-graph-max-bs", "8"]


@contextlib.contextmanager
def _router(urls: list[str], log: Path):
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls,
        "--host", "127.0.0.1", "--port", str(ROUTER), "--policy", "round_robin",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{ROUTER}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            assert time.time() < deadline, "the router did not become healthy"
            time.sleep(1)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


def _generate(url: str, i: int) -> requests.Response:
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": probes.prompt(500 + 97 * i, seed=i), "sampling_params": sp}
    return requests.post(url + "/generate", json=body, timeout=600)


def _chat(url: str, i: int) -> requests.Response:
    body = {
        "model": "default", "max_tokens": NEW, "temperature": 0,
        "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
    }  # fmt: skip
    return requests.post(url + "/v1/chat/completions", json=body, timeout=600)


def test_two_psa_servers_behind_sglang_router_serve_a_concurrent_load(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    pytest.importorskip("sglang_router", reason="sglang-router is not installed")
    torch = pytest.importorskip("torch")
    gpus = torch.cuda.device_count()
    with contextlib.ExitStack() as stack:
        servers = []
        for k, port in enumerate(PORTS):
            gpu = ["--base-gpu-id", str(k)] if gpus >= 2 else []  # else both share GPU 0
            s, proc = stack.enter_context(
                probes.live_server([*ARGS, *gpu], port, tmp_path / f"worker{k}.log")
            )
            servers.append((s, proc))
        before = [s.psa_state()["finished"] for s, _ in servers]
        url, router = stack.enter_context(
            _router([s.url for s, _ in servers], tmp_path / "router.log")
        )
        with ThreadPoolExecutor(N + 4) as pool:
            gen = list(pool.map(lambda i: _generate(url, i), range(N)))
            chat = list(pool.map(lambda i: _chat(url, i), range(4)))
        failed = [r.status_code for r in gen + chat if r.status_code != 200]
        print(f"router: {len(gen) + len(chat)} requests on {gpus} GPU(s), failed: {failed}")
        assert not failed, [r.text[:300] for r in gen + chat if r.status_code != 200]
        assert all(len(r.json()["output_ids"]) == NEW for r in gen)
        assert all(r.json()["choices"][0]["message"]["content"] for r in chat)
        served = [s.psa_state()["finished"] - b for (s, _), b in zip(servers, before)]
        print(f"requests each server finished: {served}")
        assert all(n >= N // 4 for n in served), served  # round robin: both served
        for s, proc in servers:
            assert not any(s.leaks().values())
            assert proc.poll() is None, "a server died"
        assert router.poll() is None, "the router died"
