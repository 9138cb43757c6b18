"""Prefill over a prefix that left HBM (`mem_cache.prefill_stage`): SGLang's own Triton
`forward_extend`, run through the plugin's hook with some prefix blocks given back to
the allocator (their request-table entries at page 0, their pages overwritten) and their
KV only in the host tier, gives bit for bit the output it gives with the whole prefix in
HBM, still stores the new tokens in the pool, and leaves the backend as it found it."""

from __future__ import annotations

import dataclasses
import math
import types

import numpy as np
import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.triton_backend", reason="needs SGLang")

from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd  # noqa: E402
from sglang.srt.layers.attention.triton_backend import (  # noqa: E402
    ForwardMetadata,
    TritonAttnBackend,
)
from sglang.srt.layers.radix_attention import AttentionType  # noqa: E402

from sglang_psa.mem_cache.prefill_stage import PrefillStage  # noqa: E402
from sglang_psa.mem_cache.request_kv import RequestKV  # noqa: E402
from sglang_psa.plugin.extend import around_triton_forward_extend  # noqa: E402
from sglang_psa.sched import process  # noqa: E402

pytestmark = pytest.mark.sglang  # SGLang's own modules: CI runs these on every release

BS = 32


class _Pool:
    """SGLang's token-major pool as the Triton backend uses it."""

    def __init__(self, k, v):
        self.k_buffer, self.v_buffer = k, v

    def get_key_buffer(self, lid):
        return self.k_buffer[lid]

    def get_value_buffer(self, lid):
        return self.v_buffer[lid]

    def get_kv_buffer(self, lid):
        return self.k_buffer[lid], self.v_buffer[lid]

    def set_kv_buffer(self, layer, loc, k, v, *scales, **kw):
        self.k_buffer[layer.layer_id][loc.loc] = k
        self.v_buffer[layer.layer_id][loc.loc] = v


def _backend(pool, md):
    b = object.__new__(TritonAttnBackend)
    b.page_size, b.dcp_size, b.enable_deterministic = 1, 1, False
    b.use_verify_splitkv, b._translate_kv_loc = False, None
    b.extend_attention_fwd = extend_attention_fwd
    b.token_to_kv_pool, b.forward_metadata = pool, md
    # read from 0.5.23 on (its FP8 and verify paths, off here)
    b.use_dense_fp8_chunked_prefill = b.use_verify_shared_kv = b.use_mla = False
    return b


def _metadata(**kw):
    none = {f.name: None for f in dataclasses.fields(ForwardMetadata)}
    return ForwardMetadata(**{**none, **kw})


def _layer(lid, H, d):
    return types.SimpleNamespace(
        layer_id=lid, qk_head_dim=d, v_head_dim=d, tp_q_head_num=H, k_scale=None,
        v_scale=None, logit_capping_method="tanh", logit_cap=0.0, is_cross_attention=False,
        attn_type=AttentionType.DECODER, sliding_window_size=-1, scaling=1 / math.sqrt(d),
        xai_temperature_len=-1,
    )  # fmt: skip


@pytest.mark.parametrize("H,Hkv,d", [(8, 2, 64), (16, 2, 128)])
def test_staged_prefix_gives_the_resident_output(kernel_device, H, Hkv, d):
    dev = kernel_device
    g = torch.Generator().manual_seed(H + d)
    L, pages, HB = 2, 40, 30
    prefix, extend = [5 * BS, 2 * BS], [45, 20]  # chunked prompts: whole pages of prefix
    page_of = torch.randperm(pages - 1, generator=g)[:14] + 1  # page 0: SGLang's padding
    rows, at = [], 0
    for p, e in zip(prefix, extend):
        n = -(-(p + e) // BS)
        rows.append((page_of[at : at + n, None] * BS + torch.arange(BS)).flatten()[: p + e])
        at += n
    pool_k = torch.randn(L, pages * BS, Hkv, d, generator=g)
    pool_v = torch.randn(L, pages * BS, Hkv, d, generator=g)
    host_k = torch.zeros(L, Hkv, HB, BS, d)
    host_v = torch.zeros(L, Hkv, HB, BS, d)
    # request 0's blocks 1 and 3 and request 1's block 0 left HBM: saved to host blocks,
    # their entries at page 0, their pages reused by someone else
    gone = {"a": np.array([0, 1, 0, 1, 0, 0], dtype=bool), "b": np.array([1, 0, 0], dtype=bool)}
    host = {"a": [7, 3, 11, 12, 20, 21], "b": [5, 6, 9]}
    staged_rows = [r.clone() for r in rows]
    for i, rid in enumerate("ab"):
        for blk in np.flatnonzero(gone[rid]).tolist():
            toks = rows[i][blk * BS : (blk + 1) * BS]
            host_k[:, :, host[rid][blk]] = pool_k[:, toks].permute(0, 2, 1, 3)
            host_v[:, :, host[rid][blk]] = pool_v[:, toks].permute(0, 2, 1, 3)
            pool_k[:, toks], pool_v[:, toks] = 9.0, -9.0  # the page serves another request
            staged_rows[i][blk * BS : (blk + 1) * BS] = torch.arange(BS)  # page 0's slots
    T = sum(extend)
    q = torch.randn(T, H * d, generator=g)
    k = torch.randn(T, Hkv, d, generator=g)
    v = torch.randn(T, Hkv, d, generator=g)
    out_loc = torch.cat([r[p:] for r, p in zip(rows, prefix)])
    to = lambda t: t.to(dev)  # noqa: E731
    pin = (lambda t: t.pin_memory()) if dev == "cuda" else (lambda t: t)

    def run(table, staged):
        pool = _Pool(to(pool_k.clone()), to(pool_v.clone()))
        ref_pool = _Pool(to(pool_k.clone()), to(pool_v.clone()))
        if not staged:  # the reference: every prefix block still in HBM
            for i, rid in enumerate("ab"):
                for blk in np.flatnonzero(gone[rid]).tolist():
                    toks = rows[i][blk * BS : (blk + 1) * BS]
                    ref_pool.k_buffer[:, to(toks)] = to(host_k[:, :, host[rid][blk]]).permute(
                        0, 2, 1, 3
                    )
                    ref_pool.v_buffer[:, to(toks)] = to(host_v[:, :, host[rid][blk]]).permute(
                        0, 2, 1, 3
                    )
            pool = ref_pool
        md = _metadata(
            kv_indptr=to(torch.tensor([0, prefix[0], sum(prefix)])),
            kv_indices=to(torch.cat([t[:p] for t, p in zip(table, prefix)])),
            qo_indptr=to(torch.tensor([0, extend[0], T])), max_extend_len=max(extend),
        )  # fmt: skip
        backend = _backend(pool, md)
        fb = types.SimpleNamespace(
            out_cache_loc=to(out_loc), extend_prefix_lens_cpu=prefix,
            extend_seq_lens_cpu=extend, mha_one_shot=False, attn_attend_prefix_cache=None,
            out_cache_loc_is_physical=False,  # (the last four: read from 0.5.23 on)
        )  # fmt: skip
        stage = None
        if staged:
            records = {rid: RequestKV(rid, host=host[rid], evicted=gone[rid]) for rid in "ab"}
            wb = types.SimpleNamespace(
                records=records, host=types.SimpleNamespace(k=pin(host_k), v=pin(host_v))
            )
            stage = PrefillStage(wb, pool, BS)
            reqs_ = [types.SimpleNamespace(rid=rid) for rid in "ab"]
            assert stage.plan_batch(reqs_, prefix)
            assert stage.host_tokens == 3 * BS
        process.register(types.SimpleNamespace(stage=stage))  # what the hook reads of it
        try:
            outs = []
            for lid in range(L):
                o = around_triton_forward_extend(
                    TritonAttnBackend.forward_extend, backend, to(q), to(k), to(v),
                    _layer(lid, H, d), fb, True,
                )  # fmt: skip
                outs.append(o.cpu())
        finally:
            process.register(None)
        assert backend.forward_metadata is md and backend.token_to_kv_pool is pool
        for lid in range(L):  # the new tokens went into the pool either way
            assert torch.equal(pool.k_buffer[lid][to(out_loc)].cpu(), k)
        return outs

    want = run(rows, staged=False)
    got = run(staged_rows, staged=True)
    for w, o in zip(want, got):
        assert w.abs().sum() > 0
        torch.testing.assert_close(o, w, rtol=0, atol=0)


def test_a_batch_without_evicted_prefix_is_not_staged():
    pool = _Pool(torch.zeros(1, 64, 2, 8), torch.zeros(1, 64, 2, 8))
    records = {"a": RequestKV("a", host=[1, 2, 3, 4], evicted=np.zeros(4, dtype=bool))}
    stage = PrefillStage(types.SimpleNamespace(records=records), pool, BS)
    reqs = [types.SimpleNamespace(rid="a"), types.SimpleNamespace(rid="b")]
    assert not stage.plan_batch(reqs, [64, 32]) and stage.plan is None


def test_a_batch_that_does_not_match_the_plan_is_refused():
    pool = _Pool(torch.zeros(1, 96, 2, 8), torch.zeros(1, 96, 2, 8))
    records = {"a": RequestKV("a", host=[1, 2], evicted=np.ones(2, bool))}
    stage = PrefillStage(types.SimpleNamespace(records=records), pool, BS)
    assert stage.plan_batch([types.SimpleNamespace(rid="a")], [64])
    fb = types.SimpleNamespace(extend_prefix_lens_cpu=[32])
    with pytest.raises(RuntimeError, match="order of batch set-up"):
        with stage.staged(_backend(pool, None), 0, fb):
            pass
