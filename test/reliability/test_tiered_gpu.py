"""`--psa-kv-home tiered` on a live server (GPU machine): the copy engine killed while
requests are served and written back is noticed and restarted, its unacknowledged saves
are redone, the completions equal those of an unkilled run, and every host block returns
afterwards. Three times: with HBM for KV as large as SGLang makes it; capped below each
prompt, where saved blocks leave HBM and decode (at threshold 1: every block) reads them
back from the host tier, so a redone save that wrote wrong data changes the completions;
capped so, with prefix caching (the tiered home's default) and prompts sharing a 4K-token
stem, whose blocks the tree shares and every later prompt reads from its first saves; and
at `--tp 2` (two GPUs), where one rank's engine is killed and the other's runs on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmark" / "reliability"))

import probes  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.model]

ARGS = [
    "--psa-kv-home", "tiered", "--psa-writeback", "engine",
    "--psa-host-pool-gb", "4", "--max-running-requests", "8",
]  # fmt: skip
NO_TREE = ["--disable-radix-cache"]
CAPPED = [
    "--max-total-tokens", "4096", "--chunked-prefill-size", "2048",
    "--context-length", "32768", "--psa-threshold", "1",
]  # fmt: skip
CASES = {
    "uncapped": NO_TREE,
    "capped": NO_TREE + CAPPED,
    "shared": CAPPED,
    "tp2": NO_TREE + ["--tp-size", "2"],
}
STEM = 4096


@pytest.fixture(scope="module", params=list(CASES))
def server(request, tmp_path_factory):
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    if request.param == "tp2":
        torch = pytest.importorskip("torch")
        if torch.cuda.device_count() < 2:
            pytest.skip("needs two GPUs for --tp 2 (nvidia-h100-x2 or nvidia-h200-x2)")
    log = tmp_path_factory.mktemp("server") / "server.log"
    port = 30131 + list(CASES).index(request.param)
    with probes.live_server(ARGS + CASES[request.param], port, log) as (s, _):
        s.case = request.param
        yield s


def test_engine_killed_mid_save_is_restarted_and_completions_are_unchanged(server):
    before = server.psa_state()["writeback"]
    assert before["engine_restarts"] == 0
    prompts = probes.kill_prompts(stem=STEM if server.case == "shared" else 0)
    rep = probes.engine_kill(server, prompts, new=96)
    print("copy engine killed:", rep)
    assert rep["baseline_complete"] == len(prompts)
    assert rep["writeback_after"]["blocks_saved"] > before["blocks_saved"]
    if server.case in ("capped", "shared"):
        assert rep["units_read_host"] > 0, "nothing was read back from the host tier"
    if server.case == "shared":  # the flush emptied the host tier too: the first computes
        assert rep["cached_tokens"][0] == 0 and max(rep["cached_tokens"][1:]) >= STEM
    else:
        assert not any(rep["cached_tokens"])
    if server.case == "tp2":  # one rank's engine: the other keeps its pid
        assert isinstance(rep["engine_pid_before"], list) and len(rep["engine_pid_before"]) == 2
        assert rep["engine_pid_after"][0] == rep["engine_pid_before"][0]
    assert rep["engine_restarts"] == 1, rep
    assert rep["killed_pid"] not in (rep["engine_pid_after"]
                                     if isinstance(rep["engine_pid_after"], list)
                                     else [rep["engine_pid_after"]])  # fmt: skip
    assert rep["lost"] == 0 and rep["changed"] == 0, rep
    assert rep["settled"], rep["writeback_after"]  # every request ended: every host block back
