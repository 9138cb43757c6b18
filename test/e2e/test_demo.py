"""The CPU demo end to end on a real model, at a short context."""

import pytest

from sglang_psa import demo

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_demo_prints_answers_and_per_layer_reads(capsys):
    assert (
        demo.main(
            [
                "--model",
                "smollm2-135m",
                "--context-tokens",
                "1024",
                "--thresholds",
                "1.0",
                "--questions",
                "2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Answers (" in out and "Fraction of KV blocks read per layer" in out
    # 30 layers of SmolLM2, one row each.
    rows = [
        ln
        for ln in out.splitlines()
        if ln.strip()[:2].strip().isdigit() and "%" in ln and "/" in ln
    ]
    assert len(rows) == 30
    # ε = 1 reads every block and reproduces dense greedy decoding exactly.
    assert "psa-heuristic-1: " in out
    line = next(ln for ln in out.splitlines() if ln.startswith("psa-heuristic-1: "))
    assert "2/2 identical to dense" in line and "mean KV read 100.0%" in line


def test_demo_rejects_a_bad_threshold():
    with pytest.raises(SystemExit):
        demo.main(["--model", "smollm2-135m", "--thresholds", "1.5"])
