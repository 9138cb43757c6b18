"""Shared test setup: GPU tests are skipped with a visible reason where no GPU exists."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is
# chosen when a kernel is defined, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# SGLANG_PSA_RECORD_LAUNCHES=<file>: every kernel launch the tests make in Triton's
# interpreter is recorded there (kernel, argument types, constexpr-able values, launch
# options), for `scripts/compile_sm90.py` to compile each for the GPU without a GPU.
if os.environ.get("SGLANG_PSA_RECORD_LAUNCHES") and os.environ.get("TRITON_INTERPRET") == "1":
    import json

    from triton.runtime.interpreter import InterpretedFunction

    _run = InterpretedFunction.run
    _recorded: set = set()

    def _arg(value) -> dict:
        from triton.runtime.jit import mangle_type

        if value is None:
            return {"kind": "none"}
        if isinstance(value, str):  # always a constexpr
            return {"kind": "str", "value": value}
        out = {"kind": type(value).__name__, "type": mangle_type(value)}
        if isinstance(value, (bool, int, float)):  # a constexpr's value, where it is one
            out["value"] = value
        elif hasattr(value, "data_ptr"):  # what Triton specializes a pointer on
            out["div16"] = value.data_ptr() % 16 == 0
        return out

    def _recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: v for k, v in kwargs.items() if k not in names}
        rec = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "args": {k: _arg(v) for k, v in bound.items()},
            "options": {k: v for k, v in options.items() if isinstance(v, (int, float, bool))},
        }
        line = json.dumps(rec, sort_keys=True)
        if line not in _recorded:
            _recorded.add(line)
            with open(os.environ["SGLANG_PSA_RECORD_LAUNCHES"], "a") as f:
                f.write(line + "\n")
        return _run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = _recording_run


# Under pytest-xdist (README's test command: `-n auto`) each worker gets its share of the
# cores for torch's threads, and so do the processes tests start: two workers of two
# threads each on two cores made one matmul-heavy test 11x slower than alone.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(share)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))


# SGLang imports torchvision when it loads; PyPI has no torchvision that loads beside the
# CPU torch build, so where SGLang is installed and torchvision is not, a stub (image
# decoding only, which no test uses) takes its place. Never shadows a real torchvision.
if importlib.util.find_spec("sglang") and not importlib.util.find_spec("torchvision"):
    STUBS = str(Path(__file__).parent / "stubs")
    sys.path.insert(0, STUBS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (STUBS, os.environ.get("PYTHONPATH")) if p
    )


@functools.cache
def sglang_import_error() -> str | None:
    """Why SGLang's engine does not import where SGLang is installed (None: it imports,
    or SGLang is not installed at all)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        importlib.import_module("sglang.srt.entrypoints.engine")
    except Exception as e:  # a broken install: any error, not only ImportError
        return f"{type(e).__name__}: {e}"
    return None


def hidden_sglang_failure(reason: str, cuda: bool, import_error=sglang_import_error) -> str | None:
    """The failure a skip hides, or None where the skip stands. On a GPU machine a test
    skipped for want of SGLang (its reason names SGLang) while SGLang is installed but its
    engine does not import (a wheel built for another torch) is a failure: a broken install
    must not pass for a machine without SGLang. Without a GPU skips stand as they are."""
    if not cuda or "sglang" not in reason.lower():
        return None
    error = import_error()
    if error is None:
        return None
    return f"skipped as {reason!r}, but SGLang is installed here and its engine does not import: {error}"


def _fail_hidden(rep, reason: str) -> None:
    message = hidden_sglang_failure(reason, torch.cuda.is_available())
    if message is not None:
        rep.outcome, rep.longrepr = "failed", message


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's skip for want of SGLang: see `hidden_sglang_failure`."""
    rep = (yield).get_result()
    if rep.skipped and call.excinfo is not None:
        _fail_hidden(rep, str(call.excinfo.value))


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module's skip at import (a module-level `importorskip`): likewise."""
    rep = (yield).get_result()
    if rep.skipped and isinstance(rep.longrepr, tuple):  # (path, line, reason)
        _fail_hidden(rep, str(rep.longrepr[2]))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        # With pytest-xdist (`-n`, README's test command), tests on a GPU machine run in
        # one worker, one after another as without it: many start servers that take most
        # of the GPU's memory, and unmarked ones use the GPU where it exists.
        for item in items:
            item.add_marker(pytest.mark.xdist_group("gpu"))
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The small real model (SmolLM2-135M) with the psa attention function selected."""
    from sglang_psa.hf.decode import load_model
    from sglang_psa.models import ensure_model

    return load_model(ensure_model("smollm2-135m"))


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def kernel_device(request):
    """Run a kernel test on CPU under Triton's interpreter and compiled on a GPU."""
    if request.param == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the CPU case runs under TRITON_INTERPRET=1 (CI); here kernels are compiled")
    return request.param
