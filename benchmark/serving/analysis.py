"""What the serving benchmark computes from what it saw: the server's decode log lines,
`bench_serving`'s per-request results, `/get_server_info` before and after; and how
stage results ("parts") merge into one result file with the issue's summary keys.

Pure functions of JSON-able data, so the GPU run and the CPU tests share them.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

DECODE_RE = re.compile(
    r"\[(?P<time>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})[^\]]*\]\s+Decode batch[^,]*,\s+"
    r"#running-req:\s*(?P<running>\d+),\s+#token:\s*(?P<tokens>\d+),\s+"
    r"token usage:\s*(?P<usage>[0-9.]+),.*?"
    r"(?P<graph>cuda graph|[a-z ]*graph):\s*(?P<graph_on>True|False),\s+"
    r"gen throughput \(token/s\):\s*(?P<gen>[0-9.]+),\s+#queue-req:\s*(?P<queue>\d+)"
)


def parse_decode_lines(text: str) -> list[dict]:
    """SGLang's "Decode batch" log lines: running and queued requests, KV tokens held,
    whether the step ran in a CUDA graph, and generated tokens/s over the interval."""
    out = []
    for m in DECODE_RE.finditer(text):
        out.append(
            {
                "time": m["time"],
                "running": int(m["running"]),
                "tokens": int(m["tokens"]),
                "usage": float(m["usage"]),
                "graph": m["graph_on"] == "True",
                "gen_tok_s": float(m["gen"]),
                "queue": int(m["queue"]),
            }
        )
    return out


STEADY_MIN_INTERVALS = 3  # log intervals at one batch that make it a steady state


def steady_step(lines: list[dict], batch: int | None = None) -> dict:
    """The decode step at full batch: the median over log intervals at `batch` running
    requests of running / generated tokens per second. When the server never ran `batch`
    at once: the largest batch it held for `STEADY_MIN_INTERVALS` busy intervals (a peak
    seen in one interval, a prefill landing as others finish, is no steady state), else the
    most it ran. The first interval is dropped when there are others (it may hold the last
    prefill)."""
    if not lines:
        return {"step_ms": None, "batch": None, "intervals": 0, "graph": None}
    most = max(ln["running"] for ln in lines)
    if not batch or batch > most:
        held = Counter(ln["running"] for ln in lines if ln["gen_tok_s"] > 0)
        steady = [b for b, n in held.items() if n >= STEADY_MIN_INTERVALS]
        batch = max(steady) if steady else most
    at = [ln for ln in lines if ln["running"] == batch and ln["gen_tok_s"] > 0]
    if len(at) > 1:
        at = at[1:]
    if not at:
        return {"step_ms": None, "batch": batch, "intervals": 0, "graph": None}
    steps = [1000.0 * ln["running"] / ln["gen_tok_s"] for ln in at]
    return {
        "step_ms": statistics.median(steps),
        "batch": batch,
        "intervals": len(at),
        "graph": all(ln["graph"] for ln in at),
    }


def pct(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), None for no values."""
    v = sorted(x for x in values if x is not None and not math.isnan(x))
    if not v:
        return None
    k = (len(v) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def stats(values: list[float]) -> dict:
    v = [x for x in values if x is not None]
    return {
        "mean": statistics.fmean(v) if v else None,
        "p50": pct(v, 50),
        "p99": pct(v, 99),
    }


def per_request(bench: dict, meta: dict[int, dict], score, answer_ids) -> list[dict]:
    """One record per request of a `bench_serving --output-details` result, matched to its
    task by prompt token count. `score(text, task)` and `answer_ids(text)` come from the
    tokenizer (workloads.is_correct / answer_ids)."""
    rows = []
    n = len(bench["input_lens"])
    for i in range(n):
        plen = bench["input_lens"][i]
        task = meta.get(plen)
        if task is None:
            raise KeyError(
                f"bench_serving reported a prompt of {plen} tokens that the dataset does not "
                "have: the tokenizer counted differently from the dataset build"
            )
        err = bench["errors"][i]
        text = bench["generated_texts"][i]
        out_len = bench["output_lens"][i]
        itl = bench["itls"][i] or []
        ok = not err and out_len > 0
        rows.append(
            {
                "prompt_len": plen,
                "kind": task["kind"],
                "output_len": out_len,
                "ttft_s": bench["ttfts"][i] if ok else None,
                "tpot_s": (sum(itl) / (out_len - 1)) if ok and out_len > 1 else None,
                "latency_s": (bench["ttfts"][i] + sum(itl)) if ok else None,
                "error": err or (None if ok else "no output tokens"),
                "correct": bool(score(text, task)) if ok else False,
                "answer_ids": answer_ids(text) if ok else [],
            }
        )
    return rows


def run_metrics(bench: dict, rows: list[dict], decode_lines: list[dict], batch: int | None) -> dict:
    """Throughput, latency and decode-step figures of one timed run."""
    ok = [r for r in rows if r["error"] is None]
    return {
        "requests": len(rows),
        "completed": len(ok),
        "failed": len(rows) - len(ok),
        "duration_s": bench["duration"],
        "output_tok_s": bench["output_throughput"],
        "requests_per_s": bench["request_throughput"],
        "input_tok_s": bench["input_throughput"],
        "ttft_s": stats([r["ttft_s"] for r in ok]),
        "tpot_s": stats([r["tpot_s"] for r in ok]),
        "steady_decode": steady_step(decode_lines, batch),
        "peak_running": max([ln["running"] for ln in decode_lines], default=0),
        "max_concurrent_client": bench.get("max_concurrent_requests"),
        "accuracy": (sum(r["correct"] for r in rows) / len(rows)) if rows else None,
    }


def goodput(rows: list[dict], duration_s: float, ttft_slo_s: float, tpot_slo_s: float) -> float:
    """Requests per second that met both objectives (a request with one output token has
    no TPOT and is judged on its TTFT)."""
    good = sum(
        1
        for r in rows
        if r["error"] is None
        and r["ttft_s"] <= ttft_slo_s
        and (r["tpot_s"] is None or r["tpot_s"] <= tpot_slo_s)
    )
    return good / duration_s if duration_s > 0 else 0.0


def identical_fraction(rows: list[dict], ref: list[dict]) -> dict:
    """Completions whose first answer-window tokens equal the reference's, per prompt, over
    the prompts both answered; and the mean common prefix in tokens."""
    by_len = {r["prompt_len"]: r for r in ref if r["error"] is None}
    pairs = [
        (r, by_len[r["prompt_len"]])
        for r in rows
        if r["error"] is None and r["prompt_len"] in by_len
    ]
    if not pairs:
        return {"identical": None, "compared": 0, "mean_common_prefix": None}

    def common(a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    same = sum(1 for r, p in pairs if r["answer_ids"] == p["answer_ids"])
    return {
        "identical": same / len(pairs),
        "compared": len(pairs),
        "mean_common_prefix": statistics.fmean(
            common(r["answer_ids"], p["answer_ids"]) for r, p in pairs
        ),
    }


def psa_counters(info: dict | None) -> dict | None:
    """sglang-psa's block in `/get_server_info` (`internal_states[0].psa`), if any."""
    try:
        return info["internal_states"][0]["psa"]
    except (KeyError, IndexError, TypeError):
        return None


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """KV fraction read (cumulative over the server's life, warm-up included), the HBM
    hit rate over the timed window (at the tiered home the (layer, KV head, block) units
    decode read from HBM over all units it read) and, with a host tier, what the
    write-back saved in the window (blocks, bytes, engine restarts, jobs still
    unacknowledged at the end)."""
    a, b = psa_counters(after), psa_counters(before)
    if a is None:
        return {"kv_fraction_read": 1.0, "hbm_hit_rate": None}
    hit = None
    ca, cb = a.get("residency"), (b or {}).get("residency")
    if ca and cb:
        hits = ca["units_read_hbm"] - cb["units_read_hbm"]
        host = ca["units_read_host"] - cb["units_read_host"]
        hit = hits / (hits + host) if hits + host else None
    out = {"kv_fraction_read": a.get("blocks_read_fraction"), "hbm_hit_rate": hit}
    wa, wb = a.get("writeback"), (b or {}).get("writeback")
    if wa and wb:
        out["writeback"] = {
            k: wa[k] - wb[k] for k in ("blocks_saved", "bytes_saved", "engine_restarts")
        } | {"save_jobs_in_flight": wa["save_jobs_in_flight"]}
    return out


def server_info_digest(info: dict | None) -> dict | None:
    """What a result keeps of `/get_server_info`: the KV pool size and the PSA block."""
    if info is None:
        return None
    state = (info.get("internal_states") or [{}])[0]
    return {
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "page_size": info.get("page_size"),
        "cuda_graph_backend_decode": info.get("cuda_graph_backend_decode"),
        "memory_usage": state.get("memory_usage"),
        "psa": state.get("psa"),
    }


# ---------------------------------------------------------------------------------------
# Merging parts into one result
# ---------------------------------------------------------------------------------------

SUMMARY_KEYS = (
    "decode_step_ratio_psa_vs_plain",
    "decode_step_ratio_topk_vs_plain",
    "throughput_ratio_psa_vs_plain",
    "throughput_ratio_host_vs_plain_capped",
    "throughput_ratio_host_vs_plain_capped_system",
    "ttft_p99_ratio_host_vs_plain_capped",
    "throughput_ratio_host_vs_plain_capped_topk",
    "goodput_ratio_vs_plain_strict",
    "goodput_ratio_vs_plain_relaxed",
    "ttft_p99_ratio_host_vs_hbm",
    "throughput_ratio_tiered_vs_hbm",
    "accuracy_delta_vs_plain",
    "decode_step_ratio_topk_vs_plain_8b",
    "throughput_ratio_tiered_vs_plain_8b",
    "max_concurrent_ratio_tiered_vs_plain_8b",
)


def _runs(rec: dict) -> dict[str, dict]:
    """rate -> timed run of a system's record ("inf": the one run of a workload sent all at
    once); none for a record that failed."""
    if not rec or rec.get("error"):
        return {}
    return rec["rates"] if "rates" in rec else {"inf": rec}


def latest_runs(parts: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(workload, system, rate) -> the newest part that measured it (parts sort by date)."""
    best: dict[tuple[str, str, str], dict] = {}
    for p in sorted(parts, key=lambda p: p["date"]):
        for name, rec in p["systems"].items():
            for rate in _runs(rec):
                best[(p["workload"], name, rate)] = p
    return best


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den not in (None, 0) else None


def _pair(best, workload: str, system: str, rate: str = "inf") -> tuple[dict | None, dict | None]:
    """The system's newest run at `rate`, and plain SGLang's run at that rate in the same
    part (the same stage run), or None."""
    p = best.get((workload, system, rate))
    if p is None:
        return None, None
    return _runs(p["systems"][system])[rate], _runs(p["systems"].get("plain")).get(rate)


def _metric(run, *path):
    for k in path:
        if run is None:
            return None
        run = run[k]
    return run


TIERED = ("psa_tiered_uva", "psa_tiered")  # sglang-psa with a host tier, default first


def summarize(parts: list[dict]) -> dict:
    """The issue's summary keys; each ratio compares a system with plain SGLang measured in
    the same part (stage run), except `ttft_p99_ratio_host_vs_hbm` and
    `throughput_ratio_tiered_vs_hbm`, which compare the two sglang-psa homes, the tiered
    one and HBM only (from one part when a stage ran both). A
    key whose systems were not measured is None."""
    best = latest_runs(parts)
    step = ("metrics", "steady_decode", "step_ms")
    tok_s = ("metrics", "output_tok_s")
    s: dict[str, float | None] = {}
    for mode in ("psa", "topk"):
        run, plain = _pair(best, "a", mode)
        s[f"decode_step_ratio_{mode}_vs_plain"] = _ratio(_metric(run, *step), _metric(plain, *step))
    run, plain = _pair(best, "a", "psa")
    s["throughput_ratio_psa_vs_plain"] = _ratio(_metric(run, *tok_s), _metric(plain, *tok_s))
    # The host tier under capped HBM: the tiered home, by its default write-back first.
    for home in TIERED:
        run, plain = _pair(best, "b", home)
        ratio = _ratio(_metric(run, *tok_s), _metric(plain, *tok_s))
        if ratio is not None:
            break
    s["throughput_ratio_host_vs_plain_capped"] = ratio
    s["throughput_ratio_host_vs_plain_capped_system"] = home if ratio is not None else None
    # Its p99 TTFT against plain's in the same run: the throughput must not come from
    # making the queue wait longer.
    p99 = ("metrics", "ttft_s", "p99")
    s["ttft_p99_ratio_host_vs_plain_capped"] = _ratio(_metric(run, *p99), _metric(plain, *p99))
    # The same store under the fixed top-k budget: what the store gives a policy that reads
    # less (a reference beside the default psa policy's figure above, not a replacement).
    run, plain = _pair(best, "b", "topk_tiered")
    s["throughput_ratio_host_vs_plain_capped_topk"] = _ratio(
        _metric(run, *tok_s), _metric(plain, *tok_s)
    )
    for which in ("strict", "relaxed"):
        s[f"goodput_ratio_vs_plain_{which}"] = sweep_ratio(best, "psa", f"goodput_{which}")
    host = next((r for r in (_pair(best, "a", h)[0] for h in TIERED) if r), None)
    hbm, _ = _pair(best, "a", "psa")
    s["ttft_p99_ratio_host_vs_hbm"] = _ratio(_metric(host, *p99), _metric(hbm, *p99))
    s["throughput_ratio_tiered_vs_hbm"] = _ratio(_metric(host, *tok_s), _metric(hbm, *tok_s))
    s["accuracy_delta_vs_plain"] = accuracy_delta(best, "psa")
    run, plain = _pair(best, "d", "topk")
    s["decode_step_ratio_topk_vs_plain_8b"] = _ratio(_metric(run, *step), _metric(plain, *step))
    run, plain = _pair(best, "e", "topk_tiered")
    s["throughput_ratio_tiered_vs_plain_8b"] = _ratio(_metric(run, *tok_s), _metric(plain, *tok_s))
    peak = ("metrics", "peak_running")
    s["max_concurrent_ratio_tiered_vs_plain_8b"] = _ratio(
        _metric(run, *peak), _metric(plain, *peak)
    )
    return s


def sweep_ratio(best, system: str, key: str) -> float | None:
    """`system`'s best `key` (a goodput) over the rates of workload c it was measured at,
    over plain SGLang's best at the same rates, each rate paired within one part."""
    mine, theirs = [], []
    for workload, name, rate in best:
        if workload != "c" or name != system:
            continue
        run, plain = _pair(best, "c", system, rate)
        if plain is not None and key in run and key in plain:
            mine.append(run[key])
            theirs.append(plain[key])
    return _ratio(max(mine, default=None), max(theirs, default=None))


def accuracy_delta(best, system: str) -> float | None:
    """`system`'s accuracy minus plain's over every scored prompt both answered in the same
    runs (workloads with real-model tasks; those with random weights are left out)."""
    ours = theirs = n = 0
    for (workload, name, rate), part in best.items():
        model = part.get("config", {}).get("workload", {}).get("model", "")
        if name != system or model.endswith("-dummy"):  # workloads.LLAMA_8B_DUMMY
            continue
        run, plain = _pair(best, workload, system, rate)
        if plain is None:
            continue
        ref = {r["prompt_len"]: r for r in plain["rows"]}
        for r in run["rows"]:
            q = ref.get(r["prompt_len"])
            if q is None or r["error"] or q["error"]:
                continue
            ours += r["correct"]
            theirs += q["correct"]
            n += 1
    return (ours - theirs) / n if n else None


def restate_steady(parts: list[dict]) -> None:
    """Re-derive every run's steady decode step from its decode log with the current rule
    (`steady_step`), so that parts measured apart are read alike."""
    for p in parts:
        for rec in p["systems"].values():
            for rate, run in _runs(rec).items():
                if run.get("decode_log") and run.get("metrics"):
                    batch = rec.get("num_prompts") if rate == "inf" else None
                    run["metrics"]["steady_decode"] = steady_step(run["decode_log"], batch)


def merge(parts: list[dict]) -> dict:
    """One document from stage parts: provenance of each part, the newest measurement of
    every (workload, system, rate) with plain from its own run, the summary."""
    restate_steady(parts)
    best = latest_runs(parts)
    used = {id(p) for p in best.values()}
    kept = [p for p in sorted(parts, key=lambda p: p["date"]) if id(p) in used]
    prov = [
        {
            k: p[k]
            for k in ("workload", "run_id", "machine", "device", "command", "date", "git_commit")
        }
        | {"systems": sorted(p["systems"])}
        for p in kept
    ]
    return {
        "summary": summarize(kept),
        "provenance": prov,
        "mixed": {
            "machines": sorted({p["device"] for p in kept}),
            "git_commits": sorted({p["git_commit"] for p in kept}),
        },
        "parts": kept,
    }


def table_rows(doc: dict) -> list[dict]:
    """One row per (workload, system) of a merged document, for README and the console."""
    rows = []
    for p in doc["parts"]:
        for name, rec in p["systems"].items():
            if rec.get("error"):
                rows.append({"workload": p["workload"], "system": name, "error": rec["error"][:80]})
                continue
            if "rates" in rec:
                for rate, r in rec["rates"].items():
                    m = r["metrics"]
                    rows.append(_row(p["workload"] + f"@{rate}/s", name, m, rec, r))
            else:
                rows.append(_row(p["workload"], name, rec["metrics"], rec, rec))
    return rows


def _row(workload: str, name: str, m: dict, rec: dict, r: dict) -> dict:
    ident = r.get("identical_to_plain") or {}
    return {
        "workload": workload,
        "system": name,
        "output_tok_s": m["output_tok_s"],
        "ttft_p99_s": m["ttft_s"]["p99"],
        "tpot_p50_ms": (m["tpot_s"]["p50"] or 0) * 1000,
        "step_ms": m["steady_decode"]["step_ms"],
        "step_batch": m["steady_decode"]["batch"],
        "peak_running": m["peak_running"],
        "kv_read": rec.get("counters", {}).get("kv_fraction_read"),
        "hbm_hit": rec.get("counters", {}).get("hbm_hit_rate"),
        "accuracy": m["accuracy"],
        "identical": ident.get("identical"),
        "goodput_strict": r.get("goodput_strict"),
        "goodput_relaxed": r.get("goodput_relaxed"),
    }


def markdown_table(doc: dict) -> str:
    def f(x, spec):
        return "–" if x is None else format(x, spec)

    out = [
        "| workload | system | output tok/s | p99 TTFT (s) | p50 TPOT (ms) | decode step (ms) @ batch "
        "| peak running | KV read | accuracy | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table_rows(doc):
        if "error" in r:
            out.append(f"| {r['workload']} | {r['system']} | failed: {r['error']} |||||||")
            continue
        step = f"{f(r['step_ms'], '.2f')} @ {r['step_batch']}" if r["step_ms"] else "–"
        out.append(
            f"| {r['workload']} | {r['system']} | {f(r['output_tok_s'], '.0f')} | "
            f"{f(r['ttft_p99_s'], '.1f')} | {f(r['tpot_p50_ms'], '.1f')} | {step} | "
            f"{r['peak_running']} | {f(r['kv_read'], '.0%')} | {f(r['accuracy'], '.2f')} | "
            f"{f(r['identical'], '.2f')} |"
        )
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Where a decode step's GPU time goes (`stage --profile-decode`)
# ---------------------------------------------------------------------------------------

GPU_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
KERNEL_NAME_CHARS = 120  # C++ template names run to kilobytes


def kernel_profile(traces: list[Path], steps: int, top: int = 25) -> dict:
    """GPU time per decode step by kernel, from the Chrome traces SGLang's profiler wrote
    (`/start_profile` with `num_steps`, GPU activity).

    The step count is the traced `cudaGraphLaunch` calls (one per graph-replayed step)
    when there are any, else `steps` (eager decoding). Per step: `kernel_us` sums every
    GPU event (kernels, copies, fills; events on concurrent streams count twice),
    `busy_us` the time at least one ran, `span_us` first start to last end (`span_us -
    busy_us`: the GPU idle, waiting for the host). `kernels`: the `top` names by time,
    each with its µs and launches per step; `other_us` the rest. Raises ValueError when
    the traces hold no GPU event."""
    events, graph_launches = [], 0
    for path in traces:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        for e in doc.get("traceEvents", []):
            if e.get("ph") != "X":
                continue
            if e.get("cat") in GPU_EVENT_CATEGORIES:
                events.append((float(e["ts"]), float(e["dur"]), e["name"]))
            elif e.get("cat") == "cuda_runtime" and e.get("name") == "cudaGraphLaunch":
                graph_launches += 1
    if not events:
        raise ValueError(f"no GPU events in {', '.join(str(t) for t in traces) or 'no trace'}")
    n = graph_launches or steps
    total: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for _, dur, name in events:
        total[name] += dur
        count[name] += 1
    busy, end_busy = 0.0, -math.inf
    for ts, dur, _ in sorted(events):
        if ts >= end_busy:
            busy += dur
        elif ts + dur > end_busy:
            busy += ts + dur - end_busy
        end_busy = max(end_busy, ts + dur)
    span = max(ts + dur for ts, dur, _ in events) - min(ts for ts, _, _ in events)
    ranked = total.most_common()
    return {
        "steps": n,
        "steps_from": "graph launches" if graph_launches else "requested",
        "kernel_us": sum(total.values()) / n,
        "busy_us": busy / n,
        "span_us": span / n,
        "kernels": [
            {
                "name": name[:KERNEL_NAME_CHARS],
                "us": us / n,
                "launches": count[name] / n,
            }
            for name, us in ranked[:top]
        ],
        "other_us": sum(us for _, us in ranked[top:]) / n,
    }
