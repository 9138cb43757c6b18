"""Where the Triton kernels run: compiled on a CUDA device, or under Triton's interpreter
on CPU (`TRITON_INTERPRET=1`, the tests); otherwise each wrapper takes its torch path.

Programmatic dependent launch (PDL, sm_90 on): a decode layer's kernels (block metadata,
scoring, ranking, wave attention) each depend on the one before. Launched with PDL, a
kernel's programs may be scheduled while the previous kernel's last programs still run;
each program first waits (`pdl_enter`) until the previous kernel has finished and its
writes are visible, then lets the next kernel launch. Every program waits before its
first load, so each kernel sees exactly what it would see launched normally: only the
launch latency between the two overlaps.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton's grid dependency control (PDL) and its launch option
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _HAS_PDL = "launch_pdl" in CUDAOptions.__dataclass_fields__
except ImportError:  # pragma: no cover - an older Triton: `pdl_supported` is False
    _HAS_PDL = False
    gdc_wait = gdc_launch_dependents = None


def triton_enabled(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def pdl_supported(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be launched with PDL: compiled (not the
    interpreter) on sm_90 or later, by a Triton whose launcher takes `launch_pdl`."""
    dev = torch.device(device)
    if not _HAS_PDL or dev.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return _capability(dev.index if dev.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def check_pdl(pdl: bool, device: torch.device | str) -> None:
    """Refuse a PDL launch where it cannot run (a wrapper's `pdl=True` on such a device)."""
    if pdl and not pdl_supported(device):
        raise ValueError(
            "programmatic dependent launch needs compiled kernels on sm_90 or later and a "
            f"Triton with launch_pdl; not available on {device}"
        )


def pdl_launch(pdl: bool) -> dict:
    """The launch arguments of a kernel that starts with `pdl_enter(PDL)`: its `PDL`
    constexpr and, for a PDL launch only, the launch option (a Triton without it still
    runs every other launch)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of a kernel launched with `launch_pdl=PDL`: wait for the previous
    kernel (its writes visible), then let the next one launch. A no-op without PDL."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
