"""Copy full KV pages of one layer into (KV head, block) units and back, one launch.

SGLang stores a layer's KV token-major (`[tokens, heads, head_dim]`, a page =
`block_size` consecutive tokens); the host tier stores it per (KV head, block).
The kernel reorders on the GPU: page `pages[i]`, head `h` lands in unit
`dst[h, dst_blocks[i]]` of `dst [heads, blocks, bs, head_dim]`. Two uses:
- into a device staging buffer (`dst_blocks = 0..n-1`), so each head's blocks
  are one contiguous run that one D2H copy moves and the copy engine scatters
  with plain memcpy (`gather_pages_head_major`);
- straight into the pinned host tier through UVA (`dst_blocks` = host blocks):
  GPU-initiated writes of 4-8 KB runs across PCIe.
Reference: `sglang_psa.algo.blockcopy.gather_pages_head_major_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled


@triton.jit
def _copy_pages_kernel(
    pool_k,
    pool_v,
    pages,
    unit_k,
    unit_v,
    blocks,
    pool_tok_stride,
    pool_head_stride,
    unit_head_stride,
    units,
    H: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
):
    # Units (plan entry, KV head) u = pid, pid + P, ...: one program per unit, or a few
    # persistent programs (a copy through UVA then leaves most SMs to the compute).
    tok = tl.arange(0, BS)
    dim = tl.arange(0, D)
    for u in range(tl.program_id(0), units, tl.num_programs(0)):
        i = u // H
        h = u % H
        page = tl.load(pages + i).to(tl.int64)
        blk = tl.load(blocks + i).to(tl.int64)
        at_pool = (page * BS + tok)[:, None] * pool_tok_stride + h * pool_head_stride
        at_pool += dim[None, :]
        at_unit = h.to(tl.int64) * unit_head_stride + (blk * BS + tok)[:, None] * D
        at_unit += dim[None, :]
        tl.store(unit_k + at_unit, tl.load(pool_k + at_pool))
        tl.store(unit_v + at_unit, tl.load(pool_v + at_pool))


def copy_pages_to_units(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    pages: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    dst_blocks: torch.Tensor,
    programs: int | None = None,
) -> None:
    """`k_dst[h, dst_blocks[i], t] = k_src[pages[i]*bs + t, h]` (and V) for every plan
    entry `i`, head `h` and token `t < bs`, in one launch of one program per (entry,
    head), or of `programs` persistent programs that loop over them.

    `k_src, v_src [tokens, heads, head_dim]`: one layer of SGLang's pool (token rows may
    be strided, dims contiguous). `pages`, `dst_blocks [n]` int32/int64 on the pool's
    device. `k_dst, v_dst`: contiguous `[heads, blocks, bs, head_dim]`, on the pool's
    device or (CUDA) pinned host memory written through UVA. Without CUDA and outside the
    Triton interpreter this is torch indexing, which gives the identical result.
    """
    _copy(k_src, v_src, pages, k_dst, v_dst, dst_blocks, programs)


def _copy(pool_k, pool_v, pages, unit_k, unit_v, blocks, programs) -> None:
    n = pages.numel()
    H, d = pool_k.shape[1], pool_k.shape[2]
    bs = unit_k.shape[2] if unit_k.dim() == 4 else 0
    for name, t in (("units K", unit_k), ("units V", unit_v)):
        if t.dim() != 4 or (t.shape[0], t.shape[3]) != (H, d) or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} must be a contiguous [{H}, blocks, bs, {d}]")
        if t.dtype != pool_k.dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the pool's {pool_k.dtype}")
    if pool_k.stride() != pool_v.stride() or pool_k.stride(2) != 1:
        raise ValueError("K and V pool buffers must share strides with contiguous head dims")
    if blocks.numel() != n:
        raise ValueError(f"{n} pages but {blocks.numel()} unit blocks")
    if n == 0:
        return
    if not triton_enabled(pool_k.device):
        rows = (pages.long()[:, None] * bs + torch.arange(bs)).reshape(-1)
        b = blocks.long()
        for pool, unit in ((pool_k, unit_k), (pool_v, unit_v)):
            unit[:, b] = pool[rows].view(n, bs, H, d).permute(2, 0, 1, 3).to(unit.device)
        return
    if bs & (bs - 1) or d & (d - 1):
        raise ValueError(f"block size {bs} and head dim {d} must be powers of two")
    if pool_k.is_cuda:
        for name, t in (("units K", unit_k), ("units V", unit_v)):
            if not t.is_cuda and not t.is_pinned():
                raise ValueError(f"{name} are pageable host memory, which the GPU cannot reach")
    units = n * H
    _copy_pages_kernel[(min(units, programs or units),)](
        pool_k,
        pool_v,
        pages,
        unit_k,
        unit_v,
        blocks,
        pool_k.stride(0),
        pool_k.stride(1),
        unit_k.shape[1] * bs * d,
        units,
        H=H,
        BS=bs,
        D=d,
        num_warps=4,
    )


def gather_pages_head_major(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    pages: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    block_size: int,
) -> None:
    """`k_dst[h, i*bs + t] = k_src[pages[i]*bs + t, h]` (and V): pages in plan order into a
    contiguous `[heads, n*bs, head_dim]` staging buffer on the pool's device."""
    n = pages.numel()
    H, d = k_src.shape[1], k_src.shape[2]
    want = (H, n * block_size, d)
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} must be a contiguous {want}")
    order = torch.arange(n, device=pages.device)
    copy_pages_to_units(
        k_src, v_src, pages, k_dst.view(H, n, block_size, d), v_dst.view(H, n, block_size, d),
        order,
    )  # fmt: skip
