"""Reliability benchmark: bad inputs, faults and a soak against one live sglang-psa server.

    python benchmark/reliability/run.py [--kv-home hbm|tiered] [--soak-s 420] [--skip-probes]
                                        [--out DIR]

Starts `python -m sglang.launch_server --sparse-mode psa` on the GPU test model with
`probes.SERVER_ARGS` (and, at the tiered home, `probes.TIERED_ARGS` with SGLang's test
switch retracting a request every `probes.RETRACT_EVERY` forwards: that home spills KV to
its host tier instead of retracting), runs the bad-input and fault catalogue of
`probes.py`, then a soak:
16 clients send mixed requests (prompts 1K-8K tokens, 32-512 outputs) for `--soak-s`
seconds while the server's host RSS (its whole process tree), its pinned host bytes and
GPU memory are sampled every 10 s. Growth is measured from the end of warm-up (the first
quarter of the soak) to the end. Writes `reliability.json` (benchmark/results/ unless
`--out`) with the summary keys of the reliability issue.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import probes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from sglang_psa.eval.results import write_result  # noqa: E402

MB = 2**20


def _rss_bytes(pid: int) -> int:
    import psutil

    p = psutil.Process(pid)
    return sum(q.memory_info().rss for q in [p, *p.children(recursive=True)])


def _gpu_used_bytes() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        return int(out.stdout.split()[0]) * MB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def soak(s: probes.Server, pid: int, seconds: float, clients: int = 16) -> dict:
    stop = threading.Event()
    counts = {"done": 0, "error": 0}
    longest = min(8192, s.max_total_tokens // (2 * probes.MAX_RUNNING))

    def client(k: int):
        rng = random.Random(k)
        while not stop.is_set():
            n, out = rng.randint(1024, max(1024, longest)), rng.choice((32, 128, 512))
            try:
                r = s.generate(probes.prompt(n, rng.randrange(10**6)), out, timeout=900)
                counts["done" if r.status_code == 200 else "error"] += 1
            except Exception:  # noqa: BLE001 - counted, the soak goes on
                counts["error"] += 1

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    samples, t0 = [], time.time()
    while time.time() - t0 < seconds:
        st = s.psa_state()
        samples.append({
            "t_s": round(time.time() - t0, 1),
            "rss_bytes": _rss_bytes(pid),
            "gpu_used_bytes": _gpu_used_bytes(),
            "gpu_reserved_bytes": st.get("gpu_reserved_bytes"),
            "pinned_bytes": st.get("pinned_bytes"),
            "completed": counts["done"],
        })  # fmt: skip
        print(f"[soak] {samples[-1]}", flush=True)
        time.sleep(10)
    stop.set()
    for t in threads:
        t.join(900)
    warm = next(x for x in samples if x["t_s"] >= seconds / 4) if len(samples) > 1 else samples[0]
    last = samples[-1]

    def growth(key):
        a, b = warm.get(key), last.get(key)
        return None if a is None or b is None else (b - a) / MB

    return {
        "seconds": seconds,
        "clients": clients,
        "requests": counts,
        "samples": samples,
        "rss_growth_mb": growth("rss_bytes"),
        "gpu_growth_mb": growth("gpu_used_bytes"),
        "pinned_growth_mb": growth("pinned_bytes"),
        "held_after": s.leaks(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--soak-s", type=float, default=420, help="soak duration (default 420)")
    ap.add_argument("--skip-probes", action="store_true", help="soak only")
    ap.add_argument(
        "--probes-from",
        type=Path,
        help="with --skip-probes: keep the probe outcomes of this earlier result (an 8-minute "
        "soak and the probes do not fit one 10-minute GPU call together)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmark" / "results")
    ap.add_argument("--port", type=int, default=30131)
    ap.add_argument(
        "--kv-home",
        choices=sorted(probes.KV_HOMES),
        default="hbm",
        help="the server's KV home (tiered: SGLang's radix cache over the host tier)",
    )
    args = ap.parse_args()

    from importlib.metadata import version

    server_args = probes.SERVER_ARGS + probes.KV_HOMES[args.kv_home]
    log = args.out / "reliability_server.log"
    args.out.mkdir(parents=True, exist_ok=True)
    env = probes.KV_HOME_ENV[args.kv_home]
    with probes.live_server(server_args, args.port, log, probes.API_KEY, env=env) as (s, proc):
        outcomes = []
        if not args.skip_probes:
            for o in probes.bad_inputs(s):
                outcomes.append(o)
                print(f"[bad input] {'ok  ' if o.ok else 'FAIL'} {o.name}: {o.got}", flush=True)
            for o in [*probes.faults(s), probes.metrics_endpoint(s)]:
                outcomes.append(o)
                print(f"[{o.kind}] {'ok  ' if o.ok else 'FAIL'} {o.name}: {o.got}", flush=True)
        soaked = soak(s, proc.pid, args.soak_s) if args.soak_s > 0 else None

    earlier = None
    if args.skip_probes and args.probes_from:
        earlier = json.loads(args.probes_from.read_text())
        outcomes = [probes.Outcome(**o) for o in earlier["data"]["outcomes"]]
    bad = [o for o in outcomes if o.kind == "bad_input"]
    faults = [o for o in outcomes if o.kind == "fault"]
    over = next((o for o in faults if o.name.startswith("overload")), None)
    held = [o.detail.get("held_after", {}) for o in faults]
    summary = {
        "bad_inputs_tried": len(bad),
        "bad_inputs_clean_error": sum(o.ok for o in bad),
        "faults_tried": len(faults),
        "faults_survived": sum(o.ok for o in faults),
        "requests_lost": over.detail.get("lost") if over else None,
        # a token still held holds its page: tokens round up to pages (32 tokens each)
        "leaked_pages_after_load": (
            -(-max((h.get("kv_held_tokens", 0) for h in held), default=0) // 32) if held else None
        ),
        "metrics_check_ok": next((o.ok for o in outcomes if o.kind == "check"), None),
        "soak_rss_growth_mb": soaked and soaked["rss_growth_mb"],
        "soak_gpu_growth_mb": soaked and soaked["gpu_growth_mb"],
        "kv_home": args.kv_home,
        "sglang_version": version("sglang"),
    }
    path = write_result(
        args.out / "reliability.json",
        summary,
        {
            "outcomes": [o.as_dict() for o in outcomes],
            "soak": soaked,
            "probes_from": earlier and {k: earlier[k] for k in ("git_commit", "date", "command")},
        },
        server_args=server_args,
        server_env=env,
    )
    print(f"wrote {path}: {summary}")
    sys.exit(0 if all(o.ok for o in outcomes) else 1)


if __name__ == "__main__":
    main()
