"""The decode-step benchmark's summary: keys the issue names, ratios within one stage, and
sync counting that ignores sync debug mode's one-time prototype notice."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from benchmark.decode_step import run  # noqa: E402


def test_sync_warnings_are_counted_without_the_prototype_notice():
    msgs = [
        "Synchronization debug mode is a prototype feature and does not yet detect all "
        "synchronizing operations",
        "called a synchronizing CUDA operation",
        "something else",
    ]
    assert run._syncs(msgs) == ["called a synchronizing CUDA operation"]


def _sys(step, tok_s):
    return {"error": None, "metrics": {"steady_decode": {"step_ms": step}, "output_tok_s": tok_s}}


def _part(workload, run_id, **systems):
    return {"workload": workload, "run_id": run_id, "git_commit": "c", "date": run_id,
            "systems": systems}  # fmt: skip


def test_summary_pairs_each_mode_with_the_fastest_plain_of_its_own_run(tmp_path):
    prof = {
        "machine": "GPU",
        "git_commit": "abc",
        "modes": [
            {"mode": "psa", "threshold": 0.98, "rerank_interval": 1, "prompt_tokens": 28000,
             "launches_per_layer": 6.0, "sync_messages": [], "blocks_read_fraction": 0.25,
             "kernel_us_per_step": {"_score_kernel_bound": 10.0, "_rank_blocks": 5.0,
                                    "_wave_attention_kernel": 1000.0, "_fill": 7.0}},
            {"mode": "psa", "threshold": 1.0, "rerank_interval": 1, "prompt_tokens": 28000,
             "launches_per_layer": 3.0, "sync_messages": ["a synchronizing call"]},
        ],
    }  # fmt: skip
    serving = {"data": {"parts": [
        # fa3 is the fastest plain of run 2 (tok/s), flashinfer's step is shorter: the
        # ratio follows the race's winner, not the shortest step.
        _part("a", "2", plain=_sys(5.0, 100), plain_fa3=_sys(4.0, 300),
              plain_flashinfer=_sys(3.5, 250), psa=_sys(2.0, 400)),
        # topk ran only in a run that raced nothing: no value, whatever its step.
        _part("a", "1", plain=_sys(5.0, 100), topk=_sys(1.0, 500)),
        _part("a16", "3", plain=_sys(4.0, 100), plain_fa3=_sys(3.0, 200),
              plain_flashinfer=_sys(3.5, 150), topk=_sys(0.75, 300)),
    ]}}  # fmt: skip
    pf, sf, out = tmp_path / "p.json", tmp_path / "s.json", tmp_path / "o.json"
    pf.write_text(json.dumps(prof))
    sf.write_text(json.dumps(serving))
    run.main(["summarize", "--profile", str(pf), "--out", str(out), "--serving", str(sf),
              "--hbm-peak-gbps", "3000"])  # fmt: skip
    got = json.loads(out.read_text())
    s = got["summary"]
    main, eps1 = "psa_t0.98_r1_28000", "psa_t1.0_r1_28000"
    assert s["syncs_per_step"] == 1  # the prototype notice is not a sync
    assert s["launches_per_layer"] == {main: 6.0, eps1: 3.0}
    assert s["launches_per_layer_psa"] == 6.0  # the ε 0.98 mode's, not the larger of both
    r = s["step_ms_vs_fastest_plain"]
    assert set(r) == {"psa_a", "topk_a16"}
    # psa 2.0 ms / fa3's 4.0 ms (fa3 won run 2 on tok/s; flashinfer's 3.5 would give 0.571)
    assert r["psa_a"]["ratio"] == 0.5 and r["psa_a"]["plain_backend"] == "plain_fa3"
    assert r["psa_a"]["provenance"]["run_id"] == "2"
    # topk 0.75 ms / fa3's 3.0 ms in run 3 (run 1's 1.0 ms raced no plain backend)
    assert r["topk_a16"]["ratio"] == 0.25 and r["topk_a16"]["plain_backend"] == "plain_fa3"
    assert r["topk_a16"]["provenance"]["run_id"] == "3"
    assert got["serving_steps"] == {
        "psa_a": {"ms": 2.0, "plain_ms": 4.0},
        "topk_a16": {"ms": 0.75, "plain_ms": 3.0},
    }
    # Selection: the score and rank kernels only (10 + 5 us), not the wave kernel or fills.
    assert s["selection_us_per_step"] == {main: 15.0, eps1: 0}
    assert s["wave_kernel_us_per_step"] == {main: 1000.0, eps1: None}
    assert s["blocks_read_fraction"] == {main: 0.25, eps1: None}
    # Bandwidth: K+V bytes of the blocks read over the wave kernel's time. The rig's 32
    # requests hold 28000 + 37 i tokens: 896000 + 37 x 496 = 914352; x 24 layers x 2 KV
    # heads x 64 dims x 2 (K, V) x 2 bytes = 11235557376 bytes; a quarter of them in 1 ms:
    # 2808.889344 GB/s. No wave kernel time: no value.
    assert s["wave_kernel_gbps"][main] == pytest.approx(2808.889344, rel=1e-12)
    assert s["wave_kernel_gbps"][eps1] is None
    assert s["hbm_copy_peak_gbps"] == 3000.0
    assert {"machine", "command", "date", "git_commit"} <= set(got)
