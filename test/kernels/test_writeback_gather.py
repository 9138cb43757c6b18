"""The write-back's page gather (token-major pool -> head-major staging) against its
reference, at real shapes: head_dim 64 and 128, 2-8 KV heads, pools of > 512 pages."""

import pytest
import torch

from sgl_kernel_ext.writeback import gather_pages_head_major
from sglang_psa.algo.blockcopy import gather_pages_head_major_ref


@pytest.mark.parametrize("heads,d", [(2, 64), (8, 128), (4, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_matches_reference(kernel_device, heads, d, dtype):
    g = torch.Generator().manual_seed(heads * d)
    bs, num_pages, n = 32, 600, 37
    # SGLang's layer buffer: [tokens, heads, d]; a strided view checks the row stride.
    base = torch.randn((num_pages + 1) * bs, heads + 1, d, generator=g).to(dtype)
    k = base[:, :heads].to(kernel_device)
    v = torch.randn((num_pages + 1) * bs, heads, d, generator=g).to(dtype)
    v = torch.cat([v, v[:, :1]], 1)[:, :heads].to(kernel_device)  # same strides as k
    pages = torch.randperm(num_pages, generator=g)[:n].add(1).to(torch.int32).to(kernel_device)
    kd = torch.full((heads, n * bs, d), float("nan"), dtype=dtype, device=kernel_device)
    vd = torch.full_like(kd, float("nan"))
    gather_pages_head_major(k, v, pages, kd, vd, bs)
    want_k, want_v = gather_pages_head_major_ref(k.cpu(), v.cpu(), pages.cpu(), bs)
    assert torch.equal(kd.cpu(), want_k)
    assert torch.equal(vd.cpu(), want_v)


def test_rejects_a_mismatched_destination(kernel_device):
    k = torch.zeros(64, 2, 64, device=kernel_device)
    pages = torch.tensor([0, 1], device=kernel_device)
    bad = torch.zeros(2, 63, 64, device=kernel_device)
    with pytest.raises(ValueError, match="must be a contiguous"):
        gather_pages_head_major(k, k, pages, bad, bad, 32)
