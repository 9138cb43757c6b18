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
        residency=object() if tiered else None, stage=object() if staged else None,
        serving=types.SimpleNamespace(prefill_backends=None),
    )  # fmt: skip
    return ours


def test_triton_prefill_gets_page_size_one_on_the_token_major_pool_only():
    ours = _ours()
    h = _hybrid(ours, torch.zeros(96, 2, 8))
    after_hybrid_init(None, h)
    assert h.prefill_backend.page_size == 1
    # server info names the prefill backend (the hbm home stages nothing)
    assert ours.process.serving.prefill_backends == {"prefill": "TritonAttnBackend", "staged": None}
    paged = _hybrid(ours, torch.zeros(3, 32, 2, 8))  # a [pages, page, Hkv, d] pool
    after_hybrid_init(None, paged)
    assert paged.prefill_backend.page_size == 32
    strided = _hybrid(ours, torch.zeros(96, 2, 16)[:, :, :8])  # not contiguous
    after_hybrid_init(None, strided)
    assert strided.prefill_backend.page_size == 32
    theirs = _hybrid(object(), torch.zeros(96, 2, 8))  # plain SGLang: untouched
    after_hybrid_init(None, theirs)
    assert theirs.prefill_backend.page_size == 32


def test_the_decode_graph_warmup_reaches_our_backend_through_sglangs_hybrid():
    """SGLang's decode-graph runner asks the model runner's backend, the hybrid, for
    `on_after_cuda_graph_warmup` after each batch size's warmup runs; its hybrid does not
    pass the call on. Through the hook it reaches ours: the warmup's dummy steps leave no
    stamps, counters or kept selections behind."""
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend

    resets = []
    ours = _ours()
    for name in ("ws", "counters", "_selection"):
        setattr(ours, name, types.SimpleNamespace(reset=lambda n=name: resets.append(n)))
    h = object.__new__(HybridAttnBackend)  # SGLang's own class, as the runner holds it
    h.__dict__.update(vars(_hybrid(ours, torch.zeros(96, 2, 8))))
    h.on_after_cuda_graph_warmup()
    assert resets == []  # SGLang's hybrid alone: nothing reset
    after_hybrid_init(None, h)
    h.on_after_cuda_graph_warmup()  # what the runner does
    assert resets == ["ws", "counters", "_selection"]


def test_the_tiered_home_stages_prefill_beside_any_prefill_or_says_why_not(caplog, monkeypatch):
    """Staged prefill (prompts larger than HBM) is assembled wherever the pool is
    token-major (`sched.process.assemble`, before SGLang builds the prefill backend): on
    SGLang's Triton prefill it runs there (page size 1); beside another (FA3,
    FlashInfer) a Triton backend at page size 1 is built for the staged batches and
    SGLang's stays for the rest (`StagedPrefill`); on another pool layout the startup log
    says it is off; a process assembled one way and run over the other layout stops at
    startup."""
    from sglang_psa.attention.prefill_switch import StagedPrefill
    from sglang_psa.mem_cache.prefill_stage import reads_token_major

    pool = types.SimpleNamespace(k_buffer=[torch.zeros(96, 2, 8)], v_buffer=[torch.zeros(96, 2, 8)])
    paged = types.SimpleNamespace(k_buffer=[torch.zeros(3, 32, 2, 8)], v_buffer=[])
    assert reads_token_major(pool) and not reads_token_major(paged)  # the stage's condition

    staged = _ours(tiered=True, staged=True)
    h = _hybrid(staged, torch.zeros(96, 2, 8), page_size=1)
    with caplog.at_level("WARNING", logger="sglang_psa.plugin.extend"):
        after_hybrid_init(None, h)
    assert isinstance(h.prefill_backend, TritonAttnBackend)  # Triton's own: it stages
    assert h.prefill_backend.page_size == 1 and "staged prefill is off" not in caplog.text
    triton_both = {"prefill": "TritonAttnBackend", "staged": "TritonAttnBackend"}
    assert staged.process.serving.prefill_backends == triton_both

    built = []

    def triton_init(self, model_runner, *args, **kwargs):
        built.append(model_runner)
        self.page_size = 32  # SGLang's backend at the server's page size

    monkeypatch.setattr(TritonAttnBackend, "__init__", triton_init)
    staged.process.stage = types.SimpleNamespace(plan=None)
    fast = object()  # not SGLang's Triton backend (FA3, FlashInfer)
    h = _hybrid(staged, torch.zeros(96, 2, 8))
    h.prefill_backend = fast
    runner = object()
    after_hybrid_init(None, h, runner)
    switch = h.prefill_backend
    assert isinstance(switch, StagedPrefill) and switch.fast is fast and built == [runner]
    beside = {"prefill": "object", "staged": "TritonAttnBackend"}
    assert staged.process.serving.prefill_backends == beside
    assert isinstance(switch.staging, TritonAttnBackend) and switch.staging.page_size == 1
    assert not switch._staged()
    staged.process.stage.plan = object()  # a batch planned to stage its prefix
    assert switch._staged()

    unstaged = _ours(tiered=True)
    other = _hybrid(unstaged, torch.zeros(3, 32, 2, 8))  # a pool Triton cannot stage into
    other.prefill_backend = object()
    with caplog.at_level("WARNING", logger="sglang_psa.plugin.extend"):
        after_hybrid_init(None, other)
    assert "staged prefill is off" in caplog.text
    assert unstaged.process.serving.prefill_backends == {"prefill": "object", "staged": None}
    for ours, k in ((staged, torch.zeros(3, 32, 2, 8)), (unstaged, torch.zeros(96, 2, 8))):
        with pytest.raises(RuntimeError, match="assembled with"):
            after_hybrid_init(None, _hybrid(ours, k))


def test_staged_prefill_runs_each_extend_batch_on_one_backend():
    """`StagedPrefill`: an extend batch whose prefix is staged runs on the staging
    backend, metadata and forward alike; any other batch (and SGLang's other questions)
    on the fast one; the choice holds from a batch's metadata to its forward."""
    from sglang_psa.attention.prefill_switch import StagedPrefill

    class Backend:
        def __init__(self, name):
            self.name, self.calls, self.needs_cpu_seq_lens = name, [], name == "fast"

        def init_forward_metadata(self, fb):
            self.calls.append(("meta", fb.id))

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.calls.append(("out", fb.id, in_capture))

        def init_forward_metadata_in_graph(self, fb):
            self.calls.append(("in", fb.id))

        def forward(self, q, k, v, layer, fb, save_kv_cache=True):
            self.calls.append(("forward", fb.id, layer))
            return self.name

        def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
            self.calls.append(("extend", fb.id, layer))
            return self.name

    def batch(i, extend=True):
        mode = types.SimpleNamespace(is_extend=lambda: extend)
        return types.SimpleNamespace(id=i, forward_mode=mode)

    fast, staging, planned = Backend("fast"), Backend("staging"), [False]
    sw = StagedPrefill(fast, staging, lambda: planned[0])
    b1 = batch(1)
    sw.init_forward_metadata(b1)
    assert sw.forward(None, None, None, 0, b1) == "fast"
    planned[0] = True
    b2 = batch(2)
    sw.init_forward_metadata_out_graph(b2)
    sw.init_forward_metadata_in_graph(b2)
    assert sw.forward_extend(None, None, None, 0, b2) == "staging"
    assert sw.forward(None, None, None, 1, b2) == "staging"
    sw.init_forward_metadata(batch(3, extend=False))  # not an extend: never staged
    assert sw.active is fast  # one batch staged: the staging backend's calls below
    assert staging.calls == [("out", 2, False), ("in", 2), ("extend", 2, 0), ("forward", 2, 1)]
    assert fast.calls == [("meta", 1), ("forward", 1, 0), ("meta", 3)]
    assert sw.needs_cpu_seq_lens is True  # the fast backend's answer


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
