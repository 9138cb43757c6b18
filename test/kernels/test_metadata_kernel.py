"""Block metadata kernel against `sglang_psa.algo.block_metadata`.

The same random keys are laid out twice: as `[B, H, T, d]` for the reference
and as a shuffled pool of `[block_size, d]` units for the kernel, whose
summaries go to shuffled metadata rows.
"""

import pytest
import torch

from sgl_kernel_ext.metadata import block_meta_update
from sglang_psa.algo import block_metadata


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs,d", [(32, 16), (12, 24)])  # power-of-two and odd tile sizes
def test_block_meta_update_matches_reference(kernel_device, dtype, bs, d):
    g = torch.Generator().manual_seed(bs)
    B, H = 2, 2
    T = 3 * bs + 1
    lengths = torch.tensor([T, bs + 5])  # counts: full blocks, 1 token, partial, empty
    k = torch.randn(B, H, T, d, generator=g).to(dtype)
    ref = block_metadata(k, lengths, bs)
    nb = ref.count.shape[1]
    kb = torch.nn.functional.pad(k, (0, 0, 0, nb * bs - T)).reshape(B * H * nb, bs, d)
    perm = torch.randperm(B * H * nb, generator=g)
    pool = torch.empty_like(kb)
    pool[perm] = kb
    counts = ref.count[:, None, :].expand(B, H, nb).reshape(-1)
    keep = counts > 0
    assert {1, bs}.issubset(set(counts.tolist())) and (counts[keep] < bs).sum() > 1
    units = perm[keep]
    meta_rows = torch.randperm(int(keep.sum()), generator=g)
    dev = kernel_device
    out = [torch.full((len(meta_rows), d), 7.0, device=dev) for _ in range(3)]
    block_meta_update(
        pool.to(dev), units.to(dev), counts[keep].to(torch.int32).to(dev), *out, meta_rows.to(dev)
    )
    for got, want in zip(out, ref[:3]):
        want = want.reshape(-1, d)[keep]
        torch.testing.assert_close(got.cpu()[meta_rows], want, rtol=1e-5, atol=1e-5)


def test_empty_list_leaves_outputs(kernel_device):
    k = torch.randn(4, 8, 16, device=kernel_device)
    out = [torch.full((4, 16), 7.0, device=kernel_device) for _ in range(3)]
    none = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    block_meta_update(k, none, none, *out, none)
    assert all((o == 7.0).all() for o in out)


def test_torch_fallback_without_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(3)
    bs, d = 8, 4
    k = torch.randn(1, 1, 2 * bs, d, generator=g)
    ref = block_metadata(k, torch.tensor([bs + 3]), bs)
    out = [torch.zeros(2, d) for _ in range(3)]
    units = k.view(2, bs, d)
    block_meta_update(
        units, torch.tensor([1, 0]), torch.tensor([3, bs]), *out, torch.tensor([1, 0])
    )
    for got, want in zip(out, ref[:3]):
        torch.testing.assert_close(got, want.view(2, d))
