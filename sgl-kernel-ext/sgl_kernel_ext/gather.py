"""Copy scattered KV block units between a pinned host pool and HBM slots, one launch.

Per-block `cudaMemcpy` moves 8-16 KB blocks at ~1 GB/s; a kernel whose
programs each copy one unit reads pinned host memory through UVA (zero-copy)
with many loads in flight and approaches the contiguous-copy peak. A *unit* is
a contiguous run of `unit_elems` elements (one KV block of one head, K or V or
both); source and destination are `[num_units, unit_elems]` views of any
dtype. The same kernel serves both directions (gather: host -> slots,
scatter: slots -> host).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_units_kernel(src, src_idx, dst, dst_idx, UNIT: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    s = tl.load(src_idx + i).to(tl.int64) * UNIT
    d = tl.load(dst_idx + i).to(tl.int64) * UNIT
    offs = tl.arange(0, BLOCK)
    for off in tl.static_range(0, UNIT, BLOCK):
        m = off + offs < UNIT
        tl.store(dst + d + off + offs, tl.load(src + s + off + offs, mask=m), mask=m)


def _words(t: torch.Tensor) -> torch.Tensor:
    """The widest integer view of a `[N, unit]` tensor whose rows stay whole."""
    row_bytes = t.shape[1] * t.element_size()
    for dt in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dt).element_size()
        if row_bytes % size == 0 and t.data_ptr() % size == 0:
            return t.view(torch.uint8).view(dt) if t.dtype != dt else t
    return t.view(torch.uint8)


def _use_triton(*tensors: torch.Tensor) -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1" or any(t.is_cuda for t in tensors)


class BlockCopier:
    """Plan for one unit size; `run()` launches once and allocates nothing."""

    def __init__(self, unit_elems: int, dtype: torch.dtype, block: int = 1024, num_warps: int = 4):
        self.unit_elems, self.dtype = unit_elems, dtype
        self.block, self.num_warps = block, num_warps

    def run(
        self, src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
    ) -> None:
        """`dst[dst_idx[i]] = src[src_idx[i]]`; indices are int32/int64 on the launch device.

        Without CUDA and outside the Triton interpreter this is plain torch
        indexing (identical result). Destination indices must be distinct.
        """
        if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1]:
            raise ValueError(
                f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must be "
                "[num_units, unit_elems] with equal unit_elems"
            )
        if src.dtype != dst.dtype:
            raise ValueError(f"dtype mismatch: {src.dtype} vs {dst.dtype}")
        n = src_idx.numel()
        if n != dst_idx.numel():
            raise ValueError(f"{n} source indices but {dst_idx.numel()} destination indices")
        if n == 0:
            return
        if not _use_triton(src, dst):
            dst[dst_idx.long()] = src[src_idx.long()]
            return
        ws, wd = _words(src), _words(dst)
        if ws.dtype != wd.dtype:  # alignment differs: fall back to the common narrower view
            ws, wd = src.view(torch.uint8), dst.view(torch.uint8)
        unit = ws.shape[1]
        _copy_units_kernel[(n,)](
            ws,
            src_idx,
            wd,
            dst_idx,
            UNIT=unit,
            BLOCK=min(triton.next_power_of_2(unit), self.block),
            num_warps=self.num_warps,
        )


def gather_blocks(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Host pool (pinned; read through UVA) -> HBM slots, one launch for all units."""
    BlockCopier(src.shape[1], src.dtype).run(src, src_idx, dst, dst_idx)


def scatter_blocks(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """HBM slots -> host pool (pinned; written through UVA), one launch for all units."""
    BlockCopier(src.shape[1], src.dtype).run(src, src_idx, dst, dst_idx)
