"""The ranking study's measure: blocks read in an estimate's order (forced blocks first)
until every head of the group has covered ε of its true mass."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sglang_psa.config import PSAConfig

PATH = Path(__file__).resolve().parents[3] / "benchmark" / "studies" / "ranking_study.py"
spec = importlib.util.spec_from_file_location("ranking_study", PATH)
study = importlib.util.module_from_spec(spec)
sys.modules["ranking_study"] = study
spec.loader.exec_module(study)


def _shares(heavy: list[int], nb: int = 10) -> torch.Tensor:
    """Log mass shares `[1, len(heavy), nb]`: 0.9 on one block per head, the rest spread."""
    share = torch.full((len(heavy), nb), 0.1 / (nb - 1))
    for h, j in enumerate(heavy):
        share[h, j] = 0.9
    return share.log()[None]


def test_the_true_order_reads_the_heavy_block_right_after_the_forced_ones():
    cfg = PSAConfig(block_size=32, sink_blocks=1, recent_blocks=1)
    lengths = torch.tensor([320])  # 10 blocks; 0 and 9 are forced
    true = _shares([5])
    k = torch.zeros(1, 1, 320, 4)
    oracle = study.estimate("oracle", None, k, lengths, None, 32, 1.0, true)
    got = study.needed_fraction(oracle, true, lengths, cfg, eps=0.9)
    assert float(got) == pytest.approx(0.3)  # blocks 0, 9, then 5: 0.9 + 2/90 >= 0.9
    # The reverse order finds the heavy block last: everything is read.
    got = study.needed_fraction(-oracle, true, lengths, cfg, eps=0.9)
    assert float(got) == pytest.approx(1.0)


def test_a_group_waits_for_its_slowest_head():
    cfg = PSAConfig(block_size=32, sink_blocks=1, recent_blocks=1)
    lengths = torch.tensor([320])
    true = _shares([5, 3])  # two query heads of one KV head, heavy in different blocks
    key = torch.arange(10, 0, -1, dtype=torch.float32)[None, None]  # index order
    got = study.needed_fraction(key, true, lengths, cfg, eps=0.9)
    # Forced 0 and 9, then 1, 2, 3 (head 1 covered), 4, 5 (head 0 covered): 7 blocks.
    assert float(got) == pytest.approx(0.7)
