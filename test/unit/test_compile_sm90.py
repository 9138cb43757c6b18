"""`scripts/compile_sm90.py`: the kernel launches a CPU test makes in Triton's interpreter,
recorded by `test/conftest.py` (`SGLANG_PSA_RECORD_LAUNCHES`), compile for sm_90 here
without a GPU (the decode-slot kernel, the unit cache's refresh and the tiered home's step
tables); a record naming a parameter the kernel lacks fails the run."""

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


def _record(tmp_path, *pytest_args) -> tuple:
    """The launches the CPU tests `pytest_args` make in Triton's interpreter, recorded to a
    file; returns it and the environment to compile in: the interpreter off, the GPU
    machine's Triton first on the path (`compile_sm90.gpu_triton`, installed on first use:
    registers and spills are that compiler's)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the launches are recorded in Triton's interpreter (the CPU tests)")
    rec = tmp_path / "launches.jsonl"
    env = {**os.environ, "SGLANG_PSA_RECORD_LAUNCHES": str(rec)}
    env.pop("PYTEST_XDIST_WORKER", None)
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
         *pytest_args],
        env=env, cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    compiled = {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}
    path = [str(compile_sm90.gpu_triton()), compiled.get("PYTHONPATH", "")]
    compiled["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
    return rec, compiled


def _compiled_as_served(tmp_path, script: str, tests: str, select: str) -> list[dict]:
    """The rows `script` prints (JSON, its last line) given the launches the CPU tests
    `tests -k select` recorded and the scripts folder: it compiles them at served shapes
    and reads their resources (the interpreter off)."""
    rec, compiled = _record(tmp_path, str(ROOT / tests), "-k", select)
    done = subprocess.run(
        [sys.executable, "-c", script, str(rec), str(ROOT / "scripts")],
        env=compiled, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_recorded_launches_compile_for_sm90(tmp_path):
    rec, compiled = _record(
        tmp_path,
        str(ROOT / "test/kernels/test_decode_slots.py"),
        str(ROOT / "test/kernels/test_unit_cache.py"),
        str(ROOT / "test/kernels/test_step_tables.py"),
        "-k", "kernel_matches and cpu or heavy_layer and cpu",
    )  # fmt: skip
    launches = compile_sm90.load(rec)
    want = {"_decode_slots_kernel", "_refresh_kernel", "_tiered_tables_kernel"}
    assert {x["kernel"] for x in launches} == want

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


_PLANNED = """
import json, sys
sys.path.insert(0, sys.argv[2])
import compile_sm90
from sgl_kernel_ext.wave_attention import WaveAttention
from sglang_psa.config import PSAConfig
cfg = PSAConfig()
bs = cfg.block_size
out, seen = [], set()
for launch in compile_sm90.load(__import__("pathlib").Path(sys.argv[1])):
    a = dict(launch["args"])
    if launch["kernel"] != "_wave_attention_kernel":
        continue
    kept = a["KEPT"]["value"] and a["ONE_WAVE"]["value"]  # the kept rows' launch
    if a["CACHED"]["value"] and not a["HOST_ROWS"]["value"]:
        continue  # served with the step's row flags (rows with no block off HBM read apart)
    if a["CACHED"]["value"]:
        # the kept rows' launch; the ranked rows' waves beside it (the default); waves
        # with no kept selection (the certified rule, `--psa-rerank-interval 1`)
        role = "tiered_kept" if kept else "tiered_ranked" if a["KEPT"]["value"] else "tiered_waves"
    elif not a["CACHED"]["value"] and a["TMA"]["value"] and a["PREFETCH"]["value"]:
        role = "hbm_ranked"  # the HBM home's waves, read through tensor descriptors
    else:
        continue
    if role in seen:
        continue
    seen.add(role)
    for n in ("q_ptr", "k_slots", "v_slots", "k_host", "v_host", "out_ptr"):
        a[n] = dict(a[n], type="*bf16")  # the served model's dtype (the test's is float32)
    for d, hq in ((64, 14), (128, 12)):  # Qwen2.5 0.5B and 1.5B: 2 KV heads
        wa = WaveAttention.from_config(cfg).plan(4, hq, 2, d, 1024, "cpu")
        kept = role == "tiered_kept"
        if kept:
            warps, tile = wa.kept_warps, wa.kept_tile_tokens
        else:  # what `plan` picks where descriptors are read (sm_90; not on this CPU)
            warps, tile = wa.num_warps or WaveAttention.launch_warps(True), bs
        if not kept:  # waves read HBM blocks through descriptors at both homes
            assert a["TMA"]["value"], role
            for n in ("k_desc", "v_desc"):
                a[n] = dict(a[n], type=f"tensordesc<bf16[{bs}, {d}]>")
        shape = {"D": d, "G": hq // 2, "BS": bs, "NK_BSP": bs, "NBLK": tile // bs}
        planned = dict(launch, args=dict(a), options=dict(launch["options"], num_warps=warps))
        r = compile_sm90.resources(compile_sm90.compile_launch(planned, overrides=shape))
        out.append({"role": role, "head_dim": d, "warps": warps, **r})
print(json.dumps(out))
"""


def test_decodes_wave_launches_as_planned_do_not_spill(tmp_path):
    """The launches decode runs every layer (the tiered home's ranked and kept rows with
    the unit cache on, its waves reading HBM blocks through tensor descriptors and
    gathering host blocks beside them; the HBM home's waves), compiled for
    sm_90 in bf16 at the warps and tiles `plan` and `run` pick, at Qwen2.5 0.5B's and
    1.5B's shapes and the default block size: at most 1 KB of stack a thread. The cached
    branch adds a per-row offset to another layer's buffer; not declared 16-element
    aligned, it un-vectorized the K/V loads and ptxas kept 32 registers and spilled
    3.6-6.7 KB a thread (Triton 3.6), and workload b's decode step took 28 ms instead of
    5.8 on the H200. The tiered home's waves, the ranked rows' beside a kept selection
    (the default) and those with none, each: loading the next block's ids a tile ahead
    beside the host tier's reads, the first failed Triton 3.6's pipeliner at every shape
    and dtype tried."""
    rows = _compiled_as_served(
        tmp_path, _PLANNED, "test/kernels/test_wave_attention.py",
        "reads_cached_units and cpu or descriptor_reads and cpu-psa-small",
    )  # fmt: skip
    roles = ("hbm_ranked", "tiered_kept", "tiered_ranked", "tiered_waves")
    assert sorted((r["role"], r["head_dim"]) for r in rows) == [
        (role, d) for role in roles for d in (64, 128)
    ], rows
    for r in rows:
        assert r["stack"] <= 1024, rows


_CODE_BOUNDS = """
import json, sys
sys.path.insert(0, sys.argv[2])
import compile_sm90
from sgl_kernel_ext.code_bounds import CODE_CHANNELS
from sglang_psa.config import PSAConfig
cfg = PSAConfig()
out = []
launch = next(x for x in compile_sm90.load(__import__("pathlib").Path(sys.argv[1]))
              if x["kernel"] == "_code_bounds_kernel" and x["args"]["PAGED"]["value"])
launch["args"]["q_ptr"] = dict(launch["args"]["q_ptr"], type="*bf16")  # the served dtype
for d, hq in ((64, 14), (128, 12)):  # Qwen2.5 0.5B and 1.5B: 2 KV heads
    for bits in sorted({cfg.code_bits, 8}):
        shape = {"D": d, "G": hq // 2, "BS": cfg.block_size, "BITS": bits,
                 "DC": min(d, CODE_CHANNELS)}
        r = compile_sm90.resources(compile_sm90.compile_launch(launch, overrides=shape))
        out.append({"head_dim": d, "bits": bits, **r})
print(json.dumps(out))
"""


def test_the_certified_rules_code_bounds_as_served_do_not_spill(tmp_path):
    """The certified rule's ranking reads every block's key codes each step
    (`code_bounds` through the page table): compiled for sm_90 at the default block size,
    code bits (and 8), head dims 64 and 128 and the channels a pass `code_bounds` picks,
    no stack. Rebuilding all 128 channels' cells at once held 255 registers and spilled
    512 bytes a thread; the passes unrolled, ~5 KB (Triton 3.6)."""
    rows = _compiled_as_served(
        tmp_path, _CODE_BOUNDS, "test/kernels/test_code_bounds.py", "page_table_equal and cpu-64"
    )
    assert len(rows) == 4 and all(r["stack"] == 0 for r in rows), rows


_SAVES = """
import json, sys
sys.path.insert(0, sys.argv[2])
import compile_sm90
saves = [x for x in compile_sm90.load(__import__("pathlib").Path(sys.argv[1]))
         if x["kernel"] == "_copy_pages_kernel"]
keys = {compile_sm90.source(x)[1] for x in saves}
compile_sm90.compile_launch(saves[0])
print(json.dumps({"launches": len(saves), "keys": len(keys),
                  "units": sorted({x["args"]["units"]["value"] for x in saves}),
                  "blocks_aligned": sorted({x["args"]["blocks"]["div16"] for x in saves})}))
"""


def test_saves_of_every_size_are_one_specialization(tmp_path):
    """The write-back's save launches at 1-24 blocks, their host blocks the second row of
    the write-back's table (16-byte aligned only at even sizes), are one sm_90
    specialization, and it compiles: a size that specialized anew would compile in the
    middle of serving (the kernel declares its counts and index pointers unspecialized;
    without that these launches were several specializations)."""
    row = _compiled_as_served(
        tmp_path, _SAVES, "test/kernels/test_writeback_gather.py",
        "every_size_are_one_compiled_kernel and cpu",
    )  # fmt: skip
    assert row["launches"] == 5 and len(row["units"]) == 5, row
    assert row["blocks_aligned"] == [False, True], row  # both alignments were launched
    assert row["keys"] == 1, row
