"""Where a sparse decode step's launches and syncs go, and its time against plain SGLang.

    python benchmark/decode_step/run.py profile --out $OUT/decode_step_profile.json   # GPU
    python benchmark/decode_step/run.py summarize --profile FILE                       # here

`profile` builds the `psa` backend over a real SGLang KV pool at workload a's
shape (Qwen2.5-0.5B attention: 24 layers, 14 query heads, 2 KV heads of 64;
32 requests of 28K tokens, bf16) and runs decode steps eagerly: it counts the
GPU launches per layer (kernels, copies and fills, from the CUDA profiler, the
per-step preparation counted apart) and the host syncs per step
(`torch.cuda.set_sync_debug_mode("warn")`), for `--sparse-mode psa`, `topk` and
`psa` at threshold 1. It also times the attention part of a step replayed as a
CUDA graph (every layer's attention, nothing else of the model).

`summarize` joins that with the serving benchmark's steady decode steps of
workload a (`benchmark/results/serving_h100.json`: plain SGLang and each mode
as real servers, each ratio within one stage run) into
`benchmark/results/decode_step_h100.json`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

from sglang_psa.eval.results import dump_result

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmark" / "results"
LAYERS, HQ, HKV, D, BS = 24, 14, 2, 64, 32
BATCH, PROMPT = 32, 28_000


def _git_commit() -> str:
    env = os.environ.get("GIT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def _rig(mode: str, threshold: float, device: str, prompt: int = PROMPT, interval: int = 1):
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from sglang_psa.attention.psa_backend import PSAAttnBackend
    from sglang_psa.config import PSAConfig

    cfg = PSAConfig(sparse_mode=mode, threshold=threshold, rerank_interval=interval)
    lengths = [prompt + 37 * i for i in range(BATCH)]
    pages_per = [-(-n // BS) + 1 for n in lengths]
    n_pages = sum(pages_per) + 8
    kv = MHATokenToKVPool(
        n_pages * BS, BS, torch.bfloat16, HKV, D, LAYERS, device, False, enable_alt_stream=False
    )
    req = ReqToTokenPool(BATCH + 1, 32_768 + 8, device, False)
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(LAYERS):
        kv.k_buffer[i].normal_(generator=g).mul_(3)
        kv.v_buffer[i].normal_(generator=g)
    perm = torch.randperm(n_pages - 4, device=device) + 1
    used = 0
    for r, (n, npg) in enumerate(zip(lengths, pages_per), start=1):
        pages = perm[used : used + npg]
        used += npg
        slots = (pages[:, None] * BS + torch.arange(BS, device=device)).flatten()[: n + 1]
        req.req_to_token[r, : n + 1] = slots.to(torch.int32)
    runner = SimpleNamespace(
        server_args=SimpleNamespace(_psa_config=cfg),
        req_to_token_pool=req,
        token_to_kv_pool=kv,
        page_size=BS,
        use_mla_backend=False,
        sliding_window_size=None,
    )
    backend = PSAAttnBackend(runner)
    backend.init_cuda_graph_state(BATCH, BATCH)  # the decode graphs' state (kept selections)
    rows = torch.arange(1, BATCH + 1, device=device)
    seq = torch.tensor([n + 1 for n in lengths], device=device)
    mode_ns = SimpleNamespace(is_decode_or_idle=lambda: True, is_extend=lambda: True)
    fb = SimpleNamespace(
        forward_mode=mode_ns,
        batch_size=BATCH,
        seq_lens=seq,
        req_pool_indices=rows,
        out_cache_loc=req.req_to_token[rows, seq - 1].long(),
        extend_prefix_lens=torch.zeros(BATCH, dtype=torch.int64, device=device),
        extend_num_tokens=sum(lengths),
    )
    layers = [
        SimpleNamespace(
            layer_id=i, tp_q_head_num=HQ, tp_k_head_num=HKV, head_dim=D, v_head_dim=D,
            scaling=D**-0.5, logit_cap=0.0, k_scale=None, v_scale=None,
        )
        for i in range(LAYERS)
    ]  # fmt: skip
    ext = SimpleNamespace(**{**vars(fb), "seq_lens": seq - 1})
    for ly in layers:  # the prompt's pages get their metadata, as after SGLang's prefill
        backend.on_extend(ly, ext)
    q = torch.randn(BATCH, HQ * D, generator=g, device=device, dtype=torch.bfloat16)
    k = torch.randn(BATCH, HKV, D, generator=g, device=device, dtype=torch.bfloat16)
    return backend, fb, layers, q, k


def _syncs(messages) -> list[str]:
    """The warnings of sync debug mode that report a synchronising call (not its one-time
    notice that the mode is a prototype)."""
    return [m for m in messages if "synchroniz" in m.lower() and "prototype feature" not in m]


def _kernel_times(fn, steps: int) -> dict[str, float]:
    """GPU microseconds per step by kernel name over `steps` eager calls of `fn`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("(")[0][:60]
            times[name] = times.get(name, 0.0) + e.device_time / steps
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _profile_mode(mode: str, threshold: float, prompt: int = PROMPT, interval: int = 1) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    backend, fb, layers, q, k = _rig(mode, threshold, "cuda", prompt, interval)

    def prep():
        backend.init_forward_metadata(fb)

    def attend():
        for ly in layers:
            backend.forward_decode(q, k, k, ly, fb, save_kv_cache=True)

    for _ in range(3):  # plans, compilation
        prep()
        attend()
    torch.cuda.synchronize()

    def launches(fn) -> int:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        n = 0
        for e in prof.events():
            if e.device_type.name == "CUDA":
                n += 1
        return n

    per_step = launches(prep)
    per_layer = launches(attend) / len(layers)

    def step():
        prep()
        attend()

    # Over a whole number of rerank intervals: the steps that rank and those that reuse.
    kernels_us = _kernel_times(step, max(interval, 1) * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prep()
            attend()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = _syncs(str(w.message)[:200] for w in caught)
    # The attention of a whole step as one CUDA graph (the decode graph holds it so).
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prep()
        attend()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 24 * max(interval, 1)  # whole intervals (the graph advances the step counter)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return {
        "mode": mode,
        "threshold": threshold,
        "prompt_tokens": prompt,
        "rerank_interval": interval,
        "kernel_us_per_step": kernels_us,
        "launches_per_layer": per_layer,
        "launches_per_step_prep": per_step,
        "syncs_per_step": len(syncs),
        "sync_messages": syncs[:5],
        "attention_graph_ms_per_step": start.elapsed_time(end) / reps,
        "blocks_read_fraction": backend.read_fraction(),
    }


def profile_cmd(args) -> None:
    import torch

    from sglang_psa.eval.results import source_digest

    out = {
        "machine": torch.cuda.get_device_name(),
        "command": "python benchmark/decode_step/run.py profile " + " ".join(sys.argv[2:]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "source_sha256": source_digest(ROOT),
        "shape": {
            "layers": LAYERS,
            "q_heads": HQ,
            "kv_heads": HKV,
            "head_dim": D,
            "block_size": BS,
            "batch": BATCH,
            "prompt_tokens": PROMPT,
        },  # fmt: skip
        "modes": [],
    }
    plan = [
        (m, t, n, r)
        for n in args.prompts
        for m, t, r in (("psa", 0.98, 1), ("topk", 0.98, 1), ("psa", 1.0, 1))
        + tuple(("topk", 0.98, r) for r in args.intervals)
    ]
    for k, spec in enumerate(plan, 1):  # written after each mode: a cut-short run keeps them
        out["modes"].append(_profile_mode(*spec))
        Path(args.out).write_text(dump_result(out))
        print(f"profile: {k}/{len(plan)} {spec}", file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


def _label(m: dict) -> str:
    """A profiled mode's name: mode, threshold, rerank interval, prompt length (and
    `_predicted` for the first-wave prediction psa once had with a kept order)."""
    pred = "_predicted" if m.get("first_wave_predicted") else ""
    return f"{m['mode']}_t{m['threshold']}_r{m['rerank_interval']}{pred}_{m['prompt_tokens']}"


def _wave_gbps(m: dict) -> float | None:
    """K+V bytes of the blocks a profiled step read (the rig's lengths: prompt + 37 i,
    bf16) over the wave kernel's time per step."""
    us = m.get("kernel_us_per_step", {}).get("_wave_attention_kernel")
    frac = m.get("blocks_read_fraction")
    if not us or frac is None:
        return None
    tokens = sum(m["prompt_tokens"] + 37 * i for i in range(BATCH))
    kv_bytes = tokens * LAYERS * HKV * D * 2 * 2  # K and V, 2 bytes each
    return kv_bytes * frac / (us * 1e-6) / 1e9


def summarize_cmd(args) -> None:
    """Join the profile with the serving benchmark's steady decode steps: each sparse mode
    against the fastest plain SGLang backend of the same stage run (workloads a and a16)."""
    sys.path.insert(0, str(ROOT))
    from benchmark.serving.analysis import STEP, same_run_ratio, vs_fastest

    from sglang_psa.eval.results import tree_verified

    serving = json.loads(Path(args.serving).read_text())
    prof = json.loads(Path(args.profile).read_text())
    parts = serving["data"]["parts"]
    steps, ratios = {}, {}
    for workload in ("a", "a16"):
        for system in ("psa", "topk", "psa_eps1", "psa_r8", "topk_r8"):  # psa_r8: measured once
            run, plain = vs_fastest(parts, workload, system)
            ratio, prov = same_run_ratio(run, plain, STEP)
            if ratio is None:
                continue
            key = f"{system}_{workload}"
            steps[key] = {"ms": run.metric(STEP), "plain_ms": plain.metric(STEP)}
            ratios[key] = {"ratio": ratio, "plain_backend": plain.system, "provenance": prov}
    main = [m for m in prof["modes"] if (m["mode"], m["threshold"], m["rerank_interval"]) == (
        "psa", 0.98, 1)]  # fmt: skip
    summary = {
        "syncs_per_step": max(len(_syncs(m["sync_messages"])) for m in prof["modes"]),
        "launches_per_layer_psa": max((m["launches_per_layer"] for m in main), default=None),
        "launches_per_layer": {_label(m): m["launches_per_layer"] for m in prof["modes"]},
        "step_ms_vs_fastest_plain": ratios,
        "attention_graph_ms_per_step": {
            _label(m): m.get("attention_graph_ms_per_step") for m in prof["modes"]
        },
        "selection_us_per_step": {  # scoring and ranking, summed over the layers
            _label(m): sum(
                us
                for k, us in m.get("kernel_us_per_step", {}).items()
                if k.startswith(("_score_kernel", "_rank_"))
            )
            for m in prof["modes"]
        },  # fmt: skip
        "wave_kernel_us_per_step": {
            _label(m): m.get("kernel_us_per_step", {}).get("_wave_attention_kernel")
            for m in prof["modes"]
        },
        "blocks_read_fraction": {_label(m): m.get("blocks_read_fraction") for m in prof["modes"]},
        # The wave kernel's bandwidth: the K and V bytes of the blocks it read over its time.
        "wave_kernel_gbps": {_label(m): _wave_gbps(m) for m in prof["modes"]},
        "hbm_copy_peak_gbps": args.hbm_peak_gbps,
    }
    out = {
        "machine": prof["machine"],
        "command": f"python benchmark/decode_step/run.py summarize --profile {args.profile}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "summary": summary,
        "serving_steps": steps,
        "profile_git_commit": prof["git_commit"],
        "profile_tree_verified": tree_verified(ROOT, prof["git_commit"], prof.get("source_sha256")),
        "profile": prof,
        "note": "serving steps are the steady decode steps parsed from each real server's log, "
        "each sparse system paired with the fastest plain backend of its own stage run; the "
        "profile runs the backend over SGLang's KV pool at the stated lengths (attention only).",
    }
    if args.launch_sweep:
        out["launch_sweeps_a"] = [_launch_sweep(spec) for spec in args.launch_sweep]
        # Per mode (psa_mixed: heads that spread as a real model's; `no_hint`, in sweeps of
        # a tree that dealt programs by the last step's reads: that deal turned off), each
        # tree's library launch.
        summary["wave_launch_a_us_per_layer"] = {
            f"{sw['git_commit'][:9]}_{mode}{'' if run == 'default' else '_' + run}": r[run][
                "time_us"
            ]
            for sw in out["launch_sweeps_a"]
            for mode, r in sw["result"].items()
            if isinstance(r, dict) and "default" in r
            for run in ("default", "no_hint")
            if run in r
        }
    if args.balance:
        bal = json.loads(Path(args.balance).read_text())
        out["balance"] = bal
        summary["psa_largest_head_over_mean_time"] = bal["summary"]["largest_over_mean_time"]
        summary["psa_heads_within_first_wave"] = bal["summary"]["share_of_heads_within_first_wave"]
        summary["psa_heads_at_read_cap"] = bal["summary"]["share_of_heads_at_read_cap"]
    Path(args.out).write_text(dump_result(out))
    print(json.dumps(summary, indent=1))


def _launch_sweep(spec: str) -> dict:
    """`COMMIT=FILE`: the output of `bench_wave.py --serving-a` run at COMMIT (its last
    JSON object; progress lines may precede it)."""
    commit, _, path = spec.partition("=")
    text = Path(path).read_text()
    start = text.rindex("\n{\n") + 1 if "\n{\n" in text else 0
    result = json.loads(text[start:])
    if "git_commit" in result:  # a sweep kept in an earlier summary: as it was
        return result
    return {
        "git_commit": commit,
        "command": "python benchmark/kernels/bench_wave.py --serving-a",
        "result": result,
    }


def deal_time(flat, first_share: float, by: str, per_pair: int = 8) -> float:
    """Summed over `flat [layers, steps, pairs]` (shares read), the time of a launch of
    `per_pair` programs a pair on average, dealt one each and the rest in proportion to a
    weight (the first wave's share: equal programs, as the wave kernel runs them; or a
    pair's share at the last step or at this one, never below the first wave's), its
    slowest pair setting the time (share / programs), over the time of the same bytes
    spread evenly."""
    import torch

    layers, steps, pairs = flat.shape
    spare = (per_pair - 1) * pairs
    total = balanced = 0.0
    for t in range(1 if by == "last_step" else 0, steps):
        now = flat[:, t]
        weight = {"first_wave": torch.zeros_like(now), "last_step": flat[:, t - 1]}.get(by, now)
        weight = weight.clamp(min=first_share)
        n = 1 + torch.floor(weight * spare / weight.sum(-1, keepdim=True))
        total += float((now / n).amax(-1).sum())
        balanced += float(now.sum(-1).sum() / (per_pair * pairs))
    return total / balanced


def balance_cmd(args) -> None:
    """How evenly psa's reads fall on the (request, KV head) programs of one launch, on the
    real test model's keys: each task prefilled by transformers, then decoded greedily
    under the default psa policy (the reference algorithm), its per-(layer, step, KV head)
    share of blocks read recorded. The tasks form one batch: per layer and step, a launch
    whose programs per head are fixed ends with its largest head, so the sum over layers
    and steps of the largest share against the sum of the mean is what that costs over a
    perfectly balanced launch of the same bytes."""
    import torch

    from sglang_psa.config import PSAConfig
    from sglang_psa.eval.runner import chat_parts
    from sglang_psa.eval.tasks import make_tasks
    from sglang_psa.hf.attention import DecodePolicy
    from sglang_psa.hf.decode import Session, load_model
    from sglang_psa.models import DEFAULT_MODEL, ensure_model

    model, tok = load_model(ensure_model(DEFAULT_MODEL), device=args.device)
    count = lambda s: len(tok(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    kinds = ["doc_qa", "niah_1key", "niah_multivalue", "variable_tracking"]
    tasks = make_tasks(kinds, args.prompt, args.per_kind, 0, count)
    cfg = PSAConfig()
    per_task = []  # [layers, steps, Hkv] shares read
    for i, task in enumerate(tasks):
        session = Session(model, tok)
        head, tail = chat_parts(tok, task.prompt, task.question)
        session.extend(head + tail)
        dec = session.decode(DecodePolicy("psa", cfg), args.steps)  # no early stop
        shares = torch.stack([f.view(-1, HKV) for _, f in sorted(dec.layer_fractions.items())])
        per_task.append(shares.float())
        print(f"task {i + 1}/{len(tasks)} {task.kind}: mean share {shares.mean():.3f}", flush=True)
        del session
        if args.device == "cuda":
            torch.cuda.empty_cache()
    steps = min(t.shape[1] for t in per_task)
    x = torch.stack([t[:, :steps] for t in per_task], 2)  # [layers, steps, tasks, Hkv]
    flat = x.flatten(2)  # [layers, steps, tasks * Hkv]: one launch's programs per layer/step
    nb = -(-args.prompt // cfg.block_size)
    first = min(max(int(nb * cfg.wave_fraction), cfg.wave_blocks), cfg.max_first_wave_blocks)
    first_share = (first + cfg.sink_blocks + cfg.recent_blocks) / nb
    out = {
        "machine": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "command": f"python benchmark/decode_step/run.py balance --prompt {args.prompt} "
        f"--per-kind {args.per_kind} --steps {args.steps} --device {args.device}",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git_commit": _git_commit(),
        "summary": {
            "tasks": len(tasks),
            "prompt_tokens": args.prompt,
            "steps": steps,
            "mean_share_read": float(flat.mean()),
            "largest_over_mean_time": float(flat.amax(-1).sum() / flat.mean(-1).sum()),
            "share_of_heads_within_first_wave": float((flat <= first_share + 1e-6).float().mean()),
            "share_of_heads_at_read_cap": float(
                (flat >= cfg.max_read_fraction - 1e-6).float().mean()
            ),
            "head_share_quantiles": {
                str(q): float(torch.quantile(flat.flatten(), q)) for q in (0.5, 0.9, 0.99)
            },
            "first_wave_share": first_share,
            # The same launches with their programs dealt by weight (`deal_time`): by the
            # first wave alone (equal programs, the wave kernel's launch), by the pair's
            # reads at the last step (a launch could know them), and by this step's (a
            # bound), over a perfectly balanced launch.
            **{
                f"deal_by_{by}_over_mean_time": deal_time(flat, first_share, by)
                for by in ("first_wave", "last_step", "this_step")
            },
            "step_to_step_share_correlation": float(
                torch.corrcoef(torch.stack([flat[:, 1:].flatten(), flat[:, :-1].flatten()]))[0, 1]
            ),
        },
        "per_layer_mean": flat.mean((1, 2)).tolist(),
        "per_layer_largest": flat.amax(-1).mean(1).tolist(),
        "tasks": [t.kind for t in tasks],
    }
    Path(args.out).write_text(dump_result(out))
    print(json.dumps(out["summary"], indent=1))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("profile", help="launches, syncs and graph time of the step (GPU)")
    p.add_argument("--out", default="decode_step_profile.json")
    p.add_argument("--prompts", type=int, nargs="+", default=[PROMPT], help="prompt lengths")
    p.add_argument(
        "--intervals", type=int, nargs="*", default=[], help="--psa-rerank-interval values > 1"
    )
    p.set_defaults(fn=profile_cmd)
    s = sub.add_parser("summarize", help="join the profile with the serving benchmark")
    s.add_argument("--profile", required=True)
    s.add_argument("--serving", default=str(RESULTS / "serving_h100.json"))
    s.add_argument("--out", default=str(RESULTS / "decode_step_h100.json"))
    s.add_argument(
        "--hbm-peak-gbps", type=float, default=None,
        help="device-to-device copy bandwidth measured on the GPU (bench_wave.hbm_peak_gbps)",
    )  # fmt: skip
    s.add_argument(
        "--launch-sweep", nargs="*", default=[], metavar="COMMIT=FILE",
        help="bench_wave.py --serving-a outputs (per-layer kernel times and launch sweeps at "
        "workload a's shape), each with the commit it ran",
    )  # fmt: skip
    s.add_argument("--balance", help="a `balance` output (psa's reads per KV head)")
    s.set_defaults(fn=summarize_cmd)
    b = sub.add_parser("balance", help="psa's reads per (request, KV head) on the real model")
    b.add_argument("--out", default="decode_step_balance.json")
    b.add_argument("--prompt", type=int, default=PROMPT)
    b.add_argument("--per-kind", type=int, default=2, help="tasks of each of 4 kinds")
    b.add_argument("--steps", type=int, default=16, help="decode steps a task")
    b.add_argument("--device", default="cuda")
    b.set_defaults(fn=balance_cmd)
    args = ap.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
