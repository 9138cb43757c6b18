"""CUDA-event timing shared by the kernel benchmarks."""

from __future__ import annotations

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
