"""The serving benchmark (benchmark/serving) on CPU: log parsing, scoring, merging with
provenance, dataset building, server flags, and the whole stage against a fake server
driven by SGLang's real `bench_serving` client."""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "benchmark" / "serving"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import analysis  # noqa: E402
import client_ids  # noqa: E402
import driver  # noqa: E402
import fake_sglang  # noqa: E402
import machine_samples  # noqa: E402
import systems  # noqa: E402
import workloads  # noqa: E402

_spec = importlib.util.spec_from_file_location("serving_run", REPO / "benchmark/serving/run.py")
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)

SMOKE_C = workloads.smoke(workloads.WORKLOADS["c"])
SMOKE_A = workloads.smoke(workloads.WORKLOADS["a"])
SMOKE_A16 = workloads.smoke(workloads.WORKLOADS["a16"])


def decode(t, running, gen, graph=True, tp=""):
    return (
        f"[2026-11-25 07:00:{t:02d}{tp}] Decode batch, #running-req: {running}, #token: "
        f"{running * 28000}, token usage: 0.21, cuda graph: {graph}, gen throughput "
        f"(token/s): {gen:.2f}, #queue-req: 0"
    )


# --- 1. log parsing -------------------------------------------------------------------


def test_decode_lines_are_parsed_and_other_lines_ignored():
    text = "\n".join(
        [
            "[2026-11-25 07:00:00] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token:"
            " 0, #token: 8192, token usage: 0.01, #running-req: 0, #queue-req: 3, "
            "#pending-token: 0, cuda graph: False, input throughput (token/s): 12345.67",
            "[2026-11-25 07:00:01] Decode batch, #running-req: 32, #token: 912345, token usage:"
            " 0.21, cuda graph: True, gen throughput (token/s): 5120.50, #queue-req: 0",
            "INFO:     127.0.0.1:51234 - POST /generate HTTP/1.1 200 OK",
            "[2026-11-25 07:00:02 TP0] Decode batch, #running-req: 4, #token: 1000, token usage:"
            " 0.02, cuda graph: False, gen throughput (token/s): 300.00, #queue-req: 7",
        ]
    )
    keys = ("time", "running", "tokens", "usage", "graph", "gen_tok_s", "queue")
    assert [tuple(ln[k] for k in keys) for ln in analysis.parse_decode_lines(text)] == [
        ("2026-11-25 07:00:01", 32, 912345, 0.21, True, 5120.5, 0),
        ("2026-11-25 07:00:02", 4, 1000, 0.02, False, 300.0, 7),
    ]
    assert set(analysis.parse_decode_lines(text)[0]) == set(keys)


def prefill(t, tokens, tok_s, queue=0, tp=""):
    return (
        f"[2026-11-25 07:00:{t:02d}{tp}] Prefill batch, #new-seq: 1, #new-token: {tokens}, "
        f"#cached-token: 64, token usage: 0.01, #running-req: 2, #queue-req: {queue}, "
        f"#pending-token: 0, cuda graph: False, input throughput (token/s): {tok_s:.2f}"
    )


def test_prefill_lines_give_the_servers_own_prefill_rate():
    """Prefill lines are parsed (decode lines are not); the rate is the new tokens over
    the intervals between prefill batches, the first batch's interval left out."""
    text = "\n".join(
        [
            prefill(0, 8192, 100.0, queue=3),  # its interval reaches back before the run
            decode(1, 1, 50.0),
            prefill(2, 8192, 8192 / 0.02, tp=" TP0"),  # 20 ms
            prefill(3, 4096, 4096 / 0.03),  # 30 ms
        ]
    )
    lines = analysis.parse_prefill_lines(text)
    assert [(ln["time"][-2:], ln["tokens"], ln["cached"], ln["running"], ln["queue"])
            for ln in lines] == [("00", 8192, 64, 2, 3), ("02", 8192, 64, 2, 0),
                                 ("03", 4096, 64, 2, 0)]  # fmt: skip
    rate = analysis.prefill_rate(lines)
    assert rate["batches"] == 3 and rate["tokens"] == 8192 * 2 + 4096
    assert rate["tok_s"] == pytest.approx((8192 + 4096) / 0.05)
    assert analysis.prefill_rate(lines[:1])["tok_s"] is None  # one batch: no interval
    assert analysis.parse_prefill_lines(decode(0, 4, 10.0)) == []


def test_a_run_sent_at_once_splits_into_intake_and_decode_phases():
    """Until the last request's first token, and from then to the last answer."""
    rows = [{"ttft_s": t, "error": None} for t in (0.4, 1.5, 0.9)]
    assert analysis.phases({"duration": 2.5}, rows) == {
        "intake_s": 1.5,
        "after_intake_s": pytest.approx(1.0),
    }
    assert analysis.phases({"duration": 2.5}, []) is None


def test_steady_step_is_the_median_at_the_batch_without_the_first_interval():
    # at 32 running: steps 50 (first, dropped), 10, 12, 11 ms; at 16: 1 ms (other batch)
    lines = analysis.parse_decode_lines(
        "\n".join(
            [decode(0, 16, 16000)]
            + [decode(i + 1, 32, 32000 / ms) for i, ms in enumerate([50, 10, 12, 11])]
            + [decode(9, 32, 0.0)]  # an idle interval does not count
        )
    )
    s = analysis.steady_step(lines, 32)
    assert s["step_ms"] == pytest.approx(11.0)
    assert (s["step_ms_p10"], s["step_ms_p90"]) == (pytest.approx(10.2), pytest.approx(11.8))
    assert (s["batch"], s["intervals"], s["graph"]) == (32, 3, True)
    assert analysis.steady_step(lines, None)["step_ms"] == pytest.approx(11.0)  # the max
    assert analysis.steady_step(lines, 64)["batch"] == 32  # never ran 64: the most it ran
    one = analysis.steady_step(lines, 16)  # a single interval is kept
    assert (one["step_ms"], one["intervals"]) == (pytest.approx(1.0), 1)
    mixed = analysis.parse_decode_lines("\n".join([decode(0, 8, 800), decode(1, 8, 800, False)]))
    assert analysis.steady_step(mixed, 8)["graph"] is False
    empty = analysis.steady_step([], 8)
    assert (empty["step_ms"], empty["batch"], empty["intervals"]) == (None, None, 0)


def test_a_peak_batch_seen_once_is_not_the_steady_state():
    """A server that never ran the whole workload at once: one interval at 18 (a prefill
    landing as others finish, 231 ms) is no steady state; the step is the largest batch
    held for several busy intervals (17, at 4 ms)."""
    lines = analysis.parse_decode_lines(
        "\n".join(
            [decode(i, 17, 17000 / 4.0) for i in range(6)]
            + [decode(6, 18, 18000 / 231.0)]
            + [decode(7 + i, 5, 5000 / 3.0) for i in range(5)]
        )
    )
    s = analysis.steady_step(lines, 32)
    assert (s["batch"], s["intervals"]) == (17, 5)
    assert s["step_ms"] == pytest.approx(4.0)
    part = {
        "systems": {
            "x": {
                "num_prompts": 32,
                "decode_log": lines,
                "metrics": {"steady_decode": {"step_ms": 231.0, "batch": 18}},
            }
        }
    }
    analysis.restate_steady([part])
    assert part["systems"]["x"]["metrics"]["steady_decode"]["batch"] == 17


# --- 2. percentiles, goodput, identical completions, counters -------------------------


def test_pct():
    assert analysis.pct([4, 1, 3, 2], 50) == 2.5
    assert analysis.pct([1, 2, 3, 4], 0) == 1 and analysis.pct([1, 2, 3, 4], 100) == 4
    assert analysis.pct([10, 20, None, float("nan")], 99) == pytest.approx(19.9)
    assert analysis.pct([], 50) is None and analysis.pct([None], 50) is None


def _r(ttft, tpot, error=None, plen=0, ids=()):
    keys = ("ttft_s", "tpot_s", "error", "prompt_len", "answer_ids")
    return dict(zip(keys, (ttft, tpot, error, plen, list(ids))))


def test_goodput_needs_both_objectives():
    rows = [
        _r(0.5, 0.01),  # good
        _r(2.0, 0.01),  # TTFT missed
        _r(0.5, 0.05),  # TPOT missed
        _r(0.1, 0.01, error="Timeout"),  # errored: never good
        _r(0.9, None),  # one output token: judged on TTFT, good
        _r(1.5, None),  # one output token, TTFT missed
    ]
    assert analysis.goodput(rows, 2.0, ttft_slo_s=1.0, tpot_slo_s=0.02) == 1.0
    assert analysis.goodput(rows, 0.0, 1.0, 0.02) == 0.0


def test_identical_fraction_matches_by_prompt_length():
    ref = [
        _r(0, 0, plen=300, ids=[7, 8, 9]),
        _r(0, 0, plen=100, ids=[1, 2, 3, 4]),
        _r(0, 0, plen=400, ids=[5], error="x"),
    ]
    rows = [
        _r(0, 0, plen=100, ids=[1, 2, 3, 4]),  # identical (4 common)
        _r(0, 0, plen=300, ids=[7, 8, 0]),  # differs at the third token (2 common)
        _r(0, 0, plen=200, ids=[1]),  # not in the reference
        _r(0, 0, plen=400, ids=[5]),  # the reference errored
        _r(0, 0, plen=300, ids=[7, 8, 9], error="y"),  # errored itself
    ]
    got = analysis.identical_fraction(rows, ref)
    assert got == {"identical": 0.5, "compared": 2, "mean_common_prefix": 3.0}
    assert analysis.identical_fraction(rows[2:3], ref)["identical"] is None


def test_counter_delta():
    def tiered(hbm, host, frac=0.1):
        res = {"evictions": 0, "units_read_hbm": hbm, "units_read_host": host}
        return {"internal_states": [{"psa": {"blocks_read_fraction": frac, "residency": res}}]}

    d = analysis.counter_delta(tiered(10, 0, 0.2), tiered(70, 20, 0.3))
    # a server without read counts: its fraction since start, said so
    want = {"kv_fraction_read": 0.3, "kv_fraction_scope": "server life", "hbm_hit_rate": 0.75}
    assert d == want  # hit rate (70-10) / (60 + 20)

    def counted(read, readable):  # the fraction since start, and the counts behind it
        psa = {"blocks_read_fraction": read / readable, "blocks_read": read}
        return {"internal_states": [{"psa": psa | {"blocks_readable": readable}}]}

    # a workload after another on one server: the window's blocks, not the server's life
    d = analysis.counter_delta(counted(700, 1000), counted(760, 1500))
    assert d["kv_fraction_read"] == pytest.approx(60 / 500) and d["kv_fraction_scope"] == "window"
    d = analysis.counter_delta(counted(700, 1000), counted(700, 1000))  # no decode step
    assert d["kv_fraction_read"] == 0.7 and d["kv_fraction_scope"] == "server life"
    assert analysis.counter_delta(tiered(5, 5), tiered(5, 5))["hbm_hit_rate"] is None
    assert analysis.counter_delta(None, tiered(5, 5))["hbm_hit_rate"] is None
    plain = {"internal_states": [{"memory_usage": {"kvcache": 1.0}}]}
    assert analysis.counter_delta(plain, plain) == {"kv_fraction_read": 1.0, "hbm_hit_rate": None}

    def ranked(rows, slotted):  # a kept selection: rows ranked and rows in a slot since start
        out = counted(700, 1000)
        out["internal_states"][0]["psa"] |= {"rows_ranked": rows, "rows_kept_slot": slotted}
        return out

    # the window's share: (90 - 10) / (740 - 100), not the server life's 90 / 740
    d = analysis.counter_delta(ranked(10, 100), ranked(90, 740))
    assert d["rank_fraction"] == pytest.approx(80 / 640)
    assert "rank_fraction" not in analysis.counter_delta(ranked(10, 100), ranked(10, 100))
    assert "rank_fraction" not in analysis.counter_delta(ranked(None, None), ranked(None, None))


# --- 3. per-request records -----------------------------------------------------------


def test_per_request_matches_tasks_by_prompt_length():
    meta = {
        500: {"kind": "niah_1key", "answers": ["1234567"]},
        600: {"kind": "doc_qa", "answers": ["Oslo"]},
        700: {"kind": "niah_4key", "answers": ["7654321"]},
    }
    bench = {
        "input_lens": [600, 500, 700],
        "output_lens": [4, 0, 1],
        "ttfts": [0.5, 0.0, 0.2],
        "itls": [[0.1, 0.1, 0.1], [], []],
        "generated_texts": ["Oslo x x x", "", "7654321"],
        "errors": ["", "Timeout", ""],
    }
    rows = analysis.per_request(
        bench, meta, lambda text, task: task["answers"][0] in text, lambda t: [len(t)]
    )
    assert [r["kind"] for r in rows] == ["doc_qa", "niah_1key", "niah_4key"]
    ok, err, one = rows
    assert ok["tpot_s"] == pytest.approx(0.1) and ok["latency_s"] == pytest.approx(0.8)
    assert (ok["correct"], ok["error"], ok["answer_ids"]) == (True, None, [10])
    assert err["error"] == "Timeout" and err["correct"] is False
    assert err["ttft_s"] is None and err["latency_s"] is None and err["answer_ids"] == []
    assert (one["tpot_s"], one["ttft_s"], one["correct"]) == (None, 0.2, True)
    bench["input_lens"][0] = 999
    with pytest.raises(KeyError, match="prompt of 999 tokens"):
        analysis.per_request(bench, meta, lambda *a: True, lambda t: [])


# --- 4. merging and provenance --------------------------------------------------------


def _rec(step=None, tok_s=None, p99=None, correct=(), rates=None, error=None, peak=None, mean=None):
    if error:
        return {"error": error}
    rows = [  # correct None: an errored request
        dict(prompt_len=100 + i, correct=c, error=None if c is not None else "boom", tpot_s=0.01)
        for i, c in enumerate(correct)
    ]
    rec = {"error": None, "counters": {"kv_fraction_read": 1.0}, "rows": rows}
    rec["metrics"] = {
        "steady_decode": {"step_ms": step},
        "output_tok_s": tok_s,
        "ttft_s": {"p99": p99, "mean": mean},
        "peak_running": peak,
    }
    if rates:
        rec["rates"] = {
            k: {"goodput_strict": s, "goodput_relaxed": r, "rows": rows, "metrics": rec["metrics"]}
            for k, (s, r) in rates.items()
        }
    return rec


def _part(workload, date, commit, model="qwen2.5-0.5b", **systems_):
    return {
        "workload": workload,
        "config": {"workload": {"model": model}},
        "run_id": f"{workload}-{date}",
        "machine": "host1",
        "device": "NVIDIA H100 80GB HBM3",
        "command": f"python run.py stage {workload}",
        "date": f"2026-{date}T00:00:00+00:00",
        "git_commit": commit,
        "systems": systems_,
    }


def _parts():
    return [
        _part("a", "01-01", "c0", plain=_rec(99, 1), psa=_rec(1, 1)),  # superseded entirely
        _part(
            "a",
            "02-01",
            "c1",
            plain=_rec(10, 100, correct=(True, True, False, True)),
            psa=_rec(5, 150, p99=2.0, correct=(True, False, False, None)),
        ),
        _part(
            "a",
            "03-01",
            "c2",
            plain=_rec(20, 1),
            topk=_rec(4, 1),
            psa_tiered_uva=_rec(tok_s=120, p99=3.0),
        ),
        # random weights: speed and capacity only, its answers are never scored
        _part(
            "e",
            "03-15",
            "c2",
            model="llama3.1-8b-dummy",
            plain=_rec(tok_s=100, peak=10, correct=(True,)),
            topk_tiered=_rec(tok_s=160, peak=20),
            psa=_rec(correct=(False,)),
        ),
        _part("a", "04-01", "c3", plain=_rec(30, 1), psa=_rec(error="ServerFailed: boom")),
        _part(
            "c",
            "02-15",
            "c1",
            plain=_rec(correct=(True, False), rates={"8": (2.0, 3.0), "16": (4.0, 5.0)}),
            psa=_rec(correct=(True, True), rates={"8": (1.0, 3.0), "16": (3.0, 4.0)}),
        ),
        # a later stage run of one more rate: paired with its own plain, kept beside the rest
        _part(
            "c",
            "05-01",
            "c4",
            plain=_rec(correct=(True,), rates={"32": (10.0, 10.0)}),
            psa=_rec(correct=(True,), rates={"32": (6.0, 20.0)}),
        ),
    ]


def test_each_sglang_release_keeps_its_suffixed_keys_and_the_newest_fills_the_plain_ones():
    newer = _part("a", "06-01", "c5", plain=_rec(40, 1), psa=_rec(10, 1), topk=_rec(8, 1))
    newer["software"] = {"sglang": "0.5.23", "torch": "2.14.1"}
    older = analysis.merge(_parts())["summary"]
    merged = analysis.merge(_parts() + [newer])
    s, where = merged["summary"], merged["summary_provenance"]
    # each release's own runs under its suffix, however new the other release's run is
    assert s["decode_step_ratio_psa_vs_plain_sglang0517"] == 0.5
    assert s["decode_step_ratio_topk_vs_plain_sglang0517"] == 0.2
    assert s["decode_step_ratio_psa_vs_plain_sglang0523"] == 0.25  # 10 / 40, one run
    assert s["decode_step_ratio_topk_vs_plain_sglang0523"] == 0.2
    assert where["decode_step_ratio_psa_vs_plain_sglang0523"]["sglang"] == "0.5.23"
    assert where["decode_step_ratio_psa_vs_plain_sglang0517"]["sglang"] == "0.5.17"
    # the key without suffix: the newest release that measured it
    assert s["decode_step_ratio_psa_vs_plain"] == 0.25
    assert where["decode_step_ratio_psa_vs_plain"]["sglang"] == "0.5.23"
    # ... and an older one's where the newest did not: nothing of c or e ran on 0.5.23
    assert not any(k.endswith("_sglang0523") and "goodput" in k for k in s)
    assert s["goodput_ratio_vs_plain_strict"] == older["goodput_ratio_vs_plain_strict"]
    assert s["goodput_ratio_vs_plain_strict"] is not None
    assert where["goodput_ratio_vs_plain_strict"]["sglang"] == "0.5.17"
    # every key of one release's summary stays, measured or not
    assert set(older) <= set(s)
    assert all(older[k] == s[k + "_sglang0517"] for k in older if older[k] is not None)
    prov = {p["run_id"]: p for p in merged["provenance"]}
    assert (
        prov["a-06-01"]["sglang"] == "0.5.23" and prov["a-06-01"]["software"]["torch"] == "2.14.1"
    )
    assert prov["a-02-01"]["sglang"] == "0.5.17" and prov["a-02-01"]["software"] is None


def test_merge_takes_the_newest_part_and_plain_from_the_same_part():
    parts = _parts()
    best = analysis.latest_runs(parts)
    assert best[("a", "psa", "inf")]["date"].startswith("2026-02-01")  # errored newer psa loses
    assert best[("a", "plain", "inf")]["date"].startswith("2026-04-01")
    assert best[("c", "psa", "16")]["date"].startswith("2026-02-15")
    assert best[("c", "psa", "32")]["date"].startswith("2026-05-01")
    merged = analysis.merge(parts)
    s = merged["summary"]
    assert tuple(s) == analysis.SUMMARY_KEYS
    assert s["decode_step_ratio_psa_vs_plain"] == 0.5  # 5 / 10, not 5 / 30
    assert s["decode_step_ratio_topk_vs_plain"] == 0.2  # 4 / 20
    assert s["throughput_ratio_psa_vs_plain"] == 1.5
    # the two homes were measured in different runs (psa 02-01, psa_tiered_uva 03-01): no
    # ratio pairs them
    assert s["ttft_p99_ratio_host_vs_hbm"] is None
    assert s["throughput_ratio_tiered_vs_hbm"] is None
    assert s["throughput_ratio_host_vs_plain_capped_topk"] is None  # no topk_tiered in b
    # the newest run of c with both (05-01), at plain's best rate there (32): 6 / 10, 20 / 10
    assert s["goodput_ratio_vs_plain_strict"] == 0.6
    assert s["goodput_ratio_vs_plain_relaxed"] == 2.0
    where = merged["summary_provenance"]
    assert where["goodput_ratio_vs_plain_strict"] == {
        "workload": "c",
        "run_id": "c-05-01",
        "git_commit": "c4",
        "date": "2026-05-01T00:00:00+00:00",
        "systems": ["psa", "plain"],
        "rate": "32",
        "sglang": "0.5.17",
        "metric": "goodput_strict",
    }
    assert where["decode_step_ratio_psa_vs_plain"]["run_id"] == "a-02-01"
    assert where["decode_step_ratio_topk_vs_plain"]["run_id"] == "a-03-01"
    # every value says where it comes from; a key without a value has no provenance
    assert {k for k, v in s.items() if v is not None} == set(where)
    # no plain backend race in these runs: nothing against the fastest
    assert all(s[k] is None for k in analysis.SUMMARY_KEYS if "fastest" in k)
    assert s["plain_backend"] is None and merged["plain_races"] == []
    # a: 3 prompts compared (psa's errored one left out), psa 1 right, plain 2;
    # c: 2 prompts at each of 2 rates, psa 2 right, plain 1 (per rate); 1 at rate 32, both right
    assert s["accuracy_delta_vs_plain"] == pytest.approx(((1 + 4 + 1) - (2 + 2 + 1)) / (3 + 4 + 1))
    assert s["throughput_ratio_host_vs_plain_capped"] is None
    assert s["decode_step_ratio_topk_vs_plain_8b"] is None
    assert s["throughput_ratio_tiered_vs_plain_8b"] == 1.6
    assert s["max_concurrent_ratio_tiered_vs_plain_8b"] == 2.0
    assert [p["git_commit"] for p in merged["parts"]] == ["c1", "c1", "c2", "c2", "c3", "c4"]
    assert merged["mixed"]["git_commits"] == ["c1", "c2", "c3", "c4"]
    assert [p["run_id"] for p in merged["provenance"]] == [
        "a-02-01",
        "c-02-15",
        "a-03-01",
        "e-03-15",
        "a-04-01",
        "c-05-01",
    ]
    assert merged["provenance"][0]["systems"] == ["plain", "psa"]


def test_result_file_round_trip(tmp_path):
    merged = analysis.merge(_parts())
    out = tmp_path / "res" / "serving_h100.json"
    run.write_result(out, merged)
    doc = json.loads(out.read_text())
    assert doc["git_commit"] == "c1; c2; c3; c4" and "warning" in doc
    assert doc["date"] == "2026-05-01T00:00:00+00:00" and doc["summary"] == merged["summary"]
    assert run.load_parts([out]) == json.loads(json.dumps(merged["parts"]))
    folder = tmp_path / "parts"
    folder.mkdir()
    for p in merged["parts"]:
        (folder / f"{p['run_id']}.json").write_text(json.dumps(p))
    assert sorted(p["run_id"] for p in run.load_parts([folder])) == sorted(
        p["run_id"] for p in merged["parts"]
    )
    # merging a re-saved part (same workload and run id) replaces it, not duplicates it
    newer = dict(merged["parts"][-1], git_commit="c5")
    args = SimpleNamespace(fresh=False, export=None)
    again = run.merge_into(out, [newer], args)
    assert [p["git_commit"] for p in again["parts"]] == ["c1", "c1", "c2", "c2", "c3", "c5"]


def test_a_summary_ratio_never_pairs_two_stage_runs():
    """`same_run_ratio` is how every summary ratio is made: two systems of one part at one
    rate, or no value."""
    one = _part("a", "02-01", "c1", plain=_rec(10, 100, p99=4.0), psa=_rec(5, 150, p99=2.0))
    other = _part("a", "03-01", "c2", plain=_rec(20, 1), psa_tiered_uva=_rec(tok_s=120))
    step = analysis.STEP
    ratio, where = analysis.same_run_ratio(
        analysis.measured(one, "psa"), analysis.measured(one, "plain"), step
    )
    assert ratio == 0.5 and where["run_id"] == "a-02-01" and where["systems"] == ["psa", "plain"]
    assert where["metric"] == "steady_decode.step_ms" and where["git_commit"] == "c1"
    cross = analysis.same_run_ratio(
        analysis.measured(other, "psa_tiered_uva"), analysis.measured(one, "psa"), analysis.TOK_S
    )
    assert cross == (None, None)
    # the same run id in another workload is another stage run
    twin = dict(one, workload="a16")
    cross = analysis.same_run_ratio(
        analysis.measured(twin, "psa"), analysis.measured(one, "plain"), step
    )
    assert cross == (None, None)
    c = _part(
        "c", "02-15", "c1", plain=_rec(rates={"8": (2.0, 3.0)}), psa=_rec(rates={"16": (1.0, 1.0)})
    )
    at8, at16 = analysis.measured(c, "plain", "8"), analysis.measured(c, "psa", "16")
    assert analysis.same_run_ratio(at16, at8, ("goodput_strict",)) == (None, None)
    assert analysis.measured(one, "topk") is None
    assert analysis.same_run_ratio(None, analysis.measured(one, "plain"), step) == (None, None)

    # through the summary: the two sglang-psa homes only from a run that measured both
    s, where = analysis.summarize([one, other])
    assert (
        s["throughput_ratio_tiered_vs_hbm"] is None
        and "throughput_ratio_tiered_vs_hbm" not in where
    )
    both = _part("a", "01-15", "c0", plain=_rec(9, 9), psa=_rec(tok_s=100, p99=2.0),
                 psa_tiered_uva=_rec(tok_s=90, p99=3.0))  # fmt: skip
    s, where = analysis.summarize([one, other, both])
    assert s["throughput_ratio_tiered_vs_hbm"] == 0.9 and s["ttft_p99_ratio_host_vs_hbm"] == 1.5
    assert where["throughput_ratio_tiered_vs_hbm"]["run_id"] == "a-01-15"
    assert analysis.merge([one, other, both])["parts"][0]["run_id"] == "a-01-15"  # kept for it


def test_goodput_ratio_is_taken_at_one_rate_of_one_run():
    """psa's goodput at plain's best rate, not psa's best over plain's best."""
    c = _part(
        "c",
        "02-15",
        "c1",
        plain=_rec(rates={"1": (1.0, 1.0), "2": (1.8, 2.0), "4": (1.5, 3.0)}),
        psa=_rec(rates={"1": (1.0, 1.0), "2": (1.9, 2.0), "4": (3.6, 3.9)}),
    )
    s, where = analysis.summarize([c])
    assert s["goodput_ratio_vs_plain_strict"] == pytest.approx(1.9 / 1.8)  # rate 2, not 3.6 / 1.8
    assert where["goodput_ratio_vs_plain_strict"]["rate"] == "2"
    assert s["goodput_ratio_vs_plain_relaxed"] == pytest.approx(3.9 / 3.0)  # rate 4
    assert where["goodput_ratio_vs_plain_relaxed"]["rate"] == "4"


def _raced(workload, date, commit, flashinfer=None, **others):
    """A stage run that raced the three plain backends: fa3 has the highest throughput,
    triton the lowest; flashinfer the shortest decode step (the rule is throughput)."""
    return _part(
        workload,
        date,
        commit,
        plain=_rec(8, 1000, p99=10.0, correct=(True, True, False, False)),
        plain_fa3=_rec(7, 2000, p99=5.0, mean=2.5, correct=(True, True, True, False)),
        plain_flashinfer=flashinfer or _rec(6, 1500),
        **others,
    )


def test_ratios_against_the_fastest_plain_backend_of_the_same_run():
    a = _raced(
        "a",
        "02-01",
        "c1",
        psa=_rec(3.5, 2500, p99=4.0, mean=1.5, correct=(True, True, False, True)),
        topk=_rec(2.1, 3000),
        psa_eps1=_rec(10.5, 900),
    )
    a16 = _raced(
        "a16",
        "02-02",
        "c1",
        flashinfer=_rec(error="ServerFailed: no nvcc"),  # a failed backend stays in the race
        psa=_rec(1.4, 2200, correct=(True, False, True, False)),
    )
    d = _raced("d", "02-03", "c1", model="llama3.1-8b-dummy", topk=_rec(3.5, 2400))
    # newer runs: plain triton alone (no race) and a race that lacks flashinfer
    a_new = _part("a", "03-01", "c2", plain=_rec(10, 1000), psa=_rec(5, 1200), topk=_rec(1, 1))
    a16_two = _part("a16", "03-02", "c2", plain=_rec(4, 10), plain_fa3=_rec(4, 20), psa=_rec(1, 1))
    merged = analysis.merge([a, a16, d, a_new, a16_two])
    s, where = merged["summary"], merged["summary_provenance"]
    assert (s["plain_backend"], s["plain_backend_a16"], s["plain_backend_8b"]) == ("plain_fa3",) * 3
    assert s["decode_step_ratio_psa_vs_fastest"] == 0.5  # 3.5 / 7 in run a-02-01
    assert s["decode_step_ratio_topk_vs_fastest"] == pytest.approx(0.3)
    assert s["decode_step_ratio_eps1_vs_fastest"] == 1.5
    assert s["throughput_ratio_psa_vs_fastest"] == 1.25
    assert s["ttft_ratio_psa_vs_fastest"] == 0.6  # mean TTFT 1.5 / 2.5 (p99s: 4 / 5)
    assert s["decode_step_ratio_psa_vs_fastest_a16"] == pytest.approx(0.2)
    assert s["throughput_ratio_psa_vs_fastest_a16"] == pytest.approx(1.1)
    assert s["decode_step_ratio_topk_vs_fastest_a16"] is None  # no topk in a raced a16 run
    assert s["decode_step_ratio_topk_vs_fastest_8b"] == 0.5
    # a: psa 3 of 4 against fa3's 3; a16: psa 2 of 4 against fa3's 3; d is not scored
    assert s["accuracy_delta_vs_fastest"] == pytest.approx((5 - 6) / 8)
    # the *_vs_plain keys take plain triton from the newest run of each system
    assert (
        s["decode_step_ratio_psa_vs_plain"] == 0.5
        and where["decode_step_ratio_psa_vs_plain"]["run_id"] == "a-03-01"
    )
    w = where["decode_step_ratio_psa_vs_fastest"]
    assert (w["run_id"], w["git_commit"], w["systems"]) == ("a-02-01", "c1", ["psa", "plain_fa3"])
    assert w["date"] == "2026-02-01T00:00:00+00:00"
    assert where["plain_backend"]["backends"]["plain_flashinfer"]["step_ms"] == 6
    assert where["plain_backend"]["rule"] == "highest output tok/s"
    race16 = next(r for r in merged["plain_races"] if r["workload"] == "a16")
    assert race16["backends"]["plain_flashinfer"] == {"error": "ServerFailed: no nvcc"}
    assert [r["run_id"] for r in where["accuracy_delta_vs_fastest"]["runs"]] == [
        "a-02-01",
        "a16-02-02",
    ]
    # the raced runs stay in the result although newer runs measured the same systems
    assert {p["run_id"] for p in merged["parts"]} >= {"a-02-01", "a16-02-02", "d-02-03"}
    # a race where every backend failed, or a run without a race, names no fastest
    assert analysis.plain_race(a_new) is None and analysis.plain_race(a16_two) is None
    dead = _raced("a", "04-01", "c3", flashinfer=_rec(error="x"))
    dead["systems"]["plain"] = dead["systems"]["plain_fa3"] = _rec(error="y")
    assert analysis.fastest_plain(dead) is None


def test_psas_identical_fraction_stands_beside_a_second_plain_servers_from_one_run():
    """`identical_fraction_server_psa` and `identical_fraction_server_plain_vs_plain` come from
    one a16 run that measured plain, plain_repeat and psa; a newer run without
    plain_repeat does not replace them, and none gives no value."""

    def same(x):
        return {"identical": x, "compared": 32}

    old = _part(
        "a16", "02-01", "c1",
        plain=_rec(4, 10), psa=dict(_rec(3, 12), identical_to_plain=same(0.84)),
        plain_repeat=dict(_rec(4, 10), identical_to_plain=same(0.97)),
    )  # fmt: skip
    new = _part("a16", "03-01", "c2", plain=_rec(4, 10),
                psa=dict(_rec(3, 12), identical_to_plain=same(0.5)))  # fmt: skip
    s, where = analysis.summarize([old, new])
    assert (s["identical_fraction_server_psa"], s["identical_fraction_server_plain_vs_plain"]) == (
        0.84, 0.97,
    )  # fmt: skip
    assert where["identical_fraction_server_psa"]["run_id"] == "a16-02-01"
    assert where["identical_fraction_server_plain_vs_plain"]["of"] == "plain_repeat"
    s, _ = analysis.summarize([new])
    assert (
        s["identical_fraction_server_psa"] is None
        and s["identical_fraction_server_plain_vs_plain"] is None
    )
    assert "plain_repeat" in workloads.WORKLOADS["a16"].systems
    assert systems.SYSTEMS["plain_repeat"].attention_backend == "triton"


def test_the_second_models_keys_take_its_own_runs_and_leave_the_test_models_alone():
    """The *_1p5b keys: psa's and top-k's answers against plain's in the same runs of
    a16_1p5b and a_1p5b, and the identical fractions of an a16_1p5b run that measured
    plain, plain_repeat and psa; the test model's keys never count those runs, and the
    1.5B keys never count the test model's."""
    import sglang_psa.models as models

    def same(x):
        return {"identical": x, "compared": 32}

    small = _part("a16", "02-01", "c1", plain=_rec(4, 10, correct=(True, True)),
                  psa=_rec(3, 12, correct=(True, False)))  # fmt: skip
    big16 = _part(
        "a16_1p5b", "02-02", "c1", model="qwen2.5-1.5b",
        plain=_rec(5, 9, correct=(True, False, True, True)),
        plain_repeat=dict(_rec(5, 9), identical_to_plain=same(0.95)),
        psa=dict(_rec(4, 11, correct=(True, True, True, True)), identical_to_plain=same(0.9)),
        topk=_rec(3, 12, correct=(False, False, True, True)),
    )  # fmt: skip
    big28 = _part("a_1p5b", "02-03", "c1", model="qwen2.5-1.5b",
                  plain=_rec(9, 5, correct=(True, True)), psa=_rec(6, 7, correct=(True, False)))  # fmt: skip
    s, where = analysis.summarize([small, big16, big28])
    assert s["accuracy_delta_psa_vs_plain_1p5b"] == pytest.approx((5 - 5) / 6)  # 5 of 6 each
    assert s["accuracy_delta_topk_vs_plain_1p5b"] == pytest.approx((2 - 3) / 4)  # a16 only
    assert where["accuracy_delta_psa_vs_plain_1p5b"]["prompts"] == 6
    assert s["accuracy_delta_vs_plain"] == pytest.approx(-1 / 2)  # the 0.5B run alone
    assert (s["identical_fraction_server_psa_1p5b"],
            s["identical_fraction_server_plain_vs_plain_1p5b"]) == (0.9, 0.95)  # fmt: skip
    assert s["identical_fraction_server_psa"] is None  # no a16 run of the test model had both
    s, _ = analysis.summarize([small])
    assert s["accuracy_delta_psa_vs_plain_1p5b"] is None
    assert s["identical_fraction_server_psa_1p5b"] is None
    # the names the analysis keys on are the registry's and the workloads'
    assert analysis.TEST_MODEL == models.DEFAULT_MODEL
    assert analysis.SECOND_MODEL == workloads.QWEN_1P5B and workloads.QWEN_1P5B in models.MODELS
    for name in ("a16_1p5b", "a_1p5b"):
        w = workloads.WORKLOADS[name]
        base = workloads.WORKLOADS[name.removesuffix("_1p5b")]
        assert w.model == workloads.QWEN_1P5B
        assert (w.prompt_tokens, w.output_tokens) == (base.prompt_tokens, base.output_tokens)
        assert {"plain", "plain_repeat", "psa", "topk"} <= set(w.systems)


def test_the_certified_rules_server_keys_come_from_its_audited_a16_run_beside_plain():
    """`kv_fraction_certified_server_16k` and `certified_server_min_true_coverage` are the
    a16 `psa_certified` run's KV fraction and its coverage audit's smallest share, from
    the newest a16 run that measured it beside plain; none without such a run."""

    def certified(read, low):
        info = {"psa": {"coverage_audit": {"min_true_coverage": low, "heads_checked": 9}}}
        return dict(_rec(3, 12), counters={"kv_fraction_read": read}, server_info_after=info)

    old = _part("a16", "02-01", "c1", plain=_rec(4, 10), psa_certified=certified(0.41, 0.981))
    alone = _part("a16", "03-01", "c2", psa_certified=certified(0.9, 0.5))  # no plain beside
    s, where = analysis.summarize([old, alone])
    assert s["kv_fraction_certified_server_16k"] == 0.41
    assert s["certified_server_min_true_coverage"] == 0.981
    assert where["certified_server_min_true_coverage"]["run_id"] == "a16-02-01"
    assert where["certified_server_min_true_coverage"]["of"] == "psa_certified"
    s, _ = analysis.summarize([alone])
    assert s["kv_fraction_certified_server_16k"] is None
    assert s["certified_server_min_true_coverage"] is None
    flags = systems.SYSTEMS["psa_certified"].flags
    assert "certified" in flags and "--psa-audit-coverage" in flags
    assert "psa_certified" in workloads.WORKLOADS["a16"].systems
    # its speed without the audit's dense pass: the same rule, no audit flag
    unaudited = systems.SYSTEMS["psa_certified_unaudited"].flags
    assert set(flags) - set(unaudited) == {"--psa-audit-coverage", "1"}
    assert "psa_certified_unaudited" in workloads.WORKLOADS["a16"].systems


def test_the_parallel_summary_takes_tp2_ratios_from_one_run_and_the_router_and_kill_parts(
    tmp_path,
):
    """benchmark/parallel: the --tp 2 serving keys pair two systems of one raced run, the
    threshold-1 fraction is that run's against plain triton, the router's and the kill's
    counts come from their parts; serving parts at another --tp are refused."""
    spec = importlib.util.spec_from_file_location(
        "parallel_run", REPO / "benchmark/parallel/run.py"
    )
    par = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(par)
    a16 = _raced(
        "a16", "02-02", "c1",
        psa=_rec(3.5, 2500, correct=(True, True, True, True)),
        topk=_rec(2.1, 3000),
        psa_eps1=dict(_rec(7.5, 1900), identical_to_plain={"identical": 0.75, "compared": 4}),
    )  # fmt: skip
    a16["config"]["tp"] = 2
    serving = tmp_path / "serving_tp2.json"
    serving.write_text(json.dumps({"data": {"parts": [a16]}}))
    gpu = {"gpus": ["NVIDIA H100 80GB HBM3"] * 2}
    par.write_result(tmp_path / "r.json", {"router_dp2_requests_failed": 0}, gpu)
    par.write_result(tmp_path / "k.json", {"tp2_engine_kill_requests_lost": 1}, gpu)
    out = tmp_path / "parallel.json"
    argv = ["summarize", "--serving", str(serving), "--out", str(out)]
    argv += ["--router", str(tmp_path / "r.json"), "--kill", str(tmp_path / "k.json")]
    assert par.main(argv) == 0
    doc = json.loads(out.read_text())
    s = doc["summary"]
    assert list(s) == list(par.SUMMARY_KEYS) and doc["device"] == "NVIDIA H100 80GB HBM3"
    assert s["plain_backend_tp2"] == "plain_fa3"
    assert s["tp2_throughput_ratio_vs_fastest_tp2_a16"] == 1.25  # 2500 / fa3's 2000
    assert s["tp2_throughput_ratio_vs_fastest_tp2"] is None  # workload a not run
    assert s["tp2_decode_step_ratio_psa_vs_fastest_tp2_a16"] == 0.5  # 3.5 / fa3's 7
    assert doc["machine"].startswith("host1")  # the runs' machines, not the summarizer's
    assert s["tp2_identical_fraction_eps1"] == 0.75
    assert s["tp2_accuracy_delta_vs_plain"] == pytest.approx(1 / 4)  # 4 of 4 against 3 of 4
    assert (s["router_dp2_requests_failed"], s["tp2_engine_kill_requests_lost"]) == (0, 1)
    assert doc["summary_provenance"]["tp2_throughput_ratio_vs_fastest_tp2_a16"]["systems"] == [
        "psa", "plain_fa3",
    ]  # fmt: skip
    assert par.result_path("NVIDIA H200", 2).name == "parallel_h200x2.json"
    a16["config"]["tp"] = 1
    serving.write_text(json.dumps({"data": {"parts": [a16]}}))
    with pytest.raises(SystemExit, match="--tp"):
        par.main(argv)


# --- 5. datasets ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def word_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    texts = [r.prompt for r in workloads.build_rows(SMOKE_C, fake_sglang.WordCounter())]
    texts += [r.prompt for r in workloads.build_rows(SMOKE_A, fake_sglang.WordCounter())]
    folder = fake_sglang.make_tokenizer(tmp_path_factory.mktemp("tok"), texts + ["1234567"])
    return AutoTokenizer.from_pretrained(str(folder))


@pytest.mark.parametrize("key", ["c", "a"])
@pytest.mark.parametrize("real", [False, True], ids=["counter", "tokenizer"])
def test_dataset(key, real, word_tok, tmp_path):
    w = workloads.smoke(workloads.WORKLOADS[key])
    tok = word_tok if real else fake_sglang.WordCounter()
    rows = workloads.build_rows(w, tok)
    lens = [r.prompt_len for r in rows]
    assert len(rows) == w.prompts == 8 and len(set(lens)) == len(lens)
    assert [r.kind for r in rows] == [w.kinds[i % len(w.kinds)] for i in range(8)]
    for r in rows:
        assert r.prompt_len == len(tok.encode(r.prompt))
        near = min(abs(r.prompt_len - t) for t in w.prompt_tokens)
        assert near <= workloads.TEMPLATE_SLACK and r.output_len in w.output_tokens
    if real:  # the fake server's counter agrees with the tokenizer it stands in for
        counter = fake_sglang.WordCounter()
        assert lens == [r.prompt_len for r in workloads.build_rows(w, counter)]
    path = workloads.write_dataset(rows, tok, tmp_path / "one.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == len(rows)
    for line, r in zip(lines, rows):
        conv = json.loads(line)
        assert list(conv) == ["conversations"] and len(conv["conversations"]) == 2
        user, assistant = (t["content"] for t in conv["conversations"])
        assert user == r.prompt and len(tok.encode(assistant)) == r.output_len
    meta = workloads.load_meta(path)
    assert meta == {
        r.prompt_len: {
            "kind": r.kind,
            "answers": list(r.answers),
            "answer_tokens": r.answer_tokens,
            "output_len": r.output_len,
        }
        for r in rows
    }
    twice = workloads.write_dataset(workloads.build_rows(w, tok), tok, tmp_path / "two.jsonl")
    assert twice.read_bytes() == path.read_bytes()
    assert workloads.meta_path(twice).read_bytes() == workloads.meta_path(path).read_bytes()


def test_ensure_dataset_builds_once_per_workload_and_tokenizer(word_tok, tmp_path):
    from transformers import AutoTokenizer

    path = workloads.ensure_dataset(SMOKE_A, word_tok, tmp_path)
    assert path.parent == tmp_path / "datasets" and workloads.meta_path(path).exists()
    path.write_text("kept\n")
    assert workloads.ensure_dataset(SMOKE_A, word_tok, tmp_path) == path
    assert path.read_text() == "kept\n"  # reused, not rebuilt
    other = workloads.ensure_dataset(SMOKE_C, word_tok, tmp_path)
    assert other != path and other.read_text() != "kept\n"
    # Another tokenizer counts differently: the sidecar's counts would not hold for it.
    small = AutoTokenizer.from_pretrained(
        str(fake_sglang.make_tokenizer(tmp_path / "small", ["only a few words"]))
    )
    assert workloads.ensure_dataset(SMOKE_A, small, tmp_path) != path


def test_text_of_tokens_and_scoring(word_tok):
    for n in (1, 8, 64, 1000):
        assert len(word_tok.encode(workloads.text_of_tokens(word_tok, n))) == n
    task = {"kind": "niah_1key", "answers": ["1234567"], "answer_tokens": 4}
    assert workloads.is_correct(word_tok, "x x x 1234567 x", task)  # the 4th token
    assert not workloads.is_correct(word_tok, "x x x x 1234567", task)  # the 5th: too late
    long = " ".join(["x"] * 100)
    assert len(workloads.answer_ids(word_tok, long)) == workloads.ANSWER_WINDOW


# --- 6. server flags ------------------------------------------------------------------

CAP = systems.KVCap(
    tokens=4 * 29_000, bytes_per_token=12_288, metadata_bytes_per_token=96, host_tokens=32 * 29_000
)


def test_cap_flags():
    S = systems.SYSTEMS
    for name in ("plain", "plain_hicache", "psa"):
        assert systems.cap_flags(S[name], CAP) == ["--max-total-tokens", str(CAP.tokens)]
    # The tiered home: a KV pool of the same HBM less the host tier's metadata.
    flags = systems.cap_flags(S["psa_tiered"], CAP)
    assert flags[0::2] == ["--max-total-tokens", "--psa-host-pool-gb"]
    pool_gb = float(flags[3])
    assert CAP.host_tokens * CAP.bytes_per_token <= pool_gb * 2**30  # the host tier holds all
    assert pool_gb * 2**30 <= CAP.host_tokens * CAP.bytes_per_token + 1.25 * 2**30
    pool_tokens = int(pool_gb * 2**30) // CAP.bytes_per_token
    cache = CAP.tokens * CAP.bytes_per_token - pool_tokens * CAP.metadata_bytes_per_token
    per = CAP.bytes_per_token + CAP.metadata_bytes_per_token
    assert int(flags[1]) == cache // per and int(flags[1]) < CAP.tokens
    with pytest.raises(ValueError, match="block metadata"):
        systems.cap_flags(S["psa_tiered_uva"], systems.KVCap(1000, 12_288, 96, 10**6))


def test_launch_command():
    S = systems.SYSTEMS

    def cmd(name, **kw):
        return systems.launch_command("/py", S[name], "/m", 30001, max_batch=32, **kw)

    plain = cmd("plain", extra=["--max-total-tokens", "9"])
    assert plain[:3] == ["/py", "-m", "sglang.launch_server"]
    i = plain.index("--cuda-graph-max-bs-decode")
    assert plain[i + 1] == "32" and plain[-2:] == ["--max-total-tokens", "9"]
    assert plain[plain.index("--port") + 1] == "30001"
    assert plain[plain.index("--model-path") + 1] == "/m"
    eager = cmd("plain_eager")
    assert "--cuda-graph-max-bs-decode" not in eager and eager[-2:] == [
        "--cuda-graph-backend-decode",
        "disabled",
    ]
    for name in ("psa", "topk", "psa_eps1", "psa_tiered_uva", "topk_tiered"):
        c = cmd(name, load_format="dummy")
        # sglang-psa decodes in graphs captured up to the same batch, at every KV home
        assert "--cuda-graph-max-bs-decode" in c
        assert "--sparse-mode" in c and c[c.index("--load-format") + 1] == "dummy"
    assert cmd("psa_eps1")[-2:] == ["--psa-threshold", "1.0"]
    # a flag the caps set again (the host pool) appears once, with the caps' value
    capped = cmd("topk_tiered", extra=["--max-total-tokens", "9", "--psa-host-pool-gb", "82.25"])
    assert capped.count("--psa-host-pool-gb") == 1 and capped[-2:] == [
        "--psa-host-pool-gb",
        "82.25",
    ]
    assert capped[capped.index("--psa-kv-home") + 1] == "tiered"
    # plain SGLang names its attention backend; sglang-psa leaves prefill to the plugin
    for name, backend in (
        ("plain", "triton"),
        ("plain_fa3", "fa3"),
        ("plain_flashinfer", "flashinfer"),
        ("plain_eager", "triton"),
        ("plain_hicache", "triton"),
        ("plain_hicache_fa3", "fa3"),
    ):
        c = cmd(name)
        assert c.count("--attention-backend") == 1, name
        assert c[c.index("--attention-backend") + 1] == backend, name
    for name in ("psa", "topk", "psa_eps1", "psa_tiered_uva", "topk_tiered"):
        assert "--attention-backend" not in cmd(name), name
    for name in systems.PLAIN_RACE:  # the race: plain SGLang, decode graphs, one backend each
        assert S[name].plain and S[name].graphs and S[name].flags == ()
    assert len({S[n].attention_backend for n in systems.PLAIN_RACE}) == len(systems.PLAIN_RACE)
    assert S["plain_flashinfer"].jit_s > 0 and S["plain_fa3"].jit_s == 0
    fake = cmd("psa", launcher=["/py", "fake.py"])
    assert fake[:3] == ["/py", "fake.py", "--model-path"] and "sglang.launch_server" not in fake


def test_stage_order_runs_the_plain_backends_first():
    assert run.stage_order(["psa", "plain_flashinfer", "topk", "plain_fa3"]) == [
        "plain",
        "plain_flashinfer",  # its JIT needs the most budget left: before FA3
        "plain_fa3",
        "psa",
        "topk",
    ]
    assert systems.SYSTEMS["plain_flashinfer"].jit_s > systems.SYSTEMS["plain_fa3"].jit_s
    assert run.stage_order(["topk"]) == ["plain", "topk"]
    assert run.stage_order(["plain", "psa", "plain_eager"]) == ["plain", "psa", "plain_eager"]
    for key in ("a", "a16", "d"):  # the default plans race every plain backend
        w = workloads.WORKLOADS[key]
        assert set(systems.PLAIN_RACE) <= set(w.systems) and w.systems[0] == "plain"
    a16 = workloads.WORKLOADS["a16"]
    assert (a16.prompts, a16.prompt_tokens, a16.output_tokens) == (32, (16_000,), (256,))
    assert not a16.is_sweep  # all sent at once


# --- 7. the whole stage against the fake server ---------------------------------------


def _free_port_pair(n: int = 2, step: int = 1) -> int:
    """A port P with P, P + step, ... (n ports) free, below Linux's ephemeral range (32768
    and up by default): a port the kernel handed out for binding to port 0 may be taken
    meanwhile by another test's outgoing connection before the stage's server binds it.
    The default: two consecutive ports (a stage's servers, one after another)."""
    import contextlib
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000 - n * step)
        try:
            with contextlib.ExitStack() as stack:
                for k in range(n):
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port + k * step))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {n} free ports {step} apart")


def _fake_stage(tmp_path, smoke_workload, *more, **env_extra) -> tuple[list[str], dict]:
    """`run.py stage W --smoke` (with `more` workloads: `stage W,W2,...`) against the fake
    server (skipped without SGLang's client or aiohttp): the command up to its per-call
    flags, and its environment."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("sglang is not installed: bench_serving (the real client) is needed")
    if importlib.util.find_spec("aiohttp") is None:
        pytest.skip("aiohttp is not installed: the fake server and bench_serving need it")
    ws = [smoke_workload, *more]
    rows = [r for w in ws for r in workloads.build_rows(w, fake_sglang.WordCounter())]
    tok = fake_sglang.make_tokenizer(tmp_path / "tok", [r.prompt for r in rows])
    launcher = f"{shlex.quote(sys.executable)} test/unit/bench/fake_sglang.py"
    env = dict(os.environ, **env_extra)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "python"), env.get("PYTHONPATH")) if p
    )
    names = ",".join(w.name for w in ws)
    cmd = [sys.executable, "benchmark/serving/run.py", "stage", names, "--smoke"]
    cmd += ["--model-dir", str(tok), "--launcher", launcher, "--work", str(tmp_path / "work")]
    return cmd, env


@pytest.mark.slow
def test_stage_c_smoke_end_to_end(tmp_path):
    cmd, env = _fake_stage(tmp_path, SMOKE_C)
    out = tmp_path / "out"
    cmd += ["--export", str(out), "--port", str(_free_port_pair())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    (part_file,) = (out / "parts").glob("c.*.json")
    part = json.loads(part_file.read_text())
    assert set(part["systems"]) == {"plain", "psa"}
    assert {"strict", "relaxed"} <= set(part["slo"])
    rates = {f"{r:g}" for r in SMOKE_C.rates}
    assert len(rates) == 2
    for name, rec in part["systems"].items():
        assert rec["error"] is None and set(rec["rates"]) == rates, name
        for run_ in rec["rates"].values():
            got = run_["rows"]
            assert len(got) == SMOKE_C.prompts == 8 and run_["metrics"]["failed"] == 0
            # the client noted its last send: no server serves more than the outputs by then
            m = run_["metrics"]
            assert m["output_tok_s_ceiling"] >= m["output_tok_s"] > 0
            assert sorted(r["prompt_len"] for r in got) == sorted(
                r.prompt_len for r in workloads.build_rows(SMOKE_C, fake_sglang.WordCounter())
            )
            # the fake answers every 7-digit number of the prompt: needle tasks are right,
            # doc_qa and variable_tracking are not
            assert [r["correct"] for r in got] == [r["kind"].startswith("niah") for r in got]
            niah = sum(r["kind"] in ("niah_1key", "niah_4key") for r in got) / len(got)
            assert 0 < niah < 1 and run_["metrics"]["accuracy"] == pytest.approx(niah)
            assert run_["goodput_strict"] is not None and run_["goodput_relaxed"] is not None
            # bench_serving --cache-report: the prompt tokens the server served from its cache
            assert all(isinstance(r["cached_tokens"], int) for r in got)
            cache = run_["metrics"]["prefix_cache"]
            assert cache["prompt_tokens"] == sum(r["prompt_len"] for r in got)
            # the machine sampled over the run (no nvidia-smi here: no GPU series)
            samples = run_["machine_samples"]
            assert samples["period_s"] == 0.1 and samples["gpu"] is None
            for key, series in samples["threads"].items():
                assert key.split("/", 1)[0].isdigit() and len(series["t"]) == len(series["pct"])
    assert part["systems"]["psa"]["counters"]["kv_fraction_read"] == 0.25
    assert part["systems"]["plain"]["counters"]["kv_fraction_read"] == 1.0
    # bench_serving sent every timed prompt as token ids (client_ids.py); the fake server
    # decodes them, so the answers above are read from the same text
    assert part["config"]["prompt_format"] == "ids"
    timed = SMOKE_C.prompts * len(rates) * len(part["systems"])
    logs = "".join(p.read_text() for p in (tmp_path / "work" / "logs").rglob("*.server.log"))
    assert logs.count("generate: prompt as input_ids") == timed
    summary = json.loads((out / "serving_smoke.json").read_text())["summary"]
    assert summary["goodput_ratio_vs_plain_strict"] is not None
    assert summary["goodput_ratio_vs_plain_relaxed"] is not None


def test_a_completion_is_compared_and_scored_up_to_the_end_of_its_turn():
    """EOS is ignored to fix the output length, and the server is asked to keep special
    tokens in the text: answers are compared and scored up to the first one (the end of
    the turn, included), not on what the model writes past it."""
    cmd = driver.bench_command("py", "u", "m", Path("d"), 4, 1.0, 64, 0, Path("o"))
    body = json.loads(cmd[cmd.index("--extra-request-body") + 1])
    assert body == {"sampling_params": {"temperature": 0.0, "max_new_tokens": 64,
                                        "ignore_eos": True, "skip_special_tokens": False}}  # fmt: skip
    assert "--extra-request-body" not in driver.bench_command(
        "py", "u", "m", Path("d"), 4, 1.0, None, 0, Path("o")
    )  # outputs of several lengths (workload c): no body replaces bench_serving's own

    class Tok:  # a chat model's: EOS and an end-of-turn token flagged special
        all_special_tokens = ["<eos>", "<unk>"]
        added_tokens_decoder = {9: SimpleNamespace(content="<end>", special=True),
                                8: SimpleNamespace(content="<tool>", special=False)}  # fmt: skip
        eos_token, unk_token = "<eos>", "<unk>"

        def encode(self, s, add_special_tokens=False):
            return [len(w) for w in s.replace("<", " <").replace(">", "> ").split()]

    tok = Tok()
    assert workloads.until_end(tok, "Oslo is it.<end> I apologize") == "Oslo is it.<end>"
    assert workloads.until_end(tok, "a <eos> b <end>") == "a <eos>"  # the first end
    assert workloads.until_end(tok, "a <unk> b <tool> c") == "a <unk> b <tool> c"  # no end
    ended = workloads.answer_ids(tok, "Oslo.<end> I apologize, but")
    assert ended == workloads.answer_ids(tok, "Oslo.<end> I'm sorry, I cannot")
    assert ended != workloads.answer_ids(tok, "Oslo. I'm sorry, I cannot")  # never ended


def test_client_ids_notes_the_last_send_in_the_runs_output_line(tmp_path):
    """The request generator's hand-overs are timed from the first; the run's output line
    gains the last one as `idle_duration`, except at an infinite rate."""
    import asyncio
    import time as time_

    async def get_request(rows, rate):
        for i, row in enumerate(rows):
            if i:
                await asyncio.sleep(0.02)
            yield row

    serving = SimpleNamespace(get_request=get_request)
    client_ids.record_sends(serving)
    client_ids._SENT.clear()

    async def drain():
        return [r async for r in serving.get_request(["a", "b", "c"], 50.0)]

    t0 = time_.perf_counter()
    assert asyncio.run(drain()) == ["a", "b", "c"]
    took = time_.perf_counter() - t0
    sent = list(client_ids._SENT)
    assert sent[0] == 0.0 and sent == sorted(sent) and 0.04 <= sent[-1] <= took
    out = tmp_path / "o.jsonl"
    out.write_text(json.dumps({"run": 1}) + "\n" + json.dumps({"duration": 1.0}) + "\n")
    client_ids.note_sends(["--request-rate", "inf", "--output-file", str(out)])
    assert "idle_duration" not in out.read_text()  # all at once: nothing bound
    client_ids.note_sends(["--request-rate", "50", "--output-file", str(out)])
    first, last = [json.loads(x) for x in out.read_text().splitlines()]
    assert first == {"run": 1} and last == {"duration": 1.0, "idle_duration": sent[-1]}
    client_ids._SENT.clear()


def test_client_ids_sends_the_tokens_bench_serving_counted():
    tok = fake_sglang.WordCounter()
    rows = [
        SimpleNamespace(prompt="a b c", prompt_len=3),
        SimpleNamespace(prompt="d", prompt_len=1),
    ]
    assert client_ids.to_ids(rows, tok) is rows
    assert [r.prompt for r in rows] == [[0, 0, 0], [0]]
    with pytest.raises(SystemExit, match="counts 2 tokens, bench_serving counted 3"):
        client_ids.to_ids([SimpleNamespace(prompt="a b", prompt_len=3)], tok)
    with pytest.raises(SystemExit, match="a prompt of type list"):
        client_ids.to_ids(rows, tok)  # already ids
    assert driver.bench_command("py", "u", "m", Path("d"), 1, 1.0, None, 0, Path("o"))[1] == str(
        REPO / "benchmark" / "serving" / "client_ids.py"
    )
    text = driver.bench_command("py", "u", "m", Path("d"), 1, 1.0, None, 0, Path("o"), "text")
    assert text[1:3] == ["-m", "sglang.bench_serving"]
    with pytest.raises(ValueError, match="prompt_format 'json'"):
        driver.bench_command("py", "u", "m", Path("d"), 1, 1.0, None, 0, Path("o"), "json")


def test_a_worker_tokenizes_each_prompt_once_across_runs():
    """The worker's tokenizer answers a prompt it has seen from memory: bench_serving's
    count and the ids sent, over every run of a stage, cost one tokenization each."""
    calls = []

    class Tok(fake_sglang.WordCounter):
        def encode(self, text, *a, **k):
            calls.append(text)
            return super().encode(text, *a, **k)

    memo = client_ids._Memo(Tok())
    client_ids._ENCODED.clear()
    for _ in range(3):  # three runs, each counting then converting two prompts
        rows = [SimpleNamespace(prompt=t, prompt_len=len(memo.encode(t))) for t in ("a b", "c")]
        client_ids.to_ids(rows, memo)
        assert [r.prompt for r in rows] == [[0, 0], [0]]
    assert calls == ["a b", "c"]
    ids = memo.encode("a b")
    ids.append(9)  # a caller's list is its own
    assert memo.encode("a b") == [0, 0]
    client_ids._ENCODED.clear()


FAKE_WORKER = """
import json, os, sys, time
print("worker up", file=sys.stderr, flush=True)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    arg = req["argv"][0]
    with open(req["log"], "w") as f:
        f.write(f"pid {os.getpid()} {req['prompt_format']} {arg}\\n")
    if arg == "die":
        sys.exit(3)
    if arg == "hang":
        time.sleep(60)
    print(json.dumps({"rc": int(arg)}), flush=True)
"""


def test_the_client_runs_a_stages_commands_in_one_worker_and_replaces_a_dead_one(
    monkeypatch, tmp_path
):
    worker = tmp_path / "worker.py"
    worker.write_text(FAKE_WORKER)
    monkeypatch.setattr(driver.Client, "WORKER", worker)
    ids = [sys.executable, str(REPO / "benchmark" / "serving" / "client_ids.py")]
    text = [sys.executable, "-m", "sglang.bench_serving"]
    logs = [tmp_path / f"run{i}.log" for i in range(6)]
    pid = lambda i: logs[i].read_text().split()[1]  # noqa: E731
    client = driver.Client(tmp_path / "worker.log")
    try:
        assert client.run([*ids, "0"], logs[0], 30) == 0
        assert client.run([*text, "5"], logs[1], 30) == 5
        assert pid(0) == pid(1)  # one worker for both
        assert logs[1].read_text().split()[2] == "text"
        with pytest.raises(driver.ServerFailed, match="code 3(.|\n)*die(.|\n)*worker up"):
            client.run([*ids, "die"], logs[2], 30)
        assert client.run([*ids, "0"], logs[3], 30) == 0  # a fresh worker
        assert pid(3) != pid(0)
        t0 = time.time()
        with pytest.raises(driver.ServerFailed, match="had not finished"):
            client.run([*ids, "hang"], logs[4], 1.5)
        assert time.time() - t0 < 10
        with pytest.raises(ProcessLookupError):  # the hung worker was killed
            for _ in range(50):
                os.kill(int(pid(4)), 0)
                time.sleep(0.1)
        with pytest.raises(ValueError, match="not a bench_command"):
            client.run([sys.executable, "other.py"], logs[5], 30)
    finally:
        client.close()


def test_missing_lists_the_default_plan_minus_what_was_measured():
    doc = {"data": {"parts": _parts()}}
    todo = run.missing(doc)
    assert "psa" not in todo["a"] and "topk" not in todo["a"]  # measured (a newer psa failed)
    assert todo["a"]["plain_eager"] == ["inf"]
    assert set(todo["b"]) == set(workloads.WORKLOADS["b"].systems)  # nothing of b measured
    # c was measured at rates 8, 16 and 32: of the default rates, 8 is there
    assert todo["c"]["psa"] == ["1", "2", "4"]
    assert run.missing(None).keys() == workloads.WORKLOADS.keys()


def test_a_systems_record_is_handed_over_before_its_server_shuts_down(monkeypatch, tmp_path):
    """A system's record reaches the part file while its server still runs: a device call
    that runs out during the shutdown (several seconds with SGLang) keeps the measurement.
    """
    events, plans = _one_server(monkeypatch, tmp_path)
    rec = run.run_system("psa", SMOKE_A, plans[0][1], 31999, run.time.time() + 60)
    assert rec["error"] is None
    assert events[-2:] == [("measured", "a", None), "stop"]


# --- 7b. several workloads on one server per system ------------------------------------


def _server_ctx(w, cap=None):
    return {"cap": cap, "model_dir": "/m", "max_batch": w.max_batch, "launcher": None}


def test_workloads_share_a_server_only_with_the_same_launch():
    W = workloads.WORKLOADS
    assert run.workload_list("a,a16") == ["a", "a16"] and run.workload_list("b") == ["b"]
    for bad in ("a,zz", "a,a16,a", ","):
        with pytest.raises(argparse.ArgumentTypeError):
            run.workload_list(bad)
    names = ["plain", "plain_fa3", "plain_flashinfer", "psa", "topk"]
    run.check_shared_server([W["a"], W["a16"]], names, {k: _server_ctx(W[k]) for k in W}, 31000)
    cap = systems.KVCap(4 * W["b"].max_request_tokens, 12_288, 96, 32 * 30_000)
    ctxs = {k: _server_ctx(W[k]) for k in W} | {"b": _server_ctx(W["b"], cap)}
    with pytest.raises(SystemExit, match=r"workloads a and b .*psa's launch differs at "
                       r"--max-total-tokens \(a: not set, b: \d+\)"):  # fmt: skip
        run.check_shared_server([W["a"], W["b"]], ["psa"], ctxs, 31000)
    with pytest.raises(
        SystemExit, match=r"a16 and c .*--cuda-graph-max-bs-decode \(a16: 32, c: 24"
    ):
        run.check_shared_server([W["a16"], W["c"]], ["topk"], ctxs, 31000)
    # two workloads with the same cap launch alike, but a capped workload runs alone
    b2 = dataclasses.replace(W["b"], name="b2")
    with pytest.raises(SystemExit, match="b, b2 caps the HBM for KV"):
        run.check_shared_server([W["b"], b2], ["plain"], ctxs | {"b2": ctxs["b"]}, 31000)
    # the budget a system needs: its start once, every further workload's runs
    assert run.system_budget_s("plain", 1) == run.MIN_SYSTEM_BUDGET_S
    assert run.system_budget_s("plain_flashinfer", 2) == (
        run.MIN_SYSTEM_BUDGET_S + run.MIN_WORKLOAD_BUDGET_S + systems.FLASHINFER_JIT_S
    )


def _one_server(monkeypatch, tmp_path, flush_status=200):
    """run_server with a recording stand-in for the server, warm-up and timed run."""
    events = []
    info = {"internal_states": [{"memory_usage": {"kvcache": 1.0}}]}

    class FakeServer:
        startup_s = 7.0

        def __init__(self, cmd, port, log_path, env=None, cpus=None):
            self.log_path = log_path
            events.append(("launch", log_path.name))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            events.append("stop")

        def wait_healthy(self, timeout):
            pass

        def get(self, path):
            return info

        def flush_cache(self, check=False):
            events.append(("flush", check))
            if flush_status != 200 and check:
                raise run.ServerFailed(f"/flush_cache answered {flush_status}: no")

    monkeypatch.setattr(run, "Server", FakeServer)
    monkeypatch.setattr(run, "warm_up", lambda server, tok, w: events.append(("warm", w.name)))

    def timed(server, w, name, *a):
        events.append(("run", w.name))
        return {"metrics": {"output_tok_s": 5.0}}

    monkeypatch.setattr(run, "timed_run", timed)

    def ctx(w):
        return {
            "cap": None,
            "model_dir": tmp_path,
            "work": tmp_path,
            "run_id": "r",
            "tok": None,
            "max_batch": w.max_batch,
            "launcher": None,
            "measured": lambda name, rec: events.append(("measured", w.name, rec["error"])),
        }

    return events, [(SMOKE_A, ctx(SMOKE_A)), (SMOKE_A16, ctx(SMOKE_A16))]


def test_kernels_compiled_during_a_timed_run_are_counted(monkeypatch, tmp_path):
    """Triton's cache on the host grows by a folder per compiled kernel: the record says
    how many the warm-up and the timed run compiled, and which the timed run did (a16
    compiled one while timed: its folder's `<kernel>.json` names it)."""
    events, plans = _one_server(monkeypatch, tmp_path)
    cache = tmp_path / "triton"
    cache.mkdir()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    (cache / "old").mkdir()
    (cache / "not-a-kernel.json").write_text("{}")

    def warm(server, tok, w):
        for i in range(2):
            (cache / f"{w.name}-warm{i}").mkdir()
        return 1.0

    def timed(server, w, name, *a):
        if w.name == "a16":
            (cache / "a16-timed").mkdir()
            for f in ("__grp___copy_pages_kernel.json", "_copy_pages_kernel.json",
                      "_copy_pages_kernel.cubin"):  # fmt: skip
                (cache / "a16-timed" / f).write_text("{}")
        return {"metrics": {"output_tok_s": 5.0}}

    monkeypatch.setattr(run, "warm_up", warm)
    monkeypatch.setattr(run, "timed_run", timed)
    recs = run.run_server("psa", plans, 31999, run.time.time() + 300)
    assert recs["a"]["triton_compiled"] == {"warmup": 2, "timed": 0, "timed_kernels": []}
    assert recs["a16"]["triton_compiled"] == {
        "warmup": 2, "timed": 1, "timed_kernels": ["_copy_pages_kernel"]
    }  # fmt: skip
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "none"))  # no cache: no claim
    recs = run.run_server("psa", plans, 31999, run.time.time() + 300)
    assert "triton_compiled" not in recs["a"]


def test_one_server_measures_each_workload_in_turn_flushing_between(monkeypatch, tmp_path):
    events, plans = _one_server(monkeypatch, tmp_path)
    recs = run.run_server("psa", plans, 31999, run.time.time() + 300)
    assert events == [
        ("launch", "a+a16-psa.server.log"),
        ("warm", "a"),
        ("run", "a"),
        ("measured", "a", None),
        ("warm", "a16"),
        ("flush", True),  # checked, after a16's warm-up, before its timed run
        ("run", "a16"),
        ("measured", "a16", None),
        "stop",
    ]
    assert recs["a"]["startup_s"] == recs["a16"]["startup_s"] == 7.0
    assert recs["a"]["shared_server_with"] == ["a16"]
    assert recs["a16"]["shared_server_with"] == ["a"]
    assert recs["a"]["launch"] == recs["a16"]["launch"]
    # one workload: the record as before, no sharing, no extra flush
    events.clear()
    rec = run.run_system("psa", SMOKE_A, plans[0][1], 31999, run.time.time() + 300)
    assert "shared_server_with" not in rec and ("flush", True) not in events


def test_a_refused_flush_is_that_workloads_error_and_the_budget_ends_a_server(
    monkeypatch, tmp_path
):
    events, plans = _one_server(monkeypatch, tmp_path, flush_status=500)
    recs = run.run_server("topk", plans, 31999, run.time.time() + 300)
    assert recs["a"]["error"] is None and "/flush_cache answered 500" in recs["a16"]["error"]
    assert "log_tail" in recs["a16"] and ("run", "a16") not in events
    assert events.count("stop") == 1 and events[-1] == "stop"
    # the second workload is reached with less than MIN_WORKLOAD_BUDGET_S left: not run
    events, plans = _one_server(monkeypatch, tmp_path)
    recs = run.run_server("topk", plans, 31999, run.time.time() + run.MIN_WORKLOAD_BUDGET_S - 5)
    assert set(recs) == {"a"} and ("warm", "a16") not in events


def test_repeats_keep_the_median_run_whole(monkeypatch, tmp_path):
    """`stage --repeats N`: the timed run N times on the warm server, the run of median
    output tokens/s kept whole (step, TTFT and answers of one run), the others' figures
    beside it; an even count keeps the lower middle run."""
    events, plans = _one_server(monkeypatch, tmp_path)
    rates = iter([5.0, 9.0, 7.0, 4.0, 8.0])

    def timed(server, w, name, rate, num_prompts, ctx, logs, deadline, repeat=0):
        events.append(("run", w.name, repeat))
        tok_s = next(rates)
        metrics = {"output_tok_s": tok_s, "steady_decode": {"step_ms": 10 / tok_s},
                   "ttft_s": {"mean": tok_s / 10}, "accuracy": tok_s / 100}  # fmt: skip
        return {"metrics": metrics, "rows": [tok_s]}

    monkeypatch.setattr(run, "timed_run", timed)
    w, ctx = plans[0]
    ctx["repeats"] = 3
    rec = run.run_system("psa", w, ctx, 31999, run.time.time() + 300)
    assert [e for e in events if e[0] == "run"] == [("run", "a", k) for k in range(3)]
    assert rec["metrics"]["output_tok_s"] == 7.0 and rec["rows"] == [7.0]
    assert rec["metrics"]["steady_decode"]["step_ms"] == 10 / 7.0 and rec["median_of"] == 2
    assert [r["output_tok_s"] for r in rec["repeats"]] == [5.0, 9.0, 7.0]
    assert [r["step_ms"] for r in rec["repeats"]] == [2.0, 10 / 9.0, 10 / 7.0]
    ctx["repeats"] = 2
    rec = run.run_system("psa", w, ctx, 31999, run.time.time() + 300)
    assert rec["metrics"]["output_tok_s"] == 4.0 and rec["median_of"] == 0
    assert rec["server_figures_span_runs"] and "repeats_asked" not in rec
    # a repeat that fails ends the repeats, keeping the runs done
    rates = iter([6.0, None])

    def failing(server, w, name, rate, num_prompts, ctx, logs, deadline, repeat=0):
        tok_s = next(rates)
        if tok_s is None:
            raise run.ServerFailed("bench_serving exited with 1")
        return {"metrics": {"output_tok_s": tok_s, "duration_s": 1.0}, "rows": [tok_s]}

    monkeypatch.setattr(run, "timed_run", failing)
    ctx["repeats"] = 3
    rec = run.run_system("psa", w, ctx, 31999, run.time.time() + 300)
    assert rec["error"] is None and rec["metrics"]["output_tok_s"] == 6.0
    assert rec["repeats_asked"] == 3
    # a further run starts only with 1.5x the longest run left before the stop margin
    rates = iter([6.0, 7.0])
    events.clear()
    deadline = run.time.time() + run.STOP_MARGIN_S + 1.2  # < 1.5 x a 1 s run
    rec = run.run_system("psa", w, ctx, 31999, deadline)
    assert rec["metrics"]["output_tok_s"] == 6.0 and rec["repeats_asked"] == 3

    # ... and one first run's cost more for each measurement the stage has still to make:
    # every system's one run comes before any system's repeats
    def second(server, w, name, rate, num_prompts, ctx, logs, deadline, repeat=0):
        res = timed(server, w, name, rate, num_prompts, ctx, logs, deadline, repeat)
        res["metrics"]["duration_s"] = 1.0
        return res

    monkeypatch.setattr(run, "timed_run", second)
    for still, runs in (((3, 0), 1), ((1, 0), 3), ((0, 1), 1)):  # a start: the server's 7 s
        rates = iter([6.0, 7.0, 8.0])
        ctx["still_to_come"] = lambda name, workload, still=still: still
        deadline = run.time.time() + run.STOP_MARGIN_S + 3.5  # 1.5 + 3 x 1 s > 3.5 > 1.5 + 1
        rec = run.run_system("psa", w, ctx, 31999, deadline)
        assert len(rec.get("repeats", [rec])) == runs
    del ctx["still_to_come"]
    one = {"metrics": {"output_tok_s": 1.0}}
    assert run.median_run([one]) == one and "repeats" not in one  # one run: as it came


def _together(monkeypatch, tmp_path, fails=(), slow=(), pools=None):
    """StartedTogether over recording stand-ins: `fails` exit during start-up, `slow`
    become healthy a poll later than the rest; `pools`: name -> the KV pool a server
    reports (default 1000)."""
    events, plans = _one_server(monkeypatch, tmp_path)
    state: dict[str, str] = {}

    class Stand:
        def __init__(self, name):
            self.name, self.polls, self.startup_s = name, 0, float("nan")
            self.log_path = tmp_path / f"{name}.log"

        def __enter__(self):
            state[self.name] = "starting"
            events.append(("start", self.name))
            return self

        def healthy(self):
            self.polls += 1
            if self.name in fails:
                raise run.ServerFailed(f"{self.name} exited during start-up")
            return self.polls > (2 if self.name in slow else 1)

        def pause(self):
            state[self.name] = "paused"
            events.append(("pause", self.name))

        def resume(self):
            state[self.name] = "running"
            events.append(("resume", self.name))
            others = {n: s for n, s in state.items() if n != self.name}
            # while one server is measured every other one is paused or gone
            assert set(others.values()) <= {"paused", "stopped"}, others

        def stop(self):
            if state.get(self.name) != "stopped":
                state[self.name] = "stopped"
                events.append(("stop", self.name))

        def get(self, path):
            return {
                "internal_states": [{"memory_usage": {"kvcache": 1.0}}],
                "max_total_num_tokens": (pools or {}).get(self.name, 1000),
            }

        def flush_cache(self, check=False):
            events.append(("flush", check))

    monkeypatch.setattr(run, "new_server", lambda name, plans, port: (
        Stand(name),
        {w.name: {"what": name, "launch": run.launch(name, w, c, port), "error": None}
         for w, c in plans},
    ))  # fmt: skip
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    return events, plans, state


def test_servers_started_together_are_paused_when_healthy_and_measured_one_at_a_time(
    monkeypatch, tmp_path
):
    events, plans, state = _together(monkeypatch, tmp_path, fails=("topk",), slow=("plain",))
    deadline = run.time.time() + 300
    names = ["plain", "psa", "topk"]
    together = run.StartedTogether(names, plans, 31000, deadline)
    starts = [e for e in events if e[0] == "start"]
    assert starts == [("start", n) for n in names]  # all launched before any is paused
    assert events.index(("pause", "psa")) < events.index(("pause", "plain"))  # when healthy
    assert state == {"plain": "paused", "psa": "paused", "topk": "stopped"}  # failed: stopped
    events.clear()
    recs = together.measure("plain", plans, deadline)
    assert events[0] == ("resume", "plain") and events[-1] == ("stop", "plain")
    assert [e for e in events if e[0] == "run"] == [("run", "a"), ("run", "a16")]
    for rec in recs.values():
        assert rec["error"] is None and rec["started_together_with"] == ["psa", "topk"]
    assert state["psa"] == "paused"  # still waiting for its turn
    recs = together.measure("psa", plans[:1], deadline)  # a16 no longer live: a only
    assert set(recs) == {"a"} and recs["a"]["error"] is None
    events.clear()
    recs = together.measure("topk", plans, deadline)  # its start-up failed: its error
    assert all("exited during start-up" in r["error"] for r in recs.values())
    assert ("resume", "topk") not in events and ("run", "a") not in events
    together.stop_all()
    assert set(state.values()) == {"stopped"}
    # a server that got a smaller KV pool than asked is stopped, its runs an error
    events, plans, state = _together(monkeypatch, tmp_path, pools={"psa": 900})
    for _, c in plans:
        c["together_tokens"] = 1000
    together = run.StartedTogether(["plain", "psa"], plans, 31000, deadline)
    assert state == {"plain": "paused", "psa": "stopped"}
    recs = together.measure("psa", plans, deadline)
    assert all("KV pool of 900 tokens, not the 1000" in r["error"] for r in recs.values())
    together.stop_all()
    # each server is held to its own --max-total-tokens: under a cap the tiered home asks
    # less than plain (its block metadata takes the rest of the HBM) and gets it
    cap = systems.KVCap(32_640, 12_288, 204, 16 * 16_320)  # f_capped, 0.5B
    tiered = systems.cap_flags(systems.SYSTEMS["psa_tiered_prefix"], cap)
    asked = int(tiered[tiered.index("--max-total-tokens") + 1])
    assert asked < 0.99 * cap.tokens
    pools = {"plain": 32_000, "psa_tiered_prefix": asked}  # plain short of its 32,640
    events, plans, state = _together(monkeypatch, tmp_path, pools=pools)
    for _, c in plans:
        c["cap"] = cap
    together = run.StartedTogether(["plain", "psa_tiered_prefix"], plans, 31000, deadline)
    assert state == {"plain": "stopped", "psa_tiered_prefix": "paused"}
    together.stop_all()
    # an interrupt while they start leaves no server behind
    events, plans, state = _together(monkeypatch, tmp_path, slow=("psa",))

    def interrupted(s):
        raise KeyboardInterrupt

    monkeypatch.setattr(run.time, "sleep", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run.StartedTogether(["plain", "psa"], plans, 31000, deadline)
    assert set(state.values()) == {"stopped"}


def test_start_together_sizes_one_pool_for_all_and_refuses_what_the_gpu_cannot_hold(
    monkeypatch, tmp_path
):
    W = workloads.WORKLOADS
    tokens = run.together_tokens([W["a"], W["a16"]])
    need = W["a"].prompts * W["a"].max_request_tokens  # the larger workload's requests
    assert tokens % 1024 == 0 and 1.3 * need <= tokens < 1.3 * need + 1024
    assert run.together_tokens([W["a"]], ["plain", "psa"]) == tokens  # a shares no prefix
    # f: prefix-caching servers hold each document once, plus every request's own tokens,
    # twice over; one server without a prefix cache (the tiered home over SGLang's own
    # radix cache) needs every request whole
    f, keeping = W["f"], ["plain", "plain_fa3", "plain_hicache", "psa", "psa_tiered_prefix"]
    shared = run.together_tokens([f], keeping)
    own = f.max_batch * (max(f.output_tokens) + workloads.TEMPLATE_SLACK)
    assert 2 * (f.documents * max(f.prompt_tokens) + own) <= shared < 2 * (160_000 + own) + 1024
    whole = run.together_tokens([f], [*keeping, "psa_tiered_uva"])
    assert whole == run.together_tokens([f]) and whole >= 1.3 * f.prompts * f.max_request_tokens
    assert not systems.keeps_prefix(systems.SYSTEMS["psa_tiered"])
    g = W["g"]  # every conversation's whole history once
    assert run.together_tokens([g], keeping) >= 2 * g.conversations * max(g.prompt_tokens)
    ctx = _server_ctx(W["a"]) | {"together_tokens": tokens}
    cmd = run.launch("psa", W["a"], ctx, 31000)
    assert run.launch_flags(cmd)["--max-total-tokens"] == str(tokens)
    # its own rendezvous port beside its HTTP port (servers started together are 10 apart)
    assert run.launch_flags(cmd)["--nccl-port"] == "31005"
    capped = _server_ctx(W["b"], cap=systems.KVCap(1000, 10, 1, 2000)) | {"together_tokens": 7}
    assert run.launch_flags(run.launch("plain", W["b"], capped, 1))["--max-total-tokens"] == "1000"
    (tmp_path / "model.safetensors").write_bytes(b"0" * 1024)
    monkeypatch.setattr(run, "gpu_memory_bytes", lambda: 141 * 2**30)  # an H200
    names = ["plain", "plain_fa3", "plain_flashinfer", "topk", "psa"]
    ok = run.check_together_fits(names, tokens, 12_288, 2_000, tmp_path)
    assert "GiB for 5 servers, of 112.8 they may take" in ok  # 0.8 of the GPU: static
    with pytest.raises(SystemExit, match="--start-together: 6 servers"):  # one more: ~113
        run.check_together_fits([*names, "psa_eps1"], tokens, 12_288, 2_000, tmp_path)
    monkeypatch.setattr(run, "gpu_memory_bytes", lambda: 80 * 2**30)  # an H100
    with pytest.raises(SystemExit, match="fewer --systems"):
        run.check_together_fits(names, tokens, 12_288, 2_000, tmp_path)
    monkeypatch.setattr(run, "gpu_memory_bytes", lambda: None)
    assert "not checked" in run.check_together_fits(names, tokens * 3, 12_288, 2_000, tmp_path)


@pytest.mark.slow
def test_a_stage_started_together_measures_every_system_with_one_pool_size(tmp_path):
    """`stage a,a16 --start-together --repeats 2` against fake servers (real processes,
    paused with SIGSTOP and resumed): every system measured twice on both workloads, each
    launch with the same --max-total-tokens, the parts saying so; a run continued without
    the flags (other pool sizes) is refused."""
    base, env = _fake_stage(tmp_path, SMOKE_A, SMOKE_A16)
    out = tmp_path / "out"

    seen: dict[int, set[str]] = {}  # fake server pid -> the process states seen

    def watch(port: int) -> None:
        """Note the state (R, S, T: stopped...) of every fake server of this stage."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
                state = stat.read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if len(cmdline) > 1 and cmdline[1].endswith(b"fake_sglang.py"):  # not the stage
                if any(str(port + 10 * k).encode() in cmdline for k in range(3)):
                    seen.setdefault(int(stat.parent.name), set()).add(state)

    def stage(*extra):
        port = _free_port_pair(3, 10)  # started together: ports 10 apart
        cmd = base + ["--port", str(port), "--export", str(out), *extra]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        with ThreadPoolExecutor(2) as pool:  # drain the pipes while watching
            outs = [pool.submit(proc.stdout.read), pool.submit(proc.stderr.read)]
            t0 = time.time()
            while proc.poll() is None and time.time() - t0 < 300:
                watch(port)
                time.sleep(0.05)
            proc.wait(10)
            return SimpleNamespace(
                returncode=proc.returncode, stdout=outs[0].result(), stderr=outs[1].result()
            )

    first = stage("--systems", "psa,topk", "--start-together", "--repeats", "2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # the three servers were seen, each stopped (paused) for a while and running at others
    assert len(seen) == 3 and all({"T"} < states for states in seen.values()), seen
    assert first.stdout.count("over 2 runs") == 6  # 3 systems x 2 workloads
    assert "started 3 servers together" in first.stdout
    tokens = run.together_tokens([SMOKE_A, SMOKE_A16])
    launches = [ln for ln in first.stdout.splitlines() if "fake_sglang.py --model-path" in ln]
    assert len(launches) == 3 and all(f"--max-total-tokens {tokens}" in ln for ln in launches)
    for name in ("plain", "psa", "topk"):
        assert re.search(rf"{name}: healthy after \d+ s, paused", first.stdout), name
    for path in (out / "parts").glob("*.json"):
        part = json.loads(path.read_text())
        config = part["config"]
        assert config["started_together"] and config["kv_tokens_per_server"] == tokens
        assert set(part["systems"]) == {"plain", "psa", "topk"}
        for name, rec in part["systems"].items():
            assert rec["error"] is None and len(rec["rows"]) == 8, (path.name, name)
            assert len(rec["repeats"]) == 2 and rec["median_of"] in (0, 1)
            assert sorted(rec["started_together_with"]) == sorted({"plain", "psa", "topk"} - {name})
    alone = stage("--systems", "plain_fa3", "--continue-run", "last")
    assert alone.returncode != 0 and "kv_tokens_per_server" in alone.stderr


@pytest.mark.slow
def test_a_stage_of_two_workloads_starts_one_server_per_system(tmp_path):
    """`stage a,a16`: one launch per system, a part per workload with every system, the
    prefix cache flushed between the workloads; `--continue-run last` adds a system to
    both parts (the same run id and part files, plain measured once, comparisons against
    that plain), and a part from another boot or another tree is not continued, naming
    what differs; a capped workload, `--rates` and a second model are refused."""
    base, env = _fake_stage(tmp_path, SMOKE_A, SMOKE_A16)
    out, work = tmp_path / "out", tmp_path / "work"

    def stage(*extra, names=None):
        cmd = base + ["--port", str(_free_port_pair()), "--export", str(out), *extra]
        if names:
            cmd[3] = names
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    def launches(proc):
        return [ln for ln in proc.stdout.splitlines() if "fake_sglang.py --model-path" in ln]

    first = stage("--systems", "psa")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert len(launches(first)) == 2  # plain and psa, each once for both workloads
    for name in ("plain", "psa"):
        assert f"a16/{name}: prefix cache flushed after workload a" in first.stdout
    (pa,) = (out / "parts").glob("a.*.json")
    (pa16,) = (out / "parts").glob("a16.*.json")
    parts = {"a": json.loads(pa.read_text()), "a16": json.loads(pa16.read_text())}
    assert parts["a"]["run_id"] == parts["a16"]["run_id"]
    for key, part in parts.items():
        assert part["workload"] == key and set(part["systems"]) == {"plain", "psa"}
        assert part["config"]["workload"]["prompt_tokens"] == (
            list(SMOKE_A.prompt_tokens) if key == "a" else list(SMOKE_A16.prompt_tokens)
        )
        for name, rec in part["systems"].items():
            assert rec["error"] is None and len(rec["rows"]) == 8, (key, name)
            assert rec["shared_server_with"] == [{"a": "a16", "a16": "a"}[key]]
            assert rec["identical_to_plain"]["compared"] == 8
    for name in ("plain", "psa"):
        assert (
            parts["a"]["systems"][name]["startup_s"] == parts["a16"]["systems"][name]["startup_s"]
        )
    # one log per system for both workloads, the fake's flushes in it
    (log_,) = (work / "logs" / parts["a"]["run_id"]).glob("a+a16-psa.server.log")
    assert "flush_cache:" in log_.read_text()
    smoke = json.loads((work / "serving_smoke.json").read_text())
    assert {p["workload"] for p in smoke["data"]["parts"]} == {"a", "a16"}

    second = stage("--systems", "topk", "--continue-run", "last")
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert len(launches(second)) == 1
    assert sorted(p.name for p in (work / "parts").glob("*.json")) == sorted([pa.name, pa16.name])
    for key, path in (("a", pa), ("a16", pa16)):
        part = json.loads((work / "parts" / path.name).read_text())
        assert set(part["systems"]) == {"plain", "psa", "topk"}, key
        assert part["run_id"] == parts[key]["run_id"] and len(part["continued"]) == 1
        assert part["systems"]["topk"]["identical_to_plain"]["compared"] == 8
        assert "--continue-run" in part["continued"][0]["command"]
        assert part["continued"][0]["source_sha256"] == part["source_sha256"]
    part_file = work / "parts" / pa.name
    run_id = parts["a"]["run_id"]
    part = json.loads(part_file.read_text())
    part["boot_id"] = "another-boot"
    part_file.write_text(json.dumps(part))
    other_boot = stage("--systems", "plain_fa3", "--continue-run", run_id)
    assert other_boot.returncode != 0 and "boot_id" in other_boot.stderr
    assert not launches(other_boot)
    # another tree under the same commit (a GIT_COMMIT given by hand) is not this run
    part["boot_id"], part["source_sha256"] = run.boot_id(), "another-tree"
    part_file.write_text(json.dumps(part))
    other_tree = stage("--systems", "plain_fa3", "--continue-run", run_id)
    assert other_tree.returncode != 0 and "source_sha256" in other_tree.stderr

    capped = stage("--systems", "psa", names="a,b")
    assert capped.returncode != 0 and not launches(capped)
    assert "workloads a and b cannot share a server" in capped.stderr
    assert "--max-total-tokens" in capped.stderr
    rates = stage("--rates", "1", names="a,a16")
    assert rates.returncode != 0 and "--rates" in rates.stderr and not launches(rates)
    model = stage(names="a,d")
    assert model.returncode != 0 and "different models" in model.stderr


@pytest.mark.slow
def test_a_stage_at_tp_2_launches_every_server_so_and_keeps_its_own_result(tmp_path):
    """`--tp 2`: every system's server at `--tp-size 2`, the part says so; a continued run
    at another `--tp` and a merge of parts at different `--tp` are refused. `--prompts`
    sets the requests per run, recorded in the part's workload."""
    base, env = _fake_stage(tmp_path, SMOKE_A)
    out = tmp_path / "out"

    def stage(*extra):
        cmd = base + ["--port", str(_free_port_pair()), "--export", str(out), *extra]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)

    first = stage("--systems", "psa", "--tp", "2", "--prompts", "3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    launched = [ln for ln in first.stdout.splitlines() if "fake_sglang.py --model-path" in ln]
    assert len(launched) == 2 and all("--tp-size 2" in ln for ln in launched), launched
    (pa,) = (out / "parts").glob("a.*.json")
    got = json.loads(pa.read_text())
    assert got["config"]["tp"] == 2 and got["config"]["workload"]["prompts"] == 3 != SMOKE_A.prompts
    assert all(rec["num_prompts"] == 3 for rec in got["systems"].values())
    again = stage("--systems", "topk", "--continue-run", "last")  # at --tp 1
    assert again.returncode != 0 and "tp" in again.stderr
    one = dict(json.loads(pa.read_text()), run_id="another")
    one["config"] = dict(one["config"], tp=1)
    (tmp_path / "tp1.json").write_text(json.dumps(one))
    merged = subprocess.run(
        [sys.executable, "benchmark/serving/run.py", "merge", str(pa), str(tmp_path / "tp1.json"),
         "--out", str(tmp_path / "mixed.json")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert merged.returncode != 0 and "different --tp" in merged.stderr
    assert not (tmp_path / "mixed.json").exists()


# --- 8. where a decode step's GPU time goes (--profile-decode) -------------------------


def _trace(path, events):
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _ev(cat, name, ts, dur):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_kernel_profile_divides_by_graph_steps_and_counts_overlap_once(tmp_path):
    events = []
    for i in range(4):  # 4 graph-replayed steps of 100 us
        t = 100.0 * i
        events += [
            _ev("cuda_runtime", "cudaGraphLaunch", t, 3.0),
            _ev("cuda_runtime", "cudaLaunchKernel", t, 3.0),  # not a GPU event
            _ev("kernel", "gemm" + "<T>" * 100, t, 40.0),
            _ev("kernel", "attention", t + 40, 20.0),
            _ev("kernel", "writeback", t + 50, 20.0),  # on a side stream: 10 us overlap
            _ev("gpu_memcpy", "Memcpy DtoH", t + 70, 5.0),
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": t},  # not a span
        ]
    prof = analysis.kernel_profile([_trace(tmp_path / "t.trace.json.gz", events)], 99, top=2)
    assert prof["steps"] == 4 and prof["steps_from"] == "graph launches"
    assert prof["kernel_us"] == pytest.approx(85.0)  # 40 + 20 + 20 + 5
    assert prof["busy_us"] == pytest.approx(75.0)  # 0-70 and 70-75
    assert prof["span_us"] == pytest.approx((300 + 75) / 4)
    names = [k["name"] for k in prof["kernels"]]
    assert names[0].startswith("gemm") and len(names[0]) == analysis.KERNEL_NAME_CHARS
    assert [k["us"] for k in prof["kernels"]] == [40.0, 20.0]
    assert all(k["launches"] == 1.0 for k in prof["kernels"])
    assert prof["other_us"] == pytest.approx(25.0)  # the other 20 us kernel and the copy


def test_kernel_profile_of_eager_steps_uses_the_requested_count_and_needs_gpu_events(tmp_path):
    events = [_ev("kernel", "k", 10.0 * i, 4.0) for i in range(6)]
    plain = tmp_path / "t.trace.json"
    plain.write_text(json.dumps({"traceEvents": events}))
    prof = analysis.kernel_profile([plain], 3)
    assert prof["steps"] == 3 and prof["steps_from"] == "requested"
    assert prof["kernel_us"] == pytest.approx(8.0)
    with pytest.raises(ValueError, match="no GPU events"):
        analysis.kernel_profile([_trace(tmp_path / "cpu.json.gz", [_ev("cpu_op", "x", 0, 1)])], 3)


@pytest.mark.slow
def test_profile_summary_pairs_gpu_time_with_the_same_commits_unperturbed_steps():
    """GPU time per step from a profiled run, against the steady steps of the newest stage
    run of the same workload at the same commit (never another commit's), the reference
    being the plain backend with the highest throughput there."""

    def prof(busy_us):
        return {"decode_profile": {"busy_us": busy_us, "kernels": []}}

    profiled = {
        **_part("a16", "05-01", "c9", plain=prof(4000.0), plain_fa3=prof(2500.0)),
        "profiled": 16,
    }
    profiled["systems"]["topk"] = prof(1500.0)

    def timed(step, tok_s, host_ms=None, wait_ms=None, batch=32):
        rec = _rec(step, tok_s)
        rec["metrics"]["steady_decode"]["batch"] = batch
        if host_ms is not None:  # the scheduler's host timing at two batch sizes
            rec["host_loop"] = {
                str(batch): {"host_ms": host_ms, "gpu_wait_ms": wait_ms},
                str(batch // 2): {"host_ms": 99.0, "gpu_wait_ms": 0.0},
            }
        return rec

    parts = [
        _part("a16", "04-01", "c9", plain=_rec(9.0, 1), plain_fa3=_rec(9.0, 2), topk=_rec(9.0, 3)),
        _part("a16", "04-02", "c9", plain=timed(4.5, 10), plain_fa3=timed(3.0, 20, 1.6, 1.3),
              topk=timed(2.0, 30, 2.0, 0.01)),
        _part("a16", "04-03", "c8", plain=_rec(1.0, 10), plain_fa3=_rec(1.0, 20), topk=_rec(1.0, 30)),
    ]  # fmt: skip
    summary, pairs = analysis.profile_summary([profiled], parts)
    assert summary["gpu_busy_ms_topk_a16"] == 1.5 and summary["step_ms_topk_a16"] == 2.0
    assert summary["gpu_idle_ms_topk_a16"] == pytest.approx(0.5)
    assert summary["gpu_busy_ratio_topk_vs_plain_fa3_a16"] == pytest.approx(1.5 / 2.5)
    assert summary["gpu_busy_vs_step_topk_vs_plain_fa3_a16"] == pytest.approx(1.5 / 3.0)
    assert "gpu_busy_ratio_plain_vs_plain_fa3_a16" not in summary  # plain is no sparse system
    assert pairs[0]["serving_run_id"] == "a16-04-02" and pairs[0]["reference"] == "plain_fa3"
    assert pairs[0]["plain_raced"] == ["plain", "plain_fa3"]
    # the host loop at each system's steady batch; none where the run did not time it
    assert summary["host_ms_topk_a16"] == 2.0 and summary["gpu_wait_ms_topk_a16"] == 0.01
    assert summary["host_ms_plain_fa3_a16"] == 1.6 and "host_ms_plain_a16" not in summary
    # the reference is the run's fastest plain even when the profile did not include it
    del profiled["systems"]["plain_fa3"]
    summary, pairs = analysis.profile_summary([profiled], parts)
    assert pairs[0]["reference"] == "plain_fa3"
    assert summary["gpu_busy_vs_step_topk_vs_plain_fa3_a16"] == pytest.approx(1.5 / 3.0)
    assert "gpu_busy_ratio_topk_vs_plain_fa3_a16" not in summary  # FA3's GPU time unknown
    assert pairs[0]["reference_by"].startswith("highest output throughput")
    # no run of the profile's commit: GPU time only, against the profiled plain with the least
    profiled["systems"]["plain_flashinfer"] = prof(3000.0)
    summary, pairs = analysis.profile_summary([profiled], parts[2:])
    assert summary == {
        "gpu_busy_ms_plain_a16": 4.0,
        "gpu_busy_ms_plain_flashinfer_a16": 3.0,
        "gpu_busy_ms_topk_a16": 1.5,
        "gpu_busy_ratio_topk_vs_plain_flashinfer_a16": pytest.approx(0.5),
    }
    assert pairs[0]["serving_run_id"] is None and pairs[0]["reference"] == "plain_flashinfer"
    assert pairs[0]["reference_by"].startswith("least GPU time")


def test_stage_profile_decode_smoke_records_a_kernel_table_and_stays_out_of_results(tmp_path):
    # two workloads on one server start per system, each timed run profiled in turn;
    # decoding outlasts the driver's log poll
    cmd, env = _fake_stage(tmp_path, SMOKE_A, SMOKE_A16, FAKE_SGLANG_STEP_S="0.02")
    work, out = tmp_path / "work", tmp_path / "out"
    cmd += ["--export", str(out), "--systems", "psa", "--profile-decode", "5"]
    cmd += ["--port", str(_free_port_pair())]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    (part_file,) = (out / "parts").glob("a.*.json")
    (part16,) = (out / "parts").glob("a16.*.json")
    parts = [json.loads(f.read_text()) for f in (part_file, part16)]
    for p in parts:
        assert p["profiled"] == 5
        for name in ("plain", "psa"):
            prof = p["systems"][name]["decode_profile"]
            assert prof["steps"] == 5 and prof["steps_from"] == "graph launches", name
            assert [k["name"] for k in prof["kernels"]] == ["fake_gemm", "fake_attention_kernel"]
            assert prof["busy_us"] == pytest.approx(80.0)
            assert prof["span_us"] == pytest.approx(96.0)
    assert (work / "serving_profile.json").exists()
    assert not (work / "serving_smoke.json").exists()
    # `merge` keeps such a part out of a result
    merged = subprocess.run(
        [sys.executable, "benchmark/serving/run.py", "merge", str(part_file)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert merged.returncode != 0 and "diagnosis, not results" in merged.stderr


def test_a_results_commit_is_checked_to_be_the_tree_that_ran(tmp_path):
    """`source_digest` of a tree equals `commit_digest` of the commit it was checked out
    from, and differs once a source file changes: a part that ran an edited tree is not
    verified against its commit."""
    import subprocess

    from sglang_psa.eval.results import commit_digest, source_digest, tree_verified

    def git(*a):
        return subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip

    (tmp_path / "benchmark").mkdir()
    (tmp_path / "python/sglang_psa").mkdir(parents=True)
    (tmp_path / "benchmark/run.py").write_text("x = 1\n")
    (tmp_path / "python/sglang_psa/a.py").write_text("y = 2\n")
    (tmp_path / "README.md").write_text("not a source\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD")
    ran = source_digest(tmp_path)
    assert commit_digest(tmp_path, head) == ran
    assert tree_verified(tmp_path, head, ran) is True
    (tmp_path / "README.md").write_text("docs change nothing\n")
    assert source_digest(tmp_path) == ran
    (tmp_path / "python/sglang_psa/a.py").write_text("y = 3\n")
    assert tree_verified(tmp_path, head, source_digest(tmp_path)) is False
    assert tree_verified(tmp_path, head, None) is None


# --- 9. prefix caching: shared documents (f) and multi-turn chat (g) -------------------

SMOKE_F = workloads.smoke(workloads.WORKLOADS["f"])
SMOKE_G = workloads.smoke(workloads.WORKLOADS["g"])


def test_chat_turns_text_starts_each_continuation_with_the_prompt_before(word_tok):
    from sglang_psa.eval.tasks import chat_text, chat_turns_text

    turns = ["Read this text.\n\nWhat is 1?", "1234567", "More text.\n\nWhere?", "Oslo", "And?"]
    templated = SimpleNamespace(
        chat_template="{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>"
        "\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        apply_chat_template=lambda msgs, **kw: word_tok.apply_chat_template(
            msgs, chat_template=templated.chat_template, **kw
        ),
    )
    for tok in (word_tok, templated):
        prompts = [chat_turns_text(tok, turns[: 2 * k + 1]) for k in range(3)]
        for before, after in zip(prompts, prompts[1:]):
            assert after.startswith(before) and len(after) > len(before)
        assert "1234567" in prompts[1] and prompts[2].count("Oslo") == 1
        assert chat_text(tok, "Read this text.", "What is 1?") == prompts[0]
    assert prompts[0].endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="ends with a user message"):
        chat_turns_text(word_tok, turns[:2])


@pytest.mark.parametrize("real", [False, True], ids=["counter", "tokenizer"])
def test_shared_documents_are_byte_identical_across_their_questions(real, word_tok, tmp_path):
    w = SMOKE_F
    tok = word_tok if real else fake_sglang.WordCounter()
    rows = workloads.build_rows(w, tok)
    assert (w.documents, len(rows)) == (2, 8)
    again = workloads.build_rows(w, tok)
    assert again == rows  # seeded: the same prompts, answers and output lengths
    lens = [r.prompt_len for r in rows]
    assert len(set(lens)) == len(lens)  # the dataset contract: distinct token counts
    for r in rows:
        assert r.prompt_len == len(tok.encode(r.prompt)) and r.output_len in w.output_tokens
        assert r.prompt_len <= w.prompt_tokens[0] + workloads.TEMPLATE_SLACK
        assert r.kind in w.kinds and r.turn is None
        assert all(a in r.prompt for a in r.answers) or r.kind == "person_city"
    docs = {}
    for r in rows:
        docs.setdefault(r.group, []).append(r)
    assert sorted(docs) == [0, 1] and all(len(q) == 4 for q in docs.values())
    shared = {}
    for d, asked in docs.items():
        prefix = os.path.commonprefix([r.prompt for r in asked])
        # the whole document is the prompts' common start; what follows is a question
        assert prefix.count("A long text is given below") == 1
        for r in asked:
            assert len(tok.encode(r.prompt[len(prefix) :])) < 64
        assert len({r.prompt[len(prefix) :].split("\n\n")[-1] for r in asked}) == 4
        shared[d] = prefix
    # two documents share no more than the instruction that opens each
    assert len(os.path.commonprefix(list(shared.values()))) < 100
    path = workloads.write_dataset(rows, tok, tmp_path / "f.jsonl")
    assert workloads.load_rows(path) == rows
    assert workloads.load_meta(path)[rows[0].prompt_len]["group"] == 0


def _growth_bounds(w, c, t):
    """Where turn t of conversation c may land: its target less the spacing, within the
    template slack."""
    first, last = w.prompt_tokens[0], w.prompt_tokens[-1]
    target = first + t * (last - first) / (w.turns - 1) - workloads.GROUP_SPACING * c
    return target - workloads.TEMPLATE_SLACK, target + workloads.TEMPLATE_SLACK


@pytest.mark.parametrize("real", [False, True], ids=["counter", "tokenizer"])
def test_chat_histories_grow_turn_over_turn(real, word_tok, tmp_path):
    w = SMOKE_G
    tok = word_tok if real else fake_sglang.WordCounter()
    rows = workloads.build_rows(w, tok)
    assert workloads.build_rows(w, tok) == rows
    convs = workloads.conversations(rows)
    assert [[r.turn for r in c] for c in convs] == [[0, 1, 2, 3]] * 2
    assert len({r.prompt_len for r in rows}) == len(rows)
    for c, turns in enumerate(convs):
        for t, r in enumerate(turns):
            lo, hi = _growth_bounds(w, c, t)
            assert lo <= r.prompt_len <= hi, (c, t, r.prompt_len)
            assert r.prompt_len == len(tok.encode(r.prompt)) and r.group == c
        for before, after in zip(turns, turns[1:]):
            # the whole history, the scripted (right) answer, then the new message
            assert after.prompt.startswith(before.prompt + " " + before.answers[0])
            assert 0.5 * w.think_s <= after.wait_s <= 1.5 * w.think_s
        assert turns[0].wait_s == 0.0
        # odd turns ask about the first document, far back in the history
        assert [r.kind for r in turns] == ["magic_number", "person_city"] * 2
    path = workloads.write_dataset(rows, tok, tmp_path / "g.jsonl")
    assert workloads.load_rows(path) == rows


def test_full_size_chat_reaches_28k():
    w = workloads.WORKLOADS["g"]
    rows = workloads.build_rows(w, fake_sglang.WordCounter())
    convs = workloads.conversations(rows)
    assert len(convs) == w.conversations == 16 and len(rows) == 80
    for c, turns in enumerate(convs):
        for t, r in enumerate(turns):
            lo, hi = _growth_bounds(w, c, t)
            assert lo <= r.prompt_len <= hi, (c, t, r.prompt_len)
    assert max(r.prompt_len for r in rows) > 27_500 and min(r.prompt_len for r in rows) > 14_500


def test_prefix_workloads_and_their_caps():
    W, S = workloads.WORKLOADS, systems.SYSTEMS
    for key in ("f", "f_capped", "g", "g_capped"):
        w = W[key]
        # plain at each backend and with its own host tier, sglang-psa at both KV homes
        both_homes = {"psa", "psa_tiered_prefix"}
        assert set(systems.PLAIN_RACE) | set(systems.HICACHE_RACE) | both_homes == set(w.systems), (
            key
        )
        assert systems.keeps_prefix(S["psa_tiered_prefix"])
        assert not systems.keeps_prefix(S["psa_tiered_uva"])
        assert w.is_sweep and len(w.rates) == 1  # arrivals over time, at one rate
        for name in systems.HICACHE_RACE:
            assert S[name].flags[0] == "--enable-hierarchical-cache"
    assert (W["f"].documents, W["f"].prompts // W["f"].documents) == (10, 12)
    assert (W["g"].conversations, W["g"].turns, W["g"].max_batch) == (16, 5, 16)
    for key in ("f_capped", "g_capped"):
        w = W[key]
        cap = w.kv_cap_requests * w.max_request_tokens
        # the issue's bar: the prefix set at least 4x the HBM for KV
        assert w.prefix_set_tokens >= 4 * cap, key
        assert W[key.removesuffix("_capped")].kv_cap_requests is None
        assert w.host_requests * w.max_request_tokens > cap
    for key in ("f", "g"):  # a capped variant sends the same prompts, at the same times
        capped = workloads.smoke(W[key + "_capped"])
        counter = fake_sglang.WordCounter()
        assert workloads.build_rows(capped, counter) == workloads.build_rows(
            workloads.smoke(W[key]), counter
        )
    assert workloads.conversation_starts(W["g_capped"], 2.0) == workloads.conversation_starts(
        W["g"], 2.0
    )
    s = workloads.smoke(W["g_capped"])
    assert (s.conversations, s.turns, s.prompts) == (2, 4, 8)
    assert s.think_s == W["g"].think_s / 16 and s.kv_cap_requests == 3


def test_conversation_starts_are_seeded_poisson_arrivals():
    w = workloads.WORKLOADS["g"]
    starts = workloads.conversation_starts(w, 2.0)
    assert starts == workloads.conversation_starts(w, 2.0) and starts[0] == 0.0
    assert len(starts) == 16 and starts == sorted(starts) and len(set(starts)) == 16
    assert 2.0 < starts[-1] < 20.0  # 15 gaps of 0.5 s on average
    assert workloads.conversation_starts(w, 4.0) != starts
    assert workloads.conversation_starts(w, float("inf")) == [0.0] * 16


def _turn(c, t, wait=0.0, n=10):
    return workloads.Row(f"c{c}t{t}", 1000 * c + t, n, "k", ("a",), 4, c, t, wait)


def test_run_chat_sends_turn_k_plus_1_only_after_turn_k_returned():
    import threading
    import time

    import driver

    events, lock = [], threading.Lock()

    def send(url, prompt, n, timeout):
        with lock:
            events.append(("sent", prompt, time.perf_counter()))
        time.sleep(0.03 if prompt.endswith("t0") else 0.01)  # a first turn answers slowest
        with lock:
            events.append(("returned", prompt, time.perf_counter()))
        error = "HTTP 500: boom" if prompt == "c2t1" else None
        return {"ttft": 0.005, "itl": [0.001] * (n - 1), "text": "x " * n, "output_len": n,
                "cached_tokens": 7, "error": error}  # fmt: skip

    convs = [[_turn(c, t, wait=0.02 * t) for t in range(3)] for c in range(3)]
    bench = driver.run_chat("http://fake", convs, [0.0, 0.0, 0.01], time.time() + 60, send)
    at = {(kind, p): when for kind, p, when in events}
    for c in range(2):
        for t in range(2):
            gap = at[("sent", f"c{c}t{t + 1}")] - at[("returned", f"c{c}t{t}")]
            assert gap >= convs[c][t + 1].wait_s - 1e-3, (c, t, gap)
    # a failed turn ends its conversation: the turn after it is never sent
    assert ("sent", "c2t2") not in at and bench["errors"][-1] == "not sent: turn 1 failed"
    assert bench["errors"][-2] == "HTTP 500: boom" and bench["sent_s"][-1] is None
    assert bench["input_lens"] == [r.prompt_len for c in convs for r in c]
    assert bench["completed"] == 7 and bench["cached_tokens"][0] == 7
    assert bench["max_concurrent_requests"] == 3  # the three conversations' first turns
    sent, back = bench["sent_s"], bench["returned_s"]
    assert all(sent[i + 1] >= back[i] for i in (0, 1, 3, 4))  # recorded in the same order
    assert bench["output_throughput"] == pytest.approx(70 / bench["duration"])
    # had every answer come at once: the last start plus its conversation's think times
    assert bench["idle_duration"] == pytest.approx(0.07)  # conversation 2: 0.01 + 0.06
    assert bench["idle_duration"] < bench["duration"]
    with pytest.raises(driver.ServerFailed, match="time budget"):
        driver.run_chat("http://fake", convs, [0.0] * 3, time.time() - 1, send)


def test_per_request_and_metrics_keep_cached_tokens_and_turns():
    meta = {
        500: {"kind": "magic_number", "answers": ["1234567"], "group": 0, "turn": 0},
        900: {"kind": "person_city", "answers": ["Oslo"], "group": 0, "turn": 1},
        600: {"kind": "magic_number", "answers": ["7654321"], "group": 1, "turn": 0},
    }
    bench = {
        "input_lens": [500, 900, 600],
        "output_lens": [2, 2, 2],
        "ttfts": [0.4, 0.1, 0.6],
        "itls": [[0.01], [0.01], [0.01]],
        "generated_texts": ["1234567 x", "Oslo x", "x x"],
        "errors": ["", "", ""],
        "cached_tokens": [0, 480, 100],
        "sent_s": [0.0, 1.0, 0.2],
        "returned_s": [0.5, 1.2, 0.9],
        "duration": 1.2,
        "output_throughput": 5.0,
        "request_throughput": 2.5,
        "input_throughput": 1666.7,
    }
    rows = analysis.per_request(
        bench, meta, lambda text, task: task["answers"][0] in text, lambda t: [len(t)]
    )
    assert [(r["group"], r["turn"], r["cached_tokens"]) for r in rows] == [
        (0, 0, 0),
        (0, 1, 480),
        (1, 0, 100),
    ]
    assert rows[1]["sent_s"] == 1.0 and rows[1]["returned_s"] == 1.2
    m = analysis.run_metrics(bench, rows, [], None)
    assert m["prefix_cache"] == {
        "prompt_tokens": 2000,
        "cached_tokens": 580,
        "hit_fraction": 0.29,
    }
    assert m["ttft_by_turn"]["0"]["mean"] == pytest.approx(0.5)
    assert m["ttft_by_turn"]["1"]["p50"] == pytest.approx(0.1)
    assert m["accuracy"] == pytest.approx(2 / 3)
    assert "output_tok_s_ceiling" not in m  # no chat's idle duration: no ceiling
    bench["idle_duration"] = 0.8
    ceiling = analysis.run_metrics(bench, rows, [], None)["output_tok_s_ceiling"]
    assert ceiling == pytest.approx(6 / 0.8)  # the answered requests' outputs
    del bench["idle_duration"]
    # a client that reports no cached tokens (or a workload without turns): no figure
    del bench["cached_tokens"]
    meta = {n: {k: v for k, v in t.items() if k != "turn"} for n, t in meta.items()}
    rows = analysis.per_request(bench, meta, lambda *a: True, lambda t: [])
    plain = analysis.run_metrics(bench, rows, [], None)
    assert plain["prefix_cache"] is None and "ttft_by_turn" not in plain


def _at(rate, tok_s, mean=1.0, hit=None):
    """A system's record of one timed run at `rate` (requests arriving over time); its
    median time per output token is `mean` / 100."""
    cache = None if hit is None else {"prompt_tokens": 100, "cached_tokens": 100 * hit,
                                      "hit_fraction": hit}  # fmt: skip
    metrics = {"output_tok_s": tok_s, "ttft_s": {"mean": mean, "p99": 2 * mean},
               "tpot_s": {"p50": mean / 100}, "steady_decode": {"step_ms": None},
               "prefix_cache": cache}  # fmt: skip
    return {"error": None, "rates": {rate: {"metrics": metrics, "rows": []}}}


def _prefix_run(workload, date, rate="16", tiered=300.0, hicache=200.0, **over):
    """A stage run of f or g with its default systems: fa3 the fastest plain backend."""
    systems_ = {
        "plain": _at(rate, 100.0, 4.0, 0.5),
        "plain_fa3": _at(rate, 150.0, 2.0, 0.75),
        "plain_flashinfer": _at(rate, 120.0, 3.0, 0.75),
        "plain_hicache": _at(rate, hicache, 1.5, 0.9),
        "psa": _at(rate, 140.0, 2.5, 0.7),
        "psa_tiered_uva": _at(rate, tiered, 1.0, 0.1),
    }
    systems_.update(over)
    return _part(workload, date, "c9", **{k: v for k, v in systems_.items() if v is not None})


PREFIX_SUMMARY = [k for k, *_ in analysis.PREFIX_KEYS] + [k for k, *_ in analysis.HIT_KEYS]


def test_prefix_summary_keys_pair_two_systems_of_one_stage_run():
    assert set(PREFIX_SUMMARY) <= set(analysis.SUMMARY_KEYS)
    parts = [
        _prefix_run("f", "06-01"),
        _prefix_run("f_capped", "06-02", tiered=450.0, hicache=300.0),
        _prefix_run("g", "06-03", rate="2"),
        _prefix_run("g_capped", "06-04", rate="2", tiered=330.0, hicache=220.0),
        _prefix_run("b", "06-05", rate="inf", tiered=450.0, psa=None),
        # b256 with FlashInfer not raced: no fastest plain backend, no ratio (below) ...
        _prefix_run("b256", "06-06", rate="inf", tiered=600.0, psa=None, plain_flashinfer=None),
    ]
    merged = analysis.merge(parts)
    s, where = merged["summary"], merged["summary_provenance"]
    assert s["throughput_ratio_tiered_vs_fastest_capped"] == 3.0  # 450 / fa3's 150
    assert s["throughput_ratio_tiered_vs_fastest_capped_short"] is None
    # ... and with the race complete, fa3's run is the reference
    parts.append(_prefix_run("b256", "06-07", rate="inf", tiered=225.0, psa=None))
    merged = analysis.merge(parts)
    s, where = merged["summary"], merged["summary_provenance"]
    assert s["throughput_ratio_tiered_vs_fastest_capped_short"] == 1.5
    assert where["throughput_ratio_tiered_vs_fastest_capped_short"]["run_id"] == "b256-06-07"
    assert s["throughput_ratio_tiered_vs_fastest_shared"] == 2.0  # 300 / fa3's 150
    assert s["throughput_ratio_tiered_vs_fastest_shared_capped"] == 3.0
    assert s["throughput_ratio_tiered_vs_hicache_shared_capped"] == 1.5
    assert s["throughput_ratio_tiered_vs_fastest_chat"] == 2.0
    assert s["throughput_ratio_tiered_vs_fastest_chat_capped"] == pytest.approx(2.2)
    assert s["throughput_ratio_tiered_vs_hicache_chat_capped"] == 1.5
    assert s["ttft_ratio_tiered_vs_fastest_chat"] == 0.5  # mean TTFT 1.0 / 2.0
    assert s["ttft_ratio_tiered_vs_fastest_shared"] == 0.5
    assert s["tpot_ratio_tiered_vs_fastest_shared"] == pytest.approx(0.5)  # 0.01 / 0.02
    assert where["tpot_ratio_tiered_vs_fastest_shared"]["metric"] == "tpot_s.p50"
    assert s["prefix_hit_fraction_tiered_shared"] == 0.1
    assert s["prefix_hit_fraction_fastest_shared"] == 0.75
    assert s["prefix_hit_fraction_tiered_chat"] == 0.1
    w = where["throughput_ratio_tiered_vs_hicache_shared_capped"]
    assert (w["workload"], w["run_id"], w["rate"]) == ("f_capped", "f_capped-06-02", "16")
    assert w["systems"] == ["psa_tiered_uva", "plain_hicache"]
    assert where["throughput_ratio_tiered_vs_fastest_chat"]["systems"] == [
        "psa_tiered_uva",
        "plain_fa3",
    ]
    hit = where["prefix_hit_fraction_fastest_shared"]
    assert (hit["of"], hit["run_id"], hit["metric"]) == (
        "plain_fa3",
        "f-06-01",
        "prefix_cache.hit_fraction",
    )
    assert all(s[k] is not None for k in PREFIX_SUMMARY)
    assert {k for k in PREFIX_SUMMARY} <= set(where)
    # A run that measured the tiered home with its prefix cache too: that one is the tiered
    # home of the prefix keys (without it the home keeps no prefix)
    parts.append(_prefix_run("f", "06-08", psa_tiered_prefix=_at("16", 450.0, 0.5, 0.8)))
    merged = analysis.merge(parts)
    s, where = merged["summary"], merged["summary_provenance"]
    assert s["throughput_ratio_tiered_vs_fastest_shared"] == 3.0  # 450 / fa3's 150
    assert s["prefix_hit_fraction_tiered_shared"] == 0.8
    assert where["throughput_ratio_tiered_vs_fastest_shared"]["systems"] == [
        "psa_tiered_prefix",
        "plain_fa3",
    ]
    # SGLang's host tier at FA3 too: the faster of the two is the reference
    parts.append(_prefix_run("g_capped", "06-09", rate="2", plain_hicache_fa3=_at("2", 264.0)))
    parts.append(_prefix_run("f_capped", "06-10", plain_hicache_fa3=_at("16", 150.0)))
    s, where = analysis.summarize(parts)
    assert s["throughput_ratio_tiered_vs_hicache_chat_capped"] == pytest.approx(300 / 264)
    assert where["throughput_ratio_tiered_vs_hicache_chat_capped"]["systems"] == [
        "psa_tiered_uva",
        "plain_hicache_fa3",
    ]
    assert s["throughput_ratio_tiered_vs_hicache_shared_capped"] == 1.5  # triton's 200 won
    assert where["throughput_ratio_tiered_vs_hicache_shared_capped"]["systems"][1] == (
        "plain_hicache"
    )


def test_chat_ceiling_keys_take_the_tiered_runs_ceiling_over_the_reference():
    """What bounds a chat's throughput keys: the tiered run's ceiling (its output over the
    idle duration) over the fastest plain backend's and the host tier's output tok/s, in
    the run of the matching throughput key; none without a ceiling recorded."""
    keys = [k for k, *_ in analysis.CEILING_KEYS]
    assert set(keys) <= set(analysis.SUMMARY_KEYS)
    tiered = _at("2", 330.0)
    tiered["rates"]["2"]["metrics"]["output_tok_s_ceiling"] = 450.0
    old = _prefix_run("g_capped", "06-01", rate="2", psa_tiered_uva=_at("2", 300.0))
    parts = [old, _prefix_run("g_capped", "06-04", rate="2", psa_tiered_uva=tiered)]
    s, where = analysis.summarize(parts)
    assert s["throughput_ceiling_ratio_vs_fastest_chat_capped"] == 3.0  # 450 / fa3's 150
    assert s["throughput_ceiling_ratio_vs_hicache_chat_capped"] == 2.25  # / hicache's 200
    w = where["throughput_ceiling_ratio_vs_fastest_chat_capped"]
    assert w["run_id"] == "g_capped-06-04" and w["systems"] == ["psa_tiered_uva", "plain_fa3"]
    assert s["throughput_ceiling_ratio_vs_fastest_chat"] is None  # no g run
    # the newest run recorded no ceiling (a run from before it was kept): no value
    s, where = analysis.summarize([parts[1], _prefix_run("g_capped", "06-05", rate="2")])
    assert s["throughput_ceiling_ratio_vs_fastest_chat_capped"] is None
    assert "throughput_ceiling_ratio_vs_fastest_chat_capped" not in where


def test_prefix_summary_keys_have_no_value_across_stage_runs():
    """The tiered home and its reference measured in different stage runs, at different
    rates, or without the plain race: no value and no provenance."""
    apart = [
        _prefix_run("f", "06-01", psa_tiered_uva=None),  # the race, no tiered home
        _prefix_run("f", "06-05", plain_fa3=None, plain_flashinfer=None),  # no race
        _prefix_run("f_capped", "06-02", plain_hicache=None),
        _prefix_run("f_capped", "06-06", psa_tiered_uva=None),
        # the tiered home at another rate than the race
        _prefix_run("g", "06-03", rate="2", psa_tiered_uva=None),
    ]
    apart[-1]["systems"]["psa_tiered_uva"] = _at("4", 300.0, 1.0, 0.1)
    s, where = analysis.summarize(apart)
    for k in (
        "throughput_ratio_tiered_vs_fastest_shared",
        "throughput_ratio_tiered_vs_hicache_shared_capped",
        "throughput_ratio_tiered_vs_fastest_chat",
        "ttft_ratio_tiered_vs_fastest_chat",
        "ttft_ratio_tiered_vs_fastest_shared",
        "tpot_ratio_tiered_vs_fastest_shared",
        "prefix_hit_fraction_tiered_shared",
        "prefix_hit_fraction_fastest_shared",
        "prefix_hit_fraction_tiered_chat",
    ):
        assert s[k] is None and k not in where, k
    # f_capped 06-02 raced the plain backends and measured the tiered home: paired there
    assert s["throughput_ratio_tiered_vs_fastest_shared_capped"] == 2.0
    # the copy-engine write-back stands in for the uva one when only it ran
    engine = _prefix_run("f", "06-07", psa_tiered_uva=None, psa_tiered=_at("16", 75.0))
    s, where = analysis.summarize(apart + [engine])
    assert s["throughput_ratio_tiered_vs_fastest_shared"] == 0.5
    assert where["throughput_ratio_tiered_vs_fastest_shared"]["systems"][0] == "psa_tiered"
    assert s["prefix_hit_fraction_tiered_shared"] is None  # it reported no cached tokens
    assert s["prefix_hit_fraction_fastest_shared"] == 0.75


@pytest.mark.slow
def test_stage_g_smoke_end_to_end(tmp_path):
    """The chat driver against the fake server: every turn answered, sent only after the
    turn before returned, the history's prefix served from the (fake) prefix cache."""
    cmd, env = _fake_stage(tmp_path, SMOKE_G)
    out = tmp_path / "out"
    cmd += ["--export", str(out), "--port", str(_free_port_pair()), "--systems", "psa"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (part_file,) = (out / "parts").glob("g.*.json")
    part = json.loads(part_file.read_text())
    (rate,) = {f"{r:g}" for r in SMOKE_G.rates}
    for name in ("plain", "psa"):
        run_ = part["systems"][name]["rates"][rate]
        got, m = run_["rows"], run_["metrics"]
        assert len(got) == SMOKE_G.prompts and m["failed"] == 0, name
        assert set(m["ttft_by_turn"]) == {"0", "1", "2", "3"}
        by_conv = {}
        for r in got:
            by_conv.setdefault(r["group"], {})[r["turn"]] = r
        for turns in by_conv.values():
            for t in range(1, 4):
                assert turns[t]["sent_s"] >= turns[t - 1]["returned_s"]
                # the whole history before this turn came from the cache
                assert turns[t]["cached_tokens"] >= turns[t - 1]["prompt_len"] - 1
            assert turns[0]["cached_tokens"] < turns[0]["prompt_len"] // 2
        assert 0.5 < m["prefix_cache"]["hit_fraction"] < 1.0
    same = part["systems"]["psa"]["rates"][rate]["identical_to_plain"]
    assert same["compared"] == SMOKE_G.prompts and same["identical"] == 1.0


def test_the_client_gets_the_last_physical_cores_and_the_server_the_rest():
    smt = {c: f"0/{c % 8}" for c in range(16)}  # 8 cores, CPUs c and c + 8 siblings
    got = machine_samples.split_cpus(2, smt, set(range(16)))
    assert got == {"server": [0, 1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13], "client": [6, 7, 14, 15]}
    assert machine_samples.split_cpus(2, {}, set(range(8))) == {
        "server": list(range(6)),
        "client": [6, 7],
    }
    assert machine_samples.split_cpus(2, smt, {0, 1, 2, 8, 9, 10, 11}) is None  # 4 cores: too few
    assert machine_samples.split_cpus(0, smt, set(range(16))) is None


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_a_server_with_cpus_runs_on_them_and_the_stage_keeps_its_own(tmp_path):
    mine = os.sched_getaffinity(0)
    one = [min(mine)]
    cmd = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    with driver.Server(cmd, 1, tmp_path / "s.log", cpus=one) as server:
        server.proc.wait(30)
    assert (tmp_path / "s.log").read_text().strip() == str(one)
    assert os.sched_getaffinity(0) == mine


def test_host_loop_is_the_windows_time_per_decode_iteration_by_phase():
    def sums(n, it, sched, launch, wait, res):
        return {"n": n, "iteration_s": it, "schedule_s": sched, "launch_s": launch,
                "gpu_wait_s": wait, "results_s": res}  # fmt: skip

    before = {"psa_host_timing": {"decode/32": sums(100, 0.2, 0.03, 0.02, 0.1, 0.04)}}
    after = {
        "psa_host_timing": {
            # 200 more decode iterations at batch 32: 2 ms each, 1.2 of it waiting
            "decode/32": sums(300, 0.6, 0.09, 0.06, 0.34, 0.12),
            "decode/8": sums(5, 0.01, 0.0, 0.0, 0.0, 0.0),  # too few to count
            "extend/3": sums(50, 1.0, 0.1, 0.5, 0.0, 0.2),  # not decode
        }
    }
    got = analysis.host_loop(before, after)
    assert list(got) == ["32"]
    row = got["32"]
    assert row["iterations"] == 200
    assert row["iteration_ms"] == pytest.approx(2.0)
    assert row["gpu_wait_ms"] == pytest.approx(1.2)
    assert row["host_ms"] == pytest.approx(0.8)
    assert row["schedule_ms"] == pytest.approx(0.3) and row["launch_ms"] == pytest.approx(0.2)
    assert row["results_ms"] == pytest.approx(0.4)
    assert row["other_ms"] == pytest.approx(2.0 - 0.3 - 0.2 - 1.2 - 0.4)
    assert analysis.host_loop({}, {"psa_host_timing": None}) == {}
    assert analysis.host_loop(None, after)["32"]["iterations"] == 300


def test_plugin_time_is_the_windows_calls_and_time_by_entry_point_largest_first():
    before = {
        "psa_plugin_timing": {"decode_check": {"n": 10, "s": 0.01}, "admit": {"n": 1, "s": 0.5}}
    }
    after = {
        "psa_plugin_timing": {
            "decode_check": {"n": 210, "s": 0.31},  # 200 calls, 300 ms
            "admit": {"n": 1, "s": 0.5},  # none in the window
            "match_prefix": {"n": 40, "s": 0.02},  # new in the window
        }
    }
    got = analysis.plugin_time(before, after)
    assert list(got) == ["decode_check", "match_prefix"]
    assert got["decode_check"] == {"calls": 200, "ms": pytest.approx(300.0)}
    assert got["match_prefix"] == {"calls": 40, "ms": pytest.approx(20.0)}
    assert analysis.plugin_time(None, {"psa_plugin_timing": None}) == {}


def test_layer_reads_are_the_windows_shares_per_layer():
    before = {"psa": {"reads_by_layer": {"read": [10, 0], "readable": [100, 100], "host": [5, 0]}}}
    after = {"psa": {"reads_by_layer": {"read": [60, 20], "readable": [300, 300], "host": [15, 0]}}}
    got = analysis.layer_reads(before, after)
    assert got[0] == {"layer": 0, "units_read": 50, "read_share": 0.25, "host_share": 0.2}
    assert got[1] == {"layer": 1, "units_read": 20, "read_share": 0.1, "host_share": 0.0}
    assert analysis.layer_reads(None, after)[0]["host_share"] == 15 / 60  # since start
    assert analysis.layer_reads(before, {"psa": {"reads_by_layer": None}}) == []


def test_a_merged_result_keeps_the_machine_summary_not_the_raw_samples():
    raw = {"period_s": 0.1, "threads": {"1/1 x/x": {"t": [1.0], "pct": [99.0], "cpu": [0]}}}
    run = {"metrics": {"machine": {"util_pct": 80.0}}, "machine_samples": raw}
    part = {
        "workload": "a",
        "systems": {"psa": dict(run), "swept": {"rates": {"1": dict(run)}}},
    }
    got = analysis.without_raw_samples(part)
    assert "machine_samples" not in got["systems"]["psa"]
    assert "machine_samples" not in got["systems"]["swept"]["rates"]["1"]
    assert got["systems"]["psa"]["metrics"]["machine"] == {"util_pct": 80.0}
    assert part["systems"]["psa"]["machine_samples"] is raw  # the part itself unchanged
    assert got["workload"] == "a"


def test_host_profile_turns_the_windows_samples_into_time_per_iteration():
    def prof(samples, phases, functions):
        return {"decode/32": {"hz": 1000, "samples": samples, "phases": phases,
                              "functions": functions}}  # fmt: skip

    f, g, h = "schedule|m.py:alloc:1", "schedule|m.py:loop:9", "results|m.py:send:5"
    before = {"psa_host_profile": prof(10, {"schedule": 10}, {f: [4, 4], g: [10, 6]})}
    after = {
        "psa_host_profile": prof(
            # 100 more samples: alloc innermost in 30, loop on the stack in 60, send 40
            110,
            {"schedule": 70, "results": 40},
            {f: [34, 34], g: [70, 36], h: [40, 40]},
        )
    }
    loop = {"32": {"iteration_ms": 2.0}}  # the same window: 100 samples over 2 ms each
    got = analysis.host_profile(before, after, loop)["32"]
    assert got["samples"] == 100
    assert got["phase_ms"] == pytest.approx({"schedule": 1.2, "results": 0.8})
    assert [(r["fn"], r["phase"]) for r in got["self_ms"]] == [
        ("m.py:send:5", "results"),
        ("m.py:alloc:1", "schedule"),
        ("m.py:loop:9", "schedule"),
    ]
    assert [r["ms"] for r in got["self_ms"]] == pytest.approx([0.8, 0.6, 0.6])
    assert got["inclusive_ms"]["schedule"][0] == {"fn": "m.py:loop:9", "ms": pytest.approx(1.2)}
    assert analysis.host_profile(before, after, {}) == {}  # no timing for the size
    assert analysis.host_profile(None, {"psa_host_profile": None}, loop) == {}


def test_extend_host_profile_spreads_the_extend_samples_over_every_extend_iteration():
    def state(n3, s3, n1, s1, samples, phases, functions):
        timing = {"extend/3": {"n": n3, "iteration_s": s3}, "extend/1": {"n": n1, "iteration_s": s1},
                  "decode/8": {"n": 50, "iteration_s": 9.0}}  # fmt: skip
        prof = {"extend": {"hz": 1000, "samples": samples, "phases": phases,
                           "functions": functions}}  # fmt: skip
        return {"psa_host_timing": timing, "psa_host_profile": prof}

    f = "schedule|m.py:match:3"
    before = state(2, 0.1, 1, 0.02, 20, {"schedule": 20}, {f: [20, 20]})
    # the window: 4 + 6 extend iterations, 0.3 + 0.2 s of them; 50 samples, 40 in match
    after = state(6, 0.4, 7, 0.22, 70, {"schedule": 60, "launch": 10}, {f: [60, 60]})
    got = analysis.extend_host_profile(before, after)
    assert got["iterations"] == 10 and got["iteration_ms"] == pytest.approx(50.0)
    assert got["samples"] == 50  # each sample worth 10 iterations x 50 ms / 50 samples
    assert got["phase_ms"] == pytest.approx({"schedule": 40.0, "launch": 10.0})
    assert got["self_ms"] == [
        {"phase": "schedule", "fn": "m.py:match:3", "ms": pytest.approx(40.0)}
    ]
    assert analysis.extend_host_profile(after, after) == {}  # no extend in the window
    assert analysis.extend_host_profile(before, {"psa_host_timing": {}}) == {}  # not profiled
    # the decode view ignores the extend key
    assert analysis.host_profile(before, after, {"8": {"iteration_ms": 3.0}}) == {}


def test_a_stage_that_measured_nothing_writes_no_result(tmp_path):
    out = tmp_path / "serving_profile.json"
    empty = _part("f", "12-07", "c1") | {"not_run": ["plain", "psa"]}  # budget spent
    got = run.merge_into(out, [empty], SimpleNamespace(fresh=False, export=None))
    assert got["provenance"] == [] and not out.exists()


def test_merge_keeps_a_host_profiled_part_out_of_results(tmp_path):
    part = tmp_path / "a.20261201T000000Z.json"
    part.write_text(json.dumps({"workload": "a", "run_id": "x", "host_profiled": 500,
                                "systems": {}}))  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    merged = subprocess.run(
        [sys.executable, "benchmark/serving/run.py", "merge", str(part)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert merged.returncode != 0 and "diagnosis, not results" in merged.stderr


def test_a_stage_part_names_the_installed_stack():
    from sglang_psa.eval.results import package_versions

    assert package_versions(("pytest", "no-such-distribution-here")) == {
        "pytest": pytest.__version__,
        "no-such-distribution-here": None,
    }
    assert set(run.provenance()["software"]) == set(run.SOFTWARE)


def test_a_timed_runs_server_info_samples_keep_how_hbm_is_shared(monkeypatch):
    """`InfoSamples` asks the server every period while its block runs and keeps
    `residency_sample` of each answer: SGLang's free, tree-cached and held KV and the
    tiered home's evicted blocks and unit-cache pages. A failed answer is skipped; a plain
    server's (no `psa` block) gives none."""
    psa = {
        "running": 4, "kv_available_tokens": 320, "kv_cached_tokens": 9000,
        "kv_held_tokens": 17000,
        "residency": {"blocks_evicted": 700, "cache_pages": 0, "units_read_hbm": 7,
                      "units_read_host": 47, "evictions": 5},
    }  # fmt: skip
    answers = iter([{"internal_states": [{"psa": psa}]}, None, {"internal_states": [{}]}])

    class Fake:
        def get(self, path, timeout):
            assert path == "/get_server_info"
            got = next(answers, StopIteration)
            if got is None:
                raise driver.requests.ConnectionError("busy")
            return {"internal_states": [{"psa": psa}]} if got is StopIteration else got

    with driver.InfoSamples(Fake(), analysis.residency_sample, period_s=0.01) as infos:
        deadline = time.time() + 5
        while len(infos.samples) < 2 and time.time() < deadline:
            time.sleep(0.01)
    first = infos.samples[0]
    assert set(first) == {"t", "running", "kv_available_tokens", "kv_cached_tokens",
                          "kv_held_tokens", "blocks_evicted", "cache_pages",
                          "units_read_hbm", "units_read_host"}  # fmt: skip
    assert first["kv_cached_tokens"] == 9000 and first["cache_pages"] == 0
    assert analysis.residency_sample({"internal_states": [{"psa": None}]}) is None
