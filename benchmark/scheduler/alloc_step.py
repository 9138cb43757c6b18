"""Host time of a decode step's KV slot allocation on SGLang's scheduler loop: SGLang's
own paged path against sglang-psa's one launch (`sglang_psa.mem_cache.decode_alloc`).

    python benchmark/scheduler/alloc_step.py [--out benchmark/results/alloc_step_<gpu>.json]

At a page size above one (under `--sparse-mode` a page is a 32-token PSA block) SGLang's
`alloc_for_decode` gathers each request's last slot, runs its allocation kernel, counts
the new pages with CPU tensor ops and writes the request-to-token table; the scheduler's
host runs all of it every decode step, and at batch 32 a sparse step waits for that host
loop. This times both paths' host side, call by call, on a batch of 16K-token requests
built on the GPU (a real `PagedTokenToKVPoolAllocator`; the tree cache and pools stand-ins
that `test/unit/mem_cache/test_decode_alloc.py` checks SGLang's path against), each step
followed by the lengths' advance as `prepare_for_decode` does it (not timed). SGLang's
`_alloc_page_size` is given the tree cache's page size (decode context parallelism off:
it reads the server's arguments, which no server set here). Needs SGLang and a CUDA GPU.

Summary: `host_us_sglang_b32`, `host_us_psa_b32`, `host_us_saved_b32` and the same per
batch size under `by_batch`; `launch_us_jit_b32`, the plugin kernel's launch through
Triton's JIT dispatch (`launch_us`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
PAGE = 32
PROMPT = 16_000


def fake_batch(bs, seed, device="cpu", need_sort=False, spare_pages=600, prompt=700, room=64):
    """A decode batch as `alloc_for_decode` reads it: `bs` requests in distinct rows of the
    request-to-token table, on pages of their own, of `prompt` tokens less up to two pages
    (a third at a page boundary), their rows `room` tokens longer, and the allocator's
    free pages shuffled (`spare_pages`). The tree cache records the tokens it is asked
    to evict (`batch.evicted`)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

    g = torch.Generator().manual_seed(seed)
    width_pages = (prompt + room) // PAGE + 1
    rows_total, width = bs + 8, width_pages * PAGE
    pages = bs * width_pages + spare_pages + 1
    alloc = PagedTokenToKVPoolAllocator(pages * PAGE, PAGE, torch.float32, device, None, need_sort)
    order = torch.randperm(pages - 1, generator=g) + 1
    rows = torch.randperm(rows_total, generator=g)[:bs]
    lens = torch.randint(max(1, prompt - 2 * PAGE), prompt, (bs,), generator=g)
    edge = torch.rand(bs, generator=g) < 0.33
    lens[edge] = (lens[edge] // PAGE).clamp(min=1) * PAGE
    table = torch.zeros(rows_total, width, dtype=torch.int32)
    k = 0
    for r, n in zip(rows.tolist(), lens.tolist()):
        used = (n + PAGE - 1) // PAGE
        slots = (order[k : k + used, None] * PAGE + torch.arange(PAGE)).reshape(-1)
        table[r, :n] = slots[:n].to(torch.int32)
        k += used
    alloc.free_pages = order[k : k + spare_pages].clone().to(device)
    evicted: list[int] = []
    tree = SimpleNamespace(
        page_size=PAGE,
        token_to_kv_pool_allocator=alloc,
        is_chunk_cache=lambda: False,  # 0.5.17
        supports_prefix_sharing=lambda: True,  # 0.5.23
        evict=lambda params: evicted.append(params.num_tokens),  # 0.5.17
        evict_for_alloc=lambda params, **kw: evicted.append(params.num_tokens),  # 0.5.23
        pretty_print=lambda: None,
        available_and_evictable_str=lambda: "(stand-in pool)",
    )
    pool = SimpleNamespace(req_to_token=table.to(device), _aux_cache=None)
    pool.write = lambda idx, values: pool.req_to_token.__setitem__(idx, values)
    pool.alloc_aux_to_lengths = lambda **kw: None  # 0.5.23: no auxiliary cache here
    reqs = [
        SimpleNamespace(kv=SimpleNamespace(kv_allocated_len=n, kv_committed_len=n))
        for n in lens.tolist()
    ]
    return SimpleNamespace(
        reqs=reqs,
        seq_lens=lens.to(device),
        seq_lens_cpu=lens.clone(),
        req_pool_indices=rows.to(device),
        req_pool_indices_cpu=rows.clone(),
        req_to_token_pool=pool,
        tree_cache=tree,
        token_to_kv_pool_allocator=alloc,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        hisparse_coordinator=None,
        device=device,
        maybe_evict_swa=lambda: None,
        evicted=evicted,
    )


def tree_page_size(batch) -> int:
    """SGLang's `_alloc_page_size` without a server: the tree cache's page size (on CUDA it
    asks the process's server arguments whether decode context parallelism is on; no
    server set them here, and it is off)."""
    return batch.tree_cache.page_size


def host_us(path, bs: int, steps: int, warmup: int = 50, device: str = "cuda") -> list[float]:
    """Host microseconds of each of `steps` decode allocations by `path(batch)`."""
    room = steps + warmup + PAGE  # every step's token fits its row
    batch = fake_batch(bs, seed=bs, device=device, spare_pages=bs * (room // PAGE + 2),
                       prompt=PROMPT, room=room)  # fmt: skip
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        out = path(batch)
        took = time.perf_counter() - t0
        if out is None:
            raise RuntimeError("the stand-in pool ran out of pages")
        if i >= warmup:
            times.append(took * 1e6)
        batch.seq_lens = batch.seq_lens + 1  # prepare_for_decode's advance
        batch.seq_lens_cpu = batch.seq_lens_cpu + 1
    if device == "cuda":
        torch.cuda.synchronize()
    return times


def launch_us(bs: int, steps: int, warmup: int = 50) -> dict:
    """Host microseconds of one launch of the plugin's decode-slot kernel on a batch of
    `bs` (medians over `steps`) through Triton's JIT dispatch, as `decode_alloc` calls it
    (`jit_us`: argument binding, specialisation key, cache lookup, launch), and of a
    `torch.empty` of the step's output (`empty_us`), for scale. The same slots are written
    each time (idempotent). (Calling the compiled kernel past the dispatch was measured
    and dropped: the H100 run on SGLang 0.5.23 put the dispatch at 15 us of the plugin's
    39 us step, and Triton 3.8 changed the compiled kernel's call, the coupling it costs.)"""
    from sgl_kernel_ext import decode_slots as ds

    b = fake_batch(bs, seed=bs, device="cuda", spare_pages=bs * 4, prompt=PROMPT, room=64)
    alloc = b.token_to_kv_pool_allocator
    out = torch.empty(bs, dtype=torch.int64, device="cuda")
    table = b.req_to_token_pool.req_to_token
    args = (table, table.stride(0), b.req_pool_indices, b.seq_lens, alloc.free_pages, out, bs)

    def timed(fn) -> float:
        times = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        return statistics.median(times)

    return {
        "jit_us": timed(lambda: ds._decode_slots_kernel[(1,)](*args, CHUNK=ds.CHUNK, PAGE=PAGE)),
        "empty_us": timed(lambda: torch.empty(bs, dtype=torch.int64, device="cuda")),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=None, help="default: benchmark/results/alloc_step_<gpu>.json")
    ap.add_argument("--steps", type=int, default=500)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("alloc_step: needs a CUDA GPU (the paths' host side includes launches)")
    from sglang.srt.mem_cache import allocation

    from sglang_psa.eval.results import gpu_tag, write_result
    from sglang_psa.mem_cache import decode_alloc

    allocation._alloc_page_size = tree_page_size
    paths = {
        "sglang": lambda b: allocation.alloc_for_decode(b, 1),
        "psa": decode_alloc.allocate,
    }
    by_batch = {}
    for bs in (8, 32, 64):
        row = {}
        for name, path in paths.items():
            t = host_us(path, bs, args.steps)
            row[name] = {"mean_us": statistics.fmean(t), "p50_us": statistics.median(t)}
        row["saved_us"] = row["sglang"]["mean_us"] - row["psa"]["mean_us"]
        by_batch[str(bs)] = row
        print(f"batch {bs}: SGLang {row['sglang']['mean_us']:.1f} us, psa "
              f"{row['psa']['mean_us']:.1f} us a step", flush=True)  # fmt: skip
    b32 = by_batch["32"]
    launch = launch_us(32, args.steps)
    print(f"batch 32, the kernel's launch: {launch}", flush=True)
    summary = {
        "host_us_sglang_b32": b32["sglang"]["mean_us"],
        "host_us_psa_b32": b32["psa"]["mean_us"],
        "host_us_saved_b32": b32["saved_us"],
        "launch_us_jit_b32": launch["jit_us"],
        "launch_b32": launch,
        "by_batch": by_batch,
    }
    tag = gpu_tag(torch.cuda.get_device_name(0))
    out = args.out or ROOT / "benchmark" / "results" / f"alloc_step_{tag}.json"
    print(write_result(Path(out), summary, {"steps": args.steps, "prompt_tokens": PROMPT}))


if __name__ == "__main__":
    main()
