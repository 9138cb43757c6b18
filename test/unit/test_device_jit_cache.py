"""`scripts/device_jit_cache.sh`: compiled-kernel caches saved in parts small enough to
come back from the device, restored byte for byte where they were; the Triton cache
alone when both do not fit; nothing when even that does not."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_jit_cache.sh"
MIB = 1024 * 1024

pytestmark = pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")


def _run(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"} | {"HOME": str(home)}
    return subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def _caches(home: Path, triton_bytes: int, fi_bytes: int) -> dict[Path, bytes]:
    """Files in both caches, random (incompressible) so sizes survive gzip."""
    files = {
        home / ".triton/cache/ab12/_wave_attention_kernel.cubin": os.urandom(triton_bytes),
        home / ".triton/cache/ab12/_wave_attention_kernel.json": b'{"name": "wave"}',
        home / ".cache/flashinfer/0.6/90a/cached_ops/decode.so": os.urandom(fi_bytes),
    }
    for p, data in files.items():
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return files


def test_save_then_restore_on_a_fresh_machine_gives_the_same_files(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    files = _caches(home, 20 * MIB, 2 * MIB)
    r = _run(home, "save", str(out))
    assert r.returncode == 0, r.stderr
    parts = sorted(out.glob("jit-cache.part-*"))
    assert [p.name for p in parts] == ["jit-cache.part-00", "jit-cache.part-01"]
    assert all(p.stat().st_size <= 15 * MIB for p in parts)
    shutil.rmtree(home)  # the next session's machine has none of it
    r = _run(home, "restore", str(out))
    assert r.returncode == 0 and "restored 2 part(s)" in r.stdout, r.stderr
    for p, data in files.items():
        assert p.read_bytes() == data, p


def test_the_triton_cache_alone_when_both_do_not_fit_and_nothing_when_it_does_not(tmp_path):
    home, out = tmp_path / "home", tmp_path / "out"
    _caches(home, 10 * MIB, 20 * MIB)
    r = _run(home, "save", str(out), "1")
    assert r.returncode == 0 and "Triton alone" in r.stdout, r.stdout + r.stderr
    (part,) = out.glob("jit-cache.part-*")
    shutil.rmtree(home)
    assert _run(home, "restore", str(out)).returncode == 0
    assert (home / ".triton/cache/ab12/_wave_attention_kernel.json").exists()
    assert not (home / ".cache/flashinfer").exists()

    big, out2 = tmp_path / "big", tmp_path / "out2"
    _caches(big, 20 * MIB, 1)
    r = _run(big, "save", str(out2), "1")
    assert r.returncode == 0 and "nothing saved" in r.stdout
    assert not list(out2.glob("jit-cache.part-*"))


def test_restore_without_parts_names_the_folder(tmp_path):
    r = _run(tmp_path, "restore", str(tmp_path / "none"))
    assert r.returncode != 0 and "no jit-cache.part-*" in r.stderr
    assert _run(tmp_path, "save").returncode != 0  # usage


def test_every_shell_script_runs_by_its_path():
    """The device commands run `scripts/X.sh ...` as their usage lines say (this one was
    not executable, and its save failed on the H200 with "Permission denied")."""
    scripts = sorted(SCRIPT.parent.glob("*.sh"))
    assert SCRIPT in scripts
    assert [p.name for p in scripts if not os.access(p, os.X_OK)] == []
