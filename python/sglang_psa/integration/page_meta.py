"""Block metadata for SGLang's KV pages: the criticality inputs of the wave kernel.

One SGLang page is one PSA block, so metadata is kept per (layer, page) and is
shared by every request whose table holds the page (prefix sharing for free).
A page's keys change only after SGLang hands it out again, so `invalidate`
(fed by the allocator hook with the token slots it allocated) clears it, and
`refresh` computes the missing ones, for full pages only: the partial tail
page is always attended and never ranked. Per layer `[pages, Hkv, d]` vectors
in the KV dtype (bf16 min/max of bf16 keys are exact; the scoring kernel reads
them in float32): the mean key when the score is the mean, per-channel min and
max when the score or the stop rule needs key bounds, nothing it would not read.
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
        *,
        mean: bool,
        bounds: bool,
        key_dtype: torch.dtype,
        device: torch.device | str,
    ):
        if not (mean or bounds):
            raise ValueError("PageMeta keeps the mean key, the key bounds, or both")
        shape = (layers, num_pages, kv_heads, head_dim)
        kw = dict(dtype=key_dtype, device=device)
        self.page_size = page_size
        self.mean = torch.zeros(shape, **kw) if mean else None
        self.kmin = torch.zeros(shape, **kw) if bounds else None
        self.kmax = torch.zeros(shape, **kw) if bounds else None
        self.valid = torch.zeros(num_pages, dtype=torch.bool, device=device)

    @property
    def bytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.mean, self.kmin, self.kmax) if t is not None
        )

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
        k = k_buffer.view(-1, self.page_size, H, d)[pages]  # [n, bs, Hkv, d]
        if self.mean is not None:
            self.mean[layer, pages] = k.float().mean(1).to(self.mean.dtype)
        if self.kmin is not None:  # exact in the keys' own dtype
            self.kmin[layer, pages] = k.amin(1)
            self.kmax[layer, pages] = k.amax(1)

    def mark_valid(self, pages: torch.Tensor) -> None:
        self.valid[pages] = True

    def layer(self, layer: int):
        """`[pages, Hkv, d]` mean, min, max of `layer`. What is not kept is replaced by a
        kept tensor, which the scoring kernel then does not read."""
        kept = self.mean if self.mean is not None else self.kmin
        mean = kept[layer]
        if self.kmin is None:
            return mean, mean, mean
        return mean, self.kmin[layer], self.kmax[layer]
