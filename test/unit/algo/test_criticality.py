import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.algo import block_metadata, bound_logits, criticality, mean_logits


def _inputs(seed, B=2, Hq=6, Hkv=2, T=70, d=8, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, d, generator=g) * spread
    k = torch.randn(B, Hkv, T, d, generator=g) * spread
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    return q, k, lengths


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10**6), spread=st.floats(0.1, 20.0))
def test_bound_is_an_upper_bound_of_every_logit_in_the_block(seed, spread):
    q, k, lengths = _inputs(seed, spread=spread)
    bs, scale = 8, 0.3
    meta = block_metadata(k, lengths, bs)
    ub = bound_logits(q, meta, scale)  # [B, Hq, NB]
    G = q.shape[1] // k.shape[1]
    logits = torch.einsum("bhd,bhtd->bht", q, k.repeat_interleave(G, 1)) * scale
    for b in range(q.shape[0]):
        for t in range(int(lengths[b])):
            # float32 sums of d products: allow a few ulps of the logit's magnitude.
            bound = ub[b, :, t // bs]
            assert bool((logits[b, :, t] <= bound + 1e-4 + 1e-6 * bound.abs()).all())


def test_mean_logits_is_query_dot_block_mean():
    q, k, lengths = _inputs(1)
    meta = block_metadata(k, lengths, 16)
    s = mean_logits(q, meta, 0.5)
    for h in range(q.shape[1]):
        kv = h // (q.shape[1] // k.shape[1])
        torch.testing.assert_close(
            s[:, h], 0.5 * torch.einsum("bd,bnd->bn", q[:, h], meta.mean[:, kv])
        )


def test_criticality_is_group_max_of_normalised_shares_and_masks_empty_blocks():
    q, k, lengths = _inputs(2)
    lengths = torch.tensor([70, 20])
    meta = block_metadata(k, lengths, 16)
    crit = criticality(q, meta, 0.4, "mean")
    logits = mean_logits(q, meta, 0.4) + meta.count.clamp(min=1).log()[:, None]
    logits = logits.masked_fill((meta.count == 0)[:, None], -torch.inf)
    share = torch.log_softmax(logits, -1)
    want = share.view(2, 2, 3, -1).amax(2)
    torch.testing.assert_close(crit, want)
    assert torch.isinf(crit[1, :, 2:]).all() and (crit[1, :, 2:] < 0).all()
    # A share is a log-probability: each query head's shares sum to one.
    torch.testing.assert_close(share.exp().nansum(-1), torch.ones(2, 6))
