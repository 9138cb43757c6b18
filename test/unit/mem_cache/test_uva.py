"""Host memory seen by the GPU: a CUDA tensor over registered host pages takes no GPU
memory, and writes from either side are seen by the other."""

import pytest
import torch

from sglang_psa.mem_cache.uva import HostResident, device_view


def test_on_a_cpu_device_the_view_is_the_host_tensor():
    h = HostResident((4, 8), torch.bfloat16, "cpu")
    assert h.view is h.host and h.nbytes == 64 and not h.registered
    with pytest.raises(ValueError, match="contiguous"):
        device_view(torch.zeros(4, 8).t(), "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_gpu_view_aliases_host_memory_both_ways(dtype):
    before = torch.cuda.memory_allocated()
    h = HostResident((64, 2, 16), dtype, "cuda")
    try:
        assert torch.cuda.memory_allocated() == before  # no HBM behind it
        v = h.view
        assert v.is_cuda and v.dtype == dtype and v.shape == (64, 2, 16)
        assert v.data_ptr() == h.host.data_ptr()
        src = (torch.arange(64 * 2 * 16) % 97).reshape(64, 2, 16).to(dtype)
        idx = torch.tensor([3, 17, 60], device="cuda")
        v[idx] = src[idx.cpu()].cuda()  # a GPU scatter lands in host memory
        torch.cuda.synchronize()
        assert torch.equal(h.host[idx.cpu()], src[idx.cpu()])
        h.host[5] = src[5]  # a host write is read by a GPU kernel
        assert torch.equal(v[5].sum(dtype=torch.float32).cpu(), src[5].sum(dtype=torch.float32))
    finally:
        h.close()
