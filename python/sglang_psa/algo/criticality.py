"""Criticality of KV blocks for one decode query, aggregated per KV head (GQA).

A KV head serves `G = Hq / Hkv` query heads and a block is loaded once for all of
them, so one ranking per KV head is produced: each query head's estimate of the
share of its softmax mass that a block holds, maximised over the group.
"""

from __future__ import annotations

import torch

from sglang_psa.algo.metadata import BlockMeta


def group_queries(q: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """`[B, Hq, d]` -> `[B, Hkv, G, d]` (query head h belongs to KV head h // G)."""
    B, Hq, d = q.shape
    if Hq % n_kv_heads:
        raise ValueError(f"{Hq} query heads are not a multiple of {n_kv_heads} KV heads")
    return q.view(B, n_kv_heads, Hq // n_kv_heads, d)


def mean_logits(q: torch.Tensor, meta: BlockMeta, scale: float) -> torch.Tensor:
    """Cuboid-mean estimate `scale * q . mean_key` per query head: `[B, Hq, NB]`."""
    qg = group_queries(q.float(), meta.mean.shape[1])
    s = torch.einsum("bhgd,bhnd->bhgn", qg, meta.mean) * scale
    return s.flatten(1, 2)


def bound_logits(q: torch.Tensor, meta: BlockMeta, scale: float) -> torch.Tensor:
    """True upper bound of `scale * q . k` over each block's keys: `[B, Hq, NB]`.

    Per channel, `q_c * k_c` is largest at `kmin_c` or `kmax_c` (Quest's bound).
    """
    qg = group_queries(q.float(), meta.mean.shape[1]) * scale
    hi = torch.maximum(
        qg.unsqueeze(3) * meta.kmax.unsqueeze(2), qg.unsqueeze(3) * meta.kmin.unsqueeze(2)
    )  # [B, Hkv, G, NB, d]
    return hi.sum(-1).flatten(1, 2)


def block_logits(q: torch.Tensor, meta: BlockMeta, scale: float, method: str) -> torch.Tensor:
    if method == "mean":
        return mean_logits(q, meta, scale)
    if method == "bound":
        return bound_logits(q, meta, scale)
    raise ValueError(f"unknown criticality method {method!r} (mean|bound)")


def criticality(
    q: torch.Tensor, meta: BlockMeta, scale: float, method: str = "mean"
) -> torch.Tensor:
    """Score per (request, KV head, block), `[B, Hkv, NB]`; empty blocks get -inf.

    Each query head's logit estimate plus `log(count)` is normalised over the
    blocks (a predicted mass share, in log space), then the group's max is taken.
    """
    logits = block_logits(q, meta, scale, method)
    logits = logits + meta.count.clamp(min=1).log().unsqueeze(1)
    logits = logits.masked_fill((meta.count == 0).unsqueeze(1), -torch.inf)
    return criticality_from_logits(logits, meta.mean.shape[1])


def criticality_from_logits(logits: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """`[B, Hq, NB]` per-head block logits (-inf for empty blocks) -> `[B, Hkv, NB]`: each
    head's share of its predicted mass (log space), maximised over the GQA group."""
    B, _, NB = logits.shape
    share = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return share.view(B, n_kv_heads, -1, NB).amax(2)
