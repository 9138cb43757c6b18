"""Block metadata for SGLang's KV pages: the criticality inputs of the wave kernel.

One SGLang page is one PSA block, so metadata is kept per (layer, page) and is
shared by every request whose table holds the page (prefix sharing for free).
A page's keys change only after SGLang hands it out again, so `invalidate`
(fed by the allocator hook with the token slots it allocated) clears it, and
`refresh` computes the missing ones, for full pages only: the partial tail
page is always attended and never ranked. Per layer `[pages, Hkv, d]` float32
mean keys, plus per-channel min/max when the stop rule or the score needs
key bounds.
"""

from __future__ import annotations

import torch


class PageMeta:
    def __init__(
        self,
        layers: int,
        num_pages: int,
        kv_heads: int,
        head_dim: int,
        page_size: int,
        bounds: bool,
        device: torch.device | str,
    ):
        shape = (layers, num_pages, kv_heads, head_dim)
        f32 = dict(dtype=torch.float32, device=device)
        self.page_size = page_size
        self.mean = torch.zeros(shape, **f32)
        self.kmin = torch.zeros(shape, **f32) if bounds else None
        self.kmax = torch.zeros(shape, **f32) if bounds else None
        self.valid = torch.zeros(num_pages, dtype=torch.bool, device=device)

    def invalidate(self, token_slots: torch.Tensor) -> None:
        """The pages holding these newly allocated token slots get new keys."""
        self.valid.index_fill_(0, token_slots.long() // self.page_size, False)

    def stale(self, pages: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """Distinct full pages among `pages` whose metadata is missing (one host sync)."""
        need = full & ~self.valid[pages]
        return torch.unique(pages[need])

    def refresh(self, layer: int, k_buffer: torch.Tensor, pages: torch.Tensor) -> None:
        """Compute `pages`' metadata of `layer` from SGLang's `[tokens, Hkv, d]` keys."""
        if pages.numel() == 0:
            return
        H, d = k_buffer.shape[1:]
        k = k_buffer.view(-1, self.page_size, H, d)[pages].float()  # [n, bs, Hkv, d]
        self.mean[layer, pages] = k.mean(1)
        if self.kmin is not None:
            self.kmin[layer, pages] = k.amin(1)
            self.kmax[layer, pages] = k.amax(1)

    def mark_valid(self, pages: torch.Tensor) -> None:
        self.valid[pages] = True

    def layer(self, layer: int):
        """`[pages, Hkv, d]` mean, min, max of `layer` (min/max are the mean when bounds
        are not kept: the scoring kernel then does not read them)."""
        mean = self.mean[layer]
        if self.kmin is None:
            return mean, mean, mean
        return mean, self.kmin[layer], self.kmax[layer]
