"""The decode-step benchmark's summary: keys the issue names, ratios within one stage, and
sync counting that ignores sync debug mode's one-time prototype notice."""

import json
import sys
from pathlib import Path

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


def test_summary_joins_profile_and_serving(tmp_path):
    prof = {
        "machine": "GPU",
        "git_commit": "abc",
        "modes": [
            {"mode": "psa", "threshold": 0.98, "launches_per_layer": 6.0, "sync_messages": []},
            {"mode": "psa", "threshold": 1.0, "launches_per_layer": 3.0,
             "sync_messages": ["a synchronizing call"]},
        ],
    }  # fmt: skip
    pf = tmp_path / "p.json"
    pf.write_text(json.dumps(prof))
    out = tmp_path / "s.json"
    run.main(["summarize", "--profile", str(pf), "--out", str(out),
              "--serving", str(ROOT / "benchmark/results/serving_h100.json")])  # fmt: skip
    got = json.loads(out.read_text())
    s = got["summary"]
    assert set(s) == {"launches_per_layer", "syncs_per_step", "step_ms_plain", "step_ms_psa",
                      "step_ms_topk", "step_ms_psa_eps1"}  # fmt: skip
    assert s["launches_per_layer"] == 6.0 and s["syncs_per_step"] == 1
    ratio = got["ratios_vs_plain_same_stage"]["psa"]
    assert abs(ratio - s["step_ms_psa"] / got["plain_step_ms_per_stage"]["psa"]) < 1e-12
    assert {"machine", "command", "date", "git_commit"} <= set(got)
