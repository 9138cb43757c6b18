"""Tiered-store pipeline on the GPU -> benchmark/results/store_h100.json and a plot.

PYTHONPATH=python:sgl-kernel-ext python benchmark/store/bench_store.py [--layers 32]

Llama-3.1-8B KV layout (8 KV heads, d=128, bf16, 32-token blocks). Baselines in
the same run: one contiguous pinned cudaMemcpy per direction (256 MiB).

- save: a prefill chunk of `--chunk-tokens` new tokens per layer, all layers
  back to back, through the serving path's `WriteBack` (`--psa-kv-home tiered`)
  until every job is acknowledged: GB/s of KV saved vs the D2H peak. Paths:
  `uva` as served (the default: a gather of the chunk's pages into device staging,
  then per run of host blocks one strided DMA copy of every KV head's K and one of V;
  the summary's `save_*` keys), `uva` with the save kernel alone (one kernel per layer
  writes the blocks into the host tier through unified addressing, as decode flushes go;
  `save_kernel_*`) and `engine` (GPU gather, one D2H copy per layer into the
  staging ring, copy-engine CPU scatter into host blocks; `save_engine_*`).
- overlap: the same saves issued between per-layer matmuls standing in for the
  layer's prefill compute; fraction of the save's GPU time hidden under compute,
  `(T_compute + T_save - T_both) / T_save`, and `prefill_slowdown_with_save`,
  `T_both / T_compute`, both timed on the GPU.
- promote: what the tiered home runs to bring host units back into HBM, the
  unit cache's refresh (one launch for every layer, UVA reads of the pinned host tier
  into scattered pages of SGLang's pool): GB/s vs the H2D peak for 64 to 512
  blocks' units per refresh (the summary: the largest).
- from real servers (`--serving`, default `serving_h100.json`; refresh alone with
  `--merge-serving-into`): `hbm_hit_rate` (workload b) and
  `max_concurrent_ratio_vs_plain_8b` (workload e).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from timing import cuda_time  # noqa: E402

from sglang_psa.eval.results import write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
H, D, BS, DT = 8, 128, 32, torch.bfloat16


def memcpy_peaks(mib: int = 256) -> dict[str, float]:
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = cuda_time(lambda: dev.copy_(host, non_blocking=True), reps=10)
    d2h = cuda_time(lambda: host.copy_(dev, non_blocking=True), reps=10)
    return {"h2d_memcpy_peak_gbps": n / h2d / 1e9, "d2h_memcpy_peak_gbps": n / d2h / 1e9}


def bench_save(
    layers: int, chunk: int, engine_threads: int, reps: int, path: str, dma: bool = True
) -> dict:
    """The serving path's write-back (`mem_cache.writeback.WriteBack`, as `--psa-kv-home
    tiered` runs it): a prefill chunk of `chunk` tokens in SGLang's token-major pool
    (pages in a shuffled order, as its allocator hands them out), saved once its last
    layer is written, every layer at once.
    `uva` with `dma` (as served): a staging of the chunk's blocks, runs moved by DMA;
    without: every job through the save kernel."""
    from types import SimpleNamespace

    from sglang_psa.mem_cache.writeback import WriteBack, wait_saved

    blocks = chunk // BS
    pages = blocks + 8
    g = torch.Generator(device="cuda").manual_seed(0)
    k = [torch.randn(pages * BS, H, D, device="cuda", generator=g).to(DT) for _ in range(layers)]
    v = [torch.randn(pages * BS, H, D, device="cuda", generator=g).to(DT) for _ in range(layers)]
    order = torch.randperm(pages - 1, device="cuda", generator=g)[:blocks] + 1
    req_to_token = (order[:, None] * BS + torch.arange(BS, device="cuda")).reshape(1, -1)
    wb = WriteBack(
        layers, H, D, DT, BS, 2 * blocks, 4 * chunk, "cuda",
        max_job_rows=chunk, threads=engine_threads, path=path,
        dma_blocks=blocks if path == "uva" and dma else 0,
    )  # fmt: skip
    nbytes = 2 * layers * chunk * H * D * torch.empty((), dtype=DT).element_size()
    w = torch.randn(4096, 4096, device="cuda", dtype=DT)
    x = torch.randn(chunk, 4096, device="cuda", dtype=DT)
    n_req = [0]

    def compute(layer_reps: int = 13):
        """Stand-in for one layer's prefill of the chunk, FLOP-matched to Llama-3.1-8B:
        2 x chunk x 218M weights = 13 of these [chunk, 4096] x [4096, 4096] matmuls."""
        y = x
        for _ in range(layer_reps):
            y = y @ w
        return y

    def saves(with_compute: bool):
        n_req[0] += 1
        req = SimpleNamespace(rid=n_req[0], req_pool_idx=0)
        assert wb.reserve(req.rid, chunk)
        wb.plan_extend([req], [chunk])
        wb.before_forward()
        for _ in range(layers if with_compute else 0):
            compute()
        wb.issue_extend(k, v, req_to_token)
        return req.rid

    def drain(rid) -> None:
        wait_saved(wb, poll_s=1e-4)  # finely: the end-to-end time includes this wait
        wb.forget(wb.records.pop(rid))

    def end_to_end() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        drain(saves(False))
        return time.perf_counter() - t0

    end_to_end()  # warm: engine threads, page faults in the host tier
    e2e = sorted(end_to_end() for _ in range(reps))[reps // 2]
    rid = saves(False)  # check one block's bytes in the host tier
    wait_saved(wb)
    hb, page = wb.saved_blocks(rid)[5], int(order[5])
    want = k[layers - 1][page * BS : (page + 1) * BS, 3].cpu()
    ok = torch.equal(wb.host.k[layers - 1, 3, hb], want)
    wb.forget(wb.records.pop(rid))

    def gpu_time(fn) -> float:
        """GPU time of `fn`'s work on both streams: from an event before to one after both."""
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            rid = fn()
            torch.cuda.current_stream().wait_stream(wb.stream)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
            if rid is not None:
                drain(rid)
        return sorted(times)[len(times) // 2]

    cpu_scatter_s, scatter_by_threads = None, {}
    if path == "engine":  # the engine's CPU scatter alone, here, by thread count
        from concurrent.futures import ThreadPoolExecutor

        from sglang_psa.mem_cache.copy_engine import scatter_rows

        segs = [(b, 0, BS) for b in range(blocks)]
        sk, sv = wb.engine.staged(0, chunk)
        for n_threads in sorted({1, 2, 4, 8, 16, engine_threads}):
            workers = ThreadPoolExecutor(n_threads)
            t0 = time.perf_counter()
            for layer in range(layers):
                scatter_rows(wb.host.k, wb.host.v, sk, sv, layer, segs, workers)
            dt = time.perf_counter() - t0
            workers.shutdown()
            scatter_by_threads[n_threads] = nbytes / dt / 1e9
            if n_threads == engine_threads:
                cpu_scatter_s = dt

    t_compute = gpu_time(lambda: [compute() for _ in range(layers)] and None)
    t_save = gpu_time(lambda: saves(False))
    t_both = gpu_time(lambda: saves(True))
    dma_jobs, dma_copy = wb.stats.dma_jobs, wb.report()["dma_copy"]
    wb.close()
    return {
        "path": path + ("" if path != "uva" or dma else " (save kernel only)"),
        "dma_jobs": dma_jobs,
        "dma_copy": dma_copy,
        "layers": layers,
        "chunk_tokens": chunk,
        "bytes": nbytes,
        "engine_threads": engine_threads,
        "save_end_to_end_s": e2e,
        "save_gbps": nbytes / e2e / 1e9,
        "engine_scatter_gbps": nbytes / cpu_scatter_s / 1e9 if cpu_scatter_s else None,
        "engine_scatter_gbps_by_threads": scatter_by_threads,
        "save_gpu_copy_s": t_save,
        "save_gpu_copy_gbps": nbytes / t_save / 1e9,
        "compute_s": t_compute,
        "compute_plus_save_s": t_both,
        "save_overlap_fraction": max(0.0, min(1.0, (t_compute + t_save - t_both) / t_save)),
        "saved_bytes_verified": ok,
    }


def bench_promote(layers: int, host_blocks: int, sizes: list[int], reps: int) -> dict:
    """The serving path's promotion: the unit cache's refresh (`UnitCache.refresh`, one
    launch) bringing host units (`HostKVPool`, pinned, read through UVA) into empty
    positions, i.e. pages of SGLang's token-major pool. For `n` cache pages (a position
    per (layer, KV head) each), `n` host blocks are hot (read by the last step) in every
    layer and evicted, spread so that every set gets as many as it has positions: one
    refresh copies `n` blocks' KV over all layers and heads. GB/s for each `n` (the
    tables are reset between timed runs)."""
    from sglang_psa.mem_cache.host_pool import HostKVPool
    from sglang_psa.mem_cache.unit_cache import WAYS, UnitCache

    host = HostKVPool(layers, H, host_blocks, BS, D, DT)
    g = torch.Generator().manual_seed(0)
    host.k[:, :, :64].copy_(torch.randn(host.k[:, :, :64].shape, generator=g).to(DT))
    block_bytes = 2 * layers * H * BS * D * torch.empty((), dtype=DT).element_size()
    sizes = sorted({-(-n // WAYS) * WAYS for n in sizes})
    pages = max(sizes) + 8
    pool = SimpleNamespace(
        k_buffer=[torch.zeros(pages * BS, H, D, device="cuda", dtype=DT) for _ in range(layers)],
        v_buffer=[torch.zeros(pages * BS, H, D, device="cuda", dtype=DT) for _ in range(layers)],
    )
    step = torch.tensor([7], dtype=torch.int32, device="cuda")
    by_size, ok = {}, True
    for n in sizes:
        cache = UnitCache(layers, H, host_blocks, n, BS, "cuda")
        stamps = torch.zeros(layers * H, host_blocks, dtype=torch.int32, device="cuda")
        stamps[:, :n] = 7  # host blocks 0..n-1: WAYS of them in each of the n / WAYS sets
        cache.live[:n] = 1
        cache.grow(torch.randperm(pages - 1, generator=g)[:n].cuda() + 1)
        times = []
        for _ in range(reps + 1):
            cache.unit_slot.fill_(-1)
            cache.slot_unit.fill_(-1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
            start.record()
            cache.refresh(stamps, 0, step, host, pool)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        t = sorted(times[1:])[len(times[1:]) // 2]  # the median, after a warm-up run
        pos = int(cache.unit_slot[(layers - 1) * H + 3, 5])  # page slot, layer buffer
        page = int(cache.cache_pages[pos // layers])
        got = pool.k_buffer[pos % layers][page * BS : (page + 1) * BS, 3].cpu()
        ok = ok and pos >= 0 and torch.equal(got, host.k[layers - 1, 3, 5])
        by_size[n] = {
            "blocks": n,
            "bytes": n * block_bytes,
            "s": t,
            "gbps": n * block_bytes / t / 1e9,
        }
    host.close()
    top = max(sizes)
    return {
        "layers": layers,
        "block_bytes": block_bytes,
        "round_blocks": top,
        "by_blocks": by_size,
        "round_gbps": by_size[top]["gbps"],
        "promoted_bytes_verified": ok,
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s, u, pr = data["save"], data["save_uva"], data["promote"]
    labels = ["D2H peak", "save uva", "save engine", "H2D peak", "promote round"]
    vals = [
        data["peaks"]["d2h_memcpy_peak_gbps"],
        u["save_gbps"],
        s["save_gbps"],
        data["peaks"]["h2d_memcpy_peak_gbps"],
        pr["round_gbps"],
    ]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(labels, vals, color=["#888", "#c63", "#e96", "#888", "#38c"])
    ax.set_ylabel("GB/s")
    ax.set_title("tiered store on the H100 (Llama-8B KV layout)", fontsize=9)
    for i, val in enumerate(vals):
        ax.text(i, val, f"{val:.1f}", ha="center", va="bottom", fontsize=8)
    plt.xticks(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def serving_figures(serving: Path) -> tuple[dict, dict]:
    """The store's figures that only a real server measures, from the serving benchmark's
    result: `hbm_hit_rate` (workload b, the tiered home's units read from HBM over all
    units decode read, in the timed window) and `max_concurrent_ratio_vs_plain_8b`
    (workload e: peak running requests of the tiered home over plain SGLang's in the same
    stage run, the serving summary's `max_concurrent_ratio_tiered_vs_plain_8b`). A figure
    not measured yet is None. Returns (summary part, provenance)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))
    from analysis import _pair, latest_runs

    if not serving.exists():
        return {"hbm_hit_rate": None, "max_concurrent_ratio_vs_plain_8b": None}, {}
    doc = json.loads(serving.read_text())
    best = latest_runs(doc["data"]["parts"])
    out, prov = {}, {"file": serving.name}
    run, _ = _pair(best, "b", "psa_tiered_uva")
    out["hbm_hit_rate"] = (run or {}).get("counters", {}).get("hbm_hit_rate")
    key = "max_concurrent_ratio_tiered_vs_plain_8b"
    out["max_concurrent_ratio_vs_plain_8b"] = doc["summary"].get(key)
    for key, (w, name) in (("hbm_hit_rate", ("b", "psa_tiered_uva")),
                           ("max_concurrent_ratio_vs_plain_8b", ("e", "topk_tiered"))):  # fmt: skip
        part = best.get((w, name, "inf"))
        if part is not None:
            prov[key] = {k: part[k] for k in ("workload", "run_id", "date", "git_commit", "device")}
    return out, prov


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--merge-serving-into",
        type=Path,
        help="only refresh an existing result's serving figures from --serving (no GPU)",
    )
    ap.add_argument("--serving", type=Path, default=RESULTS / "serving_h100.json")
    ap.add_argument("--name", default="store_h100")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--engine-threads", type=int, default=8)
    ap.add_argument("--host-blocks", type=int, default=1024, help="host tier of the promotion")
    ap.add_argument("--promote-blocks", default="64,256,512", help="units per refresh")
    args = ap.parse_args()
    if args.merge_serving_into:
        doc = json.loads(args.merge_serving_into.read_text())
        figures, prov = serving_figures(args.serving)
        doc["summary"].update(figures)
        doc["data"]["serving_source"] = prov
        args.merge_serving_into.write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["summary"], indent=1))
        return
    if not torch.cuda.is_available():
        sys.exit("bench_store needs a CUDA GPU")
    peaks = memcpy_peaks()
    print("peaks", peaks, flush=True)
    save = bench_save(args.layers, args.chunk_tokens, args.engine_threads, 5, "engine")
    print("save (engine)", save, flush=True)
    save_uva = bench_save(args.layers, args.chunk_tokens, args.engine_threads, 5, "uva")
    print("save (uva)", save_uva, flush=True)
    save_kernel = bench_save(
        args.layers, args.chunk_tokens, args.engine_threads, 5, "uva", dma=False
    )
    print("save (uva, kernel only)", save_kernel, flush=True)
    sizes = [int(n) for n in args.promote_blocks.split(",") if n]
    promote = bench_promote(args.layers, args.host_blocks, sizes, reps=10)
    print("promote", promote, flush=True)
    figures, prov = serving_figures(args.serving)
    d2h, h2d = peaks["d2h_memcpy_peak_gbps"], peaks["h2d_memcpy_peak_gbps"]
    summary = {
        # the default write-back (--psa-writeback uva); the copy engine's below
        "save_ratio_to_d2h_peak": save_uva["save_gbps"] / d2h,
        "save_overlap_fraction": save_uva["save_overlap_fraction"],
        "prefill_slowdown_with_save": save_uva["compute_plus_save_s"] / save_uva["compute_s"],
        "promote_ratio_to_h2d_peak": promote["round_gbps"] / h2d,
        **figures,
        **peaks,
        "save_engine_ratio_to_d2h_peak": save["save_gbps"] / d2h,
        "save_engine_overlap_fraction": save["save_overlap_fraction"],
        "prefill_slowdown_with_engine_save": save["compute_plus_save_s"] / save["compute_s"],
        "save_kernel_ratio_to_d2h_peak": save_kernel["save_gbps"] / d2h,
        "prefill_slowdown_with_kernel_save": save_kernel["compute_plus_save_s"]
        / save_kernel["compute_s"],
    }
    data = {"peaks": peaks, "save": save, "save_uva": save_uva, "save_uva_kernel": save_kernel}
    data["promote"] = promote
    data["serving_source"] = prov
    out = Path(args.out)
    write_result(
        out / f"{args.name}.json",
        summary,
        data,
        note="random bf16 KV in the Llama-3.1-8B layout; hbm_hit_rate and "
        "max_concurrent_ratio_vs_plain_8b come from real servers (serving_h100.json)",
    )
    plot(data, out / f"{args.name}.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
