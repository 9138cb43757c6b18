"""Upper bounds of each block's softmax log-mass from per-token key codes (the certified
rule's tight bound; spec: `sglang_psa.algo.token_bounds`).

A full block keeps, per KV head, its keys as `bits`-bit cells of the block's kept key
range `[lo, hi]` (per channel), stored as `bits` bit planes of `block_size x d / 8`
bytes (`pack_planes`): `bits * d / 8` bytes a token, read for every block. For a decode
query, one program per (request, KV head, chunk of blocks) rebuilds each token's cell
`[a, b]` per channel, bounds `scale * q . k` for every query head of the group by the
interval product plus a float32 margin, and writes the log-sum-exp over the block's
tokens: `ub [B, Hq, NB]` float32, `-inf` for blocks past a request's length. The wave
kernel's certified rule ranks blocks by `ub` and bounds the unread mass with it
(`WaveAttention.run(code_planes=)`).

`encode_planes` writes the planes of whole blocks on the GPU, the same cells as
`algo.token_bounds.encode_keys`. The adaptive suite's kernel rows run both
(`hf.attention.KernelRows`). For the server, `encode_pages` writes the planes and
ranges of whole pages of SGLang's key pool per page, and `code_bounds(pages=)` reads
them through the page table: the server's certified rule keeps them per page
(`mem_cache.page_meta`) and ranks on them every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# + 2 d: the float32 margin of `algo.token_bounds.token_score_bounds` (a constexpr: read
# inside the kernel)
_MARGIN_ULPS = tl.constexpr(16)
# `code_bounds` rebuilds the cells of this many channels at a time (a head dim larger is
# summed over passes).
CODE_CHANNELS = 64


def pack_planes(codes: torch.Tensor, bits: int, block_size: int) -> torch.Tensor:
    """`codes [B, Hkv, T, d]` (cells, < 2^bits) -> bit planes `[B, Hkv, NB, bits,
    block_size, d / 8]` uint8: bit `i` of byte `j` of plane `p` is bit `p` of channel
    `8 j + i`'s cell. Tokens past `T` (a partial last block) get cell 0."""
    B, H, T, d = codes.shape
    if d % 8:
        raise ValueError(f"head_dim must be a multiple of 8, got {d}")
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in [1, 8], got {bits}")
    nb = -(-T // block_size)
    c = torch.zeros(B, H, nb * block_size, d, dtype=torch.int64, device=codes.device)
    c[:, :, :T] = codes.to(torch.int64)
    c = c.view(B, H, nb, block_size, d // 8, 8)
    weights = 2 ** torch.arange(8, device=codes.device)
    planes = [(((c >> p) & 1) * weights).sum(-1) for p in range(bits)]
    return torch.stack(planes, dim=3).to(torch.uint8).contiguous()


@triton.jit
def _edge(lo, hi, c, n, inv_n):
    """Edge `c` of the `n` cells cutting `[lo, hi]` (`algo.token_bounds.cell_edge`)."""
    e = tl.minimum(tl.maximum(lo + c.to(tl.float32) * ((hi - lo) * inv_n), lo), hi)
    return tl.where(c >= n, hi, e)


@triton.jit
def _encode_kernel(
    k_ptr,  # [B, Hkv, NB * BS, D] keys (16-bit or float32), whole blocks
    lo_ptr,  # [B, Hkv, NB, D] float32
    hi_ptr,
    planes_ptr,  # [B, Hkv, NB, BITS, BS, D // 8] uint8
    NB,
    D: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
):
    row = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * NB + tl.program_id(2)
    offs_t = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    k = tl.load(k_ptr + row.to(tl.int64) * BS * D + offs_t[:, None] * D + offs_d[None, :])
    k = k.to(tl.float32)
    lo = tl.load(lo_ptr + row * D + offs_d)[None, :]
    hi = tl.load(hi_ptr + row * D + offs_d)[None, :]
    _write_planes(k, lo, hi, planes_ptr + row.to(tl.int64) * (BITS * BS * (D // 8)), D, BS, BITS)


@triton.jit
def _write_planes(k, lo, hi, out, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr):
    """The cells of keys `k [BS, D]` (float32) in `[lo, hi]` (`[1, D]`) as `BITS` bit planes
    of `BS x D / 8` bytes at `out`."""
    offs_t = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    n = tl.full((1, D), 2**BITS, tl.int32)
    inv_n = 1.0 / (2**BITS)
    # The last cell whose lower edge is <= the key, bit by bit (the reference's search).
    c = tl.zeros((BS, D), tl.int32)
    for p in tl.static_range(BITS - 1, -1, -1):
        cand = c + (1 << p)
        c = tl.where(k >= _edge(lo, hi, cand, n, inv_n), cand, c)
    bit_w = (1 << (offs_d % 8))[None, :]
    offs_b = tl.arange(0, D // 8)
    for p in range(BITS):
        bits = ((c >> p) & 1) * bit_w  # [BS, D]
        byte = tl.sum(tl.reshape(bits, (BS, D // 8, 8)), axis=2)
        tl.store(
            out + p * BS * (D // 8) + offs_t[:, None] * (D // 8) + offs_b[None, :],
            byte.to(tl.uint8),
        )


def encode_planes(
    k: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int, block_size: int
) -> torch.Tensor:
    """Bit planes (`pack_planes`' layout) of whole blocks of keys `k [B, Hkv, NB *
    block_size, d]` in their blocks' ranges `lo, hi [B, Hkv, NB, d]` (float32, holding
    every key): the cells `algo.token_bounds.encode_keys` gives, written on the GPU."""
    B, H, T, d = k.shape
    if T % block_size:
        raise ValueError(f"whole blocks only: {T} tokens, blocks of {block_size}")
    nb = T // block_size
    planes = torch.empty(B, H, nb, bits, block_size, d // 8, dtype=torch.uint8, device=k.device)
    _encode_kernel[(B, H, nb)](
        k.contiguous(),
        lo.contiguous(),
        hi.contiguous(),
        planes,
        nb,
        D=d,
        BS=block_size,
        BITS=bits,
        enable_fp_fusion=False,  # cell edges rounded as the reference's (no FMA)
    )
    return planes


@triton.jit
def _encode_pages_kernel(
    k_ptr,  # SGLang's key pool of one layer, [tokens, Hkv, D] (a page: BS tokens)
    at_ptr,  # [N] int: pages (with counts), or token slots (FROM_LOCS); < 0: none
    count_ptr,  # [N] int32: the page's tokens written so far (not FROM_LOCS)
    planes_ptr,  # [P, Hkv, BITS, BS, D // 8] uint8
    lo_ptr,  # [P, Hkv, D] float32
    hi_ptr,
    tok_stride,
    head_stride,
    D: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
    FROM_LOCS: tl.constexpr,
):
    at = tl.load(at_ptr + tl.program_id(0)).to(tl.int64)
    if at < 0:
        return
    if FROM_LOCS:  # a token was written at slot `at`: its page holds it and those before
        page = at // BS
        count = at % BS + 1
    else:
        page = at
        count = tl.load(count_ptr + tl.program_id(0))
    h = tl.program_id(1)
    row = page * tl.num_programs(1) + h
    offs_t = tl.arange(0, BS)
    offs_d = tl.arange(0, D)
    tok = page * BS + offs_t
    written = (offs_t < count)[:, None]
    k = tl.load(
        k_ptr + (tok * tok_stride + h * head_stride)[:, None] + offs_d[None, :],
        mask=written,
        other=0.0,
    ).to(tl.float32)
    # The range of the keys written so far; rows past them take its low end (cell 0).
    lo = tl.min(tl.where(written, k, float("inf")), axis=0)[None, :]
    hi = tl.max(tl.where(written, k, float("-inf")), axis=0)[None, :]
    tl.store(lo_ptr + row * D + offs_d[None, :], lo)
    tl.store(hi_ptr + row * D + offs_d[None, :], hi)
    k = tl.where(written, k, lo)
    _write_planes(k, lo, hi, planes_ptr + row * (BITS * BS * (D // 8)), D, BS, BITS)


def encode_pages(
    k_buffer: torch.Tensor,
    at: torch.Tensor,
    planes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    counts: torch.Tensor | None = None,
) -> None:
    """Key codes of pages of SGLang's key pool `k_buffer [tokens, Hkv, d]` (a page is `bs`
    consecutive tokens), as far as they are written: with `counts [N]` (int32), `at [N]`
    names pages whose first `counts` tokens hold keys; without, `at` holds token slots
    just written (a decode step's `out_cache_loc`), each page holding its slot and the
    slots before it. Entries < 0 are skipped. Each page gets the range of its keys
    into `lo, hi [P, Hkv, d]` (float32) and their cells in it into `planes [P, Hkv, bits,
    bs, d / 8]` (uint8, `pack_planes`' planes per page; rows past the keys: cell 0): what
    `algo.token_bounds.encode_keys` gives for the block. No host sync."""
    P, Hkv, bits, bs, _ = planes.shape
    d = k_buffer.shape[-1]
    if k_buffer.stride(-1) != 1 or k_buffer.shape[1] != Hkv:
        raise ValueError("k_buffer must be [tokens, Hkv, d] with contiguous channels")
    if lo.shape != (P, Hkv, d) or hi.shape != (P, Hkv, d):
        raise ValueError(f"lo, hi must be [{P}, {Hkv}, {d}] float32")
    if at.numel() == 0:
        return
    _encode_pages_kernel[(at.numel(), Hkv)](
        k_buffer, at, at if counts is None else counts, planes, lo, hi,
        k_buffer.stride(0), k_buffer.stride(1),
        D=d, BS=bs, BITS=bits, FROM_LOCS=counts is None,
        enable_fp_fusion=False,  # cell edges rounded as the reference's (no FMA)
    )  # fmt: skip


@triton.jit
def _code_bounds_kernel(
    q_ptr,  # [B, Hq, D]
    planes_ptr,  # [B, Hkv, NB, BITS, BS, D // 8] uint8
    lo_ptr,  # [B, Hkv, NB, D] float32
    hi_ptr,
    len_ptr,  # [B] int
    out_ptr,  # [B, Hq, NB] float32
    pages_ptr,  # [B, NB] int32 with PAGED: planes and ranges are per page [P, Hkv, ..]
    part_ptr,  # [B, Hq, programs, 2] float32 with WANT_PART: (max, sum of exp below it)
    scale,
    NB,
    G: tl.constexpr,
    GP: tl.constexpr,  # G padded for tl.dot (>= 16)
    D: tl.constexpr,
    BS: tl.constexpr,
    BITS: tl.constexpr,
    BLOCKS: tl.constexpr,  # blocks per program
    PAGED: tl.constexpr,
    WANT_PART: tl.constexpr,
    DC: tl.constexpr,  # channels a pass (divides D)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    Hkv = tl.num_programs(1)
    offs_g = tl.arange(0, GP)
    offs_c = tl.arange(0, DC)
    offs_t = tl.arange(0, BS)
    q_rows = q_ptr + (b * Hkv * G + h * G + offs_g)[:, None] * D
    length = tl.load(len_ptr + b)
    n_cells = tl.full((1, DC), 2**BITS, tl.int32)
    inv_n = 1.0 / (2**BITS)
    margin = (2 * D + _MARGIN_ULPS) * 5.9604644775390625e-08  # 2^-24
    p_max = tl.full([GP], float("-inf"), tl.float32)  # this program's blocks, per head
    p_sum = tl.zeros([GP], tl.float32)
    for j in range(BLOCKS):
        blk = tl.program_id(2) * BLOCKS + j
        in_range = blk < NB
        if PAGED:
            page = tl.load(pages_ptr + b * NB + blk, mask=in_range, other=0)
            row = page.to(tl.int64) * Hkv + h
        else:
            row = (b * Hkv + h) * NB + blk
        # past the last block every channel is masked (a tensor mask: the interpreter
        # takes no scalar one)
        c_ok = offs_c < DC * in_range.to(tl.int32)
        base = planes_ptr + row.to(tl.int64) * (BITS * BS * (D // 8))
        est = tl.zeros((GP, BS), tl.float32)
        mag = tl.zeros((GP, BS), tl.float32)
        # DC channels a pass, in a loop kept rolled: the whole head dim's cells and edges
        # at once held 255 registers and spilled 512 bytes a thread at head dim 128, and
        # the passes unrolled spilled ~5 KB at 5 bits and more (sm_90, Triton 3.6)
        for c0 in range(0, D, DC):
            offs_d = c0 + offs_c
            q = tl.load(q_rows + offs_d[None, :], mask=(offs_g < G)[:, None], other=0.0)
            q = q.to(tl.float32) * scale
            lo = tl.load(lo_ptr + row * D + offs_d, mask=c_ok, other=0.0)[None, :]
            hi = tl.load(hi_ptr + row * D + offs_d, mask=c_ok, other=0.0)[None, :]
            cell = tl.zeros((BS, DC), tl.int32)
            for p in range(BITS):
                byte = tl.load(
                    base + p * BS * (D // 8) + offs_t[:, None] * (D // 8) + (offs_d // 8)[None, :],
                    mask=(offs_t[:, None] < BS) & c_ok[None, :],
                    other=0,
                ).to(tl.int32)
                cell += ((byte >> (offs_d % 8)[None, :]) & 1) << p
            a = _edge(lo, hi, cell, n_cells, inv_n)
            b_edge = _edge(lo, hi, cell + 1, n_cells, inv_n)
            est = tl.dot(tl.maximum(q, 0.0), tl.trans(b_edge), acc=est, input_precision="ieee")
            est = tl.dot(tl.minimum(q, 0.0), tl.trans(a), acc=est, input_precision="ieee")
            big = tl.maximum(tl.abs(a), tl.abs(b_edge))
            mag = tl.dot(tl.abs(q), tl.trans(big), acc=mag, input_precision="ieee")
        bound = est + margin * mag  # [GP, BS]
        tok_ok = (blk * BS + offs_t) < length
        bound = tl.where(tok_ok[None, :], bound, float("-inf"))
        m = tl.max(bound, axis=1)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        # (a floor an fp32 normal: a literal below it would be typed float64)
        total = tl.maximum(tl.sum(tl.exp(bound - m_safe[:, None]), axis=1), 1e-30)
        lse = m_safe + tl.log(total)
        lse = tl.where(m == float("-inf"), float("-inf"), lse)
        tl.store(
            out_ptr + (b * Hkv * G + h * G + offs_g) * NB + blk,
            lse,
            mask=offs_g < G * in_range.to(tl.int32),
        )
        if WANT_PART:
            new_max = tl.maximum(p_max, lse)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            p_sum = p_sum * tl.exp(p_max - safe) + tl.where(
                lse == float("-inf"), 0.0, tl.exp(lse - safe)
            )
            p_max = new_max
    if WANT_PART:
        at = ((b * Hkv * G + h * G + offs_g) * tl.num_programs(2) + tl.program_id(2)) * 2
        tl.store(part_ptr + at, p_max, mask=offs_g < G)
        tl.store(part_ptr + at + 1, p_sum, mask=offs_g < G)


def code_bounds(
    q: torch.Tensor,
    planes: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    blocks_per_program: int = 4,
    num_warps: int = 4,
    pages: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
) -> torch.Tensor:
    """`q [B, Hq, d]`; `planes [B, Hkv, NB, bits, bs, d / 8]` (`pack_planes`); `lo, hi
    [B, Hkv, NB, d]` float32, the ranges the codes cut; `lengths [B]`. Returns `ub [B, Hq,
    NB]` float32: per query head, an upper bound of the log of each block's unnormalised
    softmax mass (at least `block_lse` of the float32 scores, up to the float32 rounding
    of the log-sum-exp itself), `-inf` past each length. No host sync; `out` reused.
    With the page table `pages [B, NB]` (int32), planes and ranges are per page, `[P, Hkv,
    bits, bs, d / 8]` and `[P, Hkv, d]` (`encode_pages`), and NB is the table's.
    `partials [B, Hq, ceil(NB / blocks_per_program), 2]` (float32) receives each program's
    (max, sum of exp below it) of the bounds it wrote, per query head: what
    `ranking.rank_blocks(partials=)` combines into each row's log-sum-exp."""
    B, Hq, d = q.shape
    if pages is None:
        _, Hkv, NB, bits, bs, _ = planes.shape
    else:
        (_, Hkv, bits, bs, _), NB = planes.shape, pages.shape[1]
    G = Hq // Hkv
    if out is None:
        out = torch.empty(B, Hq, NB, dtype=torch.float32, device=q.device)
    grid = (B, Hkv, triton.cdiv(NB, blocks_per_program))
    _code_bounds_kernel[grid](
        q.contiguous(),  # (any float dtype: read as float32)
        planes,
        lo.contiguous(),
        hi.contiguous(),
        lengths,
        out,
        out if pages is None else pages,
        out if partials is None else partials,
        scale,
        NB,
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        D=d,
        BS=bs,
        BITS=bits,
        BLOCKS=blocks_per_program,
        PAGED=pages is not None,
        WANT_PART=partials is not None,
        DC=min(d, CODE_CHANNELS),
        num_warps=num_warps,
        enable_fp_fusion=False,  # cell edges rounded as the reference's (no FMA)
    )
    return out


@triton.jit
def _log_add(a, b):
    m = tl.maximum(a, b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = m_safe + tl.log(tl.exp(a - m_safe) + tl.exp(b - m_safe))
    return tl.where(m == float("-inf"), float("-inf"), s)


@triton.jit
def _suffix_kernel(
    ub_ptr,  # [B, Hq, NB] float32
    order_ptr,  # [B, Hkv, NB] int32
    len_ptr,  # [B] int
    out_ptr,  # [B, Hq, NB + 1] float32
    NB,
    G: tl.constexpr,
    BS: tl.constexpr,
    C: tl.constexpr,  # positions a chunk
    DOUBLE: tl.constexpr,
):
    """One program per (request, query head): chunks from the last position back, each
    loaded last position first, scanned, and added to the sum of the chunks after it."""
    b = tl.program_id(0)
    hq = tl.program_id(1)
    Hq = tl.num_programs(1)
    h = hq // G
    nblk = (tl.load(len_ptr + b) + BS - 1) // BS
    row = (b * Hq + hq).to(tl.int64)
    orow = (b * (Hq // G) + h).to(tl.int64) * NB
    i = tl.arange(0, C)
    if DOUBLE:
        carry = tl.full([1], float("-inf"), tl.float64)
    else:
        carry = tl.full([1], float("-inf"), tl.float32)
    tl.store(out_ptr + row * (NB + 1) + NB, float("-inf"))
    n_chunks = tl.cdiv(NB, C)
    for back in range(n_chunks):
        pos = (n_chunks - back) * C - 1 - i  # descending: a forward scan sums the suffix
        inb = pos < NB
        blk = tl.minimum(tl.load(order_ptr + orow + pos, mask=inb, other=0), NB - 1)
        x = tl.load(ub_ptr + row * NB + blk, mask=inb & (pos < nblk), other=float("-inf"))
        if DOUBLE:
            x = x.to(tl.float64)
        x = tl.where(pos < nblk, x, float("-inf"))
        s = _log_add(tl.associative_scan(x, 0, _log_add), carry)
        tl.store(out_ptr + row * (NB + 1) + pos, s.to(tl.float32), mask=inb)
        carry = tl.max(tl.where(i == C - 1, s, float("-inf")), axis=0)[None]


def suffix_bounds(
    ub: torch.Tensor,
    order: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    double: bool = True,
    chunk: int = 256,
) -> torch.Tensor:
    """`out [B, Hq, NB + 1]` float32 (written and returned): the log of the bound mass
    `ub [B, Hq, NB]` of the blocks read from each position of `order [B, Hkv, NB]` on,
    summed in float64 (`double`) or float32; -inf from each request's last block on
    (spec: `algo.token_bounds.suffix_log_mass`). No allocation, no host sync."""
    B, Hq, NB = ub.shape
    _suffix_kernel[(B, Hq)](
        ub, order, lengths, out, NB,
        G=Hq // order.shape[1], BS=block_size, C=chunk, DOUBLE=double,
    )  # fmt: skip
    return out
