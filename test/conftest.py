"""Shared test setup: GPU tests are skipped with a visible reason where no GPU exists."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. It is
# chosen when a kernel is defined, so it must be set before any kernel module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm2():
    """The small real model (SmolLM2-135M) with the psa attention function selected."""
    from sglang_psa.hf.decode import load_model
    from sglang_psa.models import ensure_model

    return load_model(ensure_model("smollm2-135m"))
