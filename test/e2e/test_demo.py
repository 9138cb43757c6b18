"""The CPU demo end to end on a real model, at a short context."""

import ast
import re

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
    lines = out.splitlines()
    # The document: at least the context asked for (the chat template adds a little), the
    # same length in the progress line and in the answers' heading.
    n_doc = int(re.search(r"prefill of a (\d+)-token document", out).group(1))
    assert 1024 <= n_doc <= 1024 + 128
    assert f"Answers ({n_doc}-token document, smollm2-135m, cpu)" in out
    # Short names, each explained once by its full label.
    label = DecodePolicy("psa", PSAConfig(threshold=1.0)).label
    assert label.startswith("psa-heuristic-1-") and out.count(label) == 1
    assert "  psa-1     PSA: stops once 1 of the softmax mass" in out
    # Each answer as decoding printed it: two questions, dense then psa-1, and ε = 1 (every
    # block read) gives dense's answer text.
    progress = [re.match(r"\s+q(\d) (\S+)\s+-> (.*)$", ln) for ln in lines]
    said = {(int(m[1]), m[2]): ast.literal_eval(m[3]) for m in progress if m}
    assert list(said) == [(1, "dense"), (1, "psa-1"), (2, "dense"), (2, "psa-1")]
    for q in (1, 2):
        assert said[(q, "dense")].strip() and said[(q, "psa-1")] == said[(q, "dense")]
    # The answers table (fixed columns): the same answers (their first 24 characters), the
    # same correctness for dense and psa-1, identical to dense, and every KV block read.
    head = lines.index(" # policy    answer                   correct =dense  KV read")
    table = lines[head + 1 : lines.index("", head)]
    rows = [
        (int(ln[:2]), ln[3:12].strip(), ln[13:37].rstrip(), ln[38:45].strip(), ln[46:52].strip(),
         ln[53:].strip())
        for ln in table
    ]  # fmt: skip
    assert [(q, name) for q, name, *_ in rows] == list(said)
    for q, name, answer, correct, same, read in rows:
        assert answer == said[(q, name)][:24].rstrip()
        assert correct in ("yes", "NO") and same == "yes" and read == "100.0%", (q, name)
    correct = {(q, name): c for q, name, _, c, *_ in rows}
    assert all(correct[(q, "psa-1")] == correct[(q, "dense")] for q in (1, 2))
    # Per layer: 30 layers of SmolLM2 in order, each read in full at every step and KV head
    # (mean and p99 100%); the read cap does not apply at ε = 1, so no p99 is marked.
    layer_rows = [
        re.match(r"\s*(\d+)\s+([\d.]+)% /\s+([\d.]+)%(\*?)$", ln.rstrip()) for ln in lines
    ]
    layer_rows = [m.groups() for m in layer_rows if m]
    assert [int(m[0]) for m in layer_rows] == list(range(30))
    assert all(m[1:] == ("100.0", "100.0", "") for m in layer_rows), layer_rows
    assert "read cap:" not in out
    # The summary counts every policy's answers from the table, dense's included.
    summary = {}
    for ln in lines:
        m = re.match(r"(\S+)\s+(\d)/2 correct, (\d)/2 identical to dense, mean KV read (.*)$", ln)
        if m:
            summary[m[1]] = (int(m[2]), int(m[3]), m[4])
    assert set(summary) == {"dense", "psa-1"}
    for name in summary:
        n_yes = sum(correct[(q, name)] == "yes" for q in (1, 2))
        assert summary[name] == (n_yes, 2, "100.0%"), (name, summary[name])


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
