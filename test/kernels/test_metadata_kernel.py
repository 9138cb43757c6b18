"""Block metadata kernel against `sglang_psa.algo.block_metadata`."""

import pytest
import torch

from sgl_kernel_ext.metadata import block_meta_update
from sglang_psa.algo import block_metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_meta_update_matches_reference(kernel_device, dtype):
    g = torch.Generator().manual_seed(0)
    B, H, T, d, bs = 2, 2, 100, 16, 32  # 4 blocks per head, the last one partial
    k = torch.randn(B, H, T, d, generator=g).to(dtype)
    lengths = torch.tensor([100, 45])
    ref = block_metadata(k, lengths, bs)
    nb = ref.count.shape[1]
    # Units in a shuffled pool; summaries into shuffled metadata rows.
    kb = torch.nn.functional.pad(k, (0, 0, 0, nb * bs - T)).view(B * H * nb, bs, d)
    perm = torch.randperm(B * H * nb, generator=g)
    pool = torch.empty_like(kb)
    pool[perm] = kb
    counts = ref.count[:, None, :].expand(B, H, nb).reshape(-1)
    keep = counts > 0
    units = perm[keep]
    meta_rows = torch.randperm(int(keep.sum()), generator=g)
    dev = kernel_device
    out = [torch.full((len(meta_rows), d), 7.0, device=dev) for _ in range(3)]
    block_meta_update(pool.to(dev), units.to(dev), counts[keep].to(torch.int32).to(dev), *out,
                      meta_rows.to(dev))
    for got, want in zip(out, ref[:3]):
        want = want.reshape(-1, d)[keep]
        torch.testing.assert_close(got.cpu()[meta_rows], want, rtol=1e-5, atol=1e-5)
