"""PSA's Prometheus gauges: created in a scheduler-like process under SGLang's multiprocess
mode, refreshed between decode steps, visible to the collector `/metrics` uses."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")

SCRIPT = textwrap.dedent(
    """
    from types import SimpleNamespace
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess
    from sglang_psa.config import PSAConfig
    from sglang_psa.sched.metrics import GAUGES, PSAMetrics
    from sglang_psa.sched.serving import BackendReadouts, PSAServing

    s = PSAServing(
        PSAConfig(ws_window=2), layers=2, kv_heads=2, hbm_units=100, host_tokens=4096,
        readouts=BackendReadouts(measure=lambda: ([0], [0]), read_counts=lambda: (30, 120)),
        metrics=PSAMetrics(tp_rank=1, interval_s=3600),
    )
    assert s.try_admit("a", 64, alone=True)
    s.waits["working_set"], s.waits["kv_pages"] = 3, 2
    s.flush_step([])  # the first refresh is due at once
    s.waits["host_tier"] = 4
    s.flush_step([])  # not due again within the interval: the gauge keeps 5
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg)
    text = generate_latest(reg).decode()
    for name in GAUGES:
        assert "sglang_psa:" + name in text, name
    want = {
        "blocks_read_fraction": 0.25, "running_requests": 1.0, "capacity_units": 100.0,
        "admitted_total": 1.0, "admission_deferrals_total": 5.0,
        "admission_waits_working_set_total": 3.0, "admission_waits_kv_pages_total": 2.0,
        "admission_waits_host_tier_total": 0.0,
    }
    for line in text.splitlines():
        for name, value in want.items():
            if line.startswith("sglang_psa:" + name + "{"):
                assert 'tp_rank="1"' in line and float(line.split()[-1]) == value, line
                want[name] = None
    assert all(v is None for v in want.values()), want
    print("ok")
    """
)


def test_gauges_reach_the_multiprocess_collector(tmp_path):
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
