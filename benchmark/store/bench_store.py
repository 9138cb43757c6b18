"""Tiered-store pipeline on the GPU -> benchmark/results/store_h100.json and a plot.

PYTHONPATH=python:sgl-kernel-ext python benchmark/store/bench_store.py [--layers 32]

Llama-3.1-8B KV layout (8 KV heads, d=128, bf16, 32-token blocks). Baselines in
the same run: one contiguous pinned cudaMemcpy per direction (256 MiB).

- save: a prefill chunk of `--chunk-tokens` new tokens per layer, all layers
  back to back, through the serving path's `WriteBack` (`--psa-kv-home tiered`)
  until every job is acknowledged: GB/s of KV saved vs the D2H peak. Both paths:
  `engine` (GPU gather of the chunk's pages, one D2H copy per layer into the
  staging ring, copy-engine CPU scatter into host blocks; what the server runs)
  and `uva` (one kernel per layer writes the blocks into the host tier through
  unified addressing).
- overlap: the same saves issued between per-layer matmuls standing in for the
  layer's compute; fraction of the save's GPU copy time hidden under compute,
  `(T_compute + T_save - T_both) / T_save`, timed on the GPU.
- load: `Loader` bringing units into slots under a decode-like miss pattern
  (each step reads `--read-fraction` of a 128K context's blocks per request and
  KV head; `--reuse` of them were read the step before): GB/s of missed bytes
  vs the H2D peak, including the slot-table work; and a cold load (all misses).
- hit rate: `slot_hit_rate_at_10pct_cache` is taken from
  `slot_hit_rate_cpu.json` (real-model block-selection traces replayed through
  the slot cache on the CPU; see benchmark/store/README.md) when present.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
from timing import cuda_time  # noqa: E402

from sglang_psa.engine import Loader  # noqa: E402
from sglang_psa.eval.results import write_result  # noqa: E402
from sglang_psa.store.host_pool import HostKVPool  # noqa: E402
from sglang_psa.store.slot_store import SlotStore  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
H, D, BS, DT = 8, 128, 32, torch.bfloat16


def memcpy_peaks(mib: int = 256) -> dict[str, float]:
    n = mib << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = cuda_time(lambda: dev.copy_(host, non_blocking=True), reps=10)
    d2h = cuda_time(lambda: host.copy_(dev, non_blocking=True), reps=10)
    return {"h2d_memcpy_peak_gbps": n / h2d / 1e9, "d2h_memcpy_peak_gbps": n / d2h / 1e9}


def bench_save(layers: int, chunk: int, engine_threads: int, reps: int, path: str) -> dict:
    """The serving path's write-back (`mem_cache.writeback.WriteBack`, as `--psa-kv-home
    tiered` runs it): a prefill chunk of `chunk` tokens in SGLang's token-major pool
    (pages in a shuffled order, as its allocator hands them out), saved layer by layer."""
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
        for layer in range(layers):
            if with_compute:
                compute()
            wb.issue_extend_layer(layer, k[layer], v[layer], req_to_token)
        return req.rid

    def drain(rid) -> None:
        wait_saved(wb, poll_s=1e-4)  # finely: the end-to-end time includes this wait
        wb.release(rid)

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
    wb.release(rid)

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

        from sglang_psa.engine.copy_engine import scatter_rows

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
    wb.close()
    return {
        "path": path,
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


def bench_load(ctx: int, batch: int, read_fraction: float, reuse: float, steps: int) -> dict:
    nb = ctx // BS
    layers = 1  # one layer's units per step; the table spans this pool
    pool = HostKVPool(layers, H, nb * batch, BS, D, DT)
    per_head = max(1, int(nb * read_fraction))
    units_per_step = batch * H * per_head
    store = SlotStore(pool, num_slots=4 * units_per_step, device="cuda")
    loader = Loader(store)
    g = torch.Generator().manual_seed(0)
    unit_bytes = 2 * BS * D * 2  # K and V

    def step_units(prev: torch.Tensor | None) -> torch.Tensor:
        """Per (request, head): `reuse` of last step's blocks, the rest new at random."""
        rows = []
        for r in range(batch):
            for h in range(H):
                base = (h * pool.num_blocks) + r * nb
                keep = []
                if prev is not None:
                    old = prev[(r * H + h) * per_head : (r * H + h + 1) * per_head]
                    keep = old[torch.randperm(per_head, generator=g)[: int(per_head * reuse)]]
                    keep = keep.tolist()
                fresh = (torch.randperm(nb, generator=g) + base).tolist()
                have = set(keep)
                for u in fresh:
                    if len(keep) == per_head:
                        break
                    if u not in have:
                        keep.append(u)
                        have.add(u)
                rows.append(torch.tensor(keep, dtype=torch.int64))
        return torch.cat(rows)

    seq, prev = [], None
    for _ in range(steps):
        prev = step_units(prev)
        seq.append(prev.cuda())

    def run(units_seq):
        for u in units_seq:
            t = loader.load(u)
            t.wait()
            loader.release(t)

    torch.cuda.synchronize()
    run(seq[:2])  # warm
    before = dict(store.table.stats)
    t_steps = cuda_time(lambda: run(seq[2:]), reps=3, warmup=0)
    after = store.table.stats
    # cuda_time ran the sequence 3 times; misses per run:
    misses = (after["misses"] - before["misses"]) / 3
    n_steps = len(seq) - 2
    cold_units = torch.arange(units_per_step, device="cuda")

    def cold():
        store.table.drop_units(torch.arange(store.table.num_units, device="cuda"))
        t = loader.load(cold_units)
        t.wait()
        loader.release(t)

    t_cold = cuda_time(cold, reps=5)
    loader.synchronize()
    store.table.check_integrity()
    pool.close()
    miss_bytes = misses * unit_bytes
    return {
        "ctx": ctx,
        "batch": batch,
        "read_fraction": read_fraction,
        "reuse": reuse,
        "units_per_step": units_per_step,
        "steps": n_steps,
        "misses_per_step": misses / n_steps,
        "step_time_us": t_steps / n_steps * 1e6,
        "miss_gbps": miss_bytes / t_steps / 1e9,
        "cold_units": units_per_step,
        "cold_time_us": t_cold * 1e6,
        "cold_gbps": units_per_step * unit_bytes / t_cold / 1e9,
    }


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = data["save"]
    labels = ["H2D peak", "load (miss)", "load (cold)", "D2H peak", "save copy", "save e2e"]
    vals = [
        data["peaks"]["h2d_memcpy_peak_gbps"],
        data["load"]["miss_gbps"],
        data["load"]["cold_gbps"],
        data["peaks"]["d2h_memcpy_peak_gbps"],
        s["save_gpu_copy_gbps"],
        s["save_gbps"],
    ]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    ax.bar(labels, vals, color=["#888", "#38c", "#69d", "#888", "#c63", "#e96"])
    ax.set_ylabel("GB/s")
    ax.set_title("tiered store on the H100 (Llama-8B KV layout)", fontsize=9)
    for i, val in enumerate(vals):
        ax.text(i, val, f"{val:.1f}", ha="center", va="bottom", fontsize=8)
    plt.xticks(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def merge_hit_rate(path: Path) -> None:
    """Fill `slot_hit_rate_at_10pct_cache` of an existing result from the CPU trace replay
    (no GPU needed: the replay is a CPU simulation of the slot cache)."""
    hit_file = RESULTS / "slot_hit_rate_cpu.json"
    hit = json.loads(hit_file.read_text())
    doc = json.loads(path.read_text())
    doc["summary"]["slot_hit_rate_at_10pct_cache"] = hit["summary"]["slot_hit_rate_at_10pct_cache"]
    doc["data"]["hit_rate_source"] = {
        "file": hit_file.name,
        "git_commit": hit["git_commit"],
        "machine": hit["machine"],
        "summary": hit["summary"],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc["summary"], indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--merge-hit-rate-into", type=Path, help="only merge the CPU hit rate")
    ap.add_argument("--name", default="store_h100")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk-tokens", type=int, default=4096)
    ap.add_argument("--engine-threads", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--read-fraction", type=float, default=0.05)
    ap.add_argument("--reuse", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    if args.merge_hit_rate_into:
        return merge_hit_rate(args.merge_hit_rate_into)
    if not torch.cuda.is_available():
        sys.exit("bench_store needs a CUDA GPU")
    peaks = memcpy_peaks()
    print("peaks", peaks, flush=True)
    save = bench_save(args.layers, args.chunk_tokens, args.engine_threads, 5, "engine")
    print("save (engine)", save, flush=True)
    save_uva = bench_save(args.layers, args.chunk_tokens, args.engine_threads, 5, "uva")
    print("save (uva)", save_uva, flush=True)
    load = bench_load(args.ctx, args.batch, args.read_fraction, args.reuse, args.steps)
    print("load", load, flush=True)
    out = Path(args.out)
    hit_file = RESULTS / "slot_hit_rate_cpu.json"
    hit = json.loads(hit_file.read_text())["summary"] if hit_file.exists() else {}
    summary = {
        "save_ratio_to_d2h_peak": save["save_gbps"] / peaks["d2h_memcpy_peak_gbps"],
        "save_overlap_fraction": save["save_overlap_fraction"],
        "load_ratio_to_h2d_peak": load["miss_gbps"] / peaks["h2d_memcpy_peak_gbps"],
        "slot_hit_rate_at_10pct_cache": hit.get("slot_hit_rate_at_10pct_cache"),
        **peaks,
        "save_gbps": save["save_gbps"],
        "load_cold_ratio_to_h2d_peak": load["cold_gbps"] / peaks["h2d_memcpy_peak_gbps"],
        "save_uva_ratio_to_d2h_peak": save_uva["save_gbps"] / peaks["d2h_memcpy_peak_gbps"],
        "save_uva_overlap_fraction": save_uva["save_overlap_fraction"],
    }
    data = {
        "peaks": peaks,
        "save": save,
        "save_uva": save_uva,
        "load": load,
        "hit_rate_source": str(hit_file.name),
    }
    write_result(
        out / f"{args.name}.json",
        summary,
        data,
        note="random bf16 KV in the Llama-3.1-8B layout; the hit rate comes from real-model "
        "traces replayed on the CPU (slot_hit_rate_cpu.json)",
    )
    plot(data, out / f"{args.name}.png")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
