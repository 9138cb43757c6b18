"""The ranking kernels equal the reference: criticality from per-head logits
(`criticality_from_logits`) and the forced-first stable order (`order_blocks`), including
ties, requests of different lengths, block counts that are not powers of two, and rows
sorted in several chunks and merged."""

import pytest
import torch

from sglang_psa.algo.attention import order_blocks
from sglang_psa.algo.criticality import criticality_from_logits
from sglang_psa.config import PSAConfig


@pytest.fixture
def device(kernel_device):
    return kernel_device


# one chunk per row; 5 chunks of 64 or up to 38 chunks of 8 merged
@pytest.mark.parametrize("chunk", [512, 64, 8])
@pytest.mark.parametrize(
    "nb, G, sink, recent", [(37, 4, 1, 1), (64, 1, 2, 3), (5, 7, 1, 2), (300, 2, 0, 1)]
)
def test_rank_kernel_matches_reference(device, nb, G, sink, recent, chunk):
    from sgl_kernel_ext.ranking import rank_blocks

    bs, B, Hkv = 16, 3, 2
    g = torch.Generator().manual_seed(nb)
    lengths = torch.tensor([nb * bs, nb * bs - 20, max(1, nb * bs // 3)])
    logits = (torch.randn(B, Hkv * G, nb, generator=g) * 4).round()  # many exact ties
    nblk = (lengths + bs - 1) // bs
    logits = logits.masked_fill(torch.arange(nb)[None, None, :] >= nblk[:, None, None], -torch.inf)
    cfg = PSAConfig(block_size=bs, sink_blocks=sink, recent_blocks=recent)
    want_order, want_forced = order_blocks(criticality_from_logits(logits, Hkv), lengths, cfg)
    # A block table (slots and negative host units) to be written out in read order.
    loc = torch.randperm(B * Hkv * nb, generator=g).view(B, Hkv, nb).to(torch.int32)
    loc = torch.where(torch.rand(loc.shape, generator=g) < 0.3, -loc - 1, loc)
    order, n_forced = rank_blocks(
        logits.to(device), lengths.to(device), bs, sink, recent, Hkv, chunk_blocks=chunk,
        loc=loc.to(device), ranked_loc=(ranked := torch.full_like(loc, 7).to(device)),
    )  # fmt: skip
    assert order.dtype == torch.int32 and order.shape == (B, Hkv, nb)
    assert torch.equal(order.cpu().long(), want_order)
    assert torch.equal(n_forced.cpu().long(), want_forced)
    assert torch.equal(ranked.cpu(), loc.gather(-1, want_order))


def test_partials_from_the_scoring_kernel_give_the_same_order(device):
    """The row log-sum-exp combined from the scoring kernel's per-chunk partials ranks
    like the one computed from the whole row."""
    from sgl_kernel_ext.ranking import logit_partials, rank_blocks
    from sgl_kernel_ext.scoring import block_scores, partial_chunks
    from sglang_psa.algo import block_metadata

    g = torch.Generator().manual_seed(1)
    B, Hq, Hkv, T, d, bs = 2, 8, 2, 1500, 16, 16
    q = torch.randn(B, Hq, d, generator=g).to(device)
    k = torch.randn(B, Hkv, T, d, generator=g).to(device)
    lengths = torch.tensor([T, 700]).to(device)
    meta = block_metadata(k, lengths, bs)
    nb = meta.mean.shape[2]
    part = torch.empty(B, Hq, partial_chunks(nb), 2, device=device)
    assert part.shape[2] > 1
    logits, _ = block_scores(
        q, meta.mean, meta.kmin, meta.kmax, lengths, bs, 0.25, "bound", normalize=False,
        partials=part,
    )  # fmt: skip
    whole = logit_partials(logits)

    def lse(p):
        top = p[..., 0].amax(-1, keepdim=True)
        return top[..., 0] + torch.log((p[..., 1] * (p[..., 0] - top).exp()).sum(-1))

    torch.testing.assert_close(lse(part.cpu()), lse(whole.cpu()), atol=1e-5, rtol=1e-6)
    got = rank_blocks(logits, lengths, bs, 1, 1, Hkv, partials=part, chunk_blocks=16)
    want = rank_blocks(logits, lengths, bs, 1, 1, Hkv)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
