"""The adaptive-budget suite's kernel rows: a policy run through the server's Triton
kernels on a transformers-cache row gives the PyTorch reference's blocks and output."""

import pytest
import torch

from sglang_psa.algo import block_metadata, progressive_attention, topk_attention
from sglang_psa.config import PSAConfig
from sglang_psa.hf.attention import DecodePolicy, KernelRows

SMALL = dict(block_size=16, wave_blocks=2, wave_growth=1.5, max_wave_blocks=8)


@pytest.fixture
def device(kernel_device):
    return kernel_device


@pytest.mark.parametrize(
    "policy",
    [
        DecodePolicy("psa", PSAConfig(threshold=0.9, **SMALL)),
        DecodePolicy("psa", PSAConfig(threshold=0.98, **SMALL), cap_tokens=16 * 5),
        DecodePolicy("psa", PSAConfig(threshold=0.95, stop_rule="certified", **SMALL)),
        DecodePolicy("psa", PSAConfig(threshold=0.9, bound_bits=8, **SMALL)),
        DecodePolicy("psa", PSAConfig(threshold=0.95, bound_bits=8, later_wave_blocks=1, **SMALL)),
        DecodePolicy("psa", PSAConfig(threshold=0.98, max_read_fraction=0.4, **SMALL)),
        DecodePolicy("topk", PSAConfig(**SMALL), 16 * 6),
        DecodePolicy(
            "psa",
            PSAConfig(threshold=0.9, stop_rule="certified", bound_bits=8, **SMALL),
            code_bits=5,
        ),
    ],
    ids=lambda p: p.label,
)
@pytest.mark.parametrize("Hq,Hkv,d", [(14, 2, 64), (8, 2, 16)])
def test_a_kernel_row_equals_the_reference(device, policy, Hq, Hkv, d):
    g = torch.Generator().manual_seed(3)
    T = 231  # a partial last block
    q = torch.randn(1, Hq, d, generator=g) * 1.5
    k = torch.randn(1, Hkv, T, d, generator=g) * 1.5
    v = torch.randn(1, Hkv, T, d, generator=g)
    lengths = torch.tensor([T])
    cfg = policy.cfg
    meta = block_metadata(k, lengths, cfg.block_size)
    codes = None
    if policy.code_bits:  # the key codes of the rows' keys, on the device
        codes = KernelRows.key_codes(
            k.to(device), type(meta)(*(t.to(device) for t in meta)), cfg, 5
        )
    if policy.kind == "psa":
        cap = torch.tensor([policy.cap_tokens or 0])
        ref = progressive_attention(
            q, k, v, lengths, cfg, meta=meta, cap_tokens=cap, code_bits=policy.code_bits
        )
    else:
        ref = topk_attention(q, k, v, lengths, cfg, policy.budget_tokens, meta=meta)
    rows = KernelRows()
    to = lambda t: t.to(device)  # noqa: E731
    kscale = None
    if cfg.bound_bits == 8:  # the reference reads the bounds back from the same codes
        meta, kscale = KernelRows.codes(meta)
        kscale = to(kscale)
    for step in range(2):  # the plan is made once and reused
        m = type(meta)(*map(to, meta))
        out, n_read = rows.run(0, policy, to(q), to(k), to(v), m, None, kscale, codes)
        assert torch.equal(n_read.cpu().long(), ref.read.sum(-1)), step
        torch.testing.assert_close(out.float().cpu(), ref.out.float(), atol=2e-4, rtol=2e-4)
    assert len(rows.plans) == 1
