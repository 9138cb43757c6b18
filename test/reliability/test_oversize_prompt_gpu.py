"""A prompt larger than SGLang's KV pool in HBM at `--psa-kv-home tiered` (GPU machine):
it is prefilled in chunks whose saved blocks leave HBM, each chunk reading its prefix
staged from HBM and the host tier, then decoded from the host tier. Its completion is
token for token the one the same server gives with the whole prompt in HBM; afterwards
nothing is held. With prefix caching (the tiered home's default) the prompt sent again
is read from the host tier's kept blocks instead of prefilled, with the same completion
up to a near-tie. Without the tiered home SGLang refuses the prompt (HTTP 400)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

from sglang_psa.config import PSAConfig  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]
# Its servers cap their memory and KV pool: `scripts/gpu_tests.py --server-jobs 2` may run
# this file beside another that says so.
SERVERS_SHARE_THE_GPU = True

PROMPT, NEW, POOL = 20_000, 32, 8192
# Without prefix caching (`--disable-radix-cache`, all but the `tree` case): the prompt is
# sent twice and each time prefilled whole.
BASE = [
    "--psa-kv-home", "tiered", "--psa-host-pool-gb", "2",
    "--chunked-prefill-size", "2048",
    "--context-length", "32768", "--max-running-requests", "4", "--cuda-graph-max-bs-decode", "4",
    "--psa-threshold", "1",  # decode reads every block: the evicted ones from the host tier
    "--mem-fraction-static", "0.3",  # the whole prompt's pool still holds it many times over
]  # fmt: skip


def _pairs(out: dict) -> list:
    """Each step's top-2 (log-prob, token id) pairs of a `/generate` answer."""
    return [[(lp, tok) for lp, tok, *_ in step] for step in out["meta_info"]["output_top_logprobs"]]


def _near_tie(out: list, want: list, top2: list) -> None:
    """`out` is `want` up to its first difference, which may only come at a near-tie of
    `want`'s own top two, `out` taking the runner-up."""
    differ = next((i for i, (a, b) in enumerate(zip(out, want)) if a != b), None)
    if differ is not None:
        (lp0, t0), (lp1, t1) = top2[differ][:2]
        assert t0 == want[differ] and out[differ] == t1 and lp0 - lp1 <= NEAR_TIE, (
            differ, top2[differ], out[differ],
        )  # fmt: skip


def _serve(args, port, log, top2: bool = False, tree: bool = False):
    """Prefilled where `args` say, else on the plugin's default backend, the prompt sent
    twice: (the first completion's ids, with `top2` each step's top-2 (log-prob, token id)
    pairs (else None), server info after, what is still held, the counters once nothing
    runs, both answers). Without `tree` the two completions are the same (each prefilled
    whole, once every kernel is compiled); with it the second is checked by the caller."""
    ids = probes.prompt(PROMPT, seed=7)
    sp = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": ids, "sampling_params": sp}
    if top2:
        body |= {"return_logprob": True, "top_logprobs_num": 2}
    with probes.live_server(args, port, log, prefill=None) as (s, proc):
        outs = []
        for _ in range(2):
            r = s.post("/generate", body, timeout=900)
            assert r.status_code == 200, r.text[:500]
            outs.append(r.json())
        if not tree:
            assert outs[0]["output_ids"] == outs[1]["output_ids"]
        pairs = _pairs(outs[0]) if top2 else None
        st, held, after = s.settled()
        assert proc.poll() is None, "the server died"
    return outs[0]["output_ids"], pairs, st, held, after, outs


# Two tokens whose log-probs differ by at most this are a near-tie in bf16: a prefill on
# another kernel may round them the other way.
NEAR_TIE = 0.05
PSA_BLOCK = PSAConfig().block_size  # the servers' page size, the prefix cache's unit


@pytest.mark.parametrize("prefill", ["triton", "default", "tree"])
def test_a_prompt_larger_than_hbm_completes_as_with_the_prompt_in_hbm(tmp_path, prefill):
    """`triton`: every chunk on SGLang's Triton prefill, staged or not: the completion is
    token for token the whole prompt's. `default`: SGLang's prefill backend (FA3 on a
    Hopper GPU) for the chunks whose prefix is in HBM, Triton beside it for the staged
    ones: the completion is the whole prompt's (all on FA3) up to its first difference,
    which may only come at a near-tie of the whole prompt's own top two. `tree`: as
    `triton`, with prefix caching on: the first completion is the whole prompt's token for
    token; the prompt sent again is served from the host tier's kept blocks (all but its
    last block: SGLang computes at least one token), its completion the first's up to a
    near-tie of the first's top two (its last block computed in a chunk of its own)."""
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    tree = prefill == "tree"
    base = BASE + ([] if tree else ["--disable-radix-cache"])
    base += [] if prefill == "default" else ["--prefill-attention-backend", "triton"]
    capped = [*base, "--max-total-tokens", str(POOL)]
    port = {"triton": 30171, "default": 30174, "tree": 30176}[prefill]
    out, top2, st, held, after, outs = _serve(
        capped, port, tmp_path / "capped.log", top2=tree, tree=tree
    )
    if tree:
        cached = [o["meta_info"]["cached_tokens"] for o in outs]
        assert cached[0] == 0 and cached[1] >= PROMPT - 2 * PSA_BLOCK, cached
        _near_tie(outs[1]["output_ids"], out, top2)
    assert st["kv_total_tokens"] < PROMPT  # the prompt is larger than the pool
    assert st["residency"]["staged_batches"] >= 2, st["residency"]  # later chunks staged
    print("server info:", {k: st[k] for k in ("blocks_read_fraction", "writeback", "residency",
                                              "prefill_backends")})  # fmt: skip
    assert st["prefill_backends"]["staged"] == "TritonAttnBackend", st["prefill_backends"]
    if prefill != "default":
        assert st["prefill_backends"]["prefill"] == "TritonAttnBackend"
    elif st["prefill_backends"]["prefill"] == "TritonAttnBackend":
        pytest.skip("SGLang's prefill here is Triton (no FA3 or FlashInfer): nothing beside it")
    assert st["residency"]["evictions"] > 0 and st["residency"]["units_read_host"] > 0
    assert not any(held.values()), held
    assert after["residency"]["blocks_evicted"] == 0 and after["writeback"]["host_blocks_used"] == 0
    whole = base if not tree else [*base, "--disable-radix-cache"]  # sent twice, prefilled twice
    want, top2, st2, _, _, _ = _serve(whole, port + 1, tmp_path / "whole.log", prefill == "default")
    assert st2["residency"]["staged_batches"] == 0  # the reference never staged
    assert len(out) == NEW
    if prefill != "default":
        assert out == want
        return
    _near_tie(out, want, top2)  # a near-tie of the reference, and our token its runner-up


def test_without_the_tiered_home_the_prompt_is_refused(tmp_path):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    args = ["--max-total-tokens", str(POOL), "--context-length", "32768"]
    with probes.live_server(args, 30173, tmp_path / "hbm.log") as (s, _):
        r = s.generate(probes.prompt(PROMPT, seed=7), NEW)
        assert r.status_code == 400, (r.status_code, r.text[:300])
