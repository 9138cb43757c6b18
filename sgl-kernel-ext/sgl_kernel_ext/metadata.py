"""Block metadata of SGLang's KV pages, produced when the keys are written.

One SGLang page is one PSA block. Its metadata is per (page, KV head) the mean
key and/or the per-channel min and max over the page's tokens (spec:
`sglang_psa.algo.block_metadata`), in `[pages, Hkv, d]` tensors of one layer.
It is computed where the keys are written, never by scanning for stale pages:

- decode (`from_locs`): the page holding each request's new token, over the
  `loc % block_size + 1` tokens it holds now (so a tail page's metadata is
  current every step, and final when the page fills);
- prefill (`from_table`): every page an extend wrote, found through SGLang's
  request table (`req_to_token`), over the tokens each holds after the extend.

One program per (request, page of it, KV head), reading the page's keys as one
`[block_size, d]` tile in place from SGLang's token-major `[tokens, Hkv, d]`
buffer. All inputs are device tensors and the grid depends only on the batch
shape, so the decode launch is captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled


@triton.jit
def _page_meta_kernel(
    k_ptr,
    locs_ptr,
    table_ptr,
    rows_ptr,
    starts_ptr,
    ends_ptr,
    mean_ptr,
    min_ptr,
    max_ptr,
    table_stride,
    Hkv,
    BS: tl.constexpr,
    D: tl.constexpr,
    BS_P: tl.constexpr,
    D_P: tl.constexpr,
    FROM_LOCS: tl.constexpr,
    MEAN: tl.constexpr,
    BOUNDS: tl.constexpr,
):
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    if FROM_LOCS:
        loc = tl.load(locs_ptr + b).to(tl.int64)
        page = loc // BS
        count = (loc % BS + 1).to(tl.int32)
    else:
        start = tl.load(starts_ptr + b)
        end = tl.load(ends_ptr + b)
        p = start // BS + j  # the request's j-th page touched by the extend
        row = tl.load(rows_ptr + b).to(tl.int64)
        live = p * BS < end
        slot = tl.load(table_ptr + row * table_stride + tl.where(live, p * BS, 0))
        page = slot.to(tl.int64) // BS
        count = tl.where(live, tl.minimum(end - p * BS, BS), 0).to(tl.int32)
    t = tl.arange(0, BS_P)
    d = tl.arange(0, D_P)
    dm = d < D
    valid = (t < count)[:, None] & dm[None, :]
    base = page * BS * Hkv * D + h * D
    k = tl.load(k_ptr + base + t[:, None] * (Hkv * D) + d[None, :], mask=valid, other=0.0)
    k = k.to(tl.float32)
    out = (page * Hkv + h) * D + d
    sm = dm & ((d * 0 + count) > 0)
    if MEAN:
        tl.store(mean_ptr + out, tl.sum(k, axis=0) / tl.maximum(count, 1), mask=sm)
    if BOUNDS:
        tl.store(min_ptr + out, tl.min(tl.where(valid, k, float("inf")), axis=0), mask=sm)
        tl.store(max_ptr + out, tl.max(tl.where(valid, k, float("-inf")), axis=0), mask=sm)


def _check(k_buffer, block_size, mean, kmin, kmax):
    if k_buffer.dim() != 3 or not k_buffer.is_contiguous():
        raise ValueError("k_buffer must be SGLang's contiguous [tokens, Hkv, d] key buffer")
    if k_buffer.shape[0] % block_size:
        raise ValueError(f"the key buffer's {k_buffer.shape[0]} rows are not whole pages")
    _, H, d = k_buffer.shape
    kept = [t for t in (mean, kmin, kmax) if t is not None]
    if mean is None and kmin is None:
        raise ValueError("keep the mean, the bounds (kmin and kmax), or both")
    if (kmin is None) != (kmax is None):
        raise ValueError("kmin and kmax come together")
    for t in kept:
        if t.dim() != 3 or t.shape[1:] != (H, d) or not t.is_contiguous():
            raise ValueError(f"metadata must be contiguous [pages, {H}, {d}] tensors")


def _launch(k_buffer, block_size, grid, mean, kmin, kmax, *, locs=None, table=None, rows=None,
            starts=None, ends=None):  # fmt: skip
    """Decode passes `locs`, prefill the request table and its rows; the kernel never
    reads what its mode does not use, so those slots get a placeholder tensor."""
    _, H, d = k_buffer.shape
    dummy = mean if mean is not None else kmin
    args = (locs, table, rows, starts, ends, mean, kmin, kmax)
    _page_meta_kernel[grid](
        k_buffer, *(dummy if t is None else t for t in args),
        0 if table is None else table.stride(0), H,
        BS=block_size, D=d, BS_P=triton.next_power_of_2(block_size),
        D_P=triton.next_power_of_2(d), FROM_LOCS=locs is not None,
        MEAN=mean is not None, BOUNDS=kmin is not None,
    )  # fmt: skip


def _torch_pages(k_buffer, block_size, pages, counts, mean, kmin, kmax):
    """The same computation in torch (CPU without the interpreter)."""
    keep = counts > 0
    pages, counts = pages[keep].long(), counts[keep].long()
    H, d = k_buffer.shape[1:]
    k = k_buffer.view(-1, block_size, H, d)[pages].float()  # [n, bs, H, d]
    valid = (torch.arange(block_size, device=k.device)[None, :] < counts[:, None])[..., None, None]
    if mean is not None:
        s = torch.where(valid, k, 0.0).sum(1) / counts[:, None, None]
        mean[pages] = s.to(mean.dtype)
    if kmin is not None:
        kmin[pages] = torch.where(valid, k, torch.inf).amin(1).to(kmin.dtype)
        kmax[pages] = torch.where(valid, k, -torch.inf).amax(1).to(kmax.dtype)


def page_meta_from_locs(
    k_buffer: torch.Tensor,
    locs: torch.Tensor,
    block_size: int,
    mean: torch.Tensor | None,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
) -> None:
    """Decode: for each token slot in `locs [B]` (the step's new tokens), the metadata of
    its page over the `loc % block_size + 1` tokens the page holds. Slot 0 is SGLang's
    padding sink (page 0, never part of a request). One launch, no host sync."""
    _check(k_buffer, block_size, mean, kmin, kmax)
    B = locs.numel()
    if B == 0:
        return
    if triton_enabled(k_buffer.device):
        _launch(k_buffer, block_size, (B, 1, k_buffer.shape[1]), mean, kmin, kmax, locs=locs)
        return
    locs = locs.long()
    _torch_pages(k_buffer, block_size, locs // block_size, locs % block_size + 1, mean, kmin, kmax)


def page_meta_from_table(
    k_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    max_pages: int,
    block_size: int,
    mean: torch.Tensor | None,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
) -> None:
    """Prefill: request `b` (its `req_to_token` row `rows[b]`) had tokens `[starts[b],
    ends[b])` written; recompute every page holding one of them, over the tokens the page
    holds up to `ends[b]`. `max_pages` bounds the pages any request touched (the grid)."""
    _check(k_buffer, block_size, mean, kmin, kmax)
    B = rows.numel()
    if B == 0 or max_pages <= 0:
        return
    if triton_enabled(k_buffer.device):
        grid = (B, max_pages, k_buffer.shape[1])
        _launch(k_buffer, block_size, grid, mean, kmin, kmax, table=req_to_token, rows=rows,
                starts=starts, ends=ends)  # fmt: skip
        return
    j = torch.arange(max_pages, device=rows.device)
    p = starts.long()[:, None] // block_size + j[None, :]  # [B, J]
    live = p * block_size < ends.long()[:, None]
    tok = torch.where(live, p * block_size, 0)
    slots = req_to_token[rows.long()[:, None], tok]
    counts = torch.where(live, (ends.long()[:, None] - p * block_size).clamp(max=block_size), 0)
    _torch_pages(
        k_buffer, block_size, (slots.long() // block_size).flatten(), counts.flatten(),
        mean, kmin, kmax,
    )  # fmt: skip
