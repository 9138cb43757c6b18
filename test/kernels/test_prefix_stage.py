"""The prefill staging kernel against its reference (`algo.prefix_stage.stage_prefix_ref`):
a prefix whose blocks are partly in SGLang's pool and partly in the host tier (pinned
memory read through UVA on the GPU) is staged row for row, at real shapes (head_dim 64
and 128, 2-8 KV heads, > 512 blocks)."""

import pytest
import torch

from sgl_kernel_ext.prefix_stage import stage_prefix
from sglang_psa.algo.prefix_stage import stage_prefix_ref


def _case(heads, d, blocks, dev, seed, evicted=0.6):
    """A prefix of `blocks` full blocks plus a partial one, in scattered pool pages; a
    fraction `evicted` of the full blocks is on the host (its slots point at page 0, as
    a given-back block's request-table entries do)."""
    g = torch.Generator().manual_seed(seed)
    bs, pages, host_blocks = 32, blocks + 50, blocks + 30
    pool_k = torch.randn(pages * bs, heads, d, generator=g).to(torch.bfloat16)
    pool_v = torch.randn(pages * bs, heads, d, generator=g).to(torch.bfloat16)
    host_k = torch.randn(heads, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    host_v = torch.randn(heads, host_blocks, bs, d, generator=g).to(torch.bfloat16)
    page = torch.randperm(pages - 1, generator=g)[: blocks + 1] + 1  # never page 0
    hblock = torch.randperm(host_blocks, generator=g)[: blocks + 1]
    gone = torch.rand(blocks + 1, generator=g) < evicted
    gone[-1] = False  # the partial last block is never saved
    P = blocks * bs + 11
    pos = torch.arange(P)
    b, off = pos // bs, pos % bs
    slots = torch.where(gone[b], off, page[b] * bs + off)
    rows = torch.where(gone[b], hblock[b] * bs + off, torch.full_like(pos, -1))
    if dev == "cuda":
        host_k, host_v = host_k.pin_memory(), host_v.pin_memory()
    to = lambda t: t.to(dev)
    return to(pool_k), to(pool_v), host_k, host_v, to(slots), to(rows.to(torch.int32)), P


@pytest.mark.parametrize("heads,d,blocks", [(2, 64, 600), (8, 128, 520), (4, 64, 700)])
def test_stage_matches_reference(kernel_device, heads, d, blocks):
    pool_k, pool_v, host_k, host_v, slots, rows, P = _case(heads, d, blocks, kernel_device, d)
    assert int((rows >= 0).sum()) > P // 3 and int((rows < 0).sum()) > P // 4  # both homes
    out_k = torch.full((P + 64, heads, d), 7.0, dtype=torch.bfloat16, device=kernel_device)
    out_v = torch.full_like(out_k, 7.0)
    stage_prefix(pool_k, pool_v, host_k, host_v, slots, rows, out_k, out_v)
    want_k, want_v = stage_prefix_ref(pool_k, pool_v, host_k, host_v, slots, rows)
    assert torch.equal(out_k[:P].cpu(), want_k.cpu())
    assert torch.equal(out_v[:P].cpu(), want_v.cpu())
    assert bool((out_k[P:] == 7).all()), "rows past the prefix were written"


def test_reference_reads_each_home(kernel_device):
    """The reference itself, on the case's device (the pool in GPU memory and the host tier
    pinned, on the GPU): every row from the pool at its slot where the slot is real, else
    from the host tier's row, both homes used."""
    pool_k, pool_v, host_k, host_v, slots, rows, P = _case(2, 64, 8, kernel_device, 1)
    assert pool_k.device.type == kernel_device and host_k.device.type == "cpu"
    k, v = stage_prefix_ref(pool_k, pool_v, host_k, host_v, slots, rows)
    assert k.device == v.device == pool_k.device and k.shape == v.shape == (P, 2, 64)
    k, v, pool_k, pool_v = (t.cpu() for t in (k, v, pool_k, pool_v))
    on_host = 0
    for j, (slot, row) in enumerate(zip(slots.tolist(), rows.tolist())):
        if row >= 0:
            hb, off = divmod(row, 32)
            want_k, want_v = host_k[:, hb, off], host_v[:, hb, off]
            on_host += 1
        else:
            want_k, want_v = pool_k[slot], pool_v[slot]
        assert torch.equal(k[j], want_k) and torch.equal(v[j], want_v), j
    assert 0 < on_host < P


def test_bad_shapes_are_refused():
    pool_k, pool_v, host_k, host_v, slots, rows, P = _case(2, 64, 4, "cpu", 2)
    small = torch.empty(P - 1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="staging"):
        stage_prefix(pool_k, pool_v, host_k, host_v, slots, rows, small, small)
