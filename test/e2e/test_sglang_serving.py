"""SGLang serving with `sparse_mode="psa"` on the GPU, against plain SGLang on the same
prompts (SmolLM2-135M, the small real test model). Needs a GPU and SGLang's CUDA stack;
run on the GPU machine (see README, "Air-gapped GPU host")."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a village by the sea,",
    "The three laws of thermodynamics state that",
    " ".join(f"Item {i} costs {i * 7 % 13} dollars." for i in range(200)) + " Item 42 costs",
]


@pytest.fixture(scope="module")
def model_dir():
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    from sglang_psa.models import ensure_model

    return str(ensure_model("smollm2-135m"))


def _engine(model_dir, **kw):
    import sglang as sgl

    return sgl.Engine(
        model_path=model_dir,
        attention_backend="triton",
        sampling_backend="pytorch",
        mem_fraction_static=0.3,
        log_level="error",
        **kw,
    )


def _greedy(eng, n=32):
    outs = eng.generate(prompt=PROMPTS, sampling_params={"temperature": 0, "max_new_tokens": n})
    return [o["text"] for o in outs]


@pytest.fixture(scope="module")
def plain(model_dir):
    eng = _engine(
        model_dir, cuda_graph_backend_decode="disabled", cuda_graph_backend_prefill="disabled"
    )
    try:
        yield _greedy(eng)
    finally:
        eng.shutdown()


def test_threshold_1_matches_plain_sglang_and_bad_requests_are_refused(model_dir, plain):
    eng = _engine(model_dir, sparse_mode="psa", psa_threshold=1.0, psa_host_pool_gb=0.05)
    try:
        got = _greedy(eng)
        same = sum(a == b for a, b in zip(plain, got))
        assert same >= 0.9 * len(PROMPTS), list(zip(plain, got))
        # 0.05 GiB of host pool holds ~2.8K tokens of SmolLM2's KV: a 5K-token prompt is refused.
        with pytest.raises(ValueError, match="--psa-host-pool-gb"):
            eng.generate(prompt="word " * 5000, sampling_params={"max_new_tokens": 4})
        after = eng.generate(prompt=PROMPTS[0], sampling_params={"max_new_tokens": 4})
        assert after["text"]  # still serving
    finally:
        eng.shutdown()


def test_sparse_decode_and_64_concurrent_requests_complete(model_dir):
    eng = _engine(model_dir, sparse_mode="psa", psa_threshold=0.95)
    try:
        prompts = [" ".join(["word"] * (20 + 37 * i)) for i in range(64)]
        outs = eng.generate(
            prompt=prompts, sampling_params={"temperature": 0, "max_new_tokens": 16}
        )
        reasons = [o["meta_info"]["finish_reason"]["type"] for o in outs]
        assert all(r in ("length", "stop") for r in reasons), reasons
        state = eng.get_server_info()["internal_states"][0]["psa"]
        assert state["running"] == 0 and state["paused"] == 0, state
        assert state["kv_held_tokens"] == 0, state  # every page free or in the prefix cache
        assert state["finished"] >= 64, state
    finally:
        eng.shutdown()
