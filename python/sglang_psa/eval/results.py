"""The benchmark result contract: `benchmark/results/NAME.json` with provenance and a summary."""

from __future__ import annotations

import datetime as dt
import json
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


def dump_result(doc: dict[str, Any], pretty_chars: int = 4000) -> str:
    """A result file's text: one line per top-level key, small values indented for
    reading (the summary), large ones (per-request data, logs) compact, so the results
    stay small enough to travel with the working tree."""
    items = []
    for key, value in doc.items():
        text = json.dumps(value, indent=1, default=float)
        if len(text) > pretty_chars:
            text = json.dumps(value, separators=(",", ":"), default=float)
        items.append(f" {json.dumps(key)}: " + text.replace("\n", "\n "))
    return "{\n" + ",\n".join(items) + "\n}\n"
