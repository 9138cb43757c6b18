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
             "launches_per_layer": 6.0, "sync_messages": []},
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
              plain_flashinfer=_sys(3.5, 150), topk=_sys(1.5, 300)),
    ]}}  # fmt: skip
    pf, sf, out = tmp_path / "p.json", tmp_path / "s.json", tmp_path / "o.json"
    pf.write_text(json.dumps(prof))
    sf.write_text(json.dumps(serving))
    run.main(["summarize", "--profile", str(pf), "--out", str(out), "--serving", str(sf)])
    got = json.loads(out.read_text())
    s = got["summary"]
    assert s["syncs_per_step"] == 1
    assert s["launches_per_layer"] == {"psa_t0.98_r1_28000": 6.0, "psa_t1.0_r1_28000": 3.0}
    assert s["launches_per_layer_psa"] == 6.0
    r = s["step_ms_vs_fastest_plain"]
    assert set(r) == {"psa_a", "topk_a16"}
    assert r["psa_a"]["ratio"] == 0.5 and r["psa_a"]["plain_backend"] == "plain_fa3"
    assert r["topk_a16"]["ratio"] == 0.5 and r["topk_a16"]["provenance"]["run_id"] == "3"
    assert {"machine", "command", "date", "git_commit"} <= set(got)
