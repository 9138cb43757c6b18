"""What the serving benchmark computes from what it saw: the server's decode log lines,
`bench_serving`'s per-request results, `/get_server_info` before and after; and how
stage results ("parts") merge into one result file with the issue's summary keys.

Pure functions of JSON-able data, so the GPU run and the CPU tests share them.
"""

from __future__ import annotations

import bisect
import gzip
import json
import math
import re
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

try:  # benchmark/serving on sys.path (run.py, the tests)
    from systems import HICACHE_RACE, PLAIN_RACE
except ImportError:  # imported as benchmark.serving.analysis (benchmark/decode_step)
    from .systems import HICACHE_RACE, PLAIN_RACE

DECODE_RE = re.compile(
    r"\[(?P<time>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})[^\]]*\]\s+Decode batch[^,]*,\s+"
    r"#running-req:\s*(?P<running>\d+),\s+#token:\s*(?P<tokens>\d+),\s+"
    r"token usage:\s*(?P<usage>[0-9.]+),.*?"
    r"(?P<graph>cuda graph|[a-z ]*graph):\s*(?P<graph_on>True|False),\s+"
    r"gen throughput \(token/s\):\s*(?P<gen>[0-9.]+),\s+#queue-req:\s*(?P<queue>\d+)"
)


def parse_decode_lines(text: str, base: int | None = None) -> list[dict]:
    """SGLang's "Decode batch" log lines: running and queued requests, KV tokens held,
    whether the step ran in a CUDA graph, and generated tokens/s over the interval. With
    `base` (the byte of the log file where `text` starts) each line also gets `at`, the
    byte of the file where it ends (`machine_samples`' log sizes time it)."""
    out = []
    done_chars = done_bytes = 0
    for m in DECODE_RE.finditer(text):
        line = {
            "time": m["time"],
            "running": int(m["running"]),
            "tokens": int(m["tokens"]),
            "usage": float(m["usage"]),
            "graph": m["graph_on"] == "True",
            "gen_tok_s": float(m["gen"]),
            "queue": int(m["queue"]),
        }
        if base is not None:
            done_bytes += len(text[done_chars : m.end()].encode())
            done_chars = m.end()
            line["at"] = base + done_bytes
        out.append(line)
    return out


PREFILL_RE = re.compile(
    r"\[(?P<time>\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})[^\]]*\]\s+Prefill batch[^,]*,\s+"
    r"#new-seq:\s*(?P<seqs>\d+),\s+#new-token:\s*(?P<tokens>\d+),\s+"
    r"#cached-token:\s*(?P<cached>\d+),.*?#running-req:\s*(?P<running>\d+),\s+"
    r"#queue-req:\s*(?P<queue>\d+),.*?input throughput \(token/s\):\s*(?P<tok_s>[0-9.]+)"
)


def parse_prefill_lines(text: str) -> list[dict]:
    """SGLang's "Prefill batch" log lines, one per prefill batch as it is scheduled: new
    requests and tokens, tokens the prefix cache served, running and queued requests, and
    the new tokens over the time since the previous prefill batch (`tok_s`)."""
    return [
        {
            "time": m["time"],
            "seqs": int(m["seqs"]),
            "tokens": int(m["tokens"]),
            "cached": int(m["cached"]),
            "running": int(m["running"]),
            "queue": int(m["queue"]),
            "tok_s": float(m["tok_s"]),
        }
        for m in PREFILL_RE.finditer(text)
    ]


def prefill_rate(lines: list[dict]) -> dict:
    """The server's own prefill rate over a run: new tokens over the time between prefill
    batches (each line's tokens / its `tok_s`), the first batch left out (its interval
    reaches back before the run). Decode steps run between prefill batches count in that
    time: this is the rate at which the prompts went in, as the scheduler saw it (a client's
    TTFT adds tokenization, queueing and the way back)."""
    timed = [ln for ln in lines[1:] if ln["tok_s"] > 0]
    seconds = sum(ln["tokens"] / ln["tok_s"] for ln in timed)
    return {
        "batches": len(lines),
        "tokens": sum(ln["tokens"] for ln in lines),
        "tok_s": sum(ln["tokens"] for ln in timed) / seconds if seconds else None,
    }


STEADY_MIN_INTERVALS = 3  # log intervals at one batch that make it a steady state


def interval_step_ms(line: dict) -> float | None:
    """A decode log line's step over its interval: running requests over generated
    tokens per second (None for an idle interval)."""
    return 1000.0 * line["running"] / line["gen_tok_s"] if line["gen_tok_s"] else None


def steady_step(lines: list[dict], batch: int | None = None) -> dict:
    """The decode step at full batch: the median over log intervals at `batch` running
    requests of running / generated tokens per second. When the server never ran `batch`
    at once: the largest batch it held for `STEADY_MIN_INTERVALS` busy intervals (a peak
    seen in one interval, a prefill landing as others finish, is no steady state), else the
    most it ran. The first interval is dropped when there are others (it may hold the last
    prefill). `step_ms_p10` / `step_ms_p90`: the spread over those intervals (a sparse
    step's phases: a median between two modes reads neither)."""
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
    steps = [interval_step_ms(ln) for ln in at]
    return {
        "step_ms": statistics.median(steps),
        "step_ms_p10": pct(steps, 10),
        "step_ms_p90": pct(steps, 90),
        "batch": batch,
        "intervals": len(at),
        "graph": all(ln["graph"] for ln in at),
    }


def line_times(samples: dict, lines: list[dict]) -> list[float | None] | None:
    """When each decode line (with its byte `at`) was first seen in the server's log by
    the samples' log sizes (`machine_samples`: it was printed within the period before);
    None without log sizes or byte offsets."""
    log = samples.get("log")
    if not log or not log["t"] or any("at" not in ln for ln in lines):
        return None
    out = []
    for ln in lines:
        i = bisect.bisect_left(log["bytes"], ln["at"])
        out.append(log["t"][i] if i < len(log["t"]) else None)
    return out


def _nearest(series: dict, key: str, t: float):
    """The value of `series[key]` sampled nearest to time `t`."""
    ts = series["t"]
    i = bisect.bisect_left(ts, t)
    j = min((k for k in (i - 1, i) if 0 <= k < len(ts)), key=lambda k: abs(ts[k] - t))
    return series[key][j]


SLOW_STEP = 1.15  # a decode interval slower than this times the run's fast mode (p10)
SHARING_BUSY_PCT = 50.0  # a thread this busy in a sample slows an SMT sibling down


def core_sharing(samples: dict, thread: str) -> dict | None:
    """For each sample of `thread` (`machine_samples`, with the CPUs threads last ran on):
    `shared` 100 where another thread at least `SHARING_BUSY_PCT` busy in the same sample
    last ran on the same physical core (the same CPU or an SMT sibling), else 0; `with`
    the thread that did so most often. None without CPU ids or topology."""
    cores, threads = samples.get("cpu_core") or {}, samples.get("threads", {})
    me = threads.get(thread)
    if not cores or not me or "cpu" not in me:
        return None
    busy: dict[float, list[tuple[str, str | None]]] = {}
    for k, v in threads.items():
        if k != thread and "cpu" in v:
            for t, p, c in zip(v["t"], v["pct"], v["cpu"]):
                if p >= SHARING_BUSY_PCT:
                    busy.setdefault(t, []).append((k, cores.get(str(c))))
    shared, who = [], Counter()
    for t, c in zip(me["t"], me["cpu"]):
        core = cores.get(str(c))
        hits = [k for k, other in busy.get(t, ()) if core is not None and other == core]
        who.update(hits)
        shared.append(100.0 if hits else 0.0)
    return {"t": me["t"], "shared": shared, "with": who.most_common(1)[0][0] if who else None}


def machine_summary(samples: dict | None, lines: list[dict], batch: int | None) -> dict | None:
    """`machine_samples` of a run over its steady decode window (from the first to the last
    decode log line at `batch` running, else of all lines; timed by the log sizes, else
    by the lines' whole seconds): the GPU's median and 10th-percentile SM clock, median
    power and use; the busiest thread of the server's processes (highest median CPU %)
    with its median and 90th percentile, and the busiest thread outside them (the
    client's, the stage's). With timed lines, `phases`: the intervals slower than
    `SLOW_STEP` times the fast mode against the others, each with its median step, and
    the SM clock and the busiest server thread's CPU share sampled nearest to them; with
    the CPUs threads ran on, `busiest_thread_shared_core_pct` (`core_sharing`: how often
    another busy thread ran on its physical core; `..._with`: which, most often), in the
    phases too. None without samples or decode lines."""
    at = [ln for ln in lines if ln["running"] == batch] or lines
    if not samples or not at:
        return None
    seen = line_times(samples, at)
    if seen and seen[0] is not None and seen[-1] is not None:
        t0, t1 = seen[0] - samples["period_s"], seen[-1] + 1e-3
    else:
        seen = None
        secs = [datetime.strptime(ln["time"], "%Y-%m-%d %H:%M:%S").timestamp() for ln in at]
        t0, t1 = min(secs), max(secs) + 1.0  # the log's times are whole seconds

    def inside(series: dict, key: str) -> list[float]:
        return [v for t, v in zip(series["t"], series[key]) if t0 <= t < t1 and v is not None]

    out: dict = {"window_s": t1 - t0}
    gpu = samples.get("gpu")
    if gpu:
        sm = inside(gpu, "sm_mhz")
        out |= {
            "sm_mhz": pct(sm, 50),
            "sm_mhz_p10": pct(sm, 10),
            "power_w": pct(inside(gpu, "power_w"), 50),
            "util_pct": pct(inside(gpu, "util_pct"), 50),
        }
    server = {str(p) for p in samples.get("server_pids", [])}
    busy = {k: inside(v, "pct") for k, v in samples.get("threads", {}).items()}
    busy = {k: v for k, v in busy.items() if v}
    for label, keep in (("busiest_thread", True), ("busiest_other_thread", False)):
        of = {k: v for k, v in busy.items() if (k.split("/", 1)[0] in server) == keep}
        if of:
            name = max(of, key=lambda k: pct(of[k], 50))
            out |= {label: name, f"{label}_pct": pct(of[name], 50)}
            out[f"{label}_pct_p90"] = pct(of[name], 90)
    sharing = core_sharing(samples, out["busiest_thread"]) if "busiest_thread" in out else None
    if sharing is not None:
        inside_shared = inside(sharing, "shared")
        out["busiest_thread_shared_core_pct"] = (
            statistics.fmean(inside_shared) if inside_shared else None
        )
        out["busiest_thread_shared_core_with"] = sharing["with"]
    if seen and len(at) > 2:
        out["phases"] = _phases(samples, at[1:], seen[1:], out.get("busiest_thread"), sharing)
    return out


def _phases(
    samples: dict, lines: list[dict], seen: list, thread: str | None, sharing: dict | None
) -> dict:
    """Slow and fast decode intervals (see `machine_summary`) side by side."""
    steps = [interval_step_ms(ln) for ln in lines]
    fast = pct([x for x in steps if x], 10)
    out: dict = {
        "fast_mode_step_ms": fast,
        "slow_above_ms": None if fast is None else SLOW_STEP * fast,
    }
    if fast is None:
        return out
    gpu, threads = samples.get("gpu"), samples.get("threads", {})
    for name, slow in (("slow", True), ("fast", False)):
        idx = [
            i
            for i, x in enumerate(steps)
            if x and seen[i] is not None and (x > SLOW_STEP * fast) == slow
        ]
        group = {"intervals": len(idx), "step_ms": pct([steps[i] for i in idx], 50)}
        if idx and gpu:
            group["sm_mhz"] = pct([_nearest(gpu, "sm_mhz", seen[i]) for i in idx], 50)
            group["power_w"] = pct([_nearest(gpu, "power_w", seen[i]) for i in idx], 50)
        if idx and thread in threads:
            group["busiest_thread_pct"] = pct(
                [_nearest(threads[thread], "pct", seen[i]) for i in idx], 50
            )
        if idx and sharing is not None and sharing["t"]:
            group["busiest_thread_shared_core_pct"] = statistics.fmean(
                [_nearest(sharing, "shared", seen[i]) for i in idx]
            )
        out[name] = group
    return out


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
    """One record per request of a `bench_serving --output-details` result (or
    `driver.run_chat`'s), matched to its task by prompt token count. `score(text, task)`
    and `answer_ids(text)` come from the tokenizer (workloads.is_correct / answer_ids).
    A record keeps the prompt tokens served from the prefix cache when the client
    reported them (`cached_tokens`), its task's document or conversation (`group`) and
    turn, and when the client says so, when it was sent and answered."""
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
        row = {k: task[k] for k in ("group", "turn") if k in task}
        row |= {k: bench[k][i] for k in ("cached_tokens", "sent_s", "returned_s") if k in bench}
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
            | row
        )
    return rows


def phases(bench: dict, ok: list[dict]) -> dict | None:
    """A run whose requests were all sent at once, in two phases: until the last request
    has its first token (`intake_s`: every prompt prefilled, decode steps interleaved),
    and from then to the last answer (`after_intake_s`: decode steps only). Which of the
    two makes one system slower than another."""
    ttfts = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    if not ttfts or bench.get("duration") is None:
        return None
    return {"intake_s": max(ttfts), "after_intake_s": bench["duration"] - max(ttfts)}


def run_metrics(
    bench: dict,
    rows: list[dict],
    decode_lines: list[dict],
    batch: int | None,
    prefill_lines: list[dict] | None = None,
) -> dict:
    """Throughput, latency and decode-step figures of one timed run, the server's own
    prefill rate, with `batch` (all sent at once) its two phases, what the prefix cache
    served, and for a chat the TTFT of each turn."""
    ok = [r for r in rows if r["error"] is None]
    metrics = {
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
        "server_prefill": prefill_rate(prefill_lines or []),
        "phases": phases(bench, ok) if batch else None,
        "peak_running": max([ln["running"] for ln in decode_lines], default=0),
        "max_concurrent_client": bench.get("max_concurrent_requests"),
        "accuracy": (sum(r["correct"] for r in rows) / len(rows)) if rows else None,
        "prefix_cache": prefix_cache(ok),
    }
    if bench.get("idle_duration"):  # arrivals over time: no server serves more than this
        out = sum(r["output_len"] for r in ok)
        metrics["output_tok_s_ceiling"] = out / bench["idle_duration"]
    by_turn: dict[int, list[float]] = {}
    for r in ok:
        if r.get("turn") is not None:
            by_turn.setdefault(r["turn"], []).append(r["ttft_s"])
    if by_turn:
        metrics["ttft_by_turn"] = {str(t): stats(v) for t, v in sorted(by_turn.items())}
    return metrics


def prefix_cache(rows: list[dict]) -> dict | None:
    """Prompt tokens of the answered requests, those the server served from its prefix
    cache, and the fraction; None when the client reported no cached tokens."""
    if not rows or any(r.get("cached_tokens") is None for r in rows):
        return None
    prompt = sum(r["prompt_len"] for r in rows)
    cached = sum(r["cached_tokens"] for r in rows)
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_fraction": cached / prompt if prompt else None,
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


RANKS = ("rows_ranked", "rows_kept_slot")  # server info: decode rows ranked, rows kept


def counter_delta(before: dict | None, after: dict | None) -> dict:
    """KV fraction read over the timed window (`kv_fraction_scope` "window": the blocks
    read and readable between the two readings; "server life", warm-up and any earlier
    workload on the same server included, where the server reports only its cumulative
    fraction), the HBM hit rate over the window (at the tiered home the (layer, KV head,
    block) units decode read from HBM over all units it read) and, with a host tier, what
    the write-back saved in the window (blocks, bytes, engine restarts, jobs still
    unacknowledged at the end) and, where a selection is kept across steps, the share of
    the window's decode rows in a kept slot that scored and ranked (`rank_fraction`:
    1 / `--psa-rerank-interval` when only the interval's steps rank)."""
    a, b = psa_counters(after), psa_counters(before)
    if a is None:
        return {"kv_fraction_read": 1.0, "hbm_hit_rate": None}
    fraction, scope = a.get("blocks_read_fraction"), "server life"
    if b and all(
        isinstance(c.get(k), int) for c in (a, b) for k in ("blocks_read", "blocks_readable")
    ):
        readable = a["blocks_readable"] - b["blocks_readable"]
        if readable > 0:
            fraction, scope = (a["blocks_read"] - b["blocks_read"]) / readable, "window"
    hit = None
    ca, cb = a.get("residency"), (b or {}).get("residency")
    if ca and cb:
        hits = ca["units_read_hbm"] - cb["units_read_hbm"]
        host = ca["units_read_host"] - cb["units_read_host"]
        hit = hits / (hits + host) if hits + host else None
    out = {"kv_fraction_read": fraction, "kv_fraction_scope": scope, "hbm_hit_rate": hit}
    if b and all(isinstance(c.get(k), int) for c in (a, b) for k in RANKS):
        ranked, slotted = (a[k] - b[k] for k in RANKS)
        if slotted > 0:  # how often a kept selection was scored and ranked again
            out["rank_fraction"] = ranked / slotted
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
        "psa_host_timing": state.get("psa_host_timing"),
        "psa_plugin_timing": state.get("psa_plugin_timing"),
        "psa_host_profile": state.get("psa_host_profile"),
    }


def residency_sample(info: dict | None) -> dict | None:
    """What a timed run's periodic `/get_server_info` keeps of an sglang-psa server (how
    HBM is shared out under load): the running requests, SGLang's free, tree-cached and
    request-held KV tokens, and at the tiered home the evicted blocks, unit-cache pages and
    the units decode read from HBM and from the host tier so far. None for a server
    without the plugin's block."""
    psa = (((info or {}).get("internal_states") or [{}])[0] or {}).get("psa")
    if not psa:
        return None
    res = psa.get("residency") or {}
    keys = ("blocks_evicted", "cache_pages", "units_read_hbm", "units_read_host")
    return {
        "running": psa.get("running"),
        "kv_available_tokens": psa.get("kv_available_tokens"),
        "kv_cached_tokens": psa.get("kv_cached_tokens"),
        "kv_held_tokens": psa.get("kv_held_tokens"),
        **{k: res.get(k) for k in keys},
    }


HOST_PHASES = ("schedule", "launch", "gpu_wait", "results")


def host_loop(before: dict | None, after: dict | None, min_iterations: int = 10) -> dict:
    """The scheduler loop's host time per decode iteration over the window between two
    server-info digests (`psa_host_timing`, sums per `decode/<batch size>`), for each
    decode batch size with at least `min_iterations` iterations in it: milliseconds per
    iteration (`iteration_ms`, the step as the loop saw it), per phase, `other_ms` (the
    rest: receiving requests) and `host_ms` (the iteration less `gpu_wait_ms`: the host's
    own time). {} where the servers did not time their loops."""
    a = (after or {}).get("psa_host_timing") or {}
    b = (before or {}).get("psa_host_timing") or {}
    out = {}
    for key, sums in a.items():
        kind, _, size = key.partition("/")
        prev = b.get(key, {})
        n = sums["n"] - prev.get("n", 0)
        if kind != "decode" or n < min_iterations:
            continue
        ms = {p: 1e3 * (sums[f"{p}_s"] - prev.get(f"{p}_s", 0.0)) / n
              for p in ("iteration", *HOST_PHASES)}  # fmt: skip
        row = {"iterations": n} | {f"{p}_ms": v for p, v in ms.items()}
        row["other_ms"] = ms["iteration"] - sum(ms[p] for p in HOST_PHASES)
        row["host_ms"] = ms["iteration"] - ms["gpu_wait"]
        out[size] = row
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def plugin_time(before: dict | None, after: dict | None) -> dict:
    """The plugin's own host time in the scheduler loop over the window between two
    server-info digests (`psa_plugin_timing`): per entry point (a hook less SGLang's part
    of it, or a plugin function; `serving.*` are parts of the hooks' times), its calls and
    milliseconds in all, largest first; `gc.gen0`-`gc.gen2` are Python's collections in
    the scheduler process (plain servers too), not the plugin's work. {} where the servers
    did not time their loops."""
    a = (after or {}).get("psa_plugin_timing") or {}
    b = (before or {}).get("psa_plugin_timing") or {}
    out = {}
    for name, sums in a.items():
        prev = b.get(name, {})
        n = sums["n"] - prev.get("n", 0)
        if n > 0:
            out[name] = {"calls": n, "ms": 1e3 * (sums["s"] - prev.get("s", 0.0))}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def layer_reads(before: dict | None, after: dict | None) -> list[dict]:
    """Per layer over the window between two server-info digests (`psa.reads_by_layer`):
    the share of its (layer, KV head, block) units decode read (`read_share`) and of
    those the share read from the host tier (`host_share`, the tiered home's misses).
    [] where the servers do not report it."""
    a = ((after or {}).get("psa") or {}).get("reads_by_layer")
    if not a:
        return []
    keys, n = ("read", "readable", "host"), len(a["read"])
    b = ((before or {}).get("psa") or {}).get("reads_by_layer") or {}
    prev = {k: b.get(k) or [0] * n for k in keys}
    out = []
    for i in range(n):
        read, total, host = (a[k][i] - prev[k][i] for k in keys)
        out.append({
            "layer": i, "units_read": read,
            "read_share": read / total if total else None,
            "host_share": host / read if read else None,
        })  # fmt: skip
    return out


def host_profile(before: dict | None, after: dict | None, loop: dict, top: int = 20) -> dict:
    """Where the scheduler loop's host time went, per decode batch size that `loop`
    (`host_loop`'s rows of the same window) times: the sampling profile's counts between
    two server-info digests (`psa_host_profile`), each sample worth the window's
    iteration time over its samples. Per size: `samples`, `phase_ms` (per iteration),
    `self_ms` (the `top` innermost functions, any phase) and `inclusive_ms` (per phase,
    the `top` functions on the stack). {} where the servers were not profiled."""
    a = (after or {}).get("psa_host_profile") or {}
    b = (before or {}).get("psa_host_profile") or {}
    out = {}
    for key, prof in a.items():
        kind, _, size = key.partition("/")
        if kind != "decode" or size not in loop:
            continue
        row = _profiled(prof, b.get(key, {}), loop[size]["iteration_ms"], top)
        if row is not None:
            out[size] = row
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def extend_host_profile(before: dict | None, after: dict | None, top: int = 20) -> dict:
    """`host_profile` of the window's extend (prefill) iterations, every batch size
    together (the profile files them under `"extend"`): `iterations`, `iteration_ms` (the
    mean of the loop's own timing, `psa_host_timing`'s `extend/<size>` sums), `samples`,
    and per extend iteration `phase_ms`, `self_ms` and `inclusive_ms`. {} where the
    servers were not profiled or ran no extend in the window."""
    prof = ((after or {}).get("psa_host_profile") or {}).get("extend")
    if not prof:
        return {}
    a = (after or {}).get("psa_host_timing") or {}
    b = (before or {}).get("psa_host_timing") or {}
    n = secs = 0.0
    for key, sums in a.items():
        if key.startswith("extend/"):
            prev = b.get(key, {})
            n += sums["n"] - prev.get("n", 0)
            secs += sums["iteration_s"] - prev.get("iteration_s", 0.0)
    if n <= 0:
        return {}
    ms = 1e3 * secs / n
    prev = ((before or {}).get("psa_host_profile") or {}).get("extend", {})
    row = _profiled(prof, prev, ms, top)
    return {} if row is None else {"iterations": int(n), "iteration_ms": ms} | row


def _profiled(prof: dict, prev: dict, iteration_ms: float, top: int) -> dict | None:
    """One batch key's profile over a window (`prof` less `prev`, two snapshots), each
    sample worth the window's `iteration_ms` over its samples (see `host_profile`); None
    when the window holds no sample."""
    n = prof["samples"] - prev.get("samples", 0)
    if n <= 0:
        return None
    each = iteration_ms / n
    was = prev.get("functions", {})
    fns = {}
    for name, (incl, own) in prof["functions"].items():
        i0, s0 = was.get(name, (0, 0))
        if incl > i0:
            fns[name] = (incl - i0, own - s0)
    phases = {
        ph: (c - prev.get("phases", {}).get(ph, 0)) * each for ph, c in prof["phases"].items()
    }

    def most(counts):  # (name, count) pairs, most first, ties by name
        return sorted(counts, key=lambda kv: (-kv[1], kv[0]))[:top]

    by_self = most((f, own) for f, (_, own) in fns.items() if own > 0)
    inclusive = {
        ph: [
            {"fn": f.partition("|")[2], "ms": i * each}
            for f, i in most((f, i) for f, (i, _) in fns.items() if f.startswith(ph + "|"))
        ]
        for ph in phases
    }
    return {
        "samples": n,
        "phase_ms": dict(sorted(phases.items(), key=lambda kv: -kv[1])),
        "self_ms": [
            {"phase": f.partition("|")[0], "fn": f.partition("|")[2], "ms": own * each}
            for f, own in by_self
        ],
        "inclusive_ms": inclusive,
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
    # Against the fastest plain SGLang backend of the same stage run (`fastest_plain`).
    "plain_backend",
    "plain_backend_a16",
    "plain_backend_8b",
    "decode_step_ratio_psa_vs_fastest",
    "decode_step_ratio_topk_vs_fastest",
    "decode_step_ratio_topk_r8_vs_fastest",
    "throughput_ratio_topk_r8_vs_fastest",
    "decode_step_ratio_eps1_vs_fastest",
    "decode_step_ratio_psa_r1_vs_fastest",
    "decode_step_ratio_psa_r1_vs_fastest_a16",
    "decode_step_ratio_psa_vs_fastest_a16",
    "decode_step_ratio_topk_vs_fastest_a16",
    "decode_step_ratio_topk_vs_fastest_8b",
    "throughput_ratio_psa_vs_fastest",
    "throughput_ratio_psa_vs_fastest_a16",
    "ttft_ratio_psa_vs_fastest",
    "accuracy_delta_vs_fastest",
    # 64-token answers identical to plain SGLang's (triton), psa's beside a second plain
    # server's (batched greedy decoding does not repeat itself exactly), one a16 run.
    "identical_fraction_server_psa",
    "identical_fraction_server_plain_vs_plain",
    "accuracy_delta_psa_vs_plain_1p5b",
    "accuracy_delta_topk_vs_plain_1p5b",
    "identical_fraction_server_psa_1p5b",
    "identical_fraction_server_plain_vs_plain_1p5b",
    # The certified rule served (`psa_certified`, a16, its coverage audited every step):
    # the KV fraction it read and the smallest share of a head's true mass it covered.
    "kv_fraction_certified_server_16k",
    "certified_server_min_true_coverage",
    # Capacity (workloads b and b256: HBM for KV capped to plain's 4 requests): the tiered
    # home against the fastest plain backend of one run (the *_capped keys above: triton).
    "throughput_ratio_tiered_vs_fastest_capped",
    "throughput_ratio_tiered_vs_fastest_capped_short",
    # Prefix caching (workloads f, g and their capped variants): the tiered home against
    # the fastest plain backend or plain SGLang's host tier at its fastest backend
    # (plain_hicache, plain_hicache_fa3) of one run.
    "throughput_ratio_tiered_vs_fastest_shared",
    "throughput_ratio_tiered_vs_fastest_shared_capped",
    "throughput_ratio_tiered_vs_hicache_shared_capped",
    "throughput_ratio_tiered_vs_fastest_chat",
    "throughput_ratio_tiered_vs_fastest_chat_capped",
    "throughput_ratio_tiered_vs_hicache_chat_capped",
    "ttft_ratio_tiered_vs_fastest_chat",
    "ttft_ratio_tiered_vs_fastest_chat_capped",
    "ttft_ratio_tiered_vs_fastest_shared",
    "tpot_ratio_tiered_vs_fastest_shared",
    "prefix_hit_fraction_tiered_shared",
    "prefix_hit_fraction_fastest_shared",
    "prefix_hit_fraction_tiered_chat",
    "prefix_hit_fraction_fastest_chat",
    # What bounds the prefix keys: the most any server could serve (the run's output over
    # its idle duration: a chat's last start plus its think times, every answer at once;
    # f's last request's send: `output_tok_s_ceiling`) over the reference's output tok/s,
    # in the run of the matching throughput key. A target above it is out of reach of
    # every server.
    "throughput_ceiling_ratio_vs_fastest_shared",
    "throughput_ceiling_ratio_vs_fastest_shared_capped",
    "throughput_ceiling_ratio_vs_hicache_shared_capped",
    "throughput_ceiling_ratio_vs_fastest_chat",
    "throughput_ceiling_ratio_vs_fastest_chat_capped",
    "throughput_ceiling_ratio_vs_hicache_chat_capped",
)

STEP = ("metrics", "steady_decode", "step_ms")
TOK_S = ("metrics", "output_tok_s")
TTFT_P99 = ("metrics", "ttft_s", "p99")
TTFT_MEAN = ("metrics", "ttft_s", "mean")
TPOT_P50 = ("metrics", "tpot_s", "p50")
PEAK = ("metrics", "peak_running")
HIT = ("metrics", "prefix_cache", "hit_fraction")
CEILING = ("metrics", "output_tok_s_ceiling")
SAME = ("identical_to_plain", "identical")
TEST_MODEL = "qwen2.5-0.5b"  # sglang_psa.models.DEFAULT_MODEL: the scored answers' model
SECOND_MODEL = "qwen2.5-1.5b"  # workloads.QWEN_1P5B: the *_1p5b keys' (a16_1p5b, a_1p5b)
READ = ("counters", "kv_fraction_read")
COVERAGE = ("server_info_after", "psa", "coverage_audit", "min_true_coverage")


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


@dataclass(frozen=True)
class Measured:
    """One system's timed run at one rate, with the stage run (part) that measured it."""

    part: dict
    system: str
    rate: str

    @property
    def run(self) -> dict:
        return _runs(self.part["systems"][self.system])[self.rate]

    @property
    def stage_run(self) -> tuple[str, str]:
        return (self.part["workload"], self.part["run_id"])

    def metric(self, path: tuple[str, ...]):
        value = self.run
        for k in path:  # a metric the run did not record is None
            if not isinstance(value, dict):
                return None
            value = value.get(k)
        return value


def measured(part: dict | None, system: str, rate: str = "inf") -> Measured | None:
    """`system`'s run at `rate` in `part`, or None when the part did not measure it."""
    if part is None or rate not in _runs(part["systems"].get(system)):
        return None
    return Measured(part, system, rate)


# The SGLang release of a part that does not record one (`software.sglang`): parts
# from before the plugin served a second release ran on this one.
DEFAULT_SGLANG = "0.5.17"


def sglang_of(part: dict) -> str:
    """The SGLang release a stage part ran on (parts from before it was recorded: 0.5.17)."""
    return (part.get("software") or {}).get("sglang", DEFAULT_SGLANG)


def provenance_of(*runs: Measured, **extra) -> dict:
    """Where a summary value comes from: its stage run (workload, run id, commit, date) and
    the systems it compares, numerator first."""
    p = runs[0].part
    return {
        "workload": p["workload"],
        "run_id": p["run_id"],
        "git_commit": p["git_commit"],
        "date": p["date"],
        "systems": [m.system for m in runs],
        "rate": runs[0].rate,
        "sglang": sglang_of(p),
    } | extra


def same_run_ratio(
    num: Measured | None, den: Measured | None, path: tuple[str, ...]
) -> tuple[float | None, dict | None]:
    """num / den of the metric at `path`, and its provenance; (None, None) unless both were
    measured in one stage run (the same part: workload and run id) at the same rate. This
    is the only way a summary ratio is made: two systems from different runs, or at
    different rates, give no value."""
    if num is None or den is None:
        return None, None
    if num.stage_run != den.stage_run or num.part is not den.part or num.rate != den.rate:
        return None, None
    a, b = num.metric(path), den.metric(path)
    if a is None or b in (None, 0):
        return None, None
    return a / b, provenance_of(num, den, metric=_metric_name(path))


def _metric_name(path: tuple[str, ...]) -> str:
    return ".".join(path[1:] if path[0] == "metrics" else path)


def same_run_value(
    pair: tuple[Measured | None, Measured | None], which: int, path: tuple[str, ...]
) -> tuple[float | None, dict | None]:
    """The metric at `path` of one system of `pair` (`which`: 0 or 1), and its provenance
    (the pair, and `of` naming that system); (None, None) unless both systems of the pair
    were measured in one stage run at the same rate: a figure that sits beside a summary
    ratio comes from the run that ratio comes from."""
    num, den = pair
    if num is None or den is None or num.part is not den.part or num.rate != den.rate:
        return None, None
    value = pair[which].metric(path)
    if value is None:
        return None, None
    return value, provenance_of(num, den, metric=_metric_name(path), of=pair[which].system)


def _pair_measured(best, workload: str, system: str, rate: str = "inf"):
    """The system's newest run at `rate`, and plain SGLang's (triton) run at that rate in
    the same part (the same stage run), each a Measured or None."""
    p = best.get((workload, system, rate))
    return measured(p, system, rate), measured(p, "plain", rate)


def _pair(best, workload: str, system: str, rate: str = "inf") -> tuple[dict | None, ...]:
    """`_pair_measured` as the timed runs themselves (benchmark/decode_step reads these)."""
    return tuple(m.run if m else None for m in _pair_measured(best, workload, system, rate))


def newest_with(parts: list[dict], workload: str, *systems: str, rate: str = "inf"):
    """The newest part of `workload` that measured every one of `systems` at `rate`."""
    found = [
        p for p in parts if p["workload"] == workload and all(measured(p, s, rate) for s in systems)
    ]
    return max(found, key=lambda p: p["date"], default=None)


def plain_race(part: dict, rate: str = "inf") -> dict | None:
    """The plain SGLang backends a stage run raced (`systems.PLAIN_RACE`), each with its
    output throughput, steady decode step and p99 TTFT (or its error), and the fastest:
    the highest output throughput. None unless the run tried every backend of the race and
    one of them completed: a stage that ran plain triton alone names no fastest."""
    if not all(name in part["systems"] for name in PLAIN_RACE):
        return None
    backends, fastest = {}, None
    for name in PLAIN_RACE:
        m = measured(part, name, rate)
        if m is None:
            backends[name] = {"error": (part["systems"][name].get("error") or "not at this rate")}
            continue
        backends[name] = {
            "output_tok_s": m.metric(TOK_S),
            "step_ms": m.metric(STEP),
            "ttft_mean_s": m.metric(TTFT_MEAN),
            "ttft_p99_s": m.metric(TTFT_P99),
        }
        tok_s = m.metric(TOK_S)
        if tok_s is not None and (fastest is None or tok_s > fastest.metric(TOK_S)):
            fastest = m
    if fastest is None:
        return None
    return {
        "workload": part["workload"],
        "run_id": part["run_id"],
        "rule": "highest output tok/s",
        "fastest": fastest.system,
        "backends": backends,
    }


def fastest_plain(part: dict | None, rate: str = "inf") -> Measured | None:
    """The fastest plain SGLang backend of a stage run (`plain_race`), or None."""
    race = plain_race(part, rate) if part is not None else None
    return measured(part, race["fastest"], rate) if race else None


FASTEST = "fastest"  # a pair's reference: the fastest plain backend its stage run raced
HICACHE = "hicache"  # ... the fastest of SGLang's host tier at the backends the run measured


def fastest_hicache(part: dict, rate: str) -> Measured | None:
    """The highest output throughput of `systems.HICACHE_RACE` that `part` measured at
    `rate` (a run of the triton one alone, as recorded before FA3's, counts), or None."""
    runs = [m for name in HICACHE_RACE if (m := measured(part, name, rate)) is not None]
    runs = [m for m in runs if m.metric(TOK_S) is not None]
    return max(runs, key=lambda m: m.metric(TOK_S), default=None)


def reference(part: dict, ref: str, rate: str) -> Measured | None:
    """`ref`'s run at `rate` in `part`: `FASTEST`, the fastest plain backend the run raced
    (`fastest_plain`), `HICACHE`, SGLang's host tier at its fastest backend there
    (`fastest_hicache`), else the system named."""
    if ref == FASTEST:
        return fastest_plain(part, rate)
    if ref == HICACHE:
        return fastest_hicache(part, rate)
    return measured(part, ref, rate)


def newest_pair(
    parts: list[dict], workload: str, system: str, ref: str = FASTEST
) -> tuple[Measured | None, Measured | None]:
    """`system`'s run and the reference's (`reference`), both from the newest stage run of
    `workload` that measured the two at one rate (the highest rate they share there)."""
    found = []
    for p in parts:
        if p["workload"] != workload:
            continue
        rates = [r for r in _runs(p["systems"].get(system)) if reference(p, ref, r)]
        if rates:
            found.append((p, max(rates, key=float)))
    if not found:
        return None, None
    part, rate = max(found, key=lambda f: f[0]["date"])
    return measured(part, system, rate), reference(part, ref, rate)


def vs_fastest(parts: list[dict], workload: str, system: str) -> tuple[Measured | None, ...]:
    """`system`'s run and the fastest plain backend's, both from the newest stage run of
    `workload` that raced the plain backends and measured `system`."""
    return newest_pair(parts, workload, system)


def tiered_pair(
    parts: list[dict], workload: str, ref: str = FASTEST
) -> tuple[Measured | None, Measured | None]:
    """`newest_pair` of the tiered home (by its default write-back first: `TIERED`)."""
    for home in TIERED:
        pair = newest_pair(parts, workload, home, ref)
        if pair[0] is not None:
            return pair
    return None, None


# sglang-psa with a host tier: with its prefix cache where a run measured it (f, g), else
# the default write-back first
TIERED = ("psa_tiered_prefix", "psa_tiered_uva", "psa_tiered")
FASTEST_KEYS = (  # (key, workload, system, metric)
    ("decode_step_ratio_psa_vs_fastest", "a", "psa", STEP),
    ("decode_step_ratio_topk_vs_fastest", "a", "topk", STEP),
    # topk's default since --psa-rerank-interval 8 (topk above: ranked every step)
    ("decode_step_ratio_topk_r8_vs_fastest", "a", "topk_r8", STEP),
    ("throughput_ratio_topk_r8_vs_fastest", "a", "topk_r8", TOK_S),
    ("decode_step_ratio_eps1_vs_fastest", "a", "psa_eps1", STEP),
    # psa ranked every step (psa above: its selection kept 8 steps, the default since)
    ("decode_step_ratio_psa_r1_vs_fastest", "a", "psa_r1", STEP),
    ("decode_step_ratio_psa_r1_vs_fastest_a16", "a16", "psa_r1", STEP),
    ("decode_step_ratio_psa_vs_fastest_a16", "a16", "psa", STEP),
    ("decode_step_ratio_topk_vs_fastest_a16", "a16", "topk", STEP),
    ("decode_step_ratio_topk_vs_fastest_8b", "d", "topk", STEP),
    ("throughput_ratio_psa_vs_fastest", "a", "psa", TOK_S),
    ("throughput_ratio_psa_vs_fastest_a16", "a16", "psa", TOK_S),
    ("ttft_ratio_psa_vs_fastest", "a", "psa", TTFT_MEAN),  # the issue's target: mean TTFT
)
PLAIN_BACKEND_KEYS = {"plain_backend": "a", "plain_backend_a16": "a16", "plain_backend_8b": "d"}
PREFIX_KEYS = (  # (key, workload, reference, metric): the tiered home against the reference
    # (capacity, b and b256, then prefix caching)
    ("throughput_ratio_tiered_vs_fastest_capped", "b", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_fastest_capped_short", "b256", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_fastest_shared", "f", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_fastest_shared_capped", "f_capped", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_hicache_shared_capped", "f_capped", HICACHE, TOK_S),
    ("throughput_ratio_tiered_vs_fastest_chat", "g", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_fastest_chat_capped", "g_capped", FASTEST, TOK_S),
    ("throughput_ratio_tiered_vs_hicache_chat_capped", "g_capped", HICACHE, TOK_S),
    ("ttft_ratio_tiered_vs_fastest_chat", "g", FASTEST, TTFT_MEAN),  # every turn's
    ("ttft_ratio_tiered_vs_fastest_chat_capped", "g_capped", FASTEST, TTFT_MEAN),
    # f's throughput is its offered load's at every server: its latency tells them apart
    ("ttft_ratio_tiered_vs_fastest_shared", "f", FASTEST, TTFT_MEAN),
    ("tpot_ratio_tiered_vs_fastest_shared", "f", FASTEST, TPOT_P50),  # a request's median
)
CEILING_KEYS = (  # (key, workload, reference): the tiered run's ceiling over the reference
    ("throughput_ceiling_ratio_vs_fastest_shared", "f", FASTEST),
    ("throughput_ceiling_ratio_vs_fastest_shared_capped", "f_capped", FASTEST),
    ("throughput_ceiling_ratio_vs_hicache_shared_capped", "f_capped", HICACHE),
    ("throughput_ceiling_ratio_vs_fastest_chat", "g", FASTEST),
    ("throughput_ceiling_ratio_vs_fastest_chat_capped", "g_capped", FASTEST),
    ("throughput_ceiling_ratio_vs_hicache_chat_capped", "g_capped", HICACHE),
)
HIT_KEYS = (  # (key, workload, which of (tiered home, fastest plain) in one run)
    ("prefix_hit_fraction_tiered_shared", "f", 0),
    ("prefix_hit_fraction_fastest_shared", "f", 1),
    ("prefix_hit_fraction_tiered_chat", "g", 0),
    ("prefix_hit_fraction_fastest_chat", "g", 1),
)


def summarize(parts: list[dict]) -> tuple[dict, dict]:
    """The issue's summary keys and, for each key with a value, where it comes from.

    Every ratio is `same_run_ratio`: two systems of one stage run (part) at one rate; a
    key whose systems were not measured in one run is None. The *_vs_plain keys compare
    with plain SGLang at triton (`plain`), the *_vs_fastest keys with the fastest plain
    backend of the newest stage run that raced them all (`plain_race`; `plain_backend*`
    name it). `ttft_p99_ratio_host_vs_hbm` and `throughput_ratio_tiered_vs_hbm` compare
    the two sglang-psa homes (tiered, HBM only) in the newest run that measured both.
    The capacity and prefix-caching keys (`PREFIX_KEYS`) take the tiered home against the
    fastest plain backend or SGLang's host tier at its fastest measured backend
    (`fastest_hicache`) from the newest run of b, b256, f, g or the capped variants of f
    and g that measured both at one rate; `prefix_hit_fraction_*` are the tiered home's and the
    fastest plain backend's cached prompt tokens in the run of the matching
    `throughput_ratio_tiered_vs_fastest_*` key, and have no value without it.
    """
    best = latest_runs(parts)
    s: dict[str, float | str | None] = {}
    prov: dict[str, dict] = {}

    def put(key: str, value_prov: tuple) -> None:
        s[key], where = value_prov
        if where is not None:
            prov[key] = where

    for mode in ("psa", "topk"):
        put(
            f"decode_step_ratio_{mode}_vs_plain",
            same_run_ratio(*_pair_measured(best, "a", mode), STEP),
        )
    put("throughput_ratio_psa_vs_plain", same_run_ratio(*_pair_measured(best, "a", "psa"), TOK_S))
    # The host tier under capped HBM: the tiered home, by its default write-back first.
    for home in TIERED:
        run, plain = _pair_measured(best, "b", home)
        ratio = same_run_ratio(run, plain, TOK_S)
        if ratio[0] is not None:
            break
    put("throughput_ratio_host_vs_plain_capped", ratio)
    s["throughput_ratio_host_vs_plain_capped_system"] = home if ratio[0] is not None else None
    # Its p99 TTFT against plain's in the same run: the throughput must not come from
    # making the queue wait longer.
    put("ttft_p99_ratio_host_vs_plain_capped", same_run_ratio(run, plain, TTFT_P99))
    # The same store under the fixed top-k budget: what the store gives a policy that reads
    # less (a reference beside the default psa policy's figure above, not a replacement).
    put(
        "throughput_ratio_host_vs_plain_capped_topk",
        same_run_ratio(*_pair_measured(best, "b", "topk_tiered"), TOK_S),
    )
    for which in ("strict", "relaxed"):
        put(f"goodput_ratio_vs_plain_{which}", sweep_ratio(parts, "psa", f"goodput_{which}"))
    both = next((p for h in TIERED if (p := newest_with(parts, "a", h, "psa"))), None)
    home = next((h for h in TIERED if measured(both, h)), None)
    host, hbm = (measured(both, home), measured(both, "psa")) if home else (None, None)
    put("ttft_p99_ratio_host_vs_hbm", same_run_ratio(host, hbm, TTFT_P99))
    put("throughput_ratio_tiered_vs_hbm", same_run_ratio(host, hbm, TOK_S))
    put("accuracy_delta_vs_plain", accuracy_delta(list(best.items()), "psa"))
    put(
        "decode_step_ratio_topk_vs_plain_8b",
        same_run_ratio(*_pair_measured(best, "d", "topk"), STEP),
    )
    run, plain = _pair_measured(best, "e", "topk_tiered")
    put("throughput_ratio_tiered_vs_plain_8b", same_run_ratio(run, plain, TOK_S))
    put("max_concurrent_ratio_tiered_vs_plain_8b", same_run_ratio(run, plain, PEAK))

    for key, workload in PLAIN_BACKEND_KEYS.items():
        put(key, plain_backend(parts, workload))
    for key, workload, system, path in FASTEST_KEYS:
        put(key, same_run_ratio(*vs_fastest(parts, workload, system), path))
    put("accuracy_delta_vs_fastest", accuracy_delta_vs_fastest(parts, "psa"))
    both = newest_with(parts, "a16", "psa", "plain_repeat", "plain")
    pair = (measured(both, "psa"), measured(both, "plain_repeat"))
    put("identical_fraction_server_psa", same_run_value(pair, 0, SAME))
    put("identical_fraction_server_plain_vs_plain", same_run_value(pair, 1, SAME))
    # The second real model (workloads a16_1p5b, a_1p5b): answers against plain (triton) in
    # the same run, identical completions beside a second plain server's.
    for system in ("psa", "topk"):
        put(
            f"accuracy_delta_{system}_vs_plain_1p5b",
            accuracy_delta(list(best.items()), system, model=SECOND_MODEL),
        )
    both = newest_with(parts, "a16_1p5b", "psa", "plain_repeat", "plain")
    pair = (measured(both, "psa"), measured(both, "plain_repeat"))
    put("identical_fraction_server_psa_1p5b", same_run_value(pair, 0, SAME))
    put("identical_fraction_server_plain_vs_plain_1p5b", same_run_value(pair, 1, SAME))
    both = newest_with(parts, "a16", "psa_certified", "plain")
    pair = (measured(both, "psa_certified"), measured(both, "plain"))
    put("kv_fraction_certified_server_16k", same_run_value(pair, 0, READ))
    put("certified_server_min_true_coverage", same_run_value(pair, 0, COVERAGE))
    for key, workload, ref, path in PREFIX_KEYS:
        put(key, same_run_ratio(*tiered_pair(parts, workload, ref), path))
    for key, workload, which in HIT_KEYS:
        put(key, same_run_value(tiered_pair(parts, workload), which, HIT))
    for key, workload, ref in CEILING_KEYS:
        run, other = tiered_pair(parts, workload, ref)
        ceiling = same_run_value((run, other), 0, CEILING)[0]
        tok_s = same_run_value((run, other), 1, TOK_S)[0]
        where = "output_tok_s_ceiling / output_tok_s"
        put(key, (ceiling / tok_s, provenance_of(run, other, metric=where))
            if ceiling and tok_s else (None, None))  # fmt: skip
    return {k: s.get(k) for k in SUMMARY_KEYS}, prov


def plain_backend(parts: list[dict], workload: str | None = None) -> tuple[str | None, dict | None]:
    """The fastest plain backend of the newest stage run (of `workload`; None: any) that
    raced them all, and where it comes from; (None, None) without such a run."""
    raced = [p for p in parts if workload in (None, p["workload"]) and fastest_plain(p)]
    newest = max(raced, key=lambda p: p["date"], default=None)
    if newest is None:
        return None, None
    race = plain_race(newest)
    return race["fastest"], provenance_of(fastest_plain(newest), **race)


def accuracy_delta_vs_fastest(parts: list[dict], system: str) -> tuple[float | None, dict | None]:
    """`accuracy_delta` of `system` against the fastest plain backend, over the newest run of
    workloads a and a16 that raced the plain backends and measured `system`."""
    pairs = []
    for workload in ("a", "a16"):
        run, fastest = vs_fastest(parts, workload, system)
        if run and fastest:
            pairs.append(((workload, system, "inf"), run.part))
    return accuracy_delta(pairs, system, fastest=True)


def sweep_ratio(parts: list[dict], system: str, key: str) -> tuple[float | None, dict | None]:
    """`system`'s `key` (a goodput) over plain SGLang's at the rate where plain's is
    highest (plain at its best), both from the newest stage run of workload c that measured
    the two at some common rate with `key`."""
    found = []
    for p in parts:
        if p["workload"] != "c":
            continue
        rates = [
            r
            for r in _runs(p["systems"].get("plain"))
            if (m := measured(p, system, r)) and key in m.run and key in measured(p, "plain", r).run
        ]
        if rates:
            found.append((p, rates))
    if not found:
        return None, None
    part, rates = max(found, key=lambda f: f[0]["date"])
    rate = max(rates, key=lambda r: measured(part, "plain", r).run[key])
    return same_run_ratio(measured(part, system, rate), measured(part, "plain", rate), (key,))


def accuracy_delta(
    pairs, system: str, fastest: bool = False, model: str = TEST_MODEL
) -> tuple[float | None, dict | None]:
    """`system`'s accuracy minus plain's over every scored prompt both answered in the same
    stage run, summed over `pairs` ((workload, system, rate), part) of `system` on the
    real model `model` (the test model by default; the 8B shape's random weights are never
    scored). Plain is `plain` (triton), or with `fastest` the fastest plain backend of each
    run."""
    ours = theirs = n = 0
    used = []
    for (_, name, rate), part in pairs:
        if name != system or part.get("config", {}).get("workload", {}).get("model") != model:
            continue
        run = measured(part, system, rate)
        ref = fastest_plain(part, rate) if fastest else measured(part, "plain", rate)
        if run is None or ref is None or run.stage_run != ref.stage_run:
            continue
        by_len = {r["prompt_len"]: r for r in ref.run["rows"]}
        k = 0
        for r in run.run["rows"]:
            q = by_len.get(r["prompt_len"])
            if q is None or r["error"] or q["error"]:
                continue
            ours += r["correct"]
            theirs += q["correct"]
            k += 1
        if k:
            n += k
            used.append(provenance_of(run, ref, prompts=k))
    if not n:
        return None, None
    return (ours - theirs) / n, {"runs": used, "prompts": n}


def restate_steady(parts: list[dict]) -> None:
    """Re-derive every run's steady decode step from its decode log with the current rule
    (`steady_step`), so that parts measured apart are read alike."""
    for p in parts:
        for rec in p["systems"].values():
            for rate, run in _runs(rec).items():
                if run.get("decode_log") and run.get("metrics"):
                    batch = rec.get("num_prompts") if rate == "inf" else None
                    run["metrics"]["steady_decode"] = steady_step(run["decode_log"], batch)


def release_order(version: str) -> tuple[int, ...]:
    """`version` ("0.5.23") as numbers, so that 0.5.100 sorts after 0.5.23."""
    return tuple(int(x) for x in version.split(".") if x.isdigit())


def summary_over_releases(parts: list[dict]) -> tuple[dict, dict]:
    """The summary of parts run on one or several SGLang releases, and where each value
    comes from. Ratios pair systems of one stage run, so of one release. Over several
    releases each one's summary (`summarize` over its own parts) is kept under its keys
    suffixed `_sglang<digits>` (`_sglang0523`), and a key without suffix holds the newest
    release's value where that release measured it, an older release's otherwise (its
    provenance names the release). Every key `summarize` knows stays, None where no
    release measured it."""
    releases = sorted({sglang_of(p) for p in parts}, key=release_order)
    if len(releases) < 2:
        return summarize(parts)
    plain: dict = {}
    plain_where: dict = {}
    per_release: dict = {}
    per_release_where: dict = {}
    for version in releases:  # oldest first: a newer release's value replaces an older's
        values, where = summarize([p for p in parts if sglang_of(p) == version])
        suffix = "_sglang" + version.replace(".", "")
        for key, value in values.items():
            plain.setdefault(key, None)
            if value is None:
                continue
            plain[key] = value
            per_release[key + suffix] = value
            if key in where:
                plain_where[key] = where[key]
                per_release_where[key + suffix] = where[key]
            else:
                plain_where.pop(key, None)
    return plain | per_release, plain_where | per_release_where


def merge(parts: list[dict]) -> dict:
    """One document from stage parts: the summary and where each of its values comes from,
    the plain backend races, provenance of each part kept. A part is kept when it holds
    the newest measurement of some (workload, system, rate) or a summary value."""
    restate_steady(parts)
    summary, where = summary_over_releases(parts)
    used = {id(p) for p in latest_runs(parts).values()}
    runs = set()
    for w in where.values():
        runs |= {(r["workload"], r["run_id"]) for r in w.get("runs", [w])}
    kept = [
        p
        for p in sorted(parts, key=lambda p: p["date"])
        if id(p) in used or (p["workload"], p["run_id"]) in runs
    ]
    prov = [
        {
            k: p[k]
            for k in ("workload", "run_id", "machine", "device", "command", "date", "git_commit")
        }
        | {"systems": sorted(p["systems"]), "source_sha256": p.get("source_sha256")}
        | {"sglang": sglang_of(p), "software": p.get("software")}
        for p in kept
    ]
    races = [r for p in kept if (r := plain_race(p))]
    return {
        "summary": summary,
        "summary_provenance": where,
        "plain_races": races,
        "provenance": prov,
        "mixed": {
            "machines": sorted({p["device"] for p in kept}),
            "git_commits": sorted({p["git_commit"] for p in kept}),
        },
        "parts": [without_raw_samples(p) for p in kept],
    }


def without_raw_samples(part: dict) -> dict:
    """`part` as a merged result keeps it: each run's raw `machine_samples` (megabytes a
    run: every busy thread's series) left out, its summary `metrics.machine` kept; the
    raw samples stay in the stage's part files (WORK/parts, `--export`). The part given is
    not changed."""

    def strip(run: dict) -> dict:
        out = {k: v for k, v in run.items() if k != "machine_samples"}
        if "rates" in out:
            out["rates"] = {r: strip(x) for r, x in out["rates"].items()}
        return out

    return part | {"systems": {n: strip(rec) for n, rec in part["systems"].items()}}


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
        "prefix_hit": (m.get("prefix_cache") or {}).get("hit_fraction"),
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
        "| peak running | KV read | prefix cached | accuracy | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in table_rows(doc):
        if "error" in r:
            out.append(f"| {r['workload']} | {r['system']} | failed: {r['error']} ||||||||")
            continue
        step = f"{f(r['step_ms'], '.2f')} @ {r['step_batch']}" if r["step_ms"] else "–"
        out.append(
            f"| {r['workload']} | {r['system']} | {f(r['output_tok_s'], '.0f')} | "
            f"{f(r['ttft_p99_s'], '.1f')} | {f(r['tpot_p50_ms'], '.1f')} | {step} | "
            f"{r['peak_running']} | {f(r['kv_read'], '.0%')} | {f(r['prefix_hit'], '.0%')} | "
            f"{f(r['accuracy'], '.2f')} | "
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


def profile_summary(profiled: list[dict], parts: list[dict]) -> tuple[dict, list[dict]]:
    """What bounds each profiled server's decode step: `--profile-decode` parts (their
    servers stalled for the profiler's export, so their steps are not measurements) joined
    with the unperturbed stage run of the same workload and commit (the newest).

    Per workload W and profiled system S: `gpu_busy_ms_{S}_{W}` (GPU time per step, the
    profile's `busy_us`), `step_ms_{S}_{W}` (the unperturbed run's steady step) and
    `gpu_idle_ms_{S}_{W}` (their difference: the GPU waiting for the host). Against the
    unperturbed run's plain backend P with the highest throughput (profiled or not):
    `gpu_busy_vs_step_{S}_vs_{P}_{W}` (S's GPU time over P's unperturbed step: where S's
    step would be if the host never held it) and, when P was profiled too,
    `gpu_busy_ratio_{S}_vs_{P}_{W}` (S's GPU time over P's). For every system X of the
    unperturbed run with the scheduler's host timing (`host_loop`, at its steady batch):
    `host_ms_{X}_{W}`, the host's time per decode iteration outside its wait for the GPU
    (a step cannot be shorter: SGLang's host loop bounds it), and `gpu_wait_ms_{X}_{W}`.
    A profile whose commit has no unperturbed run of its workload gives GPU time only:
    `gpu_busy_ms_{S}_{W}` and `gpu_busy_ratio_{S}_vs_{P}_{W}` against the profiled plain
    backend P with the least GPU time per step (its pair says `reference_by`).
    Returns (summary, pairs)."""
    summary: dict = {}
    pairs: list[dict] = []
    for prof in profiled:
        w, commit = prof["workload"], prof["git_commit"]
        busy = {
            name: rec["decode_profile"]["busy_us"] / 1e3
            for name, rec in prof["systems"].items()
            if isinstance(rec.get("decode_profile"), dict) and "busy_us" in rec["decode_profile"]
        }
        profiles = {n: rec["decode_profile"] for n, rec in prof["systems"].items()
                    if rec.get("decode_profile")}  # fmt: skip
        runs = [p for p in parts if p["workload"] == w and p["git_commit"] == commit]
        if not runs:
            ref = min((n for n in PLAIN_RACE if n in busy), key=busy.get, default=None)
            for name, b in busy.items():
                summary[f"gpu_busy_ms_{name}_{w}"] = b
                if ref and name not in PLAIN_RACE:
                    summary[f"gpu_busy_ratio_{name}_vs_{ref}_{w}"] = b / busy[ref]
            pairs.append(
                {"workload": w, "git_commit": commit, "profile_run_id": prof["run_id"],
                 "serving_run_id": None, "plain_raced": [n for n in PLAIN_RACE if n in busy],
                 "reference": ref, "reference_by": "least GPU time per step (no unperturbed "
                 "run of this commit)", "profiles": profiles}
            )  # fmt: skip
            continue
        run = max(runs, key=lambda p: p["date"])
        runs_of = {n: m for n in run["systems"] if (m := measured(run, n)) is not None}
        step = {n: m.metric(STEP) for n, m in runs_of.items()}
        plains = [n for n in PLAIN_RACE if step.get(n)]
        ref = max(plains, key=lambda n: runs_of[n].metric(TOK_S) or 0, default=None)
        for name, b in busy.items():
            summary[f"gpu_busy_ms_{name}_{w}"] = b
            if step.get(name):
                summary[f"step_ms_{name}_{w}"] = step[name]
                summary[f"gpu_idle_ms_{name}_{w}"] = step[name] - b
            if ref and name != ref and name not in PLAIN_RACE:
                if ref in busy:
                    summary[f"gpu_busy_ratio_{name}_vs_{ref}_{w}"] = b / busy[ref]
                summary[f"gpu_busy_vs_step_{name}_vs_{ref}_{w}"] = b / step[ref]
        for name, m in runs_of.items():
            batch = m.metric(("metrics", "steady_decode", "batch"))
            loop = (m.run.get("host_loop") or {}).get(str(batch))
            if loop and loop.get("host_ms") is not None:
                summary[f"host_ms_{name}_{w}"] = loop["host_ms"]
                summary[f"gpu_wait_ms_{name}_{w}"] = loop.get("gpu_wait_ms")
        pairs.append(
            {
                "workload": w,
                "git_commit": commit,
                "profile_run_id": prof["run_id"],
                "serving_run_id": run["run_id"],
                "plain_raced": [n for n in PLAIN_RACE if n in run["systems"]],
                "reference": ref,
                "reference_by": "highest output throughput of the unperturbed run",
                "profiles": profiles,
            }
        )
    return summary, pairs
