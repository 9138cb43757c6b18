"""Triton scoring and wave attention against the PyTorch reference (sglang_psa.algo)."""

import math
from types import SimpleNamespace

import pytest
import torch

from sglang_psa.algo import (
    block_metadata,
    bound_codes,
    criticality,
    progressive_attention,
    quantize_bounds,
)
from sglang_psa.algo.attention import read_order
from sglang_psa.algo.criticality import bound_logits
from sglang_psa.config import PSAConfig


@pytest.fixture
def device(kernel_device):
    return kernel_device


# Small blocks and waves, so a short context spans many waves; exact (16-bit) bounds and a
# fixed first wave (the default's 8-bit bounds and growing first wave have their tests).
SMALL_WAVES = dict(
    block_size=16, wave_blocks=2, wave_growth=1.5, max_wave_blocks=8, bound_bits=16,
    wave_fraction=0.0, max_read_fraction=1.0,
)  # fmt: skip


def _case(seed, B=2, Hq=4, Hkv=2, T=200, d=16, spread=1.5, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, d, generator=g) * spread
    k = torch.randn(B, Hkv, T, d, generator=g) * spread
    v = torch.randn(B, Hkv, T, d, generator=g)
    lengths = torch.randint(T // 3, T + 1, (B,), generator=g)
    lengths[0] = T
    return [x.to(device) for x in (q, k, v, lengths)]


def _tiered_layout(k, v, lengths, bs, host_fraction, seed):
    """Scatter the blocks into HBM slots and a host pool at random; build the block table."""
    B, Hkv, T, d = k.shape
    nb = (T + bs - 1) // bs
    pad = nb * bs - T
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).view(B, Hkv, nb, bs, d)
    vb = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(B, Hkv, nb, bs, d)
    n = B * Hkv * nb
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    on_host = torch.rand(n, generator=g) < host_fraction
    k_slots = torch.zeros(n, bs, d, dtype=k.dtype, device=k.device)
    v_slots, k_host, v_host = (torch.zeros_like(k_slots) for _ in range(3))
    loc = torch.empty(n, dtype=torch.int32)
    flat_k, flat_v = kb.reshape(n, bs, d), vb.reshape(n, bs, d)
    for i in range(n):
        u = int(perm[i])
        if on_host[i]:
            k_host[u], v_host[u] = flat_k[i], flat_v[i]
            loc[i] = -u - 1
        else:
            k_slots[u], v_slots[u] = flat_k[i], flat_v[i]
            loc[i] = u
    if k.is_cuda:
        k_host, v_host = k_host.cpu().pin_memory(), v_host.cpu().pin_memory()
    return k_slots, v_slots, k_host, v_host, loc.view(B, Hkv, nb).to(k.device)


def _paged_pool(k, v, bs, g, device):
    """k, v laid out as SGLang's `[tokens, Hkv, d]` pool: each request's blocks on random
    pages (page 0 is SGLang's padding page). Returns (pages `[B, nb]`, k_pool, v_pool)."""
    B, Hkv, T, d = k.shape
    nb = -(-T // bs)
    pages = torch.randperm(B * nb + 4, generator=g)[: B * nb].view(B, nb) + 1
    k_pool = torch.zeros((B * nb + 5) * bs, Hkv, d, device=device)
    v_pool = torch.zeros_like(k_pool)
    for b in range(B):
        for j in range(nb):
            t0, t1 = j * bs, min((j + 1) * bs, T)
            p = int(pages[b, j])
            k_pool[p * bs : p * bs + t1 - t0] = k[b, :, t0:t1].transpose(0, 1).to(device)
            v_pool[p * bs : p * bs + t1 - t0] = v[b, :, t0:t1].transpose(0, 1).to(device)
    return pages, k_pool, v_pool


def _run_tiered(
    cfg, q, k, v, lengths, host_fraction, layout_seed, device, splits=None, meta=None, **kw
):
    """Lay the KV out over slots and host pool, then run the Triton wave attention (with
    `cfg.bound_bits` 8 on the bounds' codes and scale, as the server keeps them)."""
    from sgl_kernel_ext.wave_attention import WaveAttention

    bs = cfg.block_size
    meta = block_metadata(k, lengths, bs) if meta is None else meta
    if cfg.bound_bits == 8 and "meta_scale" not in kw:
        qlo, qhi, kw["meta_scale"] = _codes(meta)
        meta = meta._replace(kmin=qlo, kmax=qhi)
    k_slots, v_slots, k_host, v_host, loc = _tiered_layout(
        k, v, lengths, bs, host_fraction, seed=layout_seed
    )
    wa = WaveAttention.from_config(cfg).plan(
        *q.shape[:2], k.shape[1], q.shape[2], loc.shape[-1], device, splits=splits
    )
    return wa.run(
        q,
        k_slots,
        v_slots,
        loc,
        lengths,
        meta.mean,
        meta.kmin,
        meta.kmax,
        k_host=k_host,
        v_host=v_host,
        **kw,
    )


def _assert_matches_psa(cfg, case, host_fraction, layout_seed, device, splits=None):
    """Same blocks, output, log-mass and wave count as `progressive_attention`."""
    q, k, v, lengths = case
    ref = progressive_attention(q, k, v, lengths, cfg)
    res = _run_tiered(cfg, q, k, v, lengths, host_fraction, layout_seed, device, splits=splits)
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(res.lse, ref.lse, atol=2e-4, rtol=2e-4)
    if cfg.threshold < 1.0:
        assert torch.equal(res.n_waves.long(), ref.n_waves)
    else:  # nothing can stop a dense read early: it is one wave, whatever the schedule
        assert (res.n_waves == 1).all()


@pytest.mark.parametrize("method", ["mean", "bound"])
def test_block_scores_match_reference(device, method):
    from sgl_kernel_ext.scoring import block_scores

    q, k, _, lengths = _case(0, Hq=6, Hkv=2, T=300, device=device)
    meta = block_metadata(k, lengths, 32)
    scale = 1 / math.sqrt(q.shape[-1])
    crit, ub = block_scores(
        q, meta.mean, meta.kmin, meta.kmax, lengths, 32, scale, method, want_bound=True
    )
    torch.testing.assert_close(crit, criticality(q, meta, scale, method), atol=1e-4, rtol=1e-4)
    want_ub = bound_logits(q, meta, scale) + meta.count.clamp(min=1).log()[:, None]
    want_ub = want_ub.masked_fill((meta.count == 0)[:, None], -torch.inf)
    torch.testing.assert_close(ub, want_ub, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", ["mean", "bound"])
def test_block_scores_read_per_page_metadata_through_the_page_table(device, method):
    """Metadata stored per page `[P, Hkv, d]` and found through `pages [B, NB]` scores
    exactly like the per-request gathered `[B, Hkv, NB, d]`."""
    from sgl_kernel_ext.scoring import block_scores

    q, k, _, lengths = _case(4, Hq=6, Hkv=2, T=300, device=device)
    meta = block_metadata(k, lengths, 32)
    B, Hkv, NB, d = meta.mean.shape
    g = torch.Generator().manual_seed(5)
    pages = (torch.randperm(B * NB + 3, generator=g)[: B * NB] + 1).view(B, NB).to(device)
    per_page = [torch.zeros(B * NB + 4, Hkv, d, device=device) for _ in range(3)]
    for dst, src in zip(per_page, (meta.mean, meta.kmin, meta.kmax)):
        dst[pages] = src.permute(0, 2, 1, 3)
    scale = 1 / math.sqrt(d)
    want = block_scores(q, meta.mean, meta.kmin, meta.kmax, lengths, 32, scale, method, True)
    got = block_scores(q, *per_page, lengths, 32, scale, method, True, pages=pages)
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["mean", "bound"])
def test_block_scores_read_metadata_in_the_kv_dtype(device, method, dtype):
    """Metadata kept in the KV dtype (the serving default: half the bytes of float32) is
    scored in float32: the same scores as float32 copies of the same values."""
    from sgl_kernel_ext.scoring import block_scores

    q, k, _, lengths = _case(6, Hq=8, Hkv=2, T=300, device=device)
    meta = block_metadata(k.to(dtype), lengths, 32)  # min/max exact in dtype, mean rounded
    low = [t.to(dtype) for t in (meta.mean, meta.kmin, meta.kmax)]
    scale = 1 / math.sqrt(q.shape[-1])
    got = block_scores(q, *low, lengths, 32, scale, method, want_bound=True)
    want = block_scores(q, *(t.float() for t in low), lengths, 32, scale, method, True)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def _codes(meta):
    """The bounds as int8 codes and their scale (what the metadata kernel writes)."""
    qlo, qhi, scale = bound_codes(meta.kmin, meta.kmax)
    return qlo.to(torch.int8), qhi.to(torch.int8), scale


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("G,d", [(7, 64), (4, 128)])
def test_block_scores_read_8_bit_bounds(device, paged, G, d):
    """8-bit codes and their scale score as the float bounds they read back as
    (`quantize_bounds`), per request or per page through the page table."""
    from sgl_kernel_ext.scoring import block_scores

    q, k, _, lengths = _case(8, Hq=2 * G, Hkv=2, T=700, d=d, spread=3.0, device=device)
    meta = block_metadata(k, lengths, 32)
    back = quantize_bounds(meta)
    qlo, qhi, sc = _codes(meta)
    scale = 1 / math.sqrt(d)
    want = block_scores(q, back.mean, back.kmin, back.kmax, lengths, 32, scale, "bound", True)
    if paged:
        B, Hkv, NB, _ = meta.mean.shape
        g = torch.Generator().manual_seed(2)
        pages = (torch.randperm(B * NB + 3, generator=g)[: B * NB] + 1).view(B, NB).to(device)
        per_page = []
        for src in (meta.mean, qlo, qhi, sc):
            dst = torch.zeros((B * NB + 4, *src.permute(0, 2, 1, *range(3, src.dim())).shape[2:]),
                              dtype=src.dtype, device=device)  # fmt: skip
            dst[pages] = src.transpose(1, 2)
            per_page.append(dst)
        got = block_scores(q, *per_page[:3], lengths, 32, scale, "bound", True, pages=pages,
                           meta_scale=per_page[3])  # fmt: skip
    else:
        got = block_scores(q, meta.mean, qlo, qhi, lengths, 32, scale, "bound", True,
                           meta_scale=sc)  # fmt: skip
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="meta_scale"):
        block_scores(q, meta.mean, qlo, qhi, lengths, 32, scale, "bound")


@pytest.mark.parametrize("rule,eps", [("heuristic", 0.9), ("certified", 0.95)])
def test_wave_attention_with_8_bit_bounds_reads_what_the_reference_reads(device, rule, eps):
    """The wave kernel ranking and stopping on 8-bit codes reads the blocks the reference
    reads with the bounds read back from them, and gives its output."""
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    q, k, v, lengths = _case(17, T=600, d=64, spread=2.0, device=device)
    meta = block_metadata(k, lengths, cfg.block_size)
    ref = progressive_attention(q, k, v, lengths, cfg, meta=quantize_bounds(meta))
    qlo, qhi, sc = _codes(meta)
    res = _run_tiered(cfg, q, k, v, lengths, 0.3, 4, device, meta=meta._replace(kmin=qlo, kmax=qhi),
                      meta_scale=sc)  # fmt: skip
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize(
    "rule,eps,host",
    [
        ("heuristic", 0.9, 0.0),
        ("heuristic", 0.98, 0.5),
        ("certified", 0.95, 0.3),
        ("heuristic", 1.0, 1.0),
    ],
)
def test_wave_attention_matches_reference(device, rule, eps, host):
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    _assert_matches_psa(cfg, _case(1, device=device), host, 2, device)


@pytest.mark.parametrize("path", ["torch", "chunked"])
@pytest.mark.parametrize("rule,eps", [("heuristic", 0.9), ("certified", 0.95)])
def test_ranking_in_torch_or_in_merged_chunks_gives_the_same_result(
    device, rule, eps, path, monkeypatch
):
    """Past `fused_rank_max_blocks` the ranking runs in torch; rows longer than
    `rank_chunk_blocks` are sorted in chunks and merged: same reads, same output."""
    from sgl_kernel_ext.wave_attention import WaveAttention

    if path == "torch":
        monkeypatch.setattr(WaveAttention, "fused_rank_max_blocks", 0)
    else:  # 13 blocks per row in chunks of 4
        real_init = WaveAttention.__init__

        def small_chunks(self, **kw):
            real_init(self, **kw)
            self.rank_chunk_blocks = 4

        monkeypatch.setattr(WaveAttention, "__init__", small_chunks)
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    _assert_matches_psa(cfg, _case(13, device=device), 0.3, 4, device)


@pytest.mark.parametrize("rule, eps", [("heuristic", 0.9), ("certified", 0.95)])
def test_queries_read_in_place_from_a_view_of_the_fused_qkv(device, rule, eps):
    """SGLang's q is a view of the fused qkv projection (rows further apart than a row):
    scoring and the wave kernel read it in place, as the reference reads a copy."""
    q, k, v, lengths = _case(21, device=device)
    B, Hq, d = q.shape
    qkv = torch.zeros(B, (Hq + 2 * k.shape[1]) * d, device=device)
    view = qkv[:, : Hq * d].view(B, Hq, d)
    view.copy_(q)
    assert not view.is_contiguous()
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    _assert_matches_psa(cfg, (view, k, v, lengths), 0.3, 4, device)


def test_wave_attention_with_a_block_budget_is_topk(device):
    from sglang_psa.algo import topk_attention

    cfg = PSAConfig(threshold=1.0, block_size=16, topk_tokens=16 * 5)
    q, k, v, lengths = _case(3, device=device)
    ref = topk_attention(q, k, v, lengths, cfg)
    res = _run_tiered(cfg, q, k, v, lengths, 0.5, 4, device, max_read_blocks=5)
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("rule,eps,budget", [("heuristic", 0.9, None), ("certified", 0.95, None),
                                             ("heuristic", 1.0, 6)])  # fmt: skip
def test_a_short_request_in_a_long_plan_is_scored_and_ranked_over_its_own_blocks(
    device, rule, eps, budget
):
    """The server plans for its longest context (NB blocks) whatever the batch holds:
    score chunks and rank chunks wholly past a request's blocks are skipped and leave
    the plan's buffers as they were. With those buffers holding another batch's values
    (NaN logits, stale orders) a short request still reads, and gives, what the
    reference gives."""
    from sgl_kernel_ext.wave_attention import WaveAttention
    from sglang_psa.algo import topk_attention

    cfg = PSAConfig(threshold=eps, stop_rule=rule, topk_tokens=16 * 6, **SMALL_WAVES)
    q, k, v, _ = _case(23, T=1600, d=64, spread=2.0, device=device)
    lengths = torch.tensor([1600, 250], device=device)  # 100 and 16 of 100 blocks
    meta = block_metadata(k, lengths, cfg.block_size)
    k_slots, v_slots, k_host, v_host, loc = _tiered_layout(k, v, lengths, 16, 0.3, seed=5)
    wa = WaveAttention.from_config(cfg)
    wa.score_blocks, wa.rank_chunk_blocks = 16, 16  # 7 score and 7 rank chunks per row
    wa.plan(*q.shape[:2], k.shape[1], q.shape[2], loc.shape[-1], device)
    g = torch.Generator().manual_seed(0)
    for buf in (wa.logits, wa.partials):
        buf.copy_(torch.where(torch.rand(buf.shape, generator=g) < 0.5, torch.nan, 1e4))
    wa.order.copy_(torch.randint(0, loc.shape[-1], wa.order.shape, generator=g))
    wa.ranked_loc.copy_(torch.randint(0, k_slots.shape[0], wa.ranked_loc.shape, generator=g))
    wa.rank_scratch.copy_(torch.randint(-(2**62), 2**62, wa.rank_scratch.shape, generator=g))
    stale = wa.logits[1, :, 16:].clone()
    kw = {} if budget is None else {"max_read_blocks": budget}
    res = wa.run(q, k_slots, v_slots, loc, lengths, meta.mean, meta.kmin, meta.kmax,
                 k_host=k_host, v_host=v_host, **kw)  # fmt: skip
    # The short request's blocks past its one score chunk were not scored at all.
    torch.testing.assert_close(wa.logits[1, :, 16:], stale, rtol=0, atol=0, equal_nan=True)
    if budget is None:
        ref = progressive_attention(q, k, v, lengths, cfg)
    else:
        ref = topk_attention(q, k, v, lengths, cfg)
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("later", [0, 16])
def test_wave_table_rows_are_the_configs_schedules(later):
    """Each request's row of the kernel's wave table is `PSAConfig.wave_sizes` from its
    own first wave (`first_wave` of its blocks), cumulated; with or without smaller
    later waves."""
    from sgl_kernel_ext.wave_attention import WaveAttention

    cfg = PSAConfig(wave_fraction=1 / 8, max_first_wave_blocks=64, threshold=0.9)
    cfg = cfg.replace(later_wave_blocks=later)
    wa = WaveAttention.from_config(cfg)
    wa.one_wave = False
    ends, rows = wa._wave_table(1100)
    assert len(set(rows.tolist())) == 64 - 16 + 1  # first waves 16..64
    for n in (0, 1, 100, 129, 300, 511, 512, 513, 1100):
        want = torch.tensor(cfg.wave_sizes(1100, cfg.first_wave(n))).cumsum(0)
        row = ends[rows[n]]
        assert torch.equal(row[: len(want)].long(), want), n
        assert (row[len(want) :] == want[-1]).all()
    assert [cfg.first_wave(n) for n in (10, 200, 400, 1100)] == [16, 25, 50, 64]


@pytest.mark.parametrize("rule,eps", [("heuristic", 0.9), ("certified", 0.95)])
@pytest.mark.parametrize("splits", [1, pytest.param(4, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("later", [0, 2])
def test_a_first_wave_that_grows_with_the_context_reads_what_the_reference_reads(
    device, rule, eps, splits, later
):
    """`wave_fraction`: each request's first wave is its own share of its blocks (and the
    later waves start at `later_wave_blocks`); the kernel verifies where the reference
    does: same blocks, output and waves."""
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    cfg = cfg.replace(wave_fraction=0.2, max_first_wave_blocks=9, later_wave_blocks=later)
    case = _case(21, B=4, T=700, spread=2.0, device=device)
    lengths = case[3]
    lengths[1:] = torch.tensor([100, 300, 520], device=lengths.device)
    firsts = {cfg.first_wave(-(-int(n) // 16)) for n in lengths}
    assert len(firsts) >= 3, firsts  # requests of different first waves in one batch
    ref = progressive_attention(*case, cfg)
    fixed = progressive_attention(*case, cfg.replace(wave_fraction=0.0))
    assert not torch.equal(ref.n_waves, fixed.n_waves)  # the schedule matters here
    _assert_matches_psa(cfg, case, 0.3, 5, device, splits=splits)


@pytest.mark.gpu
@pytest.mark.parametrize("later", [0, 16])
@pytest.mark.parametrize("G,d", [(7, 64), (4, 128)])
def test_a_growing_first_wave_at_real_shapes(G, d, later):
    """The server's shapes and default policy: 32-token blocks, over 512 of them, group
    sizes 4-8, head_dim 64 and 128, 8-bit bounds, a first wave of 1/4 of each request's
    blocks up to 128 (the 20000-token request's is capped, the others' are not); later
    waves as large as the first, or from 16 blocks."""
    cfg = PSAConfig().replace(later_wave_blocks=later)
    assert cfg.bound_bits == 8 and cfg.wave_fraction == 1 / 4 and cfg.max_first_wave_blocks == 128
    g = torch.Generator().manual_seed(3)
    B, Hkv, T = 3, 2, 20000
    q = (torch.randn(B, Hkv * G, d, generator=g) * 2).cuda().bfloat16()
    k = (torch.randn(B, Hkv, T, d, generator=g) * 2).cuda().bfloat16()
    v = torch.randn(B, Hkv, T, d, generator=g).cuda().bfloat16()
    lengths = torch.tensor([T, 9000, 3000], device="cuda")
    ref = progressive_attention(q.float(), k.float(), v.float(), lengths, cfg)
    res = _run_tiered(cfg, q.float(), k.float(), v.float(), lengths, 0.2, 3, "cuda")
    assert torch.equal(res.read_mask(), ref.read)
    assert torch.equal(res.n_waves.long(), ref.n_waves)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("rule,eps", [("heuristic", 0.98), ("certified", 0.95)])
@pytest.mark.parametrize("splits", [1, pytest.param(4, marks=pytest.mark.gpu)])
def test_a_block_cap_stops_psa_where_the_reference_does(device, rule, eps, splits):
    """PSA with a cap (`max_read_blocks` below 1 = no stop rule): waves end at the cap
    as in `progressive_attention(cap_tokens=...)`; same blocks, output and waves."""
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    q, k, v, lengths = _case(5, T=300, device=device)
    cap = torch.full((q.shape[0],), 16 * 7, device=device)
    ref = progressive_attention(q, k, v, lengths, cfg, cap_tokens=cap)
    uncapped = progressive_attention(q, k, v, lengths, cfg)
    assert (ref.read.sum(-1) < uncapped.read.sum(-1)).any(), "the cap must bind somewhere"
    res = _run_tiered(cfg, q, k, v, lengths, 0.3, 4, device, splits=splits, max_read_blocks=7)
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(res.lse, ref.lse, atol=2e-4, rtol=2e-4)
    assert torch.equal(res.n_waves.long(), ref.n_waves)


@pytest.mark.parametrize("rule,eps", [("heuristic", 0.98), ("heuristic", 0.9)])
@pytest.mark.parametrize("splits", [1, pytest.param(4, marks=pytest.mark.gpu)])
def test_a_read_fraction_caps_psa_where_the_reference_does(device, rule, eps, splits):
    """`max_read_fraction`: each request's heads read at most that share of its own
    blocks; same blocks, output and waves as the reference."""
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES).replace(max_read_fraction=0.3)
    case = _case(8, B=3, T=400, spread=2.0, device=device)
    case[3][1:] = torch.tensor([250, 90], device=case[3].device)
    free = progressive_attention(*case, cfg.replace(max_read_fraction=1.0))
    ref = progressive_attention(*case, cfg)
    assert (ref.read.sum(-1) < free.read.sum(-1)).any(), "the cap must bind somewhere"
    _assert_matches_psa(cfg, case, 0.3, 6, device, splits=splits)


@pytest.mark.parametrize("budget", [None, 5], ids=["dense", "topk"])
def test_one_wave_splits_are_merged_by_the_last_program(device, budget):
    """No stop rule (threshold 1, or a fixed budget): one wave, several programs per
    (request, KV head), no barrier; the last to finish merges. Counters end at zero."""
    from sglang_psa.algo import topk_attention

    cfg = PSAConfig(threshold=1.0, block_size=16, topk_tokens=16 * (budget or 2), bound_bits=16)
    q, k, v, lengths = _case(9, T=300, device=device)
    ref = (
        topk_attention(q, k, v, lengths, cfg)
        if budget
        else progressive_attention(q, k, v, lengths, cfg)
    )
    kw = {"max_read_blocks": budget} if budget else {}
    from sgl_kernel_ext.wave_attention import WaveAttention

    meta = block_metadata(k, lengths, 16)
    k_slots, v_slots, k_host, v_host, loc = _tiered_layout(k, v, lengths, 16, 0.3, seed=2)
    wa = WaveAttention.from_config(cfg).plan(
        *q.shape[:2], k.shape[1], q.shape[2], loc.shape[-1], device, splits=4
    )
    assert wa.one_wave and wa.splits == 4
    for _ in range(2):  # the ticket counters are reset by each launch
        res = wa.run(q, k_slots, v_slots, loc, lengths, meta.mean, meta.kmin, meta.kmax,
                     k_host=k_host, v_host=v_host, **kw)  # fmt: skip
        assert torch.equal(res.read_mask(), ref.read)
        torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(res.lse, ref.lse, atol=2e-4, rtol=2e-4)
        assert int(wa.counters.abs().sum()) == 0 and (res.n_waves == 1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize(
    "rule,eps,host", [("heuristic", 0.9, 0.3), ("certified", 0.95, 0.0), ("heuristic", 1.0, 0.5)]
)
def test_split_waves_match_reference(splits, rule, eps, host):
    """Several programs per (request, KV head), merging states after every wave."""
    cfg = PSAConfig(threshold=eps, stop_rule=rule, **SMALL_WAVES)
    _assert_matches_psa(cfg, _case(5, T=700, device="cuda"), host, 6, "cuda", splits=splits)


@pytest.mark.gpu
def test_split_too_large_for_one_cooperative_launch_is_halved():
    from sgl_kernel_ext.wave_attention import WaveAttention

    cfg = PSAConfig(threshold=0.9, **SMALL_WAVES)
    q, k, v, lengths = _case(7, B=8, Hq=8, Hkv=4, T=400, device="cuda")
    ref = progressive_attention(q, k, v, lengths, cfg)
    meta = block_metadata(k, lengths, 16)
    k_slots, v_slots, k_host, v_host, loc = _tiered_layout(k, v, lengths, 16, 0.0, seed=8)
    # 8 x 4 x 64 programs cannot all be resident on any current GPU.
    wa = WaveAttention.from_config(cfg).plan(8, 8, 4, 16, loc.shape[-1], "cuda", splits=64)
    res = wa.run(q, k_slots, v_slots, loc, lengths, meta.mean, meta.kmin, meta.kmax)
    assert wa.splits < 64
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("host_fraction", [0.0, 0.5])
def test_wave_attention_reads_token_major_pages_in_place(device, host_fraction):
    """HBM slots given as SGLang's KV buffer `[tokens, Hkv, d]` (a slot = a page, the head
    an offset inside each token) with `slot_strides`; host blocks stay `[bs, d]` units."""
    from sgl_kernel_ext.wave_attention import WaveAttention

    cfg = PSAConfig(threshold=0.9, **SMALL_WAVES)
    q, k, v, lengths = _case(7, device=device)
    B, Hkv, T, d = k.shape
    bs = cfg.block_size
    nb = -(-T // bs)
    g = torch.Generator().manual_seed(3)
    pages, kbuf, vbuf = _paged_pool(k, v, bs, g, device)
    k_host = torch.zeros(B * Hkv * nb, bs, d)
    v_host = torch.zeros_like(k_host)
    on_host = torch.rand(B, Hkv, nb, generator=g) < host_fraction
    loc = torch.empty(B, Hkv, nb, dtype=torch.int32)
    for b in range(B):
        for j in range(nb):
            t0, t1 = j * bs, min((j + 1) * bs, T)
            slot = int(pages[b, j])
            for h in range(Hkv):
                if on_host[b, h, j]:
                    u = (b * Hkv + h) * nb + j
                    k_host[u, : t1 - t0] = k[b, h, t0:t1].cpu()
                    v_host[u, : t1 - t0] = v[b, h, t0:t1].cpu()
                    loc[b, h, j] = -u - 1
                else:
                    loc[b, h, j] = slot
    if device == "cuda":
        k_host, v_host = k_host.pin_memory(), v_host.pin_memory()
    meta = block_metadata(k, lengths, bs)
    ref = progressive_attention(q, k, v, lengths, cfg)
    wa = WaveAttention.from_config(cfg).plan(B, q.shape[1], Hkv, d, nb, device)
    res = wa.run(
        q,
        kbuf,
        vbuf,
        loc.to(device),
        lengths,
        meta.mean,
        meta.kmin,
        meta.kmax,
        k_host=k_host if host_fraction else None,
        v_host=v_host if host_fraction else None,
        slot_strides=(bs * Hkv * d, Hkv * d, d),
    )
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("flags", [False, True], ids=["all_rows", "row_flags"])
@pytest.mark.parametrize("kept", [False, True], ids=["ranked", "kept"])
def test_wave_attention_reads_cached_units_from_their_slot_pages(device, kept, flags):
    """The tiered home's layout: SGLang's token-major pool, a head-major host tier holding
    the evicted blocks, and the unit cache: some host units also in pages of the pool, in
    this layer's buffer or another layer's (`unit_slot`, `cache_pages`, `cache_shift`).
    The host copies of cached units are garbage, and so is this layer's buffer where a
    unit sits in the other layer's, so the result equals the reference only if every
    cached unit is read from its position's page and layer;
    `stats[2]` counts the units read from the host. `kept`: with a selection kept across
    steps too (the tiered home's default), ranked fresh this step: the same reads, and each
    row's ranked read count lands in its own slot of the cache (a kernel whose unit-cache
    lookup reused the kept slot's name failed to compile on the GPU). `flags`: with the
    rows that have a block off HBM flagged (`row_host`, as the tiered home's step gives
    them), the first row having none: it reads with the HBM home's logic, the same."""
    from sgl_kernel_ext.selection import SelectionCache
    from sgl_kernel_ext.wave_attention import WaveAttention

    cfg = PSAConfig(threshold=0.9, **SMALL_WAVES)
    q, k, v, lengths = _case(11, device=device)
    B, Hkv, T, d = k.shape
    bs = cfg.block_size
    nb = -(-T // bs)
    g = torch.Generator().manual_seed(5)
    pages, kbuf, vbuf = _paged_pool(k, v, bs, g, device)
    extra = 40  # pages past the requests' for the cache slots
    first_free = kbuf.shape[0] // bs
    kbuf = torch.cat([kbuf, torch.zeros(extra * bs, Hkv, d, device=device)])
    vbuf = torch.cat([vbuf, torch.zeros(extra * bs, Hkv, d, device=device)])
    kbuf[first_free * bs :] = float("nan")
    vbuf[first_free * bs :] = float("nan")
    other_k = torch.full_like(kbuf, float("nan"))  # the other layer's buffers
    other_v = torch.full_like(vbuf, float("nan"))
    layer_k, layer_v = [kbuf, other_k], [vbuf, other_v]
    evicted = torch.rand(B, nb, generator=g) < 0.6
    if flags:
        evicted[0] = False  # a row with every block in HBM
    HB, C, L = B * nb, extra, 2
    k_host = torch.full((Hkv, HB, bs, d), float("nan"))
    v_host = torch.full_like(k_host, float("nan"))
    unit_slot = torch.full((Hkv, HB + 1), -1, dtype=torch.int32)
    cache_pages = torch.arange(first_free, first_free + C, dtype=torch.int32)
    in_other = 0
    loc = torch.empty(B, Hkv, nb, dtype=torch.int32)
    on_host = torch.zeros(B, Hkv, nb, dtype=torch.bool)  # read from the host tier
    free = [0] * Hkv
    for b in range(B):
        for j in range(nb):
            t0, t1 = j * bs, min((j + 1) * bs, T)
            hb = b * nb + j
            if not evicted[b, j]:
                loc[b, :, j] = int(pages[b, j])
                continue
            loc[b, :, j] = -hb - 1
            for h in range(Hkv):
                kk, vv = k[b, h, t0:t1].cpu(), v[b, h, t0:t1].cpu()
                if free[h] < C * L and torch.rand(1, generator=g) < 0.5:  # cached
                    pos = free[h]  # position: page slot pos // L, layer pos % L
                    free[h] += 1
                    unit_slot[h, hb] = pos
                    row = int(cache_pages[pos // L]) * bs
                    layer_k[pos % L][row : row + bs, h] = 0.0
                    layer_v[pos % L][row : row + bs, h] = 0.0
                    layer_k[pos % L][row : row + t1 - t0, h] = kk.to(device)
                    layer_v[pos % L][row : row + t1 - t0, h] = vv.to(device)
                    in_other += pos % L
                else:
                    k_host[h, hb].zero_()
                    v_host[h, hb].zero_()
                    k_host[h, hb, : t1 - t0], v_host[h, hb, : t1 - t0] = kk, vv
                    on_host[b, h, j] = True
    assert on_host.any() and (unit_slot >= 0).any() and in_other > 0
    shift = [
        torch.tensor([(b.data_ptr() - own.data_ptr()) // 4 for b in bufs], device=device)
        for own, bufs in ((kbuf, layer_k), (vbuf, layer_v))
    ]  # float32 buffers: 4 bytes an element
    if device == "cuda":
        k_host, v_host = k_host.pin_memory(), v_host.pin_memory()
    meta = block_metadata(k, lengths, bs)
    ref = progressive_attention(q, k, v, lengths, cfg)
    wa = WaveAttention.from_config(cfg).plan(B, q.shape[1], Hkv, d, nb, device)
    stats = torch.zeros(3, dtype=torch.int64, device=device)
    if kept:  # rows 5 and 2 of the request table, ranked this step into slots of their own
        cache = SelectionCache(1, B, Hkv, nb, 1000, bs, 2, device)
        cache.assign(torch.tensor([5, 2][:B], device=device), lengths,
                     torch.zeros(1, dtype=torch.int32, device=device))  # fmt: skip
        assert cache.rows(B)[1].tolist() == [1] * B and cache.rows(B)[0].tolist() != [B] * B
    res = wa.run(
        q,
        kbuf,
        vbuf,
        loc.to(device),
        lengths,
        meta.mean,
        meta.kmin,
        meta.kmax,
        k_host=k_host,
        v_host=v_host,
        slot_strides=(bs * Hkv * d, Hkv * d, d),
        host_strides=(bs * d, d, HB * bs * d),
        stats=stats,
        unit_slot=unit_slot.to(device),
        cache_pages=cache_pages.to(device),
        cache_shift=tuple(shift),
        kept=cache.kept(0, B) if kept else None,
        row_host=(loc < 0).flatten(1).any(1).int().to(device) if flags else None,
    )
    assert torch.equal(res.read_mask(), ref.read)
    torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)
    read = ref.read[..., :nb].cpu()
    assert int(stats[0]) == int(read.sum())
    assert int(stats[2]) == int((read & on_host).sum()) > 0
    if kept:
        slot = cache.rows(B)[0].long()
        _, n_forced = read_order(q.cpu(), block_metadata(k.cpu(), lengths.cpu(), bs),
                                 lengths.cpu(), cfg, d**-0.5)  # fmt: skip
        budget = read.sum(-1) - n_forced[:, None]  # the ranked blocks the rule read
        assert (budget > 0).all()
        assert torch.equal(cache.budget[0][slot].cpu().long(), budget)
        others = torch.ones(B + 1, dtype=torch.bool)
        others[slot.cpu()] = False
        assert (cache.budget[0][others.to(device)] == 0).all()  # no other slot written


# (B, G, Hkv, T, d, block size): a small case for the interpreter, and the GPU test model's
# and an 8B model's attention at 16K-20K tokens (> 512 blocks) on the GPU.
READER_SHAPES = {
    "small": (2, 7, 2, 300, 64, 16),
    "qwen05b": (2, 7, 2, 20_000, 64, 32),
    "llama8b": (2, 4, 8, 17_000, 128, 32),
}


def _reader_case(mode, shape, device, tiered=False):
    """Workload of the reader tests over SGLang's token-major pool, NaN in the rows past
    each request's length: the config, the top-k budget, the reference, the run's inputs
    (per-page metadata read through the page table) and the plan's shape. `tiered`: about
    a third of the first request's blocks live only in a host tier (head-major, as the
    tiered home's; their HBM pages hold NaN), the second's all in HBM, and the rows are
    flagged so (`row_host`)."""
    B, G, Hkv, T, d, bs = READER_SHAPES[shape]
    if shape != "small" and device == "cpu":
        pytest.skip("real shapes run compiled on the GPU (the interpreter takes too long)")
    small = SMALL_WAVES if shape == "small" else dict(bound_bits=16)
    cfg = PSAConfig(threshold=1.0 if mode != "psa" else 0.9, **{**small, "block_size": bs})
    q, k, v, lengths = _case(12, B=B, Hq=G * Hkv, Hkv=Hkv, T=T, d=d, spread=2.0, device=device)
    lengths[1] = T - bs - 3  # a partial last block
    nb = -(-T // bs)
    pages, kbuf, vbuf = _paged_pool(k, v, bs, torch.Generator().manual_seed(4), device)
    for b in range(B):  # stale rows of each request's last page
        tail = int(lengths[b]) % bs
        if tail:
            p = int(pages[b, (int(lengths[b]) - 1) // bs])
            kbuf[p * bs + tail : (p + 1) * bs] = float("nan")
            vbuf[p * bs + tail : (p + 1) * bs] = float("nan")
    loc = pages[:, None, :].expand(B, Hkv, nb).to(torch.int32).contiguous().to(device)
    host = {}
    if tiered:  # blocks of request 0 moved to the host tier
        moved = torch.nonzero(torch.rand(nb, generator=torch.Generator().manual_seed(6)) < 0.3)
        moved = moved[:, 0].tolist()
        k_host = torch.zeros(Hkv, len(moved), bs, d, dtype=kbuf.dtype)
        v_host = torch.zeros_like(k_host)
        for u, j in enumerate(moved):
            p = int(pages[0, j])
            k_host[:, u] = kbuf[p * bs : (p + 1) * bs].transpose(0, 1).cpu()
            v_host[:, u] = vbuf[p * bs : (p + 1) * bs].transpose(0, 1).cpu()
            kbuf[p * bs : (p + 1) * bs] = float("nan")  # only the host copy is right
            vbuf[p * bs : (p + 1) * bs] = float("nan")
            loc[0, :, j] = -u - 1
        if device == "cuda":
            k_host, v_host = k_host.pin_memory(), v_host.pin_memory()
        host = dict(
            k_host=k_host, v_host=v_host, host_strides=(bs * d, d, len(moved) * bs * d),
            row_host=torch.tensor([1] + [0] * (B - 1), dtype=torch.int32, device=device),
        )  # fmt: skip
    meta = block_metadata(k, lengths, bs)
    per_page = []  # the server's metadata: per page, read through the page table
    for src in (meta.mean, meta.kmin, meta.kmax):
        dst = torch.zeros(kbuf.shape[0] // bs, Hkv, d, dtype=src.dtype, device=device)
        dst[pages.long()] = src.transpose(1, 2)
        per_page.append(dst)
    budget = 9 if mode == "topk" else None
    if mode == "topk":
        from sglang_psa.algo import topk_attention

        ref = topk_attention(q, k, v, lengths, cfg.replace(topk_tokens=bs * budget))
    else:
        ref = progressive_attention(q, k, v, lengths, cfg)
    return SimpleNamespace(
        cfg=cfg, budget=budget, ref=ref, q=q, kbuf=kbuf, vbuf=vbuf, loc=loc, lengths=lengths,
        per_page=per_page, pages=pages.to(device), nb=nb, Hkv=Hkv, bs=bs, device=device,
        strides=(bs * Hkv * d, Hkv * d, d), host=host,
        on_host=(loc < 0)[:, 0].cpu(),
    )  # fmt: skip


def _reader_plan(c, **launch):
    """A plan of case `c` with these launch attributes, and fresh last-use stamps, read
    counters and step counter (7) for its runs."""
    from sgl_kernel_ext.wave_attention import WaveAttention

    wa = WaveAttention.from_config(c.cfg)
    for attr, value in launch.items():
        setattr(wa, attr, value)
    B, Hq, d = c.q.shape
    wa.plan(B, Hq, c.Hkv, d, c.nb, c.device, read_blocks=c.budget)
    stamps = torch.zeros(c.Hkv, c.kbuf.shape[0] // c.bs, dtype=torch.int32, device=c.device)
    stats = torch.zeros(3, dtype=torch.int64, device=c.device)
    step = torch.full((1,), 7, dtype=torch.int32, device=c.device)
    return wa, (stamps, stats, step)


def _reader_run(wa, c, book):
    stamps, stats, step = book
    return wa.run(
        c.q, c.kbuf, c.vbuf, c.loc, c.lengths, *c.per_page,
        max_read_blocks=c.budget, slot_strides=c.strides, meta_pages=c.pages,
        stamps=stamps, step=step, stats=stats, **c.host,
    )  # fmt: skip


@pytest.mark.parametrize("home", ["hbm", "tiered"])
@pytest.mark.parametrize("shape", list(READER_SHAPES))
@pytest.mark.parametrize("mode", ["psa", "topk", "dense"])
def test_descriptor_reads_equal_gather_reads(device, mode, shape, home):
    """Blocks read through tensor descriptors (one block a tile, copied whole from the slot)
    and by the per-row gather, each with its block ids (and pages) loaded with the tile or
    a tile ahead, over SGLang's token-major pool: the reference's blocks, output and
    log-mass, last-use stamps on exactly the pages of the blocks read, and the read
    counters. The rows past each request's length hold NaN: every reader must mask them.
    `tiered`: the first request's blocks partly on a host tier (their HBM pages NaN),
    the second request flagged as having none (read on the HBM home's code); the host
    blocks read are counted."""
    if shape != "small" and device == "cpu":
        pytest.skip("real shapes run compiled on the GPU (the interpreter takes too long)")
    c = _reader_case(mode, shape, device, tiered=home == "tiered")
    ref = c.ref
    # The stamps the reads must leave: step 7 on each (KV head, page) a block was read from.
    want = torch.zeros(c.Hkv, c.kbuf.shape[0] // c.bs, dtype=torch.int32)
    read = ref.read[..., : c.nb].cpu()
    for b in range(read.shape[0]):
        for h in range(c.Hkv):
            want[h, c.pages[b].cpu()[read[b, h]].long()] = 7
    for tma in (True, False):
        for prefetch in (True, False):
            wa, book = _reader_plan(c, tma=tma, prefetch=prefetch)
            if tma:
                assert wa._descriptors(c.kbuf, c.vbuf, c.strides) is not None, "no TMA"
            res = _reader_run(wa, c, book)
            case = f"tma={tma} prefetch={prefetch}"
            assert torch.equal(res.read_mask(), ref.read), case
            torch.testing.assert_close(res.out, ref.out.float(), atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(res.lse, ref.lse, atol=2e-4, rtol=2e-4)
            assert torch.equal(book[0].cpu(), want), case
            assert int(book[1][0]) == int(ref.read.sum()), case
            if c.host:  # the blocks read from the host tier (top-k's few may miss them)
                host_read = int((read & c.on_host[:, None]).sum())
                assert int(book[1][2]) == host_read and (host_read > 0 or mode == "topk"), case
