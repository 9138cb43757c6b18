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
    # ε = 1 reads every block and reproduces dense greedy decoding exactly.
    label = DecodePolicy("psa", PSAConfig(threshold=1.0)).label + ": "
    assert label.startswith("psa-heuristic-1-") and label in out
    line = next(ln for ln in out.splitlines() if ln.startswith(label))
    assert "2/2 identical to dense" in line and "mean KV read 100.0%" in line


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
