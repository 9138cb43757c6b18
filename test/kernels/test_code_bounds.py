"""The key-code bound kernel equals its reference (`algo.token_bounds`: the log-sum-exp of
the token bounds over each block) and bounds every block's true mass: head_dim 64 and 128,
groups of 1 to 8 query heads, 4 to 6 bits, requests of different lengths with partial
last blocks; real shapes (> 512 blocks) compiled on the GPU."""

import math

import pytest
import torch

from sglang_psa.algo.attention import block_lse, token_scores
from sglang_psa.algo.metadata import as_kept, block_metadata
from sglang_psa.algo.token_bounds import encode_keys, token_score_bounds
from sglang_psa.config import PSAConfig


@pytest.fixture
def device(kernel_device):
    return kernel_device


def _case(seed, B, Hkv, G, d, nb, bs=32):
    g = torch.Generator().manual_seed(seed)
    T = nb * bs
    q = torch.randn(B, Hkv * G, d, generator=g) * 2
    k = (torch.randn(B, Hkv, T, d, generator=g) + torch.randn(d, generator=g) * 3).to(
        torch.bfloat16
    )
    k[:, :, 5 * bs : 6 * bs] = (q.view(B, Hkv, G, d)[:, :, :1] * 0.8).to(torch.bfloat16)
    lengths = torch.tensor([T - 7 * i for i in range(B)])
    kept = as_kept(block_metadata(k, lengths, bs), PSAConfig(bound_bits=8))
    return q, k, lengths, kept


def _run(device, q, k, lengths, kept, bits, bs=32):
    from sgl_kernel_ext.code_bounds import code_bounds, pack_planes

    codes = encode_keys(k, lengths, kept.kmin, kept.kmax, bs, bits)
    scale = 1 / math.sqrt(q.shape[-1])
    want = block_lse(token_score_bounds(q, codes, lengths, scale).double(), bs)
    planes = pack_planes(codes.codes, bits, bs)
    got = code_bounds(
        q.to(device),
        planes.to(device),
        kept.kmin.float().to(device),
        kept.kmax.float().to(device),
        lengths.to(device),
        scale,
    ).cpu()
    true = block_lse(token_scores(q, k, lengths, scale).double(), bs)
    return got, want, true


@pytest.mark.parametrize(
    "d, G, bits, nb", [(64, 4, 5, 9), (128, 8, 4, 6), (64, 1, 6, 5), (128, 7, 5, 4)]
)
def test_code_bounds_kernel_matches_reference_and_bounds_the_mass(device, d, G, bits, nb):
    q, k, lengths, kept = _case(d + G + bits, 2, 2, G, d, nb)
    got, want, true = _run(device, q, k, lengths, kept, bits)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))  # the same blocks past each length
    assert torch.equal(finite, torch.isfinite(true))
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-5, atol=1e-4)
    # an upper bound of the true log-mass (to the float32 rounding of the kernel's lse)
    assert bool((got[finite].double() >= true[finite] - 1e-5).all())
    # and a tight one: the codes bound within e^3 where the min/max bound is far looser
    assert float((got[finite].double() - true[finite]).median()) < 3.0


@pytest.mark.parametrize("d", [64, 128])
def test_code_bounds_reads_a_16_bit_query_as_its_float32_value(device, d):
    """Decode's query is the model's dtype: the kernel reads it as float32 itself (no copy
    a layer), the same bounds as for the query converted first."""
    from sgl_kernel_ext.code_bounds import code_bounds, pack_planes

    q, k, lengths, kept = _case(d, 2, 2, 7, d, 4)
    codes = encode_keys(k, lengths, kept.kmin, kept.kmax, 32, 5)
    planes = pack_planes(codes.codes, 5, 32).to(device)
    lo, hi = (t.float().to(device) for t in (kept.kmin, kept.kmax))

    def bounds(query):
        return code_bounds(query.to(device), planes, lo, hi, lengths.to(device), 0.125).cpu()

    q16 = q.to(torch.bfloat16)
    assert torch.equal(bounds(q16), bounds(q16.float()))


@pytest.mark.gpu
@pytest.mark.parametrize("d, G, bits", [(64, 7, 5), (128, 4, 4), (128, 8, 6)])
def test_code_bounds_kernel_at_real_shapes(d, G, bits):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    q, k, lengths, kept = _case(1, 2, 2, G, d, 600)
    got, want, true = _run("cuda", q, k, lengths, kept, bits)
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite].double(), want[finite], rtol=1e-5, atol=1e-4)
    assert bool((got[finite].double() >= true[finite] - 1e-5).all())


def _paged(x: torch.Tensor, pages: torch.Tensor, n_pages: int) -> torch.Tensor:
    """Per-request, per-block rows `x [B, Hkv, NB, ...]` placed per page `[P, Hkv, ...]` by
    the page table `pages [B, NB]` (page 0 and unused pages zero)."""
    B, Hkv, NB = x.shape[:3]
    out = torch.zeros(n_pages, Hkv, *x.shape[3:], dtype=x.dtype)
    out[pages.long().flatten()] = x.transpose(1, 2).flatten(0, 1)
    return out


def _paged_bounds_case(device, d, G, bits, nb):
    """Bounds per request and through a shuffled page table, from the same codes."""
    from sgl_kernel_ext.code_bounds import code_bounds, pack_planes

    B, Hkv, bs = 2, 2, 32
    q, k, lengths, kept = _case(d * G + bits, B, Hkv, G, d, nb)
    codes = encode_keys(k, lengths, kept.kmin, kept.kmax, bs, bits)
    planes = pack_planes(codes.codes, bits, bs)
    lo, hi = kept.kmin.float(), kept.kmax.float()
    n_pages = B * nb + 1  # page 0: SGLang's padding page
    pages = torch.randperm(n_pages - 1, generator=torch.Generator().manual_seed(5)) + 1
    pages = pages.view(B, nb).to(torch.int32)
    scale = 1 / math.sqrt(d)
    on = dict(device=device)
    want = code_bounds(q.to(**on), planes.to(**on), lo.to(**on), hi.to(**on),
                       lengths.to(**on), scale).cpu()  # fmt: skip
    got = code_bounds(
        q.to(**on), _paged(planes, pages, n_pages).to(**on), _paged(lo, pages, n_pages).to(**on),
        _paged(hi, pages, n_pages).to(**on), lengths.to(**on), scale, pages=pages.to(**on),
    ).cpu()  # fmt: skip
    return got, want


@pytest.mark.parametrize("d, G, bits, nb", [(64, 4, 5, 9), (128, 8, 4, 6)])
def test_code_bounds_through_a_page_table_equal_per_request_bounds(device, d, G, bits, nb):
    """Planes and ranges kept per page (the server's layout) and read through a shuffled
    page table bound each block exactly as the same codes kept per request."""
    got, want = _paged_bounds_case(device, d, G, bits, nb)
    assert torch.equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("d, G, bits", [(64, 7, 5), (128, 4, 4), (128, 8, 6)])
def test_code_bounds_through_a_page_table_at_real_shapes(d, G, bits):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    got, want = _paged_bounds_case("cuda", d, G, bits, 600)
    assert torch.equal(got, want)


def _encode_pages_case(device, d, Hkv, bits, n_pages=40):
    """SGLang-layout key pool `[tokens, Hkv, d]` (bf16; page 3 with a constant channel;
    NaN in the rows no page count covers, as a page handed out again holds), pages to
    encode by (page, tokens written) and by the token slots a decode step wrote, with
    skipped (-1) entries; each against the reference: the range of the page's written keys
    and `encode_keys`' cells in it, packed."""
    from sgl_kernel_ext.code_bounds import encode_pages, pack_planes

    bs = 32
    g = torch.Generator().manual_seed(d + bits + Hkv)
    pool = (torch.randn(n_pages * bs, Hkv, d, generator=g) * 3).to(torch.bfloat16)
    pool[3 * bs : 4 * bs, :, 0] = 1.5  # zero width
    pages = torch.tensor([7, -1, 3, 12, -1, n_pages - 1, 1], dtype=torch.int32)
    counts = torch.tensor([32, 5, 32, 1, 9, 17, 31], dtype=torch.int32)
    slots = torch.tensor([5 * bs + 31, -1, 9 * bs, 20 * bs + 13], dtype=torch.int64)
    by_locs = [(int(s) // bs, int(s) % bs + 1) for s in slots if s >= 0]
    cases = (("counts", pages, counts, [(int(p), int(c)) for p, c in zip(pages, counts) if p >= 0]),
             ("slots", slots, None, by_locs))  # fmt: skip
    for name, at, cnt, want_pages in cases:
        kpool = pool.clone()
        for p, c in want_pages:  # rows past what is written: stale, even NaN
            kpool[p * bs + c : (p + 1) * bs] = float("nan")
        sentinel = 0xA5
        planes = torch.full((n_pages, Hkv, bits, bs, d // 8), sentinel, dtype=torch.uint8)
        lo = torch.full((n_pages, Hkv, d), float("nan"))
        on = dict(device=device)
        got = [planes.to(**on), lo.to(**on), lo.clone().to(**on)]
        encode_pages(
            kpool.to(**on), at.to(**on), *got, counts=None if cnt is None else cnt.to(**on)
        )
        got = [t.cpu() for t in got]
        for p, c in want_pages:
            kk = kpool[p * bs : (p + 1) * bs].transpose(0, 1)[None]  # [1, Hkv, bs, d]
            plo = kk[:, :, :c].float().amin(2, keepdim=True)  # [1, Hkv, 1, d]: one block
            phi = kk[:, :, :c].float().amax(2, keepdim=True)
            codes = encode_keys(kk, torch.tensor([c]), plo, phi, bs, bits).codes
            assert torch.equal(got[0][p], pack_planes(codes, bits, bs)[0, :, 0]), (name, p)
            assert torch.equal(got[1][p], plo[0, :, 0]), (name, p)
            assert torch.equal(got[2][p], phi[0, :, 0]), (name, p)
        others = torch.ones(n_pages, dtype=torch.bool)
        others[[p for p, _ in want_pages]] = False
        assert (got[0][others] == sentinel).all() and got[1][others].isnan().all(), name


@pytest.mark.parametrize("d, Hkv, bits", [(64, 2, 4), (128, 2, 5), (64, 1, 8)])
def test_encode_pages_writes_each_pages_range_and_reference_cells(device, d, Hkv, bits):
    """`encode_pages` over SGLang's pool, pages named with their written token counts
    (an extend) or by the slots just written (a decode step): each gets the range of its
    written keys and `encode_keys`' cells in it (rows past them: cell 0, whatever they
    hold); skipped entries and other pages are left as they were."""
    _encode_pages_case(device, d, Hkv, bits)


@pytest.mark.gpu
@pytest.mark.parametrize("d, Hkv, bits", [(64, 2, 5), (128, 8, 6)])
def test_encode_pages_at_real_shapes(d, Hkv, bits):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    _encode_pages_case("cuda", d, Hkv, bits, n_pages=600)


def test_pack_planes_round_trip():
    from sgl_kernel_ext.code_bounds import pack_planes

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 32, (2, 3, 70, 16), generator=g, dtype=torch.uint8)
    planes = pack_planes(codes, 5, 32)
    assert planes.shape == (2, 3, 3, 5, 32, 2) and planes.dtype == torch.uint8
    bits = (planes[..., None].long() >> torch.arange(8)) & 1  # [..., d/8, 8]
    cells = (bits.flatten(-2) << torch.arange(5).view(5, 1, 1)).sum(3)  # [B, H, NB, bs, d]
    back = cells.flatten(2, 3)
    assert torch.equal(back[:, :, :70], codes.long())
    assert not back[:, :, 70:].any()  # the partial last block's padding: cell 0
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_planes(codes[..., :12], 5, 32)


@pytest.mark.parametrize("d, bits", [(64, 4), (128, 5), (64, 6), (128, 8)])
def test_encode_kernel_writes_the_reference_cells(device, d, bits):
    """The GPU encoder gives `encode_keys`' cells exactly (keys on cell edges, constant
    channels and the range ends included), packed as `pack_planes` packs them."""
    from sgl_kernel_ext.code_bounds import encode_planes, pack_planes

    g = torch.Generator().manual_seed(d + bits)
    B, Hkv, nb, bs = 2, 2, 5, 32
    k = (torch.randn(B, Hkv, nb * bs, d, generator=g) * 3).to(torch.bfloat16)
    k[:, :, :bs, 0] = 1.5  # a constant channel: zero width
    lengths = torch.full((B,), nb * bs)
    kept = as_kept(block_metadata(k, lengths, bs), PSAConfig(bound_bits=8))
    lo, hi = kept.kmin.float(), kept.kmax.float()
    # keys exactly on interior cell edges of their block's range
    edge = lo + 3 * ((hi - lo) * (1.0 / 2**bits))
    k[:, :, 1::bs, :] = edge.to(torch.bfloat16)  # rounded to bf16: near the edge
    kept = as_kept(block_metadata(k, lengths, bs), PSAConfig(bound_bits=8))
    lo, hi = kept.kmin.float(), kept.kmax.float()
    want = pack_planes(encode_keys(k, lengths, lo, hi, bs, bits).codes, bits, bs)
    got = encode_planes(k.to(device), lo.to(device), hi.to(device), bits, bs).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("bits", [4, 6])
def test_encode_kernel_places_keys_on_and_a_float32_ulp_off_cell_edges(device, bits):
    """Float32 keys on a cell edge or one ulp either side, in arbitrary block ranges: a
    float32 division puts some in the wrong cell, and the GPU's division rounds other
    ties than the CPU's; the encoder must find the reference's cells (a key on an edge
    takes the upper one) from the edges themselves."""
    from sgl_kernel_ext.code_bounds import encode_planes, pack_planes
    from sglang_psa.algo.token_bounds import cell_edge

    g = torch.Generator().manual_seed(bits)
    B, Hkv, nb, bs, d = 1, 2, 4, 32, 64
    lo = torch.randn(B, Hkv, nb, d, generator=g) * 10
    hi = lo + torch.rand(B, Hkv, nb, d, generator=g) * 7 + 1e-3
    c = torch.randint(1, 2**bits, (B, Hkv, nb, bs, d), generator=g)
    e = cell_edge(lo[:, :, :, None], hi[:, :, :, None], c, bits)
    step = torch.randint(-1, 2, e.shape, generator=g).float()
    k = torch.nextafter(e, e + step).clamp(lo[:, :, :, None], hi[:, :, :, None])
    k = k.flatten(2, 3)
    lengths = torch.full((B,), nb * bs)
    codes = encode_keys(k, lengths, lo, hi, bs, bits).codes
    naive = torch.floor(
        (k - lo.repeat_interleave(bs, 2)) / ((hi - lo) / 2**bits).repeat_interleave(bs, 2)
    )
    assert (naive.clamp(0, 2**bits - 1) != codes.float()).any()  # a division misses here
    got = encode_planes(k.to(device), lo.to(device), hi.to(device), bits, bs).cpu()
    assert torch.equal(got, pack_planes(codes, bits, bs))


def _skewed_case(seed, B, Hkv, G, d, nb, bs=32):
    """Query heads of a group near one direction, and 4% of the blocks holding keys along
    it: most of every head's mass in a few blocks, as trained models' heads put it (random
    keys spread it evenly, and every stop rule reads everything)."""
    g = torch.Generator().manual_seed(seed)
    T = nb * bs
    u = torch.randn(B, Hkv, 1, d, generator=g)
    q = (u + 0.3 * torch.randn(B, Hkv, G, d, generator=g)).view(B, Hkv * G, d)
    k = torch.randn(B, Hkv, T, d, generator=g)
    hot = (torch.rand(B, Hkv, nb, generator=g) < 0.04).repeat_interleave(bs, -1)[..., None]
    k = torch.where(hot, u * 1.5 + 0.5 * k, k).to(torch.bfloat16)
    lengths = torch.tensor([T - 7 * i for i in range(B)])
    kept = as_kept(block_metadata(k, lengths, bs), PSAConfig(bound_bits=8))
    return q, k, lengths, kept


def _code_plan(device, seed, B, Hkv, G, d, nb, bits, eps, dtype=torch.float32):
    """A skewed case laid out for `WaveAttention.run(code_planes=)` on `device`: the
    planned object, the run's arguments and keywords (every tensor already on the device,
    so a CUDA graph can capture the run), and the case `(q, k, v, lengths, scale, cfg)` on
    the CPU. Keys are bf16 values; q, K and V in `dtype` (Triton's interpreter runs the
    wave kernel in float32 only)."""
    from sgl_kernel_ext.code_bounds import encode_planes
    from sgl_kernel_ext.wave_attention import WaveAttention
    from sglang_psa.algo import bound_codes

    bs = 32
    q, k, lengths, kept = _skewed_case(seed, B, Hkv, G, d, nb, bs)
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(k.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    cfg = PSAConfig(stop_rule="certified", threshold=eps, bound_bits=8, block_size=bs)
    scale = 1 / math.sqrt(d)
    exact = block_metadata(k, lengths, bs)
    lo, hi = exact.kmin.float(), exact.kmax.float()  # each block's own range, as the server's
    # keys past a request's length take code 0 (`encode_keys`' padding; never read)
    T = k.shape[2]
    valid = (torch.arange(T)[None, :] < lengths[:, None])[:, None, :, None]
    kp = torch.where(valid, k, lo.repeat_interleave(bs, 2).to(k.dtype))
    to = lambda t: t.to(device)  # noqa: E731
    planes = encode_planes(to(kp), to(lo), to(hi), bits, bs)
    qlo, qhi, kscale = bound_codes(exact.kmin, exact.kmax)
    loc = torch.arange(B * Hkv * nb, dtype=torch.int32).view(B, Hkv, nb)
    wa = WaveAttention.from_config(cfg).plan(B, Hkv * G, Hkv, d, nb, device, out_dtype=q.dtype)
    args = (
        to(q), to(k.view(B * Hkv * nb, bs, d)), to(v.view(B * Hkv * nb, bs, d)), to(loc),
        to(lengths), to(exact.mean), to(qlo.to(torch.int8)), to(qhi.to(torch.int8)),
    )  # fmt: skip
    kwargs = dict(
        meta_scale=to(kscale), scale=scale, code_planes=planes, code_lo=to(lo), code_hi=to(hi)
    )
    return wa, args, kwargs, (q, k, v, lengths, scale, cfg)


def _certified_on_codes(device, seed, B, Hkv, G, d, nb, bits, eps, dtype=torch.float32):
    """The certified rule on `bits`-bit key codes: the reference (`progressive_attention(
    code_bits=)`) and the wave kernel (`WaveAttention.run(code_planes=)`) on one case
    (`_code_plan`), with the true log-mass of every block `[B, Hq, NB]` (float64)."""
    from sglang_psa.algo import progressive_attention

    wa, args, kwargs, (q, k, v, lengths, scale, cfg) = _code_plan(
        device, seed, B, Hkv, G, d, nb, bits, eps, dtype
    )
    ref = progressive_attention(q, k, v, lengths, cfg, scale=scale, code_bits=bits)
    got = wa.run(*args, **kwargs)
    true = block_lse(token_scores(q, k, lengths, scale).double(), 32)
    return ref, got, true, (q, k, v, lengths, scale)


def _check_certified_on_codes(ref, got, true, case, G, eps):
    q, k, v, lengths, scale = case
    read = got.read_mask().cpu()
    # the guarantee: every query head covers at least ε of its true mass
    covered = true.masked_fill(~read.repeat_interleave(G, 1), -torch.inf).logsumexp(-1)
    assert bool((covered - true.logsumexp(-1) >= math.log(eps)).all())
    # and it reads what the reference reads (the float32 bound and mass, and the margin the
    # kernel keeps for them, may end a rare head one wave later)
    same = (read == ref.read).all(-1)
    assert float(same.float().mean()) >= 0.9, (read.sum(-1), ref.read.sum(-1))
    assert bool((read.sum(-1) >= ref.read.sum(-1))[same.logical_not()].all())
    assert float(read.float().mean()) < 0.7  # the case stops early: the test can fail
    # the output is attention over the blocks it read
    s = token_scores(q, k, lengths, scale)
    T = k.shape[2]
    tok = read.repeat_interleave(32, -1)[..., :T].repeat_interleave(G, 1)
    p = torch.softmax(s.masked_fill(~tok, -torch.inf), -1)
    want = torch.einsum("bht,bhtd->bhd", p, v.float().repeat_interleave(G, 1))
    torch.testing.assert_close(got.out.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("d, G, bits, eps", [(64, 4, 5, 0.9), (128, 8, 4, 0.95)])
def test_certified_rule_on_key_codes_in_the_wave_kernel(device, d, G, bits, eps):
    """`WaveAttention.run(code_planes=)` ranks by the key-code bound and stops by it: every
    query head covers ε of its true mass, reads as the reference does, and its output is
    attention over what it read."""
    ref, got, true, case = _certified_on_codes(device, 3 + d, 2, 2, G, d, 40, bits, eps)
    _check_certified_on_codes(ref, got, true, case, G, eps)


@pytest.mark.gpu
@pytest.mark.parametrize("d, G, bits", [(64, 7, 5), (128, 4, 5), (128, 8, 6)])
def test_certified_rule_on_key_codes_in_the_wave_kernel_at_real_shapes(d, G, bits):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    ref, got, true, case = _certified_on_codes(
        "cuda", 5 + G, 2, 2, G, d, 600, bits, 0.9, torch.bfloat16
    )
    _check_certified_on_codes(ref, got, true, case, G, 0.9)


@pytest.mark.gpu
def test_certified_rule_on_key_codes_replays_in_a_cuda_graph_without_a_sync():
    """The code-bound path of `WaveAttention.run` (bound kernel, ranking, float64 suffix,
    wave kernel) is captured in a CUDA graph with sync debugging on, and a replay on new
    queries gives the eager run's reads and output."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    wa, args, kwargs, (q, *_) = _code_plan("cuda", 11, 2, 2, 4, 128, 600, 5, 0.9, torch.bfloat16)
    static_q = args[0]

    def step():
        return wa.run(*args, **kwargs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm up: compile the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            res = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    static_q.copy_(q * 0.8 + 0.2 * torch.randn(q.shape))
    graph.replay()
    torch.cuda.synchronize()
    got_out, got_read = res.out.clone(), res.read_mask()
    eager = step()
    assert torch.equal(got_read, eager.read_mask())
    assert float(got_read.float().mean()) < 0.7  # it stopped early
    torch.testing.assert_close(got_out, eager.out, rtol=0, atol=0)


def _suffix_case(device, G, nb, double):
    """Suffix sums of random bounds in a random read order (one request shorter, its
    positions past its blocks -inf), kernel and reference."""
    from sgl_kernel_ext.code_bounds import suffix_bounds
    from sglang_psa.algo.token_bounds import suffix_log_mass

    g = torch.Generator().manual_seed(nb + G)
    B, Hkv, bs = 2, 2, 32
    ub = torch.randn(B, Hkv * G, nb, generator=g) * 5
    ub[0, 0, 3] = -torch.inf  # an empty block
    order = torch.stack([torch.randperm(nb, generator=g) for _ in range(B * Hkv)])
    order = order.view(B, Hkv, nb).to(torch.int32)
    lengths = torch.tensor([nb * bs - 5, (nb // 2) * bs + 7])
    want = suffix_log_mass(ub, order, lengths, bs, torch.float64 if double else torch.float32)
    out = torch.full((B, Hkv * G, nb + 1), float("nan"), device=device)
    on = dict(device=device)
    got = suffix_bounds(ub.to(**on), order.to(**on), lengths.to(**on), bs, out, double=double)
    return got.cpu(), want


@pytest.mark.parametrize("G, nb, double", [(4, 300, True), (7, 37, False), (1, 600, True)])
def test_suffix_bounds_kernel_matches_the_reference(device, G, nb, double):
    """The certified rule's unread-mass bound after each read position: the same -inf
    (past each request's blocks, and at the end), and the same sums (float64 ones exact
    once rounded to float32, up to summation order)."""
    got, want = _suffix_case(device, G, nb, double)
    fin = torch.isfinite(want)
    assert torch.equal(fin, torch.isfinite(got)) and not got.isnan().any()
    tol = 1e-6 if double else 2e-5
    torch.testing.assert_close(got[fin], want[fin], rtol=tol, atol=tol)


@pytest.mark.gpu
def test_suffix_bounds_kernel_at_real_shapes():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine)")
    for G, double in ((4, True), (8, False)):
        got, want = _suffix_case("cuda", G, 700, double)
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(got))
        torch.testing.assert_close(got[fin], want[fin], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("d, G, bits, nb", [(64, 4, 5, 9), (128, 7, 4, 6)])
def test_code_bounds_partials_give_each_rows_log_sum_exp(device, d, G, bits, nb):
    """The partials `code_bounds` writes (per program: max and the sum of exp below it)
    combine into each row's log-sum-exp of the bounds: what the ranking normalises by."""
    from sgl_kernel_ext.code_bounds import code_bounds, pack_planes

    q, k, lengths, kept = _case(7 + d, 2, 2, G, d, nb)
    planes = pack_planes(encode_keys(k, lengths, kept.kmin, kept.kmax, 32, bits).codes, bits, 32)
    on = dict(device=device)
    parts = torch.full((2, 2 * G, -(-nb // 4), 2), float("nan"), **on)
    ub = code_bounds(q.to(**on), planes.to(**on), kept.kmin.float().to(**on),
                     kept.kmax.float().to(**on), lengths.to(**on), 1 / math.sqrt(d),
                     blocks_per_program=4, partials=parts).cpu()  # fmt: skip
    parts = parts.cpu().double()
    m, s = parts[..., 0], parts[..., 1]
    top = m.amax(-1, keepdim=True)
    lse = top[..., 0] + torch.log((s * torch.exp(m - top)).sum(-1))
    torch.testing.assert_close(lse, ub.double().logsumexp(-1), rtol=1e-5, atol=1e-5)
