"""UVA block gather/scatter kernel against the indexed-copy reference."""

import pytest
import torch

from sgl_kernel_ext.gather import BlockCopier, gather_blocks, scatter_blocks
from sglang_psa.algo.blockcopy import gather_blocks_ref


def _host(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.pin_memory() if device == "cuda" else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_elems", [4096, 8192, 4099])  # 8 KB, 16 KB bf16; odd size
def test_gather_from_host_pool_matches_reference(kernel_device, dtype, unit_elems):
    g = torch.Generator().manual_seed(unit_elems)
    n_host, n_slots, n = 40, 24, 17
    host = _host(torch.randn(n_host, unit_elems, generator=g).to(dtype), kernel_device)
    slots = torch.randn(n_slots, unit_elems, generator=g).to(dtype).to(kernel_device)
    src_idx = torch.randperm(n_host, generator=g)[:n].to(kernel_device)
    dst_idx = torch.randperm(n_slots, generator=g)[:n].to(kernel_device)
    want = gather_blocks_ref(host, src_idx, slots, dst_idx)
    gather_blocks(host, src_idx, slots, dst_idx)
    assert torch.equal(slots.cpu(), want.cpu())


def test_scatter_to_host_pool_and_round_trip(kernel_device):
    g = torch.Generator().manual_seed(0)
    slots = torch.randn(16, 8192, generator=g).to(torch.bfloat16).to(kernel_device)
    host = _host(torch.zeros(32, 8192, dtype=torch.bfloat16), kernel_device)
    idx = torch.arange(16, device=kernel_device)
    dst = (torch.randperm(32, generator=g)[:16]).to(kernel_device)
    want = gather_blocks_ref(slots, idx, host, dst)
    scatter_blocks(slots, idx, host, dst)
    assert torch.equal(host.cpu(), want.cpu())
    back = torch.zeros_like(slots)
    gather_blocks(host, dst, back, idx)
    assert torch.equal(back, slots)


def test_empty_list_and_bad_shapes(kernel_device):
    a = torch.ones(4, 64, device=kernel_device)
    b = torch.zeros(4, 64, device=kernel_device)
    none = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    BlockCopier(64, a.dtype).run(a, none, b, none)
    assert not b.any()
    with pytest.raises(ValueError, match="unit_elems"):
        gather_blocks(a, none, torch.zeros(4, 32, device=kernel_device), none)
    with pytest.raises(ValueError, match="indices"):
        gather_blocks(a, torch.arange(2, device=kernel_device), b, none)
