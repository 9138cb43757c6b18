"""Copy full KV pages of one layer, or of every layer, into (KV head, block) units, one
launch.

SGLang stores a layer's KV token-major (`[tokens, heads, head_dim]`, a page =
`block_size` consecutive tokens); the host tier stores it per (KV head, block).
The kernel reorders on the GPU: page `pages[i]`, head `h` lands in unit
`dst[h, dst_blocks[i]]` of `dst [heads, blocks, bs, head_dim]`. Two uses:
- into a device staging buffer (`dst_blocks = 0..n-1`), so each head's blocks
  are one contiguous run that one D2H copy moves and the copy engine scatters
  with plain memcpy (`gather_pages_head_major`);
- straight into the pinned host tier through UVA (`dst_blocks` = host blocks):
  GPU-initiated writes of 4-8 KB runs across PCIe; a decode flush writes every
  layer's blocks in one launch (`copy_layers_to_units`: the host launches once, not
  once a layer).
Reference: `sglang_psa.algo.blockcopy.gather_pages_head_major_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled
from sgl_kernel_ext.unit_cache import LAYER_ALIGN, layer_offset_tensors


# A save's block count varies from call to call (a decode flush's, a prefill job's), and
# the plan's host blocks are the second row of a `[2, n]` table, 16-byte aligned only at
# even n: specialized on them, every new remainder would compile a kernel variant in the
# middle of serving, stalling the scheduler's loop for the compile. The counts and the two
# index pointers are not specialized (the kernel reads them as scalars): every save of a
# shape is one compiled kernel.
@triton.jit(
    do_not_specialize=["layer_units", "units"],
    do_not_specialize_on_alignment=["pages", "blocks"],
)
def _copy_pages_kernel(
    pool_k,
    pool_v,
    pages,
    unit_k,
    unit_v,
    blocks,
    layer_off_k,
    layer_off_v,
    pool_tok_stride,
    pool_head_stride,
    unit_head_stride,
    unit_layer_stride,
    layer_units,
    units,
    H: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    LAYERED: tl.constexpr,
):
    # Units (layer, plan entry, KV head) u = pid, pid + P, ...: one program per unit, or a
    # few persistent programs (a copy through UVA then leaves most SMs to the compute).
    # LAYERED: layer l's buffers lie `layer_off_k/v[l]` elements from `pool_k/v` (multiples
    # of LAYER_ALIGN, which keeps the loads vectorized), its units `l * unit_layer_stride`
    # into `unit_k/v`; otherwise one layer, `layer_units == units`.
    tok = tl.arange(0, BS)
    dim = tl.arange(0, D)
    for u in range(tl.program_id(0), units, tl.num_programs(0)):
        src_k = pool_k
        src_v = pool_v
        dst_k = unit_k
        dst_v = unit_v
        r = u
        if LAYERED:
            layer = u // layer_units
            r = u % layer_units
            src_k += tl.multiple_of(tl.load(layer_off_k + layer), LAYER_ALIGN)
            src_v += tl.multiple_of(tl.load(layer_off_v + layer), LAYER_ALIGN)
            dst_k += layer.to(tl.int64) * unit_layer_stride
            dst_v += layer.to(tl.int64) * unit_layer_stride
        i = r // H
        h = r % H
        page = tl.load(pages + i).to(tl.int64)
        blk = tl.load(blocks + i).to(tl.int64)
        at_pool = (page * BS + tok)[:, None] * pool_tok_stride + h * pool_head_stride
        at_pool += dim[None, :]
        at_unit = h.to(tl.int64) * unit_head_stride + (blk * BS + tok)[:, None] * D
        at_unit += dim[None, :]
        tl.store(dst_k + at_unit, tl.load(src_k + at_pool))
        tl.store(dst_v + at_unit, tl.load(src_v + at_pool))


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
    _copy([k_src], [v_src], pages, k_dst[None], v_dst[None], dst_blocks, programs, None)


def copy_layers_to_units(
    k_bufs: list[torch.Tensor],
    v_bufs: list[torch.Tensor],
    pages: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    dst_blocks: torch.Tensor,
    programs: int | None = None,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """`copy_pages_to_units` for every layer at once, in one launch:
    `k_dst[l, h, dst_blocks[i], t] = k_bufs[l][pages[i]*bs + t, h]` (and V).

    `k_bufs, v_bufs`: the L layers' buffers of SGLang's pool (one dtype, shape and
    strides; lying a multiple of `LAYER_ALIGN` elements apart, else ValueError).
    `k_dst, v_dst`: contiguous `[L, heads, blocks, bs, head_dim]` (the host tier).
    `offsets`: the K and V buffers' `layer_offsets` as int64 `[L]` tensors on the pool's
    device (made here when None: pass them to spare a small copy a call).
    """
    _copy(k_bufs, v_bufs, pages, k_dst, v_dst, dst_blocks, programs, offsets)


def _copy(pool_k, pool_v, pages, unit_k, unit_v, blocks, programs, offsets) -> None:
    n, L = pages.numel(), len(pool_k)
    H, d = pool_k[0].shape[1], pool_k[0].shape[2]
    bs = unit_k.shape[3] if unit_k.dim() == 5 else 0
    for name, t in (("units K", unit_k), ("units V", unit_v)):
        shape = (t.shape[0], t.shape[1], t.shape[4]) if t.dim() == 5 else None
        if shape != (L, H, d) or not t.is_contiguous():
            got, want = tuple(t.shape), f"[{L}, {H}, blocks, bs, {d}]"
            if L == 1:  # one layer's units, as the caller passed them
                got, want = got[1:], f"[{H}, blocks, bs, {d}]"
            raise ValueError(f"{name} {got} must be a contiguous {want}")
        if t.dtype != pool_k[0].dtype:
            raise ValueError(f"{name} dtype {t.dtype} differs from the pool's {pool_k[0].dtype}")
    if len(pool_v) != L or pool_k[0].stride() != pool_v[0].stride() or pool_k[0].stride(2) != 1:
        raise ValueError("K and V pool buffers must share strides with contiguous head dims")
    if L > 1 and offsets is None:
        offsets = layer_offset_tensors(pool_k, pool_v, pages.device)
    if blocks.numel() != n:
        raise ValueError(f"{n} pages but {blocks.numel()} unit blocks")
    if n == 0:
        return
    if not triton_enabled(pool_k[0].device):
        tok = (pages.long()[:, None] * bs + torch.arange(bs)).reshape(-1)
        b = blocks.long()
        for layer in range(L):
            for pool, unit in ((pool_k[layer], unit_k[layer]), (pool_v[layer], unit_v[layer])):
                unit[:, b] = pool[tok].view(n, bs, H, d).permute(2, 0, 1, 3).to(unit.device)
        return
    if bs & (bs - 1) or d & (d - 1):
        raise ValueError(f"block size {bs} and head dim {d} must be powers of two")
    if pool_k[0].is_cuda:
        for name, t in (("units K", unit_k), ("units V", unit_v)):
            if not t.is_cuda and not t.is_pinned():
                raise ValueError(f"{name} are pageable host memory, which the GPU cannot reach")
    units = L * n * H
    off_k, off_v = offsets if L > 1 else (pages, pages)  # unread with one layer
    _copy_pages_kernel[(min(units, programs or units),)](
        pool_k[0],
        pool_v[0],
        pages,
        unit_k,
        unit_v,
        blocks,
        off_k,
        off_v,
        pool_k[0].stride(0),
        pool_k[0].stride(1),
        unit_k.shape[2] * bs * d,
        unit_k.stride(0),
        n * H,
        units,
        H=H,
        BS=bs,
        D=d,
        LAYERED=L > 1,
        num_warps=4,
    )


def gather_pages_head_major(
    k_src: torch.Tensor,
    v_src: torch.Tensor,
    pages: torch.Tensor,
    k_dst: torch.Tensor,
    v_dst: torch.Tensor,
    block_size: int,
    order: torch.Tensor | None = None,
) -> None:
    """`k_dst[h, i*bs + t] = k_src[pages[i]*bs + t, h]` (and V): pages in plan order into a
    contiguous `[heads, n*bs, head_dim]` staging buffer on the pool's device. `order`:
    `arange(n)` on the pages' device, where the caller keeps one (spares an allocation
    and a launch a call); made here when None."""
    n = pages.numel()
    H, d = k_src.shape[1], k_src.shape[2]
    want = (H, n * block_size, d)
    for name, t in (("k_dst", k_dst), ("v_dst", v_dst)):
        if tuple(t.shape) != want or not t.is_contiguous():
            raise ValueError(f"{name} {tuple(t.shape)} must be a contiguous {want}")
    if order is None:
        order = torch.arange(n, device=pages.device)
    elif order.numel() != n:
        raise ValueError(f"order has {order.numel()} entries for {n} pages")
    copy_pages_to_units(
        k_src, v_src, pages, k_dst.view(H, n, block_size, d), v_dst.view(H, n, block_size, d),
        order,
    )  # fmt: skip
