"""A selection kept across decode steps: the slot map kernel and the wave kernel reading a
kept order, against the PyTorch reference (`algo.selection`, `algo.attention.reuse_order`)."""

import random

import pytest
import torch

from sgl_kernel_ext.metadata import page_meta_from_locs
from sglang_psa.algo import block_metadata, progressive_attention, topk_attention
from sglang_psa.algo import selection as ref_sel
from sglang_psa.algo.attention import read_order, reuse_order
from sglang_psa.algo.criticality import criticality
from sglang_psa.config import PSAConfig


@pytest.fixture
def device(kernel_device):
    return kernel_device


def test_reuse_order_fresh_is_the_ranked_order():
    """With no block gained, the kept order is the order ranked now; a gained block is
    read among the forced ones, and every block is read exactly once."""
    cfg = PSAConfig(block_size=16, sink_blocks=1, recent_blocks=2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 340, 16, generator=g)
    lengths = torch.tensor([300, 170, 40])
    meta = block_metadata(k, lengths, 16)
    order, n_forced = read_order(q, meta, lengths, cfg, 0.25)
    nb = (lengths + 15) // 16
    same, nf = reuse_order(order, nb, lengths, cfg)
    assert torch.equal(same, order) and torch.equal(nf, n_forced)
    grown = lengths + torch.tensor([20, 1, 0])  # 300 -> 320 (+1 block), 170 -> 171 (+1)
    kept, nf2 = reuse_order(order, nb, grown, cfg)
    nb2 = (grown + 15) // 16
    for b in range(3):
        row = kept[b, 0, : int(nb2[b])]
        assert sorted(row.tolist()) == list(range(int(nb2[b])))
        f = int(nf2[b])
        assert set(row[:f].tolist()) == {0} | set(range(int(nb[b]) - 2, int(nb2[b])))
        assert row[f:].tolist() == order[b, 0, int(n_forced[b]) : int(nb[b])].tolist()


def _kernel_state(cache):
    return cache.tag.tolist(), cache.ranked.tolist()


def test_assign_matches_reference(device):
    """Batches that gain, lose and reorder requests over 60 steps: slot, fresh and nbr of
    every row, and the slots' tags and ranked sizes, equal the reference's."""
    from sgl_kernel_ext.selection import MAX_NEW_BLOCKS, SelectionCache

    assert MAX_NEW_BLOCKS == ref_sel.MAX_NEW_BLOCKS
    bs, max_batch, interval, short = 16, 12, 4, 2
    cache = SelectionCache(1, max_batch, 1, 64, interval, bs, short, device)
    state = ref_sel.SlotState([-1] * (max_batch + 1), [0] * (max_batch + 1))
    rnd = random.Random(1)
    live = {r: rnd.randint(1, 200) for r in rnd.sample(range(1, 40), 6)}
    step = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.zeros(2, dtype=torch.int64, device=device)
    ranked = slotted = 0
    for t in range(1, 61):
        if rnd.random() < 0.3 and len(live) < max_batch:  # a request joins (prefilled)
            r = rnd.choice([x for x in range(1, 40) if x not in live])
            live[r] = rnd.randint(1, 200)
            cache.invalidate(torch.tensor([r], device=device))
            ref_sel.invalidate(state, [r])
        if rnd.random() < 0.2 and len(live) > 1:  # one finishes
            live.pop(rnd.choice(list(live)))
        if rnd.random() < 0.05:  # a request jumps ahead by many blocks (e.g. resumed)
            r = rnd.choice(list(live))
            live[r] += 5 * bs
        for r in live:
            live[r] += 1
        rows = list(live)
        rnd.shuffle(rows)
        lengths = [live[r] for r in rows]
        pad = rnd.randint(
            0, min(2, max_batch - len(rows))
        )  # padding rows: row 0, length 1 (SGLang's fill value)
        rows, lengths = rows + [0] * pad, lengths + [1] * pad
        step.fill_(t)
        rows_t, lengths_t = torch.tensor(rows, device=device), torch.tensor(lengths, device=device)
        cache.assign(rows_t, lengths_t, step, counts=counts)
        want = ref_sel.assign_slots(state, rows, lengths, t, interval, short, bs)
        got = tuple(x.tolist() for x in cache.rows(len(rows)))
        assert got == want, f"step {t}"
        assert _kernel_state(cache) == (state.tag, state.ranked), f"step {t}"
        ranked += sum(want[1])  # rows that rank, and rows in a slot (not the scratch)
        slotted += sum(s < max_batch for s in want[0])
        assert counts.tolist() == [ranked, slotted], f"step {t}"
    assert 0 < ranked < slotted  # the interval's steps and the joins ranked, not every row


CFG = dict(
    block_size=16, wave_blocks=2, wave_growth=1.5, max_wave_blocks=8, bound_bits=16,
    wave_fraction=0.0, max_read_fraction=1.0, sink_blocks=1, recent_blocks=1,
)  # fmt: skip


def _paged(k, v, bs, device):
    """k, v `[B, Hkv, T, d]` as slots `[B * nb, bs, d]` per head, and the table `loc`."""
    B, Hkv, T, d = k.shape
    nb = -(-T // bs)
    pad = nb * bs - T
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad)).reshape(B * Hkv * nb, bs, d)
    vb = torch.nn.functional.pad(v, (0, 0, 0, pad)).reshape(B * Hkv * nb, bs, d)
    loc = torch.arange(B * Hkv * nb, dtype=torch.int32).view(B, Hkv, nb)
    return kb.to(device), vb.to(device), loc.to(device)


# (B, Hq, Hkv, T, d, block size, first lengths): a small case for the interpreter, and the
# GPU test model's and an 8B model's attention at 16K-20K tokens (> 512 blocks) on the GPU.
SHAPES = {
    "small": (3, 8, 2, 400, 16, 16, [380, 250, 300]),
    "qwen05b": (2, 14, 2, 20_512, 64, 32, [20_478, 16_384]),
    "llama8b": (2, 32, 8, 17_000, 128, 32, [16_990, 16_400]),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", ["psa", "topk"])
def test_wave_reads_kept_order(device, mode, shape):
    """Step 1 ranks (fresh) into the slots; step 2, longer by a block and with new
    queries, reads the kept order: blocks, output and log-mass equal the reference given
    the same kept order (`progressive_attention`/`topk_attention(prior=...)`). psa's
    step 1 leaves each (request, KV head)'s ranked read count in the cache; step 2 reads
    that many ranked blocks in one wave, no stop rule."""
    from sgl_kernel_ext.selection import SelectionCache
    from sgl_kernel_ext.wave_attention import WaveAttention

    B, Hq, Hkv, T, d, bs, first = SHAPES[shape]
    if shape != "small" and device == "cpu":
        pytest.skip("real shapes run compiled on the GPU (the interpreter takes too long)")
    small = dict(CFG, block_size=bs) if shape == "small" else dict(bound_bits=16)
    cfg = PSAConfig(sparse_mode=mode, threshold=0.9, topk_tokens=6 * bs, **small)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(B, Hkv, T, d, generator=g) * 1.5
    v = torch.randn(B, Hkv, T, d, generator=g)
    len1 = torch.tensor(first)
    len2 = len1 + torch.tensor([5, 17, 1][:B])  # +1 block for the first two
    nb_max = -(-T // bs)
    topk = mode == "topk"
    wa = WaveAttention.from_config(cfg.replace(threshold=1.0) if topk else cfg)
    wa = wa.plan(B, Hq, Hkv, d, nb_max, device, read_blocks=cfg.topk_tokens // bs if topk else None)
    cache = SelectionCache(1, B, Hkv, nb_max, 1000, bs, 2, device)
    rows = torch.tensor([5, 2, 9][:B], device=device)
    k_slots, v_slots, loc = _paged(k, v, bs, device)
    max_read = cfg.topk_tokens // bs if topk else None
    orders = []
    for step, lengths in ((0, len1), (1, len2)):
        q = torch.randn(B, Hq, d, generator=g) * 1.5
        meta = block_metadata(k, lengths, bs)
        cache.assign(rows, lengths.to(device), torch.tensor([step], device=device))
        slot, fresh, nbr = cache.rows(B)
        assert fresh.tolist() == [int(step == 0)] * B
        res = wa.run(
            q.to(device), k_slots, v_slots, loc, lengths.to(device),
            meta.mean.to(device), meta.kmin.to(device), meta.kmax.to(device),
            max_read_blocks=max_read, kept=cache.kept(0, B),
        )  # fmt: skip
        if step == 0:
            kept = cache.order[0][slot.long()].cpu()
            ref_order, n_forced = read_order(q, meta, lengths, cfg, d**-0.5)
            crit = criticality(q, meta, d**-0.5, cfg.score)
            nbs = (lengths + bs - 1) // bs
            for b in range(B):  # the kernel's ranking is the reference's ...
                n, f = int(nbs[b]), int(n_forced[b])
                if shape == "small":
                    assert torch.equal(kept[b, :, :n], ref_order[b, :, :n])
                    continue
                # ... up to near-ties at real shapes (the GPU's scores round otherwise):
                # the forced blocks first, then every block once, by non-increasing
                # reference criticality within rounding.
                assert torch.equal(kept[b, :, :f], ref_order[b, :, :f])
                assert torch.equal(kept[b, :, :n].sort(-1).values, torch.arange(n).expand(Hkv, n))
                c = crit[b].gather(-1, kept[b, :, f:n].long())
                tol = 1e-3 * (1 + c.abs().amax())
                assert (c[:, 1:] <= c[:, :-1] + tol).all(), shape
            fn = (lambda *a, **kw: topk_attention(*a, **kw)) if topk else progressive_attention
            # The reference reading the kernel's ranking (the same order, checked above;
            # at real shapes near-ties may sit otherwise): a kept order ranked now.
            ref = fn(q, k, v, lengths, cfg, prior=(kept, nbs))
            budget = ref.read.sum(-1) - n_forced[:, None]  # ranked blocks the rule read
            if not topk:
                kept_n = cache.budget[0][slot.long()].cpu().long()
                assert torch.equal(kept_n, budget)
                assert (budget > 0).any() and (ref.n_waves > 1).any(), "a case the rule stops"
            orders.append((kept, nbs, budget))
        else:
            assert nbr.tolist() == orders[0][1].tolist()
            kept, nbs, budget = orders[0]
            if topk:
                ref = topk_attention(q, k, v, lengths, cfg, prior=(kept, nbs))
            else:
                ref = progressive_attention(q, k, v, lengths, cfg, prior=(kept, nbs, budget))
                assert (res.n_waves.cpu() == 1).all()
                # The forced blocks (one gained) and the kept budget, not the stop rule's.
                nb2, nbr = (lengths + bs - 1) // bs, nbs
                n_sink = nbr.clamp(max=cfg.sink_blocks)
                n_f = n_sink + nb2 - torch.maximum(n_sink, nbr - cfg.recent_blocks)
                assert torch.equal(res.n_read.cpu().long(), n_f[:, None] + budget)
        n_read = res.n_read.cpu()
        assert torch.equal(n_read.long(), ref.read.sum(-1)), f"step {step}"
        torch.testing.assert_close(res.out.cpu(), ref.out.float(), atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(res.lse.cpu(), ref.lse, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("home", ["hbm", "tiered"])
@pytest.mark.parametrize("kept_split", [True, False], ids=["own_launch", "one_launch"])
@pytest.mark.parametrize("shape", ["small", "qwen05b"])
@pytest.mark.parametrize("mode", ["psa", "topk"])
def test_fresh_and_kept_rows_in_one_run(device, mode, shape, kept_split, home):
    """One step where a request new to the cache ranks while the others read their kept
    order: the kept rows' launch (on a side stream on the GPU) and the fresh rows' launch
    each give their rows what the reference gives a row of that kind: the fresh row the
    order ranked now, under the stop rule (psa) or at top-k's budget; the kept rows the
    order and, for psa, the ranked read count kept at step 0. `one_launch`
    (`kept_split=False`): top-k's rows all in one launch, the same result (psa's kept rows
    keep their own launch). The step's new keys (`new_keys`, in an SGLang-layout pool of
    their own here) get their pages' metadata whichever launch writes them: the fresh
    row's before its ranking, the kept rows' in their launch (NEWMETA) where they have
    one; no other page is written. `tiered`: a third of request 1's blocks (a kept row at
    step 1) live only in a host tier (their HBM slots NaN) and the step's row flags say so:
    that row reads in the launches compiled with the host tier, the others in the HBM
    home's; on the GPU that step is also captured in a CUDA graph and replayed, and run
    eagerly again, neither doing a host sync (`torch.cuda.set_sync_debug_mode("error")`)."""
    from sgl_kernel_ext.selection import SelectionCache
    from sgl_kernel_ext.wave_attention import WaveAttention

    B, Hq, Hkv, T, d, bs, first = SHAPES[shape]
    if shape != "small" and device == "cpu":
        pytest.skip("real shapes run compiled on the GPU (the interpreter takes too long)")
    small = dict(CFG, block_size=bs) if shape == "small" else dict(bound_bits=16)
    cfg = PSAConfig(sparse_mode=mode, threshold=0.9, topk_tokens=6 * bs, **small)
    topk = mode == "topk"
    g = torch.Generator().manual_seed(5)
    k = torch.randn(B, Hkv, T, d, generator=g) * 1.5
    v = torch.randn(B, Hkv, T, d, generator=g)
    len1 = torch.tensor(first)
    len2 = len1 + torch.tensor([5, 17, 1][:B])
    nb_max = -(-T // bs)
    max_read = cfg.topk_tokens // bs if topk else None
    wa = WaveAttention.from_config(cfg.replace(threshold=1.0) if topk else cfg)
    wa = wa.plan(B, Hq, Hkv, d, nb_max, device, read_blocks=max_read)
    wa.kept_split = kept_split
    cache = SelectionCache(1, B, Hkv, nb_max, 1000, bs, 2, device)
    k_slots, v_slots, loc = _paged(k, v, bs, device)
    host = {}
    if home == "tiered":  # blocks of request 1 moved to a host tier (head-major units)
        nb1 = -(-int(len1[1]) // bs)
        moved = [j for j in range(nb1) if j % 3]
        k_host = torch.zeros(Hkv, len(moved), bs, d)
        v_host = torch.zeros_like(k_host)
        for u, j in enumerate(moved):
            for h in range(Hkv):
                slot = int(loc[1, h, j])
                k_host[h, u], v_host[h, u] = k_slots[slot].cpu(), v_slots[slot].cpu()
                k_slots[slot] = float("nan")  # only the host copy is right
                v_slots[slot] = float("nan")
            loc[1, :, j] = -u - 1
        if device == "cuda":
            k_host, v_host = k_host.pin_memory(), v_host.pin_memory()
        flags = torch.tensor([0, 1, 0][:B], dtype=torch.int32, device=device)
        host = dict(k_host=k_host, v_host=v_host, row_host=flags,
                    host_strides=(bs * d, d, len(moved) * bs * d),
                    stats=torch.zeros(3, dtype=torch.int64, device=device))  # fmt: skip
    step = torch.zeros(1, dtype=torch.int32, device=device)
    # The new keys: one per row, in pages of a token-major pool (page 0: SGLang's padding).
    P = 4 * B + 1
    pool = (torch.randn(P * bs, Hkv, d, generator=g) * 1.5).to(device)
    new_locs = torch.tensor([(4 * b + 2) * bs + (3 * b) % bs for b in range(B)], device=device)
    fill = lambda: torch.full((P, Hkv, d), 7.0, device=device)  # noqa: E731
    nk_meta = (fill(), fill(), fill())

    def run(rows, lengths, q, new_keys=None):
        meta = block_metadata(k, lengths, bs)
        cache.assign(torch.tensor(rows, device=device), lengths.to(device), step)
        res = wa.run(
            q.to(device), k_slots, v_slots, loc, lengths.to(device),
            meta.mean.to(device), meta.kmin.to(device), meta.kmax.to(device),
            max_read_blocks=max_read, kept=cache.kept(0, B), new_keys=new_keys, **host,
        )  # fmt: skip
        return [t.cpu() for t in cache.rows(B)], res

    run([5, 2, 9][:B], len1, torch.randn(B, Hq, d, generator=g) * 1.5)
    (slot0, _, _) = cache.rows(B)
    kept0 = cache.order[0][slot0.long()].cpu()  # every row ranked at step 0
    budget0 = cache.budget[0][slot0.long()].cpu().long()
    nbs0 = (len1 + bs - 1) // bs
    step.fill_(1)
    q = torch.randn(B, Hq, d, generator=g) * 1.5
    (slot, fresh, nbr), res = run(  # request 0 is new: it ranks
        [7, 2, 9][:B], len2, q, new_keys=(pool, new_locs, *nk_meta, None)
    )
    assert fresh.tolist() == [1] + [0] * (B - 1)
    want = (fill(), fill(), fill())
    page_meta_from_locs(pool, new_locs, bs, *want)  # every row's new key, one launch
    torch.testing.assert_close(nk_meta[0].cpu(), want[0].cpu(), rtol=1e-6, atol=1e-6)
    for got, ref in zip(nk_meta[1:], want[1:]):  # the bounds: exact
        assert torch.equal(got.cpu(), ref.cpu())
    assert {int(x) // bs for x in new_locs} == set(range(2, P, 4))  # (others stay at 7)
    assert (nk_meta[0][1].cpu() == 7.0).all()
    assert nbr[1:].tolist() == nbs0[1:].tolist()
    nbs = (len2 + bs - 1) // bs
    now = cache.order[0][slot.long()].cpu()  # the fresh row's order ranked this step
    if shape == "small":  # the kernel's ranking is the reference's
        ref_order, _ = read_order(q, block_metadata(k, len2, bs), len2, cfg, d**-0.5)
        n0 = int(nbs[0])
        assert torch.equal(now[0, :, :n0], ref_order[0, :, :n0])
    fn = topk_attention if topk else progressive_attention
    ref_fresh = fn(q, k, v, len2, cfg, prior=(now, nbs))
    prior = (kept0, nbs0) if topk else (kept0, nbs0, budget0)
    ref_kept = fn(q, k, v, len2, cfg, prior=prior)
    out = torch.cat([ref_fresh.out[:1], ref_kept.out[1:]]).float()
    lse = torch.cat([ref_fresh.lse[:1], ref_kept.lse[1:]])
    n_read = torch.cat([ref_fresh.read[:1], ref_kept.read[1:]]).sum(-1)
    assert torch.equal(res.n_read.cpu().long(), n_read)
    if host:  # both steps read host units (request 1's: flagged)
        assert int(host["stats"][2]) > 0
    if topk:  # the fixed budget, whether ranked now or kept
        assert (n_read <= max_read).all() and (n_read == max_read).any()
    torch.testing.assert_close(res.out.cpu(), out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(res.lse.cpu(), lse, atol=2e-4, rtol=2e-4)
    if not topk:  # the fresh row left its ranked read count for the steps after
        _, n_forced = read_order(q, block_metadata(k, len2, bs), len2, cfg, d**-0.5)
        left = cache.budget[0][int(slot[0])].cpu().long()
        assert torch.equal(left, ref_fresh.read[0].sum(-1) - n_forced[0])
    if home == "tiered" and device == "cuda":
        # The same step captured in a CUDA graph (the flagged rows' launches, the kept row
        # 1's, on a stream of their own, joined before the output): replayed, every row
        # reads again what it read.
        want = out.to(device)
        meta = block_metadata(k, len2, bs)
        args = (q.to(device), k_slots, v_slots, loc, len2.to(device), meta.mean.to(device),
                meta.kmin.to(device), meta.kmax.to(device))  # fmt: skip
        views = cache.kept(0, B)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = wa.run(*args, max_read_blocks=max_read, kept=views,
                         new_keys=(pool, new_locs, *nk_meta, None), **host)  # fmt: skip
        # The step eagerly (it writes what the replay writes: the same step, state and
        # query; its output copied, the plan's buffers being the graph's) and the replay,
        # with any host sync an error (the decode step is sacred).
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = wa.run(*args, max_read_blocks=max_read, kept=views,
                           new_keys=(pool, new_locs, *nk_meta, None), **host).out.clone()  # fmt: skip
            got.out.fill_(float("nan"))
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        torch.testing.assert_close(eager, want, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got.out, want, atol=2e-4, rtol=2e-4)
