"""Working sets measured on the device from last-use stamps equal the set-based window union
(the scheduler's spec), published by request-table row with the length measured at."""

import pytest
import torch

from sgl_kernel_ext.working_set import (
    block_readers,
    block_readers_ref,
    working_set_parts,
    working_set_ref,
)
from sglang_psa.mem_cache.read_stamps import ReadStamps
from sglang_psa.sched import WorkingSetTracker


@pytest.mark.parametrize("window", [1, 3])
def test_published_sizes_equal_the_union_of_the_last_window_steps(kernel_device, window):
    device = kernel_device
    g = torch.Generator().manual_seed(window)
    L, H, P, BS = 2, 2, 40, 4
    ws = ReadStamps(L, H, P, window, rows=8, block_size=BS, device=device)
    tracker = WorkingSetTracker(window)
    # Two requests with their own pages (no sharing), of 7 and 5 blocks.
    pages = torch.tensor([[3, 9, 1, 22, 7, 30, 11], [5, 6, 8, 14, 2, 0, 0]], device=device)
    pages = pages.to(torch.int32)
    lengths = torch.tensor([27, 18], dtype=torch.int32, device=device)  # 7 and 5 blocks
    rows = torch.tensor([4, 7], device=device)
    for step in range(6):
        ws.begin_step(rows, pages, lengths)  # measures the steps before this one
        if device == "cuda":
            torch.cuda.synchronize()
        sizes, lens = ws.read()
        if step:
            assert [int(sizes[4]), int(sizes[7])] == [tracker.size(0), tracker.size(1)]
            assert [int(lens[4]), int(lens[7])] == [27, 18]
        assert int(lens[5]) == 0  # a row nobody used: never measured
        units = {0: set(), 1: set()}
        for layer in range(L):
            read = torch.rand(2, H, 7, generator=g) < 0.3
            read[1, :, 5:] = False  # past request 1's last block
            ws.mark(layer, pages, read.to(device))
            for b, h, j in read.nonzero().tolist():
                units[b].add((layer, h, j))
        for b in (0, 1):
            tracker.record(b, units[b])


@pytest.mark.parametrize("LH,NB,window", [(48, 1100, 12), (256, 600, 4)])
def test_working_set_kernel_matches_reference_at_real_shapes(kernel_device, LH, NB, window):
    """Qwen 0.5B (24 layers x 2 KV heads) at 35K tokens; Llama 8B (32 x 8) at 19K."""
    g = torch.Generator().manual_seed(LH)
    P, BS, B = 3000, 32, 3
    step = 40
    stamps = torch.randint(0, step + 1, (LH, P), generator=g, dtype=torch.int32)
    pages = torch.randint(1, P, (B, NB), generator=g, dtype=torch.int32)
    lengths = torch.tensor([NB * BS, 1, 300 * BS + 5], dtype=torch.int32)
    dev = kernel_device
    parts = torch.full((B, LH), -1, dtype=torch.int32, device=dev)
    working_set_parts(
        stamps.to(dev), pages.to(dev), lengths.to(dev), torch.tensor([step], device=dev),
        window, BS, parts,
    )  # fmt: skip
    want = working_set_ref(stamps, pages, lengths, step, window, BS)
    assert parts.sum(1).cpu().tolist() == want.tolist()
    assert want[0] > 0 and want[1] <= LH


@pytest.mark.parametrize("LH,NB,window", [(48, 1100, 4), (256, 600, 1)])
def test_block_readers_kernel_matches_reference_at_real_shapes(kernel_device, LH, NB, window):
    """Per block of the batch, the (layer x KV head) units that read it within the window:
    Qwen 0.5B shapes at 35K tokens, Llama 8B's at 19K; never-read stamps (0) count not;
    into uint8, capped at 255 (Llama 8B's 256 units read a block)."""
    g = torch.Generator().manual_seed(LH + window)
    P, B, step = 3000, 3, 40
    stamps = torch.randint(0, step + 1, (LH, P), generator=g, dtype=torch.int32)
    stamps[:, :50] = 0  # never read
    pages = torch.randint(0, P, (B, NB), generator=g, dtype=torch.int32)
    dev = kernel_device
    out = torch.full((B, NB), -1, dtype=torch.int32, device=dev)
    block_readers(stamps.to(dev), pages.to(dev), torch.tensor([step], device=dev), window, out)
    want = block_readers_ref(stamps, pages, step, window)
    assert torch.equal(out.cpu(), want)
    assert 0 < int(want.max()) <= LH and int(want.min()) == 0
    out8 = torch.zeros((B, NB), dtype=torch.uint8, device=dev)  # the heat's bytes: capped
    block_readers(stamps.to(dev), pages.to(dev), torch.tensor([step], device=dev), window, out8)
    assert torch.equal(out8.cpu(), want.clamp(max=255).to(torch.uint8))
    every = torch.full_like(stamps, step).to(dev)  # every unit read every block just now
    block_readers(every, pages.to(dev), torch.tensor([step], device=dev), window, out8)
    assert (out8.cpu() == min(LH, 255)).all()


def test_published_heat_is_each_held_rows_block_readers(kernel_device):
    """`heat()` maps every request-table row the last batch held to its blocks' readers
    (`block_readers_ref` of the stamps before the step, capped at 255), and no other row."""
    from sglang_psa.mem_cache.read_stamps import HEAT_WINDOW

    dev = kernel_device
    g = torch.Generator().manual_seed(5)
    L, H, P, BS, NB = 2, 2, 40, 4, 6
    ws = ReadStamps(L, H, P, 2, rows=8, block_size=BS, device=dev, heat_blocks=NB)
    ws.step.fill_(9)
    ws.stamps.copy_(torch.randint(0, 10, (L * H, P), generator=g, dtype=torch.int32))
    pages = torch.randint(1, P, (2, NB), generator=g, dtype=torch.int32)
    want = block_readers_ref(ws.stamps.cpu(), pages, 9, HEAT_WINDOW)
    rows = torch.tensor([4, 7])
    ws.begin_step(rows.to(dev), pages.to(dev), torch.tensor([NB * BS] * 2, device=dev))
    if dev == "cuda":
        torch.cuda.synchronize()
    heat = ws.heat()
    assert sorted(heat) == [4, 7]
    for i, row in enumerate([4, 7]):
        assert heat[row].tolist() == want[i].clamp(max=255).tolist()
