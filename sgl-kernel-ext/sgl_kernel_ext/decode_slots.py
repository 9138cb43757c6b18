"""A decode step's KV slots at a page size above one, in one launch.

For each request of the batch: the slot of its next token (the one after the last
in its page, or the first of a new page taken from the allocator's free pages, in
request order) is written to `out` and into its request-to-token row, so that the
scheduler's host does one launch where SGLang's paged path does a gather, an
allocation kernel, an index write and their casts. Spec and layout:
`sglang_psa.algo.decode_slots.decode_slots_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled

CHUNK = 128  # requests a pass of the kernel's loop takes


# One compiled variant whatever the batch (neither the batch size nor the table's row
# stride is specialised, and the batch is walked in fixed chunks), so it compiles at the
# server's first decode step (SGLang's own start-up warm-up) and never again while
# requests wait: a variant per power-of-two batch bound compiled up to six times in the
# scheduling phase as a batch grew to 32.
@triton.jit(do_not_specialize=["row_stride", "bs"])
def _decode_slots_kernel(
    req_to_token,
    row_stride,
    rows_ptr,
    lens_ptr,
    free_ptr,
    out_ptr,
    bs,
    CHUNK: tl.constexpr,
    PAGE: tl.constexpr,
):
    taken = tl.full([], 0, tl.int32)  # free pages handed to earlier chunks
    for start in range(0, bs, CHUNK):
        i = start + tl.arange(0, CHUNK)
        live = i < bs
        row = tl.load(rows_ptr + i, mask=live, other=0).to(tl.int64)
        n = tl.load(lens_ptr + i, mask=live, other=1).to(tl.int64)  # tokens before this one
        fresh = (live & (n % PAGE == 0)).to(tl.int32)  # the token opens a page
        rank = taken + tl.cumsum(fresh, 0) - fresh  # its page among the batch's new ones
        page = tl.load(free_ptr + rank, mask=fresh != 0, other=0).to(tl.int64)
        base = req_to_token + row * row_stride
        last = tl.load(base + n - 1, mask=live & (fresh == 0), other=0).to(tl.int64)
        slot = tl.where(fresh != 0, page * PAGE, last + 1)
        tl.store(out_ptr + i, slot, mask=live)
        tl.store(base + n, slot.to(tl.int32), mask=live)
        taken += tl.sum(fresh, 0)


def decode_slots(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
    out: torch.Tensor,
) -> None:
    """Write the slots of `rows`' next tokens (`lens`: their tokens so far) into `out`
    (int64 [bs]) and `req_to_token[rows, lens]`. `free_pages` must hold at least as many
    pages as there are lens divisible by `page_size` (the caller counts them on the host)."""
    bs = rows.shape[0]
    if bs == 0:
        return
    if not triton_enabled(rows.device):
        from sglang_psa.algo.decode_slots import decode_slots_ref

        out.copy_(decode_slots_ref(req_to_token, rows, lens, free_pages, page_size))
        return
    _decode_slots_kernel[(1,)](
        req_to_token, req_to_token.stride(0), rows, lens, free_pages, out, bs,
        CHUNK=CHUNK, PAGE=page_size,
    )  # fmt: skip
