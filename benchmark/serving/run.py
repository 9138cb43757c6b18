#!/usr/bin/env python3
"""Serving benchmark: sglang-psa against plain SGLang, as real servers, under long-context load.

    python benchmark/serving/run.py stage a                     # workload a, its default systems
    python benchmark/serving/run.py stage a --systems psa,topk  # plain SGLang always runs too
    python benchmark/serving/run.py stage a,a16 --systems psa   # one server per system, both
    python benchmark/serving/run.py merge PART.json ...         # fold stage parts into the result
    python benchmark/serving/run.py table                       # README table from the result
    python benchmark/serving/run.py missing                     # stages the result still lacks
    python benchmark/serving/run.py list                        # workloads and systems

A stage is one workload (see `list`) against some systems, plain SGLang at triton
(`plain`, decode CUDA graphs) always among them and always first, then the other
plain backends named (`plain_fa3`, `plain_flashinfer`: systems.PLAIN_RACE), then
the rest. Each system is a real
`python -m sglang.launch_server` process: started, waited on until healthy
(FlashInfer's JIT compile happens before `/health` answers; its system needs
`jit_s` more of the budget to start), warmed up with prompts outside the dataset
(kernel compilation stays outside the timed window), then driven by SGLang's own
client, `python -m sglang.bench_serving --dataset-name custom`, with a seeded
dataset of long-context tasks from `sglang_psa.eval.tasks` so that every answer
is scored. `/get_server_info` is read before and after, the server's own "Decode
batch" log lines give the steady decode step, and the server is shut down before
the next one starts.

Every summary ratio pairs two systems of one stage run (one part: one run id, at
one rate; analysis.same_run_ratio), and the result says where each comes from
(`summary_provenance`: run id, commit, date, systems). A stage run that tried all
three plain backends names the fastest (highest output tok/s) and the *_vs_fastest
keys are taken against it (`plain_backend`; `plain_races` keeps each backend's
throughput, step and p99 TTFT).

A stage writes its part (`WORK/parts/WORKLOAD.RUN_ID.json`: measurements plus
machine, command, date and commit) after every system, so a stage cut short
keeps what finished; `--export DIR` mirrors parts and the merged result there
(the device's $OUT). Merging keeps, for every (workload, system), the newest
part that measured it, and takes plain SGLang from that same part: re-running
one stage re-measures only what it names. A 10-minute device call holds plain
SGLang and one or two other systems of a workload (`--systems`, `--rates` split
the rest); a stage that does not fit one call runs as back-to-back calls into one
run (`--continue-run last`: same machine since boot, same commit and workload; the
part, run id and dataset are the first call's, so its ratios still pair within one
stage run). benchmark/serving/README.md lists what each call takes on the H100.

The plain backend race on the H100 (each line one device call, back to back on one
machine, the bundle installed with FA3 and `source /tmp/psa-site/psa-env.sh`,
`export HF_HUB_OFFLINE=1 GIT_COMMIT=<commit>` the same in every call; `S=`
`python3 benchmark/serving/run.py stage`, `E=--budget-s 560 --export $OUT`).
Estimated from earlier runs (plain's first start on a fresh machine 130-170 s,
later ~65 s; psa ~60-95 s; FlashInfer's first start per model shape +~100 s of JIT;
a16's timed run 5 s, a's 18 s, d's 33 s; ~15-25 s of warm-up and shutdown each):

    $S a16 --systems plain,plain_fa3 $E                                     # ~260 s (~410 s with the install)
    $S a16 --systems plain_flashinfer,psa,topk --continue-run last $E       # ~370 s
    $S a --systems plain,plain_fa3,plain_flashinfer,psa $E                  # ~450 s
    $S a --systems topk,psa_eps1 --continue-run last $E                     # ~220 s
    $S d --systems plain,plain_fa3 $E                                       # ~300 s (8B shapes)
    $S d --systems plain_flashinfer,topk --continue-run last $E             # ~330 s

Five systems of a16 in one call (~615 s on a fresh machine) overrun the 560 s
budget, hence two calls. The budget stops what does not fit: a system is not
started with less than 90 s (FlashInfer: 210 s) left, and its name lands in the
part's `not_run`, to be added with `--continue-run last`.

`stage a,a16 ...` runs several workloads on one server start per system: servers start
in `stage_order`, each measures the workloads in the order listed (warm-up, a checked
`/flush_cache` before every workload but the first, its timed runs), and each workload
keeps its own part (same run id), every record with the same `startup_s` and
`shared_server_with`. It saves a start (65-85 s, FlashInfer +~100 s) per system and
workload. Workloads share a server only when every system's launch is the same for them
(same model, `max_batch`, flags) and none caps the KV (`b`, `e`, `*_capped`); otherwise
the stage exits naming the flag that differs. A system needs 90 s plus 30 s per further
workload of the budget (FlashInfer +120 s) to start; `--continue-run last` continues the
newest run of each workload; `--rates` takes one workload. Without
`--systems` it runs the systems every listed workload runs by default.

`--start-together` starts every system's server at once and pauses each (SIGSTOP to its
process group) as soon as it is healthy; then each in turn is resumed, measured and
stopped, while the others, paused, hold GPU memory and no CPU. The start-ups overlap, so
a stage waits for the slowest one instead of their sum (a five-system race on the H200
spent ~530 s starting servers one after another). Every server then gets the same KV
pool, `--max-total-tokens` sized for the largest workload's requests with 30% to spare
(f and g, when every server keeps a prefix cache: their shared text once plus each
request's own tokens, twice over; `kv_tokens_per_server` in the part's config; a capped
workload keeps its cap), and the
stage refuses to start when the servers would not fit the share of the GPU's memory that
SGLang lets them take (`--mem-fraction-static`); a server that still reports a smaller
pool is that system's error. A run continues only with the same pool size.

`stage W --profile-decode STEPS` is a diagnosis run: once every prompt is prefilled,
SGLang's profiler records STEPS decode steps of each server, and each system's record
gets a table of GPU time per step by kernel (`decode_profile`). The profiler's export
stalls the server, so that run goes to WORK/serving_profile.json and `merge` skips it;
`profile-summary` pairs it with the same commit's unprofiled steps.

`stage W --host-profile HZ` is a diagnosis run of the host side: every server's
scheduler loop is sampled HZ times a second (`sglang_psa.sched.host_profile`) and each
record gets `host_profile`, the loop's time per decode iteration by phase and by Python
function, and `host_profile_extend`, the same per extend (prefill) iteration. Sampling
slows the loop, so that run goes to WORK/serving_profile.json too.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import analysis  # noqa: E402
import driver  # noqa: E402
import machine_samples  # noqa: E402
import systems as systems_mod  # noqa: E402
import workloads as workloads_mod  # noqa: E402
from driver import Server, ServerFailed, log  # noqa: E402

from sglang_psa.eval import results as results_mod  # noqa: E402
from sglang_psa.eval.results import dump_result  # noqa: E402

RESULTS = REPO / "benchmark" / "results"
DEFAULT_WORK = Path(os.environ.get("PSA_SERVING_WORK", "/tmp/psa-serving"))
WARMUP_SHORT = 4  # concurrent short requests in the warm-up (decode at several batch sizes)
# Concurrent prompts of the workload's longest length in the warm-up: prefill batches of
# several requests, chunks that end inside one request and start another, as the timed
# window has (Triton specialises kernels on such arguments; one long prompt alone left
# variants to compile in the timed window).
WARMUP_LONG = 3
SLO_FACTORS = {"strict": 5.0, "relaxed": 25.0}  # x plain SGLang's single-request TTFT/TPOT
PROBE_OUTPUT = 128
STARTUP_TIMEOUT_S = 600
MIN_SYSTEM_BUDGET_S = 90  # a system is not started with less of the stage budget left
MIN_WORKLOAD_BUDGET_S = 30  # and 30 s more for each further workload its server runs
INFO_PERIOD_S = 5.0  # an sglang-psa server's residency sampled this often in a timed run
STOP_MARGIN_S = 25  # a timed run ends this long before the budget: shutdown and merge


# ---------------------------------------------------------------------------------------
# provenance
# ---------------------------------------------------------------------------------------


def device_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        name = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    except (OSError, IndexError, subprocess.TimeoutExpired):
        name = ""
    return name or "no GPU"


def result_name(device: str) -> str:
    """serving_h100 / serving_h200 / serving_gpu (`eval.results.gpu_tag`)."""
    from sglang_psa.eval.results import gpu_tag

    return f"serving_{gpu_tag(device)}"


def provenance() -> dict:
    from sglang_psa.eval.results import git_commit, machine, package_versions, source_digest

    return {
        "machine": machine(),
        "device": device_name(),
        "command": " ".join(shlex.quote(a) for a in ["python", *sys.argv]),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(REPO),
        "source_sha256": source_digest(REPO),  # the tree that ran (checked at write_result)
        "software": package_versions(SOFTWARE),  # the stack every server of the stage ran on
    }


SOFTWARE = ("sglang", "sglang-kernel", "flashinfer-python", "torch", "triton")


# ---------------------------------------------------------------------------------------
# one system
# ---------------------------------------------------------------------------------------


def side_prompt(tok, w: workloads_mod.Workload, seed: str) -> str:
    """A needle task of the workload's longest prompt length that is not in its dataset."""
    import random

    from sglang_psa.eval.tasks import Builder, chat_text, niah

    n = max(w.prompt_tokens) - workloads_mod.TEMPLATE_SLACK
    task = niah(Builder(workloads_mod.counter(tok), random.Random(f"serving/{seed}")), n, 1)
    return chat_text(tok, task.prompt, task.question)


def triton_cache_entries() -> dict[str, str] | None:
    """Kernels in Triton's on-disk cache on this host (`TRITON_CACHE_DIR`, else
    `~/.triton/cache`: one folder per compiled kernel), each folder with the kernel it
    holds (its files' name: `<kernel>.json` beside the binaries; a launcher's or helper
    module's name where it holds no kernel), or None where there is none. The server runs
    on this host, so a folder that appears during a timed run names a kernel compiled
    there (a warm-up that missed a specialisation)."""
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(
        os.environ.get("TRITON_HOME") or os.path.expanduser("~"), ".triton", "cache"
    )
    try:
        return {e.name: _cached_kernel(e.path) for e in os.scandir(folder) if e.is_dir()}
    except OSError:
        return None


def _cached_kernel(folder: str) -> str:
    """The kernel (or module) a Triton cache folder holds, by its files' names."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return "?"
    stems = [n.split(".")[0] for n in names if n.endswith(".json") and not n.startswith("__grp__")]
    stems = stems or [n.split(".")[0] for n in names if not n.startswith("__grp__")]
    return stems[0] if stems else "?"


def warm_up(server: Server, tok, w: workloads_mod.Workload) -> float:
    """`WARMUP_LONG` prompts of the workload's longest length and a few short ones at once,
    none of them in the dataset; then the prefix cache is flushed. Kernels compiled at first
    use (triton, FlashInfer's JIT for prefill) compile here, outside the timed window.
    Returns seconds."""
    import concurrent.futures as cf

    longs = [side_prompt(tok, w, "warmup" if i == 0 else f"warmup{i}") for i in range(WARMUP_LONG)]
    short = [f"Count from {i} to {i + 20}:" for i in range(WARMUP_SHORT)]
    t0 = time.time()
    with cf.ThreadPoolExecutor(WARMUP_SHORT + WARMUP_LONG) as pool:
        jobs = [pool.submit(server.generate, p, 16) for p in longs]
        jobs += [pool.submit(server.generate, s, 32) for s in short]
        for j in jobs:
            j.result()
    server.flush_cache()
    log(f"warmed up in {time.time() - t0:.0f} s")
    return time.time() - t0


def probe(server: Server, tok, w: workloads_mod.Workload) -> dict:
    """One request alone (the workload's longest prompt, not in the dataset): TTFT and TPOT
    as a client sees them. Plain SGLang's probe sets the goodput objectives."""
    res = driver.stream_generate(server.url, side_prompt(tok, w, "probe"), PROBE_OUTPUT, 600)
    if res["error"]:
        raise ServerFailed(f"the single-request probe failed: {res['error']}")
    server.flush_cache()
    ttft, n = res["ttft"], res["output_len"]
    tpot = sum(res["itl"]) / max(1, n - 1)
    log(f"single-request probe: TTFT {ttft * 1e3:.0f} ms, TPOT {tpot * 1e3:.2f} ms")
    return {"ttft_s": ttft, "tpot_s": tpot, "output_tokens": n}


def launch(name: str, w: workloads_mod.Workload, ctx: dict, port: int) -> list[str]:
    """The server command of system `name` for workload `w` (its KV cap, batch, model)."""
    system = systems_mod.SYSTEMS[name]
    extra = []
    if ctx["cap"] is not None:
        extra += systems_mod.cap_flags(system, ctx["cap"])
    elif ctx.get("together_tokens"):  # stage --start-together: one pool size for all
        extra += ["--max-total-tokens", str(ctx["together_tokens"])]
    if ctx.get("tp", 1) > 1:
        extra += ["--tp-size", str(ctx["tp"])]
    return systems_mod.launch_command(
        driver.python(),
        system,
        str(ctx["model_dir"]),
        port,
        max_batch=ctx["max_batch"],
        load_format="dummy" if w.model == workloads_mod.LLAMA_8B_DUMMY else None,
        extra=extra,
        launcher=ctx["launcher"],
    )


def run_system(
    name: str,
    w: workloads_mod.Workload,
    ctx: dict,
    port: int,
    deadline: float,
) -> dict:
    """Start `name`'s server, warm it up, run the workload's timed run(s), hand the record
    to `ctx["measured"]` (when set) while the server still runs, stop it."""
    return run_server(name, [(w, ctx)], port, deadline)[w.name]


def run_server(
    name: str,
    plans: list[tuple[workloads_mod.Workload, dict]],
    port: int,
    deadline: float,
) -> dict[str, dict]:
    """Start `name`'s server once (the launch of the first workload: `stage` checked that
    every workload's is the same) and measure each (workload, ctx) of `plans` on it in
    order, as `run_system` measures one; before every workload but the first, after its
    warm-up, the prefix cache is flushed (a refused flush is that workload's error). Each
    workload's record carries the start-up and, with several, `shared_server_with`. A
    workload reached with less than MIN_WORKLOAD_BUDGET_S of the budget left is not
    measured and has no record. Returns workload name -> record."""
    server, recs = new_server(name, plans, port)
    try:
        with server:
            server.wait_healthy(min(STARTUP_TIMEOUT_S, deadline - time.time()))
            measure_server(server, name, plans, recs, deadline)
    except (ServerFailed, OSError, ValueError, KeyError) as e:
        fail_unfinished(recs, e, server, name)
    return finished(recs)


def new_server(
    name: str, plans: list[tuple[workloads_mod.Workload, dict]], port: int
) -> tuple[Server, dict[str, dict]]:
    """`name`'s server for `plans` (not started) and an empty record per workload."""
    w0, ctx0 = plans[0]
    cmd = launch(name, w0, ctx0, port)
    what = systems_mod.SYSTEMS[name].what
    order = [w.name for w, _ in plans]
    recs = {key: {"what": what, "launch": cmd, "error": None} for key in order}
    logs = ctx0["work"] / "logs" / ctx0["run_id"]
    server = Server(
        cmd, port, logs / f"{'+'.join(order)}-{name}.server.log", cpus=ctx0.get("server_cpus")
    )
    return server, recs


def measure_server(
    server: Server,
    name: str,
    plans: list[tuple[workloads_mod.Workload, dict]],
    recs: dict[str, dict],
    deadline: float,
) -> None:
    """Measure each workload of `plans` on the healthy `server` (`run_server`'s loop); a
    record measured, failed or skipped is marked done (`_done`, dropped by `finished`)."""
    order = [w.name for w, _ in plans]
    for i, (w, ctx) in enumerate(plans):
        rec = recs[w.name]
        left = deadline - time.time()
        if i and left < MIN_WORKLOAD_BUDGET_S:
            log(f"{w.name}/{name}: not run, {left:.0f} s of the stage budget left")
            rec["_skipped"] = rec["_done"] = True
            continue
        rec["startup_s"] = server.startup_s
        if len(plans) > 1:
            rec["shared_server_with"] = [k for k in order if k != w.name]
        try:
            measure(server, name, w, ctx, rec, deadline, flush_after=order[i - 1] if i else None)
        except (ServerFailed, OSError, ValueError, KeyError) as e:
            if len(plans) == 1:
                raise  # recorded by the caller, with the log's tail after the shutdown
            failed(rec, e, server, f"{w.name}/{name}")
        rec["_done"] = True


def fail_unfinished(recs: dict[str, dict], e: Exception, server: Server, name: str) -> None:
    """`e` is the error of every record of `name` not yet measured, failed or skipped."""
    for key, rec in recs.items():
        if not rec.get("_done"):
            failed(rec, e, server, f"{key}/{name}")


def finished(recs: dict[str, dict]) -> dict[str, dict]:
    """The records of the workloads measured (or failed), without the bookkeeping marks."""
    out = {}
    for key, rec in recs.items():
        if rec.pop("_skipped", False):
            continue
        rec.pop("_done", None)
        out[key] = rec
    return out


class StartedTogether:
    """`stage --start-together`: every system's server started at once, each paused
    (`Server.pause`) as soon as it is healthy, then measured one at a time, resumed for
    its turn and stopped after it. The start-ups overlap (a stage pays the slowest, not
    the sum: FlashInfer's JIT and triton's compiles beside the rest) while a measured
    server shares the machine only with paused ones, which hold GPU memory and no CPU.
    Every server gets the same KV pool (`--max-total-tokens`, `together_tokens`), so that
    all fit in the GPU's memory at once (`check_together_fits`)."""

    def __init__(self, names: list[str], plans: list[tuple[workloads_mod.Workload, dict]],
                 port: int, deadline: float):  # fmt: skip
        """A server whose KV pool is smaller than its own `--max-total-tokens` asked (SGLang
        takes what fits, with a warning, when the GPU's memory is short) is that system's
        error, not a run on a smaller pool. Under a cap the tiered home asks less HBM for
        KV than plain does (its block metadata takes the rest: `systems.cap_flags`)."""
        self.servers: dict[str, tuple[Server, dict[str, dict]]] = {}
        self.errors: dict[str, Exception] = {}
        for i, name in enumerate(names):  # ports 10 apart: each server's own beside it
            self.servers[name] = new_server(name, plans, port + 10 * i)
        try:
            self._start(names, deadline)
        except BaseException:  # a failed launch, an interrupt: no server left behind
            self.stop_all()
            raise

    def _start(self, names: list[str], deadline: float) -> None:
        t0 = time.time()
        waiting = dict.fromkeys(names)
        for name in names:
            self.servers[name][0].__enter__()
        log(f"started {len(names)} servers together: {', '.join(names)}")
        last = t0
        while waiting and time.time() < min(t0 + STARTUP_TIMEOUT_S, deadline):
            for name in list(waiting):
                server = self.servers[name][0]
                try:
                    if not server.healthy():
                        continue
                    server.startup_s = time.time() - t0
                    self._check_pool(name, server)
                    server.pause()
                    log(f"{name}: healthy after {server.startup_s:.0f} s, paused")
                except (ServerFailed, OSError, ValueError, KeyError) as e:
                    self.errors[name] = e  # and its subprocesses, which may live on, stopped
                    server.stop()
                del waiting[name]
            if time.time() - last > 30:
                last = time.time()
                log(f"waiting for {', '.join(waiting)} ({time.time() - t0:.0f} s)")
            time.sleep(1.0)
        for name in waiting:  # still starting: stopped, so as not to load the others' runs
            self.servers[name][0].stop()
            self.errors[name] = ServerFailed(
                f"the server was not healthy after {time.time() - t0:.0f} s (started "
                f"together with {len(names) - 1} others); last lines of "
                f"{self.servers[name][0].log_path}:\n{driver.tail(self.servers[name][0].log_path)}"
            )

    def _check_pool(self, name: str, server: Server) -> None:
        recs = self.servers[name][1]
        asked = launch_flags(next(iter(recs.values()))["launch"]).get("--max-total-tokens")
        if asked is None:
            return
        got = server.get("/get_server_info").get("max_total_num_tokens")
        if got is not None and got < 0.99 * int(asked):  # page rounding aside
            raise ServerFailed(
                f"{name} started with a KV pool of {got} tokens, not the {asked} its "
                "--max-total-tokens asked for: the servers started together did not fit the "
                "GPU's memory (name fewer --systems)"
            )

    def measure(self, name: str, plans: list[tuple[workloads_mod.Workload, dict]],
                deadline: float) -> dict[str, dict]:  # fmt: skip
        """`name`'s records for `plans` (a subset of the started workloads: those still
        live), its server resumed, measured and stopped."""
        server, recs = self.servers[name]
        recs = {w.name: recs[w.name] for w, _ in plans}
        together = [n for n in self.servers if n != name]
        for rec in recs.values():
            rec["started_together_with"] = together
        try:
            if name in self.errors:
                raise self.errors[name]
            server.resume()
            measure_server(server, name, plans, recs, deadline)
        except (ServerFailed, OSError, ValueError, KeyError) as e:
            server.stop()  # the log's tail after the shutdown
            fail_unfinished(recs, e, server, name)
        finally:
            server.stop()
        return finished(recs)

    def stop_all(self) -> None:
        for server, _ in self.servers.values():
            server.stop()


def together_tokens(ws: list[workloads_mod.Workload], names: list[str] = ()) -> int:
    """The KV pool (tokens) each server gets under `--start-together`: every request of the
    largest workload at its longest prompt and output, with 30% to spare for SGLang's
    admission, which reserves a share of each running request's remaining output.

    A workload whose requests share prompt text (f, g: `prefix_set_tokens`), raced only by
    servers that keep a prefix cache (`systems.keeps_prefix`), holds that text once: the
    pool is its prefix set plus every request in flight's own tokens (output, question and
    template: TEMPLATE_SLACK), twice over (a document asked again while its first request
    still prefills is computed twice; admission reserves remaining outputs), never more
    than the size without sharing. Such a pool never makes a prefix-caching server evict,
    and it lets six servers of f or g start together on one GPU (without sharing, f asks
    2.5M tokens, 30 GB of an 0.5B model's KV, a server)."""

    def need(w: workloads_mod.Workload) -> int:
        alone = int(w.prompts * w.max_request_tokens * 1.3)
        shared = w.prefix_set_tokens
        if (
            not shared
            or not names
            or not all(systems_mod.keeps_prefix(systems_mod.SYSTEMS[n]) for n in names)
        ):
            return alone
        own = max(w.output_tokens) + workloads_mod.TEMPLATE_SLACK
        return min(alone, 2 * (shared + w.max_batch * own))

    return -(-max(need(w) for w in ws) // 1024) * 1024


def gpu_memory_bytes() -> int | None:
    """The first GPU's memory (nvidia-smi; no CUDA context in this process), or None."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return int(float(out.strip().splitlines()[0]) * 2**20)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def check_together_fits(
    names: list[str], tokens: int, kv_bytes: int, meta_bytes: int, model_dir: Path
) -> str:
    """Exit naming the flag unless `names`' servers, each with a `tokens` KV pool (and
    sglang-psa's block metadata for the sparse ones), fit the share of the GPU's memory
    that SGLang lets static memory take (`--mem-fraction-static`: each server keeps the
    rest of what was free at its start for activations), with the weights counted by the
    model folder's files and 4 GiB a server for activations and graphs; returns what it
    checked, for the log. Without a GPU there is nothing to check (a test's fake
    servers). A server that still gets a smaller pool is caught once it is up
    (`StartedTogether`)."""
    total = gpu_memory_bytes()
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    need = sum(
        weights + tokens * (kv_bytes + (0 if systems_mod.SYSTEMS[n].plain else meta_bytes))
        + 4 * 2**30
        for n in names
    )  # fmt: skip
    if total is None:
        return f"{need / 2**30:.1f} GiB for {len(names)} servers (no GPU: not checked)"
    room = systems_mod.MEM_FRACTION_STATIC * total
    if need > room:
        raise SystemExit(
            f"--start-together: {len(names)} servers with {tokens} KV tokens each need about "
            f"{need / 2**30:.1f} GiB, more than the {room / 2**30:.1f} GiB "
            f"({systems_mod.MEM_FRACTION_STATIC:g} of the GPU's {total / 2**30:.1f}) that "
            "they may take together; run without --start-together, or name fewer --systems"
        )
    return f"{need / 2**30:.1f} GiB for {len(names)} servers, of {room / 2**30:.1f} they may take"


def failed(rec: dict, e: Exception, server: Server, label: str) -> None:
    rec["error"] = f"{type(e).__name__}: {e}"
    rec["log_tail"] = driver.tail(server.log_path)
    log(f"{label} FAILED: {rec['error'][:2000]}")


def _innermost(profile: dict, top: int = 8) -> str:
    """A host profile's `top` innermost functions, for the log: `name (phase) ms`."""
    return ", ".join(f"{r['fn'].split(':')[-2]} ({r['phase']}) {r['ms']:.3f}"
                     for r in profile["self_ms"][:top])  # fmt: skip


def measure(
    server: Server,
    name: str,
    w: workloads_mod.Workload,
    ctx: dict,
    rec: dict,
    deadline: float,
    flush_after: str | None = None,
) -> None:
    """Warm the running server up for `w`, run its timed run(s) and fill `rec`, handing it
    to `ctx["measured"]` (when set). `flush_after`: the workload measured before on this
    server, whose prefix cache is flushed (checked) after the warm-up."""
    logs = ctx["work"] / "logs" / ctx["run_id"]
    cached = [triton_cache_entries()]
    rec["warmup_s"] = warm_up(server, ctx["tok"], w)
    cached.append(triton_cache_entries())
    if flush_after is not None:
        server.flush_cache(check=True)
        log(f"{w.name}/{name}: prefix cache flushed after workload {flush_after}")
    info = server.get("/get_server_info")
    rec["server_info_before"] = analysis.server_info_digest(info)
    num_prompts = w.prompts
    if w.batch_from_capacity:
        num_prompts = ctx.setdefault("batch", capacity_batch(info, w))
    rec["num_prompts"] = num_prompts
    if w.name == "c" and name == "plain":
        ctx["probe"] = probe(server, ctx["tok"], w)
    runs, failed_rates = {}, {}
    repeats = ctx.get("repeats") or 1
    for rate in w.rates:
        key = "inf" if math.isinf(rate) else f"{rate:g}"
        try:
            tries = timed_runs(
                lambda k, rate=rate: timed_run(
                    server, w, name, rate, num_prompts, ctx, logs, deadline, k
                ),
                repeats,
                deadline,
                f"{w.name}/{name}",
                ctx["still_to_come"](name, w.name) if "still_to_come" in ctx else (0, 0),
                server.startup_s if math.isfinite(server.startup_s) else 0.0,
            )
            runs[key] = median_run(tries)
            if len(tries) < repeats:
                runs[key]["repeats_asked"] = repeats
            if len(tries) > 1:
                seen = ", ".join(f"{t['output_tok_s']:.0f}" for t in runs[key]["repeats"])
                log(f"{w.name}/{name} @ {key}/s: output tok/s over {len(tries)} runs {seen}; "
                    f"kept run {runs[key]['median_of'] + 1} (the median)")  # fmt: skip
        except ServerFailed as e:
            if not w.is_sweep:
                raise
            failed_rates[key] = f"{type(e).__name__}: {e}"
            log(f"{w.name}/{name} @ {key}/s FAILED: {failed_rates[key][:2000]}; no more rates")
            break
    if not runs:
        raise ServerFailed(f"no rate completed: {failed_rates}")
    if repeats > 1:  # the server's counters and loop timing below span every repeat
        rec["server_figures_span_runs"] = True
    cached.append(triton_cache_entries())
    if None not in cached:  # Triton kernels compiled on this host (the server's)
        warm = [cached[1][k] for k in cached[1].keys() - cached[0].keys()]
        timed = sorted(cached[2][k] for k in cached[2].keys() - cached[1].keys())
        rec["triton_compiled"] = {"warmup": len(warm), "timed": len(timed), "timed_kernels": timed}
        if timed:
            log(f"{w.name}/{name}: {len(timed)} Triton kernels compiled during the timed "
                f"run(s) ({', '.join(timed)}): the warm-up missed them, the timing includes "
                "their compile")  # fmt: skip
    after = server.get("/get_server_info")
    rec["server_info_after"] = analysis.server_info_digest(after)
    rec["counters"] = analysis.counter_delta(info, after)
    rec["host_loop"] = analysis.host_loop(rec["server_info_before"], rec["server_info_after"])
    if rec["host_loop"]:  # the largest decode batch's
        size, h = list(rec["host_loop"].items())[-1]
        log(f"{w.name}/{name}: host loop at decode batch {size}: {h['iteration_ms']:.2f} ms "
            f"an iteration, {h['host_ms']:.2f} of it the host's (schedule "
            f"{h['schedule_ms']:.2f}, launch {h['launch_ms']:.2f}, results "
            f"{h['results_ms']:.2f}, other {h['other_ms']:.2f}), GPU wait "
            f"{h['gpu_wait_ms']:.2f}")  # fmt: skip
    rec["layer_reads"] = analysis.layer_reads(rec["server_info_before"], rec["server_info_after"])
    missed = [r for r in rec["layer_reads"] if r["host_share"]]
    if missed:  # the tiered home: which layers' reads the unit cache missed
        top = ", ".join(f"{r['layer']}: {r['host_share']:.2f} of {r['read_share']:.2f} read"
                        for r in sorted(missed, key=lambda r: -r["host_share"])[:6])  # fmt: skip
        log(f"{w.name}/{name}: layers reading most from the host tier: {top}")
    rec["plugin_time"] = analysis.plugin_time(rec["server_info_before"], rec["server_info_after"])
    if rec["plugin_time"]:
        top = ", ".join(f"{k} {v['ms'] / 1e3:.2f} s ({v['calls']} calls)"
                        for k, v in list(rec["plugin_time"].items())[:8])  # fmt: skip
        log(f"{w.name}/{name}: the plugin's own host time in the scheduler loop: {top}")
    prof = analysis.host_profile(
        rec["server_info_before"], rec["server_info_after"], rec["host_loop"]
    )
    if prof:
        rec["host_profile"] = prof
        size, h = list(prof.items())[-1]
        log(f"{w.name}/{name}: host profile at decode batch {size} ({h['samples']} samples), "
            f"ms an iteration by innermost function: {_innermost(h)}")  # fmt: skip
    ext = analysis.extend_host_profile(rec["server_info_before"], rec["server_info_after"])
    if ext:
        rec["host_profile_extend"] = ext
        phases = ", ".join(f"{k} {v:.2f}" for k, v in ext["phase_ms"].items())
        log(f"{w.name}/{name}: host profile of {ext['iterations']} extend iterations "
            f"({ext['iteration_ms']:.1f} ms each, {ext['samples']} samples): {phases}; "
            f"ms an iteration by innermost function: {_innermost(ext)}")  # fmt: skip
    if w.is_sweep:
        rec["rates"] = runs
        rec["rates_failed"] = failed_rates
    else:
        rec.update(runs["inf"])
    if ctx.get("measured"):  # saved before the server's shutdown, which takes time
        ctx["measured"](name, rec)


def _unless(skip: bool, ctx):
    """`ctx`, or no context where `skip`."""
    return contextlib.nullcontext() if skip else ctx


def timed_run(
    server: Server,
    w: workloads_mod.Workload,
    name: str,
    rate: float,
    num_prompts: int,
    ctx: dict,
    logs: Path,
    deadline: float,
    repeat: int = 0,
) -> dict:
    """One `bench_serving` run at `rate` (a chat workload: one `driver.run_chat` run, its
    conversations starting at `rate`) against a warm server with an empty prefix cache:
    its metrics, the decode log lines of its window, and one row per request. `repeat`:
    which run of `stage --repeats` this is (its files' names say so from the second on)."""
    key = "inf" if math.isinf(rate) else f"{rate:g}"
    again = f" (repeat {repeat + 1})" if repeat else ""
    log(f"{w.name}/{name}: {num_prompts} requests at rate {key}/s{again}")
    server.flush_cache()  # the same prompts again at each rate: no prefix hits
    start = server.log_size()
    key_file = f"{key}.r{repeat + 1}" if repeat else key
    out = logs / f"{w.name}-{name}-{key_file}.bench.jsonl"
    steps = ctx.get("profile_steps") if math.isinf(rate) else None
    folder = ctx["work"] / "profiles" / ctx["run_id"] / f"{w.name}-{name}"
    profile = (steps, folder) if steps else None
    session = server.proc.pid if server.proc is not None else None  # its own session
    sampler = machine_samples.MachineSamples(
        session, log_path=server.log_path, cores=ctx.get("cpu_core")
    )
    # how an sglang-psa server shares HBM out under load (plain SGLang has no such block)
    plain = systems_mod.SYSTEMS[name].plain
    infos = driver.InfoSamples(server, analysis.residency_sample, INFO_PERIOD_S)
    if w.turns:
        convs = workloads_mod.conversations(workloads_mod.load_rows(ctx["dataset"]))
        starts = workloads_mod.conversation_starts(w, rate)
        with driver.watching(server, profile), sampler, _unless(plain, infos):
            bench = driver.run_chat(server.url, convs, starts, deadline - STOP_MARGIN_S)
        out.write_text(json.dumps(bench) + "\n")  # beside bench_serving's records
    else:
        cmd = driver.bench_command(
            driver.python(),
            server.url,
            str(ctx["model_dir"]),
            ctx["dataset"],
            num_prompts,
            rate,
            w.fixed_output,
            w.seed,
            out,
            ctx["prompt_format"],
        )
        with sampler, _unless(plain, infos):
            bench = driver.run_bench(
                ctx["client"],
                cmd,
                server,
                logs / f"{w.name}-{name}-{key_file}.bench.log",
                out,
                timeout=max(60.0, deadline - time.time() - STOP_MARGIN_S),
                profile=profile,
            )
    profile = decode_profile(server, folder, steps) if steps else None
    text = server.log_text(start, server.log_size())
    lines = analysis.parse_decode_lines(text, base=start)
    rows = analysis.per_request(
        bench,
        ctx["meta"],
        lambda text, task: workloads_mod.is_correct(ctx["tok"], text, task),
        lambda text: workloads_mod.answer_ids(ctx["tok"], text),
    )
    batch = num_prompts if math.isinf(rate) else None
    run = {
        "metrics": analysis.run_metrics(
            bench, rows, lines, batch, analysis.parse_prefill_lines(text)
        ),
        "decode_log": lines,
        "rows": rows,
        # the GPU's clocks and the server's busy threads over the run (machine_samples)
        "machine_samples": sampler.result(),
    }
    if infos.samples:  # every INFO_PERIOD_S: residency_sample's fields
        run["server_info_samples"] = infos.samples
    run["metrics"]["machine"] = analysis.machine_summary(run["machine_samples"], lines, batch)
    if profile is not None:
        run["decode_profile"] = profile
    m = run["metrics"]
    log(
        f"{w.name}/{name} @ {key}/s: {m['output_tok_s']:.0f} output tok/s, "
        f"p99 TTFT {m['ttft_s']['p99'] or float('nan'):.1f} s, steady step "
        f"{m['steady_decode']['step_ms'] or float('nan'):.2f} ms at batch "
        f"{m['steady_decode']['batch']}, server prefill "
        f"{m['server_prefill']['tok_s'] or float('nan'):.0f} tok/s, accuracy "
        f"{m['accuracy']:.2f}, {m['failed']} failed"
    )
    if samples := run.get("server_info_samples"):
        med = {k: statistics.median([x[k] for x in samples if x[k] is not None] or [None])
               for k in samples[0] if k != "t"}  # fmt: skip
        log(f"{w.name}/{name}: HBM under load (median of {len(samples)} samples): "
            f"{med['kv_available_tokens']} tokens free, {med['kv_cached_tokens']} cached "
            f"in the tree, {med['kv_held_tokens']} held; {med['cache_pages']} unit-cache "
            f"pages, {med['blocks_evicted']} blocks evicted")  # fmt: skip
    if mach := m["machine"]:
        sd = m["steady_decode"]
        log(
            f"{w.name}/{name}: step p10-p90 {sd.get('step_ms_p10') or float('nan'):.2f}-"
            f"{sd.get('step_ms_p90') or float('nan'):.2f} ms; SM clock "
            f"{mach.get('sm_mhz') or float('nan'):.0f} MHz (p10 "
            f"{mach.get('sm_mhz_p10') or float('nan'):.0f}), "
            f"{mach.get('power_w') or float('nan'):.0f} W; busiest server thread "
            f"{mach.get('busiest_thread')} at {mach.get('busiest_thread_pct') or float('nan'):.0f}% "
            f"(p90 {mach.get('busiest_thread_pct_p90') or float('nan'):.0f}%); busiest other "
            f"{mach.get('busiest_other_thread')} at "
            f"{mach.get('busiest_other_thread_pct') or float('nan'):.0f}%"
        )
    return run


def timed_runs(
    run_once,
    repeats: int,
    deadline: float,
    label: str,
    still_to_come: tuple[int, int] = (0, 0),
    start_s: float = 0.0,
) -> list[dict]:
    """`run_once(k)` (a `timed_run`, k counting from 0) up to `repeats` times. A run's
    cost is its wall time (the client's and the scoring's included) or its benchmark
    duration, the larger; a further run starts only with 1.5 times the costliest so far
    left before the budget's stop margin, plus what the stage has yet to do
    (`still_to_come`: runs, server starts): one first run's cost a run and `start_s`
    (this server's start-up) a start. So every system gets its one run before any gets
    its repeats. A further run that fails ends the repeats keeping those done (the first
    run's failure is raised)."""
    tries: list[dict] = []
    costs: list[float] = []
    runs, starts = still_to_come
    for k in range(repeats):
        if tries:
            need = 1.5 * max(costs) + runs * costs[0] + starts * start_s
            left = deadline - time.time() - STOP_MARGIN_S
            if left < need:
                log(f"{label}: {k} of {repeats} runs; {left:.0f} s left, {need:.0f} s needed "
                    f"for another beside the {runs} runs and {starts} server starts still "
                    "to come")  # fmt: skip
                break
        t0 = time.time()
        try:
            tries.append(run_once(k))
        except ServerFailed as e:
            if not tries:
                raise
            log(f"{label}: run {k + 1} of {repeats} FAILED ({e}); keeping {k}")
            break
        costs.append(max(time.time() - t0, tries[-1]["metrics"].get("duration_s") or 0.0))
    return tries


def median_run(tries: list[dict]) -> dict:
    """Of `stage --repeats` runs of one system at one rate, the run of median output
    tokens/s (the lower of the two middle ones for an even count), whole: its step, TTFT
    and answers are one run's, never a mix. With several runs it lists each one's headline
    figures under `repeats` and its own index under `median_of`."""
    if len(tries) == 1:
        return tries[0]
    order = sorted(range(len(tries)), key=lambda i: tries[i]["metrics"]["output_tok_s"])
    pick = order[(len(tries) - 1) // 2]
    run = tries[pick]
    run["median_of"] = pick
    run["repeats"] = [
        {
            "output_tok_s": t["metrics"]["output_tok_s"],
            "step_ms": t["metrics"]["steady_decode"]["step_ms"],
            "ttft_mean_s": t["metrics"]["ttft_s"]["mean"],
            "server_prefill_tok_s": (t["metrics"].get("server_prefill") or {}).get("tok_s"),
            "accuracy": t["metrics"]["accuracy"],
        }
        for t in tries
    ]
    return run


PROFILE_WAIT_S = 60  # for the server to write its trace after the run


def decode_profile(server: Server, folder: Path, steps: int) -> dict:
    """The kernel table of the steps `--profile-decode` recorded in this run (see
    `analysis.kernel_profile`), or {"error": why} when no trace came."""
    deadline = time.time() + PROFILE_WAIT_S
    stopped = False
    while True:
        traces = sorted(folder.glob("*.trace.json*")) if folder.exists() else []
        if traces:
            time.sleep(2.0)  # the export may still be writing the file
            try:
                table = analysis.kernel_profile(traces, steps)
            except (ValueError, OSError, EOFError) as e:  # EOFError: a truncated gzip
                return {"error": f"{type(e).__name__}: {e}", "traces": [str(t) for t in traces]}
            table["traces"] = [str(t) for t in traces]
            log(
                f"  decode profile: {table['busy_us'] / 1e3:.2f} ms busy of "
                f"{table['span_us'] / 1e3:.2f} ms per step over {table['steps']} steps"
            )
            for k in table["kernels"][:12]:
                log(f"    {k['us']:9.1f} us  x{k['launches']:5.1f}  {k['name'][:90]}")
            return table
        if time.time() > deadline:
            if stopped:
                return {"error": f"no trace in {folder} {PROFILE_WAIT_S} s after the run"}
            driver.stop_profile(server)  # the run ended before the steps were recorded
            stopped, deadline = True, time.time() + PROFILE_WAIT_S
        time.sleep(1.0)


def capacity_batch(info: dict, w: workloads_mod.Workload) -> int:
    """The largest batch of the workload's requests that plain SGLang's KV pool holds,
    less 4% so that sglang-psa (whose pool also keeps block metadata) holds it too."""
    tokens = int(info["max_total_num_tokens"])
    batch = max(1, min(w.prompts, int(0.96 * tokens) // w.max_request_tokens))
    log(f"KV pool of {tokens} tokens: batch {batch} of {w.max_request_tokens}-token requests")
    return batch


def finish_part(part: dict, w: workloads_mod.Workload, ctx: dict) -> None:
    """Comparisons that need plain's record: completions identical to plain, and for the
    rate sweep the goodput objectives from plain's single-request probe."""
    plain = part["systems"].get("plain")
    if not plain or plain.get("error"):
        return
    probe_ = ctx.get("probe")
    if probe_:
        part["slo"] = {
            which: {"ttft_s": f * probe_["ttft_s"], "tpot_s": f * probe_["tpot_s"]}
            for which, f in SLO_FACTORS.items()
        } | {"probe": probe_, "factors": SLO_FACTORS}
    for rec in part["systems"].values():
        if rec.get("error"):
            continue
        if "rates" in rec:
            for key, run in rec["rates"].items():
                if key not in plain["rates"]:
                    continue  # plain did not complete this rate: nothing to compare with
                run["identical_to_plain"] = analysis.identical_fraction(
                    run["rows"], plain["rates"][key]["rows"]
                )
                for which in SLO_FACTORS if probe_ else ():
                    slo = part["slo"][which]
                    run[f"goodput_{which}"] = analysis.goodput(
                        run["rows"], run["metrics"]["duration_s"], slo["ttft_s"], slo["tpot_s"]
                    )
        else:
            rec["identical_to_plain"] = analysis.identical_fraction(rec["rows"], plain["rows"])


def stage_order(names: list[str]) -> list[str]:
    """The order a stage starts its systems in: plain (triton) always and first, then the
    other plain backends named, the one that needs the most start-up budget first
    (FlashInfer's JIT: started third, it missed a call's budget that FA3 and a sparse
    system then fit), else in `systems.PLAIN_RACE` order, then the rest as named."""
    race = [s for s in systems_mod.PLAIN_RACE[1:] if s in names]
    race.sort(key=lambda s: -systems_mod.SYSTEMS[s].jit_s)  # stable: ties keep the order
    return ["plain", *race] + [s for s in names if s != "plain" and s not in race]


def workload_list(text: str) -> list[str]:
    """`stage`'s workload argument: one workload, or a comma list of distinct ones."""
    keys = [k for k in text.split(",") if k]
    unknown = [k for k in keys if k not in workloads_mod.WORKLOADS]
    if unknown or not keys:
        raise argparse.ArgumentTypeError(
            f"unknown workload {', '.join(unknown) or repr(text)} (choose from "
            f"{', '.join(sorted(workloads_mod.WORKLOADS))})"
        )
    if len(set(keys)) < len(keys):
        raise argparse.ArgumentTypeError(f"a workload is named twice in {text}")
    return keys


def system_budget_s(name: str, workloads: int) -> float:
    """The stage budget a system needs left to be started for `workloads` workloads."""
    extra = MIN_WORKLOAD_BUDGET_S * (workloads - 1)
    return MIN_SYSTEM_BUDGET_S + extra + systems_mod.SYSTEMS[name].jit_s


def launch_flags(cmd: list[str]) -> dict[str, str | None]:
    """A server command's flags and their values (None: a flag without one)."""
    flags: dict[str, str | None] = {}
    for i, a in enumerate(cmd):
        if a.startswith("--"):
            nxt = cmd[i + 1] if i + 1 < len(cmd) else None
            flags[a] = None if nxt is None or nxt.startswith("--") else nxt
    return flags


def check_shared_server(
    ws: list[workloads_mod.Workload], names: list[str], ctxs: dict[str, dict], port: int
) -> None:
    """Several workloads share one server per system only when each system's launch is the
    same for all of them, and none caps the HBM for KV; otherwise exit naming the
    workloads and the flag that differs."""
    first = ws[0]
    for name in names:
        cmd = launch(name, first, ctxs[first.name], port)
        for w in ws[1:]:
            other = launch(name, w, ctxs[w.name], port)
            if other == cmd:
                continue
            a, b = launch_flags(cmd), launch_flags(other)
            flag = next((f for f in [*a, *b] if a.get(f, "∅") != b.get(f, "∅")), "(argument order)")

            def value(d: dict, f: str = flag) -> str:
                return "not set" if f not in d else "set" if d[f] is None else d[f]

            raise SystemExit(
                f"workloads {first.name} and {w.name} cannot share a server: {name}'s launch "
                f"differs at {flag} ({first.name}: {value(a)}, {w.name}: {value(b)}); run "
                "them as separate stages"
            )
    capped = [w.name for w in ws if w.kv_cap_requests]
    if capped:
        raise SystemExit(
            f"workload {', '.join(capped)} caps the HBM for KV (kv_cap_requests): a capped "
            "workload runs as a stage of its own"
        )


class Plan:
    """One workload of a stage: its part (and file) and the context its runs read; `live`
    turns False once plain SGLang failed in it (nothing to compare with)."""

    def __init__(self, w: workloads_mod.Workload, ctx: dict, part: dict, path: Path):
        self.w, self.ctx, self.part, self.path = w, ctx, part, path
        self.live = True


def compact(cpus: list[int]) -> str:
    """`[0, 1, 2, 5]` as `0-2,5`."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def stage(args) -> int:
    from transformers import AutoTokenizer

    keys = args.workload
    if args.repeats < 1:
        raise SystemExit(f"--repeats: at least 1 run a system; got {args.repeats}")
    several = len(keys) > 1
    if several and args.rates:
        raise SystemExit("--rates: a rate sweep's subset is for one workload; name one")
    ws = []
    for key in keys:
        w = workloads_mod.WORKLOADS[key]
        if args.smoke:
            w = workloads_mod.smoke(w)
        if args.rates:
            rates = tuple(float(r) for r in args.rates.split(","))
            if not w.is_sweep or not set(rates) <= set(w.rates):
                raise SystemExit(
                    f"--rates: workload {w.name} sweeps {list(w.rates)}; got {args.rates}"
                )
            w = dataclasses.replace(w, rates=rates)
        if args.prompts:  # recorded in the part's config.workload, so never mixed
            w = dataclasses.replace(w, prompts=args.prompts)
        ws.append(w)
    models = {w.model for w in ws}
    if len(models) > 1:
        raise SystemExit(
            f"workloads {', '.join(keys)} cannot share a server: they serve different models "
            f"({', '.join(f'{w.name}: {w.model}' for w in ws)}); run them as separate stages"
        )
    if args.systems:
        names = [s for s in args.systems.split(",") if s]
    else:  # the systems every listed workload runs by default
        names = [s for s in ws[0].systems if all(s in w.systems for w in ws)]
    unknown = [s for s in names if s not in systems_mod.SYSTEMS]
    if unknown:
        raise SystemExit(f"--systems: unknown {unknown}; known: {', '.join(systems_mod.SYSTEMS)}")
    names = stage_order(names)
    label = ",".join(keys)
    t0 = time.time()
    deadline = t0 + args.budget_s
    work = Path(args.work)
    # every server (plain ones too) times its scheduler loop (sglang_psa.sched.host_timing)
    os.environ.setdefault("SGLANG_PSA_HOST_TIMING", "1")
    if args.host_profile:  # and samples it (a diagnosis run)
        os.environ["SGLANG_PSA_HOST_PROFILE"] = f"{args.host_profile:g}"
    # Physical cores as the OS shows them: the client's cores and the samples' core
    # sharing follow them.
    allowed, cores = os.sched_getaffinity(0), machine_samples.cpu_cores()
    cpus = machine_samples.split_cpus(args.client_cores, cores, allowed)
    host_cpu = machine_samples.cpu_info()
    log(f"host CPU: {host_cpu}")
    if cpus is not None:  # this process (the client, the sampler) and its children
        os.sched_setaffinity(0, cpus["client"])
        log(f"CPUs: servers on {compact(cpus['server'])}, client and stage on "
            f"{compact(cpus['client'])} (--client-cores {args.client_cores})")  # fmt: skip
    else:
        log(f"CPUs: not split (--client-cores {args.client_cores}, "
            f"{len(os.sched_getaffinity(0))} CPUs)")  # fmt: skip
    for w in ws:
        log(f"stage {w.name}: {w.what}; systems {', '.join(names)}; budget {args.budget_s:.0f} s")
    if several:
        log(f"one server per system for workloads {label}, in that order")
    model_dir = (
        Path(args.model_dir) if args.model_dir else workloads_mod.prepare_model(ws[0].model, work)
    )
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    kv, meta_bytes = workloads_mod.kv_bytes(model_dir)
    ctxs = {}
    for w in ws:
        cap = None
        if w.kv_cap_requests:
            cap = systems_mod.KVCap(
                tokens=w.kv_cap_requests * w.max_request_tokens,
                bytes_per_token=kv,
                metadata_bytes_per_token=meta_bytes,
                host_tokens=(w.host_requests or w.prompts) * w.max_request_tokens,
            )
        ctxs[w.name] = {
            "profile_steps": args.profile_decode,
            "work": work,
            "model_dir": model_dir,
            "tok": tok,
            "cap": cap,
            "max_batch": w.max_batch,
            "launcher": shlex.split(args.launcher) if args.launcher else None,
            "tp": args.tp,
            "prompt_format": args.prompt_format,
            "server_cpus": cpus["server"] if cpus else None,
            "cpu_core": cores,
            # --start-together, uncapped: one pool size for all (a cap sets its own)
            "together_tokens": together_tokens(ws, names)
            if args.start_together and not cap
            else None,
            # a rate sweep and a profiled run time each rate once
            "repeats": 1 if w.is_sweep or args.profile_decode else args.repeats,
        }
    if several:
        check_shared_server(ws, names, ctxs, args.port)
    run_id = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    plans = []
    for w in ws:
        ctx = ctxs[w.name]
        dataset = workloads_mod.ensure_dataset(w, tok, work)
        log(f"model {model_dir}; dataset {dataset} ({time.time() - t0:.0f} s so far)")
        part = {
            "workload": w.name,
            "run_id": run_id,
            "boot_id": boot_id(),
            "cpu": host_cpu,
            **provenance(),
            "config": {
                "workload": w.to_json(),
                "model_dir": str(model_dir),
                "kv_bytes_per_token": kv,
                "psa_metadata_bytes_per_token": meta_bytes,
                "kv_cap_tokens": ctx["cap"].tokens if ctx["cap"] else None,
                "mem_fraction_static": systems_mod.MEM_FRACTION_STATIC,
                "decode_log_interval": systems_mod.DECODE_LOG_INTERVAL,
                "smoke": args.smoke,
                "tp": args.tp,
                "prompt_format": args.prompt_format,
                "cpus": cpus,
                "started_together": bool(args.start_together),
                "kv_tokens_per_server": ctx["together_tokens"],
                "repeats": ctx["repeats"],
            },
            "systems": {},
        }
        if args.profile_decode:
            part["profiled"] = args.profile_decode
        if args.host_profile:
            part["host_profiled"] = args.host_profile
        ctx |= {"run_id": run_id, "dataset": dataset, "meta": workloads_mod.load_meta(dataset)}
        part_path = work / "parts" / f"{w.name}.{run_id}.json"
        if args.continue_run:
            part, part_path = continued_part(args, w, work, part)
            ctx["run_id"] = part["run_id"]
            ctx["probe"] = part.get("slo", {}).get("probe")
            if w.batch_from_capacity:
                ctx["batch"] = part["systems"]["plain"]["num_prompts"]
        plans.append(Plan(w, ctx, part, part_path))
    if args.continue_run:
        names = [n for n in names if n != "plain"]
        if not names:
            raise SystemExit("--continue-run: name the systems to add with --systems")
        for p in plans:
            log(f"continuing run {p.part['run_id']} (plain measured there) with {', '.join(names)}")

    def measured(p: Plan):
        def save(name: str, rec: dict) -> None:
            """A system's record goes into the part file as soon as it is measured: a
            device call that runs out during the server's shutdown keeps it."""
            p.part["systems"][name] = rec
            finish_part(p.part, p.w, p.ctx)
            save_part(p.part, p.path, args)

        return save

    for p in plans:
        p.ctx["measured"] = measured(p)

    def still_to_come(name: str, workload: str) -> tuple[int, int]:
        """What the stage does after this (system, workload): runs (one a measurement)
        and server starts (none where the servers were started together)."""
        live = [p.w.name for p in plans if p.live]
        later = names[names.index(name) + 1 :] if name in names else []
        after = live[live.index(workload) + 1 :] if workload in live else []
        return len(later) * len(live) + len(after), 0 if together else len(later)

    for p in plans:
        p.ctx["still_to_come"] = still_to_come

    def not_run(p: Plan, name: str) -> None:
        if name not in p.part.setdefault("not_run", []):
            p.part["not_run"].append(name)

    def measure_system(i: int, name: str, together: StartedTogether | None) -> bool:
        """Measure `name` on every live workload (its server started now, or resumed from
        `together`) and save the parts; False once no workload is live."""
        todo = [p for p in plans if p.live]
        if not todo:
            return False
        left = deadline - time.time()
        # a server started together already runs: only its workloads' time is needed
        need = MIN_WORKLOAD_BUDGET_S * len(todo)
        if together is None:
            need = system_budget_s(name, len(todo))
        if left < need:
            log(f"{label}/{name}: not started, {left:.0f} s of the stage budget left")
            for p in todo:
                not_run(p, name)
            return True
        log(f"[{i + 1}/{len(names)}] {label}/{name} ({left:.0f} s of the budget left)")
        if together is None:
            recs = run_server(name, [(p.w, p.ctx) for p in todo], args.port + i, deadline)
        else:
            recs = together.measure(name, [(p.w, p.ctx) for p in todo], deadline)
        for p in todo:
            if p.w.name not in recs:  # the budget ran out before this workload's turn
                not_run(p, name)
                save_part(p.part, p.path, args)
                continue
            p.part["systems"][name] = recs[p.w.name]
            if name in p.part.get("not_run", []):  # left out earlier, measured now
                p.part["not_run"].remove(name)
            if name == "plain" and p.part["systems"][name]["error"]:
                log(
                    f"{p.w.name}: plain SGLang failed: the other systems would have nothing to "
                    "compare with"
                )
                p.live = False
                continue
            finish_part(p.part, p.w, p.ctx)
            save_part(p.part, p.path, args)
        return True

    client = driver.Client(work / "logs" / f"client-{run_id}.log")  # one for every run
    together = None
    try:
        client.start(driver.python())  # its imports overlap the servers' start-up
        for p in plans:
            p.ctx["client"] = client
        if args.start_together:
            ctx0 = plans[0].ctx
            tokens = ctx0["cap"].tokens if ctx0["cap"] else ctx0["together_tokens"]
            fits = check_together_fits(names, tokens, kv, meta_bytes, model_dir)
            log("--start-together: " + fits)
            together = StartedTogether(names, [(p.w, p.ctx) for p in plans], args.port, deadline)
        for i, name in enumerate(names):
            if not measure_system(i, name, together):
                break
    finally:
        client.close()
        if together is not None:
            together.stop_all()
    for p in plans:
        save_part(p.part, p.path, args)  # with the systems left unstarted, if any
    out = Path(args.out) if args.out else None
    if (args.profile_decode or args.host_profile) and out is None:
        out = Path(args.work) / "serving_profile.json"  # perturbed runs: diagnosis only
    if args.smoke and out is None:
        out = Path(args.work) / "serving_smoke.json"  # never merged into a real result
    if args.tp > 1 and out is None:  # benchmark/parallel summarizes it, beside one GPU's
        out = Path(args.work) / f"serving_tp{args.tp}.json"
    parts = [p.part for p in plans]
    merged = merge_into(out, parts, args)
    print(analysis.markdown_table({"parts": parts}))
    print(json.dumps(merged["summary"], indent=1))
    log(f"stage {label} done in {time.time() - t0:.0f} s")
    return 0 if all(not r.get("error") for p in parts for r in p["systems"].values()) else 1


def boot_id() -> str | None:
    """This boot of this machine (Linux), or None: what `--continue-run` checks."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def continued_part(args, w: workloads_mod.Workload, work: Path, fresh: dict) -> tuple[dict, Path]:
    """The part `--continue-run` adds systems to (a run id, or `last`: the newest part of
    this workload in WORK). The same run means the same machine since its last boot, the
    same commit and the same workload, with plain SGLang measured in it: a stage whose
    servers do not fit one device call is run as back-to-back calls, each ratio still
    between two servers of one machine and one dataset."""
    parts = sorted((work / "parts").glob(f"{w.name}.*.json"))
    if args.continue_run != "last":
        parts = [p for p in parts if p.name == f"{w.name}.{args.continue_run}.json"]
    if not parts:
        raise SystemExit(f"--continue-run {args.continue_run}: no {w.name} part in {work}/parts")
    path = parts[-1]
    part = json.loads(path.read_text())
    same = {
        "boot_id": (part.get("boot_id"), fresh["boot_id"]),
        "git_commit": (part.get("git_commit"), fresh["git_commit"]),
        "workload": (
            part["config"]["workload"],
            json.loads(json.dumps(fresh["config"]["workload"])),
        ),
        "smoke": (part["config"].get("smoke"), fresh["config"]["smoke"]),
        "tp": (tp_of(part), tp_of(fresh)),
        "prompt_format": (
            part["config"].get("prompt_format", "text"),
            fresh["config"]["prompt_format"],
        ),
        "cpus": (part["config"].get("cpus"), fresh["config"]["cpus"]),
        "repeats": (part["config"].get("repeats", 1), fresh["config"]["repeats"]),
        # --start-together sizes every KV pool alike: a run continues with the same pools
        "kv_tokens_per_server": (
            part["config"].get("kv_tokens_per_server"),
            fresh["config"]["kv_tokens_per_server"],
        ),
        # a diagnosis run (perturbed servers) continues only as one
        "profiled": (part.get("profiled"), fresh.get("profiled")),
        "host_profiled": (part.get("host_profiled"), fresh.get("host_profiled")),
        # the tree that ran: a GIT_COMMIT given by hand does not vouch for it
        "source_sha256": (part.get("source_sha256"), fresh["source_sha256"]),
        # plain SGLang and the plugin on one release (parts from before it was recorded: any)
        "software": (part.get("software", fresh["software"]), fresh["software"]),
    }
    differ = [k for k, (a, b) in same.items() if a != b or (k == "boot_id" and a is None)]
    if differ:
        raise SystemExit(
            f"--continue-run: {path.name} is not this run ({', '.join(differ)} differ): "
            "run the stage again with plain SGLang"
        )
    plain = part["systems"].get("plain")
    if not plain or plain.get("error"):
        raise SystemExit(f"--continue-run: plain SGLang did not complete in {path.name}")
    keys = ("command", "date", "git_commit", "source_sha256")
    part["continued"] = part.get("continued", []) + [{k: fresh.get(k) for k in keys}]
    return part, path


def save_part(part: dict, path: Path, args) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_result(part))
    if args.export:
        dst = Path(args.export) / "parts"
        dst.mkdir(parents=True, exist_ok=True)
        for p in path.parent.glob("*.json"):
            shutil.copy2(p, dst / p.name)


# ---------------------------------------------------------------------------------------
# merging, the result file, plots
# ---------------------------------------------------------------------------------------


def load_parts(paths: list[Path]) -> list[dict]:
    parts = []
    for p in paths:
        files = sorted(p.glob("*.json")) if p.is_dir() else [p]
        for f in files:
            doc = json.loads(f.read_text())
            parts.extend(doc["data"]["parts"] if "data" in doc else [doc])
    return parts


def write_result(path: Path, merged: dict) -> None:
    """The result contract: machine, command, date, git_commit, summary, data. Provenance
    of a merged result is per part; the top level names every machine and commit used."""
    from sglang_psa.eval.results import tree_verified

    prov = merged["provenance"]
    for p in prov:  # is each part's commit the tree that ran? (None: not recorded)
        p["tree_verified"] = tree_verified(REPO, p["git_commit"], p.get("source_sha256"))
    doc = {
        "machine": "; ".join(sorted({p["machine"] for p in prov})),
        "device": "; ".join(merged["mixed"]["machines"]),
        "command": [p["command"] for p in prov],
        "date": max(p["date"] for p in prov),
        "git_commit": "; ".join(merged["mixed"]["git_commits"]),
        "sglang": "; ".join(sorted({p["sglang"] for p in prov})),
        "summary": merged["summary"],
        "summary_provenance": merged["summary_provenance"],
        "plain_races": merged["plain_races"],
        "provenance": prov,
        "data": {"parts": merged["parts"]},
    }
    if len(merged["mixed"]["git_commits"]) > 1 or len(merged["mixed"]["machines"]) > 1:
        doc["warning"] = "parts come from different commits or devices; see provenance"
    if any(p["tree_verified"] is False for p in prov):
        doc["tree_warning"] = "a part ran a tree that is not its git_commit (tree_verified)"
        log(f"warning: {doc['tree_warning']}")
    path.parent.mkdir(parents=True, exist_ok=True)
    # the summary (with every release's suffixed keys) indented for reading
    path.write_text(dump_result(doc, pretty_chars=len(json.dumps(doc["summary"], indent=1))))
    log(f"wrote {path}")


def tp_of(part: dict) -> int:
    """The `--tp-size` every server of a stage part ran at (1: parts from before `--tp`)."""
    return int(part.get("config", {}).get("tp", 1))


def merge_into(out: Path | None, new_parts: list[dict], args) -> dict:
    """Merge `new_parts` into the result at `out` (default: results/NAME.json for this
    device, under --export too) and redraw its plot."""
    device = new_parts[0]["device"] if new_parts else device_name()
    out = out or RESULTS / f"{result_name(device)}.json"
    old = load_parts([out]) if out.exists() and not getattr(args, "fresh", False) else []
    ids = {(p["workload"], p["run_id"]) for p in new_parts}
    tps = {tp_of(p) for p in old + new_parts}
    if len(tps) > 1:
        raise SystemExit(
            f"merge: parts at different --tp ({', '.join(map(str, sorted(tps)))}) go to "
            f"different result files; {out} would mix them"
        )
    merged = analysis.merge([p for p in old if (p["workload"], p["run_id"]) not in ids] + new_parts)
    if not merged["provenance"]:  # no server measured anything (e.g. the budget ran out)
        log(f"merge: no part holds a measurement; {out} is not written")
        return merged
    write_result(out, merged)
    plot(merged, out.with_suffix(".png"))
    if getattr(args, "export", None):
        Path(args.export).mkdir(parents=True, exist_ok=True)
        for f in (out, out.with_suffix(".png")):
            if f.exists():
                shutil.copy2(f, Path(args.export) / f.name)
    return merged


def plot(merged: dict, path: Path) -> None:
    """Output throughput against request rate (workload c) and the per-request TPOT
    distribution (workload a) of every system."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    if not merged["parts"]:
        return
    seen = [(p["workload"], n) for p in merged["parts"] for n in p["systems"]]

    def label(p: dict, name: str) -> str:  # a system measured in several runs: say which
        many = seen.count((p["workload"], name)) > 1
        return f"{name} (run {p['run_id']})" if many else name

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in merged["parts"]:
        if p["workload"] != "c":
            continue
        for name, rec in p["systems"].items():
            if rec.get("error") or "rates" not in rec:
                continue
            rates = sorted(rec["rates"], key=float)
            ax1.plot(
                [float(r) for r in rates],
                [rec["rates"][r]["metrics"]["output_tok_s"] for r in rates],
                marker="o",
                label=label(p, name),
            )
    ax1.set(xlabel="request rate (req/s)", ylabel="output tok/s", title="c: throughput vs rate")
    for p in merged["parts"]:
        if p["workload"] != "a":
            continue
        for name, rec in p["systems"].items():
            if rec.get("error") or "rows" not in rec:
                continue
            tp = sorted(1e3 * r["tpot_s"] for r in rec["rows"] if r["tpot_s"] is not None)
            if tp:
                ax2.plot(tp, [(i + 1) / len(tp) for i in range(len(tp))], label=label(p, name))
    ax2.set(xlabel="TPOT (ms)", ylabel="fraction of requests", title="a: TPOT distribution")
    ax2.set_xscale("log")
    for ax in (ax1, ax2):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def merge_cmd(args) -> int:
    parts = load_parts([Path(p) for p in args.parts])
    profiled = [p for p in parts if p.get("profiled") or p.get("host_profiled")]
    if profiled:  # their servers stalled for the profiler's export or sampling: perturbed
        log(f"merge: skipping {len(profiled)} part(s) of --profile-decode/--host-profile runs")
        parts = [p for p in parts if p not in profiled]
        if not parts:
            raise SystemExit(
                "merge: only --profile-decode/--host-profile parts given: diagnosis, not results"
            )
    if not parts:
        raise SystemExit("merge: no parts found in " + ", ".join(args.parts))
    merged = merge_into(Path(args.out) if args.out else None, parts, args)
    print(json.dumps(merged["summary"], indent=1))
    return 0


def profile_summary_cmd(args) -> int:
    """`--profile-decode` parts joined with the serving result's runs of the same commit
    (`analysis.profile_summary`), written as a result file of their own."""
    profiled = [p for p in load_parts([Path(f) for f in args.profile]) if p.get("profiled")]
    if not profiled:
        raise SystemExit(f"profile-summary: no --profile-decode part in {', '.join(args.profile)}")
    serving = json.loads(Path(args.serving).read_text())["data"]["parts"]
    summary, pairs = analysis.profile_summary(profiled, serving)
    results_mod.write_result(
        Path(args.out), summary, {"pairs": pairs},
        note="GPU time per decode step from the profiled servers (busy: some kernel ran), "
        "against the steady step of the same commit's unperturbed stage run where there is "
        "one (else GPU time only, against the profiled plain backend with the least); kernel "
        "tables per system in data.pairs[].profiles (concurrent kernels overlap there: their "
        "sum exceeds busy).",
    )  # fmt: skip
    print(json.dumps(summary, indent=1))
    return 0


def table_cmd(args) -> int:
    path = Path(args.result) if args.result else RESULTS / "serving_h100.json"
    doc = json.loads(path.read_text())
    print(analysis.markdown_table(doc["data"]))
    return 0


def missing(doc: dict | None) -> dict[str, dict[str, list[str]]]:
    """workload -> system -> rates of the default plan (every workload's default systems at
    its rates) that a merged result has no successful measurement of."""
    have = analysis.latest_runs(doc["data"]["parts"]) if doc else {}
    out: dict[str, dict[str, list[str]]] = {}
    for w in workloads_mod.WORKLOADS.values():
        keys = ["inf" if math.isinf(r) else f"{r:g}" for r in w.rates]
        for name in w.systems:
            lack = [k for k in keys if (w.name, name, k) not in have]
            if lack:
                out.setdefault(w.name, {})[name] = lack
    return out


def missing_cmd(args) -> int:
    path = Path(args.result) if args.result else RESULTS / "serving_h100.json"
    todo = missing(json.loads(path.read_text()) if path.exists() else None)
    for wname, systems in todo.items():
        others = {n: r for n, r in systems.items() if n != "plain"} or systems  # plain always runs
        for name, rates in others.items():
            extra = "" if rates == ["inf"] else f" --rates {','.join(rates)}"
            print(f"stage {wname} --systems {name}{extra}")
    if not todo:
        print(f"{path}: every workload's default systems are measured")
    return 0


def list_cmd(args) -> int:
    for w in workloads_mod.WORKLOADS.values():
        print(f"{w.name:4} {w.what}\n     systems: {', '.join(w.systems)}")
    print()
    for s in systems_mod.SYSTEMS.values():
        print(f"{s.name:17} {s.what}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("stage", help="run one workload against plain SGLang and other systems")
    st.add_argument(
        "workload",
        type=workload_list,
        help="a workload, or a comma list (e.g. a,a16) run on one server per system",
    )
    st.add_argument("--systems", help="comma list (default: the workload's); plain is always run")
    st.add_argument("--budget-s", type=float, default=560, help="wall-clock budget of the stage")
    st.add_argument("--work", default=str(DEFAULT_WORK), help="datasets, logs, parts")
    st.add_argument("--port", type=int, default=31000)
    st.add_argument(
        "--client-cores",
        type=int,
        default=2,
        help="physical cores kept for the client and the stage, the rest for the servers "
        "(0: no split; none either on machines of fewer than this + 4 cores)",
    )
    st.add_argument("--export", help="mirror parts and the merged result here (e.g. $OUT)")
    st.add_argument("--out", help="merged result file (default results/serving_<gpu>.json)")
    st.add_argument(
        "--smoke",
        action="store_true",
        help="a small version of the workload (8 requests, 1/16 lengths) to check the path; "
        "merged into WORK/serving_smoke.json, never into the real result",
    )
    st.add_argument(
        "--rates",
        help="a rate sweep's subset to run, e.g. 1,2 (a long sweep split over several calls)",
    )
    st.add_argument(
        "--continue-run",
        metavar="RUN_ID",
        help="add --systems to an earlier run of this stage on this machine (same boot, "
        "commit and workload; `last`: the newest): a stage that does not fit one call",
    )
    st.add_argument(
        "--start-together",
        action="store_true",
        help="start every system's server at once, pause each once healthy and measure "
        "them one at a time (the stage waits for the slowest start-up, not the sum); every "
        "server gets the same KV pool, sized for the largest workload, and they must fit "
        "the GPU's memory together",
    )
    st.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="time each system's run N times on its warm server (the prefix cache flushed "
        "before each) and keep the run of median output tokens/s whole, the others' "
        "headline figures beside it (not for rate sweeps or profiled runs)",
    )
    st.add_argument(
        "--profile-decode",
        type=int,
        default=0,
        metavar="STEPS",
        help="diagnosis: once every prompt is prefilled, record STEPS decode steps of each "
        "system with SGLang's profiler and keep a table of GPU time by kernel; the "
        "profiler's export stalls the server, so the run goes to WORK/serving_profile.json, "
        "never into a real result",
    )
    st.add_argument(
        "--host-profile",
        type=float,
        default=0,
        metavar="HZ",
        help="diagnosis: sample every server's scheduler loop HZ times a second and keep "
        "its host time per decode iteration by phase and Python function; sampling slows "
        "the loop, so the run goes to WORK/serving_profile.json, never into a real result",
    )
    st.add_argument(
        "--prompts",
        type=int,
        help="requests per run instead of the workload's (its batch where it is set from "
        "capacity: the most that plain SGLang's pool holds, up to this), e.g. an 8B-shape "
        "batch that one GPU's HBM cannot hold, at --tp 2",
    )
    st.add_argument(
        "--prompt-format",
        choices=driver.PROMPT_FORMATS,
        default="ids",
        help="how the client sends prompts: ids (token ids, the default: TTFT without SGLang's "
        "tokenizer-manager backlog of 32 long prompts arriving at once) or text",
    )
    st.add_argument("--model-dir", help="serve this model folder instead of the workload's")
    st.add_argument(
        "--tp",
        type=int,
        default=1,
        help="every server at --tp-size TP (one GPU per rank); the result goes to "
        "WORK/serving_tpTP.json (benchmark/parallel/run.py summarizes it), never beside "
        "one GPU's",
    )
    st.add_argument(
        "--launcher",
        help="server command to use instead of `python -m sglang.launch_server` (tests)",
    )
    st.set_defaults(fn=stage)
    mg = sub.add_parser("merge", help="merge stage parts (files, folders or result files)")
    mg.add_argument("parts", nargs="+")
    mg.add_argument("--out", help="result file to merge into (default by device of the parts)")
    mg.add_argument("--fresh", action="store_true", help="ignore the parts already in --out")
    mg.add_argument("--export")
    mg.set_defaults(fn=merge_cmd)
    ps = sub.add_parser("profile-summary", help="what bounds the profiled decode steps")
    ps.add_argument("profile", nargs="+", help="--profile-decode results (serving_profile.json)")
    ps.add_argument("--serving", default=str(RESULTS / "serving_h200.json"))
    ps.add_argument("--out", default=str(RESULTS / "decode_profile_h200.json"))
    ps.set_defaults(fn=profile_summary_cmd)
    tb = sub.add_parser("table", help="markdown table of a result file")
    tb.add_argument("result", nargs="?")
    tb.set_defaults(fn=table_cmd)
    ms = sub.add_parser("missing", help="stages a result still lacks (default plan)")
    ms.add_argument("result", nargs="?")
    ms.set_defaults(fn=missing_cmd)
    ls = sub.add_parser("list", help="workloads and systems")
    ls.set_defaults(fn=list_cmd)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
