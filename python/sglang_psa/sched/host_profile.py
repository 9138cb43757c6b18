"""A sampling profile of SGLang's scheduler loop by phase: which Python functions the
host spends a decode (or extend) iteration in. A diagnostic that runs only with
`SGLANG_PSA_HOST_PROFILE=<samples per second>` beside `SGLANG_PSA_HOST_TIMING=1` in the
server's environment (plain servers too: the plugin's hooks wrap the loop alike).

`host_timing` says how long each phase of an iteration takes; this says where inside a
phase the time goes. A thread of the scheduler process wakes `hz` times a second, reads
the scheduler thread's Python stack (`sys._current_frames`) and counts it under the
phase the loop is in (`host_timing.PHASES`, or `other`). At the iteration's end the
samples are filed under the batch the iteration launched (`"decode/32"`), as its time is;
an extend batch's under `"extend"`, whatever its size.

Costs and limits: each sample holds the GIL while it walks the stack (tens of us), and
the process's GIL switch interval is shortened to a quarter of the sampling period so
that a sample is taken when asked (Python's default, 5 ms, would cap samples at ~200 a
second); a profiled loop runs slower: runs with it are diagnosis, never results. A
function in C that keeps the GIL shows as its Python caller; a sample that lands while
the scheduler thread waits on the GIL counts where that thread stands.

Contract: `PROFILE.snapshot()` gives, per batch key (`"decode/<size>"`, `"extend"`),
cumulative `samples`, samples per phase and, per `"<phase>|<function>"`, `[inclusive,
self]` sample counts (inclusive: the function was on the stack; self: it was the
innermost frame); a client takes the difference of two snapshots and turns counts into
time with the loop's own timing.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from types import CodeType

ENV = "SGLANG_PSA_HOST_PROFILE"
MAX_DEPTH = 64  # frames kept from the innermost one; SGLang's loop runs ~20-40 deep
MAX_HZ = 10_000


def rate_hz(environ=os.environ) -> float:
    """Samples per second asked for in `SGLANG_PSA_HOST_PROFILE` (0: off). A value that
    is not a number in (0, 10000] stops the server's start with a message naming it."""
    text = environ.get(ENV, "").strip()
    if not text or text == "0":
        return 0.0
    try:
        hz = float(text)
    except ValueError:
        hz = -1.0
    if not 0 < hz <= MAX_HZ:
        raise ValueError(f"{ENV}={text!r}: expected samples per second in (0, {MAX_HZ}]")
    return hz


@functools.lru_cache(maxsize=1)
def _import_roots() -> tuple[str, ...]:
    """The folders modules are imported from (`sys.path`), longest first."""
    roots = {os.path.abspath(p) for p in sys.path if p}
    return tuple(sorted(roots, key=len, reverse=True))


def function_name(code: CodeType, roots: tuple[str, ...] | None = None) -> str:
    """`sglang/srt/managers/scheduler.py:run_batch:2140`: the file from the import root
    it was loaded from (site-packages, a `pip --target` folder, a checkout's `python/`),
    the function and its first line."""
    return f"{_relative(code.co_filename, roots)}:{code.co_name}:{code.co_firstlineno}"


@functools.lru_cache(maxsize=4096)
def _relative(path: str, roots: tuple[str, ...] | None) -> str:
    for root in _import_roots() if roots is None else roots:  # absolute, no trailing /
        if path.startswith(root + "/"):
            return path[len(root) + 1 :]
    # not under an import root (an editable install's finder): above its package folders
    parts = path.split("/")
    top = len(parts) - 1
    while top > 1 and os.path.exists("/".join(parts[:top] + ["__init__.py"])):
        top -= 1
    return "/".join(parts[top:]) if top < len(parts) - 1 else "/".join(parts[-2:])


class HostProfile:
    """Stack samples of one thread, filed by loop phase and by the iteration's batch."""

    def __init__(self, hz: float, frames=sys._current_frames):
        self.hz = hz
        self.phase = "other"  # set by the host-timing hooks on the profiled thread
        self.thread_id: int | None = None
        self._frames = frames
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, tuple[CodeType, ...]], int] = {}
        self._stacks: dict[str, dict[tuple[str, tuple[CodeType, ...]], int]] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # -- the sampler ---------------------------------------------------------------
    def start(self, thread_id: int) -> None:
        """Sample `thread_id` from a daemon thread from now on (once; later calls keep
        the first thread)."""
        if self._thread is not None:
            return
        self.thread_id = thread_id
        # A waking sampler waits for the GIL until the busy thread drops it, at the latest
        # after the switch interval (5 ms by default): shortened so that samples come at
        # the rate asked for, not at ~200 a second.
        sys.setswitchinterval(min(sys.getswitchinterval(), 0.25 / self.hz))
        self._thread = threading.Thread(target=self._run, name="psa-host-profile", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        interval = 1.0 / self.hz
        while not self._stop.wait(interval):
            self.sample()

    def sample(self) -> None:
        """Count the profiled thread's stack once, under the phase it is in."""
        frame = self._frames().get(self.thread_id)
        codes = []
        while frame is not None and len(codes) < MAX_DEPTH:
            codes.append(frame.f_code)
            frame = frame.f_back
        if not codes:
            return
        key = (self.phase, tuple(codes))
        with self._lock:
            self._pending[key] = self._pending.get(key, 0) + 1

    # -- the loop's side -----------------------------------------------------------
    def end_iteration(self, batch_key: str) -> None:
        """The iteration that launched `batch_key` ended: its samples are that batch's
        (decode batches per size; extend batches, few and of every size, all under
        `"extend"`; idle iterations are not kept)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if batch_key.startswith("extend/"):
            batch_key = "extend"
        elif not batch_key.startswith("decode/"):
            return
        if not pending:
            return
        stacks = self._stacks.setdefault(batch_key, {})
        for key, n in pending.items():
            stacks[key] = stacks.get(key, 0) + n

    def snapshot(self) -> dict[str, dict]:
        out = {}
        for batch_key, stacks in sorted(self._stacks.items()):
            phases: dict[str, int] = {}
            functions: dict[str, list[int]] = {}
            for (phase, codes), n in stacks.items():
                phases[phase] = phases.get(phase, 0) + n
                for code in set(codes):
                    functions.setdefault(f"{phase}|{function_name(code)}", [0, 0])[0] += n
                functions.setdefault(f"{phase}|{function_name(codes[0])}", [0, 0])[1] += n
            out[batch_key] = {
                "hz": self.hz,
                "samples": sum(phases.values()),
                "phases": phases,
                "functions": functions,
            }
        return out


def make() -> HostProfile | None:
    hz = rate_hz()
    return HostProfile(hz) if hz else None


PROFILE = make()
