"""A prompt larger than SGLang's KV pool in HBM at `--psa-kv-home tiered` (GPU machine):
it is prefilled in chunks whose saved blocks leave HBM, each chunk reading its prefix
staged from HBM and the host tier, then decoded from the host tier. Its completion is
token for token the one the same server gives with the whole prompt in HBM; afterwards
nothing is held. Without the tiered home SGLang refuses the prompt (HTTP 400)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

PROMPT, NEW, POOL = 20_000, 32, 8192
BASE = [
    "--psa-kv-home", "tiered", "--psa-host-pool-gb", "2", "--chunked-prefill-size", "2048",
    "--context-length", "32768", "--max-running-requests", "4", "--cuda-graph-max-bs", "4",
    "--psa-threshold", "1",  # decode reads every block: the evicted ones from the host tier
]  # fmt: skip


def _serve(args, port, log):
    ids = probes.prompt(PROMPT, seed=7)
    with probes.live_server(args, port, log) as (s, proc):
        outs = []
        for _ in range(2):  # twice: the same answer once every kernel is compiled
            r = s.generate(ids, NEW)
            assert r.status_code == 200, r.text[:500]
            outs.append(r.json()["output_ids"])
        assert outs[0] == outs[1]
        out = outs[0]
        st, held, after = s.settled()
        assert proc.poll() is None, "the server died"
    return out, st, held, after


def test_a_prompt_larger_than_hbm_completes_as_with_the_prompt_in_hbm(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    capped = [*BASE, "--max-total-tokens", str(POOL)]
    out, st, held, after = _serve(capped, 30171, tmp_path / "capped.log")
    assert st["kv_total_tokens"] < PROMPT  # the prompt is larger than the pool
    assert st["residency"]["staged_batches"] >= 2, st["residency"]  # later chunks staged
    print("server info:", {k: st[k] for k in ("blocks_read_fraction", "writeback", "residency")})
    assert st["residency"]["evictions"] > 0 and st["residency"]["units_read_host"] > 0
    assert not any(held.values()), held
    assert after["residency"]["blocks_evicted"] == 0 and after["writeback"]["host_blocks_used"] == 0
    want, st2, _, _ = _serve(BASE, 30172, tmp_path / "whole.log")
    assert st2["residency"]["staged_batches"] == 0  # the reference never staged
    assert len(out) == NEW and out == want


def test_without_the_tiered_home_the_prompt_is_refused(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    args = ["--max-total-tokens", str(POOL), "--context-length", "32768"]
    with probes.live_server(args, 30173, tmp_path / "hbm.log") as (s, _):
        r = s.generate(probes.prompt(PROMPT, seed=7), NEW)
        assert r.status_code == 400, (r.status_code, r.text[:300])
