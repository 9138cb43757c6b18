"""Reference of the tiered home's per-step block tables (`sgl_kernel_ext.step_tables`).

A decode step at `--psa-kv-home tiered` reads each block where it lives. Given the
step's page table `pages [B, NB]` (int32: request b's block j is on page `pages[b, j]`),
the write-back's location table `host_loc [rows, >= NB]` (int32, by request-table row:
`-u - 1` where block j's only copy is host block `u`, else 0 or above) and the batch's
request-table rows `rows [B]`:
- `loc [B, Hkv, NB]`: every KV head's location of block j, `host_loc` where that is
  negative (the wave kernel reads host block `-loc - 1`), else the page;
- `pages'`: the row of the block's metadata and last-use stamps, the page, or for a
  block off HBM its host block's row `page_rows + u` (= `page_rows - 1 - host_loc`);
- `row_host [B]` (int32): 1 where any block of the row is off HBM.
"""

from __future__ import annotations

import torch


def tiered_tables_ref(
    pages: torch.Tensor, host_loc: torch.Tensor, rows: torch.Tensor, page_rows: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loc, pages', row_host) as the module says; the inputs are left as they are."""
    nb = pages.shape[1]
    host = host_loc[rows.long(), :nb]
    on = host < 0
    loc = torch.where(on, host, pages)[:, None, :].expand(-1, kv_heads, -1).contiguous()
    return loc, torch.where(on, page_rows - 1 - host, pages), on.any(1).to(torch.int32)
