"""Retraction at `--psa-kv-home tiered` (GPU machine): SGLang retracts decoding requests
(forced every few forwards with its `SGLANG_TEST_RETRACT`), and each one resumes from
the blocks it had saved in the host tier, its prefill computing only the few tokens
after them, where SGLang alone frees the KV and prefills the whole request again. The
completions are those of the same server without retraction: token for token, except
where the model itself finds the two tokens a near tie (a resumed request's last few
tokens are computed by the prefill kernel, not by decode steps, and its batches differ,
so bf16 rounding differs); afterwards nothing is held or parked. Twice: without prefix
caching, where a retracted request parks and resumes from its own saved blocks, and with
it (the tiered home's default) on prompts sharing a 2K-token stem, where a retracted
request is matched again from the prefix index (the tree's and the host tier's blocks,
shared with the others) instead of parking."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

PROMPT, NEW, N, BS, STEM = 3000, 96, 4, 32, 2048
NEAR_TIE = 0.1  # nats between the two tokens where completions may part
BASE = [
    "--psa-kv-home", "tiered", "--psa-host-pool-gb", "2",
    "--context-length", "8192",
    "--max-running-requests", str(N), "--cuda-graph-max-bs-decode", str(N),
    "--psa-threshold", "1",  # decode reads every block, the kept ones from the host tier
]  # fmt: skip
NO_TREE = ["--disable-radix-cache"]
PROMPTS = [probes.prompt(PROMPT + 37 * i, seed=20 + i) for i in range(N)]
_STEM = probes.prompt(STEM, seed=19)
SHARED = [_STEM + p[STEM:] for p in PROMPTS]  # the same lengths, one 2K-token stem


def _serve(port, log, prompts, args, check=None):
    with probes.live_server(BASE + args, port, log) as (s, proc):
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
        if check is not None:
            check(s, outs)
        assert proc.poll() is None, "the server died"
    return outs, st, held, after, wall


def _top2(s, ids):
    """The model's two likeliest next tokens after `ids` on server `s`: {token: logprob}."""
    body = {
        "input_ids": ids, "return_logprob": True, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }  # fmt: skip
    r = s.post("/generate", body, timeout=300)
    assert r.status_code == 200, r.text[:300]
    return {int(t): float(lp) for lp, t, *_ in r.json()["meta_info"]["output_top_logprobs"][0]}


@pytest.mark.parametrize("tree", [False, True], ids=["parked", "prefix-tree"])
def test_retracted_requests_resume_from_the_host_tier_with_the_same_completions(
    tree, tmp_path, monkeypatch
):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    prompts, args = (SHARED, []) if tree else (PROMPTS, NO_TREE)
    port = 30183 if tree else 30181
    want, st2, _, _, wall2 = _serve(port + 1, tmp_path / "steady.log", prompts, args)
    print(f"steady server: {wall2:.2f} s, {st2['retracted']} retractions")
    assert st2["retracted"] == 0 and st2["residency"]["resumed"] == 0
    parted = []

    def same_completions(s, outs):
        for i, (o, w) in enumerate(zip(outs, want)):
            assert len(o) == len(w) == NEW
            j = next((j for j, (a, b) in enumerate(zip(o, w)) if a != b), None)
            if j is None:
                continue
            top = _top2(s, prompts[i] + w[:j])
            parted.append((i, j, top))
            assert {o[j], w[j]} == set(top), f"request {i} parts at token {j}: {top}"
            assert abs(top[o[j]] - top[w[j]]) < NEAR_TIE, f"request {i}, token {j}: {top}"

    monkeypatch.setenv("SGLANG_TEST_RETRACT", "1")  # the server inherits it
    outs, st, held, after, wall = _serve(
        port, tmp_path / "retract.log", prompts, args, same_completions
    )
    res = st["residency"]
    print(f"retracting server: {wall:.2f} s, {st['retracted']} retractions, residency {res}")
    print(f"completions parting at near ties (request, token, top-2): {parted}")
    assert st["retracted"] > 0
    if tree:  # matched again from the prefix index: nothing parks
        assert res["resumed"] == 0
    else:
        # Every resumption read at least its prompt's full blocks from the host tier (they
        # were saved by its prefill) and computed again at most its last partial block and
        # the blocks its last two steps completed (not yet planned for a save).
        assert res["resumed"] > 0
        assert res["resumed_host_tokens"] >= res["resumed"] * (PROMPT // BS * BS)
        assert res["resumed_recomputed_tokens"] <= res["resumed"] * 3 * BS
    assert not any(held.values()), held
    ar = after["residency"]
    assert ar["parked_requests"] == 0 and ar["blocks_evicted"] == 0
    assert after["writeback"]["host_blocks_used"] == 0  # held by none (the tree keeps some)
