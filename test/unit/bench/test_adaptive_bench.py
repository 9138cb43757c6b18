"""The adaptive-budget suite's bookkeeping on synthetic rows: per-policy tables, the best
single top-k budget as an operator would pick it, and the summary keys of its result."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from sglang_psa.config import PSAConfig
from sglang_psa.eval.results import dump_result
from sglang_psa.hf.attention import DecodePolicy

PATH = Path(__file__).resolve().parents[3] / "benchmark" / "adaptive" / "run.py"
spec = importlib.util.spec_from_file_location("adaptive_run", PATH)
adaptive = importlib.util.module_from_spec(spec)
sys.modules["adaptive_run"] = adaptive
spec.loader.exec_module(adaptive)


def _rows(policy, length, correct, identical, kl, kv, n=10):
    return [
        {
            "task": "niah", "length": length, "length_bucket": length, "policy": policy,
            "correct": i < correct, "identical": i < identical, "kl": kl, "kv_fraction": kv,
        }
        for i in range(n)
    ]  # fmt: skip


CODES = DecodePolicy("psa", PSAConfig(stop_rule="certified", threshold=0.9), code_bits=5).label


def _suite():
    psa = DecodePolicy("psa", PSAConfig()).label  # the current default
    # certified and top-k as the suite runs them: on its first default's exact bounds
    first = adaptive.FIRST
    cert = DecodePolicy("psa", first.replace(threshold=0.95, stop_rule="certified")).label
    topk = {
        b: DecodePolicy("topk", first.replace(topk_tokens=b), b).label for b in (256, 512, 1024)
    }
    rows = []
    for n in (8192, 16384):
        rows += _rows("dense", n, 8, 10, 0.0, 1.0)
        rows += _rows(psa, n, 8, 9, 0.01, 0.10)
        rows += _rows(cert, n, 8, 10, 0.001, 0.40 if n == 16384 else 0.6)
        # a certified policy on key codes: less at 16K, more at 8K (the pick is by 16K+)
        rows += _rows(CODES, n, 8, 10, 0.001, 0.30 if n == 16384 else 0.9)
        rows += _rows(topk[256], n, 6, 5, 0.5, 0.05)  # too few correct
        rows += _rows(topk[512], n, 8, 8, 0.1, 0.10)  # accurate, too few identical
        rows += _rows(topk[1024], n, 8, 9, 0.05, 0.20)  # the best single budget
    return rows, psa, topk


def test_the_best_single_topk_budget_is_the_smallest_that_meets_both_bars():
    rows, psa, topk = _suite()
    tab = adaptive.table(rows)
    assert tab["dense"]["n"] == 20 and set(tab["dense"]["by_length"]) == {8192, 16384}
    assert tab[topk[512]]["identical"] == pytest.approx(0.8)
    label, stats = adaptive.best_topk(tab, [256, 512, 1024], 0.01, 0.9)
    assert label == topk[1024] and stats["kv_fraction"] == pytest.approx(0.2)
    # with a looser identical bar the 512-token budget wins; per length the same
    assert adaptive.best_topk(tab, [256, 512, 1024], 0.01, 0.8)[0] == topk[512]
    assert adaptive.best_topk(tab, [256, 512, 1024], 0.01, 0.9, key=16384)[0] == topk[1024]
    assert adaptive.best_topk(tab, [256], 0.01, 0.9) is None


def test_summary_keys_compare_the_default_psa_policy_with_the_best_budget():
    rows, psa, topk = _suite()
    s = adaptive.summarize(adaptive.table(rows), [256, 512, 1024], 0.01, 0.9)
    assert s["kv_fraction_psa"] == pytest.approx(0.1)
    assert s["kv_fraction_best_topk"] == pytest.approx(0.2)
    assert s["kv_ratio_psa_vs_best_topk"] == pytest.approx(0.5)
    assert s["accuracy_delta_psa_vs_dense"] == pytest.approx(0.0)
    assert s["identical_fraction_psa"] == pytest.approx(0.9)
    assert s["mean_kl_psa"] == pytest.approx(0.01)
    # the largest budget run, bar or not (here it is the best one)
    assert s["kv_ratio_psa_vs_largest_topk"] == pytest.approx(0.5)
    assert s["accuracy_delta_largest_topk_vs_dense"] == pytest.approx(0.0)
    # where no budget meets the bar, the best is null and the largest still compares
    few = adaptive.summarize(adaptive.table(rows), [256], 0.01, 0.9)
    assert few["best_topk_policy"] is None and few["kv_ratio_psa_vs_best_topk"] is None
    assert few["kv_ratio_psa_vs_largest_topk"] == pytest.approx(2.0)
    assert few["accuracy_delta_largest_topk_vs_dense"] == pytest.approx(-0.2)
    # the certified policy reading least at 16K+, its 16K rows only
    assert s["kv_fraction_certified_16k"] == pytest.approx(0.3)
    assert s["certified_16k_policy"] == CODES and CODES.endswith("-c5")
    # the numerical floor (ε 1, every block read): no floor row here, then one
    assert s["identical_fraction_floor"] is None
    floor = adaptive.floor_policy().label
    assert floor in {p.label for p in adaptive.policies([256])}
    with_floor = rows + _rows(floor, 8192, 8, 7, 0.0001, 1.0) + _rows(floor, 16384, 8, 8, 0, 1.0)
    s = adaptive.summarize(adaptive.table(with_floor), [256, 512, 1024], 0.01, 0.9)
    assert s["identical_fraction_floor"] == pytest.approx(0.75)
    assert s["kv_fraction_psa"] == pytest.approx(0.1)  # the default's keys unchanged
    # a run without the default policy (joined later by --combine): its keys null in the
    # result file, which is valid JSON (no NaN)
    s = adaptive.summarize(
        adaptive.table([r for r in rows if r["policy"] != psa]), [256, 512, 1024], 0.01, 0.9
    )
    strict = {"parse_constant": lambda c: pytest.fail(f"{c} in a result file")}
    s = json.loads(dump_result({"summary": s}), **strict)["summary"]
    assert s["kv_fraction_psa"] is None and s["kv_ratio_psa_vs_best_topk"] is None
    assert s["kv_fraction_best_topk"] == pytest.approx(0.2)


def test_a_row_tells_a_divergence_after_the_answers_stop_from_one_inside_it():
    """`answer_identical`: the tokens up to and including the stop equal dense's (what a
    server stopping there returns); `identical`: all of them; `first_divergence`: where
    they first differ."""
    from types import SimpleNamespace as NS

    stop = 9
    dense = [1, 2, stop, 5, 5]
    rows_tokens = [dense, [1, 2, stop, 6, 6], [1, 3, stop, 5, 5], [1, 2, 4, stop, 5]]
    pols = [DecodePolicy("dense", PSAConfig())] + [DecodePolicy("psa", PSAConfig())] * 3
    session = NS(
        decode_rows=lambda p, n, k: NS(tokens=rows_tokens, kv_fractions=[1.0, 0.3, 0.3, 0.3]),
        forced_kl_rows=lambda p, toks, k: [0.0, 0.1, 0.1, 0.1],
        length=5, head_dim=64, tok=NS(decode=lambda ids, skip_special_tokens: str(ids)),
    )  # fmt: skip
    task = NS(kind="niah", score=lambda text: text == "[1, 2]")
    rows = adaptive.run_task(session, task, pols, {stop})
    got = [(r["identical"], r["answer_identical"], r["first_divergence"]) for r in rows]
    assert got == [(True, True, None), (False, True, 3), (False, False, 1), (False, False, 2)]
    assert [r["correct"] for r in rows] == [True, True, False, False]
    for r in rows:
        r["length_bucket"] = 4096  # the suite's loop adds it
    assert adaptive.table(rows)[pols[1].label]["answer_identical"] == pytest.approx(1 / 3)


def test_metadata_counts_in_a_sparse_policys_kv_fraction():
    bound = DecodePolicy("psa", PSAConfig(score="bound", bound_bits=16))
    mean = DecodePolicy("topk", PSAConfig(score="mean", topk_tokens=256), 256)
    f = adaptive.metadata_fraction
    assert f(DecodePolicy("dense", PSAConfig()), 64) == 0.0
    assert f(bound, 64) == pytest.approx(2 / 64)  # min and max per 32 keys and values
    assert f(mean, 64) == pytest.approx(1 / 64)
    q8 = DecodePolicy("psa", PSAConfig(score="bound", bound_bits=8))
    assert f(q8, 64) == pytest.approx((1 + 2 / 64) / 64)  # a byte a channel + float32 scale
    assert "-q8" in q8.label and q8.group != bound.group
    # key codes: `code_bits` bits a channel and token against 2 x 16 bits (K and V)
    codes = DecodePolicy("psa", PSAConfig(stop_rule="certified", bound_bits=8), code_bits=5)
    assert f(codes, 64) == pytest.approx((1 + 2 / 64) / 64 + 5 / 32)
    assert codes.group != DecodePolicy("psa", codes.cfg).group  # never batched together
    with pytest.raises(ValueError, match="certified rule only"):
        DecodePolicy("psa", PSAConfig(), code_bits=5)
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        DecodePolicy("psa", PSAConfig(stop_rule="certified"), code_bits=9)


def test_report_tables_every_policy_overall_and_per_length():
    rows, psa, topk = _suite()
    tab = adaptive.table(rows)
    text = adaptive.report({"data": {"policies": json.loads(json.dumps(tab))}})
    lines = text.splitlines()
    assert len(lines) == 2 + len(tab)
    row = next(line for line in lines if line.startswith(f"| {psa} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    s = tab[psa]
    assert cells[5] == f"{s['kv_fraction']:.3f}"
    assert cells[3] == f"{s['answer_identical']:.2f}"  # rows without the field: `identical`
    lengths = sorted(s["by_length"])
    per = s["by_length"][lengths[-1]]
    assert cells[-1] == f"{per['kv_fraction']:.3f} / {per['identical']:.2f}"


def test_a_second_models_summary_is_attached_with_its_suffix(tmp_path):
    """`--attach`: the 1.5B run's summary keys land in the test model's result suffixed
    `_1p5b`, with where they come from; the test model's keys and data stay."""
    main = {"machine": "m", "date": "d0", "git_commit": "c0",
            "summary": {"kv_fraction_psa": 0.3, "kv_ratio_psa_vs_best_topk": 0.47},
            "model": "Qwen2.5-Coder-0.5B-Instruct", "data": {"rows": [1, 2]}}  # fmt: skip
    big = {"machine": "m", "date": "d1", "git_commit": "c1", "command": "run.py --model x",
           "summary": {"kv_fraction_psa": 0.25, "kv_ratio_psa_vs_best_topk": 0.4},
           "model": "Qwen2.5-Coder-1.5B-Instruct", "data": {"rows": [3]}}  # fmt: skip
    (tmp_path / "adaptive_budget.json").write_text(dump_result(main))
    (tmp_path / "adaptive_budget_1p5b.json").write_text(dump_result(big))
    keys = adaptive.attach(tmp_path / "adaptive_budget_1p5b.json",
                           tmp_path / "adaptive_budget.json", "_1p5b")  # fmt: skip
    assert keys == {"kv_fraction_psa_1p5b": 0.25, "kv_ratio_psa_vs_best_topk_1p5b": 0.4}
    doc = json.loads((tmp_path / "adaptive_budget.json").read_text())
    assert doc["summary"] == {**main["summary"], **keys}
    assert doc["data"] == main["data"] and doc["date"] == "d0"
    assert doc["attached"]["_1p5b"] == {
        "file": "adaptive_budget_1p5b.json", "model": "Qwen2.5-Coder-1.5B-Instruct",
        "date": "d1", "git_commit": "c1", "command": "run.py --model x",
    }  # fmt: skip
    with pytest.raises(SystemExit, match="starts with '_'"):
        adaptive.attach(tmp_path / "adaptive_budget_1p5b.json",
                        tmp_path / "adaptive_budget.json", "1p5b")  # fmt: skip


def test_shards_partition_the_suite_and_each_spans_its_lengths():
    """`--shard K/N`: N processes share the suite; together they run every task once,
    and each one's tasks still come from every length (a shard cut short covers them)."""
    jobs = [(n, i, k) for i in range(2) for n in (4096, 8192, 16384) for k in range(7)]
    shards = [adaptive.shard(jobs, f"{k}/4") for k in range(4)]
    assert sorted(j for s in shards for j in s) == sorted(jobs)
    assert sum(len(s) for s in shards) == len(jobs)
    for s in shards:
        assert {n for n, _, _ in s[: len(s) // 2 + 1]} == {4096, 8192, 16384}
    assert adaptive.shard(jobs, None) == jobs
    for bad in ("4/4", "-1/2", "1", "a/b"):
        with pytest.raises(ValueError, match="--shard"):
            adaptive.shard(jobs, bad)


def test_a_resumed_run_names_the_commits_that_measured_its_kept_rows(tmp_path):
    """`--resume` keeps an earlier run's rows, so the result names that run's commits
    beside its own (on 2026-12-07 a resume across commits had recorded only the last)."""
    f = tmp_path / "ab_s0.json"
    f.write_text(dump_result({"git_commit": "c0; c1", "data": {"rows": [{"task": "t"}]}}))
    assert adaptive.resumed(f) == ([{"task": "t"}], ["c0", "c1"])
    f.write_text(dump_result({"git_commit": "c0", "data": {"rows": []}}))
    assert adaptive.resumed(f) == ([], [])  # nothing kept: no commit to name
