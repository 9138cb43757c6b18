"""The benchmark result contract: `benchmark/results/NAME.json` with provenance and a summary."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any


def machine() -> str:
    parts = [
        platform.node() or "host",
        platform.machine(),
        f"{os.cpu_count()} cpus",
        f"python {platform.python_version()}",
    ]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts.append(torch.cuda.get_device_name(0))
        else:
            parts.append("no GPU")
    except ImportError:
        pass
    return ", ".join(parts)


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """The installed version of each distribution in `names` (None: not installed)."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_tag(device: str) -> str:
    """A result file's GPU suffix from a device name: h100, h200, b200 or a100; gpu for
    another GPU, cpu for "no GPU" (a run on another kind never lands under an H100's
    name)."""
    for tag in ("H100", "H200", "B200", "A100"):
        if tag in device:
            return tag.lower()
    return "gpu" if device != "no GPU" else "cpu"


def git_commit(repo: Path | None = None) -> str:
    """`GIT_COMMIT` when set (the GPU machine's copy of .git can be stale), else git's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=repo or Path(__file__).resolve().parent,
            check=True,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=repo or Path.cwd(),
        ).stdout
        return out.stdout.strip() + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("GIT_COMMIT", "unknown")


# The code a measurement ran: the package, the kernels and the benchmarks' Python files.
SOURCE_DIRS = ("python/sglang_psa", "sgl-kernel-ext/sgl_kernel_ext", "benchmark")


def _digest(files: list[tuple[str, bytes]]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def source_digest(
    repo: Path, dirs: tuple[str, ...] = SOURCE_DIRS, suffixes: tuple[str, ...] = (".py",)
) -> str:
    """sha256 of the sources (files ending in `suffixes`) under `dirs` (folders or files)
    in the tree at `repo`, as the tree is (the GPU machine's copy has no trustworthy git):
    with `commit_digest`, a result's `git_commit` is checked to be the tree that ran."""
    files = [
        (f.relative_to(repo).as_posix(), f.read_bytes())
        for d in dirs
        for f in ([repo / d] if (repo / d).is_file() else (repo / d).rglob("*"))
        if f.suffix in suffixes and f.is_file() and "__pycache__" not in f.parts
    ]
    return _digest(files)


@functools.cache
def commit_digest(repo: Path, commit: str) -> str | None:
    """`source_digest` of the tracked Python sources at `commit` (None if git cannot
    read it); cached: a result's parts often share a commit."""
    try:
        names = subprocess.run(
            ["git", "ls-tree", "-r", "--name-only", commit, "--", *SOURCE_DIRS],
            capture_output=True, text=True, cwd=repo, check=True,
        ).stdout.split()  # fmt: skip
        files = [
            (n, subprocess.run(
                ["git", "show", f"{commit}:{n}"], capture_output=True, cwd=repo, check=True
            ).stdout)
            for n in names
            if n.endswith(".py")
        ]  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None
    return _digest(files)


def tree_verified(repo: Path, commit: str, digest: str | None) -> bool | None:
    """Whether the tree that ran (`digest`) is `commit`'s; None when either is unknown."""
    if not digest or not commit or commit == "unknown" or "+dirty" in commit:
        return None if not digest else False
    want = commit_digest(repo, commit)
    return None if want is None else want == digest


def write_result(path: Path, summary: dict[str, Any], data: Any, **extra: Any) -> Path:
    """Write the JSON with `machine`, `command`, `date`, `git_commit`, `summary`, `data`."""
    doc = {
        "machine": machine(),
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "summary": summary,
        **extra,
        "data": data,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")  # whole or not at all: a run killed mid-write
    tmp.write_text(dump_result(doc))  # leaves the last result in place
    tmp.replace(path)
    return path


def _finite(value: Any) -> Any:
    """`value` with every NaN and infinity (numpy's too) as None: JSON has neither, and
    results_tables.py refuses a file holding one."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if value is None or isinstance(value, (str, bool, int)):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    return number if math.isfinite(number) else None


def dump_result(doc: dict[str, Any], pretty_chars: int = 4000) -> str:
    """A result file's text: one line per top-level key, small values indented for
    reading (the summary), large ones (per-request data, logs) compact, so the results
    stay small enough to travel with the working tree. A NaN or infinity is written as
    null (a value the run does not have)."""
    items = []
    for key, value in _finite(doc).items():
        text = json.dumps(value, indent=1, default=float)
        if len(text) > pretty_chars:
            text = json.dumps(value, separators=(",", ":"), default=float)
        items.append(f" {json.dumps(key)}: " + text.replace("\n", "\n "))
    return "{\n" + ",\n".join(items) + "\n}\n"
