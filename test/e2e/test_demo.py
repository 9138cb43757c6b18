"""The CPU demo end to end on a real model, at a short context."""

import pytest

from sglang_psa import demo
from sglang_psa.config import PSAConfig
from sglang_psa.hf.attention import DecodePolicy

pytestmark = [pytest.mark.model, pytest.mark.slow]


def test_demo_prints_answers_and_per_layer_reads(capsys):
    assert (
        demo.main(
            [
                "--cpu",  # the transformers demo, also where a GPU and SGLang exist
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
    # Short names, each explained once by its full label.
    label = DecodePolicy("psa", PSAConfig(threshold=1.0)).label
    assert label.startswith("psa-heuristic-1-") and out.count(label) == 1
    assert "  psa-1     PSA: stops once 1 of the softmax mass" in out
    # The summary counts every policy's answers, dense's included.
    summary = {ln.split()[0]: ln for ln in out.splitlines() if " correct, " in ln}
    assert set(summary) == {"dense", "psa-1"}
    assert "/2 correct, 2/2 identical to dense, mean KV read 100.0%" in summary["dense"]
    # ε = 1 reads every block and reproduces dense greedy decoding exactly; the read cap
    # does not apply to it, so no p99 is marked as capped.
    assert "2/2 identical to dense" in summary["psa-1"] and "100.0%" in summary["psa-1"]
    assert "read cap:" not in out and not any(ln.endswith("*") for ln in rows)


def test_the_legend_explains_the_label_and_a_capped_p99_is_marked():
    policies = [DecodePolicy("dense"), DecodePolicy("psa", PSAConfig(threshold=0.95))]
    text = demo.legend(policies)
    assert "psa-0.95" in text and policies[1].label in text
    assert "mr0.5, the read cap" in text and "(wf4)" in text and "(q8)" in text
    assert demo.read_cap_of(policies[1]) == 0.5
    assert demo.read_cap_of(DecodePolicy("psa", PSAConfig(threshold=1.0))) is None
    assert demo.read_cap_of(DecodePolicy("psa", PSAConfig(stop_rule="certified"))) is None


def test_help_lists_cpu(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--cpu", "--help"])
    assert e.value.code == 0 and "--cpu" in capsys.readouterr().out


def test_demo_rejects_a_bad_threshold():
    with pytest.raises(SystemExit):
        demo.main(["--cpu", "--model", "smollm2-135m", "--thresholds", "1.5"])


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_demo_serves_the_small_model_with_psa(tmp_path):
    """The README's main job on a GPU: the SGLang server with --sparse-mode psa."""
    pytest.importorskip("sglang.srt.entrypoints.engine", reason="SGLang is not installed")
    log = tmp_path / "server.log"
    rc = demo.main(["--exit-after-demo", "--context-tokens", "2048", "--log", str(log)])
    assert rc == 0, log.read_text()[-3000:]
