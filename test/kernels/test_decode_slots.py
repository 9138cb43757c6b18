"""A decode step's paged KV slots in one launch (`sgl_kernel_ext.decode_slots`) against
its reference (`algo.decode_slots.decode_slots_ref`), and the reference against the
contract written out request by request: the same slots, the same table entries, the
same pages taken, at real shapes (32-token pages, > 512 free pages, batches to 300)."""

import pytest
import torch

from sgl_kernel_ext.decode_slots import decode_slots
from sglang_psa.algo.decode_slots import decode_slots_ref


def _state(bs, page, seed, dev="cpu"):
    """Requests in distinct rows with `lens` tokens on pages of their own (slot 0 of page
    0 is SGLang's padding), a third of them at a page boundary; a shuffled free list."""
    g = torch.Generator().manual_seed(seed)
    rows_total, width, pages = bs + 40, 40 * page, 4 * bs * 40 + 600
    rows = torch.randperm(rows_total, generator=g)[:bs]
    lens = torch.randint(1, width - 1, (bs,), generator=g)
    at_edge = torch.rand(bs, generator=g) < 0.33
    lens[at_edge] = (lens[at_edge] // page).clamp(min=1) * page
    order = torch.randperm(pages - 1, generator=g) + 1
    used, k = order[: 40 * bs], 0
    req_to_token = torch.zeros(rows_total, width, dtype=torch.int32)
    for r, n in zip(rows.tolist(), lens.tolist()):
        for p in range((n + page - 1) // page):
            req_to_token[r, p * page : (p + 1) * page] = torch.arange(page) + used[k] * page
            k += 1
        req_to_token[r, n:] = 0  # nothing written past the request's tokens
    free = order[40 * bs :]
    assert len(free) > 512
    t = dict(req_to_token=req_to_token, rows=rows, lens=lens, free_pages=free)
    return {k: v.to(dev) for k, v in t.items()}


def _contract(req_to_token, rows, lens, free_pages, page):
    """The slots written out one request at a time, in batch order."""
    table, taken, slots = req_to_token.clone(), 0, []
    for r, n in zip(rows.tolist(), lens.tolist()):
        if n % page == 0:
            slot = int(free_pages[taken]) * page
            taken += 1
        else:
            slot = int(table[r, n - 1]) + 1
        table[r, n] = slot
        slots.append(slot)
    return torch.tensor(slots), table, taken


@pytest.mark.parametrize("bs,page", [(1, 32), (7, 16), (32, 32), (300, 32)])
def test_reference_is_the_contract(bs, page):
    s = _state(bs, page, seed=bs)
    want, table, taken = _contract(**s, page=page)
    got = decode_slots_ref(s["req_to_token"], s["rows"], s["lens"], s["free_pages"], page)
    assert torch.equal(got, want)
    assert torch.equal(s["req_to_token"], table)
    assert taken == int((s["lens"] % page == 0).sum()) > 0 or bs == 1


@pytest.mark.parametrize("bs,page", [(1, 32), (7, 16), (32, 32), (300, 32)])
def test_kernel_matches_reference(kernel_device, bs, page):
    s = _state(bs, page, seed=100 + bs, dev=kernel_device)
    want_table = s["req_to_token"].cpu().clone()
    want = decode_slots_ref(want_table, s["rows"].cpu(), s["lens"].cpu(),
                            s["free_pages"].cpu(), page)  # fmt: skip
    out = torch.full((bs,), -1, dtype=torch.int64, device=kernel_device)
    decode_slots(s["req_to_token"], s["rows"], s["lens"], s["free_pages"], page, out)
    assert torch.equal(out.cpu(), want)
    assert torch.equal(s["req_to_token"].cpu(), want_table)


def test_an_empty_batch_writes_nothing(kernel_device):
    table = torch.zeros(4, 64, dtype=torch.int32, device=kernel_device)
    empty = torch.zeros(0, dtype=torch.int64, device=kernel_device)
    decode_slots(table, empty, empty, torch.arange(1, 5, device=kernel_device), 32, empty)
    assert int(table.abs().sum()) == 0


@pytest.mark.gpu
def test_one_compiled_variant_whatever_the_batch():
    """Batches of 1 to 300 requests run on the one variant compiled at the first call:
    nothing compiles in the scheduling phase while requests wait."""
    from sgl_kernel_ext.decode_slots import _decode_slots_kernel

    caches = getattr(_decode_slots_kernel, "device_caches", None)
    assert caches is not None, "Triton's JITFunction.device_caches moved: count variants anew"
    dev = torch.cuda.current_device()
    counts = []  # variants after each batch (other tests may have compiled some before)
    for bs in (1, 2, 5, 16, 17, 32, 33, 200, 300):
        s = _state(bs, 32, seed=bs, dev="cuda")
        out = torch.empty(bs, dtype=torch.int64, device="cuda")
        decode_slots(s["req_to_token"], s["rows"], s["lens"], s["free_pages"], 32, out)
        counts.append(len(caches[dev][0]))
    torch.cuda.synchronize()
    assert counts[0] >= 1 and set(counts) == {counts[0]}, f"variants after each batch: {counts}"
