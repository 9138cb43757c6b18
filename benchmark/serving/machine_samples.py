"""What the machine did while a timed run ran, to tell a slow phase of the GPU from one of
the host: the GPU's SM clock, power and use (`nvidia-smi -lms`), and the CPU share of every
busy thread on the machine (`/proc`), both every `PERIOD_S`.

Contract: `MachineSamples(session)` is a context manager; inside it a reader thread
follows `nvidia-smi` (none where the machine has no `nvidia-smi`) and another reads
`/proc/<pid>/task/<tid>/stat` of every process (the client and the stage compete with
the server for the same cores). `result()` after the block: `{"period_s", "gpu": {"t",
"sm_mhz", "mem_mhz", "power_w", "util_pct", "temp_c"} | None, "threads":
{"<pid>/<tid> <process>/<thread>": {"t", "pct", "cpu"}}, "server_pids": [...],
"cpu_core": {"<cpu>": "<package>/<core>"}}`: times in
`time.time()` seconds (the decode log's clock), only threads that used at least
`BUSY_PCT` of a core in some interval; `server_pids` the processes whose session id is
`session` (the server's: `Server` starts it in a session of its own); `cpu` the CPU a
thread last ran on at each sample and `cpu_core` each CPU's physical core (SMT siblings
share one: two busy threads on one core slow each other down). With `log_path`
(the server's log) the result also has `"log": {"t", "bytes"}`, the log's size at each
sample, which times the decode log's lines (SGLang stamps them to the second only; a
line was printed before the first sample that saw its bytes). Sampling costs the host a
few percent of one core; the timed window pays it on every system alike.
"""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

PERIOD_S = 0.1
BUSY_PCT = 5.0
GPU_FIELDS = ("sm_mhz", "mem_mhz", "power_w", "util_pct", "temp_c")
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu"
PROC = Path("/proc")
SYS_CPU = Path("/sys/devices/system/cpu")


def parse_smi_line(line: str) -> tuple[float, list[float | None]] | None:
    """One `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits` line: its time
    (`time.time()` seconds; nvidia-smi prints local time) and the fields of `GPU_FIELDS`
    (None where it prints `[N/A]` or the like); None for a line that is no sample."""
    cells = [c.strip() for c in line.split(",")]
    if len(cells) != 1 + len(GPU_FIELDS):
        return None
    try:
        t = datetime.datetime.strptime(cells[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None
    values = []
    for c in cells[1:]:
        try:
            values.append(float(c))
        except ValueError:
            values.append(None)
    return t, values


def cpu_info(cpuinfo: Path = PROC / "cpuinfo", root: Path = SYS_CPU) -> dict:
    """The host CPU a stage ran on, to compare runs on different machines: its model name,
    CPUs this process may use, physical cores among them (`cpu_cores`), and
    `python_loop_ms`, the best of 5 runs of a fixed pure-Python loop (the scheduler's
    host loop is Python: a slower core, or one shared with a busy sibling, shows here)."""
    model = None
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    allowed = os.sched_getaffinity(0)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc += i & 7
        best = min(best, time.perf_counter() - t0)
    return {
        "model": model,
        "cpus": len(allowed),
        "cores": len(physical_cores(cpu_cores(root), allowed)),
        "python_loop_ms": round(best * 1e3, 3),
    }


def cpu_cores(root: Path = SYS_CPU) -> dict[int, str]:
    """Each online CPU's physical core, `<package>/<core>` (SMT siblings share one); {}
    where the topology is not readable."""
    out = {}
    for d in root.glob("cpu[0-9]*"):
        try:
            top = d / "topology"
            pkg = (top / "physical_package_id").read_text().strip()
            out[int(d.name[3:])] = f"{pkg}/{(top / 'core_id').read_text().strip()}"
        except (OSError, ValueError):
            continue
    return out


def physical_cores(cores: dict[int, str], cpus: set[int]) -> list[list[int]]:
    """`cpus` grouped by physical core (`cores`: CPU -> core, from `cpu_cores`; a CPU it
    does not name is a core of its own), each group sorted, the groups by their first CPU."""
    by_core: dict[str, list[int]] = {}
    for cpu in sorted(cpus):
        by_core.setdefault(cores.get(cpu, f"cpu{cpu}"), []).append(cpu)
    return sorted(by_core.values())


def split_cpus(client_cores: int, cores: dict[int, str], allowed: set[int]) -> dict | None:
    """The CPUs of the last `client_cores` physical cores (`physical_cores`) among
    `allowed` for the client and the stage (load generator, sampler), the others for the
    server, so that neither slows the other's threads down (a client is on another
    machine in production); None when fewer than `client_cores + 4` cores are allowed, or
    `client_cores` is 0."""
    groups = physical_cores(cores, allowed)
    if client_cores <= 0 or len(groups) < client_cores + 4:
        return None
    client = sorted(c for g in groups[-client_cores:] for c in g)
    return {"server": sorted(set(allowed) - set(client)), "client": client}


def _processes(proc: Path = PROC):
    """(pid, name, the stat fields after the name, folder) of every process whose stat
    reads now; one that ends meanwhile is left out."""
    for p in proc.iterdir():
        if not p.name.isdigit():
            continue
        try:
            name, rest = _split_stat((p / "stat").read_text())
        except (OSError, ValueError):
            continue
        yield int(p.name), name, rest, p


def thread_times(
    session: int | None, proc: Path = PROC
) -> tuple[dict[str, tuple[float, int]], set[int]]:
    """CPU seconds so far and the CPU it last ran on of every thread of every process,
    keyed `<pid>/<tid> <process>/<thread>`, and the pids whose session id is `session`.
    Processes and threads that end while read are left out."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, int]] = {}
    mine: set[int] = set()
    for pid, pname, rest, p in _processes(proc):
        try:
            if session is not None and int(rest[3]) == session:  # field 6: the session id
                mine.add(pid)
            for t in (p / "task").iterdir():
                tname, trest = _split_stat((t / "stat").read_text())
                cpu = (int(trest[11]) + int(trest[12])) / tick  # utime + stime
                # field 39: the CPU it last ran on
                out[f"{pid}/{t.name} {pname}/{tname}"] = (cpu, int(trest[36]))
        except (OSError, ValueError, IndexError):
            continue
    return out, mine


def _split_stat(text: str) -> tuple[str, list[str]]:
    """`/proc/.../stat`: the command name (it may hold spaces and parentheses) and the
    fields after it, from field 3 (the state) on."""
    name = text[text.index("(") + 1 : text.rindex(")")]
    return name, text[text.rindex(")") + 2 :].split()


class MachineSamples:
    def __init__(
        self,
        session: int | None,
        period_s: float = PERIOD_S,
        proc: Path = PROC,
        log_path: Path | None = None,
        cores: dict[int, str] | None = None,
    ):
        self.session, self.period_s, self.proc, self.log_path = session, period_s, proc, log_path
        self.cores = cores  # CPU -> physical core; default: the OS's topology (`cpu_cores`)
        self._log: tuple[list[float], list[int]] = ([], [])
        self._stop = threading.Event()
        self._gpu: list[tuple[float, list[float | None]]] = []
        self._threads: dict[str, tuple[list[float], list[float], list[int]]] = {}
        self._server: set[int] = set()
        self._smi: subprocess.Popen | None = None
        self._workers: list[threading.Thread] = []

    def __enter__(self) -> MachineSamples:
        smi = shutil.which("nvidia-smi")
        if smi:
            cmd = [smi, f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                   f"-lms={max(1, round(self.period_s * 1000))}", "--id=0"]  # fmt: skip
            self._smi = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            self._workers.append(threading.Thread(target=self._read_smi, daemon=True))
        if self.proc.is_dir():
            self._workers.append(threading.Thread(target=self._read_proc, daemon=True))
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._smi is not None:
            self._smi.terminate()
            try:
                self._smi.wait(5)
            except subprocess.TimeoutExpired:
                self._smi.kill()
        for w in self._workers:
            w.join(5)

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            if (s := parse_smi_line(line)) is not None:
                self._gpu.append(s)

    def _log_size(self, now: float) -> None:
        if self.log_path is None:
            return
        try:
            size = self.log_path.stat().st_size
        except OSError:
            return
        self._log[0].append(round(now, 3))
        self._log[1].append(size)

    def _read_proc(self) -> None:
        last_t, (last, mine) = time.time(), thread_times(self.session, self.proc)
        self._log_size(last_t)
        self._server |= mine
        while not self._stop.wait(self.period_s):
            now, (cur, mine) = time.time(), thread_times(self.session, self.proc)
            self._log_size(now)
            self._server |= mine
            dt = now - last_t
            for key, (cpu, on) in cur.items():
                if key in last and dt > 0:
                    ts, pct, cpus = self._threads.setdefault(key, ([], [], []))
                    ts.append(round(now, 3))
                    pct.append(round(100.0 * (cpu - last[key][0]) / dt, 1))
                    cpus.append(on)
            last_t, last = now, cur

    def result(self) -> dict:
        gpu = None
        if self._gpu:
            gpu = {"t": [round(t, 3) for t, _ in self._gpu]}
            for i, name in enumerate(GPU_FIELDS):
                gpu[name] = [v[i] for _, v in self._gpu]
        threads = {
            k: {"t": ts, "pct": pct, "cpu": cpus}
            for k, (ts, pct, cpus) in self._threads.items()
            if pct and max(pct) >= BUSY_PCT
        }
        out = {
            "period_s": self.period_s,
            "gpu": gpu,
            "threads": threads,
            "server_pids": sorted(self._server),
            "cpu_core": {str(c): core for c, core in sorted((self.cores or cpu_cores()).items())},
        }
        if self.log_path is not None:
            out["log"] = {"t": self._log[0], "bytes": self._log[1]}
        return out
