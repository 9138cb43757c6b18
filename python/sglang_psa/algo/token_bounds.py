"""Per-token low-bit key codes and the upper bounds on `scale * q . k` they certify.

A block's per-channel key range `[lo, hi]` (its kept key min/max, `metadata.as_kept`)
is cut into `2^bits` cells per channel; each token stores, per channel, the index of
a cell that contains its key (`bits` bits a channel: `bits * d / 8` bytes a token and
KV head). `bits` may instead be set per KV head and channel (`[Hkv, d]`, 0 to 8; a
channel of 0 bits stores nothing and keeps the block's range: `allocate_bits`). For a
query the interval product gives, per token,

    scale * q . k  <=  sum_i max(q'_i a_i, q'_i b_i) + margin
                    =  q' . mid + sum_i |q'_i| (b_i - a_i) / 2 + margin

with `q' = scale * q`, `[a_i, b_i]` the token's cell in channel i and `mid` its centre:
the dequantised key plus the largest rounding error, channel by channel. Cells rather
than round-to-nearest levels: `2^bits` cells of width `(hi - lo) / 2^bits` leave a half
width of `(hi - lo) / 2^(bits + 1)`, where `2^bits` levels would leave
`(hi - lo) / (2 (2^bits - 1))`.

Exactness. The edges are a fixed float32 formula of `(lo, hi, c)`, non-decreasing in
`c` and inside `[lo, hi]`, and the encoder checks that each key lies in its cell in
float32 (keys are bf16 or float32, so exactly representable), so `a_i <= k_i <= b_i`
holds exactly and the interval product bounds the real `scale * q . k`. The margin
`(2 d + 16) 2^-24 * sum_i |q'_i| max(|a_i|, |b_i|)` covers float32 rounding: of the
bound's own dot products and sum, of scaling `q`, and of `attention.token_scores`'
(a float32 dot product of length d errs by at most `d 2^-24 (1 + o(1))` times
`sum |x_i y_i|`, in any summation order, FMA or not). So `token_score_bounds` is at
least both the exact real score and the float32 one `token_scores` returns, for every
valid token. The margin is ~1e-5 of the bound's scale: it costs nothing measurable.

Codes are relative to the block's range, so a block's codes are final once the block
is full (its min/max no longer move). Blocks past a request's length have no tokens;
their bounds are `-inf`, as `token_scores`' scores are.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang_psa.algo.criticality import group_queries

_U32 = 2.0**-24  # float32 unit roundoff


class KeyCodes(NamedTuple):
    codes: torch.Tensor  # [B, Hkv, T, d] uint8: cell per token and channel (0 past lengths)
    lo: torch.Tensor  # [B, Hkv, NB, d] float32: per-block per-channel range the cells cut
    hi: torch.Tensor  # [B, Hkv, NB, d] float32
    bits: int | torch.Tensor  # one width, or [Hkv, d] int64 per KV head and channel
    block_size: int


def _bits_tensor(bits: int | torch.Tensor, device) -> torch.Tensor:
    """`bits` as an int64 tensor broadcasting over `[B, Hkv, T, d]`."""
    if isinstance(bits, int):
        bits = torch.tensor(bits)
    bits = bits.to(device=device, dtype=torch.int64)
    if bits.numel() and (bits.min() < 0 or bits.max() > 8):
        raise ValueError(f"bits must be in [0, 8], got {bits.min()}..{bits.max()}")
    return bits if bits.dim() == 0 else bits[None, :, None, :]


def _per_token(x: torch.Tensor, block_size: int, T: int) -> torch.Tensor:
    """`[B, H, NB, d]` per block -> `[B, H, T, d]` per token."""
    return x.repeat_interleave(block_size, dim=2)[:, :, :T]


def cell_edge(
    lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, bits: int | torch.Tensor
) -> torch.Tensor:
    """Edge `c` (0..2^bits) of the cells cutting `[lo, hi]`, float32: `lo` at 0, `hi` at
    `2^bits`, else `lo + c * (hi - lo) * 2^-bits` clamped into `[lo, hi]` (non-decreasing
    in `c`: every float32 step is a monotone rounding; `2^-bits` is exact). `bits`: an int
    or an int64 tensor broadcasting with `c`."""
    n = torch.as_tensor(2**bits) if isinstance(bits, int) else 2**bits
    w = (hi - lo) * (1.0 / n.to(torch.float32))
    cf = c.to(torch.float32)
    e = torch.minimum(torch.maximum(lo + cf * w, lo), hi)
    return torch.where(c >= n, hi, e)


def encode_keys(
    k: torch.Tensor,
    lengths: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    block_size: int,
    bits: int | torch.Tensor,
) -> KeyCodes:
    """Codes of every key `k [B, Hkv, T, d]` in its block's range `lo, hi [B, Hkv, NB, d]`
    (any range containing the block's keys: the exact or the kept min/max), `bits` (0 to
    8) a channel, or `[Hkv, d]` per KV head and channel. Raises `ValueError` when a valid
    key lies outside its block's range or is not finite."""
    B, H, T, d = k.shape
    bt = _bits_tensor(bits, k.device)
    n = 2**bt
    kf = k.float()
    valid = (torch.arange(T, device=k.device)[None, :] < lengths[:, None])[:, None, :, None]
    lo_t = _per_token(lo.float(), block_size, T)
    hi_t = _per_token(hi.float(), block_size, T)
    kf = torch.where(valid, kf, lo_t)  # padding: code 0
    if not torch.isfinite(kf).all():
        raise ValueError("keys must be finite")
    if ((kf < lo_t) | (kf > hi_t)).any():
        raise ValueError("a key lies outside its block's [lo, hi] range")
    # The cell is the last whose lower edge is <= the key (a key on an edge takes the
    # upper cell), found bit by bit from the float32 edges themselves: no division to
    # round, and nearly empty ranges (many equal edges) come out the same everywhere.
    c = torch.zeros(kf.shape, dtype=torch.int64, device=k.device)
    for p in reversed(range(int(bt.max()))):
        cand = c + 2**p
        fits = (cand < n) & (kf >= cell_edge(lo_t, hi_t, cand, bt))
        c = torch.where(fits, cand, c)
    a, b = cell_edge(lo_t, hi_t, c, bt), cell_edge(lo_t, hi_t, c + 1, bt)
    if ((kf < a) | (kf > b)).any():  # cannot happen: edges run from lo to hi monotonically
        raise AssertionError("a key is outside its cell")
    return KeyCodes(c.to(torch.uint8), lo.float(), hi.float(), bits, block_size)


def decode_cells(codes: KeyCodes) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's cell `(a, b)`, both `[B, Hkv, T, d]` float32, `a <= k <= b`."""
    T = codes.codes.shape[2]
    lo_t = _per_token(codes.lo, codes.block_size, T)
    hi_t = _per_token(codes.hi, codes.block_size, T)
    c = codes.codes.long()
    bt = _bits_tensor(codes.bits, c.device)
    return cell_edge(lo_t, hi_t, c, bt), cell_edge(lo_t, hi_t, c + 1, bt)


def token_score_bounds(
    q: torch.Tensor, codes: KeyCodes, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """Upper bound of `scale * q . k` for every key, `[B, Hq, T]` float32, `-inf` past
    each length: at least the exact real score and `attention.token_scores`' float32
    one (module docstring). `q [B, Hq, d]` groups onto the codes' KV heads (GQA)."""
    a, b = decode_cells(codes)
    Hkv, T, d = a.shape[1], a.shape[2], a.shape[3]
    qs = group_queries(q.float(), Hkv) * scale  # [B, Hkv, G, d]
    est = torch.einsum("bhgd,bhtd->bhgt", qs.clamp(min=0), b) + torch.einsum(
        "bhgd,bhtd->bhgt", qs.clamp(max=0), a
    )
    mag = torch.einsum("bhgd,bhtd->bhgt", qs.abs(), torch.maximum(a.abs(), b.abs()))
    bound = (est + (2 * d + 16) * _U32 * mag).flatten(1, 2)
    pad = torch.arange(T, device=a.device)[None, :] >= lengths[:, None]
    return bound.masked_fill(pad[:, None, :], -torch.inf)


def code_bytes_per_token(bits: int | torch.Tensor, head_dim: int) -> float:
    """Bytes of codes per token and KV head (mean over KV heads for per-channel `bits`)."""
    if isinstance(bits, int):
        return bits * head_dim / 8
    return float(bits.sum(-1).double().mean()) / 8


def allocate_bits(weights: torch.Tensor, mean_bits: int, max_bits: int = 8) -> torch.Tensor:
    """Per-channel widths `[..., d]` int64 summing to `mean_bits * d` per row, each in
    `[0, max_bits]`, that minimise `sum_i weights_i * 2^-bits_i`: the bound's slack is
    `sum_i |q'_i| (hi_i - lo_i) 2^-(bits_i + 1)`, so `weights` should be a channel's
    typical `|q_i| (hi_i - lo_i)` (e.g. calibrated per layer and KV head). Greedy on the
    marginal gain `weights_i 2^-(bits_i + 1)`, optimal for this separable convex cost.
    Any widths keep the bound valid; these only make it tight for the bytes."""
    w = weights.double().clamp(min=0)
    d = w.shape[-1]
    if not 0 <= mean_bits <= max_bits <= 8:
        raise ValueError(f"need 0 <= mean_bits <= max_bits <= 8, got {mean_bits}, {max_bits}")
    bits = torch.zeros(w.shape, dtype=torch.int64, device=w.device)
    for _ in range(mean_bits * d):
        gain = torch.where(bits < max_bits, w * torch.exp2(-(bits + 1).double()), -1.0)
        bits.scatter_add_(-1, gain.argmax(-1, keepdim=True), torch.ones_like(bits[..., :1]))
    return bits


def suffix_log_mass(
    ub: torch.Tensor,
    order: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """`[B, Hq, NB + 1]` float32: the log of the bound mass `ub [B, Hq, NB]` of the blocks
    read from each position of `order [B, Hkv, NB]` on (summed in `dtype`; -inf from a
    request's last block on): what the certified rule leaves unread after each position
    (`sgl_kernel_ext.code_bounds.suffix_bounds` computes it on the GPU)."""
    B, Hq, NB = ub.shape
    G = Hq // order.shape[1]
    ub_o = ub.gather(-1, order.long().clamp(max=NB - 1).repeat_interleave(G, 1))
    nblk = (lengths.to(ub.device) + block_size - 1) // block_size
    past = torch.arange(NB, device=ub.device) >= nblk[:, None, None]
    ub_o = ub_o.to(dtype).masked_fill(past, -torch.inf)
    tail = torch.logcumsumexp(ub_o.flip(-1), dim=-1).flip(-1)
    return torch.cat([tail, torch.full_like(tail[..., :1], -torch.inf)], -1).float()
