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


_RESOURCES = """
import json, sys
sys.path.insert(0, sys.argv[2])
import compile_sm90
out = []
for launch in compile_sm90.load(__import__("pathlib").Path(sys.argv[1])):
    if launch["kernel"] != "_wave_attention_kernel" or not launch["args"]["CACHED"]["value"]:
        continue
    row = {}
    for cached in (True, False):  # at Qwen 0.5B's shape: head dim 64, 7 query heads a KV head
        k = compile_sm90.compile_launch(launch, overrides={"CACHED": cached, "D": 64, "G": 7})
        row[cached] = compile_sm90.resources(k)
    out.append({"prefetch": launch["args"]["PREFETCH"]["value"], "cached": row[True],
                "uncached": row[False]})
print(json.dumps(out))
"""


def test_reading_cached_units_costs_the_wave_kernel_no_spills(tmp_path):
    """The wave kernel's CACHED branch (a cached unit read from its position's page in
    another layer's buffer) adds a per-row offset to the K/V addresses. Compiled for
    sm_90 at a real shape, each of its variants (the ranked launch and the kept one)
    spills about as much as the same launch without the unit cache (stack a thread within
    1.25x + 512 bytes: Triton 3.6 gives the ranked launch 6.7 KB against 5.7 KB, 3.9 5.0
    against 4.7). An offset the compiler cannot prove 16-element aligned un-vectorized the
    loads: the kept variant went from 255 registers and ~400 bytes of stack to 32
    registers and 7.5 KB, and workload b's decode step from 5.8 ms to 28 ms on the H200."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the launches are recorded in Triton's interpreter (the CPU tests)")
    rec = tmp_path / "launches.jsonl"
    env = {**os.environ, "SGLANG_PSA_RECORD_LAUNCHES": str(rec)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(ROOT / "test/kernels/test_wave_attention.py"),
         "-k", "reads_cached_units and cpu-kept"],
        env=env, cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    compiled = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _RESOURCES, str(rec), str(ROOT / "scripts")],
        env=compiled, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert {r["prefetch"] for r in rows} == {True, False}, rows  # both launches compiled
    for r in rows:
        assert r["cached"]["stack"] <= 1.25 * r["uncached"]["stack"] + 512, rows


_PLANNED = """
import json, sys
sys.path.insert(0, sys.argv[2])
import compile_sm90
from sgl_kernel_ext.wave_attention import WaveAttention
from sglang_psa.config import PSAConfig
cfg = PSAConfig()
bs = cfg.block_size
out = []
for launch in compile_sm90.load(__import__("pathlib").Path(sys.argv[1])):
    a = launch["args"]
    if launch["kernel"] != "_wave_attention_kernel" or a["ONE_WAVE"]["value"] or a["KEPT"]["value"]:
        continue
    for d, hq in ((64, 14), (128, 12)):  # Qwen2.5 0.5B and 1.5B: 2 KV heads
        wa = WaveAttention.from_config(cfg).plan(4, hq, 2, d, 1024, "cpu", host_tier=True)
        tile = wa.tile_tokens or 64  # the host tier's gather (`run`)
        shape = {"D": d, "G": hq // 2, "BS": bs, "NK_BSP": bs, "NBLK": tile // bs, "S": 2,
                 "STAMP": True, "PREFETCH": True}
        planned = dict(launch, options=dict(launch["options"], num_warps=wa.warps))
        r = compile_sm90.resources(compile_sm90.compile_launch(planned, overrides=shape))
        out.append({"head_dim": d, "warps": wa.warps, **r})
    break
print(json.dumps(out))
"""


def test_the_tiered_homes_wave_launch_as_planned_does_not_spill(tmp_path):
    """The launch the tiered home's decode runs every layer (waves over ranked blocks, K/V
    gathered from HBM pages, the unit cache and the host tier), compiled for sm_90 at the
    warps `plan(host_tier=True)` picks and the tile `run` gathers, at Qwen2.5 0.5B's and
    1.5B's shapes with the default block size: at most 1 KB of stack a thread. With two
    warps ptxas gave it 32 registers and 5 KB of spills (12 KB at head dim 128)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the launches are recorded in Triton's interpreter (the CPU tests)")
    rec = tmp_path / "launches.jsonl"
    env = {**os.environ, "SGLANG_PSA_RECORD_LAUNCHES": str(rec)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         str(ROOT / "test/kernels/test_wave_attention.py"),
         "-k", "reads_cached_units and cpu-ranked"],
        env=env, cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    compiled = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _PLANNED, str(rec), str(ROOT / "scripts")],
        env=compiled, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["head_dim"] for r in rows] == [64, 128], rows
    for r in rows:
        assert r["stack"] <= 1024, rows
