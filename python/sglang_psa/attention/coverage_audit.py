"""`--psa-audit-coverage`: the stop rule's guarantee checked in the server.

After a layer's decode attention, `audit` scores every key of every request in the
batch (a dense pass, float32) from SGLang's pool through the step's page table and
folds into `coverage [2]` (`mem_cache.read_stamps.ReadCounters`) the smallest share of
a query head's true softmax mass that the blocks it read held, and how many query
heads were checked. Fixed shapes and no host sync: it runs inside the decode graphs
(it allocates there, as a diagnosis may). The spec of the share is
`sglang_psa.algo.attention.read_share`.
"""

from __future__ import annotations

import torch

from sglang_psa.algo.attention import read_share, token_scores


def audit(
    coverage: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    read: torch.Tensor,
    scale: float,
    block_size: int,
) -> None:
    """`q [B, Hq, d]`; `k_pool [slots, Hkv, d]` (slot = page * block_size + offset);
    `pages [B, NB]` each request's pages in order; `lengths [B]`; `read [B, Hkv, >= NB]`
    the blocks the step read. Updates `coverage` in place: `[0]` the smallest share so
    far, `[1]` the query heads checked."""
    B, Hq, _ = q.shape
    NB = pages.shape[1]
    offs = torch.arange(block_size, device=pages.device)
    slots = (pages.long()[:, :, None] * block_size + offs).view(B, NB * block_size)
    k = k_pool[slots].transpose(1, 2)  # [B, Hkv, T, d]
    share = read_share(token_scores(q, k, lengths.long(), scale), read[..., :NB], block_size)
    torch.minimum(coverage[:1], share.min().double().view(1), out=coverage[:1])
    coverage[1:] += B * Hq
