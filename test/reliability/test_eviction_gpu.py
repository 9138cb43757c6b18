"""`--psa-kv-home tiered` under capped HBM on a live server (GPU machine): more requests
run at once than the KV pool holds, because saved blocks give their pages back; every
request completes; afterwards no block stays evicted, no host block or KV page is held.

(Answers under eviction are compared with plain SGLang's by the serving benchmark's
workload b: accuracy and completions identical to plain.)"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]
# Its servers cap their memory and KV pool: `scripts/gpu_tests.py --server-jobs 2` may run
# this file beside another that says so.
SERVERS_SHARE_THE_GPU = True

PROMPT, NEW, N = 6000, 128, 6
# A pool of 14K tokens holds two such requests whole; six run at once only by eviction.
# The pool is capped by tokens, so the fraction only sets SGLang's start-up check: the KV
# budget is the GPU memory free after the weights load less (1 - fraction) of what was free
# before. At 0.3 a neighbour that took 15 GB more during this start-up left none (H100,
# SGLang 0.5.23, 2026-12-06, 55 GB free before): at 0.5 it may take 26 GB.
# Without prefix caching (`--disable-radix-cache`): afterwards no host block may be held,
# which a prefix cache's kept blocks would be; the tiered home's default keeps prefixes
# (test_server_gpu.py's tiered probes: `host_tier_full`, `prefix_evicted_then_reread`).
ARGS = [
    "--psa-kv-home", "tiered", "--disable-radix-cache", "--psa-host-pool-gb", "2",
    "--max-total-tokens", "14336", "--mem-fraction-static", "0.5",
]  # fmt: skip


def test_capped_hbm_runs_more_requests_than_it_holds_and_frees_everything(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    with probes.live_server(ARGS, 30151, tmp_path / "server.log") as (s, proc):
        codes: list[tuple[int, int]] = []

        def one(i: int) -> None:
            r = s.generate(probes.prompt(PROMPT, seed=i), NEW)
            n = len(r.json()["output_ids"]) if r.status_code == 200 else -1
            codes.append((r.status_code, n))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(N)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        assert proc.poll() is None, "the server died under load"
        assert codes == [(200, NEW)] * N, codes
        st = s.psa_state()
        print("residency:", st["residency"], "write-back:", st["writeback"])
        assert st["residency"]["evictions"] > 0, "no block left HBM: the cap did not bind"
        assert st["admitted"] >= N and st["retracted"] == 0, st
        held = s.leaks()
        assert not any(held.values()), held
        st = s.psa_state()
        assert st["residency"]["blocks_evicted"] == 0, st["residency"]
        assert st["writeback"]["host_blocks_used"] == 0, st["writeback"]
