"""A model of the tiered home's host-tier reads at workload b: how many of the units decode
reads miss the unit cache, with positions tied to their layer (the layout before shared
positions: each page held one slot per (layer, KV head), so a layer reading more blocks
than the cache has pages missed the excess whatever the ways) and with a set's positions
shared by the layers (`mem_cache.unit_cache` now), by ways per set
(`--psa-unit-cache-ways`). A prediction to check against the server's `reads_by_layer`,
not a measurement.

    python benchmark/studies/unit_cache_layers.py [--out FILE] [--kernel]

Inputs: the per-layer shares of the blocks read from the certified-bound study
(`results/archive/certified_bound_cpu_16k.json`, the true-mass oracle at ε 0.95, Qwen
0.5B at 16K on CPU), scaled to b's measured mean read share (0.20) and capped at the read
cap (0.5); b's batch on the H200 (13 requests of 875 blocks) and its unit cache (2,759
pages of the pool's 3,077 at the sample with the fewest; `serving_h200.json`). Each
(layer, KV head) reads a uniformly random set of that many host blocks, the same every
step (a kept selection; no churn between rankings); the cache holds a unit where its
set has a position for it (`mem_cache.unit_cache.UnitCache`'s fill order: page `p` is
way `p // sets` of set `p % sets`, host block `hb` in set `hb % sets`). Random blocks
spread less evenly over the sets than a request's consecutive host blocks, so the ways'
share is an upper estimate.

`--kernel` also runs the unit cache itself (`UnitCache.refresh`, the Triton kernel, under
Triton's interpreter on this CPU: ~7 minutes) once from empty at that shape (24 layers x 2
KV heads, head_dim 8 to keep the tensors small: the layout does not depend on it) and
counts the units read it takes in, checking a sample of them against their host copies.

Summary: `host_share_by_ways` ({ways: share of the units read that miss}),
`capacity_share` (the part no number of ways removes), both with positions tied to their
layer; `host_share_layers_shared_8_ways` (a set's positions shared by the layers: the
layout built); with `--kernel`, `kernel_cached_share_one_refresh` (the share of the units
read that the kernel's one refresh cached).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
STUDY = ROOT / "benchmark" / "results" / "archive" / "certified_bound_cpu_16k.json"
REQUESTS, BLOCKS, MEAN_READ, READ_CAP = 13, 875, 0.20, 0.5
POOL_PAGES, CACHE_PAGES, KV_HEADS = 3077, 2759, 2


def shares() -> np.ndarray:
    """Per-layer shares of the blocks read, scaled to b's mean and capped."""
    per_layer = json.loads(STUDY.read_text())["data"]["per_layer"]["oracle@0.95"]
    f = np.asarray(per_layer["blocks_fraction"])
    return np.minimum(READ_CAP, f * MEAN_READ / f.mean())


def host_share(
    ways: int, f: np.ndarray, seed: int = 0, shared: bool = False
) -> tuple[float, float]:
    """(share of the units read that miss, of it the share past the cache's pages). With
    `shared`, the unit cache's layout: a set's positions are its pages times the layers,
    per KV head, any layer's unit taking any of them; without, positions tied to their
    layer (the layout before)."""
    import torch

    from sglang_psa.mem_cache.unit_cache import UnitCache

    cache = UnitCache(1, 1, 1, POOL_PAGES, 32, "cpu", ways=ways)
    slots = cache._slots(0, CACHE_PAGES)  # the positions the cache's pages fill
    ways_in_set = torch.bincount(slots // ways, minlength=cache.sets).numpy()
    rng = np.random.default_rng(seed)
    blocks = REQUESTS * BLOCKS
    read = missed = past = 0
    for _ in range(KV_HEADS):  # the heads read alike
        head_sets = np.zeros(cache.sets, dtype=np.int64)  # units of this head by set
        for share in f:
            n = int(round(share * blocks))
            hot = rng.choice(blocks, n, replace=False)
            per_set = np.bincount(hot % cache.sets, minlength=cache.sets)
            read += n
            if shared:
                head_sets += per_set
            else:
                missed += int(np.maximum(per_set - ways_in_set, 0).sum())
                past += max(0, n - CACHE_PAGES)
        if shared:
            missed += int(np.maximum(head_sets - ways_in_set * len(f), 0).sum())
            past += max(0, int(head_sets.sum()) - CACHE_PAGES * len(f))
    return missed / read, past / read


def kernel_refresh(f: np.ndarray, seed: int = 0) -> dict:
    """One refresh of the real unit cache from empty at b's shape (see the docstring):
    every (layer, KV head) reads its share of the batch's evicted blocks. Needs
    TRITON_INTERPRET=1 (no GPU here)."""
    import time
    from types import SimpleNamespace

    import torch

    from sglang_psa.mem_cache.unit_cache import UnitCache

    L, H, bs, d, step = len(f), KV_HEADS, 32, 8, 7
    HB = REQUESTS * BLOCKS
    cache = UnitCache(L, H, HB, POOL_PAGES, bs, "cpu")
    cache.grow(torch.arange(1, CACHE_PAGES + 1))
    cache.live.fill_(1)  # every block of the batch evicted, as in b
    rng = np.random.default_rng(seed)
    stamps = torch.zeros(L * H, HB, dtype=torch.int32)
    read = 0
    for lid, share in enumerate(f):
        for h in range(H):
            n = int(round(share * HB))
            stamps[lid * H + h, torch.from_numpy(rng.choice(HB, n, replace=False))] = step
            read += n
    g = torch.Generator().manual_seed(seed)
    host = SimpleNamespace(
        k=torch.randn(L, H, HB, bs, d, generator=g).to(torch.bfloat16),
        v=torch.randn(L, H, HB, bs, d, generator=g).to(torch.bfloat16),
    )
    rows = (POOL_PAGES + 1) * bs
    pool = SimpleNamespace(
        k_buffer=[torch.zeros(rows, H, d, dtype=torch.bfloat16) for _ in range(L)],
        v_buffer=[torch.zeros(rows, H, d, dtype=torch.bfloat16) for _ in range(L)],
    )
    t0 = time.perf_counter()
    cache.refresh(stamps, 0, torch.tensor([step], dtype=torch.int32), host, pool)
    seconds = time.perf_counter() - t0
    held = (cache.unit_slot[:, :-1] >= 0).nonzero().tolist()
    for lh, hb in held[:: max(1, len(held) // 64)]:  # a sample: its copy in its position
        q = int(cache.unit_slot[lh, hb])
        page = int(cache.cache_pages[q // L])
        got = pool.k_buffer[q % L][page * bs : (page + 1) * bs, lh % H]
        if not torch.equal(got, host.k[lh // H, lh % H, hb]):
            raise AssertionError(f"unit ({lh}, {hb}) differs from its host copy")
    if len(held) != int(cache.copied):
        raise AssertionError(f"{len(held)} units cached, {int(cache.copied)} copied")
    return {
        "units_read": read,
        "positions": CACHE_PAGES * L * H,
        "cached": len(held),
        "cached_share": len(held) / read,
        "interpreter_s": seconds,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmark" / "results" / "unit_cache_layers.json"))
    ap.add_argument(
        "--kernel",
        action="store_true",
        help="also run the unit cache's refresh once at b's shape (interpreter)",
    )
    args = ap.parse_args(argv)
    if args.kernel and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("--kernel runs the Triton kernel on this CPU: set TRITON_INTERPRET=1")
    sys.path[:0] = [str(ROOT / "python"), str(ROOT / "sgl-kernel-ext")]
    from sglang_psa.eval.results import write_result

    f = shares()
    by_ways, capacity = {}, None
    for ways in (8, 16, 32, 64):
        by_ways[str(ways)], capacity = host_share(ways, f)
        print(f"{ways} ways: {by_ways[str(ways)]:.3f} of the units read miss "
              f"({capacity:.3f} past the cache's pages)")  # fmt: skip
    shared, _ = host_share(8, f, shared=True)
    print(f"8 ways, a set's positions shared by the layers: {shared:.3f} miss")
    summary = {
        "host_share_by_ways": by_ways,
        "capacity_share": capacity,
        "host_share_layers_shared_8_ways": shared,
    }
    data = {
        "layer_read_shares": f.tolist(),
        "requests": REQUESTS, "blocks_per_request": BLOCKS, "mean_read_share": MEAN_READ,
        "pool_pages": POOL_PAGES, "cache_pages": CACHE_PAGES, "kv_heads": KV_HEADS,
        "measured_host_share_b": [0.14, 0.17],
    }  # fmt: skip
    if args.kernel:
        k = kernel_refresh(f)
        print(f"the kernel's one refresh cached {k['cached']} of {k['units_read']} units read "
              f"({k['cached_share']:.4f}) in {k['positions']} positions")  # fmt: skip
        summary["kernel_cached_share_one_refresh"] = k["cached_share"]
        data["kernel_refresh"] = k
    print(write_result(Path(args.out), summary, data))


if __name__ == "__main__":
    main()
