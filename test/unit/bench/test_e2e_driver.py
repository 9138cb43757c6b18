"""The end-to-end benchmark's driver on a fake engine: what it sends, what it scores and
how it compares greedy runs, so the GPU run does not fail on plumbing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

PATH = Path(__file__).resolve().parents[3] / "benchmark" / "e2e" / "run_e2e.py"
spec = importlib.util.spec_from_file_location("run_e2e", PATH)
run_e2e = importlib.util.module_from_spec(spec)
sys.modules["run_e2e"] = run_e2e
spec.loader.exec_module(run_e2e)


class FakeEngine:
    """Greedy 'model': token i of a reply is (sum of the prompt + i) % 50; answers 'ANS'."""

    def __init__(self, limit_tokens: int):
        self.limit = limit_tokens
        self.calls = []

    def _one(self, ids, n):
        if len(ids) > self.limit:
            raise ValueError("--psa-host-pool-gb: too long")
        toks = [(sum(ids) + i) % 50 for i in range(n)]
        return {
            "text": "ANS " + " ".join(map(str, toks)),
            "meta_info": {
                "output_token_logprobs": [(-0.1, t, None) for t in toks],
                "output_top_logprobs": [[(-0.1, t, None), (-2.0, t + 1, None)] for t in toks],
                "finish_reason": {"type": "length"},
            },
        }

    def generate(self, prompt=None, input_ids=None, sampling_params=None, **kw):
        self.calls.append(kw)
        n = sampling_params["max_new_tokens"]
        if prompt is not None:
            return self._one([len(prompt)], n)
        if input_ids and isinstance(input_ids[0], list):
            return [self._one(ids, n) for ids in input_ids]
        return self._one(input_ids, n)

    def get_server_info(self):
        idle = {"running": 0, "paused": 0, "kv_held_tokens": 0}
        return {"internal_states": [{"psa": idle}]}


def _workload():
    task = SimpleNamespace(max_new_tokens=8, score=lambda text: text.startswith("ANS"))
    return {
        "tasks": [task, task],
        "task_ids": [[1, 2, 3], [4, 5]],
        "greedy_prompts": [[1, 2, 3], [4, 5], [9]],
        "mixed": [[7] * (i + 1) for i in range(64)],
        "oversized": [1] * 200,
    }


def test_exercise_scores_completes_and_checks_the_oversized_request():
    out = run_e2e.exercise(FakeEngine(limit_tokens=100), _workload(), psa=True)
    assert out["accuracy"] == 1.0
    assert out["concurrent_completed"] == 64
    assert out["leaked"] == 0
    assert "--psa-host-pool-gb" in out["oversized_error"]
    assert out["served_after_error"] is True
    assert len(out["greedy"]) == 3 and len(out["greedy"][0]["ids"]) == 48


def test_runs_from_different_commits_are_reported_not_mixed_silently(capsys):
    same = {"git_commit": "abc", "machine": "H200"}
    runs = {"plain": {"provenance": same}, "psa_1": {"provenance": dict(same)}}
    assert run_e2e.runs_provenance(runs) == {"plain": same, "psa_1": same}
    assert "warning" not in capsys.readouterr().out
    runs["psa_1"]["provenance"]["git_commit"] = "def"
    runs["old"] = {}  # a part written before parts recorded their provenance
    origin = run_e2e.runs_provenance(runs)
    assert origin["psa_1"]["git_commit"] == "def" and origin["old"] == {}
    out = capsys.readouterr().out
    assert "differ in git_commit" in out and "'unknown'" in out
    assert "differ in machine" in out  # the old part's machine is unknown too
