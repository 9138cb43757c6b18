"""Where the Triton kernels run: compiled on a CUDA device, or under Triton's interpreter
on CPU (`TRITON_INTERPRET=1`, the tests); otherwise each wrapper takes its torch path."""

from __future__ import annotations

import os

import torch


def triton_enabled(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
