"""Reference of the prefill staging: one layer of a prefix whose blocks live in HBM or on the host.

At the tiered home a prompt larger than HBM is prefilled in chunks whose saved blocks
give their pages back (`mem_cache.prefill_stage`); a later chunk still attends to the
whole prefix. Per layer, the prefix is gathered into a device staging buffer that
SGLang's extend kernel then reads: row `j` of the staging is the prefix token whose
request-table slot is `slots[j]`, read from SGLang's pool at that slot when the slot is
a real one (`host_rows[j] < 0`), else from the host tier's layer at row `host_rows[j]`
(host block times the block size plus the token's offset in its block).

`stage_prefix_ref` is the spec of `sgl_kernel_ext.prefix_stage.stage_prefix`.
"""

from __future__ import annotations

import torch


def stage_prefix_ref(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    slots: torch.Tensor,
    host_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(k, v)`, each `[P, Hkv, d]` on the pool's device: `pool_k/v [tokens, Hkv, d]` (one
    layer of SGLang's pool), `host_k/v [Hkv, HB, bs, d]` (one layer of the host tier),
    `slots [P]` and `host_rows [P]` (-1: read the pool)."""
    heads, d = pool_k.shape[1], pool_k.shape[2]
    out = []
    for pool, host in ((pool_k, host_k), (pool_v, host_v)):
        rows = host.reshape(heads, -1, d)  # [Hkv, HB * bs, d]
        staged = pool[slots.long().to(pool.device)].clone()
        on_host = (host_rows >= 0).cpu()
        if on_host.any():
            idx = host_rows.cpu()[on_host].long()
            staged[on_host.to(pool.device)] = (
                rows[:, idx.to(rows.device)].permute(1, 0, 2).to(pool.device)
            )
        out.append(staged)
    return out[0], out[1]
