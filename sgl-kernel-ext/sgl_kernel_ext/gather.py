"""Copy scattered KV block units between a pinned host pool and HBM slots, one launch.

Per-block `cudaMemcpy` moves 8-16 KB blocks at ~1 GB/s; a kernel whose
programs each copy one unit reads pinned host memory through UVA (zero-copy)
with many loads in flight and approaches the contiguous-copy peak. A *unit* is
a contiguous run of `unit_elems` elements (one KV block of one head, K or V or
both); source and destination are `[num_units, unit_elems]` views of any
dtype, moved as the widest integer words the row size and alignment allow.
The same kernel serves both directions (gather: host -> slots, scatter:
slots -> host).

Host memory on the GPU path: a pinned CPU tensor is passed to the kernel as
is. Triton's launcher resolves every pointer argument with
`cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER)`, which for
page-locked memory returns its device-visible (UVA) address, the same address
`cudaHostGetDevicePointer` gives; no wrapper is needed. Pageable memory has no
such address, so unpinned CPU tensors are refused up front with a clear error.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled


@triton.jit
def _copy_units_kernel(
    src,
    src_idx,
    dst,
    dst_idx,
    count,
    src_stride,
    dst_stride,
    UNIT: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_COUNT: tl.constexpr,
):
    i = tl.program_id(0)
    if HAS_COUNT:
        lim = tl.load(count)
    else:
        lim = count  # the launch size: every program is live
    s = tl.load(src_idx + i).to(tl.int64) * src_stride  # i < launch size: in bounds
    d = tl.load(dst_idx + i).to(tl.int64) * dst_stride
    offs = tl.arange(0, BLOCK)
    live = offs * 0 + i < lim
    for off in tl.static_range(0, UNIT, BLOCK):
        m = (off + offs < UNIT) & live
        tl.store(dst + d + off + offs, tl.load(src + s + off + offs, mask=m), mask=m)


def _word_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type every row, row stride and base address is a multiple of."""
    for dt in (torch.int64, torch.int32, torch.int16):
        if all(
            (t.shape[1] * t.element_size()) % dt.itemsize == 0
            and (t.stride(0) * t.element_size()) % dt.itemsize == 0
            and t.data_ptr() % dt.itemsize == 0
            for t in tensors
        ):
            return dt
    return torch.uint8


def _words(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dt else t.view(torch.uint8).view(dt)


class BlockCopier:
    """Plan for one unit size and dtype; `run()` launches once and allocates nothing.

    `device` is where the kernel runs (the HBM side); `None` takes the device
    of `dst` or `src`, whichever is on CUDA. `block` elements (words) per load
    step and `num_warps` per program are the launch shape the benchmark sweeps;
    copies into host memory (scatter) take `scatter_block`/`scatter_warps`: writes
    across PCIe want more of them in flight per program (H100: 16 warps reach ~95%
    of the D2H memcpy peak where 4 reach ~88%, `bench_gather.py`).
    """

    def __init__(
        self,
        unit_elems: int,
        dtype: torch.dtype,
        device: torch.device | str | None = None,
        *,
        block: int = 2048,
        num_warps: int = 4,
        scatter_block: int = 1024,
        scatter_warps: int = 16,
    ) -> None:
        self.unit_elems, self.dtype = unit_elems, dtype
        self.device = torch.device(device) if device is not None else None
        self.block, self.num_warps = block, num_warps
        self.scatter_block, self.scatter_warps = scatter_block, scatter_warps

    def _check(
        self, src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
    ) -> None:
        for name, t in (("src", src), ("dst", dst)):
            if t.dim() != 2 or t.shape[1] != self.unit_elems or t.stride(1) != 1:
                raise ValueError(
                    f"{name} {tuple(t.shape)} must be [num_units, unit_elems={self.unit_elems}] "
                    "with contiguous rows"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name} dtype {t.dtype} differs from the plan's {self.dtype}")
        if src_idx.numel() != dst_idx.numel():
            raise ValueError(
                f"{src_idx.numel()} source indices but {dst_idx.numel()} destination indices"
            )

    def run(
        self,
        src: torch.Tensor,
        src_idx: torch.Tensor,
        dst: torch.Tensor,
        dst_idx: torch.Tensor,
        count: torch.Tensor | None = None,
    ) -> None:
        """`dst[dst_idx[i]] = src[src_idx[i]]` for all i, in one launch.

        Indices are int32/int64 on the kernel's device; destinations must be
        distinct (sources may repeat). `count`, a one-element integer tensor on
        the kernel's device, limits the copy to the first `count[0]` pairs, so
        a caller whose number of misses is known only on the GPU launches for
        the upper bound without a host sync. On CUDA the host side must be
        pinned. Without CUDA and outside the Triton interpreter this is plain
        torch indexing, which gives the identical result.
        """
        self._check(src, src_idx, dst, dst_idx)
        n = src_idx.numel()
        if n == 0:
            return
        device = self.device or (src.device if src.is_cuda else dst.device)
        if not triton_enabled(device):
            m = n if count is None else int(count.reshape(-1)[0])
            dst[dst_idx[:m].long()] = src[src_idx[:m].long()]
            return
        if device.type == "cuda":
            for name, t in (("src", src), ("dst", dst)):
                if not t.is_cuda and not t.is_pinned():
                    raise ValueError(
                        f"{name} is pageable CPU memory, which the GPU cannot address; "
                        "allocate the host pool with pin_memory=True (or .pin_memory())"
                    )
        wt = _word_dtype(src, dst)
        ws, wd = _words(src, wt), _words(dst, wt)
        unit = ws.shape[1]
        to_host = not dst.is_cuda and device.type == "cuda"
        block, warps = (
            (self.scatter_block, self.scatter_warps) if to_host else (self.block, self.num_warps)
        )
        _copy_units_kernel[(n,)](
            ws,
            src_idx,
            wd,
            dst_idx,
            n if count is None else count,
            ws.stride(0),
            wd.stride(0),
            UNIT=unit,
            BLOCK=min(triton.next_power_of_2(unit), block),
            HAS_COUNT=count is not None,
            num_warps=warps,
        )


def gather_blocks(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """Host pool (pinned; read through UVA) -> HBM slots, one launch for all units."""
    BlockCopier(src.shape[-1], src.dtype).run(src, src_idx, dst, dst_idx)


def scatter_blocks(
    src: torch.Tensor, src_idx: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor
) -> None:
    """HBM slots -> host pool (pinned; written through UVA), one launch for all units."""
    BlockCopier(src.shape[-1], src.dtype).run(src, src_idx, dst, dst_idx)
