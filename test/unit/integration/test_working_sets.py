"""GPU-side working-set sizes (last-use stamps) equal the set-based window union."""

import pytest
import torch

from sglang_psa.integration.working_sets import WorkingSetStamps
from sglang_psa.sched import WorkingSetTracker

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 3])
def test_stamp_counts_equal_the_union_of_the_last_window_steps(device, window):
    g = torch.Generator().manual_seed(window)
    L, H, P, BS = 2, 2, 40, 4
    stamps = WorkingSetStamps(L, H, P, window, device)
    tracker = WorkingSetTracker(window)
    # Two requests with their own pages (no sharing), of 7 and 5 blocks.
    pages = torch.tensor([[3, 9, 1, 22, 7, 30, 11], [5, 6, 8, 14, 2, 0, 0]], device=device)
    lengths = torch.tensor([27, 18], device=device)  # 7 and 5 blocks
    rows = torch.tensor([4, 7], device=device)
    for _ in range(6):
        stamps.begin_step(rows, pages, lengths)
        units = {0: set(), 1: set()}
        for layer in range(L):
            read = torch.rand(2, H, 7, generator=g) < 0.3
            read[1, :, 5:] = False  # past request 1's last block
            stamps.mark(layer, pages, read.to(device))
            for b, h, j in read.nonzero().tolist():
                units[b].add((layer, h, j))
        for b in (0, 1):
            tracker.record(b, units[b])
        got_rows, sizes, totals = stamps.measure(BS)
        assert got_rows == [4, 7]
        assert sizes == [tracker.size(0), tracker.size(1)]
        assert totals == [7 * L * H, 5 * L * H]
        assert stamps.measure(BS) is None
