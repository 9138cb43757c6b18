"""Validity of the per-token key-code score bounds (`algo.token_bounds`): every valid
token's bound is at least its score, exact (float64) and as `token_scores` computes it
(float32), on random and adversarial keys."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.algo.attention import block_lse, token_scores
from sglang_psa.algo.criticality import bound_logits
from sglang_psa.algo.metadata import block_metadata, quantize_bounds
from sglang_psa.algo.token_bounds import (
    allocate_bits,
    cell_edge,
    code_bytes_per_token,
    decode_cells,
    encode_keys,
    token_score_bounds,
)


def exact_scores(q, k, lengths, scale):
    B, Hq, d = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    s = torch.einsum("bhgd,bhtd->bhgt", q.double().view(B, Hkv, -1, d), k.double())
    s = s.flatten(1, 2) * scale
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return s.masked_fill(pad[:, None, :], -torch.inf)


def check_valid(q, k, lengths, bs, bits, scale, kept_bits=None):
    """Encode with the exact (or `kept_bits`-coded) block ranges; assert the contract."""
    meta = block_metadata(k, lengths, bs)
    if kept_bits:
        meta = quantize_bounds(meta, kept_bits)
    codes = encode_keys(k, lengths, meta.kmin, meta.kmax, bs, bits)
    top = 2**bits if isinstance(bits, int) else (2**bits)[None, :, None, :]
    assert (codes.codes.long() < top).all()
    a, b = decode_cells(codes)
    valid = (torch.arange(k.shape[2])[None, :] < lengths[:, None])[:, None, :, None]
    kf = k.float()
    assert ((a <= kf) | ~valid).all() and ((kf <= b) | ~valid).all(), "key outside its cell"
    ub = token_score_bounds(q, codes, lengths, scale)
    s32 = token_scores(q, k, lengths, scale)
    s64 = exact_scores(q, k, lengths, scale)
    v = torch.isfinite(s64)
    assert torch.equal(torch.isfinite(ub), v), "bounds must be -inf exactly past lengths"
    assert (ub[v] >= s32[v]).all(), (ub[v] - s32[v]).min()
    assert (ub.double()[v] >= s64[v]).all(), (ub.double()[v] - s64[v]).min()
    # Block masses: what the certified rule sums.
    assert (block_lse(ub.double(), bs) >= block_lse(s64, bs)).all()
    return ub, s64, meta


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    bits=st.sampled_from([1, 2, 3, 4, 8, "per-channel"]),
    bs=st.sampled_from([4, 8, 32]),
    T=st.integers(1, 80),
    d=st.sampled_from([8, 64, 128]),
    key_scale=st.sampled_from([1e-3, 1.0, 30.0, 1e4]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    kept_bits=st.sampled_from([None, 8]),
)
def test_bound_is_valid_on_random_keys(seed, bits, bs, T, d, key_scale, dtype, kept_bits):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, G = 2, 2, 3
    if bits == "per-channel":
        bits = torch.randint(0, 9, (Hkv, d), generator=g)
    k = (torch.randn(B, Hkv, T, d, generator=g) * key_scale).to(dtype)
    k[:, :, :, 0] += 50 * key_scale  # an outlier channel, as RoPE'd keys have
    q = (torch.randn(B, Hkv * G, d, generator=g) * 4).to(dtype)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    check_valid(q, k, lengths, bs, bits, d**-0.5, kept_bits)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("offset", [0.0, 1e4, -3e5])
def test_bound_is_valid_when_keys_sit_on_the_bound(bits, offset):
    """Keys on the cell edge that maximises `q . k` (the interval bound is then exact in
    real arithmetic, so only the margin absorbs float32 rounding), on a large offset with
    a tiny range (cancellation), with constant channels (zero-width cells)."""
    g = torch.Generator().manual_seed(bits)
    B, Hkv, G, T, d, bs = 1, 2, 4, 64, 64, 32
    q = torch.randn(B, Hkv * G, d, generator=g) * 10
    base = offset + torch.randn(B, Hkv, T, d, generator=g) * 1e-2
    base[..., :8] = offset + 0.5  # constant channels
    lengths = torch.tensor([T])
    meta = block_metadata(base, lengths, bs)
    # Snap every key of KV head h to the edge its first query head favours.
    codes = encode_keys(base, lengths, meta.kmin, meta.kmax, bs, bits)
    a, b = decode_cells(codes)
    favour = q.view(B, Hkv, G, d)[:, :, 0, None, :] > 0
    k = torch.where(favour, b, a)  # still inside each block's [kmin, kmax]
    check_valid(q, k, lengths, bs, bits, 0.125)


def test_bound_is_valid_on_extreme_magnitudes():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 96, 64, generator=g) * 1e15
    k[..., 5] = 7.0
    k[..., 6] = torch.tensor([1e-30, -1e-30]).repeat(48)
    q = torch.randn(1, 2, 64, generator=g) * 1e10
    check_valid(q, k, torch.tensor([90]), 32, 4, 0.125)


def test_edges_are_monotone_and_span_the_range():
    lo = torch.tensor([-3.0, 1e4, 0.0, -1e-38])
    hi = torch.tensor([5.0, 1e4 + 1e-3 * 1024, 0.0, 1e-38])
    for bits in (1, 2, 4, 8):
        e = torch.stack([cell_edge(lo, hi, torch.tensor(c), bits) for c in range(2**bits + 1)])
        assert torch.equal(e[0], lo) and torch.equal(e[-1], hi)
        assert (e[1:] >= e[:-1]).all()


def test_each_key_takes_the_last_cell_whose_lower_edge_holds_it():
    """The canonical cell (the one the GPU encoder must reproduce): the largest `c` with
    `edge(c) <= k`, so a key on an edge takes the upper cell, also in nearly empty ranges
    where several float32 edges coincide and a division lands cells away."""
    g = torch.Generator().manual_seed(1)
    lo = torch.tensor([-3.0, 1e4, 7.0, 0.5, 2.0]).repeat(8, 1)
    hi = lo + torch.tensor([5.0, 3 * 1e4 * 2**-23, 0.0, 1e-3, 2.0**-20])
    lo, hi = lo.view(1, 1, 8, 5), hi.view(1, 1, 8, 5)
    for bits in (1, 4, 6):
        n = 2**bits
        edges = torch.stack([cell_edge(lo, hi, torch.tensor(c), bits) for c in range(n + 1)])
        pick = torch.randint(0, n + 1, lo.shape, generator=g)
        on_edge = edges.gather(0, pick[None]).squeeze(0)
        for k in (on_edge, torch.nextafter(on_edge, on_edge - 1).clamp(lo, hi)):
            codes = encode_keys(
                k[:, :, :, None].expand(1, 1, 8, 4, 5).flatten(2, 3),
                torch.tensor([32]),
                lo,
                hi,
                4,
                bits,
            ).codes.long()
            want = ((edges[:-1] <= k[None]).sum(0) - 1).clamp(max=n - 1)
            assert torch.equal(codes.view(1, 1, 8, 4, 5)[:, :, :, 0], want), bits


def test_code_bound_is_tighter_than_the_box_bound():
    """The cells sit inside the block's [kmin, kmax], so each token's bound is at most the
    block's box bound (up to the margin), and more bits are never looser."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(1, 2, 256, 64, generator=g)
    q = torch.randn(1, 6, 64, generator=g) * 3
    lengths = torch.tensor([256])
    ub2, s64, meta = check_valid(q, k, lengths, 32, 2, 0.125)
    ub4, _, _ = check_valid(q, k, lengths, 32, 4, 0.125)
    box = bound_logits(q, meta, 0.125).repeat_interleave(32, -1)
    assert (ub2 <= box + 1e-3).all()
    assert (ub4 <= ub2 + 1e-3).all()
    assert (ub4 - s64.float()).mean() < (ub2 - s64.float()).mean() < (box - s64.float()).mean()


def test_dequantised_score_alone_is_not_a_bound():
    """Without the rounding term `sum |q_i| (b_i - a_i) / 2` (just `q . mid`), true scores
    exceed the estimate: the validity check above is able to fail."""
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 2, 256, 64, generator=g)
    q = torch.randn(1, 6, 64, generator=g) * 3
    lengths = torch.tensor([256])
    meta = block_metadata(k, lengths, 32)
    a, b = decode_cells(encode_keys(k, lengths, meta.kmin, meta.kmax, 32, 4))
    mid = torch.einsum("bhgd,bhtd->bhgt", q.view(1, 2, 3, 64), (a + b) / 2).flatten(1, 2) * 0.125
    assert (exact_scores(q, k, lengths, 0.125) > mid.double()).any()


def test_keys_outside_their_range_are_refused():
    k = torch.randn(1, 1, 32, 8)
    lengths = torch.tensor([32])
    meta = block_metadata(k, lengths, 32)
    with pytest.raises(ValueError, match="outside"):
        encode_keys(k, lengths, meta.kmin + 1e-3, meta.kmax, 32, 4)
    with pytest.raises(ValueError, match="bits"):
        encode_keys(k, lengths, meta.kmin, meta.kmax, 32, 9)


def test_per_channel_bits_are_valid_on_the_bound():
    """Per-channel widths (0 to 8), keys snapped to their favoured cell edge."""
    g = torch.Generator().manual_seed(5)
    B, Hkv, G, T, d, bs = 1, 2, 3, 64, 16, 32
    bits = torch.randint(0, 9, (Hkv, d), generator=g)
    q = torch.randn(B, Hkv * G, d, generator=g) * 10
    base = 1e3 + torch.randn(B, Hkv, T, d, generator=g)
    lengths = torch.tensor([T])
    meta = block_metadata(base, lengths, bs)
    a, b = decode_cells(encode_keys(base, lengths, meta.kmin, meta.kmax, bs, bits))
    k = torch.where(q.view(B, Hkv, G, d)[:, :, 0, None, :] > 0, b, a)
    check_valid(q, k, lengths, bs, bits, 0.125)


def test_allocate_bits_spends_the_budget_where_the_weight_is():
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0], [64.0, 16.0, 1.0, 0.0]])
    bits = allocate_bits(w, 2, max_bits=8)
    assert bits.sum(-1).tolist() == [8, 8]
    assert bits[0].tolist() == [2, 2, 2, 2]
    assert bits[1].tolist() == [5, 3, 0, 0]  # gains tie at 2 > 1/2: ties go to the lower channel
    assert (allocate_bits(torch.rand(3, 64) * 100, 4, max_bits=6) <= 6).all()
    assert code_bytes_per_token(bits, 4) == 1.0
    # A better allocation is never worse than the uniform one on its own cost.
    w = torch.rand(8, 64).pow(4) * 1e3
    cost = lambda b: (w * torch.exp2(-b.double())).sum(-1)
    assert (cost(allocate_bits(w, 4)) <= cost(torch.full_like(w, 4).long()) + 1e-9).all()
