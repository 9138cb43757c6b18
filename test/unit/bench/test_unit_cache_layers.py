"""The unit-cache model's count of misses (benchmark/studies/unit_cache_layers.py):
a layer reading more blocks than the cache has pages misses the excess whatever the
ways; below that, only units beyond a full set's ways miss; the real refresh (`--kernel`)
caches what the model says fits."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmark" / "studies" / "unit_cache_layers.py"
spec = importlib.util.spec_from_file_location("unit_cache_layers", PATH)
model = importlib.util.module_from_spec(spec)
sys.modules["unit_cache_layers"] = model
spec.loader.exec_module(model)


def test_a_layer_past_the_pages_misses_its_excess_and_fuller_sets_miss_more():
    blocks = model.REQUESTS * model.BLOCKS
    heavy = np.array([0.5])  # 5,688 blocks a head against 2,759 pages
    missed, past = model.host_share(8, heavy)
    n = round(0.5 * blocks)
    assert past == (n - model.CACHE_PAGES) / n
    assert missed >= past  # the pages past capacity miss, and the full sets' overflow too
    light = np.array([0.05])  # 569 a head: about 1.5 a set of 384
    few, none_past = model.host_share(8, light)
    assert none_past == 0 and 0 <= few < 0.01
    assert model.host_share(64, light)[0] <= few


def test_shared_positions_absorb_a_heavy_layer_in_the_light_layers_slots():
    f = np.array([0.5] + [0.01] * 23)  # one layer past the pages, 23 nearly idle
    missed, past = model.host_share(8, f)
    assert past > 0.3 and missed >= past
    assert model.host_share(8, f, shared=True) == (0.0, 0.0)  # 24 layers' slots for it
    over = np.full(24, 0.5)  # every layer past the pages: sharing cannot help
    assert model.host_share(8, over, shared=True)[1] == model.host_share(8, over)[1] > 0


def test_the_studys_shares_are_scaled_to_bs_mean_and_capped():
    f = model.shares()
    assert abs(f.mean() - model.MEAN_READ) < 0.02 and f.max() <= model.READ_CAP
    assert len(f) == 24


def test_the_kernels_refresh_caches_what_the_model_says_fits(monkeypatch):
    """`--kernel` at a small shape: with positions for every unit read the real refresh
    caches them all; with a quarter of the pages, at most the positions."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the study runs the kernel under TRITON_INTERPRET=1 (CI)")
    for name, value in (("REQUESTS", 2), ("BLOCKS", 96), ("POOL_PAGES", 64)):
        monkeypatch.setattr(model, name, value)
    f = np.array([0.5, 0.05, 0.05])  # one heavy layer: past the pages were it alone
    monkeypatch.setattr(model, "CACHE_PAGES", 64)
    full = model.kernel_refresh(f)
    assert full["units_read"] > 64 * 2 and full["cached"] == full["units_read"]
    assert model.host_share(8, f, shared=True)[0] == 0.0
    monkeypatch.setattr(model, "CACHE_PAGES", 16)
    short = model.kernel_refresh(f)
    assert short["cached"] <= short["positions"] == 16 * 3 * 2 < short["units_read"]
    assert short["cached"] > 0.8 * short["positions"]
