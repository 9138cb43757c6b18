"""The prefill glue (`plugin.extend`): SGLang's Triton prefill backend addresses the
token-major pool per token under `--sparse-mode`, which computes the same attention as
its page-aware addressing at the PSA block size."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.triton_backend", reason="needs SGLang")

from sglang.srt.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402

from sglang_psa.attention.psa_backend import PSAAttnBackend  # noqa: E402
from sglang_psa.plugin.extend import after_hybrid_init  # noqa: E402

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release


def _hybrid(decode, k_buffer, page_size=32):
    prefill = object.__new__(TritonAttnBackend)
    prefill.page_size = page_size
    pool = types.SimpleNamespace(k_buffer=[k_buffer], v_buffer=[k_buffer.clone()])
    return types.SimpleNamespace(
        prefill_backend=prefill, decode_backend=decode, token_to_kv_pool=pool
    )


def _ours(tiered: bool = False, staged: bool = False) -> PSAAttnBackend:
    """Our decode backend as the hook reads it: the scheduler process it assembled, with
    (tiered) or without a host tier, and with or without a prefill stage."""
    ours = object.__new__(PSAAttnBackend)
    ours.process = types.SimpleNamespace(
        residency=object() if tiered else None, stage=object() if staged else None
    )
    return ours


def test_triton_prefill_gets_page_size_one_on_the_token_major_pool_only():
    ours = _ours()
    h = _hybrid(ours, torch.zeros(96, 2, 8))
    after_hybrid_init(None, h)
    assert h.prefill_backend.page_size == 1
    paged = _hybrid(ours, torch.zeros(3, 32, 2, 8))  # a [pages, page, Hkv, d] pool
    after_hybrid_init(None, paged)
    assert paged.prefill_backend.page_size == 32
    strided = _hybrid(ours, torch.zeros(96, 2, 16)[:, :, :8])  # not contiguous
    after_hybrid_init(None, strided)
    assert strided.prefill_backend.page_size == 32
    theirs = _hybrid(object(), torch.zeros(96, 2, 8))  # plain SGLang: untouched
    after_hybrid_init(None, theirs)
    assert theirs.prefill_backend.page_size == 32


def test_the_tiered_home_stages_prefill_on_triton_or_says_why_not(caplog):
    """Staged prefill (prompts larger than HBM) is assembled for the Triton prefill over
    the token-major pool (`sched.process.stages_prefill`, from the server args, before
    SGLang builds the prefill backend), also when it already runs at page size 1; with
    another prefill the startup log says it is off; a process assembled for one prefill
    backend and run with another stops at startup."""
    from sglang_psa.sched.process import stages_prefill

    pool = types.SimpleNamespace(k_buffer=[torch.zeros(96, 2, 8)], v_buffer=[torch.zeros(96, 2, 8)])
    paged = types.SimpleNamespace(k_buffer=[torch.zeros(3, 32, 2, 8)], v_buffer=[])
    triton = types.SimpleNamespace(prefill_attention_backend="triton", attention_backend="triton")
    fa3 = types.SimpleNamespace(prefill_attention_backend="fa3", attention_backend="fa3")
    assert stages_prefill(triton, pool) and not stages_prefill(fa3, pool)
    assert not stages_prefill(triton, paged) and not stages_prefill(types.SimpleNamespace(), pool)
    assert stages_prefill(types.SimpleNamespace(attention_backend="triton"), pool)

    staged = _ours(tiered=True, staged=True)
    h = _hybrid(staged, torch.zeros(96, 2, 8), page_size=1)
    with caplog.at_level("WARNING", logger="sglang_psa.plugin.extend"):
        after_hybrid_init(None, h)
    assert h.prefill_backend.page_size == 1 and "staged prefill is off" not in caplog.text
    unstaged = _ours(tiered=True)
    other = _hybrid(unstaged, torch.zeros(96, 2, 8))
    other.prefill_backend = object()  # not SGLang's Triton backend (FA3, FlashInfer)
    with caplog.at_level("WARNING", logger="sglang_psa.plugin.extend"):
        after_hybrid_init(None, other)
    assert "staged prefill is off" in caplog.text and "object" in caplog.text
    for ours, prefill in ((staged, object()), (unstaged, None)):
        wrong = _hybrid(ours, torch.zeros(96, 2, 8))
        if prefill is not None:
            wrong.prefill_backend = prefill
        with pytest.raises(RuntimeError, match="assembled with"):
            after_hybrid_init(None, wrong)


def test_the_extend_kernel_at_page_size_one_equals_page_size_32(kernel_device):
    """SGLang's extend kernel with a prefix in the pool on pages of 32 tokens: page-aware
    and per-token addressing give the same output."""
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    dev = kernel_device
    g = torch.Generator().manual_seed(0)
    H, Hkv, d, bs = 4, 2, 64, 32
    prefix, extend = [64, 32], [40, 17]  # whole pages of prefix, then the new tokens
    pages = torch.randperm(12, generator=g)[:6] + 1  # page 0 is SGLang's padding page
    pool_k = torch.randn(16 * bs, Hkv, d, generator=g)
    pool_v = torch.randn(16 * bs, Hkv, d, generator=g)
    rows, at = [], 0
    for p, e in zip(prefix, extend):
        n = -(-(p + e) // bs)
        toks = (pages[at : at + n, None] * bs + torch.arange(bs)).flatten()[: p + e]
        rows.append(toks)
        at += n
    kv_indices = torch.cat([r[:p] for r, p in zip(rows, prefix)])
    kv_indptr = torch.tensor([0, prefix[0], sum(prefix)])
    qo_indptr = torch.tensor([0, extend[0], sum(extend)])
    T = sum(extend)
    q = torch.randn(T, H, d, generator=g)
    k = torch.randn(T, Hkv, d, generator=g)
    v = torch.randn(T, Hkv, d, generator=g)
    for r, p, e, s in zip(rows, prefix, extend, [0, extend[0]]):  # the extend in the pool
        pool_k[r[p:]], pool_v[r[p:]] = k[s : s + e], v[s : s + e]
    to = lambda t: t.to(dev)  # noqa: E731
    outs = []
    for page_size in (1, bs):
        o = torch.empty(T, H, d, device=dev)
        extend_attention_fwd(
            to(q), to(k), to(v), o, to(pool_k), to(pool_v), to(qo_indptr), to(kv_indptr),
            to(kv_indices), None, True, None, max(extend), 1.0, 1.0, page_size=page_size,
        )  # fmt: skip
        outs.append(o.cpu())
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert outs[0].abs().sum() > 0
