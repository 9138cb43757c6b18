"""The kernel benchmark's page-gather probe (`bench_wave.read_pages`, the `--readers` row
that reads a selection's bytes with no attention): it reads exactly the K and V of the
pages in its table, whatever the tile, programs per head and pipeline depth, against the
torch sum (under Triton's interpreter on CPU, compiled on a GPU)."""

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmark" / "kernels"))

import bench_wave  # noqa: E402


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tok,splits,stages", [(32, 4, 2), (64, 8, 3), (128, 2, 2)])
def test_read_pages_sums_exactly_the_pages_of_its_table(kernel_device, d, tok, splits, stages):
    g = torch.Generator().manual_seed(0)
    bs, hkv, batch, n_pages, n = bench_wave.BS, 2, 3, 90, 37
    kbuf = torch.randn(n_pages * bs, hkv, d, generator=g).to(torch.bfloat16)
    vbuf = torch.randn(n_pages * bs, hkv, d, generator=g).to(torch.bfloat16)
    # a different choice of n pages per (request, KV head), in no order
    table = torch.stack([torch.randperm(n_pages, generator=g)[:n] for _ in range(batch * hkv)])
    table = table.view(batch, hkv, n).to(torch.int32)
    kbuf, vbuf, table = (t.to(kernel_device) for t in (kbuf, vbuf, table))
    out = torch.full((batch, hkv, splits), float("nan"), device=kernel_device)
    bench_wave.read_pages(kbuf, vbuf, table, out, tok=tok, warps=2, stages=stages)
    want = bench_wave.read_pages_reference(kbuf, vbuf, table)
    torch.testing.assert_close(out.sum(-1), want, rtol=1e-4, atol=1e-2)
    # the other head's pages are not what it read
    swapped = bench_wave.read_pages_reference(kbuf, vbuf, table.flip(1))
    assert not torch.allclose(out.sum(-1), swapped, rtol=1e-4, atol=1e-2)


def test_attention_over_pages_is_each_query_heads_softmax_over_its_kv_heads_pages():
    """The reference `--readers` checks FA3's compacted-table reads against."""
    g = torch.Generator().manual_seed(1)
    bs, hkv, G, d, batch, n_pages, n = bench_wave.BS, 2, 3, 64, 2, 12, 5
    kbuf = torch.randn(n_pages * bs, hkv, d, generator=g)
    vbuf = torch.randn(n_pages * bs, hkv, d, generator=g)
    q = torch.randn(batch, hkv * G, d, generator=g)
    table = torch.stack([torch.randperm(n_pages, generator=g)[:n] for _ in range(batch * hkv)])
    table = table.view(batch, hkv, n).to(torch.int32)
    got = bench_wave._attention_over_pages(q, kbuf, vbuf, table)
    for b in range(batch):
        for hq in range(hkv * G):
            h = hq // G
            rows = torch.cat([torch.arange(p * bs, (p + 1) * bs) for p in table[b, h].tolist()])
            w = torch.softmax(kbuf[rows, h] @ q[b, hq] * d**-0.5, dim=0)
            torch.testing.assert_close(got[b, hq], w @ vbuf[rows, h], rtol=1e-4, atol=1e-5)
