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
import select
import shutil
import subprocess
import sys
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


# One pinned spinner per CPU for `sibling_probe`: on "go MS" it spins a pure-Python loop
# for MS milliseconds and answers how many iterations it ran.
SPINNER = r"""
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
print("ready", flush=True)
for line in sys.stdin:
    end = time.perf_counter() + float(line.split()[1]) / 1e3
    n = 0
    while time.perf_counter() < end:
        n += 1
    print(n, flush=True)
"""
SIBLING_SPIN_MS = 30.0
SIBLING_RATIO = 0.8  # both spinners of a pair below this share of their solo rate


class _Spinners:
    """A spinner process pinned to each CPU; `run(cpus)` spins the named ones at once and
    returns each one's iteration count."""

    def __init__(self, cpus: list[int], spin_ms: float, timeout_s: float = 10.0, code=None):
        """`code`: the spinners' program (default `SPINNER`; tests)."""
        self.spin_ms, self.timeout_s = spin_ms, timeout_s
        self.procs = {
            c: subprocess.Popen(
                [sys.executable, "-c", code or SPINNER, str(c)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for c in cpus
        }
        for c in cpus:
            if self._line(c) != "ready":
                raise RuntimeError(f"sibling probe: the spinner of CPU {c} did not start")

    def _line(self, cpu: int) -> str:
        """The spinner's next line, or RuntimeError after `timeout_s` (a hung spinner
        must not hang the stage)."""
        out = self.procs[cpu].stdout
        if not select.select([out], [], [], self.timeout_s)[0]:
            raise RuntimeError(f"sibling probe: the spinner of CPU {cpu} did not answer")
        return out.readline().strip()

    def run(self, cpus: tuple[int, ...]) -> dict[int, int]:
        for c in cpus:
            self.procs[c].stdin.write(f"go {self.spin_ms}\n")
            self.procs[c].stdin.flush()
        return {c: int(self._line(c)) for c in cpus}

    def close(self) -> None:
        for proc in self.procs.values():
            proc.stdin.close()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def sibling_probe(cpus: set[int], spin_ms: float = SIBLING_SPIN_MS, measure=None) -> dict:
    """CPUs that share a physical core the OS does not show: a VM's vCPUs may sit on SMT
    threads of one host core while its topology reports a core for each, and two busy
    threads there slow each other down (the scheduler's Python loop beside a client or
    tokenizer thread). A pinned pure-Python spin runs on each CPU alone, then on every pair
    at once; a pair whose two spins both ran below `SIBLING_RATIO` of their solo rate,
    measured twice, shares a core. `measure(cpus) -> {cpu: iterations}` replaces the
    spinners (tests). Returns `{"pairs": [[a, b, slower ratio], ...], "solo": {cpu:
    iterations}, "spin_ms", "seconds"}`; ~5 s on 16 CPUs."""
    t0 = time.perf_counter()
    order = sorted(cpus)
    spinners = None
    if measure is None:
        spinners = _Spinners(order, spin_ms)
        measure = spinners.run
    try:
        for c in order:  # a first spin warms each one up (its first ran ~25% slower)
            measure((c,))
        solo = {c: measure((c,))[c] for c in order}

        def ratio(a: int, b: int) -> float:
            got = measure((a, b))
            return max(got[a] / max(solo[a], 1), got[b] / max(solo[b], 1))

        pairs = []
        for i, a in enumerate(order):
            for b in order[i + 1 :]:
                r = ratio(a, b)
                if r < SIBLING_RATIO and (r := max(r, ratio(a, b))) < SIBLING_RATIO:
                    pairs.append([a, b, round(r, 3)])
    finally:
        if spinners is not None:
            spinners.close()
    return {"pairs": pairs, "solo": {str(c): n for c, n in solo.items()}, "spin_ms": spin_ms,
            "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip


def merge_siblings(cores: dict[int, str], pairs: list[list]) -> dict[int, str]:
    """`cores` (CPU -> physical core, `cpu_cores`) with the CPUs of each probed sibling
    pair (`sibling_probe`), and whatever they share a core with, on one core: the core of
    the group's first CPU (a CPU the topology does not name is core `cpu<N>`)."""
    label = dict(cores)
    for a, b, *_ in pairs:
        la, lb = label.setdefault(a, f"cpu{a}"), label.setdefault(b, f"cpu{b}")
        first = {x: min(c for c, y in label.items() if y == x) for x in (la, lb)}
        keep, drop = sorted((la, lb), key=first.get)
        label = {c: keep if x == drop else x for c, x in label.items()}
    return label


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


SCHEDULER_THREAD = "sglang::schedul"  # SGLang's scheduler process names itself so (comm: 15 chars)


def pin_scheduler(
    session: int, cores: dict[int, str], cpus: list[int], proc: Path = PROC
) -> dict | None:
    """A physical core of its own for each scheduler loop of the server in `session`: the
    main thread of every process whose name starts with `SCHEDULER_THREAD` is pinned to
    the CPUs of one physical core among `cpus` (`cores`: CPU -> core, probed siblings
    joined), and every other thread of the session's processes to the rest of `cpus`, so
    that no tokenizer, detokenizer or helper thread runs on the loop's core or its SMT
    sibling. Threads a pinned thread starts later inherit its CPUs. Returns `{"scheduler":
    {pid: [cpus]}, "others": [cpus], "threads": n}`, or None (nothing changed) where no
    scheduler process is found or `cpus` hold fewer physical cores than schedulers + 1."""
    groups = physical_cores(cores, set(cpus))
    procs: dict[int, tuple[str, list[int]]] = {}
    for pid, name, rest, p in _processes(proc):
        try:
            if int(rest[3]) == session:  # field 6: the session id
                procs[pid] = (name, [int(t.name) for t in (p / "task").iterdir()])
        except (OSError, ValueError, IndexError):
            continue
    loops = sorted(pid for pid, (name, _) in procs.items() if name.startswith(SCHEDULER_THREAD))
    if not loops or len(groups) < len(loops) + 1:
        return None
    own = {pid: groups[i] for i, pid in enumerate(loops)}
    rest = sorted(set(cpus) - {c for g in own.values() for c in g})
    n = 0
    for pid, (_, tids) in procs.items():
        for tid in tids:
            try:
                os.sched_setaffinity(tid, own[pid] if tid in own else rest)
                n += 1
            except (ProcessLookupError, PermissionError):
                continue  # a thread that ended meanwhile
    return {"scheduler": {str(p): g for p, g in own.items()}, "others": rest, "threads": n}


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
