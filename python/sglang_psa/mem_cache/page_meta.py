"""Block metadata of SGLang's KV pages: the criticality inputs of the wave kernel.

One SGLang page is one PSA block, so metadata is kept per (layer, page) and is
shared by every request whose table holds the page (prefix sharing for free).
It is produced where keys are written, never scanned for (`sgl_kernel_ext.metadata`):
after each prefill extend for every page the extend wrote (every layer in one launch,
once the last layer is written), and in each decode
step for the page of every new token (so a partial tail page is current and a
page that fills is final). A page SGLang hands out again is rewritten by the
same path before it is read. At the tiered home the table has a row per host
block beside the page rows (`host_rows`): each save copies its page's rows there
(`writeback`), and a block read from the host tier is scored from there, whether
residency gave its page back or SGLang's tree freed it and a later match maps it.
Per layer `[rows, Hkv, d]` vectors in the KV
dtype (bf16 min/max of bf16 keys are exact; the scoring kernel reads them in
float32): the mean key when the score is the mean, per-channel min and max when
the score or the stop rule needs key bounds, nothing it would not read. With
`bound_bits=8` the bounds are int8 codes with a float32 scale per (page, KV head)
(`kscale`), rounded outward: half the bytes the ranking reads per block.

With `code_bits` (the certified rule) a page also keeps its keys' codes: per (layer, page,
KV head) the per-channel range of its keys `[code_lo, code_hi]` (float32) and each key
as a cell of it in `code_bits` bit planes (`sgl_kernel_ext.code_bounds.encode_pages`),
written on the same path, as far as the page is written; the wave kernel bounds each
block's mass from them (`code_bounds(pages=)`).
"""

from __future__ import annotations

import torch

from sgl_kernel_ext.code_bounds import encode_pages
from sgl_kernel_ext.metadata import page_meta_from_table_layers
from sgl_kernel_ext.runtime import triton_enabled
from sgl_kernel_ext.unit_cache import LayerOffsetCache
from sglang_psa.config import PSAConfigError


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
        host_rows: int = 0,
        bound_bits: int = 16,
        code_bits: int = 0,
    ):
        if not (mean or bounds):
            raise ValueError("PageMeta keeps the mean key, the key bounds, or both")
        shape = (layers, num_pages + host_rows, kv_heads, head_dim)
        kw = dict(dtype=key_dtype, device=device)
        self.page_size, self.num_pages = page_size, num_pages
        self._key_offsets = LayerOffsetCache()  # the key buffers' layer offsets, made once
        self.page_rows = num_pages  # rows from here on belong to host blocks
        self.mean = torch.zeros(shape, **kw) if mean else None
        codes = bounds and bound_bits == 8
        bkw = dict(dtype=torch.int8, device=device) if codes else kw
        self.kmin = torch.zeros(shape, **bkw) if bounds else None
        self.kmax = torch.zeros(shape, **bkw) if bounds else None
        self.kscale = torch.zeros(shape[:-1], device=device) if codes else None
        self.planes = self.code_lo = self.code_hi = None
        if code_bits:
            if head_dim % 8:
                raise PSAConfigError(
                    "stop_rule", f"certified: key codes need a head dim that is a multiple of "
                    f"8; this model's is {head_dim}",
                )  # fmt: skip
            planes = (*shape[:-1], code_bits, page_size, head_dim // 8)
            self.planes = torch.zeros(planes, dtype=torch.uint8, device=device)
            self.code_lo = torch.zeros(shape, device=device)
            self.code_hi = torch.zeros(shape, device=device)

    @property
    def _tensors(self):
        return (self.mean, self.kmin, self.kmax, self.kscale, self.planes, self.code_lo,
                self.code_hi)  # fmt: skip

    def codes(self, layer: int):
        """`(planes, lo, hi)` of `layer`'s pages (`[rows, Hkv, bits, bs, d / 8]` uint8,
        `[rows, Hkv, d]` float32 twice), or None without key codes."""
        if self.planes is None:
            return None
        return self.planes[layer], self.code_lo[layer], self.code_hi[layer]

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors if t is not None)

    def _kept(self, layer: int):
        return tuple(None if t is None else t[layer] for t in self._tensors[:4])

    def new_keys(self, layer: int, k_buffer: torch.Tensor, locs: torch.Tensor) -> tuple:
        """A decode step wrote one key per request at token slots `locs [B]`: the wave
        kernel's `run(new_keys=)`, which writes their pages' metadata (before the ranking
        that reads it, or beside it for rows that keep their selection)."""
        return (k_buffer, locs, *self._kept(layer))

    def encode_new_keys(self, layer: int, k_buffer: torch.Tensor, locs: torch.Tensor) -> None:
        """The certified rule's key codes of the pages of the step's new keys at `locs
        [B]`, as far as written (nothing without `code_bits`)."""
        if self.planes is not None:
            encode_pages(k_buffer, locs, *self.codes(layer))

    def on_extend(
        self,
        k_bufs: list[torch.Tensor],
        req_to_token: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        ends: torch.Tensor,
        max_pages: int,
    ) -> None:
        """An extend wrote tokens `[starts, ends)` of the requests in `req_to_token` rows
        `rows`, in every layer (`k_bufs`: SGLang's key buffers, one a layer); `max_pages`
        bounds the pages one request's extend touched. One launch for every layer's
        metadata (and one a layer for the key codes)."""
        # (the CPU's torch path reads no offsets, and takes buffers lying anywhere)
        on_gpu = triton_enabled(k_bufs[0].device)
        offsets = self._key_offsets(k_bufs, k_bufs, k_bufs[0].device)[0] if on_gpu else None
        page_meta_from_table_layers(
            k_bufs, req_to_token, rows, starts, ends, max_pages, self.page_size,
            *self._tensors[:4], offsets=offsets,
        )  # fmt: skip
        if self.planes is not None:
            pages, counts = _extended_pages(req_to_token, rows, starts, ends, max_pages,
                                            self.page_size)  # fmt: skip
            for layer, k_buffer in enumerate(k_bufs):
                encode_pages(k_buffer, pages, *self.codes(layer), counts=counts)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's metadata of rows `src` into rows `dst` (int64 device tensors)."""
        for t in self._tensors:
            if t is not None:
                t.index_copy_(1, dst, t.index_select(1, src))

    def layer(self, layer: int):
        """`[rows, Hkv, d]` mean, min, max of `layer`, and the bounds' `[rows, Hkv]` scale
        when they are 8-bit codes (else None). What is not kept is replaced by a kept
        tensor, which the scoring kernel then does not read."""
        kept = self.mean if self.mean is not None else self.kmin
        mean = kept[layer]
        if self.kmin is None:
            return mean, mean, mean, None
        scale = None if self.kscale is None else self.kscale[layer]
        return mean, self.kmin[layer], self.kmax[layer], scale


def _extended_pages(req_to_token, rows, starts, ends, max_pages: int, bs: int):
    """`(pages, counts)` `[rows x max_pages]` int32: every page an extend of tokens
    `[starts, ends)` wrote into (-1 past a request's), with the tokens it holds now
    (device ops, no sync)."""
    starts, ends = starts.long(), ends.long()
    j = (starts // bs)[:, None] + torch.arange(max_pages, device=starts.device)[None, :]
    first_tok = j * bs
    written = (first_tok < ends[:, None]) & (ends > starts)[:, None]
    col = first_tok.clamp(max=req_to_token.shape[1] - 1)
    slots = req_to_token[rows.long()[:, None], col]
    pages = torch.where(written, slots // bs, -1).to(torch.int32)
    counts = (ends[:, None] - first_tok).clamp(1, bs).to(torch.int32)
    return pages.flatten(), counts.flatten()
