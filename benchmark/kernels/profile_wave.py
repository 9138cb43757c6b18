"""One headline wave-attention step (128K ctx, batch 8, 5% of blocks) for profilers.

    python benchmark/kernels/profile_wave.py            # torch profiler table of the step
    ncu --kernel-name _wave_attention_kernel --launch-skip 3 --launch-count 1 \\
        python benchmark/kernels/profile_wave.py --plain   # one kernel under Nsight Compute
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_wave import BS, CONFIG, HKV, HQ, D, setup  # noqa: E402

from sgl_kernel_ext.wave_attention import WaveAttention  # noqa: E402


def main() -> None:
    batch, ctx, frac = 8, 131072, 0.05
    q, ks, vs, kh, vh, loc, lengths, meta = setup(batch, ctx, 0.0)
    nb = ctx // BS
    # The server's configuration and launch defaults, as bench_wave's rows run them.
    wa = WaveAttention.from_config(CONFIG).plan(batch, HQ, HKV, D, nb, "cuda")
    step = lambda: wa.run(
        q, ks, vs, loc, lengths, meta[0], meta[1], meta[2], max_read_blocks=round(frac * nb)
    )
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    if "--plain" in sys.argv:
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="cuda_time_total", row_limit=15))


if __name__ == "__main__":
    main()
