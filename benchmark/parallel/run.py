"""Two GPUs: sglang-psa at `--tp 2`, and one server per GPU behind `sglang-router`.

    # the serving race at --tp 2 (plain SGLang at every backend, psa, topk, threshold 1):
    python benchmark/serving/run.py stage a,a16 --tp 2 \\
        --systems plain,plain_fa3,plain_flashinfer,psa,topk,psa_eps1 --export $OUT
    python benchmark/parallel/run.py router --out $OUT   # data parallelism, a mixed load
    python benchmark/parallel/run.py kill --out $OUT     # one rank's copy engine killed
    python benchmark/parallel/run.py summarize --serving WORK/serving_tp2.json \\
        --router $OUT/router_dp2.json --kill $OUT/engine_kill_tp2.json

`router` starts two `--sparse-mode psa` servers, one per GPU (`--base-gpu-id`), behind
`python -m sglang_router.launch_router` (round robin) and sends a mixed load through it:
`/generate` requests of 0.5-3K tokens, every fourth of 8-12K, and OpenAI chat
completions, all at once. `kill` starts one `--tp-size 2` server at the tiered home with
the copy-engine write-back and kills rank 1's copy engine 0.3 s into a run of eight
6-10K-token prompts (`probes.engine_kill`), against the same run unkilled. Each writes a
part with its provenance. `summarize` reads the `--tp 2` serving result and the two
parts and writes `benchmark/results/parallel_<gpu>x<N>.json` (the device named, e.g.
`parallel_h100x2`) with the issue's summary keys; a key whose run is missing is null.
Every serving ratio pairs two systems of one stage run (`analysis.same_run_ratio`), the
plain side being the fastest plain backend that run raced.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("benchmark/reliability", "benchmark/serving", "python"):
    sys.path.insert(0, str(ROOT / sub))

import analysis  # noqa: E402
import probes  # noqa: E402

from sglang_psa.eval.results import gpu_tag, write_result  # noqa: E402

RESULTS = ROOT / "benchmark" / "results"
ROUTER_ARGS = ["--max-running-requests", "16", "--cuda-graph-max-bs-decode", "16"]
KILL_ARGS = [
    "--tp-size", "2", "--psa-kv-home", "tiered", "--psa-writeback", "engine",
    "--psa-host-pool-gb", "4", "--max-running-requests", "8",
]  # fmt: skip
SUMMARY_KEYS = (
    "tp2_identical_fraction_eps1",
    "tp2_accuracy_delta_vs_plain",
    "tp2_throughput_ratio_vs_fastest_tp2",
    "tp2_throughput_ratio_vs_fastest_tp2_a16",
    "tp2_throughput_ratio_vs_fastest_tp2_8b",
    "tp2_decode_step_ratio_psa_vs_fastest_tp2",
    "tp2_decode_step_ratio_topk_vs_fastest_tp2",
    "tp2_decode_step_ratio_psa_vs_fastest_tp2_a16",
    "tp2_decode_step_ratio_topk_vs_fastest_tp2_a16",
    "plain_backend_tp2",
    "router_dp2_requests_failed",
    "tp2_engine_kill_requests_lost",
)


def gpus() -> list[str]:
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def need_gpus(n: int) -> None:
    have = gpus()
    if len(have) < n:
        raise SystemExit(f"this needs {n} GPUs; the machine has {len(have)} ({have})")


def router(args) -> int:
    """Two servers, one per GPU, behind sglang-router; a mixed load through it."""
    need_gpus(2)
    args.out.mkdir(parents=True, exist_ok=True)
    specs = [
        ([*ROUTER_ARGS, "--base-gpu-id", str(k)], args.port + 1 + k, args.out / f"worker{k}.log")
        for k in range(2)
    ]
    with probes.live_servers(specs) as servers:
        before = [s.psa_state()["finished"] for s, _ in servers]
        urls = [s.url for s, _ in servers]
        with probes.router(urls, args.port, args.out / "router.log") as (url, proc):
            load = probes.mixed_load(url, args.requests, args.new_tokens, chats=args.chats)
            router_alive = proc.poll() is None
        served = [s.psa_state()["finished"] - b for (s, _), b in zip(servers, before)]
        held = [s.leaks() for s, _ in servers]
        alive = [p.poll() is None for _, p in servers]
    data = {
        "requests": args.requests + args.chats,
        "failed": load["failed"],
        "failures": load["failures"],
        "wall_s": load["wall_s"],
        "finished_per_server": served,
        "held_after_per_server": held,
        "servers_alive": alive,
        "router_alive": router_alive,
        "server_args": ROUTER_ARGS,
        "gpus": gpus(),
    }
    print(json.dumps(data, indent=1))
    write_result(args.out / "router_dp2.json", {"router_dp2_requests_failed": load["failed"]}, data)
    return 0 if load["failed"] == 0 and all(alive) and router_alive else 1


def kill(args) -> int:
    """One `--tp-size 2` server at the tiered home; rank 1's copy engine killed mid-save."""
    need_gpus(2)
    args.out.mkdir(parents=True, exist_ok=True)
    with probes.live_server(KILL_ARGS, args.port, args.out / "kill_tp2.log") as (s, _):
        rep = probes.engine_kill(s, probes.kill_prompts(), new=96, rank=1)
    rep |= {"server_args": KILL_ARGS, "gpus": gpus()}
    print(json.dumps(rep, indent=1))
    write_result(
        args.out / "engine_kill_tp2.json", {"tp2_engine_kill_requests_lost": rep["lost"]}, rep
    )
    ok = rep["lost"] == 0 and rep["changed"] == 0 and rep["engine_restarts"] == 1
    return 0 if ok and rep["settled"] else 1


def serving_summary(parts: list[dict]) -> tuple[dict, dict]:
    """The `--tp` serving keys from the parts of one `--tp 2` serving result."""
    s: dict = {}
    prov: dict = {}

    def put(key: str, value_prov: tuple) -> None:
        s[key], where = value_prov
        if where is not None:
            prov[key] = where

    put(
        "tp2_throughput_ratio_vs_fastest_tp2",
        analysis.same_run_ratio(*analysis.vs_fastest(parts, "a", "psa"), analysis.TOK_S),
    )
    put(
        "tp2_throughput_ratio_vs_fastest_tp2_a16",
        analysis.same_run_ratio(*analysis.vs_fastest(parts, "a16", "psa"), analysis.TOK_S),
    )
    put(
        "tp2_throughput_ratio_vs_fastest_tp2_8b",
        analysis.same_run_ratio(*analysis.vs_fastest(parts, "d", "topk"), analysis.TOK_S),
    )
    for mode in ("psa", "topk"):
        for workload, suffix in (("a", ""), ("a16", "_a16")):
            put(
                f"tp2_decode_step_ratio_{mode}_vs_fastest_tp2{suffix}",
                analysis.same_run_ratio(*analysis.vs_fastest(parts, workload, mode), analysis.STEP),
            )
    # threshold 1 against plain SGLang at --tp 2 (triton, the same run's `plain`)
    eps1 = analysis.newest_with(parts, "a", "psa_eps1", "plain") or analysis.newest_with(
        parts, "a16", "psa_eps1", "plain"
    )
    pair = (analysis.measured(eps1, "psa_eps1"), analysis.measured(eps1, "plain"))
    put("tp2_identical_fraction_eps1", analysis.same_run_value(pair, 0, analysis.SAME))
    put("tp2_accuracy_delta_vs_plain", analysis.accuracy_delta_vs_fastest(parts, "psa"))
    put("plain_backend_tp2", analysis.plain_backend(parts))
    return s, prov


@functools.cache
def _serving_run():
    """benchmark/serving/run.py as a module (this file's own name is `run` too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("serving_run", ROOT / "benchmark/serving/run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result_path(device: str, tp: int) -> Path:
    """results/parallel_<gpu>x<tp>.json, the GPU named as the serving results name it."""
    return RESULTS / f"parallel_{gpu_tag(device)}x{tp}.json"


def summarize(args) -> int:
    serving_run = _serving_run()
    parts = serving_run.load_parts([args.serving]) if args.serving else []
    tps = {serving_run.tp_of(p) for p in parts}
    if parts and tps != {args.tp}:
        raise SystemExit(f"--serving: its parts ran at --tp {sorted(tps)}, not --tp {args.tp}")
    summary, prov = serving_summary(parts)
    docs = {}
    for key, path in (("router", args.router), ("kill", args.kill)):
        docs[key] = json.loads(path.read_text()) if path else None
        if docs[key]:
            summary |= docs[key]["summary"]
            for k in docs[key]["summary"]:
                prov[k] = {x: docs[key][x] for x in ("command", "date", "git_commit", "machine")}
    devices = sorted({p["device"] for p in parts} | {g for d in docs.values() if d
                                                      for g in d["data"]["gpus"]})  # fmt: skip
    if len(devices) > 1:
        raise SystemExit(f"the runs come from different GPUs: {devices}")
    out = args.out or result_path(devices[0] if devices else "no GPU", args.tp)
    data = {
        "serving_parts": parts,
        "plain_races": [r for p in parts if (r := analysis.plain_race(p))],
        "router": docs["router"],
        "engine_kill": docs["kill"],
    }
    summary = {k: summary.get(k) for k in SUMMARY_KEYS}
    machines = sorted({p["machine"] for p in parts} | {d["machine"] for d in docs.values() if d})
    write_result(
        out, summary, data, device=devices[0] if devices else None,
        summary_provenance=prov, machine="; ".join(machines) or None,
    )  # fmt: skip
    print(f"wrote {out}\n" + json.dumps(summary, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("router", help="two servers behind sglang-router, a mixed load")
    r.add_argument("--requests", type=int, default=48, help="/generate requests (default 48)")
    r.add_argument("--chats", type=int, default=8, help="chat completions (default 8)")
    r.add_argument("--new-tokens", type=int, default=128)
    r.add_argument("--port", type=int, default=30190)
    r.add_argument("--out", type=Path, default=Path("/tmp/psa-parallel"))
    r.set_defaults(fn=router)
    k = sub.add_parser("kill", help="--tp-size 2 at the tiered home, rank 1's engine killed")
    k.add_argument("--port", type=int, default=30180)
    k.add_argument("--out", type=Path, default=Path("/tmp/psa-parallel"))
    k.set_defaults(fn=kill)
    s = sub.add_parser("summarize", help="results/parallel_<gpu>x<N>.json from the runs")
    s.add_argument("--serving", type=Path, help="the --tp serving result (or its parts)")
    s.add_argument("--router", type=Path, help="router_dp2.json")
    s.add_argument("--kill", type=Path, help="engine_kill_tp2.json")
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--out", type=Path)
    s.set_defaults(fn=summarize)
    args = ap.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
