"""Strided DMA: one copy-engine operation for a block run of every KV head.

The host tier is (layer, KV head, block)-major, so a run of host blocks is contiguous
within one head and the heads lie a (layer, head) slab apart. Moving a run with one
`copy_` per head costs a host call and a gap on the copy engine per head (1 MB copies
at the 8B shape: the gaps and the Python issue rate held the write-back to 0.78 of the
D2H peak). `cudaMemcpy2DAsync` moves the run of all heads as one operation: `height`
rows (the heads) of `width` bytes, each side with its own row pitch.

The function comes from the CUDA runtime that torch already loaded (found in
`/proc/self/maps`, so it is the same library and the same context). Where it cannot be
found, `StridedCopy.api` says `per-row` and every row is one `copy_` (the server logs
it once at startup; the write-back report carries it).
"""

from __future__ import annotations

import ctypes
import logging
import os

import torch

logger = logging.getLogger(__name__)

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from unified addresses
MAX_PITCH = 2**31 - 1  # cudaDevAttrMaxPitch on current GPUs


def _loaded_cudart() -> str | None:
    """Path of the `libcudart` this process has mapped (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libcudart") and ".so" in path:
                    return path
    except OSError:
        return None
    return None


class StridedCopy:
    """`copy(dst, src, stream)`: `dst[i] = src[i]` for every row of two 2-D views whose
    rows are contiguous (any row stride), on `stream`, without a host sync.

    On CUDA with the runtime found: one `cudaMemcpy2DAsync` (`api == "memcpy2d"`). On
    the CPU, or without it (`api == "per-row"`): one `copy_` per row. The caller keeps
    both tensors alive until the stream has passed the copy (the write-back's buffers
    are persistent)."""

    def __init__(self, device: torch.device):
        self._fn = None
        self.api = "per-row"
        self._warned_pitch = False
        if device.type != "cuda":
            return
        path = _loaded_cudart()
        if path is None:
            logger.warning(
                "sglang-psa: libcudart is not mapped in this process: the write-back's DMA "
                "moves a run with one copy per KV head (slower)"
            )
            return
        fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]
        fn.argtypes += [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._fn, self.api = fn, "memcpy2d"

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        if dst.shape != src.shape or dst.dim() != 2 or dst.dtype != src.dtype:
            raise ValueError(f"strided copy of {tuple(src.shape)} into {tuple(dst.shape)}")
        if dst.stride(1) != 1 or src.stride(1) != 1:
            raise ValueError("strided copy: rows must be contiguous")
        es = dst.element_size()
        dpitch, spitch = dst.stride(0) * es, src.stride(0) * es
        if self._fn is None or max(dpitch, spitch) > MAX_PITCH:
            if self._fn is not None and not self._warned_pitch:
                self._warned_pitch = True
                logger.warning(
                    "sglang-psa: a host-tier row pitch of %d bytes exceeds cudaMemcpy2DAsync's "
                    "%d: such runs move with one copy per KV head (slower)",
                    max(dpitch, spitch), MAX_PITCH,
                )  # fmt: skip
            for i in range(dst.shape[0]):
                dst[i].copy_(src[i], non_blocking=True)
            return
        width, height = dst.shape[1] * es, dst.shape[0]
        err = self._fn(
            dst.data_ptr(), dpitch, src.data_ptr(), spitch, width, height, _MEMCPY_DEFAULT,
            stream.cuda_stream,
        )  # fmt: skip
        if err:
            raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {err}")
