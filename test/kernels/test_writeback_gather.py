"""The write-back's page copies (token-major pool -> head-major staging, or straight into
host-tier units through UVA) against the reference, at real shapes: head_dim 64 and 128,
2-8 KV heads, pools of > 512 pages."""

import pytest
import torch

from sgl_kernel_ext.writeback import (
    copy_layers_to_units,
    copy_pages_to_units,
    gather_pages_head_major,
)
from sglang_psa.algo.blockcopy import gather_pages_head_major_ref


@pytest.mark.parametrize("heads,d,given_order", [(2, 64, False), (8, 128, True), (4, 64, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_matches_reference(kernel_device, heads, d, dtype, given_order):
    """Pages in plan order into the head-major staging (the staging order made by the
    gather, or the caller's kept `arange`, as the DMA path passes it)."""
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
    order = torch.arange(n, device=kernel_device) if given_order else None
    gather_pages_head_major(k, v, pages, kd, vd, bs, order)
    want_k, want_v = gather_pages_head_major_ref(k.cpu(), v.cpu(), pages.cpu(), bs)
    assert torch.equal(kd.cpu(), want_k)
    assert torch.equal(vd.cpu(), want_v)


def test_rejects_a_mismatched_destination(kernel_device):
    k = torch.zeros(64, 2, 64, device=kernel_device)
    pages = torch.tensor([0, 1], device=kernel_device)
    bad = torch.zeros(2, 63, 64, device=kernel_device)
    with pytest.raises(ValueError, match="must be a contiguous"):
        gather_pages_head_major(k, k, pages, bad, bad, 32)
    good = torch.zeros(2, 64, 64, device=kernel_device)
    with pytest.raises(ValueError, match="order has 3 entries for 2 pages"):
        gather_pages_head_major(k, k, pages, good, good, 32, torch.arange(3, device=kernel_device))


def _plan(g, num_pages: int, host_blocks: int, n: int, device):
    """`n` distinct pages of the pool and `n` distinct host blocks, shuffled."""
    pages = torch.randperm(num_pages, generator=g)[:n].to(device)
    blocks = torch.randperm(host_blocks, generator=g)[:n].to(torch.int32).to(device)
    return pages, blocks


def _host_units(shape, device):
    """Zeroed host-tier K and V units in bf16 (page-locked where the GPU writes them)."""
    out = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    return [t.pin_memory() for t in out] if device == "cuda" else out


@pytest.mark.parametrize("programs", [None, 7])  # one per unit; a few persistent ones
@pytest.mark.parametrize("heads,d", [(2, 64), (8, 128)])
def test_pages_land_in_their_host_units(kernel_device, heads, d, programs):
    """Into the host tier's `[heads, blocks, bs, d]` (pinned, written through UVA on the GPU)
    at scattered host blocks; units not named stay untouched."""
    g = torch.Generator().manual_seed(d)
    bs, num_pages, host_blocks, n = 32, 520, 700, 29
    k = torch.randn(num_pages * bs, heads, d, generator=g).to(torch.bfloat16).to(kernel_device)
    v = torch.randn(num_pages * bs, heads, d, generator=g).to(torch.bfloat16).to(kernel_device)
    pages, blocks = _plan(g, num_pages, host_blocks, n, kernel_device)
    hk, hv = _host_units((heads, host_blocks, bs, d), kernel_device)
    copy_pages_to_units(k, v, pages, hk, hv, blocks, programs=programs)
    if kernel_device == "cuda":
        torch.cuda.synchronize()
    want_k, want_v = gather_pages_head_major_ref(k.cpu(), v.cpu(), pages.cpu(), bs)
    b = blocks.cpu().long()
    assert torch.equal(hk[:, b], want_k.view(heads, n, bs, d))
    assert torch.equal(hv[:, b], want_v.view(heads, n, bs, d))
    untouched = torch.ones(host_blocks, dtype=torch.bool)
    untouched[b] = False
    assert not hk[:, untouched].any() and not hv[:, untouched].any()


@pytest.mark.parametrize("programs", [None, 16])
@pytest.mark.parametrize("layers,heads,d", [(24, 2, 64), (4, 8, 128)])
def test_every_layer_in_one_launch_lands_as_each_layer_alone(
    kernel_device, layers, heads, d, programs
):
    """A decode flush's copy: every layer's pages, each layer's buffer its own allocation
    (SGLang's pool), into the host tier's `[L, heads, blocks, bs, d]` in one launch, equal
    per layer to the reference; host blocks not named stay untouched in every layer."""
    g = torch.Generator().manual_seed(layers * d)
    bs, num_pages, host_blocks, n = 32, 520, 600, 19
    dt = torch.bfloat16
    k = [
        torch.randn(num_pages * bs, heads, d, generator=g).to(dt).to(kernel_device)
        for _ in range(layers)
    ]
    v = [
        torch.randn(num_pages * bs, heads, d, generator=g).to(dt).to(kernel_device)
        for _ in range(layers)
    ]
    pages, blocks = _plan(g, num_pages, host_blocks, n, kernel_device)
    hk, hv = _host_units((layers, heads, host_blocks, bs, d), kernel_device)
    copy_layers_to_units(k, v, pages, hk, hv, blocks, programs=programs)
    if kernel_device == "cuda":
        torch.cuda.synchronize()
    b = blocks.cpu().long()
    untouched = torch.ones(host_blocks, dtype=torch.bool)
    untouched[b] = False
    for layer in range(layers):
        want_k, want_v = gather_pages_head_major_ref(
            k[layer].cpu(), v[layer].cpu(), pages.cpu(), bs
        )
        assert torch.equal(hk[layer][:, b], want_k.view(heads, n, bs, d)), layer
        assert torch.equal(hv[layer][:, b], want_v.view(heads, n, bs, d)), layer
    assert not hk[:, :, untouched].any() and not hv[:, :, untouched].any()


def test_every_layer_in_one_launch_refuses_misaligned_layer_buffers(kernel_device):
    """Layer buffers a kernel reaches from the first's pointer must lie a multiple of 16
    elements apart (what keeps its loads vectorized): otherwise a clear error."""
    base = torch.zeros(2 * 64 * 2 * 64 + 8, device=kernel_device)
    k = [base[: 64 * 2 * 64].view(64, 2, 64), base[8 : 8 + 64 * 2 * 64].view(64, 2, 64)]
    hk = torch.zeros(2, 2, 4, 32, 64)
    pages = torch.tensor([0, 1], device=kernel_device)
    with pytest.raises(ValueError, match="multiple of 16 elements"):
        copy_layers_to_units(k, k, pages, hk, hk, pages)


def _compiled_variants(kernel) -> int:
    """Compiled variants of a Triton kernel on the current GPU (Triton 3.6 keeps them per
    device in `device_caches[device][0]`)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        import triton

        pytest.fail(f"Triton {triton.__version__} has no JITFunction.device_caches: "
                    "count the kernel's compiled variants another way")  # fmt: skip
    return len(caches[torch.cuda.current_device()][0])


def test_saves_of_every_size_are_one_compiled_kernel(kernel_device):
    """A save's size varies from call to call (decode flushes of 16, 17, ... blocks; a
    prefill job's slices), and its host blocks are the second row of the write-back's
    `[2, n]` table (`WriteBack._tables`), 16-byte aligned only at even n. Each size lands
    as the reference says, and on the GPU only the first compiles: a kernel variant
    compiled in the middle of serving stalls the scheduler's loop."""
    from sgl_kernel_ext.writeback import _copy_pages_kernel

    g = torch.Generator().manual_seed(5)
    layers, heads, d, bs, num_pages, host_blocks = 3, 2, 64, 32, 520, 600
    dt = torch.bfloat16
    k = [torch.randn(num_pages * bs, heads, d, generator=g).to(dt).to(kernel_device)
         for _ in range(layers)]  # fmt: skip
    v = [torch.randn(num_pages * bs, heads, d, generator=g).to(dt).to(kernel_device)
         for _ in range(layers)]  # fmt: skip
    hk, hv = _host_units((layers, heads, host_blocks, bs, d), kernel_device)
    cuda = kernel_device == "cuda"
    first = None
    for n in (16, 17, 1, 9, 24):
        pages, blocks = _plan(g, num_pages, host_blocks, n, kernel_device)
        tables = torch.stack([pages.long(), blocks.long()])
        copy_layers_to_units(k, v, tables[0], hk, hv, tables[1], programs=16)
        if cuda:
            torch.cuda.synchronize()
            first = _compiled_variants(_copy_pages_kernel) if first is None else first
            assert _compiled_variants(_copy_pages_kernel) == first, f"{n} blocks compiled anew"
        b = blocks.cpu().long()
        for layer in range(layers):
            want_k, want_v = gather_pages_head_major_ref(
                k[layer].cpu(), v[layer].cpu(), pages.cpu(), bs
            )
            assert torch.equal(hk[layer][:, b], want_k.view(heads, n, bs, d)), (n, layer)
            assert torch.equal(hv[layer][:, b], want_v.view(heads, n, bs, d)), (n, layer)
