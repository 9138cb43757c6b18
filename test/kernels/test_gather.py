"""UVA block gather/scatter kernel against the indexed-copy reference.

On CPU the kernel runs under Triton's interpreter; on a GPU the host side is a
pinned CPU tensor read or written through UVA.
"""

import pytest
import torch

from sgl_kernel_ext.gather import BlockCopier, gather_blocks, scatter_blocks
from sglang_psa.algo.blockcopy import gather_blocks_ref


def _host(t: torch.Tensor, device: str) -> torch.Tensor:
    return t.pin_memory() if device == "cuda" else t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("unit_elems", [4096, 8192, 4099])  # 8 KB, 16 KB (2-byte); odd size
def test_gather_from_host_pool_matches_reference(kernel_device, dtype, unit_elems):
    g = torch.Generator().manual_seed(unit_elems)
    n_host, n_slots, n = 40, 24, 17
    host = _host(torch.randn(n_host, unit_elems, generator=g).to(dtype), kernel_device)
    slots = torch.randn(n_slots, unit_elems, generator=g).to(dtype).to(kernel_device)
    src_idx = torch.randperm(n_host, generator=g)[:n].to(kernel_device)
    dst_idx = torch.randperm(n_slots, generator=g)[:n].to(torch.int32).to(kernel_device)
    want = gather_blocks_ref(host, src_idx, slots, dst_idx)
    gather_blocks(host, src_idx, slots, dst_idx)
    assert torch.equal(slots.cpu(), want.cpu())


def test_repeated_sources_strided_rows_and_byte_units(kernel_device):
    """Sources may repeat (destinations stay distinct); pool rows may be strided; an
    odd byte size falls back to byte words."""
    g = torch.Generator().manual_seed(1)
    base = _host(torch.randn(12, 2, 384, generator=g).to(torch.bfloat16), kernel_device)
    host = base[:, 1]  # [12, 384] with row stride 768
    slots = torch.zeros(10, 384, dtype=torch.bfloat16, device=kernel_device)
    src_idx = torch.tensor([3, 3, 0, 11, 3, 7], device=kernel_device)
    dst_idx = torch.tensor([9, 0, 4, 1, 2, 5], device=kernel_device)
    want = gather_blocks_ref(host, src_idx, slots, dst_idx)
    BlockCopier(384, torch.bfloat16, kernel_device).run(host, src_idx, slots, dst_idx)
    assert torch.equal(slots.cpu(), want.cpu())

    raw = _host(torch.randint(0, 255, (6, 37), generator=g, dtype=torch.uint8), kernel_device)
    out = torch.zeros(6, 37, dtype=torch.uint8, device=kernel_device)
    perm = torch.randperm(6, generator=g).to(kernel_device)
    gather_blocks(raw, perm, out, torch.arange(6, device=kernel_device))
    assert torch.equal(out.cpu(), raw.cpu()[perm.cpu()])


@pytest.mark.parametrize("count", [0, 5, 9])
def test_device_count_limits_the_copy(kernel_device, count):
    """Only the first `count[0]` pairs move; the rest of the (upper-bound) launch is idle."""
    g = torch.Generator().manual_seed(count)
    host = _host(torch.randn(20, 4096, generator=g).to(torch.bfloat16), kernel_device)
    slots = torch.zeros(12, 4096, dtype=torch.bfloat16, device=kernel_device)
    src_idx = torch.randperm(20, generator=g)[:9].to(kernel_device)
    dst_idx = torch.randperm(12, generator=g)[:9].to(kernel_device)
    want = gather_blocks_ref(host, src_idx[:count], slots, dst_idx[:count])
    n = torch.tensor([count], dtype=torch.int32, device=kernel_device)
    BlockCopier(4096, torch.bfloat16, kernel_device).run(host, src_idx, slots, dst_idx, n)
    assert torch.equal(slots.cpu(), want.cpu())


def test_scatter_to_host_pool_and_round_trip(kernel_device):
    g = torch.Generator().manual_seed(0)
    slots = torch.randn(16, 8192, generator=g).to(torch.bfloat16).to(kernel_device)
    host = _host(torch.zeros(32, 8192, dtype=torch.bfloat16), kernel_device)
    idx = torch.arange(16, device=kernel_device)
    dst = torch.randperm(32, generator=g)[:16].to(kernel_device)
    want = gather_blocks_ref(slots, idx, host, dst)
    scatter_blocks(slots, idx, host, dst)
    assert torch.equal(host.cpu(), want.cpu())
    back = torch.zeros_like(slots)
    gather_blocks(host, dst, back, idx)
    assert torch.equal(back, slots)


def test_empty_list_and_bad_arguments(kernel_device):
    a = torch.ones(4, 64, device=kernel_device)
    b = torch.zeros(4, 64, device=kernel_device)
    none = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    BlockCopier(64, a.dtype).run(a, none, b, none)
    assert not b.any()
    with pytest.raises(ValueError, match="unit_elems"):
        gather_blocks(a, none, torch.zeros(4, 32, device=kernel_device), none)
    with pytest.raises(ValueError, match="indices"):
        gather_blocks(a, torch.arange(2, device=kernel_device), b, none)
    with pytest.raises(ValueError, match="dtype"):
        gather_blocks(a, none, b.half(), none)


@pytest.mark.gpu
def test_pageable_host_memory_is_refused():
    pageable = torch.ones(4, 64)
    slots = torch.zeros(4, 64, device="cuda")
    idx = torch.arange(4, device="cuda")
    with pytest.raises(ValueError, match="pin"):
        gather_blocks(pageable, idx, slots, idx)


def test_torch_fallback_without_cuda_or_interpreter(monkeypatch):
    """Plain CPU tensors outside the interpreter take the torch path, same result."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(2)
    src = torch.randn(8, 100, generator=g).half()
    dst = torch.zeros(5, 100, dtype=torch.half)
    src_idx, dst_idx = torch.tensor([7, 7, 1]), torch.tensor([4, 0, 2], dtype=torch.int32)
    want = gather_blocks_ref(src, src_idx, dst, dst_idx)
    gather_blocks(src, src_idx, dst, dst_idx)
    assert torch.equal(dst, want)
