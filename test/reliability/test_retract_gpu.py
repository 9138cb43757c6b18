"""Retraction at `--psa-kv-home tiered` (GPU machine): SGLang retracts decoding requests
(forced every few forwards with its `SGLANG_TEST_RETRACT`), and each one resumes from
the blocks it had saved in the host tier, its prefill computing only the few tokens
after them, where SGLang alone frees the KV and prefills the whole request again. The
completions are token for token those of the same server without retraction, and
afterwards nothing is held or parked."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

PROMPT, NEW, N, BS = 3000, 96, 4, 32
BASE = [
    "--psa-kv-home", "tiered", "--psa-host-pool-gb", "2", "--context-length", "8192",
    "--max-running-requests", str(N), "--cuda-graph-max-bs", str(N),
    "--psa-threshold", "1",  # decode reads every block, the kept ones from the host tier
]  # fmt: skip


def _serve(port, log):
    prompts = [probes.prompt(PROMPT + 37 * i, seed=20 + i) for i in range(N)]
    with probes.live_server(BASE, port, log) as (s, proc):
        assert s.generate(prompts[0][:300], 8).status_code == 200  # kernels compiled
        t0 = time.time()
        bg = [probes._in_background(s.generate, p, NEW) for p in prompts]
        for b in bg:
            b["t"].join(600)
        wall = time.time() - t0
        for b in bg:
            assert "r" in b and b["r"].status_code == 200, b.get("e") or b["r"].text[:300]
        outs = [b["r"].json()["output_ids"] for b in bg]
        st, held, after = s.settled()
        assert proc.poll() is None, "the server died"
    return outs, st, held, after, wall


def test_retracted_requests_resume_from_the_host_tier_with_the_same_completions(
    tmp_path, monkeypatch
):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")  # the server inherits it
    outs, st, held, after, wall = _serve(30181, tmp_path / "retract.log")
    res = st["residency"]
    print(f"retracting server: {wall:.2f} s, {st['retracted']} retractions, residency {res}")
    assert st["retracted"] > 0 and res["resumed"] > 0
    # Every resumption read at least its prompt's full blocks from the host tier (they were
    # saved by its prefill) and computed again at most its last partial block and the
    # blocks its last two steps completed (not yet planned for a save).
    assert res["resumed_host_tokens"] >= res["resumed"] * (PROMPT // BS * BS)
    assert res["resumed_recomputed_tokens"] <= res["resumed"] * 3 * BS
    assert not any(held.values()), held
    ar = after["residency"]
    assert ar["parked_requests"] == 0 and ar["blocks_evicted"] == 0
    assert after["writeback"]["host_blocks_used"] == 0
    monkeypatch.delenv("SGLANG_TEST_RETRACT")
    want, st2, _, _, wall2 = _serve(30182, tmp_path / "steady.log")
    print(f"steady server: {wall2:.2f} s, {st2['retracted']} retractions")
    assert st2["retracted"] == 0 and st2["residency"]["resumed"] == 0
    for i, (o, w) in enumerate(zip(outs, want)):
        first = next((j for j, (a, b) in enumerate(zip(o, w)) if a != b), None)
        assert len(o) == NEW and o == w, f"request {i} differs from token {first} on"
