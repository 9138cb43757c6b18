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
recorded values, and prints every failure with its error. Exit status 1 on any failure.
Compile with the GPU machine's Triton (3.6 there): `--triton DIR` puts a folder holding it
first (`pip install --no-deps --target DIR triton==3.6.0`); another version's compiler can
fail where that one passes (Triton 3.9's pipeliner rejects the wave kernel's one-warp TMA
variant that 3.6 compiles) or the reverse.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel-ext")]


def load(path: Path) -> list[dict]:
    """The distinct launches recorded in `path` (one JSON object a line), in order."""
    seen, out = set(), []
    for line in path.read_text().splitlines():
        if line.strip() and line not in seen:
            seen.add(line)
            out.append(json.loads(line))
    return out


def source(launch: dict):
    """Triton's `ASTSource` for a recorded launch, and what makes it distinct: the kernel
    as compiled (no interpreter), its pointer and scalar parameters typed, its constexpr
    parameters at their values (launches differing only in scalar values are one)."""
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    params = {p.name: p for p in fn.params}
    signature, constexprs = {}, {}
    for name, arg in launch["args"].items():
        if name not in params:
            raise KeyError(f"{launch['kernel']} has no parameter {name!r} (stale record?)")
        if params[name].is_constexpr or arg["kind"] == "none":
            signature[name] = "constexpr"
            # `INTERP` (a kernel's interpreter-only path) is False where it compiles
            constexprs[name] = False if name == "INTERP" else arg.get("value")
        else:
            signature[name] = arg["type"]
    key = json.dumps([launch["module"], launch["kernel"], signature, constexprs,
                      launch["options"]], sort_keys=True, default=repr)  # fmt: skip
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs), key


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("launches", type=Path, help="the file SGLANG_PSA_RECORD_LAUNCHES named")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (default 90)")
    ap.add_argument("--triton", type=Path, help="a folder holding the Triton to compile with")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("TRITON_INTERPRET=1 is set: kernels load as interpreted functions, not compiled")
    if args.triton is not None:
        if not (args.triton / "triton" / "__init__.py").is_file():
            ap.error(f"--triton {args.triton}: no triton package there")
        sys.path.insert(0, str(args.triton))
    import triton
    from triton.backends.compiler import GPUTarget

    target = GPUTarget("cuda", args.arch, 32)
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
            opts = {k: v for k, v in launch["options"].items() if k in ("num_warps", "num_stages")}
            triton.compile(src, target=target, options=opts)
        except Exception as e:  # noqa: BLE001 - every failure is reported
            failed += 1
            print(f"FAIL {what}\n    {type(e).__name__}: {str(e)[:2000]}", flush=True)
    took = time.perf_counter() - t0
    print(f"compile_sm90: {n - failed} of {n} kernel specializations compiled for "
          f"sm_{args.arch} with Triton {triton.__version__} in {took:.0f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
