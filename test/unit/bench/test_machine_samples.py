"""`benchmark/serving/machine_samples.py`: nvidia-smi's lines parsed, and a busy thread
of a process session seen busy (and an idle one not) through the real /proc."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmark" / "serving"))

import machine_samples as ms  # noqa: E402


def test_an_nvidia_smi_line_parses_to_its_time_and_fields():
    t, values = ms.parse_smi_line("2026/11/29 14:50:12.345, 1980, 3201, 512.33, 97, 61\n")
    want = datetime.datetime(2026, 11, 29, 14, 50, 12, 345000).timestamp()
    assert t == pytest.approx(want)
    assert values == [1980.0, 3201.0, 512.33, 97.0, 61.0]
    _, values = ms.parse_smi_line("2026/11/29 14:50:12.345, 1980, 3201, [N/A], 97, 61")
    assert values[2] is None and values[0] == 1980.0
    assert ms.parse_smi_line("timestamp, clocks.current.sm [MHz]") is None
    assert ms.parse_smi_line("Failed to initialize NVML: no device, a, b, c, d, e") is None


def test_stat_lines_split_after_a_name_with_spaces_and_parentheses():
    name, rest = ms._split_stat("4242 (sglang::sch (x)) S 1 4242 4242 0 -1 0 0 0 0 0 7 3 0")
    assert name == "sglang::sch (x)"
    assert rest[0] == "S" and rest[3] == "4242" and (rest[11], rest[12]) == ("7", "3")


BUSY = """
import threading, time
def spin():
    end = time.time() + 30
    while time.time() < end:
        pass
threading.Thread(target=spin, name="spinner", daemon=True).start()
time.sleep(30)
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_spinning_thread_of_the_session_is_sampled_busy_and_others_are_not():
    # A child in a session of its own, as `Server` starts SGLang: one thread spins, the
    # main thread sleeps; a process outside the session (this one) is never read.
    proc = subprocess.Popen([sys.executable, "-c", BUSY], start_new_session=True)
    try:
        time.sleep(1.0)  # the interpreter up, the spinner started
        with ms.MachineSamples(proc.pid, period_s=0.1) as s:
            time.sleep(1.2)
        out = s.result()
    finally:
        proc.kill()
        proc.wait()
    assert out["period_s"] == 0.1
    threads = out["threads"]
    assert threads, "no thread of the session was seen busy"
    assert proc.pid in out["server_pids"] and os.getpid() not in out["server_pids"]
    mine = {k: v for k, v in threads.items() if k.startswith(f"{proc.pid}/")}
    assert mine, threads.keys()
    busiest = max(mine.values(), key=lambda v: sorted(v["pct"])[len(v["pct"]) // 2])
    pct = sorted(busiest["pct"])
    assert pct[len(pct) // 2] > 30.0, pct  # a spinning thread: a good share of a core
    assert len(busiest["t"]) == len(busiest["pct"]) >= 5
    assert all(b > a for a, b in zip(busiest["t"], busiest["t"][1:]))
    # the sleeping main thread never reached BUSY_PCT, so it is left out
    assert len(mine) == 1, mine.keys()
    # each sample names a CPU the thread may run on, and the topology (where readable)
    # names every such CPU's core
    assert len(busiest["cpu"]) == len(busiest["t"])
    assert set(busiest["cpu"]) <= os.sched_getaffinity(0)
    if ms.cpu_cores():
        assert set(out["cpu_core"]) >= {str(c) for c in os.sched_getaffinity(0)}


def test_without_a_session_or_nvidia_smi_no_gpu_and_no_server_process(monkeypatch):
    monkeypatch.setattr(ms.shutil, "which", lambda name: None)
    with ms.MachineSamples(None, period_s=0.05) as s:
        time.sleep(0.1)
    out = s.result()
    assert out["gpu"] is None and out["server_pids"] == []


def test_the_summary_reads_the_samples_inside_the_steady_decode_window():
    import analysis

    def at(sec):
        return datetime.datetime(2026, 11, 29, 14, 50, sec).timestamp()

    lines = [  # 16 running at :10 (not the batch), 32 running at :11 and :12
        {"time": f"2026-11-29 14:50:{sec}", "running": r, "gen_tok_s": 1.0}
        for sec, r in ((10, 16), (11, 32), (12, 32))
    ]
    ts = [at(10) + 0.5, at(11) + 0.2, at(11) + 0.7, at(12) + 0.5, at(13) + 0.5]
    samples = {
        "period_s": 0.1,
        "gpu": {
            "t": ts,
            "sm_mhz": [1000, 1980, 1500, 1700, 900],
            "mem_mhz": [3201] * 5,
            "power_w": [100, 400, 300, 500, 50],
            "util_pct": [10, 100, 90, 95, None],
            "temp_c": [60] * 5,
        },  # fmt: skip
        "threads": {
            "11/11 sglang::scheduler/python": {"t": ts, "pct": [0, 99, 97, 98, 0]},
            "12/12 sglang::detoken/python": {"t": ts, "pct": [90, 10, 20, 30, 90]},
            "40/41 python3/client": {"t": ts, "pct": [0, 50, 60, 70, 0]},
        },
        "server_pids": [11, 12],
    }
    m = analysis.machine_summary(samples, lines, 32)
    assert m["window_s"] == pytest.approx(2.0)  # :11 to the end of :12
    assert m["sm_mhz"] == 1700 and m["sm_mhz_p10"] == pytest.approx(1540)
    assert (m["power_w"], m["util_pct"]) == (400, 95)
    assert m["busiest_thread"] == "11/11 sglang::scheduler/python"
    assert m["busiest_thread_pct"] == 98 and m["busiest_thread_pct_p90"] == pytest.approx(98.8)
    assert m["busiest_other_thread"] == "40/41 python3/client"
    assert m["busiest_other_thread_pct"] == 60
    assert analysis.machine_summary(None, lines, 32) is None
    assert analysis.machine_summary(samples, [], 32) is None
    no_gpu = analysis.machine_summary(samples | {"gpu": None}, lines, 64)  # never 64: all
    assert "sm_mhz" not in no_gpu and no_gpu["window_s"] == pytest.approx(3.0)


def test_decode_lines_are_timed_by_the_log_sizes_and_split_into_phases(tmp_path):
    """Lines carry the byte where they end (non-ASCII text before them counts in bytes);
    the first sample whose log size reached it times a line; the window runs from the
    first timed line at full batch to the last; slow and fast intervals each get the SM
    clock and the scheduler thread's share sampled nearest to them."""
    import analysis

    def line(sec, running, gen):
        return (
            f"[2026-11-29 14:50:{sec:02d}] Decode batch, #running-req: {running}, #token: 1, "
            f"token usage: 0.10, cuda graph: True, gen throughput (token/s): {gen:.2f}, "
            f"#queue-req: 0\n"
        )

    head = "[2026-11-29 14:50:00] warmup done — ü\n"  # 3 bytes more than characters
    gens = [1000.0] + [32000 / 2.0] * 3 + [32000 / 3.0] * 3 + [32000 / 2.0] * 2  # ms: 2, 3
    body = "".join(line(10, 32, g) for g in gens)
    text = head + body
    lines = analysis.parse_decode_lines(text, base=100)
    ends, pos = [], 100 + len(head.encode())
    for ln_ in body.splitlines(True):
        pos += len(ln_.encode())
        ends.append(pos - 1)  # the match ends before the newline
    assert [ln["at"] for ln in lines] == ends
    assert "at" not in analysis.parse_decode_lines(text)[0]

    def at(k):  # line k printed at 1000.0 + 0.05 k s, seen by the next 0.1 s sample
        return 1000.0 + 0.05 * k

    ts = [1000.0 + 0.1 * i for i in range(8)]
    sizes = [max([100] + [ends[k] for k in range(len(ends)) if at(k) <= t]) for t in ts]
    clock = [1980, 1980, 1980, 1500, 1500, 1980, 1980, 1980]  # slow lines 4-6: seen at .2-.3 s
    sched = [100.0, 50.0, 50.0, 99.0, 99.0, 50.0, 50.0, 50.0]
    samples = {
        "period_s": 0.1,
        "gpu": {
            "t": ts,
            "sm_mhz": clock,
            "power_w": [400] * 8,
            "util_pct": [99] * 8,
            "mem_mhz": [3201] * 8,
            "temp_c": [60] * 8,
        },  # fmt: skip
        "threads": {"11/11 sched/python": {"t": ts, "pct": sched}},
        "server_pids": [11],
        "log": {"t": ts, "bytes": sizes},
    }
    seen = analysis.line_times(samples, lines)
    assert seen == [pytest.approx(1000.0 + 0.1 * -(-k // 2)) for k in range(len(lines))]
    m = analysis.machine_summary(samples, lines, 32)
    assert m["window_s"] == pytest.approx(seen[-1] + 1e-3 - (seen[0] - 0.1))
    ph = m["phases"]
    assert ph["fast_mode_step_ms"] == pytest.approx(2.0)
    assert (ph["slow"]["intervals"], ph["fast"]["intervals"]) == (3, 5)
    assert ph["slow"]["step_ms"] == pytest.approx(3.0) and ph["fast"]["step_ms"] == pytest.approx(
        2.0
    )
    assert ph["slow"]["sm_mhz"] == 1500 and ph["fast"]["sm_mhz"] == 1980
    assert ph["slow"]["busiest_thread_pct"] == 99.0 and ph["fast"]["busiest_thread_pct"] == 50.0


def test_the_sampler_records_the_logs_size_as_it_grows(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("start\n")
    with ms.MachineSamples(None, period_s=0.05, log_path=log) as s:
        time.sleep(0.2)
        with log.open("a") as f:
            f.write("x" * 100)
        time.sleep(0.2)
    sizes = s.result()["log"]["bytes"]
    assert sizes[0] == 6 and sizes[-1] == 106 and sizes == sorted(sizes)
    assert "log" not in ms.MachineSamples(None).result()


def test_cpu_cores_reads_each_cpus_package_and_core(tmp_path):
    for cpu, (pkg, core) in {0: (0, 0), 1: (0, 1), 2: (0, 0), 3: (0, 1), 4: (1, 0)}.items():
        top = tmp_path / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text(f"{pkg}\n")
        (top / "core_id").write_text(f"{core}\n")
    (tmp_path / "cpufreq").mkdir()  # not a CPU
    (tmp_path / "cpu5").mkdir()  # offline: no topology
    assert ms.cpu_cores(tmp_path) == {0: "0/0", 1: "0/1", 2: "0/0", 3: "0/1", 4: "1/0"}


def test_core_sharing_counts_busy_threads_on_the_same_physical_core():
    import analysis

    ts = [1.0, 1.1, 1.2, 1.3]
    samples = {
        "cpu_core": {"0": "0/0", "1": "0/1", "8": "0/0", "9": "0/1"},  # 8 is 0's sibling
        "threads": {
            "11/11 sglang::scheduler/python": {"t": ts, "pct": [99] * 4, "cpu": [0, 0, 1, 0]},
            # on 0's sibling at 1.0 and 1.3, busy only at 1.0; on 1's at 1.2, busy
            "40/41 python3/client": {"t": ts, "pct": [90, 80, 70, 20], "cpu": [8, 9, 9, 8]},
            "12/12 sglang::detoken/python": {"t": ts, "pct": [30] * 4, "cpu": [0, 0, 1, 0]},
        },
    }
    got = analysis.core_sharing(samples, "11/11 sglang::scheduler/python")
    assert got["shared"] == [100.0, 0.0, 100.0, 0.0]
    assert got["with"] == "40/41 python3/client"
    assert analysis.core_sharing({"threads": samples["threads"]}, "11/11 x") is None


def test_cpu_info_names_the_model_its_cores_and_a_python_loop_time(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: X\nmodel name\t: Some CPU 9000 @ 3GHz\n")
    allowed = sorted(os.sched_getaffinity(0))
    root = tmp_path / "sys"
    for cpu in allowed:  # every CPU on one core: SMT siblings all
        top = root / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text("0\n")
        (top / "core_id").write_text("0\n")
    got = ms.cpu_info(info, root)
    assert got["model"] == "Some CPU 9000 @ 3GHz"
    assert (got["cpus"], got["cores"]) == (len(allowed), 1)
    assert 0 < got["python_loop_ms"] < 10_000
    assert ms.cpu_info(tmp_path / "none", tmp_path / "nosys")["model"] is None
