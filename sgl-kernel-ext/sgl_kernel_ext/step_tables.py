"""The tiered home's per-step block tables in one launch: where each block of the batch
is read (HBM page or host block), the row of its metadata, and which rows have a block
off HBM. One program a request; spec: `sglang_psa.algo.step_tables.tiered_tables_ref`.
Recorded into the decode graph where ten small PyTorch ops were (a gather, compares,
two reductions, selects and copies)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled

CHUNK = 256  # blocks a pass of a program's loop takes


@triton.jit(do_not_specialize=["nb", "host_stride", "page_rows"])
def _tiered_tables_kernel(
    pages_ptr,
    host_loc_ptr,
    rows_ptr,
    loc_ptr,
    row_host_ptr,
    nb,
    host_stride,
    page_rows,
    HKV: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seen = tl.zeros([CHUNK], tl.int32)
    for start in range(0, nb, CHUNK):
        j = start + tl.arange(0, CHUNK)
        live = j < nb
        page = tl.load(pages_ptr + b * nb + j, mask=live, other=0)
        host = tl.load(host_loc_ptr + row * host_stride + j, mask=live, other=0)
        off = host < 0
        where = tl.where(off, host, page)
        for h in tl.static_range(HKV):
            tl.store(loc_ptr + (b * HKV + h) * nb + j, where, mask=live)
        tl.store(pages_ptr + b * nb + j, tl.where(off, page_rows - 1 - host, page), mask=live)
        seen = tl.maximum(seen, off.to(tl.int32))
    tl.store(row_host_ptr + b, tl.max(seen, 0))


def tiered_step_tables(
    pages: torch.Tensor,
    host_loc: torch.Tensor,
    rows: torch.Tensor,
    page_rows: int,
    loc: torch.Tensor,
    row_host: torch.Tensor,
) -> None:
    """In place, for the batch's `rows [B]`: `loc [B, Hkv, NB]` and `row_host [B]` written,
    `pages [B, NB]` rewritten to metadata rows (all int32, contiguous), from the
    write-back's `host_loc [rows, >= NB]`. Fixed shapes, no sync: graph-recordable."""
    B, nb = pages.shape
    hkv = loc.shape[1]
    if loc.shape != (B, hkv, nb) or row_host.shape != (B,) or host_loc.shape[1] < nb:
        raise ValueError(
            f"tiered_step_tables: pages {tuple(pages.shape)}, loc {tuple(loc.shape)}, "
            f"row_host {tuple(row_host.shape)}, host_loc {tuple(host_loc.shape)}"
        )
    if B == 0:
        return
    if not triton_enabled(pages.device):
        from sglang_psa.algo.step_tables import tiered_tables_ref

        got = tiered_tables_ref(pages, host_loc, rows, page_rows, hkv)
        for dst, src in zip((loc, pages, row_host), got):
            dst.copy_(src)
        return
    assert pages.is_contiguous() and loc.is_contiguous() and host_loc.stride(1) == 1
    _tiered_tables_kernel[(B,)](
        pages, host_loc, rows, loc, row_host, nb, host_loc.stride(0), page_rows,
        HKV=hkv, CHUNK=CHUNK,
    )  # fmt: skip
