"""The fused ranking kernel equals the reference: criticality from per-head logits
(`criticality_from_logits`) and the forced-first stable order (`order_blocks`), including
ties, requests of different lengths and block counts that are not powers of two."""

import pytest
import torch

from sglang_psa.algo.attention import order_blocks
from sglang_psa.algo.criticality import criticality_from_logits
from sglang_psa.config import PSAConfig


@pytest.fixture
def device(kernel_device):
    return kernel_device


@pytest.mark.parametrize("nb, G, sink, recent", [(37, 4, 1, 1), (64, 1, 2, 3), (5, 7, 1, 2)])
def test_rank_kernel_matches_reference(device, nb, G, sink, recent):
    from sgl_kernel_ext.ranking import rank_blocks

    bs, B, Hkv = 16, 3, 2
    g = torch.Generator().manual_seed(nb)
    lengths = torch.tensor([nb * bs, nb * bs - 20, max(1, nb * bs // 3)])
    logits = (torch.randn(B, Hkv * G, nb, generator=g) * 4).round()  # many exact ties
    nblk = (lengths + bs - 1) // bs
    logits = logits.masked_fill(torch.arange(nb)[None, None, :] >= nblk[:, None, None], -torch.inf)
    cfg = PSAConfig(block_size=bs, sink_blocks=sink, recent_blocks=recent)
    want_order, want_forced = order_blocks(criticality_from_logits(logits, Hkv), lengths, cfg)
    order, n_forced = rank_blocks(logits.to(device), lengths.to(device), bs, sink, recent, Hkv)
    assert order.dtype == torch.int32 and order.shape == (B, Hkv, nb)
    assert torch.equal(order.cpu().long(), want_order)
    assert torch.equal(n_forced.cpu().long(), want_forced)
