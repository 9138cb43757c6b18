import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.algo import BlockMetaCache, block_metadata


def explicit_meta(k, lengths, bs):
    B, H, T, d = k.shape
    nb = (T + bs - 1) // bs
    out = {n: torch.zeros(B, H, nb, d) for n in ("mean", "kmin", "kmax")}
    count = torch.zeros(B, nb, dtype=torch.int64)
    for b in range(B):
        for j in range(nb):
            lo, hi = j * bs, min((j + 1) * bs, int(lengths[b]))
            if hi <= lo:
                continue
            blk = k[b, :, lo:hi].float()
            out["mean"][b, :, j] = blk.mean(1)
            out["kmin"][b, :, j] = blk.amin(1)
            out["kmax"][b, :, j] = blk.amax(1)
            count[b, j] = hi - lo
    return out, count


def test_block_metadata_matches_explicit_loop():
    torch.manual_seed(0)
    k = torch.randn(3, 2, 100, 8)
    lengths = torch.tensor([100, 33, 1])
    meta = block_metadata(k, lengths, 16)
    ref, count = explicit_meta(k, lengths, 16)
    torch.testing.assert_close(meta.mean, ref["mean"])
    torch.testing.assert_close(meta.kmin, ref["kmin"])
    torch.testing.assert_close(meta.kmax, ref["kmax"])
    assert torch.equal(meta.count, count)


@settings(max_examples=40, deadline=None)
@given(data=st.data(), bs=st.sampled_from([4, 8, 32]), batch=st.integers(1, 3))
def test_incremental_update_equals_recomputation(data, bs, batch):
    """Appending keys in arbitrary ragged chunks gives the summaries of a full recompute."""
    T = data.draw(st.integers(1, 90))
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, T), min_size=batch, max_size=batch)))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k = torch.randn(batch, 2, T, 4, generator=g)
    cache = BlockMetaCache.empty(batch, 2, 4, bs, capacity_blocks=1)
    while bool((cache.lengths < lengths).any()):
        step = torch.tensor([data.draw(st.integers(1, 40)) for _ in range(batch)])
        n = torch.minimum(step, lengths - cache.lengths)
        chunk = torch.zeros(batch, 2, max(int(n.max()), 1), 4)
        for b in range(batch):
            s = int(cache.lengths[b])
            chunk[b, :, : int(n[b])] = k[b, :, s : s + int(n[b])]
        cache.append(chunk, n)
    got, want = cache.meta(), block_metadata(k, lengths, bs)
    nb = got.count.shape[1]  # blocks up to the longest request; the rest must be empty
    assert not want.count[:, nb:].any()
    assert torch.equal(got.count, want.count[:, :nb])
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b[:, :, :nb], rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(data=st.data(), bs=st.sampled_from([4, 8, 32]), batch=st.integers(1, 3))
def test_uniform_append_equals_recomputation(data, bs, batch):
    """Equal-length requests appended in chunks of one size for all (a batch of decode
    policies over one context) give the summaries of a full recompute."""
    T = data.draw(st.integers(1, 90))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    k = torch.randn(batch, 2, T, 4, generator=g)
    cache = BlockMetaCache.empty(batch, 2, 4, bs, capacity_blocks=1)
    start = 0
    while start < T:
        n = min(data.draw(st.integers(1, 40)), T - start)
        cache.append_uniform(k[:, :, start : start + n], start)
        start += n
    nb = -(-T // bs)
    got, want = cache.meta(nb), block_metadata(k, torch.full((batch,), T), bs)
    assert torch.equal(cache.lengths, torch.full((batch,), T))
    assert torch.equal(got.count, want.count)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    bits=st.sampled_from([4, 8]),
    spread=st.sampled_from([1e-3, 1.0, 50.0]),
)
def test_quantized_bounds_still_bound_every_key(seed, bits, spread):
    """Key bounds kept in `bits`-bit integers and a scale per block still bound every key,
    and lie within one quantization step of the exact bounds."""
    from sglang_psa.algo import quantize_bounds

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 3, 70, 8, generator=g) * spread
    lengths = torch.tensor([70, 33])
    meta = block_metadata(k, lengths, 16)
    q = quantize_bounds(meta, bits)
    assert bool((q.kmin <= meta.kmin).all()) and bool((q.kmax >= meta.kmax).all())
    step = torch.maximum(meta.kmin.abs(), meta.kmax.abs()).amax(-1, keepdim=True)
    step = step / (2 ** (bits - 1) - 1)
    assert bool((meta.kmin - q.kmin <= step * 1.0001).all())
    assert bool((q.kmax - meta.kmax <= step * 1.0001).all())
    assert torch.equal(q.mean, meta.mean) and torch.equal(q.count, meta.count)
