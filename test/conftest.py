"""Shared test setup: GPU tests are skipped with a visible reason where no GPU exists."""

from __future__ import annotations

import pytest
import torch


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
