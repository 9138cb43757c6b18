"""CUDA tensors that live in page-locked host memory (unified virtual addressing).

Under UVA a registered host page has the same address on the GPU, so a CUDA
tensor over it lets unmodified GPU code (SGLang's KV store kernel, its Triton
prefill attention, our wave kernel) read and write host memory across PCIe.
That is how SGLang's KV pool moves to the host: every kernel keeps its pointer
arithmetic, only the bytes travel further.
"""

from __future__ import annotations

import torch

from sglang_psa.mem_cache.host_pool import register_host, unregister_host

# __cuda_array_interface__ has no bfloat16: alias by an integer of the same width.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TYPESTR = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}


class _Alias:
    """Presents a registered host tensor to `torch.as_tensor` as CUDA memory; torch keeps
    this object (and so the host tensor) alive as long as the CUDA tensor."""

    def __init__(self, host: torch.Tensor):
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR[host.dtype],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def device_view(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A CUDA tensor on `device` aliasing contiguous, registered host tensor `host`."""
    if not host.is_contiguous() or host.device.type != "cpu":
        raise ValueError("device_view needs a contiguous CPU tensor")
    as_int = host.view(_INT_OF_WIDTH[host.element_size()])
    with torch.cuda.device(torch.device(device)):
        view = torch.as_tensor(_Alias(as_int), device=device)
    if view.data_ptr() != host.data_ptr():
        raise RuntimeError("the CUDA view of host memory got a different address (no UVA?)")
    return view.view(host.dtype)


class HostResident:
    """Zeroed host memory of `shape` for a CUDA `device`: registered once, and seen by the
    GPU through `view` (on a CPU device `view` is the host tensor itself)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
        self.device = torch.device(device)
        self.host = torch.zeros(shape, dtype=dtype)
        self.registered = False
        if self.device.type == "cuda":
            register_host(self.host)
            self.registered = True
            self.view = device_view(self.host, self.device)
        else:
            self.view = self.host

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()

    def close(self) -> None:
        if self.registered:
            unregister_host(self.host)
            self.registered = False
