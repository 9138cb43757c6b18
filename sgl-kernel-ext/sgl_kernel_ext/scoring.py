"""Criticality of KV blocks for a batch of decode queries, from block metadata.

One program per (request, KV head, chunk of blocks) scores the blocks for the
whole GQA group, so the launch is as parallel as the metadata: per query head the logit estimate (`mean`: q . mean key;
`bound`: Quest's bound from key min/max) plus log(token count) is normalised
over the blocks, and the group's max is the block's criticality (spec:
`sglang_psa.algo.criticality`). With `want_bound`, the per-head true upper
bound of each block's log-mass is also written, for the certified stop rule.
Key bounds are read in the KV dtype, or as 8-bit codes with a scale per block and
KV head (`sgl_kernel_ext.metadata`): the codes are exact in fp16, so the products
stay float32-accurate and the scale multiplies the block's sum.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _qdot(q, k, INTERP: tl.constexpr):
    """`q [GP, D]` float32 times `k [N, D]`^T in float32. Float32 keys: three tf32 passes.
    16-bit keys stay 16-bit (half the registers, no conversion): q is split into three
    16-bit terms whose sum is q to ~24 bits, and each product with the exact keys is
    accumulated in float32, so the result is float32-accurate."""
    kt = tl.trans(k)
    if k.dtype == tl.float32:
        return tl.dot(q, kt, input_precision="tf32x3")
    q1 = q.to(k.dtype)
    r = q - q1.to(tl.float32)
    q2 = r.to(k.dtype)
    q3 = (r - q2.to(tl.float32)).to(k.dtype)
    if INTERP and k.dtype == tl.bfloat16:
        # Triton's interpreter computes bf16 dots wrongly (numpy has no bf16): the same
        # exact products, as float32 operands.
        kt = kt.to(tl.float32)
        q1, q2, q3 = q1.to(tl.float32), q2.to(tl.float32), q3.to(tl.float32)
        p = "ieee"
        return tl.dot(
            q1,
            kt,
            acc=tl.dot(q2, kt, acc=tl.dot(q3, kt, input_precision=p), input_precision=p),
            input_precision=p,
        )
    return tl.dot(q1, kt, acc=tl.dot(q2, kt, acc=tl.dot(q3, kt)))


@triton.jit
def _logits(
    q,
    mean_ptr,
    min_ptr,
    max_ptr,
    scale_ptr,
    base,
    j,
    dd,
    nb,
    length,
    pages_ptr,
    page_row,
    h,
    Hkv,
    BS: tl.constexpr,
    D: tl.constexpr,
    BOUND: tl.constexpr,
    PAGED: tl.constexpr,
    CODES: tl.constexpr,
    INTERP: tl.constexpr,
):
    jm = j < nb
    if PAGED:  # metadata per page `[P, Hkv, D]`, found through the request's page table
        page = tl.load(pages_ptr + page_row + j, mask=jm, other=0).to(tl.int64)
        row = page * Hkv + h
    else:
        row = base // D + j
    offs = row[:, None] * D + dd[None, :]
    if BOUND:
        kmin = tl.load(min_ptr + offs, mask=jm[:, None], other=0)
        kmax = tl.load(max_ptr + offs, mask=jm[:, None], other=0)
        if CODES:  # integers up to 2048 are exact in fp16
            kmin, kmax = kmin.to(tl.float16), kmax.to(tl.float16)
        # sum_d max(q_d min_d, q_d max_d) = q+ . max + q- . min: two tensor-core products
        # instead of a [GP, NBC, D] elementwise tensor (which spilled registers).
        x = _qdot(tl.maximum(q, 0.0), kmax, INTERP) + _qdot(tl.minimum(q, 0.0), kmin, INTERP)
        if CODES:
            x = x * tl.load(scale_ptr + row, mask=jm, other=0.0)[None, :]
    else:
        mean = tl.load(mean_ptr + offs, mask=jm[:, None], other=0.0)
        x = _qdot(q, mean, INTERP)  # tensor cores (GP, NBC >= 16)
    count = tl.minimum(length - j * BS, BS).to(tl.float32)
    x = x + tl.log(tl.maximum(count, 1.0))[None, :]
    return tl.where(jm[None, :], x, float("-inf"))


@triton.jit
def _score_kernel(
    q_ptr,
    q_stride,
    mean_ptr,
    min_ptr,
    max_ptr,
    scale_ptr,
    lengths_ptr,
    pages_ptr,
    logit_ptr,
    ub_ptr,
    part_ptr,
    fresh_ptr,
    scale,
    Hkv,
    NB,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NBC: tl.constexpr,
    BOUND: tl.constexpr,
    WANT_UB: tl.constexpr,
    PAGED: tl.constexpr,
    WANT_PART: tl.constexpr,
    CODES: tl.constexpr,
    INTERP: tl.constexpr,
    SKIP_PAST: tl.constexpr,
    GATED: tl.constexpr,
):
    b = tl.program_id(0) // Hkv
    h = tl.program_id(0) % Hkv
    j = tl.program_id(1) * NBC + tl.arange(0, NBC)
    length = tl.load(lengths_ptr + b)
    nb = (length + BS - 1) // BS
    # Chunks past the request's blocks: with SKIP_PAST nothing is written there (the
    # ranking reads no further than the request's blocks), so a short request in a
    # long-context server costs its own blocks, not the longest allowed.
    row_end = NB
    if SKIP_PAST:
        row_end = nb
    if GATED:  # a kept selection: only rows that rank this step are scored
        row_end = row_end * tl.load(fresh_ptr + b)
    if tl.program_id(1) * NBC < row_end:
        g = tl.arange(0, GP)
        gmask = g < G
        dd = tl.arange(0, D)
        hq = h * G + g
        q = (
            tl.load(
                q_ptr + b.to(tl.int64) * q_stride + hq[:, None] * D + dd[None, :],
                mask=gmask[:, None],
                other=0.0,
            ).to(tl.float32)
            * scale
        )
        base = (b * Hkv + h) * NB * D
        out = (b * Hkv * G + hq)[:, None] * NB + j[None, :]
        omask = gmask[:, None] & (j < NB)[None, :]
        # the block's metadata and where to find it: the same for the score and the bound
        at = (q, mean_ptr, min_ptr, max_ptr, scale_ptr, base, j, dd, nb, length)
        at = at + (pages_ptr, b * NB, h, Hkv)
        x = _logits(*at, BS, D, BOUND, PAGED, CODES, INTERP)
        tl.store(logit_ptr + out, x, mask=omask)
        if WANT_PART:  # this chunk's (max, sum of exp) per query head, for the row's lse
            m = tl.max(x, axis=1)
            ssum = tl.sum(tl.where(x == float("-inf"), 0.0, tl.exp(x - m[:, None])), axis=1)
            pbase = ((b * Hkv * G + hq) * tl.num_programs(1) + tl.program_id(1)) * 2
            tl.store(part_ptr + pbase, m, mask=gmask)
            tl.store(part_ptr + pbase + 1, ssum, mask=gmask)
        if WANT_UB:
            if BOUND:  # the score is the bound
                ub = x
            else:
                ub = _logits(*at, BS, D, True, PAGED, CODES, INTERP)
            tl.store(ub_ptr + out, ub, mask=omask)


def block_scores(
    q: torch.Tensor,
    meta_mean: torch.Tensor,
    meta_min: torch.Tensor,
    meta_max: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    scale: float,
    method: str = "mean",
    want_bound: bool = False,
    blocks_per_program: int = 32,  # the plan passes its swept launch (bench_wave)
    num_warps: int = 2,
    pages: torch.Tensor | None = None,
    normalize: bool = True,
    partials: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    meta_scale: torch.Tensor | None = None,
    skip_past_length: bool = False,
    fresh: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Criticality `[B, Hkv, NB]` and, if asked, bound log-mass `[B, Hq, NB]`. With
    `normalize=False` the first is the raw per-head logits `[B, Hq, NB]` (for `rank_blocks`).

    `meta_*` are `[B, Hkv, NB, d]` (gathered per request by the caller), or,
    with `pages [B, NB]`, `[P, Hkv, d]` per page, read through the page table in place;
    float32, or the KV dtype (half the bytes to read; scored in float32). With int8
    `meta_min`/`meta_max` (8-bit codes), `meta_scale` is their float32 scale per block
    and KV head: `[B, Hkv, NB]`, or `[P, Hkv]` per page.
    `partials` (`[B, Hq, partial_chunks(NB), 2]` float32, see there) receives each
    chunk's (max, sum of exp) of the raw logits, from which `rank_blocks` gets the lse.
    `out` receives the raw logits (else they are allocated).
    `skip_past_length`: chunks of `blocks_per_program` blocks wholly past a request's
    blocks are not scored, and their logits, bounds and partials are left as they were
    (for `rank_blocks(skip_past_length=True)`; raw logits only). Otherwise every column
    up to NB is written, `-inf` past each length.
    """
    if method not in ("mean", "bound"):
        raise ValueError(f"unknown criticality method {method!r} (mean|bound)")
    if skip_past_length and normalize:
        raise ValueError("skip_past_length leaves columns unwritten: raw logits only")
    B, Hq, D = q.shape
    if pages is None:
        Hkv, NB = meta_mean.shape[1], meta_mean.shape[2]
    else:
        Hkv, NB = meta_mean.shape[1], pages.shape[1]
    G = Hq // Hkv
    if out is None:  # the raw logits' buffer; callers that plan pass their own
        logits = torch.empty(B, Hq, NB, dtype=torch.float32, device=q.device)
    else:
        if out.shape != (B, Hq, NB) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 [{B}, {Hq}, {NB}] tensor")
        logits = out
    ub = torch.empty_like(logits) if want_bound else logits
    nbc = blocks_per_program
    lengths32 = lengths.to(torch.int32).contiguous()
    paged = pages is not None
    pages_arg = pages.to(torch.int32).contiguous() if paged else lengths32
    nbc = max(nbc, 16)
    codes = meta_min.dtype == torch.int8
    if codes != (meta_scale is not None) or codes != (meta_max.dtype == torch.int8):
        raise ValueError("8-bit bounds (int8 meta_min and meta_max) come with meta_scale")
    if codes and meta_scale.shape != meta_min.shape[:-1]:
        raise ValueError(f"meta_scale must be {tuple(meta_min.shape[:-1])}, one per bound pair")
    if partials is not None and partials.shape != (B, Hq, triton.cdiv(NB, nbc), 2):
        raise ValueError(f"partials must be [B, Hq, {triton.cdiv(NB, nbc)}, 2] float32")
    q = queries_in_place(q)
    _score_kernel[(B * Hkv, triton.cdiv(NB, nbc))](
        q, q.stride(0), meta_mean.contiguous(), meta_min.contiguous(), meta_max.contiguous(),
        meta_scale.contiguous() if codes else lengths32,  # unread without codes
        lengths32, pages_arg, logits, ub, logits if partials is None else partials,
        lengths32 if fresh is None else fresh, scale, Hkv, NB,
        G=G, GP=max(triton.next_power_of_2(G), 16), D=D, BS=block_size, NBC=nbc,
        BOUND=method == "bound", WANT_UB=want_bound, PAGED=paged,
        WANT_PART=partials is not None, CODES=codes,
        INTERP=os.environ.get("TRITON_INTERPRET") == "1", SKIP_PAST=skip_past_length,
        GATED=fresh is not None, num_warps=num_warps,
    )  # fmt: skip
    out = logits if not normalize else criticality_from_logits(logits, Hkv)
    return out, (ub if want_bound else None)


def queries_in_place(q: torch.Tensor) -> torch.Tensor:
    """`q [B, Hq, d]` as the kernels read it: in place when each row's heads are packed
    (rows may lie apart, `q.stride(0)`: SGLang's q is a view of the fused qkv), else a copy."""
    return q if q.stride(2) == 1 and q.stride(1) == q.shape[2] else q.contiguous()


def partial_chunks(n_blocks: int, blocks_per_program: int = 32) -> int:
    """How many (max, sum of exp) partials per row `block_scores` writes."""
    return triton.cdiv(n_blocks, max(blocks_per_program, 16))


def criticality_from_logits(logits: torch.Tensor, n_kv_heads: int) -> torch.Tensor:
    """Per-head logits `[B, Hq, NB]` -> criticality `[B, Hkv, NB]`: normalise per query head
    over its blocks, then take the GQA group's max (torch; `rank_blocks` fuses this)."""
    B, _, NB = logits.shape
    share = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return share.view(B, n_kv_heads, -1, NB).amax(2)
