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
