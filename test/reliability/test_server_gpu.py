"""A live `--sparse-mode psa` server under hostile input, aborts and overload (GPU machine).

A server at each KV home (Qwen2.5-Coder-0.5B with `probes.SERVER_ARGS`: `--api-key`,
`--enable-metrics`, KV capped so that queueing and retraction happen; the tiered home with
SGLang's radix cache over the host tier, `probes.TIERED_ARGS`, where KV spills to the host
tier instead, retraction forced by SGLang's test switch, `probes.KV_HOME_ENV`) takes the
probe catalogue
of `benchmark/reliability/probes.py`: every bad input gets its answer or a clear 4xx, every
fault (requests sharing a prefix aborted, a prefix evicted from HBM and asked again among
them) leaves no request slot, KV page or admission entry held. The soak is the
benchmark's (`benchmark/reliability/run.py`), not a test.
"""

from __future__ import annotations

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


@pytest.fixture(scope="module", params=list(probes.KV_HOMES))
def server(request, tmp_path_factory):
    """The probes' server at each KV home (tiered: SGLang's radix cache over the host tier)."""
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = probes.SERVER_ARGS + probes.KV_HOMES[request.param]
    port = 30127 + 2 * list(probes.KV_HOMES).index(request.param)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SGLANG_PSA_HOST_TIMING", "1")  # the scheduler loop times itself
        mp.setenv("SGLANG_PSA_HOST_PROFILE", "200")  # and samples its stack
        env = probes.KV_HOME_ENV[request.param]  # the tiered home: retraction forced
        with probes.live_server(args, port, log, probes.API_KEY, env=env) as (s, _):
            yield s


def test_bad_inputs_get_an_answer_or_a_clear_4xx(server):
    outcomes = probes.bad_inputs(server)
    failed = [o for o in outcomes if not o.ok]
    assert len(outcomes) >= 30 and not failed, "\n".join(map(str, failed))


@pytest.mark.parametrize("fault", probes.FAULTS, ids=lambda f: f.__name__)
def test_faults_leave_nothing_held(server, fault):
    """Each fault leaves nothing held (the client-disconnect probe: the request aborted)."""
    o = fault(server)
    assert o.ok, f"{o.name}: expected {o.expected}; got {o.got} ({o.detail})"


def test_psa_gauges_are_in_metrics(server):
    o = probes.metrics_endpoint(server)
    assert o.ok, o


def test_the_scheduler_loop_times_its_decode_iterations(server):
    """A lone request's 64 decode steps show in `psa_host_timing` under decode batch 1:
    every phase took time, and an iteration holds its phases."""

    def timing() -> dict:
        return server.info()["internal_states"][0]["psa_host_timing"].get("decode/1", {})

    before = timing()
    r = server.generate(probes.prompt(2000, seed=7), 64)
    assert r.status_code == 200, r.text
    after = timing()
    n = after["n"] - before.get("n", 0)
    assert n >= 60, (before, after)
    spent = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_s")}
    assert all(v > 0 for v in spent.values()), spent
    phases = sum(v for k, v in spent.items() if k != "iteration_s")
    # gpu_wait and results count under the batch processed, one iteration later
    assert phases <= spent["iteration_s"] * 1.1, spent
    assert spent["iteration_s"] / n < 0.1, spent  # ms-scale steps, not a stall


def test_the_scheduler_loop_profile_samples_sglangs_own_functions(server):
    """With `SGLANG_PSA_HOST_PROFILE` the loop's samples of a lone request's decode land
    under decode batch 1, in the loop's phases, with SGLang's `run_batch` on the stack of
    the launch-phase samples (all but those landing in the timing hook around it)."""

    def profile() -> dict:
        state = server.info()["internal_states"][0]
        return state["psa_host_profile"].get("decode/1", {"samples": 0, "functions": {}})

    before = profile()
    r = server.generate(probes.prompt(2000, seed=8), 256)
    assert r.status_code == 200, r.text
    after = profile()
    assert after["samples"] - before["samples"] >= 10, (before, after)
    launch = after["phases"].get("launch", 0) - before.get("phases", {}).get("launch", 0)
    assert launch > 0, after["phases"]
    run_batch = [
        v[0] - before["functions"].get(k, [0, 0])[0]
        for k, v in after["functions"].items()
        if k.startswith("launch|sglang/srt/managers/scheduler.py:run_batch:")
    ]
    assert len(run_batch) == 1 and run_batch[0] >= 0.9 * launch, (launch, run_batch)
