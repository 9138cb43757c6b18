"""Where a loader step's time goes (torch profiler), for the decode-like miss pattern.

PYTHONPATH=python:sgl-kernel-ext python benchmark/store/profile_load.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from sglang_psa.engine import Loader
from sglang_psa.store.host_pool import HostKVPool
from sglang_psa.store.slot_store import SlotStore


def main() -> None:
    batch, H, nb, per_head = 8, 8, 4096, 204
    pool = HostKVPool(1, H, nb * batch, 32, 128, torch.bfloat16)
    n = batch * H * per_head
    store = SlotStore(pool, num_slots=4 * n, device="cuda")
    loader = Loader(store)
    g = torch.Generator().manual_seed(0)
    steps = [torch.randperm(H * nb * batch, generator=g)[:n].cuda() for _ in range(6)]
    for u in steps[:2]:
        t = loader.load(u)
        t.wait()
        loader.release(t)
    torch.cuda.synchronize()
    # Any op in a load that synchronizes the stream is reported with its stack.
    import traceback
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"SYNC: {message}\n" + "".join(traceback.format_stack(limit=8)[:-1]))

    warnings.showwarning = show
    torch.cuda.set_sync_debug_mode("warn")
    t = loader.load(steps[2])
    t.wait()
    loader.release(t)
    torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for u in steps[2:]:
            t = loader.load(u)
            t.wait()
            loader.release(t)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))
    pool.close()


if __name__ == "__main__":
    main()
