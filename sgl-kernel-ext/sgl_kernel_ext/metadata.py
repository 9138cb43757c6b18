"""Block metadata of SGLang's KV pages, produced when the keys are written.

One SGLang page is one PSA block. Its metadata is per (page, KV head) the mean
key and/or the per-channel min and max over the page's tokens (spec:
`sglang_psa.algo.block_metadata`), in `[pages, Hkv, d]` tensors of one layer.
It is computed where the keys are written, never by scanning for stale pages:

- decode (`from_locs`): the page holding each request's new token, over the
  `loc % block_size + 1` tokens it holds now (so a tail page's metadata is
  current every step, and final when the page fills);
- prefill (`from_table`): every page an extend wrote, found through SGLang's
  request table (`req_to_token`), over the tokens each holds after the extend; for
  every layer in one launch once the last is written (`from_table_layers`).

One program per (request, page of it, KV head), reading the page's keys as one
`[block_size, d]` tile in place from SGLang's token-major `[tokens, Hkv, d]`
buffer. All inputs are device tensors and the grid depends only on the batch
shape, so the decode launch is captured in CUDA graphs.

Bounds are kept in the KV dtype, or (int8 `kmin`/`kmax` with a float32 `kscale
[pages, Hkv]`) as 8-bit codes: half the bytes scoring reads. The codes round
outward, so they still bound every key (spec: `sglang_psa.algo.bound_codes`,
whose float32 steps the kernel repeats exactly).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled
from sgl_kernel_ext.unit_cache import LAYER_ALIGN, layer_offset_tensors

# float32((1 + 2^-20) / 127): a block's largest |bound| to its code scale (the margin
# keeps every code in [-128, 127]); `sglang_psa.algo.bound_codes` spells it out.
CODE_STEP = float(torch.tensor((1 + 2**-20) / 127, dtype=torch.float32))


@triton.jit
def store_page_meta(
    k_ptr,
    page,
    count,
    h,
    Hkv,
    mean_ptr,
    min_ptr,
    max_ptr,
    scale_ptr,
    code_step,
    BS: tl.constexpr,
    D: tl.constexpr,
    BS_P: tl.constexpr,
    D_P: tl.constexpr,
    MEAN: tl.constexpr,
    BOUNDS: tl.constexpr,
    CODES: tl.constexpr,
):
    """KV head `h` of page `page` of SGLang's key buffer (`[tokens, Hkv, D]` at `k_ptr`):
    the mean, or the bounds (8-bit codes and their scale with CODES), of its first
    `count` keys, stored at row `page` of the metadata (`[pages, Hkv, D]`). Nothing for
    `count` 0. Called by `_page_meta_kernel` and by the wave kernel's kept-rows launch."""
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
        lo = tl.min(tl.where(valid, k, float("inf")), axis=0)
        hi = tl.max(tl.where(valid, k, float("-inf")), axis=0)
        if CODES:  # 8-bit codes, rounded outward, and the block's scale
            amax = tl.max(tl.where(dm, tl.maximum(tl.abs(lo), tl.abs(hi)), 0.0), axis=0)
            sc = tl.maximum(amax * code_step, 1e-30)
            qlo = tl.floor(tl.math.div_rn(lo, sc))
            qlo = tl.where(qlo * sc > lo, qlo - 1.0, qlo)
            qhi = tl.ceil(tl.math.div_rn(hi, sc))
            qhi = tl.where(qhi * sc < hi, qhi + 1.0, qhi)
            qlo = tl.minimum(tl.maximum(qlo, -128.0), 127.0)
            qhi = tl.minimum(tl.maximum(qhi, -128.0), 127.0)
            tl.store(min_ptr + out, qlo.to(tl.int8), mask=sm)
            tl.store(max_ptr + out, qhi.to(tl.int8), mask=sm)
            tl.store(scale_ptr + page * Hkv + h, sc, mask=count > 0)
        else:
            tl.store(min_ptr + out, lo, mask=sm)
            tl.store(max_ptr + out, hi, mask=sm)


@triton.jit
def new_key_page(loc, BS: tl.constexpr):
    """The page of the key a decode step wrote at token slot `loc`, and how many keys that
    page holds (the new one last)."""
    loc = loc.to(tl.int64)
    return loc // BS, (loc % BS + 1).to(tl.int32)


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
    scale_ptr,
    gate_ptr,
    layer_off_ptr,
    table_stride,
    meta_layer_stride,
    scale_layer_stride,
    Hkv,
    code_step,
    BS: tl.constexpr,
    D: tl.constexpr,
    BS_P: tl.constexpr,
    D_P: tl.constexpr,
    FROM_LOCS: tl.constexpr,
    MEAN: tl.constexpr,
    BOUNDS: tl.constexpr,
    CODES: tl.constexpr,
    GATE: tl.constexpr,
    LAYERED: tl.constexpr,
):
    # Programs (request, page of it, layer x KV head). LAYERED: layer l's keys lie
    # `layer_off[l]` elements from `k_ptr` (a multiple of LAYER_ALIGN), its metadata
    # `l * meta_layer_stride` (scales `l * scale_layer_stride`) into the outputs.
    b = tl.program_id(0)
    j = tl.program_id(1)
    h = tl.program_id(2)
    if LAYERED:
        layer = h // Hkv
        h = h % Hkv
        k_ptr += tl.multiple_of(tl.load(layer_off_ptr + layer), LAYER_ALIGN)
        at = layer.to(tl.int64) * meta_layer_stride
        mean_ptr += at
        min_ptr += at
        max_ptr += at
        scale_ptr += layer.to(tl.int64) * scale_layer_stride
    if GATE:  # only the rows whose gate is set
        if tl.load(gate_ptr + b) == 0:
            return
    if FROM_LOCS:
        page, count = new_key_page(tl.load(locs_ptr + b), BS)
    else:
        start = tl.load(starts_ptr + b)
        end = tl.load(ends_ptr + b)
        p = start // BS + j  # the request's j-th page touched by the extend
        row = tl.load(rows_ptr + b).to(tl.int64)
        live = p * BS < end
        slot = tl.load(table_ptr + row * table_stride + tl.where(live, p * BS, 0))
        page = slot.to(tl.int64) // BS
        count = tl.where(live, tl.minimum(end - p * BS, BS), 0).to(tl.int32)
    store_page_meta(k_ptr, page, count, h, Hkv, mean_ptr, min_ptr, max_ptr, scale_ptr,
                    code_step, BS, D, BS_P, D_P, MEAN, BOUNDS, CODES)  # fmt: skip


def _check(k_buffer, block_size, mean, kmin, kmax, kscale=None):
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
    codes = kmin is not None and kmin.dtype == torch.int8
    if codes and (kscale is None or kscale.shape != (kmin.shape[0], H)
                  or kscale.dtype != torch.float32 or not kscale.is_contiguous()):  # fmt: skip
        raise ValueError(f"8-bit bounds need a contiguous float32 kscale [pages, {H}]")


def _launch(k_buffer, block_size, grid, mean, kmin, kmax, kscale, *, locs=None, table=None,
            rows=None, starts=None, ends=None, gate=None, offsets=None):  # fmt: skip
    """Decode passes `locs` (and maybe a `gate`), prefill the request table and its rows;
    the kernel never reads what its mode does not use, so those slots get a placeholder
    tensor. `offsets`: every layer at once (`mean`/`kmin`/`kmax`/`kscale` then carry a
    leading layer dimension; `k_buffer` is layer 0's)."""
    _, H, d = k_buffer.shape
    kept = mean if mean is not None else kmin  # (also the placeholder of unused slots)
    args = (locs, table, rows, starts, ends, mean, kmin, kmax, kscale, gate, offsets)
    _page_meta_kernel[grid](
        k_buffer, *(kept if t is None else t for t in args),
        0 if table is None else table.stride(0),
        kept.stride(0) if offsets is not None else 0,
        kscale.stride(0) if offsets is not None and kscale is not None else 0,
        H, CODE_STEP,
        BS=block_size, D=d, BS_P=triton.next_power_of_2(block_size),
        D_P=triton.next_power_of_2(d), FROM_LOCS=locs is not None,
        MEAN=mean is not None, BOUNDS=kmin is not None, CODES=kscale is not None,
        GATE=gate is not None, LAYERED=offsets is not None,
    )  # fmt: skip


def _torch_pages(k_buffer, block_size, pages, counts, mean, kmin, kmax, kscale):
    """The same computation in torch (CPU without the interpreter)."""
    keep = counts > 0
    pages, counts = pages[keep].long(), counts[keep].long()
    H, d = k_buffer.shape[1:]
    k = k_buffer.view(-1, block_size, H, d)[pages].float()  # [n, bs, H, d]
    valid = (torch.arange(block_size, device=k.device)[None, :] < counts[:, None])[..., None, None]
    if mean is not None:
        s = torch.where(valid, k, 0.0).sum(1) / counts[:, None, None]
        mean[pages] = s.to(mean.dtype)
    if kmin is None:
        return
    lo = torch.where(valid, k, torch.inf).amin(1)
    hi = torch.where(valid, k, -torch.inf).amax(1)
    if kscale is not None:  # the kernel's float32 steps
        sc = (torch.maximum(lo.abs(), hi.abs()).amax(-1) * CODE_STEP).clamp(min=1e-30)
        s = sc[..., None]
        qlo, qhi = torch.floor(lo / s), torch.ceil(hi / s)
        qlo = torch.where(qlo * s > lo, qlo - 1, qlo).clamp(-128, 127)
        qhi = torch.where(qhi * s < hi, qhi + 1, qhi).clamp(-128, 127)
        lo, hi = qlo, qhi
        kscale[pages] = sc
    kmin[pages] = lo.to(kmin.dtype)
    kmax[pages] = hi.to(kmax.dtype)


def page_meta_from_locs(
    k_buffer: torch.Tensor,
    locs: torch.Tensor,
    block_size: int,
    mean: torch.Tensor | None,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kscale: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> None:
    """Decode: for each token slot in `locs [B]` (the step's new tokens), the metadata of
    its page over the `loc % block_size + 1` tokens the page holds; with `gate [B]`
    (int32) only for the rows whose gate is not 0. Slot 0 is SGLang's padding sink (page
    0, never part of a request). One launch, no host sync."""
    _check(k_buffer, block_size, mean, kmin, kmax, kscale)
    B = locs.numel()
    if B == 0:
        return
    if gate is not None and gate.shape != (B,):
        raise ValueError(f"gate must be [{B}] like locs, got {tuple(gate.shape)}")
    if triton_enabled(k_buffer.device):
        grid = (B, 1, k_buffer.shape[1])
        _launch(k_buffer, block_size, grid, mean, kmin, kmax, kscale, locs=locs, gate=gate)
        return
    locs = locs.long()
    pages, counts = locs // block_size, locs % block_size + 1
    if gate is not None:
        counts = torch.where(gate != 0, counts, 0)
    _torch_pages(k_buffer, block_size, pages, counts, mean, kmin, kmax, kscale)


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
    kscale: torch.Tensor | None = None,
) -> None:
    """Prefill: request `b` (its `req_to_token` row `rows[b]`) had tokens `[starts[b],
    ends[b])` written; recompute every page holding one of them, over the tokens the page
    holds up to `ends[b]`. `max_pages` bounds the pages any request touched (the grid).
    One layer (`page_meta_from_table_layers` with one)."""
    meta = (None if t is None else t[None] for t in (mean, kmin, kmax, kscale))
    page_meta_from_table_layers([k_buffer], req_to_token, rows, starts, ends, max_pages,
                                block_size, *meta)  # fmt: skip


def page_meta_from_table_layers(
    k_bufs: list[torch.Tensor],
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    starts: torch.Tensor,
    ends: torch.Tensor,
    max_pages: int,
    block_size: int,
    mean: torch.Tensor | None,
    kmin: torch.Tensor | None,
    kmax: torch.Tensor | None,
    kscale: torch.Tensor | None = None,
    offsets: torch.Tensor | None = None,
) -> None:
    """`page_meta_from_table` for every layer at once, in one launch: `k_bufs` the L
    layers' key buffers (one shape and dtype, lying a multiple of `LAYER_ALIGN` elements
    apart, else ValueError), the metadata `[L, pages, Hkv, d]` (`kscale [L, pages, Hkv]`).
    `offsets`: the key buffers' `layer_offsets` as an int64 `[L]` tensor on their device
    (made here when None: pass it to spare a small copy a call)."""
    L = len(k_bufs)
    meta = (mean, kmin, kmax, kscale)
    for t in meta:
        if t is not None and t.shape[0] != L:
            raise ValueError(f"metadata of {t.shape[0]} layers for {L} key buffers")
    for layer in (0, L - 1):  # one shape and dtype throughout (layer_offsets checks it)
        _check(k_bufs[layer], block_size, *(None if t is None else t[layer] for t in meta))
    B = rows.numel()
    if B == 0 or max_pages <= 0:
        return
    if triton_enabled(k_bufs[0].device):
        if L > 1 and offsets is None:
            offsets = layer_offset_tensors(k_bufs, k_bufs, k_bufs[0].device)[0]
        grid = (B, max_pages, L * k_bufs[0].shape[1])
        _launch(k_bufs[0], block_size, grid, *meta, table=req_to_token, rows=rows,
                starts=starts, ends=ends, offsets=offsets if L > 1 else None)  # fmt: skip
        return
    j = torch.arange(max_pages, device=rows.device)
    p = starts.long()[:, None] // block_size + j[None, :]  # [B, J]
    live = p * block_size < ends.long()[:, None]
    tok = torch.where(live, p * block_size, 0)
    slots = req_to_token[rows.long()[:, None], tok]
    counts = torch.where(live, (ends.long()[:, None] - p * block_size).clamp(max=block_size), 0)
    pages = (slots.long() // block_size).flatten()
    for layer, k in enumerate(k_bufs):
        _torch_pages(k, block_size, pages, counts.flatten(),
                     *(None if t is None else t[layer] for t in meta))  # fmt: skip
