"""Gather full KV pages of one layer into a head-major staging buffer, one launch.

The write-back to the host tier moves a layer's newly full blocks with one D2H
copy per K and V. SGLang stores a layer's KV token-major (`[tokens, heads,
head_dim]`, a page = `block_size` consecutive tokens); the host tier stores it
per (KV head, block). This kernel reorders on the GPU: block `i` of `pages`
lands, per head `h`, at rows `i*bs .. i*bs+bs` of head `h` in
`dst [heads, n*bs, head_dim]`, so each head's blocks are one contiguous run the
copy engine moves with plain memcpy. Reference: `sglang_psa.algo.blockcopy.
gather_pages_head_major_ref`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gather_pages_kernel(
    k_src,
    v_src,
    pages,
    k_dst,
    v_dst,
    src_tok_stride,
    src_head_stride,
    dst_head_stride,
    BS: tl.constexpr,
    D: tl.constexpr,
):
    i = tl.program_id(0)  # block of the plan
    h = tl.program_id(1)  # KV head
    page = tl.load(pages + i).to(tl.int64)
    tok = tl.arange(0, BS)
    dim = tl.arange(0, D)
    src = (page * BS + tok)[:, None] * src_tok_stride + h * src_head_stride + dim[None, :]
    dst = h.to(tl.int64) * dst_head_stride + (i * BS + tok)[:, None] * D + dim[None, :]
    tl.store(k_dst + dst, tl.load(k_src + src))
    tl.store(v_dst + dst, tl.load(v_src + src))


def _triton_enabled(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def gather_pages_head_major(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    pages: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    block_size: int,
) -> None:
    """`k_dst[h, i*bs + t] = k_src[pages[i]*bs + t, h]` (and V) for every plan entry `i`,
    head `h` and token `t < bs`, in one launch.

    `k_src, v_src [tokens, heads, head_dim]`: one layer of SGLang's pool (token rows
    may be strided, dims contiguous). `pages [n]` int32/int64 on the same device.
    `k_dst, v_dst`: contiguous `[heads, n*bs, head_dim]` on the same device.
    Without CUDA and outside the Triton interpreter this is torch indexing, which
    gives the identical result.
    """
    n = pages.numel()
    H, d = k_src.shape[1], k_src.shape[2]
    want = (H, n * block_size, d)
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} must be a contiguous {want}")
        if t.dtype != k_src.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the pool's {k_src.dtype}")
    if k_src.stride() != v_src.stride() or k_src.stride(2) != 1:
        raise ValueError("K and V pool buffers must share strides with contiguous head dims")
    if n == 0:
        return
    if not _triton_enabled(k_src.device):
        rows = (pages.long()[:, None] * block_size + torch.arange(block_size)).reshape(-1)
        k_dst.copy_(k_src[rows].transpose(0, 1))
        v_dst.copy_(v_src[rows].transpose(0, 1))
        return
    if block_size & (block_size - 1) or d & (d - 1):
        raise ValueError(f"block size {block_size} and head dim {d} must be powers of two")
    _gather_pages_kernel[(n, H)](
        k_src,
        v_src,
        pages,
        k_dst,
        v_dst,
        k_src.stride(0),
        k_src.stride(1),
        n * block_size * d,
        BS=block_size,
        D=d,
        num_warps=4,
    )
