"""The tiered home's per-step block tables in one launch (`sgl_kernel_ext.step_tables`)
against its reference (`algo.step_tables.tiered_tables_ref`), and the reference against
the contract written out block by block, at real shapes (> 512 blocks a request, 2 and 8
KV heads, batches to 64, rows of the request table out of order)."""

import pytest
import torch

from sgl_kernel_ext.step_tables import tiered_step_tables
from sglang_psa.algo.step_tables import tiered_tables_ref

PAGE_ROWS = 5000  # pages of the pool: metadata rows from here on are host blocks'


def _state(B, nb, seed, dev="cpu"):
    """A step of `B` requests in shuffled request-table rows: pages, and a location table
    (wider than the plan) where some rows have a share of their blocks on host blocks
    (negative, distinct), one row none and one row all."""
    g = torch.Generator().manual_seed(seed)
    rows_total = B + 9
    rows = torch.randperm(rows_total, generator=g)[:B]
    pages = torch.randint(1, PAGE_ROWS, (B, nb), generator=g, dtype=torch.int32)
    host_loc = torch.zeros(rows_total, nb + 16, dtype=torch.int32)
    share = torch.rand(B, generator=g) * 0.6
    share[0], share[-1] = 0.0, 1.0
    host_loc[-1] = -7  # a row no request of the step holds
    units = torch.randperm(B * nb, generator=g)
    for b in range(B):
        off = torch.rand(nb, generator=g) < share[b]
        if b == B - 1:
            off[:] = True
        host_loc[rows[b], :nb] = torch.where(off, -units[b * nb : (b + 1) * nb] - 1, 0)
    return [t.to(dev) for t in (pages, host_loc, rows)]


def _contract(pages, host_loc, rows, hkv):
    B, nb = pages.shape
    loc = torch.empty(B, hkv, nb, dtype=torch.int32)
    meta = pages.clone()
    flags = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        for j in range(nb):
            h = int(host_loc[rows[b], j])
            if h < 0:  # host block -h - 1: read there; metadata row PAGE_ROWS + that block
                loc[b, :, j] = h
                meta[b, j] = PAGE_ROWS + (-h - 1)
                flags[b] = 1
            else:
                loc[b, :, j] = pages[b, j]
    return loc, meta, flags


@pytest.mark.parametrize("B,nb,hkv", [(3, 40, 2), (5, 520, 8)])
def test_reference_is_the_contract(B, nb, hkv):
    pages, host_loc, rows = _state(B, nb, seed=B)
    got = tiered_tables_ref(pages, host_loc, rows, PAGE_ROWS, hkv)
    for g, w in zip(got, _contract(pages, host_loc, rows, hkv)):
        assert torch.equal(g, w)
    assert got[2][0] == 0 and got[2][-1] == 1


@pytest.mark.parametrize("B,nb,hkv", [(1, 40, 2), (7, 600, 2), (64, 1024, 2), (9, 530, 8)])
def test_kernel_matches_reference(kernel_device, B, nb, hkv):
    if kernel_device == "cpu" and B * nb > 8000:
        pytest.skip("large shapes run compiled on the GPU (the interpreter takes too long)")
    pages, host_loc, rows = _state(B, nb, seed=100 + B, dev=kernel_device)
    want = tiered_tables_ref(pages.cpu(), host_loc.cpu(), rows.cpu(), PAGE_ROWS, hkv)
    loc = torch.full((B, hkv, nb), 123, dtype=torch.int32, device=kernel_device)
    flags = torch.full((B,), 9, dtype=torch.int32, device=kernel_device)
    before = host_loc.clone()
    tiered_step_tables(pages, host_loc, rows, PAGE_ROWS, loc, flags)
    assert torch.equal(loc.cpu(), want[0])
    assert torch.equal(pages.cpu(), want[1])
    assert torch.equal(flags.cpu(), want[2])
    assert torch.equal(host_loc, before)


def test_shapes_that_do_not_match_are_refused():
    pages, host_loc, rows = _state(3, 40, seed=1)
    with pytest.raises(ValueError, match="tiered_step_tables"):
        tiered_step_tables(pages, host_loc[:, :30], rows, PAGE_ROWS,
                           torch.zeros(3, 2, 40, dtype=torch.int32),
                           torch.zeros(3, dtype=torch.int32))  # fmt: skip
