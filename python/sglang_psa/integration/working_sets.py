"""Working-set sizes counted on the GPU, from per-block last-use stamps.

Keeping each request's window as Python sets costs O(blocks read) per step on
the host (hundreds of thousands of tuples for a batch of long requests). Here
every (layer, KV head, page) keeps the decode step that last read it; a
request's working set is the number of its own blocks stamped within the
last `window` steps. Marking is a masked scatter per layer with no sync;
measuring is one gather and one small copy to the host per step. Pages shared
through prefix caching carry one stamp, so a shared page read by one request
counts for all holders: conservative for admission.
"""

from __future__ import annotations

import torch


class WorkingSetStamps:
    def __init__(self, layers: int, kv_heads: int, num_pages: int, window: int, device):
        self.layers, self.kv_heads, self.num_pages = layers, kv_heads, num_pages
        self.window = window
        # One extra entry absorbs the writes of blocks not read.
        self.stamps = torch.zeros(
            layers * kv_heads * num_pages + 1, dtype=torch.int32, device=device
        )
        self.step = 0
        self._last = None  # (req_pool_idx, pages, lengths) of the last decode step

    def begin_step(self, req_pool_idx: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor):
        self.step += 1
        self._last = (req_pool_idx, pages, lengths)

    def mark(self, layer: int, pages: torch.Tensor, read: torch.Tensor) -> None:
        """`read [B, Hkv, NB]` blocks of `pages [B, NB]` were read by `layer` this step."""
        H, P = self.kv_heads, self.num_pages
        heads = torch.arange(H, device=pages.device)[None, :, None]
        idx = (layer * H + heads) * P + pages[:, None, :]
        idx = torch.where(read, idx, self.stamps.numel() - 1)
        self.stamps.index_fill_(0, idx.flatten(), self.step)

    def measure(self, block_size: int) -> tuple[list[int], list[int], list[int]] | None:
        """(request-table rows, window working-set sizes, units owned) of the last decode
        step, once (later calls return None until the next step)."""
        if self._last is None:
            return None
        rpi, pages, lengths = self._last
        self._last = None
        LH, P = self.layers * self.kv_heads, self.num_pages
        B, NB = pages.shape
        table = self.stamps[:-1].view(LH, P)[:, pages]  # [LH, B, NB]
        own = (
            torch.arange(NB, device=pages.device)[None, :]
            < ((lengths + block_size - 1) // block_size)[:, None]
        )
        recent = (table > max(0, self.step - self.window)) & own[None]  # 0: never read
        sizes = recent.sum((0, 2))
        totals = own.sum(1) * LH
        return rpi.tolist(), sizes.tolist(), totals.tolist()
