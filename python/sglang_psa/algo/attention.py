"""Reference decode attention: dense, progressive sparse (PSA) and top-k.

This is the specification the Triton kernels are tested against, written for
clarity over speed. Shapes: `q [B, Hq, d]` (one decode token per request),
`k, v [B, Hkv, T, d]` padded past `lengths [B]`. Every sparse function returns
the output and the exact set of blocks it read, so KV traffic can be counted.

Exact scores and per-block masses are computed for every block up front; the
selection logic only ever looks at the masses of blocks it has already chosen
to read (plus metadata), and the output is a softmax over exactly the read
tokens, so the result is identical to reading blocks one wave at a time and
merging (output, max, sum) states as flash-decoding does.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from sglang_psa.algo.criticality import bound_logits, criticality, criticality_from_logits
from sglang_psa.algo.metadata import BlockMeta, as_kept, block_metadata, num_blocks
from sglang_psa.algo.token_bounds import encode_keys, token_score_bounds
from sglang_psa.config import PSAConfig


class SparseResult(NamedTuple):
    out: torch.Tensor  # [B, Hq, d], dtype of q
    read: torch.Tensor  # [B, Hkv, NB] bool: blocks whose K/V were read
    lse: torch.Tensor  # [B, Hq] float32: log of the attended (unnormalised) mass
    n_waves: torch.Tensor  # [B, Hkv] int64: waves run (0 for top-k)


def _default_scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def token_scores(
    q: torch.Tensor, k: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """`scale * q . k` for every key, `[B, Hq, T]` float32, -inf past each length."""
    B, Hq, d = q.shape
    Hkv, T = k.shape[1], k.shape[2]
    qg = q.float().view(B, Hkv, Hq // Hkv, d)
    s = torch.einsum("bhgd,bhtd->bhgt", qg, k.float()).flatten(1, 2) * scale
    pad = torch.arange(T, device=k.device)[None, :] >= lengths[:, None]
    return s.masked_fill(pad[:, None, :], -torch.inf)


def block_lse(scores: torch.Tensor, block_size: int) -> torch.Tensor:
    """Log of each block's unnormalised softmax mass, `[B, Hq, NB]` (-inf if empty)."""
    B, Hq, T = scores.shape
    nb = (T + block_size - 1) // block_size
    s = torch.nn.functional.pad(scores, (0, nb * block_size - T), value=-torch.inf)
    return torch.logsumexp(s.view(B, Hq, nb, block_size), dim=-1)


def attend(
    scores: torch.Tensor, v: torch.Tensor, read: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the tokens of the read blocks only.

    `read [B, Hkv, NB]`; returns the output `[B, Hq, d]` (float32) and the log of
    the attended mass `[B, Hq]`. Equal to merging per-block partial states.
    """
    B, Hq, T = scores.shape
    Hkv = v.shape[1]
    tok_read = read.repeat_interleave(block_size, dim=-1)[..., :T]  # [B, Hkv, T]
    s = scores.view(B, Hkv, Hq // Hkv, T).masked_fill(~tok_read[:, :, None, :], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    out = torch.einsum("bhgt,bhtd->bhgd", p, v.float())
    return out.flatten(1, 2), lse.flatten(1, 2)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Plain softmax attention over each request's `lengths[b]` keys."""
    scores = token_scores(q, k, lengths, _default_scale(q, scale))
    p = torch.softmax(scores, dim=-1)
    B, Hq, T = p.shape
    out = torch.einsum("bhgt,bhtd->bhgd", p.view(B, k.shape[1], -1, T), v.float())
    return out.flatten(1, 2).to(q.dtype)


def stop_limit(threshold: float) -> float:
    """The stop rule's bound on log(uncovered / covered) for ε = `threshold` (-inf at 1)."""
    return math.log((1.0 - threshold) / threshold) if threshold < 1.0 else -math.inf


def forced_blocks(lengths: torch.Tensor, nb: int, cfg: PSAConfig) -> torch.Tensor:
    """`[B, NB]` bool: the sink blocks and the recent (tail) blocks, always read."""
    idx = torch.arange(nb, device=lengths.device)[None, :]
    nblk = num_blocks(lengths, cfg.block_size)[:, None]
    valid = idx < nblk
    return valid & ((idx < cfg.sink_blocks) | (idx >= nblk - cfg.recent_blocks))


def read_order(
    q: torch.Tensor, meta: BlockMeta, lengths: torch.Tensor, cfg: PSAConfig, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read order per (request, KV head): forced blocks first, then by criticality.

    Returns `order [B, Hkv, NB]` (block indices; empty blocks last) and
    `n_forced [B]`.
    """
    return order_blocks(criticality(q, meta, scale, cfg.score), lengths, cfg)


def order_blocks(
    crit: torch.Tensor, lengths: torch.Tensor, cfg: PSAConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forced blocks first (in block order), then by criticality `[B, Hkv, NB]`."""
    forced = forced_blocks(lengths, crit.shape[-1], cfg)
    key = torch.where(forced.unsqueeze(1), torch.inf, crit)
    # Ties (and the forced +inf) are broken by block index, so the order is deterministic.
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    return order, forced.sum(-1)


def reuse_order(
    order: torch.Tensor, ranked_blocks: torch.Tensor, lengths: torch.Tensor, cfg: PSAConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """The read order of a selection kept across decode steps (`--psa-rerank-interval`).

    `order [B, Hkv, NB]` was ranked (`order_blocks`) when each request had
    `ranked_blocks [B]` blocks; it has `lengths` tokens now. Forced: the sink blocks and
    every block from the tail block at ranking time on (so blocks gained since are
    read); then the kept order's ranked blocks; then the empty blocks. Returns the
    order and the forced counts `[B]`, as `order_blocks` does (equal to it when no
    block was gained and the order is fresh).
    """
    B, Hkv, NB = order.shape
    nblk = num_blocks(lengths, cfg.block_size).tolist()
    out = torch.empty_like(order)
    n_forced = torch.empty(B, dtype=torch.long, device=order.device)
    for b, (nb, nbr) in enumerate(zip(nblk, ranked_blocks.tolist())):
        if not 0 <= nbr <= nb:
            raise ValueError(f"request {b}: ranked at {nbr} blocks, has {nb}")
        n_sink = min(cfg.sink_blocks, nbr)
        tail0 = max(n_sink, nbr - cfg.recent_blocks)
        forced = torch.cat([torch.arange(n_sink), torch.arange(tail0, nb)]).to(order.device)
        rest = torch.arange(nb, NB, device=order.device)
        n_forced[b] = forced.numel()
        for h in range(Hkv):
            kept = order[b, h, n_sink + nbr - tail0 : nbr]
            out[b, h] = torch.cat([forced, kept, rest])
    return out, n_forced


def _wave_checkpoints(
    nblk: torch.Tensor, n_forced: torch.Tensor, nb: int, cfg: PSAConfig
) -> torch.Tensor:
    """`[B, NB]` bool: read-order positions after which a wave ends and is verified
    (each request's first wave is `cfg.first_wave` of its own blocks)."""
    pos = torch.arange(nb, device=nblk.device)[None, :]
    ranked_done = pos + 1 - n_forced[:, None]
    firsts = [cfg.first_wave(int(n)) for n in nblk.tolist()]
    ends = {f: torch.tensor(cfg.wave_sizes(nb, f), device=nblk.device).cumsum(0) for f in firsts}
    at_end = torch.zeros_like(ranked_done, dtype=torch.bool)
    for i, f in enumerate(firsts):
        at_end[i] = torch.isin(ranked_done[i], ends[f])
    at_end &= ranked_done > 0
    return (at_end | (pos + 1 == nblk[:, None])) & (pos < nblk[:, None])


def read_cap(nblk: torch.Tensor, cfg: PSAConfig) -> torch.Tensor:
    """`[B]` most blocks each request's KV heads read under `cfg.max_read_fraction` (the
    heuristic rule only): the ceiling of the float32 product, as the kernel computes it
    (the forced blocks are read whatever it says)."""
    f = torch.tensor(cfg.max_read_fraction, dtype=torch.float32, device=nblk.device)
    return torch.ceil(nblk.to(torch.float32) * f).long()


def _unsort(order: torch.Tensor, read_sorted: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Read mask by block index from one by read-order position; empty blocks never read."""
    read = torch.zeros_like(read_sorted).scatter(-1, order, read_sorted)
    return read & valid[:, None, :]


def progressive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    cfg: PSAConfig,
    meta: BlockMeta | None = None,
    scale: float | None = None,
    threshold: torch.Tensor | None = None,
    cap_tokens: torch.Tensor | None = None,
    code_bits: int = 0,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SparseResult:
    """PSA: read blocks wave by wave in criticality order until the covered mass passes ε.

    A (request, KV head) stops after the first wave at which every query head of
    its group satisfies the stop rule:
    - `heuristic` (the PSA paper): uncovered mass ≈ smallest ranked block mass
      read so far × blocks left;
    - `certified`: uncovered mass ≤ Σ over unread blocks of count × exp(bound),
      with the bound from the block's key min/max, so ≥ ε of the true mass is
      covered for every query head.
    Stop when uncovered / covered ≤ (1 - ε) / ε, evaluated in log space so that
    ε = 1 reads everything (dense attention).

    `code_bits` > 0 (certified rule only; `--psa-code-bits` in the server): the unread mass
    is bounded token by token from `code_bits`-bit key codes in each block's own key
    range (`token_bounds`; their bytes count as read for every block), blocks are ranked
    by that bounded mass, and the rule is evaluated in float64, so the guarantee holds
    for the float32 scores the output is computed from.

    `prior = (order, ranked_blocks)`: read in the order kept from an earlier step
    (`reuse_order`) instead of ranking now. `prior = (order, ranked_blocks, budget)`
    (`budget [B, Hkv]`: the ranked blocks the rule read when the order was ranked): no
    stop rule; each (request, KV head) reads its forced blocks and `budget` ranked ones
    in one wave (`--psa-rerank-interval`'s steps between rankings).

    `meta`: the exact block summaries (default: from `k`); with `cfg.bound_bits` 8 the
    bounds are read back from their 8-bit codes (`as_kept`), as the kernels read them.

    Per request (`[B]` tensors, for evaluating several policies in one batch):
    `threshold` replaces `cfg.threshold` as ε; `cap_tokens` caps the blocks read at
    `cap_tokens // block_size` (never below the forced ones; 0 or less: no cap), as
    if the last wave ended there. `cfg.max_read_fraction` caps them the same way at that
    share of each request's blocks (`read_cap`) under the heuristic rule with ε < 1.
    """
    scale = _default_scale(q, scale)
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    bs = cfg.block_size
    exact = block_metadata(k, lengths, bs) if meta is None else meta
    meta = as_kept(exact, cfg)
    nb = meta.count.shape[1]
    nblk = num_blocks(lengths, bs)
    scores = token_scores(q, k, lengths, scale)
    if code_bits:
        if cfg.stop_rule != "certified":
            raise ValueError("code_bits bound the unread mass of the certified rule only")
        # The cells cut each block's own key range (what the server keeps beside a page).
        codes = encode_keys(k, lengths, exact.kmin.float(), exact.kmax.float(), bs, code_bits)
        code_ub = block_lse(token_score_bounds(q, codes, lengths, scale).double(), bs)
        order, n_forced = order_blocks(criticality_from_logits(code_ub.float(), Hkv), lengths, cfg)
    elif prior is not None:
        order, n_forced = reuse_order(*prior[:2], lengths, cfg)
    else:
        order, n_forced = read_order(q, meta, lengths, cfg, scale)
    order_q = order.repeat_interleave(G, dim=1)  # [B, Hq, NB]

    # Block masses in read order (float64 where the rule certifies them).
    lse_o = block_lse(scores.double() if code_bits else scores, bs).gather(-1, order_q)
    covered = torch.logcumsumexp(lse_o, dim=-1)
    pos = torch.arange(nb, device=q.device)
    if cfg.stop_rule == "heuristic":
        is_ranked = (pos[None, :] >= n_forced[:, None])[:, None, :]
        smallest = torch.cummin(lse_o.masked_fill(~is_ranked, torch.inf), dim=-1).values
        n_left = (nblk[:, None] - pos[None, :] - 1).clamp(min=0).float()
        uncovered = smallest + n_left.log()[:, None, :]
        # Before any ranked block is read there is no estimate: not done.
        uncovered = torch.where(
            torch.isinf(smallest) & (n_left[:, None, :] > 0), torch.inf, uncovered
        )
    else:
        if code_bits:
            ub = code_ub.gather(-1, order_q)
        else:
            ub = bound_logits(q, meta, scale) + meta.count.clamp(min=1).log()[:, None, :]
            ub = ub.masked_fill((meta.count == 0)[:, None, :], -torch.inf).gather(-1, order_q)
        # Mass bound of the blocks after position p: reverse cumulative logsumexp, shifted.
        tail = torch.logcumsumexp(ub.flip(-1), dim=-1).flip(-1)
        uncovered = torch.cat([tail[..., 1:], torch.full_like(tail[..., :1], -torch.inf)], -1)

    if threshold is None:
        limit = stop_limit(cfg.threshold)
    else:
        t = threshold.to(device=q.device, dtype=torch.float64)
        limit = torch.where(t < 1.0, torch.log((1.0 - t) / t), -torch.inf).to(covered.dtype)
        limit = limit[:, None, None]
    ok = (uncovered - covered) <= limit  # -inf - finite = -inf <= -inf holds
    ok_group = ok.view(B, Hkv, G, nb).all(2)
    checks = _wave_checkpoints(nblk, n_forced, nb, cfg)
    stop = ok_group & checks[:, None, :]
    # First verified position that satisfies the rule; the last block always does.
    first = torch.where(stop, pos, nb).amin(-1)
    n_read = (first + 1).clamp(max=nb)
    # The share cap bounds the heuristic rule with ε < 1 only: ε = 1 reads everything
    # (dense), and the certified rule's guarantee would not survive a cap.
    eps = torch.as_tensor(cfg.threshold if threshold is None else threshold, device=q.device)
    capped_rows = (eps < 1.0) & (cfg.stop_rule == "heuristic")
    cap = torch.where(capped_rows, read_cap(nblk, cfg), nb)
    if cap_tokens is not None:
        cap_tokens = cap_tokens.to(q.device)
        cap = torch.minimum(cap, torch.where(cap_tokens > 0, cap_tokens // bs, nb).clamp(min=1))
    capped = cap_tokens is not None or cfg.max_read_fraction < 1
    if capped:
        n_read = torch.minimum(n_read, torch.maximum(cap, n_forced)[:, None])
    budget = prior[2] if prior is not None and len(prior) > 2 else None
    if budget is not None:  # a kept selection at its kept read count: one wave, no rule
        n_read = n_forced[:, None] + budget.to(n_forced.device).long().clamp(min=0)
        n_read = torch.minimum(n_read, nblk[:, None])
    read_sorted = pos[None, None, :] < n_read[..., None]
    read = _unsort(order, read_sorted, meta.count > 0)
    if budget is not None:
        n_waves = (nblk > 0)[:, None].long().expand_as(n_read)
    else:
        n_waves = (checks[:, None, :] & read_sorted).sum(-1)
        if capped:  # a wave the cap cut short counts too
            last = checks[:, None, :].expand_as(read_sorted).gather(-1, (n_read - 1)[..., None])
            n_waves = n_waves + (~last[..., 0]).long()
    out, lse = attend(scores, v, read, bs)
    return SparseResult(out.to(q.dtype), read, lse, n_waves)


def topk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    cfg: PSAConfig,
    budget_tokens: int | torch.Tensor | None = None,
    meta: BlockMeta | None = None,
    scale: float | None = None,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SparseResult:
    """Quest-style baseline: read a fixed budget of blocks (forced ones included).

    `cfg.score` picks the ranking: `bound` is Quest's key min/max bound, `mean`
    the cuboid mean. `budget_tokens` (default `cfg.topk_tokens`) may be a `[B]`
    tensor: one budget per request. `prior`: a kept order, as `progressive_attention`.
    """
    scale = _default_scale(q, scale)
    bs = cfg.block_size
    budget = cfg.topk_tokens if budget_tokens is None else budget_tokens
    meta = as_kept(block_metadata(k, lengths, bs) if meta is None else meta, cfg)
    nb = meta.count.shape[1]
    if prior is not None:
        order, n_forced = reuse_order(*prior, lengths, cfg)
    else:
        order, n_forced = read_order(q, meta, lengths, cfg, scale)
    budget = torch.as_tensor(budget, device=q.device).expand(n_forced.shape)
    k_blocks = torch.maximum((budget // bs).clamp(min=1), n_forced)
    pos = torch.arange(nb, device=q.device)
    read_sorted = (pos[None, :] < k_blocks[:, None])[:, None, :].expand_as(order)
    read = _unsort(order, read_sorted, meta.count > 0)
    out, lse = attend(token_scores(q, k, lengths, scale), v, read, bs)
    return SparseResult(out.to(q.dtype), read, lse, torch.zeros_like(order[..., 0]))


def true_coverage(
    q: torch.Tensor,
    k: torch.Tensor,
    lengths: torch.Tensor,
    read: torch.Tensor,
    block_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Fraction of each query head's true softmax mass inside the read blocks: `[B, Hq]`
    (`k [B, Hkv, T, d]`, `read [B, Hkv, NB]` with NB * block_size >= T)."""
    return read_share(token_scores(q, k, lengths, _default_scale(q, scale)), read, block_size)


def read_share(scores: torch.Tensor, read: torch.Tensor, block_size: int) -> torch.Tensor:
    """Share of each query head's softmax mass over `scores [B, Hq, T]` (-inf: no key)
    that the blocks `read [B, Hkv, NB]` hold, `[B, Hq]` float32. No host sync."""
    B, Hq, T = scores.shape
    tok = read.repeat_interleave(block_size, dim=-1)[..., :T]  # [B, Hkv, T]
    tok = tok.repeat_interleave(Hq // read.shape[1], dim=1)
    covered = torch.logsumexp(scores.masked_fill(~tok, -torch.inf), dim=-1)
    return torch.exp(covered - torch.logsumexp(scores, dim=-1))


def oracle_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    cfg: PSAConfig,
    scale: float | None = None,
) -> SparseResult:
    """The fewest blocks any ranking could read: blocks by their *true* mass share.

    A lower bound for analysis, not an algorithm (it reads every key to rank):
    per (request, KV head), forced blocks first, then blocks by the group's max
    true share, stopping at the first prefix where every query head of the group
    covers ≥ ε of its softmax mass (one block at a time, no waves).
    """
    scale = _default_scale(q, scale)
    B, Hq, _ = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    bs = cfg.block_size
    scores = token_scores(q, k, lengths, scale)
    lse_b = block_lse(scores, bs)
    nb = lse_b.shape[-1]
    share = (lse_b - torch.logsumexp(lse_b, -1, keepdim=True)).view(B, Hkv, G, nb).amax(2)
    forced = forced_blocks(lengths, nb, cfg)
    key = torch.where(forced[:, None, :], torch.inf, share)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    lse_o = lse_b.gather(-1, order.repeat_interleave(G, dim=1))
    cov = torch.logcumsumexp(lse_o, -1) - torch.logsumexp(lse_b, -1, keepdim=True)
    ok = (cov >= math.log(cfg.threshold) - 1e-6).view(B, Hkv, G, nb).all(2)
    pos = torch.arange(nb, device=q.device)
    first = torch.where(ok & (pos >= forced.sum(-1)[:, None, None] - 1), pos, nb - 1).amin(-1)
    read_sorted = pos[None, None, :] <= first[..., None]
    read = _unsort(order, read_sorted, num_blocks(lengths, bs)[:, None] > pos)
    out, lse = attend(scores, v, read, bs)
    return SparseResult(out.to(q.dtype), read, lse, torch.zeros_like(first))
