"""Progressive wave attention over a tiered KV store, in one launch per layer.

Blocks live either in HBM slots (`k_slots/v_slots [num_slots, bs, d]`) or in a
pinned host pool (`k_host/v_host [num_host, bs, d]`, read through UVA); a block
table `loc [B, Hkv, NB]` says where (`>= 0`: slot, `< 0`: host unit `-loc-1`).

One program per (request, KV head) serves the whole GQA group: it walks the
ranked order wave by wave, merges each block into the running (max, sum, acc)
state, and after every wave verifies the stop rule (the spec is
`sglang_psa.algo.progressive_attention`). A finished head simply stops, so a
decode step needs no CPU round trip and the launch can be captured in a CUDA
graph. Scoring and ranking come first (`scoring.py`, torch.sort on the device).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.scoring import block_scores

HEURISTIC, CERTIFIED = 0, 1


@triton.jit
def _wave_attention_kernel(
    q_ptr,
    k_slots,
    v_slots,
    k_host,
    v_host,
    loc_ptr,
    order_ptr,
    lengths_ptr,
    nforced_ptr,
    wave_ends_ptr,
    ub_suffix_ptr,
    out_ptr,
    lse_ptr,
    nread_ptr,
    nwaves_ptr,
    scale,
    limit,
    max_read,
    Hkv,
    NB,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NBLK: tl.constexpr,
    RULE: tl.constexpr,
    PREC: tl.constexpr,
    HAS_HOST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    length = tl.load(lengths_ptr + b)
    nb = (length + BS - 1) // BS
    nf = tl.load(nforced_ptr + b)
    g = tl.arange(0, GP)
    gmask = g < G
    dd = tl.arange(0, D)
    tt = tl.arange(0, BS)
    jj = tl.arange(0, NBLK)
    hq = h * G + g
    q = tl.load(
        q_ptr + (b * Hkv * G + hq)[:, None] * D + dd[None, :], mask=gmask[:, None], other=0.0
    )
    q = (q.to(tl.float32) * scale).to(q.dtype)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    smallest = tl.full([GP], float("inf"), tl.float32)
    row = (b * Hkv + h) * NB
    pos = 0
    w = 0
    done = (nb <= 0).to(tl.int32)
    while done == 0:
        end = tl.minimum(tl.minimum(nf + tl.load(wave_ends_ptr + w), nb), max_read)
        # The block ids and locations of a tile are fetched one tile ahead, so the
        # dependent order -> table lookups overlap the previous tile's K/V traffic.
        pidx = pos + jj
        pm = pidx < end
        blk = tl.load(order_ptr + row + pidx, mask=pm, other=0)
        where = tl.load(loc_ptr + row + blk, mask=pm, other=0).to(tl.int64)
        while pos < end:
            # NBLK ranked blocks per step; each is read from its HBM slot or, through UVA,
            # from the host pool (two masked loads: only one touches memory per block).
            in_hbm = where >= 0
            unit = tl.where(in_hbm, where, -where - 1)
            valid = pm[:, None] & ((blk[:, None] * BS + tt[None, :]) < length)  # [NBLK, BS]
            offs = unit[:, None, None] * (BS * D) + tt[None, :, None] * D + dd[None, None, :]
            m_dev = valid[:, :, None] & in_hbm[:, None, None]
            if HAS_HOST:
                m_host = valid[:, :, None] & (~in_hbm)[:, None, None]
                k = tl.load(k_slots + offs, mask=m_dev, other=0.0) + tl.load(
                    k_host + offs, mask=m_host, other=0.0
                )
                v = tl.load(v_slots + offs, mask=m_dev, other=0.0) + tl.load(
                    v_host + offs, mask=m_host, other=0.0
                )
            else:
                k = tl.load(k_slots + offs, mask=m_dev, other=0.0)
                v = tl.load(v_slots + offs, mask=m_dev, other=0.0)
            nxt = tl.minimum(pos + NBLK, end)
            pidx_n = nxt + jj
            pm_n = pidx_n < end
            blk_n = tl.load(order_ptr + row + pidx_n, mask=pm_n, other=0)
            where_n = tl.load(loc_ptr + row + blk_n, mask=pm_n, other=0).to(tl.int64)
            k = tl.reshape(k, [NBLK * BS, D])
            v = tl.reshape(v, [NBLK * BS, D])
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [GP, NBLK * BS] fp32
            s = tl.where(tl.reshape(valid, [NBLK * BS])[None, :], s, float("-inf"))
            s3 = tl.reshape(s, [GP, NBLK, BS])
            bmax = tl.max(s3, axis=2)
            blse = bmax + tl.log(tl.sum(tl.exp(s3 - bmax[:, :, None]), axis=2))  # [GP, NBLK]
            ranked = pm & (pidx >= nf)
            smallest = tl.minimum(
                smallest, tl.min(tl.where(ranked[None, :], blse, float("inf")), axis=1)
            )
            m_new = tl.maximum(m_i, tl.max(bmax, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            m_i = m_new
            pos = nxt
            pidx, pm, blk, where = pidx_n, pm_n, blk_n, where_n
        covered = m_i + tl.log(l_i)
        if RULE == 0:
            n_left = (nb - pos).to(tl.float32)
            uncovered = tl.where(
                n_left > 0, smallest + tl.log(tl.maximum(n_left, 1.0)), float("-inf")
            )
        else:
            uncovered = tl.load(
                ub_suffix_ptr + (b * Hkv * G + hq) * (NB + 1) + pos, mask=gmask, other=float("-inf")
            )
        ok = ((uncovered - covered) <= limit) | (uncovered == float("-inf")) | (g >= G)
        w += 1
        done = ((tl.min(ok.to(tl.int32), axis=0) > 0) | (pos >= nb) | (pos >= max_read)).to(
            tl.int32
        )
    out = acc / l_i[:, None]
    tl.store(out_ptr + (b * Hkv * G + hq)[:, None] * D + dd[None, :], out, mask=gmask[:, None])
    tl.store(lse_ptr + b * Hkv * G + hq, m_i + tl.log(l_i), mask=gmask)
    tl.store(nread_ptr + b * Hkv + h, pos)
    tl.store(nwaves_ptr + b * Hkv + h, w)


@dataclass
class WaveResult:
    out: torch.Tensor  # [B, Hq, d] float32
    lse: torch.Tensor  # [B, Hq] float32
    order: torch.Tensor  # [B, Hkv, NB] int64: read order
    n_read: torch.Tensor  # [B, Hkv] int32: blocks read = order[..., :n_read]
    n_waves: torch.Tensor  # [B, Hkv] int32

    def read_mask(self) -> torch.Tensor:
        pos = torch.arange(self.order.shape[-1], device=self.order.device)
        sorted_read = pos < self.n_read[..., None]
        return torch.zeros_like(sorted_read).scatter(-1, self.order, sorted_read)


class WaveAttention:
    """Plan once for a batch shape, run per layer: scoring, ranking and the wave kernel.

    `plan()` fixes the wave schedule and the output buffers; `run()` writes into
    them (torch.sort and the suffix sums still allocate temporaries).
    """

    def __init__(
        self,
        *,
        block_size: int,
        threshold: float,
        stop_rule: str = "heuristic",
        score: str = "mean",
        sink_blocks: int = 1,
        recent_blocks: int = 1,
        wave_blocks: int = 8,
        wave_growth: float = 1.25,
        max_wave_blocks: int = 128,
    ):
        if stop_rule not in ("heuristic", "certified"):
            raise ValueError(f"stop_rule must be heuristic|certified, got {stop_rule!r}")
        self.bs, self.threshold, self.rule, self.score = block_size, threshold, stop_rule, score
        self.sink, self.recent = sink_blocks, recent_blocks
        self.wave = (wave_blocks, wave_growth, max_wave_blocks)
        self.tile_tokens, self.num_warps = 128, 4  # launch shape: benchmark/kernels
        self.limit = math.log((1 - threshold) / threshold) if threshold < 1.0 else -math.inf

    @classmethod
    def from_config(cls, cfg) -> WaveAttention:
        return cls(
            block_size=cfg.block_size,
            threshold=cfg.threshold,
            stop_rule=cfg.stop_rule,
            score=cfg.score,
            sink_blocks=cfg.sink_blocks,
            recent_blocks=cfg.recent_blocks,
            wave_blocks=cfg.wave_blocks,
            wave_growth=cfg.wave_growth,
            max_wave_blocks=cfg.max_wave_blocks,
        )

    def plan(
        self,
        batch: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        max_blocks: int,
        device: torch.device | str,
    ) -> WaveAttention:
        first, growth, cap = self.wave
        sizes, size, left = [], float(first), max_blocks
        while left > 0:
            sizes.append(min(int(size), left))
            left -= sizes[-1]
            size = min(size * growth, float(cap))
        ends = torch.tensor(sizes or [1], dtype=torch.int64).cumsum(0)
        self.wave_ends = torch.cat([ends, ends[-1:]]).to(torch.int32).to(device)
        self.B, self.Hq, self.Hkv, self.D, self.NB = (
            batch,
            n_q_heads,
            n_kv_heads,
            head_dim,
            max_blocks,
        )
        f32 = dict(dtype=torch.float32, device=device)
        self.out = torch.empty(batch, n_q_heads, head_dim, **f32)
        self.lse = torch.empty(batch, n_q_heads, **f32)
        self.n_read = torch.empty(batch, n_kv_heads, dtype=torch.int32, device=device)
        self.n_waves = torch.empty_like(self.n_read)
        return self

    def run(
        self,
        q: torch.Tensor,
        k_slots: torch.Tensor,
        v_slots: torch.Tensor,
        loc: torch.Tensor,
        lengths: torch.Tensor,
        meta_mean: torch.Tensor,
        meta_min: torch.Tensor,
        meta_max: torch.Tensor,
        k_host: torch.Tensor | None = None,
        v_host: torch.Tensor | None = None,
        scale: float | None = None,
        max_read_blocks: int | None = None,
    ) -> WaveResult:
        """q `[B, Hq, d]`; loc `[B, Hkv, NB]`; meta_* `[B, Hkv, NB, d]` float32; lengths `[B]`.

        `max_read_blocks` caps the blocks read per (request, KV head): with
        threshold 1 this is top-k attention over the same ranked order.
        """
        B, Hq, D = q.shape
        Hkv, NB, bs = self.Hkv, self.NB, self.bs
        assert (B, Hq, D) == (self.B, self.Hq, self.D) and loc.shape == (B, Hkv, NB), (
            "run() shapes differ from plan()"
        )
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        dev = q.device
        nblk = (lengths + bs - 1) // bs
        crit, ub = block_scores(
            q,
            meta_mean,
            meta_min,
            meta_max,
            lengths,
            bs,
            scale,
            self.score,
            want_bound=self.rule == "certified",
        )
        idx = torch.arange(NB, device=dev)[None, :]
        forced = (idx < nblk[:, None]) & ((idx < self.sink) | (idx >= nblk[:, None] - self.recent))
        key = torch.where(forced[:, None, :], torch.inf, crit)
        order = torch.sort(key, dim=-1, descending=True, stable=True).indices
        n_forced = forced.sum(-1).to(torch.int32)
        if self.rule == "certified":
            G = Hq // Hkv
            ub_o = ub.gather(-1, order.repeat_interleave(G, dim=1))
            tail = torch.logcumsumexp(ub_o.flip(-1), dim=-1).flip(-1)
            ub_suffix = torch.cat([tail, torch.full_like(tail[..., :1], -torch.inf)], -1)
            ub_suffix = ub_suffix.contiguous()
        else:
            ub_suffix = self.lse  # unused by the heuristic rule
        has_host = k_host is not None
        k_host = k_slots if k_host is None else k_host
        v_host = v_slots if v_host is None else v_host
        order32 = order.to(torch.int32).contiguous()
        G = Hq // Hkv
        _wave_attention_kernel[(B, Hkv)](
            q.contiguous(),
            k_slots,
            v_slots,
            k_host,
            v_host,
            loc.to(torch.int32).contiguous(),
            order32,
            lengths.to(torch.int32).contiguous(),
            n_forced,
            self.wave_ends,
            ub_suffix,
            self.out,
            self.lse,
            self.n_read,
            self.n_waves,
            scale,
            self.limit,
            NB if max_read_blocks is None else max_read_blocks,
            Hkv,
            NB,
            G=G,
            GP=max(triton.next_power_of_2(G), 16),  # tl.dot needs >= 16 rows
            D=D,
            BS=bs,
            NBLK=max(1, self.tile_tokens // bs),
            HAS_HOST=has_host,
            num_warps=self.num_warps,
            RULE=0 if self.rule == "heuristic" else 1,
            PREC="ieee" if q.dtype == torch.float32 else "tf32",
        )
        return WaveResult(self.out, self.lse, order, self.n_read, self.n_waves)
