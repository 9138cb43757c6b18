"""`scripts/compile_sm90.py`: the kernel launches a CPU test makes in Triton's interpreter,
recorded by `test/conftest.py` (`SGLANG_PSA_RECORD_LAUNCHES`), compile for sm_90 here
without a GPU (the decode-slot kernel and the unit cache's refresh); a record naming a
parameter the kernel lacks fails the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import compile_sm90  # noqa: E402

pytest.importorskip("triton.backends.nvidia", reason="Triton's CUDA backend is not installed")


def test_recorded_launches_compile_for_sm90(tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the launches are recorded in Triton's interpreter (the CPU tests)")
    rec = tmp_path / "launches.jsonl"
    env = {**os.environ, "SGLANG_PSA_RECORD_LAUNCHES": str(rec)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(ROOT / "test/kernels/test_decode_slots.py"),
         str(ROOT / "test/kernels/test_unit_cache.py"),
         "-k", "kernel_matches and cpu or heavy_layer and cpu"],
        env=env, cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    launches = compile_sm90.load(rec)
    assert {x["kernel"] for x in launches} == {"_decode_slots_kernel", "_refresh_kernel"}
    compiled = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}  # kernels as compiled

    def run():
        return subprocess.run(
            [sys.executable, str(ROOT / "scripts/compile_sm90.py"), str(rec)],
            env=compiled, capture_output=True, text=True, timeout=600,
        )  # fmt: skip

    done = run()
    assert done.returncode == 0 and "compiled for sm_90" in done.stdout, done.stdout + done.stderr
    stale = dict(launches[0], args={**launches[0]["args"], "gone": {"kind": "int", "value": 1}})
    rec.write_text(json.dumps(stale) + "\n")
    done = run()
    assert done.returncode == 1 and "no parameter 'gone'" in done.stdout
