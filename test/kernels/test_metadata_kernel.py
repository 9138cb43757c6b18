"""Page metadata kernels against `sglang_psa.algo.block_metadata`.

Keys live in an SGLang-style token-major pool `[tokens, Hkv, d]` whose pages are
handed to requests in shuffled order; the reference sees the same keys as
`[B, Hkv, T, d]`. Decode updates the page of each new token; prefill updates
every page an extend wrote, found through the request table.
"""

import pytest
import torch

from sgl_kernel_ext.metadata import (
    page_meta_from_locs,
    page_meta_from_table,
    page_meta_from_table_layers,
)
from sglang_psa.algo import block_metadata, bound_codes


def _pool(g, lengths, bs, H, d, dtype, pages_total=None):
    """Pool, request table and per-request page lists (page 0 is SGLang's padding)."""
    need = sum(-(-n // bs) for n in lengths)
    P = pages_total or need + 3
    pool = torch.randn(P * bs, H, d, generator=g).to(dtype)
    perm = (torch.randperm(P - 1, generator=g) + 1)[:need]
    width = max(lengths) + bs
    table = torch.zeros(len(lengths) + 1, width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lengths, start=1):
        npg = -(-n // bs)
        pages = perm[used : used + npg]
        used += npg
        table[r, : npg * bs] = (pages[:, None] * bs + torch.arange(bs)).flatten().to(torch.int32)
    return pool, table, P


def _ref(pool, table, lengths, bs):
    """Reference metadata `[B, H, NB, d]` of each request's keys."""
    T = max(lengths)
    ks = []
    for r, n in enumerate(lengths, start=1):
        k = pool[table[r, :n].long()]  # [n, H, d]
        ks.append(torch.nn.functional.pad(k.float(), (0, 0, 0, 0, 0, T - n)))
    return block_metadata(torch.stack(ks).transpose(1, 2), torch.tensor(lengths), bs)


def _bufs(P, H, d, dtype, dev, mean=True, bounds=True):
    def mk():
        return torch.full((P, H, d), 7.0, dtype=dtype, device=dev)

    return (mk() if mean else None, mk() if bounds else None, mk() if bounds else None)


def _assert_page(meta, ref, page, r, j, exact_bounds):
    mean, kmin, kmax = meta
    if mean is not None:
        torch.testing.assert_close(
            mean[page].float().cpu(), ref.mean[r, :, j], rtol=1e-2, atol=1e-2
        )
    if kmin is not None:
        got_min, got_max = kmin[page].float().cpu(), kmax[page].float().cpu()
        if exact_bounds:
            assert torch.equal(got_min, ref.kmin[r, :, j])
            assert torch.equal(got_max, ref.kmax[r, :, j])
        else:
            torch.testing.assert_close(got_min, ref.kmin[r, :, j])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,H,d", [(32, 2, 64), (32, 8, 128), (16, 4, 24)])
def test_prefill_pages_from_the_table_match_reference(kernel_device, dtype, bs, H, d):
    g = torch.Generator().manual_seed(bs + H + d)
    lengths = [5 * bs + 7, 2 * bs, 1]
    prefix = [2 * bs, 0, 0]  # an extend after a cached prefix, a whole prompt, one token
    pool, table, P = _pool(g, lengths, bs, H, d, dtype)
    dev = kernel_device
    meta = _bufs(P, H, d, dtype, dev)
    max_pages = max(-(-(n - p) // bs) + 1 for n, p in zip(lengths, prefix))
    page_meta_from_table(
        pool.to(dev), table.to(dev), torch.tensor([1, 2, 3], device=dev),
        torch.tensor(prefix, device=dev), torch.tensor(lengths, device=dev), max_pages, bs, *meta,
    )  # fmt: skip
    ref = _ref(pool, table, lengths, bs)
    touched = set()
    for r, (n, p0) in enumerate(zip(lengths, prefix)):
        for j in range(p0 // bs, -(-n // bs)):
            page = int(table[r + 1, j * bs]) // bs
            touched.add(page)
            _assert_page(meta, ref, page, r, j, exact_bounds=True)
    # Pages of the cached prefix and pages of nobody are left alone.
    for page in set(range(P)) - touched:
        assert all((t[page] == 7.0).all() for t in meta)


@pytest.mark.parametrize("mean,bounds", [(True, False), (False, True)])
def test_decode_updates_the_new_tokens_page_whatever_it_holds(kernel_device, mean, bounds):
    g = torch.Generator().manual_seed(5)
    bs, H, d, dtype = 32, 4, 64, torch.bfloat16
    lengths = [3 * bs, 2 * bs + 1, 40]  # a page just filled, one token in, partial
    pool, table, P = _pool(g, lengths, bs, H, d, dtype)
    dev = kernel_device
    meta = _bufs(P, H, d, dtype, dev, mean, bounds)
    locs = torch.tensor([int(table[r + 1, n - 1]) for r, n in enumerate(lengths)] + [0])
    page_meta_from_locs(pool.to(dev), locs.to(dev), bs, *meta)  # row 4: graph padding
    ref = _ref(pool, table, lengths, bs)
    for r, n in enumerate(lengths):
        j = (n - 1) // bs
        _assert_page(meta, ref, int(locs[r]) // bs, r, j, exact_bounds=True)
    other = [int(table[1, 0]) // bs, int(table[2, 0]) // bs]  # earlier pages untouched
    for page in other:
        assert all((t[page] == 7.0).all() for t in meta if t is not None)


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_a_gated_decode_updates_only_the_gated_rows_pages(kernel_device, monkeypatch, path):
    """`gate`: the kept-selection step writes the new keys of the rows that rank before
    their ranking, the others' in the kept rows' launch (`store_page_meta`)."""
    if path == "torch":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = kernel_device if path == "kernel" else "cpu"
    g = torch.Generator().manual_seed(11)
    bs, H, d, dtype = 32, 2, 64, torch.bfloat16
    lengths = [3 * bs, 2 * bs + 1, 40, 7]
    pool, table, P = _pool(g, lengths, bs, H, d, dtype)
    meta = _bufs(P, H, d, dtype, dev)
    locs = torch.tensor([int(table[r + 1, n - 1]) for r, n in enumerate(lengths)])
    gate = torch.tensor([0, 1, 1, 0], dtype=torch.int32)
    page_meta_from_locs(pool.to(dev), locs.to(dev), bs, *meta, gate=gate.to(dev))
    ref = _ref(pool, table, lengths, bs)
    for r, n in enumerate(lengths):
        page = int(locs[r]) // bs
        if gate[r]:
            _assert_page(meta, ref, page, r, (n - 1) // bs, exact_bounds=True)
        else:
            assert all((t[page] == 7.0).all() for t in meta), r
    with pytest.raises(ValueError, match=r"gate must be \[4\]"):
        page_meta_from_locs(pool, locs, bs, *_bufs(P, H, d, dtype, "cpu"), gate=gate[:2])


def test_bad_arguments_are_refused():
    pool = torch.zeros(64, 2, 8)
    with pytest.raises(ValueError, match="whole pages"):
        page_meta_from_locs(torch.zeros(40, 2, 8), torch.zeros(1, dtype=torch.long), 32,
                            torch.zeros(2, 2, 8), None, None)  # fmt: skip
    with pytest.raises(ValueError, match="mean, the bounds"):
        page_meta_from_locs(pool, torch.zeros(1, dtype=torch.long), 32, None, None, None)
    with pytest.raises(ValueError, match=r"\[pages, 2, 8\]"):
        page_meta_from_locs(pool, torch.zeros(1, dtype=torch.long), 32, torch.zeros(2, 8), None,
                            None)  # fmt: skip


def test_torch_fallback_without_cuda_or_interpreter(monkeypatch):
    """The CPU path the demo takes computes the same summaries."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(3)
    bs, H, d = 8, 2, 4
    lengths = [2 * bs + 3, bs]
    pool, table, P = _pool(g, lengths, bs, H, d, torch.float32)
    meta = _bufs(P, H, d, torch.float32, "cpu")
    page_meta_from_table(pool, table, torch.tensor([1, 2]), torch.tensor([0, 0]),
                         torch.tensor(lengths), 4, bs, *meta)  # fmt: skip
    ref = _ref(pool, table, lengths, bs)
    for r, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            _assert_page(meta, ref, int(table[r + 1, j * bs]) // bs, r, j, exact_bounds=True)
    locs = torch.tensor([int(table[1, lengths[0] - 1])])
    meta2 = _bufs(P, H, d, torch.float32, "cpu")
    page_meta_from_locs(pool, locs, bs, *meta2)
    _assert_page(meta2, ref, int(locs[0]) // bs, 0, 2, exact_bounds=True)


def _code_bufs(P, H, d, dev):
    """8-bit bounds and their scale, poisoned so untouched pages show."""
    kmin = torch.full((P, H, d), 99, dtype=torch.int8, device=dev)
    return kmin, kmin.clone(), torch.full((P, H), 7.0, device=dev)


def _assert_codes(got, ref, page, r, j):
    """The page's codes and scale are `bound_codes` of the reference bounds, bit for bit,
    and read back they bound every key of the block."""
    kmin, kmax, kscale = got
    qlo, qhi, sc = bound_codes(ref.kmin[r, :, j], ref.kmax[r, :, j])
    assert torch.equal(kmin[page].cpu().float(), qlo), (page, r, j)
    assert torch.equal(kmax[page].cpu().float(), qhi), (page, r, j)
    assert torch.equal(kscale[page].cpu(), sc), (page, r, j)
    s = kscale[page].cpu()[:, None]
    assert bool((kmin[page].cpu().float() * s <= ref.kmin[r, :, j]).all())
    assert bool((kmax[page].cpu().float() * s >= ref.kmax[r, :, j]).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs,H,d", [(32, 2, 64), (32, 8, 128)])
@pytest.mark.parametrize("spread", [1e-3, 30.0])
def test_8_bit_bounds_are_the_reference_codes(kernel_device, dtype, bs, H, d, spread):
    """Prefill from the table and a decode step write 8-bit codes and scales equal to
    `sglang_psa.algo.bound_codes` of the exact bounds."""
    g = torch.Generator().manual_seed(bs + H + d)
    lengths = [5 * bs + 7, 2 * bs + 1]
    pool, table, P = _pool(g, lengths, bs, H, d, torch.float32)
    pool = (pool * spread).to(dtype)
    dev = kernel_device
    got = _code_bufs(P, H, d, dev)
    page_meta_from_table(
        pool.to(dev), table.to(dev), torch.tensor([1, 2], device=dev),
        torch.tensor([0, 0], device=dev), torch.tensor(lengths, device=dev), 6, bs,
        None, got[0], got[1], got[2],
    )  # fmt: skip
    ref = _ref(pool, table, lengths, bs)
    for r, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            _assert_codes(got, ref, int(table[r + 1, j * bs]) // bs, r, j)
    got = _code_bufs(P, H, d, dev)
    locs = torch.tensor([int(table[r + 1, n - 1]) for r, n in enumerate(lengths)])
    page_meta_from_locs(pool.to(dev), locs.to(dev), bs, None, *got)
    for r, n in enumerate(lengths):
        _assert_codes(got, ref, int(locs[r]) // bs, r, (n - 1) // bs)


def test_8_bit_bounds_on_the_torch_fallback(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = torch.Generator().manual_seed(4)
    bs, H, d = 8, 2, 4
    lengths = [2 * bs + 3, bs]
    pool, table, P = _pool(g, lengths, bs, H, d, torch.float32)
    got = _code_bufs(P, H, d, "cpu")
    page_meta_from_table(pool, table, torch.tensor([1, 2]), torch.tensor([0, 0]),
                         torch.tensor(lengths), 4, bs, None, *got)  # fmt: skip
    ref = _ref(pool, table, lengths, bs)
    for r, n in enumerate(lengths):
        for j in range(-(-n // bs)):
            _assert_codes(got, ref, int(table[r + 1, j * bs]) // bs, r, j)
    with pytest.raises(ValueError, match="kscale"):
        page_meta_from_locs(pool, torch.tensor([9]), bs, None, got[0], got[1], None)


@pytest.mark.parametrize(
    "bs,H,d,lengths,kind",
    [
        (32, 2, 64, [5 * 32 + 7, 2 * 32, 1], "bounds"),  # + the mean
        (16, 2, 128, [514 * 16 + 5], "codes"),  # > 512 pages of one request
        (32, 4, 64, [3 * 32 + 1, 40], "mean"),
    ],
)
def test_every_layer_in_one_launch_matches_each_layer_alone(kernel_device, bs, H, d, lengths,
                                                            kind):  # fmt: skip
    """`page_meta_from_table_layers`: the extend's metadata of every layer in one launch
    (each layer's keys its own buffer, reached by its offset from the first) equals
    `page_meta_from_table` run a layer at a time, bit for bit, and leaves the pages the
    extend did not write alone."""
    g = torch.Generator().manual_seed(bs + H + d)
    L, dev, dtype = 2 if len(lengths) == 1 else 3, kernel_device, torch.bfloat16
    pool0, table, P = _pool(g, lengths, bs, H, d, dtype)
    pad = 64  # the layers lie apart, as SGLang's allocations do
    big = torch.randn(L, P * bs + pad, H, d, generator=g).to(dtype).to(dev)
    k_bufs = [big[layer, : P * bs] for layer in range(L)]
    prefix = [2 * bs] + [0] * (len(lengths) - 1)
    args = (table.to(dev), torch.arange(1, len(lengths) + 1, device=dev),
            torch.tensor(prefix, device=dev), torch.tensor(lengths, device=dev))  # fmt: skip
    max_pages = max(-(-(n - p) // bs) + 1 for n, p in zip(lengths, prefix))

    def bufs():
        if kind == "codes":
            lo = torch.full((L, P, H, d), 99, dtype=torch.int8, device=dev)
            return None, lo, lo.clone(), torch.full((L, P, H), 7.0, device=dev)
        f = torch.full((L, P, H, d), 7.0, dtype=dtype, device=dev)
        return (f, None, None, None) if kind == "mean" else (f, f.clone(), f.clone(), None)

    got, want = bufs(), bufs()
    page_meta_from_table_layers(k_bufs, *args, max_pages, bs, *got)
    for layer in range(L):
        page_meta_from_table(
            k_bufs[layer], *args, max_pages, bs,
            *(None if t is None else t[layer] for t in want),
        )  # fmt: skip
    touched = 0
    for a, b in zip(got, want):
        if a is not None:
            assert torch.equal(a, b)
            touched += int((a != (99 if a.dtype == torch.int8 else 7.0)).any())
    assert touched  # (the comparison is not between two untouched buffers)
    with pytest.raises(ValueError, match="layers"):
        page_meta_from_table_layers(k_bufs[:1], *args, max_pages, bs, *got)
