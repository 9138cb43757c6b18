"""Per-block key summaries that criticality scoring and the certified stop rule read.

For every (request, KV head, block) we keep the cuboid mean of the keys and the
per-channel min and max. Layout: keys are `[B, Hkv, T, d]`, padded past each
request's length; summaries are `[B, Hkv, NB, d]` with `NB = ceil(T / block_size)`.
Blocks past a request's length have `count == 0` and must be ignored by readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class BlockMeta(NamedTuple):
    mean: torch.Tensor  # [B, Hkv, NB, d] float32
    kmin: torch.Tensor  # [B, Hkv, NB, d] float32, per-channel min over the block's keys
    kmax: torch.Tensor  # [B, Hkv, NB, d] float32, per-channel max
    count: torch.Tensor  # [B, NB] int64, tokens in the block (0 = empty)


def num_blocks(lengths: torch.Tensor, block_size: int) -> torch.Tensor:
    return (lengths + block_size - 1) // block_size


def block_metadata(k: torch.Tensor, lengths: torch.Tensor, block_size: int) -> BlockMeta:
    """Summaries of all blocks, computed from scratch (the spec of `BlockMetaCache`)."""
    B, H, T, d = k.shape
    nb = (T + block_size - 1) // block_size
    pad = nb * block_size - T
    kf = torch.nn.functional.pad(k.float(), (0, 0, 0, pad)).view(B, H, nb, block_size, d)
    pos = torch.arange(nb * block_size, device=k.device).view(1, nb, block_size)
    valid = (pos < lengths.view(B, 1, 1)).view(B, 1, nb, block_size, 1)
    count = valid.view(B, nb, block_size).sum(-1)
    ksum = (kf * valid).sum(3)
    mean = ksum / count.clamp(min=1).view(B, 1, nb, 1)
    kmin = torch.where(valid, kf, torch.inf).amin(3)
    kmax = torch.where(valid, kf, -torch.inf).amax(3)
    empty = (count == 0).view(B, 1, nb, 1)
    kmin = kmin.masked_fill(empty, 0.0)
    kmax = kmax.masked_fill(empty, 0.0)
    return BlockMeta(mean, kmin, kmax, count)


def bound_codes(
    kmin: torch.Tensor, kmax: torch.Tensor, bits: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key bounds `[..., d]` as `bits`-bit integer codes with one float32 scale per vector
    pair (per block and KV head): `(qmin, qmax, scale [...])`, `kmin >= qmin * scale` and
    `kmax <= qmax * scale` in float32, so the bounds read back still bound every key
    (Quest's score and the certified rule stay valid) in `bits` instead of 16 bits a
    channel. This float32 arithmetic is the metadata kernel's, step for step:

    scale = max |bound| * (1 + 2^-20) / (2^(bits-1) - 1)   (the margin keeps codes in range)
    qmin  = floor(kmin / scale), one lower if qmin * scale > kmin   (float rounding)
    qmax  = ceil(kmax / scale),  one higher if qmax * scale < kmax
    """
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in [2, 8], got {bits}")
    lo, hi = kmin.float(), kmax.float()
    amax = torch.maximum(lo.abs(), hi.abs()).amax(-1)
    scale = torch.clamp(amax * _code_step(bits), min=1e-30)
    s = scale[..., None]
    qlo = torch.floor(lo / s)
    qlo = torch.where(qlo * s > lo, qlo - 1, qlo)
    qhi = torch.ceil(hi / s)
    qhi = torch.where(qhi * s < hi, qhi + 1, qhi)
    top = 2 ** (bits - 1)
    return qlo.clamp(-top, top - 1), qhi.clamp(-top, top - 1), scale


def _code_step(bits: int) -> float:
    """The float32 factor from a block's largest |bound| to its code scale."""
    levels = 2 ** (bits - 1) - 1
    return float(torch.tensor((1 + 2**-20) / levels, dtype=torch.float32))


def as_kept(meta: BlockMeta, cfg) -> BlockMeta:
    """Exact block summaries as the blocks keep them under `cfg`: with
    `cfg.bound_bits == 8` the key bounds read back from their 8-bit codes."""
    return quantize_bounds(meta, 8) if cfg.bound_bits == 8 else meta


def quantize_bounds(meta: BlockMeta, bits: int = 8) -> BlockMeta:
    """The key bounds as read back from `bound_codes` (float32): what scoring sees when
    blocks keep 8-bit bounds (`PSAConfig.bound_bits`). The mean is left as it is."""
    qlo, qhi, scale = bound_codes(meta.kmin, meta.kmax, bits)
    s = scale[..., None]
    return BlockMeta(meta.mean, qlo * s, qhi * s, meta.count)


@dataclass
class BlockMetaCache:
    """Block summaries kept up to date as tokens arrive, without rereading old keys.

    Only the blocks that receive new tokens are touched: their running sum, min
    and max are combined with the new keys. This is what the GPU does when a
    decode step appends one token per request.
    """

    block_size: int
    ksum: torch.Tensor  # [B, H, cap, d] float32
    kmin: torch.Tensor
    kmax: torch.Tensor
    count: torch.Tensor  # [B, cap] int64
    lengths: torch.Tensor  # [B] int64

    @classmethod
    def empty(
        cls,
        batch: int,
        heads: int,
        head_dim: int,
        block_size: int,
        capacity_blocks: int = 16,
        device: torch.device | str = "cpu",
    ) -> BlockMetaCache:
        shape = (batch, heads, capacity_blocks, head_dim)
        return cls(
            block_size=block_size,
            ksum=torch.zeros(shape, dtype=torch.float32, device=device),
            kmin=torch.full(shape, torch.inf, dtype=torch.float32, device=device),
            kmax=torch.full(shape, -torch.inf, dtype=torch.float32, device=device),
            count=torch.zeros(batch, capacity_blocks, dtype=torch.int64, device=device),
            lengths=torch.zeros(batch, dtype=torch.int64, device=device),
        )

    @property
    def capacity_blocks(self) -> int:
        return self.count.shape[1]

    def _grow(self, need_blocks: int) -> None:
        cap = self.capacity_blocks
        if need_blocks <= cap:
            return
        new_cap = max(need_blocks, 2 * cap)
        extra = new_cap - cap

        def ext(t: torch.Tensor, fill: float) -> torch.Tensor:
            shape = list(t.shape)
            shape[-2 if t.dim() == 4 else -1] = extra
            return torch.cat(
                [t, torch.full(shape, fill, dtype=t.dtype, device=t.device)],
                dim=-2 if t.dim() == 4 else -1,
            )

        self.ksum, self.kmin, self.kmax = (
            ext(self.ksum, 0.0),
            ext(self.kmin, torch.inf),
            ext(self.kmax, -torch.inf),
        )
        self.count = ext(self.count, 0)

    def append(self, k_new: torch.Tensor, n_new: torch.Tensor) -> None:
        """Add `n_new[b]` keys `k_new[b, :, :n_new[b]]` after each request's current end."""
        B, H, _, d = k_new.shape
        new_len = self.lengths + n_new.to(self.lengths)
        self._grow(int(num_blocks(new_len, self.block_size).max()))
        for b in range(B):
            n = int(n_new[b])
            if n == 0:
                continue
            start = int(self.lengths[b])
            blk = torch.arange(start, start + n, device=k_new.device) // self.block_size
            kb = k_new[b, :, :n].float()  # [H, n, d]
            idx = blk.view(1, n, 1).expand(H, n, d)
            self.ksum[b].scatter_add_(1, idx, kb)
            self.kmin[b].scatter_reduce_(1, idx, kb, reduce="amin", include_self=True)
            self.kmax[b].scatter_reduce_(1, idx, kb, reduce="amax", include_self=True)
            self.count[b].scatter_add_(0, blk, torch.ones_like(blk))
        self.lengths = new_len

    def append_uniform(self, k_new: torch.Tensor, start: int) -> None:
        """`append` for requests that all hold `start` tokens and all add every key of
        `k_new [B, H, n, d]`: one scatter per summary for the whole batch, no host sync."""
        B, H, n, d = k_new.shape
        self._grow(-(-(start + n) // self.block_size))
        blk = torch.arange(start, start + n, device=k_new.device) // self.block_size
        kb = k_new.float()
        idx = blk.view(1, 1, n, 1).expand(B, H, n, d)
        self.ksum.scatter_add_(2, idx, kb)
        self.kmin.scatter_reduce_(2, idx, kb, reduce="amin", include_self=True)
        self.kmax.scatter_reduce_(2, idx, kb, reduce="amax", include_self=True)
        self.count.scatter_add_(
            1, blk.expand(B, n), torch.ones(B, n, dtype=self.count.dtype, device=blk.device)
        )
        self.lengths = self.lengths + n

    def meta(self, n_blocks: int | None = None) -> BlockMeta:
        """Summaries of the `ceil(max length / block_size)` first blocks, as `block_metadata`
        (`n_blocks`, when the caller knows it, spares reading the lengths back)."""
        if n_blocks is not None:
            nb = n_blocks
        else:
            nb = int(num_blocks(self.lengths, self.block_size).max()) if self.lengths.numel() else 0
        count = self.count[:, :nb]
        empty = (count == 0)[:, None, :, None]
        mean = self.ksum[:, :, :nb] / count.clamp(min=1)[:, None, :, None]
        return BlockMeta(
            mean,
            self.kmin[:, :, :nb].masked_fill(empty, 0.0),
            self.kmax[:, :, :nb].masked_fill(empty, 0.0),
            count,
        )
