"""Working-set sizes of a decode batch from per-block last-use stamps, on the GPU.

`stamps [LH, P]` holds, per (layer x KV head, page), the decode step that last
read the block (0: never); the wave kernel writes them. A request's working set
is the number of its own blocks (`pages [B, NB]`, the first `ceil(len / bs)`)
stamped after `step - window`. One program per (request, layer x KV head)
counts its row into `parts [B, LH]`; the caller sums (spec: `working_set_ref`).
`block_readers` counts the other way: per block of the batch, the units that
read it lately (spec: `block_readers_ref`); residency ranks pages by it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled


@triton.jit
def _working_set_kernel(
    stamps_ptr,
    pages_ptr,
    lengths_ptr,
    step_ptr,
    parts_ptr,
    window,
    P,
    NB,
    BS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    lh = tl.program_id(1)
    LH = tl.num_programs(1)
    nb = (tl.load(lengths_ptr + b) + BS - 1) // BS
    since = tl.load(step_ptr) - window
    n = tl.zeros([CHUNK], tl.int32)
    for j0 in range(0, nb, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        m = j < nb
        page = tl.load(pages_ptr + b * NB + j, mask=m, other=0).to(tl.int64)
        st = tl.load(stamps_ptr + lh * P + page, mask=m, other=0)
        n += (m & (st > since) & (st > 0)).to(tl.int32)
    tl.store(parts_ptr + b * LH + lh, tl.sum(n, axis=0))


def _recent(stamps, pages, lengths, since, block_size):
    """`[LH, B, NB]`: the request's own blocks stamped after `since`."""
    NB = pages.shape[1]
    own = (
        torch.arange(NB, device=pages.device)[None, :]
        < ((lengths.long() + block_size - 1) // block_size)[:, None]
    )
    table = stamps[:, pages.long()]
    return (table > since) & (table > 0) & own[None]


def working_set_ref(stamps, pages, lengths, step, window, block_size):
    """`[B]` working-set sizes in torch: the spec of `working_set_parts(...).sum(1)`."""
    return _recent(stamps, pages, lengths, int(step) - window, block_size).sum((0, 2))


def working_set_parts(
    stamps: torch.Tensor,
    pages: torch.Tensor,
    lengths: torch.Tensor,
    step: torch.Tensor,
    window: int,
    block_size: int,
    parts: torch.Tensor,
) -> torch.Tensor:
    """Fill `parts [B, LH]` (int32) with each request's recently stamped blocks per
    (layer x KV head); one launch, no host sync. `stamps [LH, P]` int32, `pages [B, NB]`
    int32, `lengths [B]` int32, `step [1]` int32 (the current step)."""
    LH, P = stamps.shape
    B, NB = pages.shape
    if parts.shape != (B, LH) or parts.dtype != torch.int32:
        raise ValueError(f"parts must be int32 [{B}, {LH}]")
    if B == 0:
        return parts
    if triton_enabled(stamps.device):
        _working_set_kernel[(B, LH)](
            stamps, pages, lengths, step, parts, window, P, NB,
            BS=block_size, CHUNK=256, num_warps=2,
        )  # fmt: skip
        return parts
    recent = _recent(stamps, pages, lengths, step.long() - window, block_size)
    parts.copy_(recent.sum(2).T)
    return parts


@triton.jit
def _block_readers_kernel(
    stamps_ptr, pages_ptr, step_ptr, out_ptr, window, P, NB, LH, CAP: tl.constexpr,
    CHUNK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    j = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    m = j < NB
    page = tl.load(pages_ptr + b * NB + j, mask=m, other=0).to(tl.int64)
    since = tl.load(step_ptr) - window
    n = tl.zeros([CHUNK], tl.int32)
    for lh in range(0, LH):
        st = tl.load(stamps_ptr + lh * P + page, mask=m, other=0)
        n += ((st > since) & (st > 0)).to(tl.int32)
    tl.store(out_ptr + b * NB + j, tl.minimum(n, CAP).to(out_ptr.dtype.element_ty), mask=m)


def block_readers_ref(stamps, pages, step, window):
    """`[B, NB]` in torch: the spec of `block_readers` (int32; its uint8 output is this
    capped at 255)."""
    table = stamps[:, pages.long()]
    since = int(step) - window
    return ((table > since) & (table > 0)).sum(0).to(torch.int32)


def block_readers(
    stamps: torch.Tensor, pages: torch.Tensor, step: torch.Tensor, window: int, out: torch.Tensor
) -> torch.Tensor:
    """Fill `out [B, NB]` (int32, or uint8: capped at 255) with how many (layer x KV head)
    units read each block of `pages [B, NB]` within the last `window` steps (stamped after
    `step - window`); one launch of `B x ceil(NB / 256)` programs that each loop over the
    units, no host sync. Blocks past a request's length get a count too, which the caller
    ignores."""
    LH, P = stamps.shape
    B, NB = pages.shape
    if out.shape != (B, NB) or out.dtype not in (torch.int32, torch.uint8):
        raise ValueError(f"out must be int32 or uint8 [{B}, {NB}]")
    cap = 255 if out.dtype == torch.uint8 else 2**31 - 1
    if B == 0:
        return out
    if triton_enabled(stamps.device):
        chunk = 256
        _block_readers_kernel[(B, triton.cdiv(NB, chunk))](
            stamps, pages, step, out, window, P, NB, LH, CAP=cap, CHUNK=chunk, num_warps=4
        )
        return out
    out.copy_(block_readers_ref(stamps, pages, step.long(), window).clamp(max=cap))
    return out
