"""Wave attention speed on the GPU: time vs fraction of blocks read, HBM vs host-resident.

Llama-3.1-8B head layout (32 q / 8 KV heads, d=128, bf16), one layer, random
data: random weights give near-uniform attention, so the fraction of blocks is
forced with a block budget (`max_read_blocks`, threshold 1) rather than by ε.
Baseline in the same run: dense decode attention over the full context (torch
SDPA) and the device-to-device copy bandwidth (HBM peak).

    python benchmark/kernels/bench_wave.py                # prints JSON
    python benchmark/kernels/bench_wave.py --serving-8b   # workload e's step, launch sweep
    python benchmark/kernels/bench_wave.py --serving-a    # workload a's (Qwen 0.5B heads)
    python benchmark/kernels/bench_wave.py --serving-a --defaults-only  # no sweep
    python benchmark/kernels/bench_wave.py --serving-a --knobs=rank,score  # these sweep keys
    python benchmark/kernels/bench_wave.py --launch-probe   # fixed cost by launch and read size
    python benchmark/kernels/bench_wave.py --graph-launch   # the host's cost to launch the graph
    python benchmark/kernels/bench_wave.py --kept-sweep   # the kept rows' launch, one knob at a time
        [--knobs=default,meta_in_chain]                    # ... only these
    python benchmark/kernels/bench_wave.py --ncu-kept     # a kept step, eager, for Nsight Compute
    python benchmark/kernels/bench_wave.py --serving-a --defaults-only --ctx=16000 \
        --shape=qwen05b_tp2   # workload a16's, one rank's heads at --tp 2
    python benchmark/kernels/bench_wave.py --readers --ctx=16000  # what else reads the pages
    python benchmark/kernels/bench_wave.py --tiered-a     # the two KV homes' launches at a
"""

from __future__ import annotations

import functools
import json
import math
import re
import sys

import torch
import triton
import triton.language as tl
from timing import cuda_time, replay_host_us

from sgl_kernel_ext.metadata import page_meta_from_locs
from sgl_kernel_ext.wave_attention import WaveAttention
from sglang_psa.config import PSAConfig

HQ, HKV, D, BS = 32, 8, 128, 32
# Head layouts a sweep can take (`use_shape`): query heads, KV heads, head dim.
# (q heads, KV heads, head dim); qwen05b_tp2: one rank's share of Qwen 0.5B's at --tp 2
SHAPES = {"llama8b": (32, 8, 128), "qwen05b": (14, 2, 64), "qwen05b_tp2": (7, 1, 64)}
# The server's defaults (ranking score, wave sizes), at ε = 1: a budget forces the fraction.
CONFIG = PSAConfig(block_size=BS, threshold=1.0)
# Launch shape; None: the library's default (what the server runs). The sweeps in run()
# set it for the headline case, then put the defaults back for every other row.
DEFAULT_LAUNCH = dict.fromkeys(
    (
        "tile_tokens",
        "num_warps",
        "splits",
        "num_stages",
        "score_blocks",
        "score_warps",
        "rank_chunk_blocks",
        "prefetch",
        "tma",
        "one_exp",
        "kept_tile_tokens",
        "kept_warps",
        "kept_stages",
        "kept_prefetch",
        "kept_most_splits",
        "kept_tma",
        "kept_beside",
        "kept_split",
        "fresh_first",
    )
)
LAUNCH = dict(DEFAULT_LAUNCH)


def _time(fn, reps: int = 20, warmup: int = 3, stream=None) -> float:
    return cuda_time(fn, reps, warmup, stream)


def _captured(fn, layers: int):
    """`fn()` run once on a side stream (warm-up, outside the capture), then captured
    `layers` deep in a CUDA graph: (the graph, fn's last result)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(layers):
            res = fn()
    return graph, res


def hbm_peak_gbps() -> float:
    x = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    t = _time(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() / t / 1e9


def h2d_peak_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    y = torch.empty(x.numel(), dtype=torch.uint8, device="cuda")
    return x.numel() / _time(lambda: y.copy_(x, non_blocking=True), reps=10) / 1e9


def setup(batch: int, ctx: int, host_fraction: float, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = ctx // BS
    n = batch * HKV * nb
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k_slots = torch.randn(n, BS, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v_slots = torch.randn_like(k_slots)
    loc = torch.randperm(n, device="cuda", generator=g).to(torch.int32)
    k_host = v_host = None
    if host_fraction > 0:
        k_host, v_host = k_slots.cpu().pin_memory(), v_slots.cpu().pin_memory()
        on_host = torch.rand(n, device="cuda", generator=g) < host_fraction
        loc = torch.where(on_host, -loc - 1, loc)
    loc = loc.view(batch, HKV, nb)
    # int32, as the serving backend passes them (converted once per step, not per layer)
    lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    # Metadata in the KV dtype, as the server keeps it (bf16 min/max are exact).
    meta = torch.randn(3, batch, HKV, nb, D, device="cuda", generator=g).to(torch.bfloat16)
    return q, k_slots, v_slots, k_host, v_host, loc, lengths, meta


def meta_bytes(batch: int, ctx: int) -> int:
    """Metadata the scoring reads per layer: every block's key vectors (bf16)."""
    vectors = int(CONFIG.needs_key_mean) + 2 * int(CONFIG.needs_key_bounds)
    return batch * HKV * (ctx // BS) * D * 2 * vectors


def bench_case(
    batch: int,
    ctx: int,
    frac: float,
    host_fraction: float = 0.0,
    profile: bool = False,
    splits: int | None = None,
    torch_rank: bool = False,
    layers: int = 1,
    plan_ctx: int | None = None,
    codes: bool = False,
) -> dict:
    """One step timed as a CUDA-graph replay. With `layers` > 1 the graph holds that many
    steps back to back, as one decode step's graph holds every layer's, and the time is
    per layer (the graph's launch is then shared, as it is in a model). `plan_ctx`: the
    plan (and the buffers) span that many tokens, the requests `ctx` (a server plans for
    its longest context); `codes`: key bounds as 8-bit codes, as the server keeps them."""
    q, ks, vs, kh, vh, loc, lengths, meta = setup(batch, plan_ctx or ctx, host_fraction)
    lengths.fill_(ctx)
    nb = (plan_ctx or ctx) // BS
    meta_scale = None
    if codes:
        from sglang_psa.algo.metadata import bound_codes

        lo, hi = torch.minimum(meta[1], meta[2]), torch.maximum(meta[1], meta[2])
        qlo, qhi, meta_scale = bound_codes(lo, hi)
        meta = (meta[0], qlo.to(torch.int8), qhi.to(torch.int8))
    budget = max(2, round(frac * (ctx // BS)))
    if splits is None:
        splits = LAUNCH["splits"] if batch == 8 and ctx == 131072 else None
    wa = WaveAttention.from_config(CONFIG)
    for attr, value in LAUNCH.items():
        if attr != "splits" and value is not None:
            setattr(wa, attr, value)
    wa.plan(batch, HQ, HKV, D, nb, "cuda", splits=splits)  # default splits follow num_warps
    if torch_rank:  # torch.sort instead of the one-launch ranking kernel (same order)
        wa.fused_rank_max_blocks = 0
    run = lambda: wa.run(
        q,
        ks,
        vs,
        loc,
        lengths,
        meta[0],
        meta[1],
        meta[2],
        k_host=kh,
        v_host=vh,
        max_read_blocks=budget,
        meta_scale=meta_scale,
    )
    t_eager = _time(run)
    # The whole step (scoring, ranking, all waves) captured once and replayed: the
    # production path, since a decode step needs no CPU round trip.
    graph, res = _captured(run, layers)
    t = _time(graph.replay, reps=20 if layers == 1 else 50, warmup=3 if layers == 1 else 10)
    t /= layers
    read_bytes = batch * HKV * budget * BS * D * 2 * 2
    if codes:  # the 8-bit bounds and their scale, for every block of the requests
        meta_read = batch * HKV * (ctx // BS) * (2 * D + 4)
    else:
        meta_read = meta_bytes(batch, ctx)
    assert int(res.n_read.min()) == budget == int(res.n_read.max())
    out = {
        "batch": batch,
        "ctx": ctx,
        "fraction": frac,
        "blocks_read": budget,
        "host_fraction": host_fraction,
        "time_us": t * 1e6,
        "layers_per_graph": layers,
        "eager_time_us": t_eager * 1e6,
        "score": wa.score,
        "splits": wa.splits,  # after any halving for the cooperative launch
        "gbps_on_bytes_read": read_bytes / t / 1e9,
        "bytes_read": read_bytes,
        # K/V plus the metadata the ranking reads (every block's, whatever the fraction).
        "meta_bytes_read": meta_read,
        "gbps_on_all_bytes": (read_bytes + meta_read) / t / 1e9,
    }
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            run()
            torch.cuda.synchronize()
        out["kernels_us"] = {
            e.key[:60]: e.device_time_total for e in p.key_averages() if e.device_time_total > 0
        }
    return out


def dense_sdpa_us(batch: int, ctx: int) -> float:
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, ctx, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    return _time(f) * 1e6


def run(h2d_floor_gbps: float = 0.0) -> dict:
    """`h2d_floor_gbps`: an H2D cudaMemcpy peak measured earlier in the same run; the
    host-block cost ratio divides by the higher of it and this run's own (one low
    memcpy sample would otherwise flatter the ratio)."""
    hbm = hbm_peak_gbps()
    h2d = max(h2d_peak_gbps(), h2d_peak_gbps(), h2d_floor_gbps)
    sweep = {}
    for tile, warps in ((32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)):
        LAUNCH.update(tile_tokens=tile, num_warps=warps)
        sweep[f"tile{tile}_warps{warps}"] = bench_case(8, 131072, 0.05)["time_us"]
        torch.cuda.empty_cache()
    best = min(sweep, key=sweep.get)
    LAUNCH.update(tile_tokens=int(best[4:].split("_")[0]), num_warps=int(best.split("warps")[1]))
    # Software-pipeline depth of the tile loop (1: loads wait for the previous merge).
    stage_sweep = {}
    for stages in (1, 2, 3, 4):
        LAUNCH.update(num_stages=stages)
        try:
            stage_sweep[f"stages{stages}"] = bench_case(8, 131072, 0.05)["time_us"]
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: report, go on
            stage_sweep[f"stages{stages}"] = f"failed: {type(e).__name__}: {str(e)[:100]}"
        torch.cuda.empty_cache()
    ok = {k: v for k, v in stage_sweep.items() if isinstance(v, float)}
    LAUNCH.update(num_stages=int(min(ok, key=ok.get)[6:]))
    sweep.update(stage_sweep)
    # Scoring launch shape (blocks per program, warps), whole step timed.
    score_sweep = {}
    for blocks in (32, 64, 128):
        for warps in (2, 4, 8):
            LAUNCH.update(score_blocks=blocks, score_warps=warps)
            score_sweep[f"score{blocks}_warps{warps}"] = bench_case(8, 131072, 0.05)["time_us"]
            torch.cuda.empty_cache()
    best = min(score_sweep, key=score_sweep.get)
    blocks, warps = (int(x) for x in re.findall(r"\d+", best))
    LAUNCH.update(score_blocks=blocks, score_warps=warps)
    sweep.update(score_sweep)
    # Blocks per ranking program (a row of 4096 blocks is sorted in 4096 / C chunks, merged).
    rank_sweep = {}
    for chunk in (256, 512, 1024, 2048):
        LAUNCH.update(rank_chunk_blocks=chunk)
        rank_sweep[f"rank_chunk{chunk}"] = bench_case(8, 131072, 0.05)["time_us"]
    LAUNCH.update(rank_chunk_blocks=int(min(rank_sweep, key=rank_sweep.get)[10:]))
    sweep.update(rank_sweep)
    print("launch sweep (us):", sweep, "->", LAUNCH, flush=True)
    # Programs per (request, KV head) for the headline case (more than one per SM needs
    # them all resident: a cooperative launch that does not fit fails and is skipped).
    split_sweep = {}
    best_tile, best_warps = LAUNCH["tile_tokens"], LAUNCH["num_warps"]
    # Fewer warps per program lets two programs share an SM, so more splits fit.
    for tile, warps in {(best_tile, best_warps), (64, 4), (128, 4), (32, 2), (64, 2)}:
        for sp in (1, 2, 4, 8):
            LAUNCH.update(tile_tokens=tile, num_warps=warps, splits=sp)
            key = f"tile{tile}_warps{warps}_splits{sp}"
            try:
                r = bench_case(8, 131072, 0.05)
                if r["splits"] != sp:  # halved to fit: the same as a smaller entry
                    split_sweep[key] = f"did not fit; ran with {r['splits']}"
                else:
                    split_sweep[key] = r["time_us"]
            except Exception as e:  # noqa: BLE001 - report and keep measuring
                split_sweep[key] = f"failed: {type(e).__name__}: {str(e)[:100]}"
            torch.cuda.empty_cache()
    ok = {k: v for k, v in split_sweep.items() if isinstance(v, float)}
    best = min(ok, key=ok.get)
    tile, warps, sp = (int(x) for x in re.findall(r"\d+", best))
    LAUNCH.update(tile_tokens=tile, num_warps=warps, splits=sp)
    print("split sweep (us):", split_sweep, "->", LAUNCH, flush=True)
    best_launch = dict(LAUNCH)
    best_headline = bench_case(8, 131072, 0.05)
    # Every row from here on runs the library's defaults, as the server does.
    LAUNCH.clear()
    LAUNCH.update(DEFAULT_LAUNCH)
    rows, dense = [], {}
    for ctx in (32768, 131072):
        for batch in (1, 8, 32):
            if batch * ctx * HKV * D * 4 > 40e9:  # K+V bf16 must fit comfortably
                continue
            dense[f"{ctx}x{batch}"] = dense_sdpa_us(batch, ctx)
            for frac in (0.01, 0.05, 0.2, 1.0):
                r = bench_case(batch, ctx, frac)
                torch.cuda.empty_cache()
                r["dense_sdpa_us"] = dense[f"{ctx}x{batch}"]
                r["hbm_efficiency"] = r["gbps_on_bytes_read"] / hbm
                r["hbm_efficiency_all_bytes"] = r["gbps_on_all_bytes"] / hbm
                rows.append(r)
                print(json.dumps(r), flush=True)
    host_rows = []
    for hf in (0.0, 0.5, 1.0):
        # Three fresh setups each (new pinned pool, new placement): the time of UVA reads
        # varied by a third between two setups of one run; the median is reported.
        tries = [bench_case(8, 131072, 0.05, host_fraction=hf) for _ in range(3)]
        r = sorted(tries, key=lambda x: x["time_us"])[1]
        r["time_us_per_setup"] = [x["time_us"] for x in tries]
        host_bytes = r["bytes_read"] * hf
        r["pcie_time_us"] = host_bytes / (h2d * 1e9) * 1e6
        host_rows.append(r)
        print(json.dumps(r), flush=True)
    # Fixed cost per layer: the smallest step (2 blocks per head, batch 1, 1K context).
    # Per layer in a 32-layer graph (a decode step's graph holds every layer); the step
    # replayed alone, graph launch included, is kept beside it.
    small = bench_case(1, 1024, 0.0, profile=True, layers=32)
    overhead = small["time_us"]
    overhead_one_graph = bench_case(1, 1024, 0.0)["time_us"]
    by_splits = {sp: bench_case(1, 1024, 0.0, splits=sp, layers=32)["time_us"] for sp in (1, 2)}
    key = next(r for r in rows if r["ctx"] == 131072 and r["batch"] == 8 and r["fraction"] == 0.05)
    # Where the headline step's time goes (scoring, ranking, waves), eager, profiled.
    key_profile = bench_case(8, 131072, 0.05, profile=True)["kernels_us"]
    key_torch_rank = bench_case(8, 131072, 0.05, torch_rank=True, profile=True)
    full_host = host_rows[-1]
    wave_us = next(v for k, v in key_profile.items() if k.startswith("_wave_attention_kernel"))
    return {
        "hbm_peak_gbps": hbm,
        "h2d_memcpy_peak_gbps_for_host_ratio": h2d,
        "wave_attention_hbm_efficiency": key["hbm_efficiency"],
        "wave_attention_hbm_efficiency_all_bytes": key["hbm_efficiency_all_bytes"],
        # The most the first can reach: K/V bytes over every byte the step must read (the
        # ranking reads all blocks' metadata whatever the fraction), all at the HBM peak.
        "wave_attention_hbm_efficiency_ceiling": key["bytes_read"]
        / (key["bytes_read"] + key["meta_bytes_read"]),
        # The wave kernel alone (profiled, eager) on the K/V bytes it reads.
        "wave_kernel_hbm_efficiency": key["bytes_read"] / (wave_us * 1e-6) / 1e9 / hbm,
        # The headline case with the launch shape the sweeps found best for it.
        "wave_attention_hbm_efficiency_best_launch": best_headline["gbps_on_bytes_read"] / hbm,
        "headline_best_launch": {**best_launch, "time_us": best_headline["time_us"]},
        "wave_fixed_overhead_us": overhead,
        "host_block_cost_ratio": full_host["time_us"] / full_host["pcie_time_us"]
        if full_host["pcie_time_us"] > 0
        else math.nan,
        "rows": rows,
        "host_rows": host_rows,
        "dense_sdpa_us": dense,
        "overhead_case": small,
        "overhead_one_step_per_graph_us": overhead_one_graph,
        "overhead_by_splits_us": by_splits,
        "headline_kernels_us": key_profile,
        "headline_with_torch_sort": {
            "time_us": key_torch_rank["time_us"],
            "kernels_us": key_torch_rank["kernels_us"],
        },
        "launch_sweep_us": sweep,
        "split_sweep_us": split_sweep,
        "launch": "library defaults (WaveAttention) for every row but headline_best_launch",
    }


def use_shape(name: str) -> None:
    """Set the head layout every later case uses (`SHAPES`)."""
    global HQ, HKV, D
    HQ, HKV, D = SHAPES[name]


def serving_8b() -> dict:
    """Workload e's decode step per layer (benchmark/serving, 8B shape): 20 requests of
    32000 tokens in a plan of 131072 (the model's context: the server plans for it), a
    top-k budget of 2048 tokens, 8-bit key bounds."""
    use_shape("llama8b")
    return launch_sweep(dict(batch=20, ctx=32000, frac=2048 / 32000, codes=True, layers=8), 131072)


_SERVER_DATA: dict = {}


def _server_data(batch: int, nb: int, device: str = "cuda", mixed: bool = False) -> tuple:
    """SGLang-layout K/V pages, a shuffled page table and per-page key metadata, made once
    per shape (`server_case` sweeps launches over the same data). Random keys give every
    KV head near-uniform attention; `mixed`: half the (request, KV head) pairs, at random,
    focus instead, every query of their group meeting 8 blocks of keys at a logit of 30
    (the rest near 0), so they stop after one wave while the others read to the cap, as
    psa's heads spread on a real model (`benchmark/decode_step/run.py balance`)."""
    from sglang_psa.algo.metadata import bound_codes

    key = (batch, nb, HQ, HKV, D, device, mixed)
    if key not in _SERVER_DATA:
        _SERVER_DATA.clear()
        g = torch.Generator(device=device).manual_seed(0)
        n_pages = batch * nb + 1  # page 0: SGLang's padding page
        kbuf = torch.randn(n_pages * BS, HKV, D, device=device, generator=g).to(torch.bfloat16)
        vbuf = torch.randn(n_pages * BS, HKV, D, device=device, generator=g).to(torch.bfloat16)
        pages = torch.randperm(n_pages - 1, device=device, generator=g) + 1
        pages = pages.to(torch.int32).view(batch, nb).contiguous()
        loc = pages[:, None, :].expand(batch, HKV, nb).contiguous()
        q = torch.randn(batch, HQ, D, device=device, generator=g).to(torch.bfloat16)
        if mixed:
            G = HQ // HKV
            focus = torch.rand(batch, HKV, device=device, generator=g) < 0.5
            for b, h in focus.nonzero().tolist():
                # The smallest key that every query of the group meets at logit 30 (its bound then
                # ranks it above every random block, whose bound is loose).
                qg = q[b, h * G : (h + 1) * G].float()
                want = torch.full((G, 1), 30.0 * D**0.5, device=device)
                key_vec = torch.linalg.lstsq(qg, want, driver="gelsd" if device == "cpu" else None)
                key_vec = key_vec.solution[:, 0].to(torch.bfloat16)
                for blk in torch.randperm(nb, device=device, generator=g)[:8].tolist():
                    p = int(pages[b, blk])
                    kbuf[p * BS : (p + 1) * BS, h] = key_vec
        blocks = kbuf.view(n_pages, BS, HKV, D).float()
        mean = blocks.mean(1).to(torch.bfloat16)
        qlo, qhi, mscale = bound_codes(blocks.amin(1), blocks.amax(1))
        _SERVER_DATA[key] = (
            q, kbuf, vbuf, pages, loc, mean, qlo.to(torch.int8), qhi.to(torch.int8), mscale,
        )  # fmt: skip
    return _SERVER_DATA[key]


def server_case(
    mode: str,
    batch: int,
    ctx: int,
    plan_ctx: int,
    frac: float,
    layers: int = 8,
    splits: int | None = None,
    profile: bool = False,
    bookkeeping: bool = True,
    eager_runs: int = 0,
    meta_in_chain: bool = False,
    host_launch: bool = False,
    tiered: bool = False,
    flagged: bool = False,
) -> dict:
    """One decode layer's sparse attention as the server runs it (workload a's Qwen2.5-0.5B
    heads): K/V read in place from SGLang's token-major pool `[tokens, Hkv, d]` (a page of
    `BS` tokens is a slot, the head an offset), per-page 8-bit key bounds and means read
    through the page table, last-use stamps and read counters written, a plan spanning
    `plan_ctx` tokens. `mode`: "psa" (ε 0.98, heuristic rule, waves with their barriers;
    random data gives near-uniform attention, so the read cap is set to `frac` to read
    that share), "psa_mixed" (the same over `_server_data(mixed=True)`: half the heads
    stop after one wave, the others read to the cap `frac`, as psa's heads spread on the
    real model), "topk" (ε 1, a budget of `frac` of the blocks: one
    wave) or "dense" (ε 1, every block: `--psa-threshold 1`). A `_kept` suffix ("psa_kept",
    "psa_mixed_kept"): a step between rankings (`--psa-rerank-interval`): the selection
    and read counts an eager ranking step left, read with no scoring, ranking or stop
    rule; `_halfkept`: the same with half the rows new in the batch (they rank).
    Each run writes the page metadata of the step's new keys as the server does
    (`run(new_keys=)`: the rows that rank before their ranking, the others in the kept
    rows' launch); `meta_in_chain`: every row's in one launch before the ranking (the
    path before).
    Graph-replayed `layers` deep, time per layer. `bookkeeping=False`: no last-use stamps
    or read counters (what they cost). `eager_runs > 0`: only that many runs, eager, no
    timing (for a profiler: `--ncu-kept`). `host_launch`: also the host's time to launch
    the graph (`timing.replay_host_us`), into an idle GPU and behind a busy one.
    `tiered`: as the tiered home runs it, with a host tier (pinned, head-major), the
    unit cache's tables and the step's row flags given to the kernel, every block still
    in HBM (workload a's case: nothing evicted); `flagged`: every row flagged as having
    a block off HBM (what such rows pay for the host tier's logic, none read)."""
    nb = plan_ctx // BS
    half = mode.endswith("_halfkept")  # half the rows joined since: they rank, half keep
    mode = mode.removesuffix("_halfkept") + ("_kept" if half else "")
    kept_sel = mode.endswith("_kept")
    mode = mode.removesuffix("_kept")
    mixed = mode == "psa_mixed"
    q, kbuf, vbuf, pages, loc, mean, qlo, qhi, mscale = _server_data(batch, nb, mixed=mixed)
    lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    stamps = torch.zeros(HKV, kbuf.shape[0] // BS, device="cuda", dtype=torch.int32)
    step = torch.zeros(1, device="cuda", dtype=torch.int32)
    stats = torch.zeros(3, device="cuda", dtype=torch.int64)
    psa = mode.startswith("psa")
    cfg = PSAConfig(block_size=BS, threshold=0.98 if psa else 1.0)
    wa = WaveAttention.from_config(cfg)
    budget = None
    if psa:  # the read cap (psa_mixed: the share its unfocused heads read)
        wa.max_read_fraction = frac
    elif mode == "topk":
        budget = max(2, round(frac * (ctx // BS)))
    for attr, value in LAUNCH.items():
        if attr != "splits" and value is not None:
            setattr(wa, attr, value)
    wa.plan(batch, HQ, HKV, D, nb, "cuda", splits=splits, out_dtype=torch.bfloat16,
            read_blocks=budget)  # fmt: skip
    kept = None
    if kept_sel:  # rank once (eager, fresh), then every replay reads what it kept
        from sgl_kernel_ext.selection import SelectionCache

        sel = SelectionCache(1, batch, HKV, nb, 1 << 30, BS, 2, "cuda")
        rows = torch.arange(batch, device="cuda")
        sel.assign(rows, lengths, step)  # no slot yet: every row ranks
        kept = sel.kept(0, batch)
    # The step's new keys: each request's last token, whose page gets its metadata again
    # (the server's `new_keys`; the keys stay as they are).
    last = lengths.long() - 1  # the new token's position
    new_locs = pages.gather(1, (last // BS)[:, None])[:, 0].long() * BS + last % BS
    new_keys = (kbuf, new_locs, mean, qlo, qhi, mscale)
    new_meta = lambda: page_meta_from_locs(*new_keys[:2], BS, *new_keys[2:])  # noqa: E731
    host = {}
    if tiered:  # a host tier of 64 blocks (none read) and an empty unit cache
        units = 64
        k_host = torch.zeros(HKV, units, BS, D, dtype=torch.bfloat16).pin_memory()
        shift = torch.zeros(1, dtype=torch.int64, device="cuda")
        host = dict(
            k_host=k_host, v_host=torch.zeros_like(k_host).pin_memory(),
            host_strides=(BS * D, D, units * BS * D),
            unit_slot=torch.full((HKV, units + 1), -1, dtype=torch.int32, device="cuda"),
            cache_pages=torch.zeros(1, dtype=torch.int32, device="cuda"),
            cache_shift=(shift, shift),
            row_host=torch.full((batch,), int(flagged), dtype=torch.int32, device="cuda"),
        )  # fmt: skip
    run = lambda: wa.run(
        q, kbuf, vbuf, loc, lengths, mean, qlo, qhi, scale=D**-0.5, max_read_blocks=budget,
        slot_strides=(BS * HKV * D, HKV * D, D), meta_pages=pages,
        stamps=stamps if bookkeeping else None, step=step, stats=stats if bookkeeping else None,
        meta_scale=mscale, kept=kept, new_keys=None if meta_in_chain else new_keys,
        before_rank=new_meta if meta_in_chain else None, **host,
    )  # fmt: skip
    if kept_sel:
        run()
        if half:  # requests new in the batch's first half: no slot, so they rank
            sel.invalidate(rows[: batch // 2])
        sel.assign(rows, lengths, step + 1)  # the steps between: no other row ranks
        assert int(sel.rows(batch)[1].sum()) == (batch // 2 if half else 0)
    if eager_runs:
        for _ in range(eager_runs):
            run()
        torch.cuda.synchronize()
        return {"mode": mode, "eager_runs": eager_runs}
    graph, res = _captured(run, layers)
    t = _time(graph.replay, reps=30, warmup=5) / layers
    n_read = res.n_read.float()
    read_bytes = batch * HKV * n_read.mean().item() * BS * D * 2 * 2
    out = {
        "mode": mode + ("_kept" if kept_sel else ""),
        "time_us": t * 1e6,
        "splits": wa.splits,
        "blocks_read_per_head": n_read.mean().item(),
        "largest_head_over_mean": (n_read.max() / n_read.mean()).item(),
        "waves_per_head": res.n_waves.float().mean().item(),
        "gbps_on_bytes_read": read_bytes / t / 1e9,
    }
    if host_launch:
        out["replay_host_us"] = replay_host_us(graph.replay)
        out["replay_host_us_queued"] = replay_host_us(graph.replay, drain=False)
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        with prof(activities=[ProfilerActivity.CUDA]) as p:
            graph.replay()
            torch.cuda.synchronize()
        out["kernels_us_per_layer"] = {
            e.key[:40]: e.device_time_total / layers
            for e in p.key_averages()
            if e.device_time_total > 0
        }
    return out


def _sweep_one(
    sweeps: dict, label: str, key: str, bench, splits, launch: dict, pick=lambda r: r["time_us"]
) -> None:
    """Time `bench(splits=splits)` (`pick` of its result: a case's `time_us`) with one
    launch change into `sweeps[key]`; a failure is recorded and the sweep goes on."""
    LAUNCH.update(launch)
    try:
        sweeps[key] = pick(bench(splits=splits))
    except Exception as e:  # noqa: BLE001 - report and keep measuring
        sweeps[key] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    LAUNCH.clear()
    LAUNCH.update(DEFAULT_LAUNCH)
    torch.cuda.empty_cache()
    print(label, sweeps[key], file=sys.stderr, flush=True)


def serving_a(
    sweep: bool = True,
    only: tuple[str, ...] = (),
    knobs: tuple[str, ...] = (),
    shape: str = "qwen05b",
    ctx: int = 28000,
) -> dict:
    """Workload a's decode attention per layer, in the server's layout (`server_case`): 32
    requests of `ctx` tokens (28000; a16: 16000) in a plan of 32768, with the heads of
    `shape` (`SHAPES`); psa reading 20% of the blocks in waves (its share there), and over
    heads that spread as a real model's do (`psa_mixed`: half stop after one wave, half
    read to the cap), topk its 2048-token budget in one; a launch sweep of each (splits,
    tile and warps, pipeline depth), against the HBM peak of the same run. `only`: these
    modes alone; `knobs`: the sweep keys starting so alone."""
    use_shape(shape)
    hbm = hbm_peak_gbps()
    result = {"hbm_peak_gbps": hbm, "heads": {"q": HQ, "kv": HKV, "d": D}, "block": BS}
    modes = (
        ("psa", 0.2), ("psa_mixed", 0.5), ("psa_kept", 0.2), ("psa_mixed_kept", 0.5),
        ("topk", 2048 / ctx), ("topk_kept", 2048 / ctx), ("dense", 1.0),
    )  # fmt: skip
    for mode, frac in (m for m in modes if not only or m[0] in only):
        case = dict(mode=mode, batch=32, ctx=ctx, plan_ctx=32768, frac=frac)
        default = server_case(**case, profile=True)
        sweeps: dict[str, float | str] = {"default": default["time_us"]}

        def one(key, splits=None, _ctx=(sweeps, mode, case), **launch):
            if knobs and not any(key.startswith(k) for k in knobs):
                return
            bench = functools.partial(server_case, **_ctx[2])
            _sweep_one(_ctx[0], f"{_ctx[1]} {key}", key, bench, splits, launch)

        if not sweep:  # the library's launch only
            result[mode] = {"case": case, "default": default}
            continue
        default_splits = default["splits"]
        for sp in {max(1, default_splits // 2), default_splits * 2}:
            one(f"splits{sp}", splits=sp)
        # The other block reader at its best launch: the per-row gather (waves read
        # through tensor descriptors by default), or descriptors (one-wave runs gather).
        if mode == "dense" or mode == "topk":
            one("descriptors", tma=True, tile_tokens=32)
        else:
            one("gather", tma=False, num_warps=2, tile_tokens=64)
            one("two_exp", one_exp=False)  # the block merge's second exponential pass
        for tile in (32, 64, 128):
            one(f"tile{tile}", tile_tokens=tile)
        one("stages3", num_stages=3)
        for warps in (1, 2, 4):
            one(f"warps{warps}", num_warps=warps)
        # The selection's launches: ranking chunk (1024: one launch, no merge) and scoring.
        for chunk in (256, 1024):
            one(f"rank_chunk{chunk}", rank_chunk_blocks=chunk)
        for blocks, warps in ((32, 2), (64, 2), (128, 4), (128, 8)):
            one(f"score{blocks}_warps{warps}", score_blocks=blocks, score_warps=warps)
        ok = {k: v for k, v in sweeps.items() if isinstance(v, float)}
        best = min(ok, key=ok.get)
        result[mode] = {
            "case": case,
            "default": default,
            "default_hbm_efficiency": default["gbps_on_bytes_read"] / hbm,
            "sweep_us": sweeps,
            "best": {
                "launch": best,
                "time_us": ok[best],
                "vs_default": ok[best] / default["time_us"],
            },
        }
        print(json.dumps({mode: result[mode]["best"]}), flush=True)
    return result


def launch_probe(ctx: int = 16000) -> dict:
    """The wave kernel's fixed cost by launch (`--launch-probe`): steps between rankings
    (`topk_kept`: the one-wave launch; `psa_kept`: kept rows read by the waves launch
    before they got a launch of their own, at commit 7f574a7) at read shares of 0.4% to
    40% of the blocks, each at its default split and at 1-32 programs a (request, KV
    head); wall time per layer (`t`) and the wave kernel's own (`wave`), microseconds."""
    use_shape("qwen05b")
    out: dict = {}

    def pick(r: dict) -> dict:
        k = r["kernels_us_per_layer"]
        wave = next((v for n, v in k.items() if n.startswith("_wave")), None)
        return dict(t=r["time_us"], wave=wave, splits=r["splits"], blk=r["blocks_read_per_head"])

    def case(key, mode, frac, **launch):
        bench = functools.partial(server_case, mode, 32, ctx, 32768, frac, profile=True)
        _sweep_one(out, key, key, bench, launch.pop("splits", None), launch, pick)

    for mode in ("topk_kept", "psa_kept"):
        for frac in (0.004, 0.02, 0.05, 0.1, 0.2, 0.4):
            case(f"{mode} f{frac} default", mode, frac)
    for frac in (0.02, 0.1, 0.2):
        for sp in (1, 2, 4, 8, 16, 32):
            case(f"topk_kept f{frac} s{sp}", "topk_kept", frac, splits=sp)
            case(f"psa_kept f{frac} s{sp}", "psa_kept", frac, splits=sp)
        case(f"topk_kept f{frac} prefetch", "topk_kept", frac, prefetch=True)
        case(f"psa_kept f{frac} gather", "psa_kept", frac, tma=False, num_warps=2,
             tile_tokens=64)  # fmt: skip
    return out


def graph_launch(ctx: int = 16000, layers: int = 24) -> dict:
    """The host's cost of launching a decode graph's attention (`--graph-launch`): the
    server case captured `layers` deep (the model's 24 layers at workload a16's shape),
    replayed into an idle GPU (`host_us`: what a host-bound step pays, as top-k's at 16K
    in the server) and behind busy ones (`queued_host_us`), against GPU time per layer
    (`t`), microseconds; for top-k's kept step at its default (the fresh rows' chain on a
    higher-priority stream), at one priority, on one stream and in one launch, psa's
    kept step both ways, both ranking steps and the dense read."""
    use_shape("qwen05b")
    out: dict = {}
    f = 2048 / ctx  # top-k's 2048-token budget

    def pick(r: dict) -> dict:
        return dict(host_us=r["replay_host_us"], queued_host_us=r["replay_host_us_queued"],
                    t=r["time_us"])  # fmt: skip

    cases = {
        "topk_kept": ("topk_kept", f, {}),
        "topk_kept_same_priority": ("topk_kept", f, dict(fresh_first=False)),
        "topk_kept_one_stream": ("topk_kept", f, dict(kept_beside=False)),
        "topk_kept_one_launch": ("topk_kept", f, dict(kept_split=False)),
        "topk_ranking": ("topk", f, {}),
        "psa_kept": ("psa_kept", 0.3, {}),
        "psa_kept_fresh_first": ("psa_kept", 0.3, dict(fresh_first=True)),
        "psa_ranking": ("psa", 0.3, {}),
        "dense": ("dense", 1.0, {}),
    }
    for key, (mode, frac, launch) in cases.items():
        bench = functools.partial(server_case, mode, 32, ctx, 32768, frac, layers=layers,
                                  host_launch=True)  # fmt: skip
        _sweep_one(out, f"graph launch {key}", key, bench, None, launch, pick)
    return out


def kept_sweep(cases=((16000, 0.3), (28000, 0.2)), only: tuple[str, ...] = ()) -> dict:
    """The kept rows' launch (`--kept-sweep`): psa's step between rankings at workload
    a16's and a's shapes (32 x ctx, Qwen 0.5B heads), reading the share of blocks psa reads
    there in the server, at the library's launch and around it (top-k's, at its 2048-token
    budget, first: `topk_ctx*`, with its kept rows in one launch with the fresh rows as
    `one_launch`); a ranking step, and a step
    where half the rows rank (`half_`), each with and without the bookkeeping (stamps,
    counters), with the kept rows' launch after the fresh rows' (`one_stream`) instead
    of beside them, and with the fresh rows' chain ahead of the kept launch (`fresh_first`)
    or at its priority (`same_priority`; one of the two is the plan's default); wall time per layer (`t`), the wave kernel's own (`wave`) and the
    new keys' page metadata's (`meta`, which waits for SMs beside the kept launch),
    microseconds; beside it the page gather alone over the same share (`read_pages`, no
    attention), GB/s. `only` keeps those knobs (and the ranking steps' `default`)."""
    use_shape("qwen05b")
    out: dict = {"hbm_peak_gbps": hbm_peak_gbps()}

    def pick(r: dict) -> dict:
        k = r["kernels_us_per_layer"]
        wave = next((v for n, v in k.items() if n.startswith("_wave")), None)
        meta = next((v for n, v in k.items() if n.startswith("_page_meta")), None)
        return dict(t=r["time_us"], wave=wave, meta=meta, blk=r["blocks_read_per_head"],
                    gbps=r["gbps_on_bytes_read"])  # fmt: skip

    t64 = dict(kept_tile_tokens=64, kept_warps=2)  # the launch before 128-token tiles
    knobs = {  # `book`: False runs without stamps and counters (what they cost)
        "default": {},
        "no_bookkeeping": dict(book=False),
        "one_stream": dict(kept_beside=False),  # kept rows after the fresh rows' launches
        "fresh_first": dict(fresh_first=True),  # the fresh rows' chain ahead (top-k's default)
        "same_priority": dict(fresh_first=False),  # ... not ahead (the stop rule's default)
        "meta_in_chain": dict(chain_meta=True),  # every new key's page before the ranking
        "prefetch": dict(kept_prefetch=True),
        "stages3": dict(kept_stages=3),
        "tile64_warps2": t64,
        "tile64_warps2_no_bookkeeping": dict(t64, book=False),
        "tile128_warps8": dict(kept_warps=8),
        "tile256_warps8": dict(kept_tile_tokens=256, kept_warps=8),
        "most16": dict(kept_most_splits=16),
        "most4": dict(kept_most_splits=4),
        "tma_warps1_prefetch_most16": dict(
            kept_tma=True, kept_warps=1, kept_prefetch=True, kept_most_splits=16
        ),
    }
    # top-k (2048 tokens a head): its kept rows in a launch of their own, on the side
    # stream (the default), against one launch with the fresh rows (`one_launch`, the path
    # before) and the kept launch's shape around the default
    topk_knobs = {
        key: knobs[key]
        for key in (
            "default",
            "no_bookkeeping",
            "one_stream",
            "same_priority",
            "meta_in_chain",
            "tile64_warps2",
            "most16",
            "most4",
        )  # fmt: skip
    } | {"one_launch": dict(kept_split=False)}
    if only:
        knobs = {k: v for k, v in knobs.items() if k in only or k == "default"}
        topk_knobs = {k: v for k, v in topk_knobs.items() if k in only or k == "default"}
    for ctx in sorted({c for c, _ in cases}):
        row = {}
        ranking = tuple(k for k in ("default", "one_launch") if k in topk_knobs)
        modes = (("topk_kept", topk_knobs), ("topk", ranking), ("topk_halfkept", ranking))
        for mode, keys in modes:
            for key in keys:
                launch = dict(topk_knobs[key])
                bench = functools.partial(server_case, mode, 32, ctx, 32768, 2048 / ctx,
                                          profile=True, bookkeeping=launch.pop("book", True),
                                          meta_in_chain=launch.pop("chain_meta", False))  # fmt: skip
                name = {"topk_kept": key, "topk": f"ranking_step_{key}"}.get(mode, f"half_{key}")
                _sweep_one(row, f"topk {ctx} {name}", name, bench, None, launch, pick)
        ok = {k: v["t"] for k, v in row.items() if isinstance(v, dict)}
        row["best"] = min(ok, key=ok.get)
        out[f"topk_ctx{ctx}"] = row
        print(json.dumps({f"topk {ctx}": {row["best"]: ok[row["best"]], "default": ok.get("default")}}),
              file=sys.stderr, flush=True)  # fmt: skip
    for ctx, frac in cases:
        row: dict = {}
        ranking = tuple(k for k in ("default", "no_bookkeeping", "one_stream") if k in knobs)
        for mode, keys in (("psa_kept", knobs), ("psa", ranking), ("psa_halfkept", ranking)):
            for key in keys:
                launch = dict(knobs[key])
                bench = functools.partial(server_case, mode, 32, ctx, 32768, frac, profile=True,
                                          bookkeeping=launch.pop("book", True),
                                          meta_in_chain=launch.pop("chain_meta", False))  # fmt: skip
                name = {"psa_kept": key, "psa": f"ranking_step_{key}"}.get(mode, f"half_{key}")
                _sweep_one(row, f"{ctx} {name}", name, bench, None, launch, pick)
        q, kbuf, vbuf, table, n = _chosen_pages(32, ctx, 32768, frac)
        nbytes = 32 * HKV * n * BS * D * 2 * 2
        for tok, warps, sp, stages in ((32, 2, 8, 3), (32, 2, 16, 2), (64, 2, 8, 2)):
            o = torch.empty(32, HKV, sp, device="cuda")
            fn = functools.partial(read_pages, kbuf, vbuf, table, o, tok, warps, stages)
            row[f"read_only_tok{tok}_warps{warps}_splits{sp}_stages{stages}_gbps"] = (
                nbytes / _graph_us(fn, 8) / 1e3
            )
        ok = {k: v["t"] for k, v in row.items() if isinstance(v, dict)}
        row["best"] = min(ok, key=ok.get)
        out[f"ctx{ctx}_frac{frac}"] = row
        print(json.dumps({ctx: {row["best"]: ok[row["best"]], "default": ok.get("default")}}),
              file=sys.stderr, flush=True)  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------
# Other readers of the same pages (`--readers`): how fast the bytes a sparse step reads can
# be read at all, with no attention (`read_pages`), and by FA3, SGLang's H100 decode kernel,
# given the chosen pages as a compacted page table per KV head (`fa3_case`).
# ---------------------------------------------------------------------------------------


@triton.jit
def _read_pages_kernel(
    k_ptr, v_ptr, table_ptr, out_ptr, n, Hkv, S,
    TOK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Grid (B, Hkv, S): program `s` of (request b, KV head h) reads tiles of `TOK` tokens
    of the `n` pages in `table_ptr[b, h, :n]` (interleaved with the other S - 1), K and V
    from SGLang's token-major pool `[tokens, Hkv, D]`, and writes their sum (so the loads
    are kept): a page gather as the wave kernel's one-wave path issues it, without the
    attention."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    acc = tl.zeros([TOK, D], tl.float32)
    total = n * BS
    dd = tl.arange(0, D)
    for i in tl.range(0, tl.cdiv(total - s * TOK, S * TOK), num_stages=STAGES):
        t = (s + i * S) * TOK + tl.arange(0, TOK)
        valid = t < total
        page = tl.load(table_ptr + (b * Hkv + h) * n + t // BS, mask=valid, other=0)
        row = page.to(tl.int64) * BS + t % BS
        off = (row * Hkv + h)[:, None] * D + dd[None, :]
        acc += tl.load(k_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
        acc += tl.load(v_ptr + off, mask=valid[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + (b * Hkv + h) * S + s, tl.sum(tl.sum(acc, axis=1), axis=0))


def read_pages(kbuf, vbuf, table, out, tok: int = 64, warps: int = 2, stages: int = 2):
    """`out [B, Hkv, S]` float32: partial sums of K + V over the pages `table [B, Hkv, n]`
    (int32 page ids) of the pool `kbuf/vbuf [tokens, Hkv, D]`, S = out's last dim."""
    B, Hkv, n = table.shape
    S = out.shape[2]
    _read_pages_kernel[(B, Hkv, S)](
        kbuf, vbuf, table, out, n, Hkv, S,
        TOK=tok, D=kbuf.shape[2], BS=BS, STAGES=stages, num_warps=warps,
    )  # fmt: skip


def read_pages_reference(kbuf, vbuf, table) -> torch.Tensor:
    """`[B, Hkv]` float32: the sum of K + V over each (request, KV head)'s pages."""
    B, Hkv, n = table.shape
    rows = (table.long()[..., None] * BS + torch.arange(BS, device=table.device)).view(B, Hkv, -1)
    h = torch.arange(Hkv, device=table.device)[None, :, None]
    return (kbuf[rows, h].float() + vbuf[rows, h].float()).sum((-1, -2))


def _chosen_pages(batch: int, ctx: int, plan_ctx: int, frac: float) -> tuple:
    """`_server_data`'s pool and query, and `[B, Hkv, n]` int32: n = `frac` of each
    request's pages, a different random choice per (request, KV head), as a selection
    would pick them."""
    q, kbuf, vbuf, pages, *_ = _server_data(batch, plan_ctx // BS)
    own = ctx // BS
    n = max(1, round(frac * own))
    g = torch.Generator(device="cuda").manual_seed(1)
    pick = torch.rand(batch, HKV, own, device="cuda", generator=g).argsort(-1)[..., :n]
    table = torch.gather(pages[:, None, :own].expand(batch, HKV, own), 2, pick)
    return q, kbuf, vbuf, table.to(torch.int32).contiguous(), n


def _graph_us(fn, layers: int) -> float:
    """Microseconds of one `fn()`, replayed `layers` deep in a CUDA graph."""
    graph, _ = _captured(fn, layers)
    return _time(graph.replay, reps=30, warmup=5) / layers * 1e6


def read_case(batch: int, ctx: int, plan_ctx: int, frac: float, layers: int = 8) -> dict:
    """The page gather alone (`read_pages`) over `frac` of the pages, swept over tile,
    warps, programs per (request, KV head) and pipeline depth; GB/s on the bytes read."""
    q, kbuf, vbuf, table, n = _chosen_pages(batch, ctx, plan_ctx, frac)
    nbytes = batch * HKV * n * BS * D * 2 * 2
    sweep = {}
    for tok in (32, 64, 128):
        for warps in (2, 4):
            for splits in (8, 16, 32):
                for stages in (2, 3):
                    out = torch.empty(batch, HKV, splits, device="cuda")
                    key = f"tok{tok}_warps{warps}_splits{splits}_stages{stages}"
                    fn = functools.partial(read_pages, kbuf, vbuf, table, out, tok, warps, stages)
                    try:
                        sweep[key] = nbytes / _graph_us(fn, layers) / 1e3
                    except Exception as e:  # noqa: BLE001 - report and keep measuring
                        sweep[key] = f"failed: {type(e).__name__}: {str(e)[:80]}"
    ok = {k: v for k, v in sweep.items() if isinstance(v, float)}
    best = max(ok, key=ok.get)
    return {"pages_per_head": n, "bytes": nbytes, "best": best, "best_gbps": ok[best],
            "gbps": sweep}  # fmt: skip


def fa3_case(
    batch: int, ctx: int, plan_ctx: int, frac: float, layers: int = 8, per_head: bool = False
) -> dict:
    """FA3 (SGLang's H100 decode kernel, `flash_attn_with_kvcache`) reading `frac` of each
    request's pages: per KV head one call over that head's slice of SGLang's pool with a
    compacted page table (the chosen pages; attention over a set of whole pages is
    order-free), graph-replayed. `frac` 1: one call over every page and head, as plain
    SGLang decodes. `per_head`: each head's pages copied out of the pool first (a layout
    SGLang does not keep: for FA3 builds that refuse the strided slice). Raises ImportError
    without SGLang's FA3."""
    from sglang.kernels.ops.attention.flash_attention_v3 import flash_attn_with_kvcache

    q, kbuf, vbuf, table, n = _chosen_pages(batch, ctx, plan_ctx, frac)
    n_pages = kbuf.shape[0] // BS
    kc, vc = kbuf.view(n_pages, BS, HKV, D), vbuf.view(n_pages, BS, HKV, D)
    G = HQ // HKV
    seqlens = torch.full((batch,), n * BS, device="cuda", dtype=torch.int32)
    if frac >= 1:
        _, _, _, pages, *_ = _server_data(batch, plan_ctx // BS)
        full = pages[:, : ctx // BS].contiguous()
        qf = q.view(batch, 1, HQ, D)
        calls = [(qf, kc, vc, full)]
    else:
        calls = [
            (q[:, h * G : (h + 1) * G].contiguous().view(batch, 1, G, D),
             kc[:, :, h : h + 1], vc[:, :, h : h + 1], table[:, h].contiguous())
            for h in range(HKV)
        ]  # fmt: skip
        if per_head:
            calls = [(qh, k.contiguous(), v.contiguous(), t) for qh, k, v, t in calls]

    def run():
        return [
            flash_attn_with_kvcache(
                q=qh,
                k_cache=k,
                v_cache=v,
                page_table=t,
                cache_seqlens=seqlens,
                softmax_scale=D**-0.5,
                causal=True,
            )
            for qh, k, v, t in calls
        ]

    us = _graph_us(run, layers)
    outs = [o[0] if isinstance(o, (tuple, list)) else o for o in run()]  # (out, lse, ...)
    got = torch.cat([o.reshape(batch, -1, D) for o in outs], dim=1).float()
    chosen = full[:, None, :].expand(batch, HKV, -1) if frac >= 1 else table
    want = _attention_over_pages(q, kbuf, vbuf, chosen)
    nbytes = batch * HKV * n * BS * D * 2 * 2
    return {"pages_per_head": n, "calls_per_layer": len(calls), "per_head_copy": per_head,
            "time_us": us, "gbps_on_bytes_read": nbytes / us / 1e3,
            "max_abs_err_vs_torch": (got - want).abs().max().item()}  # fmt: skip


def _attention_over_pages(q, kbuf, vbuf, table) -> torch.Tensor:
    """`[B, HQ, D]` float32: each query head's attention over the whole pages `table [B,
    Hkv, n]` of its KV head (the reference a compacted-table read must match)."""
    B, Hkv, n = table.shape
    rows = (table.long()[..., None] * BS + torch.arange(BS, device=table.device)).view(B, Hkv, -1)
    h = torch.arange(Hkv, device=table.device)[None, :, None]
    k, v = kbuf[rows, h].float(), vbuf[rows, h].float()  # [B, Hkv, n * BS, D]
    d = kbuf.shape[-1]
    qg = q.float().view(B, Hkv, -1, d)
    p = torch.softmax(qg @ k.transpose(-1, -2) * d**-0.5, dim=-1)
    return (p @ v).view(B, -1, d)


def readers(ctx: int = 16000, fracs=(0.07, 0.13, 0.3, 0.5, 1.0), shape: str = "qwen05b") -> dict:
    """Per layer at workload a16's (or a's) shape, for shares of the pages: the wave
    kernel's one-wave read (`server_case` topk: ranking included; at 1, threshold 1), the
    page gather alone (`read_case`, its best launch) and FA3 over the same share
    (`fa3_case`: over SGLang's pool, and over per-head copies of it), against the HBM copy
    peak of the same run."""
    use_shape(shape)
    out = {"hbm_peak_gbps": hbm_peak_gbps(), "heads": {"q": HQ, "kv": HKV, "d": D},
           "ctx": ctx, "batch": 32, "by_fraction": {}}  # fmt: skip
    for frac in fracs:
        row = {}
        mode = "dense" if frac >= 1 else "topk"
        case = dict(batch=32, ctx=ctx, plan_ctx=32768, frac=frac)
        for name, fn in (("wave", functools.partial(server_case, mode, **case, profile=True)),
                         ("read_only", functools.partial(read_case, **case)),
                         ("fa3", functools.partial(fa3_case, **case)),
                         ("fa3_per_head", functools.partial(fa3_case, **case, per_head=True))):  # fmt: skip
            try:
                row[name] = fn()
            except Exception as e:  # noqa: BLE001 - report and keep measuring
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            torch.cuda.empty_cache()
        out["by_fraction"][str(frac)] = row
        print(json.dumps({frac: {k: v.get("time_us", v.get("best_gbps", v.get("error")))
                                 for k, v in row.items()}}), file=sys.stderr, flush=True)  # fmt: skip
    return out


def launch_sweep(case: dict, plan_ctx: int) -> dict:
    """The library's launch with its kernel table at `case`, the same requests in a plan
    of their own length, then one launch knob at a time around the default (splits, tile
    and warps, pipeline depth, scoring launch), each graph-replayed `layers` deep.
    Against the HBM peak of the same run."""
    hbm = hbm_peak_gbps()
    default = bench_case(**case, plan_ctx=plan_ctx, profile=True)
    own = bench_case(**case)
    sweeps: dict[str, float | str] = {}

    bench = functools.partial(bench_case, **case, plan_ctx=plan_ctx)

    def one(key, splits=None, **launch):
        _sweep_one(sweeps, key, key, bench, splits, launch)

    for sp in (2, 4, 8, 16, 32):
        one(f"splits{sp}", splits=sp)
    for tile, warps in ((32, 4), (64, 8), (128, 4), (128, 8)):
        for sp in (4, 8, 16):
            one(f"tile{tile}_warps{warps}_splits{sp}", splits=sp, tile_tokens=tile, num_warps=warps)
    for stages in (1, 3):
        one(f"stages{stages}", num_stages=stages)
    for blocks, warps in ((32, 2), (32, 4), (64, 2), (64, 8), (128, 4), (128, 8), (256, 8)):
        one(f"score{blocks}_warps{warps}", score_blocks=blocks, score_warps=warps)
    ok = {k: v for k, v in sweeps.items() if isinstance(v, float)}
    best = min(ok, key=ok.get)
    return {
        "hbm_peak_gbps": hbm,
        "case": {**case, "plan_ctx": plan_ctx, "heads": {"q": HQ, "kv": HKV, "d": D}},
        "default": default,
        "default_plan_of_own_length": own,
        "sweep_us": sweeps,
        "best": {"launch": best, "time_us": ok[best], "vs_default": ok[best] / default["time_us"]},
        "default_hbm_efficiency_all_bytes": default["gbps_on_all_bytes"] / hbm,
    }


def tiered_a(ctx: int = 28000) -> dict:
    """The two KV homes' decode attention at workload a's shape (`server_case`, Qwen 0.5B
    heads, 32 x `ctx` tokens in a plan of 32768, nothing evicted), per layer: `hbm`, the
    HBM home; `tiered`, the tiered home's launch (a host tier, the unit cache and the
    step's row flags given: no row has a block off HBM, so the flagged rows' launch, on
    a branch of its own, has programs that return at once); `tiered_flagged`, that with
    every row flagged (the host tier's logic on every tile); `tiered_gather`, that with
    its waves reading every block by the per-row gather, two warps (the tiered home's
    launch before its waves read HBM blocks through tensor descriptors). Modes: psa over
    heads that spread as a real model's (`psa_mixed`, ranking every row), a step between
    rankings (`_kept`) and one with half the rows ranking (`_halfkept`), top-k's."""
    use_shape("qwen05b")
    out: dict = {"ctx": ctx, "batch": 32, "plan_ctx": 32768}
    cases = (("psa_mixed", 0.5), ("psa_mixed_kept", 0.5), ("psa_mixed_halfkept", 0.5),
             ("topk_kept", 2048 / ctx))  # fmt: skip
    for mode, frac in cases:
        row = {}
        for name, tiered, flagged, launch in (
            ("hbm", False, False, {}), ("tiered", True, False, {}),
            ("tiered_flagged", True, True, {}), ("tiered_gather", True, True, {"tma": False}),
        ):  # fmt: skip
            LAUNCH.update(launch)
            try:
                r = server_case(mode, 32, ctx, 32768, frac, tiered=tiered, flagged=flagged,
                                profile=True)  # fmt: skip
                row[name] = {"time_us": r["time_us"], "kernels_us": r["kernels_us_per_layer"]}
            finally:
                LAUNCH.clear()
                LAUNCH.update(DEFAULT_LAUNCH)
            torch.cuda.empty_cache()
        for name in ("tiered", "tiered_flagged", "tiered_gather"):
            row[f"{name}_vs_hbm"] = row[name]["time_us"] / row["hbm"]["time_us"]
        out[mode] = row
        print(mode, {k: v for k, v in row.items() if k.endswith("_vs_hbm")}, file=sys.stderr,
              flush=True)  # fmt: skip
    return out


if __name__ == "__main__":

    def option(name: str) -> str | None:
        """The value of `--name=VALUE` on the command line, or None."""
        return next((a.split("=", 1)[1] for a in sys.argv if a.startswith(f"--{name}=")), None)

    if "--readers" in sys.argv:
        print(json.dumps(readers(int(option("ctx") or 16000), shape=option("shape") or "qwen05b"),
                         indent=1))  # fmt: skip
    elif "--ncu-kept" in sys.argv:
        # Kept steps, eager, for Nsight Compute. The wave kernel's launches: the ranking run's
        # two (0, 1), then each kept run's kept-rows launch and its empty waves launch, so
        # skip 4 is the second kept run's kept-rows launch:
        #   ncu --kernel-name _wave_attention_kernel --launch-skip 4 --launch-count 1 \
        #     --section SpeedOfLight --section Occupancy --section WarpStateStats \
        #     --section MemoryWorkloadAnalysis --section LaunchStats \
        #     python3 benchmark/kernels/bench_wave.py --ncu-kept
        use_shape("qwen05b")
        ctx = int(option("ctx") or 16000)
        frac = float(option("frac") or 0.3)
        print(json.dumps(server_case("psa_kept", 32, ctx, 32768, frac, eager_runs=3)))
    elif "--kept-sweep" in sys.argv:
        only = tuple(v.split(",")) if (v := option("knobs")) else ()
        print(json.dumps(kept_sweep(only=only), indent=1))
    elif "--graph-launch" in sys.argv:
        print(json.dumps(graph_launch(int(option("ctx") or 16000)), indent=1))
    elif "--launch-probe" in sys.argv:
        print(json.dumps(launch_probe(int(option("ctx") or 16000)), indent=1))
    elif "--tiered-a" in sys.argv:
        print(json.dumps(tiered_a(int(option("ctx") or 28000)), indent=1))
    elif "--serving-8b" in sys.argv:
        print(json.dumps(serving_8b(), indent=1))
    elif "--serving-a" in sys.argv:
        only, knobs = (tuple(v.split(",")) if (v := option(k)) is not None else ()
                       for k in ("modes", "knobs"))  # fmt: skip
        sweep = "--defaults-only" not in sys.argv
        shape, ctx = option("shape") or "qwen05b", int(option("ctx") or 28000)
        print(json.dumps(serving_a(sweep, only, knobs, shape, ctx), indent=1))
    else:
        print(json.dumps(run(), indent=1))
