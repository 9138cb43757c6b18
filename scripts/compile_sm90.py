"""Compile, for an H100/H200 (sm_90), every Triton kernel specialization the CPU tests launched.

    SGLANG_PSA_RECORD_LAUNCHES=/tmp/launches.jsonl python -m pytest -q test/kernels ...
    python scripts/compile_sm90.py /tmp/launches.jsonl

The CPU tests run the kernels in Triton's interpreter, which never compiles them: a kernel
that the interpreter runs can still fail to compile on the GPU machine, where finding out
costs device time. With `SGLANG_PSA_RECORD_LAUNCHES` set, `test/conftest.py` records each
kernel launch the tests make (the kernel, each argument's type, or value where it is an
integer, float, bool or None, and the launch options) once per distinct launch; this
script compiles each recorded launch with this machine's Triton for the `--arch` GPU
(no GPU needed: Triton's own compiler and ptxas), the constexpr parameters at their
recorded values and the arguments specialized on 16-divisibility as a GPU launch would
specialize them, and prints every failure with its error. Exit status 1 on any failure.
`--resources` prints each specialization's registers and stack bytes a thread (spills):
a kernel that compiles can still spill its way to a fraction of its speed (the wave
kernel's unit-cache branch once did, `test_compile_sm90.py` guards it).
Compile with the GPU machine's Triton (3.6 there, `GPU_TRITON`): `--triton DIR` puts a
folder holding it first (`pip install --no-deps --target DIR triton==3.6.0`; `--triton gpu`:
`gpu_triton()` installs it under build/ once); another version's compiler can fail where
that one passes or the reverse.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel-ext")]


# The GPU machine's Triton (torch 2.11's): the compiler whose registers and spills count.
# Another version's can fail where it passes or the reverse (Triton 3.9's pipeliner
# rejects the wave kernel's one-warp descriptor launches that 3.6 compiles, and 3.9 spills
# the tiered home's kept launch at head dim 128 where 3.6 does not).
GPU_TRITON = "3.6.0"


def gpu_triton(root: Path = ROOT / "build") -> Path:
    """A folder holding Triton `GPU_TRITON` for this Python (`--triton`), installed there
    from the package index on first use (`pip install --no-deps --target`). Raises
    RuntimeError naming the command when pip cannot install it."""
    where = root / f"triton-{GPU_TRITON}-py{sys.version_info[0]}{sys.version_info[1]}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{where.name}.lock", "w") as lock:  # one installer at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (where / "triton" / "__init__.py").is_file():
            return where
        tmp = where.with_name(where.name + ".part")
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
               f"triton=={GPU_TRITON}"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not install the GPU machine's Triton {GPU_TRITON} to compile with "
                f"({' '.join(cmd)}): {done.stderr.strip()[-500:]}"
            )
        tmp.rename(where)
    return where


def load(path: Path) -> list[dict]:
    """The distinct launches recorded in `path` (one JSON object a line), in order."""
    seen, out = set(), []
    for line in path.read_text().splitlines():
        if line.strip() and line not in seen:
            seen.add(line)
            out.append(json.loads(line))
    return out


def source(launch: dict, overrides: dict | None = None):
    """Triton's `ASTSource` for a recorded launch, and what makes it distinct: the kernel
    as compiled (no interpreter), its pointer and scalar parameters typed and specialized
    on 16-divisibility as a GPU launch would be (pointers recorded 16-byte aligned or not
    recorded either way, integers that are multiples of 16, except the parameters the
    kernel declares not specialized on them), its constexpr parameters at
    their values (launches differing only in scalar values are one). `overrides`: values
    in place of recorded ones (a real shape's head dim in place of a test's)."""
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    params = {p.name: p for p in fn.params}
    signature, constexprs, attrs = {}, {}, {}
    for name, arg in launch["args"].items():
        if name not in params:
            raise KeyError(f"{launch['kernel']} has no parameter {name!r} (stale record?)")
        if overrides and name in overrides:
            arg = dict(arg, value=overrides[name])
        if params[name].is_constexpr or arg["kind"] == "none":
            signature[name] = "constexpr"
            # `INTERP` (a kernel's interpreter-only path) is False where it compiles
            constexprs[name] = False if name == "INTERP" else arg.get("value")
            continue
        signature[name] = arg["type"]
        # (what the kernel declares `do_not_specialize[_on_alignment]` is not specialized)
        aligned = arg["type"].startswith("*") and arg.get("div16", True)
        aligned = aligned and not params[name].do_not_specialize_on_alignment
        div16 = arg["type"] in ("i32", "i64") and arg.get("value", 1) % 16 == 0
        if aligned or (div16 and not params[name].do_not_specialize):
            attrs[(fn.arg_names.index(name),)] = [["tt.divisibility", 16]]
    key = json.dumps([launch["module"], launch["kernel"], signature, constexprs,
                      sorted(attrs), launch["options"]], sort_keys=True, default=repr)  # fmt: skip
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), key


def compile_launch(launch: dict, arch: int = 90, overrides: dict | None = None, src=None):
    """A recorded launch compiled for `arch` (`source`'s `overrides`; `src`: its source,
    where the caller has it already)."""
    import triton
    from triton.backends.compiler import GPUTarget

    if src is None:
        src, _ = source(launch, overrides)
    opts = {k: v for k, v in launch["options"].items() if k in ("num_warps", "num_stages")}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)


def resources(kernel) -> dict:
    """Registers a thread and stack bytes a thread (spilled registers, mostly) of a
    compiled kernel, from its cubin (`cuobjdump`, shipped with Triton's CUDA backend)."""
    import tempfile

    import triton.backends.nvidia as nv

    tool = Path(nv.__file__).parent / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], check=True,
                             capture_output=True, text=True).stdout  # fmt: skip
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"no resource usage in cuobjdump's output: {out[:500]}")
    return {"regs": int(m.group(1)), "stack": int(m.group(2))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("launches", type=Path, help="the file SGLANG_PSA_RECORD_LAUNCHES named")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90)")
    ap.add_argument("--triton", help="a folder holding the Triton to compile with, or 'gpu' "
                    f"(Triton {GPU_TRITON}, installed under build/ on first use)")  # fmt: skip
    ap.add_argument("--resources", action="store_true",
                    help="print each specialization's registers and stack a thread")  # fmt: skip
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 is set: kernels load as interpreted functions, not compiled")
    if args.triton is not None:
        folder = gpu_triton() if args.triton == "gpu" else Path(args.triton)
        if not (folder / "triton" / "__init__.py").is_file():
            ap.error(f"--triton {args.triton}: no triton package there")
        sys.path.insert(0, str(folder))
    import triton

    done: set = set()
    failed = n = 0
    t0 = time.perf_counter()
    for launch in load(args.launches):
        what = f"{launch['module']}.{launch['kernel']} {launch['options']}"
        try:
            src, key = source(launch)
            if key in done:
                continue
            done.add(key)
            n += 1
            kernel = compile_launch(launch, args.arch, src=src)
            if args.resources:
                print(f"{what}: {resources(kernel)}", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL {what}\n    {type(e).__name__}: {str(e)[:2000]}", flush=True)
    took = time.perf_counter() - t0
    print(f"compile_sm90: {n - failed} of {n} kernel specializations compiled for "
          f"sm_{args.arch} with Triton {triton.__version__} in {took:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
