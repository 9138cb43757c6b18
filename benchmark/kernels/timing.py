"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

import statistics
import time

import torch


def cuda_time(fn, reps: int = 20, warmup: int = 3, stream=None) -> float:
    """Median seconds of `fn`, timed with CUDA events on `stream` (default: current)."""
    stream = stream or torch.cuda.current_stream()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def replay_host_us(launch, reps: int = 50, warmup: int = 5, drain: bool = True) -> float:
    """Median microseconds the host spends in `launch()` (a graph's replay): with `drain`
    the GPU idle before each (a host-bound server's case), else back to back behind the
    previous launches' work."""
    times = []
    for i in range(warmup + reps):
        if drain:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        launch()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6
