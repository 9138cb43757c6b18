"""Progressive wave attention over a tiered KV store, in one launch per layer.

Blocks live either in HBM slots (`k_slots/v_slots [num_slots, bs, d]`) or in a
pinned host pool (`k_host/v_host [num_host, bs, d]`, read through UVA); a block
table `loc [B, Hkv, NB]` says where (`>= 0`: slot, `< 0`: host unit `-loc-1`).

One program per (request, KV head) serves the whole GQA group: it walks the
ranked order wave by wave, merges each block into the running (max, sum, acc)
state, and after every wave verifies the stop rule (the spec is
`sglang_psa.algo.progressive_attention`). A finished head simply stops, so a
decode step needs no CPU round trip and the launch can be captured in a CUDA
graph. Scoring and ranking come first (`scoring.py`, `ranking.py`); the ranking
also writes the block table in read order, so a tile's K/V addresses wait on
one load, not two.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # host-side tensor descriptors (Triton >= 3.4)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the per-row gather reads every block
    TensorDescriptor = None

from sgl_kernel_ext.code_bounds import code_bounds, suffix_bounds
from sgl_kernel_ext.metadata import CODE_STEP, new_key_page, page_meta_from_locs, store_page_meta
from sgl_kernel_ext.ranking import rank_blocks, rank_scratch_numel
from sgl_kernel_ext.scoring import (
    block_scores,
    criticality_from_logits,
    partial_chunks,
    queries_in_place,
)
from sgl_kernel_ext.unit_cache import LAYER_ALIGN

HEURISTIC, CERTIFIED = 0, 1
logger = logging.getLogger(__name__)


@triton.jit
def _group_query(q_ptr, b, q_stride, hq, gmask, dd, D: tl.constexpr):
    """The GQA group's queries `[GP, D]` (padding rows zero) in their dtype, request `b`'s
    row `q_stride` elements apart (SGLang's q is a view of the fused qkv). Not pre-scaled:
    rounding q * scale to bf16 would shift every logit (1/sqrt(128) is no power of two)."""
    at = q_ptr + b.to(tl.int64) * q_stride + hq[:, None] * D + dd[None, :]
    return tl.load(at, mask=gmask[:, None], other=0.0)


@triton.jit
def _tile_index(
    order_ptr,
    loc_ptr,
    row,
    first,
    end,
    length,
    BS: tl.constexpr,
    NBLK: tl.constexpr,
):
    """One row per token of a tile of NBLK ranked blocks starting at rank `first`: its
    location (slot >= 0, host unit < 0), its token within the block, whether it
    holds a token, and its block index. `loc_ptr` is the block table in read order, so
    the location does not wait on the block id: one dependent load fewer before the K/V
    gather. The rows of a block load the same ids (one L1 line), so the K/V tile is a
    plain 2-D gather that Triton pipelines straight into shared memory."""
    r = tl.arange(0, NBLK * BS)
    pidx = first + r // BS
    pm = pidx < end
    blk = tl.load(order_ptr + row + pidx, mask=pm, other=0)
    where = tl.load(loc_ptr + row + pidx, mask=pm, other=0).to(tl.int64)
    tok = r % BS
    return where, tok, pm & (blk * BS + tok < length), blk


@triton.jit
def _tile_index_kept(
    order_ptr,
    loc_ptr,
    orow,
    row,
    first,
    end,
    length,
    n_sink,
    tail0,
    nf,
    kept0,
    BS: tl.constexpr,
    NBLK: tl.constexpr,
):
    """`_tile_index` over a kept selection (`sgl_kernel_ext.selection`; spec:
    `algo.attention.reuse_order`): read positions below `nf` are the forced blocks, the
    sink ones then every block from `tail0` on, computed here; later positions are the
    kept order's ranked blocks (row `orow`, from position `kept0`). Locations by block."""
    r = tl.arange(0, NBLK * BS)
    pidx = first + r // BS
    pm = pidx < end
    forced = pidx < nf
    fblk = tl.where(pidx < n_sink, pidx, tail0 + pidx - n_sink)
    kblk = tl.load(order_ptr + orow + kept0 + pidx - nf, mask=pm & (~forced), other=0)
    blk = tl.where(forced, fblk, kblk)
    where = tl.load(loc_ptr + row + blk, mask=pm, other=0).to(tl.int64)
    tok = r % BS
    return where, tok, pm & (blk * BS + tok < length), blk


@triton.jit
def _tile_at(
    order_ptr,
    loc_ptr,
    orow,
    row,
    first,
    end,
    length,
    n_sink,
    tail0,
    nf,
    kept0,
    BS: tl.constexpr,
    NBLK: tl.constexpr,
    KEPT: tl.constexpr,
):
    """The tile of read positions from `first`: `_tile_index_kept` over a kept selection,
    else `_tile_index` over the ranked block table."""
    if KEPT:
        return _tile_index_kept(
            order_ptr, loc_ptr, orow, row, first, end, length, n_sink, tail0, nf, kept0, BS,
            NBLK,
        )  # fmt: skip
    return _tile_index(order_ptr, loc_ptr, row, first, end, length, BS, NBLK)


@triton.jit
def _block_at(
    order_ptr, loc_ptr, orow, row, pos, end, n_sink, tail0, nf, kept0, KEPT: tl.constexpr
):
    """The block at read position `pos` (< `end`, else 0) and its location (a slot, >= 0):
    scalars, for tiles of one block read through a tensor descriptor (`_tile_at`'s rules
    for one block)."""
    ok = pos < end
    if KEPT:
        forced = pos < nf
        kblk = tl.load(order_ptr + orow + kept0 + pos - nf, mask=ok & (~forced), other=0)
        blk = tl.where(forced, tl.where(pos < n_sink, pos, tail0 + pos - n_sink), kblk)
        where = tl.load(loc_ptr + row + blk, mask=ok, other=0)
    else:
        blk = tl.load(order_ptr + row + pos, mask=ok, other=0)
        where = tl.load(loc_ptr + row + pos, mask=ok, other=0)
    return where, blk


@triton.jit
def _block_and_page(
    order_ptr, rloc_ptr, pages_ptr, orow, row, b, pos, end, n_sink, tail0, nf, kept0, NB,
    KEPT: tl.constexpr, STAMP: tl.constexpr,
):  # fmt: skip
    """`_block_at` and, with STAMP, the block's page from the page table (else 0)."""
    where, blk = _block_at(order_ptr, rloc_ptr, orow, row, pos, end, n_sink, tail0, nf, kept0,
                           KEPT)  # fmt: skip
    page = 0
    if STAMP:
        page = tl.load(pages_ptr + b * NB + blk)
    return where, blk, page


@triton.jit
def _tile_and_pages(
    order_ptr, rloc_ptr, pages_ptr, orow, row, b, first, end, length, n_sink, tail0, nf, kept0,
    NB, BS: tl.constexpr, NBLK: tl.constexpr, KEPT: tl.constexpr, STAMP: tl.constexpr,
):  # fmt: skip
    """`_tile_at` and, with STAMP, each block's page at its first token's row (else 0)."""
    where, tok, valid, blk = _tile_at(order_ptr, rloc_ptr, orow, row, first, end, length,
                                      n_sink, tail0, nf, kept0, BS, NBLK, KEPT)  # fmt: skip
    page = 0
    if STAMP:
        page = tl.load(pages_ptr + b * NB + blk, mask=valid & (tok == 0))
    return where, tok, valid, blk, page


@triton.jit
def _block_ptrs(
    where,
    tok,
    valid,
    h,
    dd,
    k_slots,
    v_slots,
    k_host,
    v_host,
    uslot_ptr,
    cpages_ptr,
    kshift_ptr,
    vshift_ptr,
    uslot_stride,
    cache_layers,
    slot_stride,
    tok_stride,
    head_stride,
    host_slot_stride,
    host_tok_stride,
    host_head_stride,
    HAS_HOST: tl.constexpr,
    CACHED: tl.constexpr,
):
    """K and V addresses `[T, D]` of KV head `h` at the rows `tok` of the blocks at
    `where` (`[T]`, one entry a row), and which rows lie in HBM. A block is read from its
    HBM slot or, through UVA, from the host pool (`where < 0`: host unit `-where - 1`):
    one pointer chosen per row. HBM slots may be strided (SGLang's token-major pages: a
    slot is a page, the head an offset within each token); host units are `[bs, d]` runs
    unless `host_*_stride` say otherwise. CACHED: a host unit that the unit cache holds is
    read from its cached page in its position's layer buffer instead."""
    if CACHED:  # a cached host unit: its page (0 while the slot is torn down), in its
        # position's layer buffer
        on_host = valid & (where < 0)
        upos = tl.load(uslot_ptr + h * uslot_stride - where - 1, mask=on_host, other=-1)
        u0 = tl.maximum(upos, 0)
        cpage = tl.load(cpages_ptr + u0 // cache_layers, mask=upos >= 0, other=0)
        cpage = cpage.to(tl.int64)
        # Multiples of LAYER_ALIGN (`unit_cache.layer_offsets` checks): told to the
        # compiler, the K/V loads stay vectorized; untold, ptxas kept 32 registers and
        # spilled 4 KB a thread (bf16, head dim 64) and b's step took 28 ms instead of 5.8
        # on the H200.
        ksh = tl.load(kshift_ptr + u0 % cache_layers, mask=cpage > 0, other=0)
        vsh = tl.load(vshift_ptr + u0 % cache_layers, mask=cpage > 0, other=0)
        ksh = tl.multiple_of(ksh, LAYER_ALIGN)
        vsh = tl.multiple_of(vsh, LAYER_ALIGN)
        where = tl.where(cpage > 0, cpage, where)
    in_hbm = where >= 0
    unit = tl.where(in_hbm, where, -where - 1)
    offs = unit * slot_stride + h * head_stride + tok * tok_stride  # [T]: a row's start
    if HAS_HOST:  # chosen a row, not an element (fewer registers: the loads as at HBM)
        offs_h = unit * host_slot_stride + h * host_head_stride + tok * host_tok_stride
        k_at, v_at = k_slots + offs, v_slots + offs
        if CACHED:  # a cached unit's row: its position's layer buffer
            k_at, v_at = k_at + ksh, v_at + vsh
        k_row = tl.where(in_hbm, k_at, k_host + offs_h)
        v_row = tl.where(in_hbm, v_at, v_host + offs_h)
        return k_row[:, None] + dd[None, :], v_row[:, None] + dd[None, :], in_hbm
    offs2 = offs[:, None] + dd[None, :]
    return k_slots + offs2, v_slots + offs2, in_hbm


@triton.jit
def _merge_tile(
    q,
    k,
    v,
    valid,
    first,
    end,
    nf,
    scale,
    m_i,
    l_i,
    acc,
    smallest,
    GP: tl.constexpr,
    NBLK: tl.constexpr,
    BS: tl.constexpr,
    D: tl.constexpr,
    PREC: tl.constexpr,
    TRACK: tl.constexpr,
    ONE_EXP: tl.constexpr = False,
):
    """Merge one tile `k, v [NBLK * BS, D]` (`valid [NBLK * BS]`, blocks of ranks
    `first ..`) into the running (max, sum, acc) state of the GQA group. With TRACK
    (the heuristic stop rule) also keep the smallest log-mass of a ranked block (rank
    in [nf, end)). ONE_EXP (TRACK, one block a tile): the block's own exponentials serve
    both its log-mass and the merge (rescaled by one exponential per query head), not
    a second pass over the tile."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [GP, NBLK * BS] fp32
    s = tl.where(valid[None, :], s, float("-inf"))
    if TRACK and ONE_EXP and NBLK == 1:
        bmax = tl.max(s, axis=1)  # [GP]: the block's max, per query head
        e = tl.where(bmax[:, None] == float("-inf"), 0.0, tl.exp(s - bmax[:, None]))
        bsum = tl.sum(e, axis=1)
        ranked = (first < end) & (first >= nf)
        smallest = tl.where(ranked, tl.minimum(smallest, bmax + tl.log(bsum)), smallest)
        m_new = tl.maximum(m_i, bmax)
        beta = tl.where(bmax == float("-inf"), 0.0, tl.exp(bmax - m_new))
        p = e * beta[:, None]
        p_sum = bsum * beta
    else:
        if TRACK:
            s3 = tl.reshape(s, [GP, NBLK, BS])
            bmax = tl.max(s3, axis=2)
            blse = bmax + tl.log(tl.sum(tl.exp(s3 - bmax[:, :, None]), axis=2))  # [GP, NBLK]
            pb = first + tl.arange(0, NBLK)
            ranked = (pb < end) & (pb >= nf)
            smallest = tl.minimum(
                smallest, tl.min(tl.where(ranked[None, :], blse, float("inf")), axis=1)
            )
            m_new = tl.maximum(m_i, tl.max(bmax, axis=1))
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.where(m_new[:, None] == float("-inf"), 0.0, tl.exp(s - m_new[:, None]))
        p_sum = tl.sum(p, axis=1)
    alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m_i - m_new))
    l_i = l_i * alpha + p_sum
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc, smallest


@triton.jit
def _stop(
    covered,
    low,
    ub_suffix_ptr,
    ub_row,
    wstart,
    nb,
    max_read,
    limit,
    gmask,
    NB,
    RULE: tl.constexpr,
):
    """1 when every query head of the group has covered enough mass (or nothing is left)."""
    if RULE == 0:
        n_left = (nb - wstart).to(tl.float32)
        uncovered = tl.where(n_left > 0, low + tl.log(tl.maximum(n_left, 1.0)), float("-inf"))
    else:
        uncovered = tl.load(
            ub_suffix_ptr + ub_row * (NB + 1) + wstart, mask=gmask, other=float("-inf")
        )
    ok = ((uncovered - covered) <= limit) | (uncovered == float("-inf")) | (~gmask)
    return ((tl.min(ok.to(tl.int32), axis=0) > 0) | (wstart >= nb) | (wstart >= max_read)).to(
        tl.int32
    )


@triton.jit
def _read_wave(
    q, m_i, l_i, acc, smallest, n_host, wstart, end, sid, b, h, dd, length, nf, n_sink,
    tail0, kept0, orow, row, step, scale,
    order_ptr, rloc_ptr, pages_ptr, stamp_ptr, stamp_stride,
    k_slots, v_slots, k_desc, v_desc, desc_head_rows, desc_head_cols, k_host, v_host,
    uslot_ptr, cpages_ptr, kshift_ptr, vshift_ptr, uslot_stride, cache_layers,
    slot_stride, tok_stride, head_stride, host_slot_stride, host_tok_stride, host_head_stride,
    NB,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, NBLK: tl.constexpr,
    S: tl.constexpr, STAGES: tl.constexpr, PREC: tl.constexpr, HAS_HOST: tl.constexpr,
    CACHED: tl.constexpr, STAMP: tl.constexpr, STATS: tl.constexpr, KEPT: tl.constexpr,
    PREFETCH: tl.constexpr, TMA: tl.constexpr, ONE_EXP: tl.constexpr, TRACK: tl.constexpr,
):  # fmt: skip
    """One wave's tiles of this program (`_wave_attention_kernel`'s loop body): the
    blocks at read positions `wstart + (sid + i * S) * NBLK` below `end`, merged into
    `(m_i, l_i, acc, smallest)`; `n_host` counts the host units read (STATS). HAS_HOST:
    blocks may lie on the host tier (or in the unit cache, CACHED); without it every
    block is read from HBM with none of that logic (a row with no block off HBM)."""
    # This program's tiles of the wave: wstart + (sid + i * S) * NBLK. A counted loop
    # that Triton software-pipelines (STAGES): the block ids, their locations and the
    # K/V tiles of later iterations are in flight while this one is merged.
    n_tiles = tl.cdiv(end - wstart - sid * NBLK, S * NBLK)
    if PREFETCH:  # the first tile's ids (and pages); each iteration loads the next one's
        if TMA:
            n_where, n_blk, n_page = _block_and_page(
                order_ptr, rloc_ptr, pages_ptr, orow, row, b, wstart + sid, end, n_sink, tail0,
                nf, kept0, NB, KEPT, STAMP,
            )  # fmt: skip
        else:
            n_where, n_tok, n_valid, n_blk, n_page = _tile_and_pages(
                order_ptr, rloc_ptr, pages_ptr, orow, row, b, wstart + sid * NBLK, end, length,
                n_sink, tail0, nf, kept0, NB, BS, NBLK, KEPT, STAMP,
            )  # fmt: skip
    for i in tl.range(0, n_tiles, num_stages=STAGES):
        first = wstart + (sid + i * S) * NBLK
        if TMA:
            # NBLK blocks a tile, each copied by the tensor memory accelerator from its
            # slot into shared memory and merged on its own: no per-element addresses.
            # Rows past the request's length hold stale values: masked (their keys to
            # -inf, their values to 0).
            for j in tl.static_range(NBLK):
                if PREFETCH:  # NBLK == 1: this block's ids were loaded an iteration ago
                    where, blk, page = n_where, n_blk, n_page
                    n_where, n_blk, n_page = _block_and_page(
                        order_ptr, rloc_ptr, pages_ptr, orow, row, b, first + S, end, n_sink,
                        tail0, nf, kept0, NB, KEPT, STAMP,
                    )  # fmt: skip
                else:  # (the page loaded before the merge, stored after it)
                    where, blk, page = _block_and_page(
                        order_ptr, rloc_ptr, pages_ptr, orow, row, b, first + j, end, n_sink,
                        tail0, nf, kept0, NB, KEPT, STAMP,
                    )  # fmt: skip
                tok = tl.arange(0, BS)
                valid = (first + j < end) & (blk * BS + tok < length)
                if HAS_HOST:  # (a host block's copy reads the padding page 0, replaced)
                    where_hbm = tl.maximum(where, 0)
                else:
                    where_hbm = where
                at = [where_hbm * BS + h * desc_head_rows, h * desc_head_cols]
                k = k_desc.load(at)
                v = tl.where(valid[:, None], v_desc.load(at), 0.0)
                if HAS_HOST:  # on the host tier (or in the unit cache): gathered (masked
                    # loads, no branch: a branch in the loop fails Triton's pipeliner)
                    wv = (where + tl.zeros([BS], tl.int32)).to(tl.int64)
                    hv = ((valid != 0) & (wv < 0)) != 0  # (a boolean in the interpreter)
                    kp, vp, in_hbm = _block_ptrs(
                        wv, tok, hv, h, dd,
                        k_slots, v_slots, k_host, v_host, uslot_ptr, cpages_ptr, kshift_ptr,
                        vshift_ptr, uslot_stride, cache_layers, slot_stride, tok_stride,
                        head_stride, host_slot_stride, host_tok_stride, host_head_stride,
                        HAS_HOST, CACHED,
                    )  # fmt: skip
                    k = tl.where(wv[:, None] < 0, tl.load(kp, mask=hv[:, None], other=0.0), k)
                    v = tl.where(wv[:, None] < 0, tl.load(vp, mask=hv[:, None], other=0.0), v)
                    if STATS:
                        n_host += tl.sum((hv & (tok == 0) & (~in_hbm)).to(tl.int32), axis=0)
                m_i, l_i, acc, smallest = _merge_tile(
                    q, k, v, valid, first + j, end, nf, scale, m_i, l_i, acc, smallest,
                    GP, 1, BS, D, PREC, TRACK, ONE_EXP,
                )  # fmt: skip
                if STAMP:  # one store per block
                    if first + j < end:
                        tl.store(stamp_ptr + h * stamp_stride + page, step)
        else:
            if PREFETCH:
                # This tile's ids were loaded an iteration ago: its K/V addresses wait
                # on no load, and the next tile's ids are in flight while this one is
                # merged.
                where, tok, valid, blk, page = n_where, n_tok, n_valid, n_blk, n_page
                n_where, n_tok, n_valid, n_blk, n_page = _tile_and_pages(
                    order_ptr, rloc_ptr, pages_ptr, orow, row, b, first + S * NBLK, end,
                    length, n_sink, tail0, nf, kept0, NB, BS, NBLK, KEPT, STAMP,
                )  # fmt: skip
            else:  # (pages loaded before the merge, so the stores after it wait on none)
                where, tok, valid, blk, page = _tile_and_pages(
                    order_ptr, rloc_ptr, pages_ptr, orow, row, b, first, end, length, n_sink,
                    tail0, nf, kept0, NB, BS, NBLK, KEPT, STAMP,
                )  # fmt: skip
            kp, vp, in_hbm = _block_ptrs(
                where, tok, valid, h, dd, k_slots, v_slots, k_host, v_host, uslot_ptr,
                cpages_ptr, kshift_ptr, vshift_ptr, uslot_stride, cache_layers,
                slot_stride, tok_stride, head_stride, host_slot_stride, host_tok_stride,
                host_head_stride, HAS_HOST, CACHED,
            )  # fmt: skip
            if STATS and HAS_HOST:
                n_host += tl.sum((valid & (tok == 0) & (~in_hbm)).to(tl.int32), axis=0)
            k = tl.load(kp, mask=valid[:, None], other=0.0)
            v = tl.load(vp, mask=valid[:, None], other=0.0)
            m_i, l_i, acc, smallest = _merge_tile(
                q, k, v, valid, first, end, nf, scale, m_i, l_i, acc, smallest,
                GP, NBLK, BS, D, PREC, TRACK,
            )  # fmt: skip
            if STAMP:  # one store per block: its first token's row
                tl.store(stamp_ptr + h * stamp_stride + page, step, mask=valid & (tok == 0))
    return m_i, l_i, acc, smallest, n_host


@triton.jit
def _wave_attention_kernel(
    q_ptr,
    q_stride,
    k_slots,
    v_slots,
    k_desc,
    v_desc,
    desc_head_rows,
    desc_head_cols,
    k_host,
    v_host,
    rloc_ptr,
    order_ptr,
    lengths_ptr,
    nforced_ptr,
    wave_ends_ptr,
    wave_row_ptr,
    ub_suffix_ptr,
    out_ptr,
    lse_ptr,
    nread_ptr,
    nwaves_ptr,
    part_ptr,
    acc_part_ptr,
    counter_ptr,
    pages_ptr,
    stamp_ptr,
    step_ptr,
    stats_ptr,
    uslot_ptr,
    cpages_ptr,
    kshift_ptr,
    vshift_ptr,
    rowhost_ptr,
    sel_slot_ptr,
    sel_nbr_ptr,
    sel_fresh_ptr,
    budget_ptr,
    nk_k_ptr,
    nk_loc_ptr,
    nk_mean_ptr,
    nk_min_ptr,
    nk_max_ptr,
    nk_scale_ptr,
    code_step,
    sink,
    recent,
    stamp_stride,
    uslot_stride,
    cache_layers,
    wave_stride,
    scale,
    limit,
    max_read,
    cap_frac,
    Hkv,
    NB,
    slot_stride,
    tok_stride,
    head_stride,
    host_slot_stride,
    host_tok_stride,
    host_head_stride,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    NBLK: tl.constexpr,
    RULE: tl.constexpr,
    PREC: tl.constexpr,
    HAS_HOST: tl.constexpr,
    CACHED: tl.constexpr,
    S: tl.constexpr,
    STAGES: tl.constexpr,
    STAMP: tl.constexpr,
    STATS: tl.constexpr,
    ONE_WAVE: tl.constexpr,
    KEPT: tl.constexpr,
    PREFETCH: tl.constexpr,
    TMA: tl.constexpr,
    ONE_EXP: tl.constexpr,
    TRACK: tl.constexpr,
    ROWS: tl.constexpr = 0,
    BUDGET: tl.constexpr = True,
    NEWMETA: tl.constexpr = False,
    NK_MEAN: tl.constexpr = False,
    NK_BOUNDS: tl.constexpr = False,
    NK_CODES: tl.constexpr = False,
    NK_BSP: tl.constexpr = 16,
    HOST_ROWS: tl.constexpr = 0,
):
    """Grid (B, Hkv, S): S programs split each wave of one (request, KV head) by tiles.

    Bookkeeping is written here, not by later launches: with STAMP every block read
    gets `*step_ptr` in `stamp_ptr[h * stamp_stride + page]` (its page from the page
    table `pages_ptr [B, NB]`: last-use stamps for working sets and residency), and
    with STATS the blocks read, the blocks available and the blocks read from the host
    tier are added to `stats_ptr[0:3]`.

    CACHED (tiered home): a host unit that the unit cache holds is read from HBM instead:
    its position `q = uslot_ptr[h * uslot_stride + host block]` >= 0 is page
    `cpages_ptr[q // cache_layers]` of layer `q % cache_layers`'s buffer, `kshift_ptr[l]`
    (`vshift_ptr[l]`) elements from this layer's (`sglang_psa.mem_cache.unit_cache`).
    HOST_ROWS splits the rows between two launches by the step's row flags
    (`rowhost_ptr[b]`, nonzero where a block of the row is off HBM); programs of the other
    rows return at once. 1: the rows with no block off HBM, in a launch compiled without
    the host tier (HAS_HOST false: the HBM home's code, registers and occupancy); 2: the
    flagged rows (with HAS_HOST). 0: every row.

    ONE_WAVE (no stop rule: threshold 1 or a fixed budget) reads every block in one wave:
    the S programs never wait for each other, the last to finish merges their states
    (a ticket counter), so the launch needs no co-residency (not cooperative) and S can
    fill the GPU.

    With S > 1 the programs of a (request, KV head) exchange their (max, sum,
    smallest) after every wave through `part_ptr` (double-buffered by wave
    parity) and a counter barrier, so all S take the same stop decision; their
    accumulators meet once, in `acc_part_ptr`, after the last wave. S > 1 needs
    every program resident at once (cooperative launch).

    KEPT: the read order is a kept selection (`sgl_kernel_ext.selection`): row
    `sel_slot_ptr[b]` of `order_ptr [slots, Hkv, NB]`, ranked when the request had
    `sel_nbr_ptr[b]` blocks; the forced blocks (`sink` first ones, and every block from
    the tail block at ranking time on, `recent` of them then) come first.

    ROWS (a kept selection) splits the rows between two launches; programs of the other
    rows return at once. 1: the rows that rank this step (`sel_fresh_ptr[b]`) read as
    a run without ROWS does (under the stop rule, in waves; or top-k's budget) and, with
    BUDGET (the stop rule's), leave how many ranked blocks they read in
    `budget_ptr[slot * Hkv + h]`; 2 (a ONE_WAVE launch): the rows reading a kept
    selection read their forced blocks and, with BUDGET, that many ranked ones (spec:
    `algo.attention.progressive_attention(prior=(.., budget))`), without it top-k's
    `max_read` blocks (`topk_attention(prior=...)`), in one wave, with no stop rule.

    NEWMETA (with ROWS 2): each row's first program also writes the metadata of its KV
    head's page of the step's new key (slot `nk_loc_ptr[b]` of SGLang's key buffer
    `nk_k_ptr`; `store_page_meta`), so that those rows' new keys cost no launch on the
    ranking's path (the rows that rank wrote theirs before ranking).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    sid = tl.program_id(2)
    bh = b * Hkv + h
    # The request's scalars are loaded together, before the row test: one round trip.
    length = tl.load(lengths_ptr + b)
    if HOST_ROWS == 1:  # the rows with no block off HBM
        if tl.load(rowhost_ptr + b) != 0:
            return
    elif HOST_ROWS == 2:  # the rows with one
        if tl.load(rowhost_ptr + b) == 0:
            return
    if KEPT:
        nbr = tl.load(sel_nbr_ptr + b)
        slot = tl.load(sel_slot_ptr + b)
    if ROWS == 1:  # the rows that rank this step
        if tl.load(sel_fresh_ptr + b) == 0:
            return
    elif ROWS == 2:  # the rows that read their kept selection
        if tl.load(sel_fresh_ptr + b) != 0:
            return
        if NEWMETA:
            if sid == 0:
                nk_page, nk_count = new_key_page(tl.load(nk_loc_ptr + b), BS)
                store_page_meta(nk_k_ptr, nk_page, nk_count, h, Hkv, nk_mean_ptr, nk_min_ptr,
                                nk_max_ptr, nk_scale_ptr, code_step, BS, D, NK_BSP, D,
                                NK_MEAN, NK_BOUNDS, NK_CODES)  # fmt: skip
    nb = (length + BS - 1) // BS
    if KEPT:
        n_sink = tl.minimum(sink, nbr)
        tail0 = tl.maximum(n_sink, nbr - recent)
        nf = n_sink + nb - tail0
        kept0 = n_sink + nbr - tail0
        orow = (slot * Hkv + h) * NB
    else:
        nf = tl.load(nforced_ptr + b)
        n_sink, tail0, kept0, orow = 0, 0, 0, 0  # a kept selection's only
    # Blocks this request's heads read at most: the budget, and `cap_frac` of its blocks
    # (the ceiling of the float32 product; never below the forced blocks).
    mr = tl.minimum(max_read, tl.maximum(nf, tl.ceil(cap_frac * nb.to(tl.float32)).to(tl.int32)))
    if ROWS == 2:
        if BUDGET:  # a kept selection read at its kept budget, in one wave
            kept_n = tl.load(budget_ptr + slot * Hkv + h)
            mr = tl.minimum(nb, nf + tl.maximum(kept_n, 0))
    g = tl.arange(0, GP)
    gmask = g < G
    dd = tl.arange(0, D)
    hq = h * G + g
    q = _group_query(q_ptr, b, q_stride, hq, gmask, dd, D)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    smallest = tl.full([GP], float("inf"), tl.float32)
    row = bh * NB
    # This request's wave schedule: a row of the table, chosen by its block count (the
    # first wave may grow with the context).
    ends_row = wave_ends_ptr + tl.load(wave_row_ptr + tl.minimum(nb, NB)) * wave_stride
    step = tl.load(step_ptr) if STAMP else 0
    wstart = 0
    w = 0
    n_host = 0
    done = (nb <= 0).to(tl.int32)
    while done == 0:
        end = tl.minimum(tl.minimum(nf + tl.load(ends_row + w), nb), mr)
        if ROWS == 2:
            end = mr
        # This program's tiles of the wave. (Block ids are loaded a tile ahead (PREFETCH)
        # only where no host read is beside them in a descriptor launch: that failed
        # Triton 3.6's pipeliner.)
        m_i, l_i, acc, smallest, n_host = _read_wave(
            q, m_i, l_i, acc, smallest, n_host, wstart, end, sid, b, h, dd, length, nf,
            n_sink, tail0, kept0, orow, row, step, scale, order_ptr, rloc_ptr, pages_ptr,
            stamp_ptr, stamp_stride, k_slots, v_slots, k_desc, v_desc, desc_head_rows,
            desc_head_cols, k_host, v_host, uslot_ptr, cpages_ptr, kshift_ptr, vshift_ptr,
            uslot_stride, cache_layers, slot_stride, tok_stride, head_stride,
            host_slot_stride, host_tok_stride, host_head_stride, NB, G, GP, D, BS, NBLK,
            S, STAGES, PREC, HAS_HOST, CACHED, STAMP, STATS, KEPT,
            PREFETCH and not (HAS_HOST and TMA), TMA, ONE_EXP, TRACK,
        )  # fmt: skip
        wstart = end
        if S == 1 or ONE_WAVE:  # nothing to agree on: one wave reads every block
            covered = m_i + tl.log(l_i)
            low = smallest
        else:
            # Publish this program's (max, sum, smallest), wait for the S programs of this
            # (b, h), merge. The accumulators are exchanged once, after the last wave.
            buf = (w % 2) * (tl.num_programs(0) * Hkv * S) + bh * S + sid
            tl.store(part_ptr + buf * 3 * GP + g, m_i)
            tl.store(part_ptr + buf * 3 * GP + GP + g, l_i)
            tl.store(part_ptr + buf * 3 * GP + 2 * GP + g, smallest)
            tl.debug_barrier()
            target = (w + 1) * S
            seen = tl.atomic_add(counter_ptr + bh, 1, sem="release") + 1
            while seen < target:
                seen = tl.atomic_add(counter_ptr + bh, 0, sem="acquire")
            tl.debug_barrier()
            first = (w % 2) * (tl.num_programs(0) * Hkv * S) + bh * S
            ss = tl.arange(0, S)
            base = (first + ss)[:, None] * 3 * GP + g[None, :]
            m_all = tl.load(part_ptr + base, volatile=True)  # [S, GP]
            l_all = tl.load(part_ptr + base + GP, volatile=True)
            low = tl.min(tl.load(part_ptr + base + 2 * GP, volatile=True), axis=0)
            m_top = tl.max(m_all, axis=0)
            l_top = tl.sum(
                tl.where(m_all == float("-inf"), 0.0, l_all * tl.exp(m_all - m_top[None, :])),
                axis=0,
            )
            covered = m_top + tl.log(l_top)
        w += 1
        done = _stop(
            covered, low, ub_suffix_ptr, b * Hkv * G + hq, wstart, nb, mr, limit, gmask,
            NB, RULE,
        )  # fmt: skip
    writer = sid == 0
    if S == 1:
        out = acc / l_i[:, None]
        lse = m_i + tl.log(l_i)
    elif ONE_WAVE:
        # Publish this program's state; the last of the S to arrive merges them, one
        # program's state at a time (a [S, GP, D] tensor of them spilled from S = 4 on).
        me = bh * S + sid
        tl.store(part_ptr + me * 3 * GP + g, m_i)
        tl.store(part_ptr + me * 3 * GP + GP + g, l_i)
        acc_at = g[:, None] * D + dd[None, :]
        tl.store(acc_part_ptr + me * GP * D + acc_at, acc, mask=gmask[:, None])
        tl.debug_barrier()
        ticket = tl.atomic_add(counter_ptr + bh, 1, sem="acq_rel")
        writer = ticket == S - 1
        m_top = tl.full([GP], float("-inf"), tl.float32)
        lsum = tl.zeros([GP], tl.float32)
        out = tl.zeros([GP, D], tl.float32)
        if writer:
            for other in range(S):
                src = bh * S + other
                m_s = tl.load(part_ptr + src * 3 * GP + g, volatile=True)
                l_s = tl.load(part_ptr + src * 3 * GP + GP + g, volatile=True)
                a_s = tl.load(
                    acc_part_ptr + src * GP * D + acc_at,
                    mask=gmask[:, None],
                    other=0.0,
                    volatile=True,
                )
                m_new = tl.maximum(m_top, m_s)
                alpha = tl.where(m_top == float("-inf"), 0.0, tl.exp(m_top - m_new))
                beta = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_new))
                lsum = lsum * alpha + l_s * beta
                out = out * alpha[:, None] + a_s * beta[:, None]
                m_top = m_new
            # every program has arrived: reset the ticket for the next launch
            tl.atomic_xchg(counter_ptr + bh, 0)
        out = out / lsum[:, None]
        lse = m_top + tl.log(lsum)
    else:
        # Every program holds the merged scalars and took the same stop decision; each
        # publishes its accumulator and program 0 merges them.
        tl.store(acc_part_ptr + (bh * S + sid) * GP * D + g[:, None] * D + dd[None, :], acc)
        tl.debug_barrier()
        if sid != 0:
            tl.atomic_add(counter_ptr + bh, 1, sem="release")
        else:
            target = w * S + S - 1
            seen = tl.atomic_add(counter_ptr + bh, 0, sem="acquire")
            while seen < target:
                seen = tl.atomic_add(counter_ptr + bh, 0, sem="acquire")
            # Every other program has arrived for the last time: the barrier's counter is
            # reset here for the next launch (no zeroing launch per layer).
            tl.atomic_xchg(counter_ptr + bh, 0)
        tl.debug_barrier()
        # Program 0 merges the S accumulators one at a time (all S at once would set the
        # registers of the whole kernel, and so how many programs an SM holds).
        last = ((w - 1) % 2) * (tl.num_programs(0) * Hkv * S) + bh * S
        ss = tl.arange(0, S)
        m_top = tl.max(
            tl.load(part_ptr + (last + ss)[:, None] * 3 * GP + g[None, :], volatile=True), axis=0
        )
        lsum = tl.zeros([GP], tl.float32)
        out = tl.zeros([GP, D], tl.float32)
        if writer:
            for other in range(S):
                m_s = tl.load(part_ptr + (last + other) * 3 * GP + g, volatile=True)
                l_s = tl.load(part_ptr + (last + other) * 3 * GP + GP + g, volatile=True)
                a_s = tl.load(
                    acc_part_ptr + (bh * S + other) * GP * D + g[:, None] * D + dd[None, :],
                    volatile=True,
                )
                wgt = tl.where(m_s == float("-inf"), 0.0, tl.exp(m_s - m_top))
                lsum += wgt * l_s
                out += wgt[:, None] * a_s
        out = out / lsum[:, None]
        lse = m_top + tl.log(lsum)
    if writer:
        res = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + (b * Hkv * G + hq)[:, None] * D + dd[None, :], res, mask=gmask[:, None])
        tl.store(lse_ptr + b * Hkv * G + hq, lse, mask=gmask)
        tl.store(nread_ptr + bh, wstart)
        tl.store(nwaves_ptr + bh, w)
        if ROWS == 1:
            if BUDGET:  # ranked this step: the budget the kept steps read at
                tl.store(budget_ptr + slot * Hkv + h, wstart - nf)
        if STATS:
            tl.atomic_add(stats_ptr, wstart.to(tl.int64))
            tl.atomic_add(stats_ptr + 1, nb.to(tl.int64))
    if STATS & HAS_HOST:  # every program: the host units its tiles read
        tl.atomic_add(stats_ptr + 2, n_host.to(tl.int64))


# With key codes the certified rule compares the float32 mass the kernel sums against a
# float64 bound: it asks for this much more in log space (a relative 1e-4 of the mass, far
# above the float32 rounding of a sum over a request's blocks) before it stops, so the
# guarantee holds for the true mass.
CODE_LIMIT_MARGIN = 1e-4
# Blocks per program of the key-code bound kernel (`code_bounds`).
CODE_BLOCKS = 4


@dataclass
class WaveResult:
    out: torch.Tensor  # [B, Hq, d] in the plan's output dtype
    lse: torch.Tensor  # [B, Hq] float32
    # [B, Hkv, NB] int32: read order (stale past a request's blocks); with a kept
    # selection the cache's `[slots, Hkv, NB]`, row b's order at `slot[b]`
    order: torch.Tensor
    n_read: torch.Tensor  # [B, Hkv] int32: blocks read = order[..., :n_read]
    n_waves: torch.Tensor  # [B, Hkv] int32
    slot: torch.Tensor | None = None  # [B] int32: each row's slot of a kept selection

    def read_mask(self) -> torch.Tensor:
        """`[B, Hkv, NB]` bool: the blocks read. Past a request's blocks `order` may hold
        stale entries (repeats): they add nothing. (Allocates: diagnosis and tests.)"""
        order = self.order if self.slot is None else self.order[self.slot.long()]
        NB = order.shape[-1]
        sorted_read = torch.arange(NB, device=order.device) < self.n_read[..., None]
        idx = order.long().clamp(0, NB - 1)
        hits = torch.zeros_like(idx).scatter_add(-1, idx, sorted_read.long())
        return hits > 0


class Workspace:
    """Device buffers shared by plans that never run at the same time (SGLang replays one
    decode graph at a time, one per captured batch size): each plan takes views of the
    same flat buffers instead of its own. A request larger than a buffer replaces it
    (plans holding the old one keep it alive), so size it by the largest plan first."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get((name, dtype))
        if buf is None or buf.numel() < n:
            # zeroed once: the split barrier's counters rely on it (each launch resets them)
            buf = torch.zeros(max(n, 1), dtype=dtype, device=self.device)
            self._bufs[(name, dtype)] = buf
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._bufs.values())


def _one_wave_splits(sms: int, programs: int, read: int, warps: int, most: int) -> int:
    """Programs a (request, KV head) of a one-wave launch, whose programs never wait for
    each other: ~32 warps per SM, at least 8 blocks each, at most `most` (the best of
    bench_wave --serving-a's sweeps)."""
    return max(1, min(most, -(-(32 // warps) * sms // programs), read // 8))


class WaveAttention:
    """Plan once for a batch shape, run per layer: scoring, ranking and the wave kernel.

    `plan()` fixes the wave schedule and every buffer a run writes (from a shared
    `Workspace` when given); `run()` allocates no buffer of its own (either stop rule) and
    never synchronises with the host, so a decode step of runs is captured in a CUDA graph.
    """

    # Up to this many blocks per request (2M tokens of 32) the ranking kernels sort
    # (`ranking.py`); beyond, torch sorts (the same order).
    fused_rank_max_blocks = 1 << 16

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
        wave_fraction: float = 0.0,
        max_first_wave_blocks: int = 64,
        later_wave_blocks: int = 0,
        max_read_fraction: float = 1.0,
    ):
        if stop_rule not in ("heuristic", "certified"):
            raise ValueError(f"stop_rule must be heuristic|certified, got {stop_rule!r}")
        self.bs, self.threshold, self.rule, self.score = block_size, threshold, stop_rule, score
        self.sink, self.recent = sink_blocks, recent_blocks
        self.wave = (wave_blocks, wave_growth, max_wave_blocks)
        self.wave_fraction, self.max_first_wave = wave_fraction, max_first_wave_blocks
        self.later_wave = later_wave_blocks  # 0: later waves start at the first's size
        # A (request, KV head) reads at most this share of the request's blocks under the
        # heuristic rule with ε < 1 (the certified rule's guarantee would not survive a cap;
        # ε = 1 is dense, top-k's budget is `max_read_blocks`).
        capped = stop_rule == "heuristic" and threshold < 1.0
        self.max_read_fraction = float(max_read_fraction) if capped else 1.0
        self._tables: dict = {}  # wave tables by (blocks, one wave, device), shared by copies
        # Launch shape: the best of `benchmark/kernels/bench_wave.py`'s sweeps (the
        # launch sweeps kept in benchmark/results/decode_step_h100.json). None: by the
        # run's kind (`plan` sets `warps`, `run` the tile): runs in waves read one block a
        # tile through tensor descriptors with one warp a program (more programs share a
        # heavy head); one-wave runs gather 64-token tiles with two.
        self.tile_tokens, self.num_warps = None, None
        # Software-pipeline depth of the tile loop (1: none).
        self.num_stages = 2
        # Load the next tile's block ids while this tile is merged; None: for runs in waves
        # only (it lost on one-wave reads).
        self.prefetch = None
        # Read HBM blocks through tensor descriptors (copied into shared memory by the TMA)
        # where the GPU has them (sm_90 on); None: for runs in waves only (one-wave runs
        # gather faster). Blocks on a host tier are gathered in either (`_block_ptrs`).
        self.tma = None
        # The kept rows' launch (`run`'s second, one wave): tokens a tile, warps, pipeline
        # depth, ids loaded a tile ahead, most programs a (request, KV head), tensor
        # descriptors or the per-row gather. 128-token tiles with four warps: 7-11% faster
        # than 64 with two at a16's and a's shapes (bench_wave --kept-sweep, H200).
        self.kept_tile_tokens, self.kept_warps, self.kept_stages = 128, 4, 2
        self.kept_prefetch, self.kept_most_splits, self.kept_tma = False, 8, False
        # The kept rows' launch runs on a side stream, beside the fresh rows' launches (`run`).
        self.kept_beside = True
        # Beside it, the fresh rows' chain (the new keys' page metadata, scoring, ranking,
        # the waves launch) may run on a stream of higher priority: on the steps between
        # rankings that chain has no row but its launches still take SMs, and the kept
        # launch's programs filled them first (in a 16K top-k server step the 64-program
        # page-metadata launch waited behind them, 15 us a layer against ~3 alone).
        # None: by the plan. Top-k's kept launch is short and the chain ends its layer:
        # ahead (a 16K layer 20.4 us against 22.8, 28K even); the stop rule's kept launch
        # reads more and ends the layer itself: not ahead (34.9 us against 37.3 at 16K,
        # 37.5 against 39.2 at 28K; bench_wave --kept-sweep, H200).
        self.fresh_first: bool | None = None
        # Top-k's kept rows read in that launch of their own; False: in one launch with the
        # fresh rows, after their ranking (bench_wave --kept-sweep's comparison; the stop
        # rule's kept rows always have their own, which reads their kept budget).
        self.kept_split = True
        # The heuristic rule's block-at-a-time merge takes one exponential pass per block
        # (its log-mass and its merge from the same exponentials), not two.
        self.one_exp = True
        # Blocks per ranking program (rows longer than this are sorted in chunks, merged).
        self.rank_chunk_blocks = 512
        # Scoring launch: blocks per program and warps (H100 sweep in bench_wave).
        self.score_blocks, self.score_warps = 64, 4
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
            wave_fraction=cfg.wave_fraction,
            max_first_wave_blocks=cfg.max_first_wave_blocks,
            later_wave_blocks=cfg.later_wave_blocks,
            max_read_fraction=cfg.max_read_fraction,
        )

    def first_wave(self, n_blocks: int) -> int:
        """The first wave of a request of `n_blocks` blocks (`PSAConfig.first_wave`)."""
        first = self.wave[0]
        if not self.wave_fraction:
            return first
        return min(max(int(n_blocks * self.wave_fraction), first), self.max_first_wave)

    def _wave_table(self, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[F, W]` int32 cumulative wave ends, one row per distinct first wave (each row
        ends with a repeat of its last end), and `[max_blocks + 1]` int32: the row of a
        request of n blocks (spec: `PSAConfig.wave_sizes`; later waves from `later_wave`)."""
        _, growth, cap = self.wave
        if self.one_wave:
            firsts = [max_blocks] * (max_blocks + 1)
        else:
            firsts = [self.first_wave(n) for n in range(max_blocks + 1)]
        rows: dict[int, list[int]] = {}
        for first in firsts:
            if first in rows:
                continue
            ends, size, left, top = [], float(first), max_blocks, float(max(cap, first))
            while left > 0:
                left -= min(int(size), left)
                ends.append(max_blocks - left)
                if len(ends) == 1 and self.later_wave:
                    size = float(self.later_wave)
                else:
                    size = min(size * growth, top)
            rows[first] = (ends or [1]) + [(ends or [1])[-1]]
        width = max(len(r) for r in rows.values())
        table = [r + r[-1:] * (width - len(r)) for r in rows.values()]
        index = {f: i for i, f in enumerate(rows)}
        return (
            torch.tensor(table, dtype=torch.int32),
            torch.tensor([index[f] for f in firsts], dtype=torch.int32),
        )

    @staticmethod
    def launch_warps(described: bool) -> int:
        """The wave launch's warps unless `num_warps` says: one where blocks are read
        through tensor descriptors (`described`; sm_90 on), else two (the per-row gather)."""
        return 1 if described else 2

    def plan(
        self,
        batch: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        max_blocks: int,
        device: torch.device | str,
        splits: int | None = None,
        out_dtype: torch.dtype = torch.float32,
        workspace: Workspace | None = None,
        read_blocks: int | None = None,
    ) -> WaveAttention:
        """Fix shapes, the wave schedule and buffers, on this object (plan a copy, see
        `planned`, to keep several). `splits` programs share each (request, KV head); by
        default as many as keep two programs per SM resident (always 1 in Triton's
        interpreter, which runs programs one after another). The output is written in
        `out_dtype` (the model's, so no conversion follows). `read_blocks` is the most a
        run reads per (request, KV head) (a top-k budget), for choosing the split.
        """
        dev = torch.device(device)
        self._ws = workspace if workspace is not None else Workspace(dev)
        # No stop rule (threshold 1, or top-k's fixed budget): one wave, no barriers.
        self.one_wave = self.limit == -math.inf
        # Whether runs may read through tensor descriptors (`_descriptors` then checks each
        # run's layout): decided once here, with the launch it picks.
        interp = os.environ.get("TRITON_INTERPRET") == "1"
        has_tma = TensorDescriptor is not None and (
            interp or (dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9)
        )
        wanted = self.tma if self.tma is not None else not self.one_wave
        self.described = bool(wanted and has_tma)
        self.warps = self.num_warps or self.launch_warps(self.described)
        compiled = dev.type == "cuda" and not interp  # the interpreter runs programs in turn
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if compiled else 0
        programs = batch * n_kv_heads
        if splits is None:
            splits = 1
            if compiled:
                if self.one_wave:
                    read = max_blocks if read_blocks is None else min(read_blocks, max_blocks)
                    splits = _one_wave_splits(sms, programs, read, self.warps, 32)
                else:
                    # As many programs as the register file holds per SM, at ~240 registers
                    # a thread (capping them with maxnreg spilled and ran slower);
                    # run() halves this if a launch does not fit. Short contexts get fewer:
                    # every wave ends in a barrier of all the splits (and a split launch is
                    # cooperative), which costs more than it saves below ~64 blocks per
                    # split (bench_wave: overhead_by_splits_us).
                    per_sm = max(1, 65536 // (240 * 32 * self.warps))
                    splits = max(1, min(16, per_sm * sms // programs, max_blocks // 64))
        if splits & (splits - 1):
            splits = 1 << (splits.bit_length() - 1)  # a power of two for tl.arange
        # A kept selection's rows read in one wave (`run`'s second launch): up to
        # `kept_most_splits` programs a (request, KV head), of what the read cap (top-k:
        # its budget) lets a head read (bench_wave --launch-probe: psa's kept reads of
        # 50-200 blocks at 32 x 16K). A dense plan keeps no selection.
        self.kept_splits = 1
        if compiled and (not self.one_wave or read_blocks is not None):
            if self.one_wave:
                cap = min(read_blocks, max_blocks)
            else:
                cap = int(self.max_read_fraction * max_blocks)
            kept = _one_wave_splits(sms, programs, cap, self.kept_warps, self.kept_most_splits)
            self.kept_splits = 1 << (kept.bit_length() - 1)
        self.B, self.Hq, self.Hkv, self.D, self.NB = (
            batch,
            n_q_heads,
            n_kv_heads,
            head_dim,
            max_blocks,
        )
        self._alloc_splits(splits, batch, n_q_heads, n_kv_heads, head_dim, dev)
        # A kept selection's rows read on this stream, beside the fresh rows' scoring,
        # ranking and waves (`run`); made here, before any graph capture.
        self.side = torch.cuda.Stream(dev) if compiled else None
        # ... and the fresh rows' chain on this one, ahead of the kept rows for free SMs (a
        # captured kernel keeps its stream's priority: PyTorch instantiates graphs with
        # per-node priorities).
        self.urgent = torch.cuda.Stream(dev, priority=-1) if compiled else None
        # ... and, with row flags (the tiered home), the flagged rows' launches on this
        # one, forked after the ranking, beside the unflagged rows' launch: off the layer's
        # path (bench_wave --tiered-a, H100: 1.034x the HBM home's layer, 1.047 after the
        # unflagged launch, 1.057 as two launches in the fresh rows' chain).
        self.flagged = torch.cuda.Stream(dev) if compiled else None
        key = (max_blocks, self.one_wave, str(dev))
        if key not in self._tables:
            self._tables[key] = tuple(t.to(dev) for t in self._wave_table(max_blocks))
        self.wave_ends, self.wave_row = self._tables[key]
        take = self._ws.take
        i32, f32 = torch.int32, torch.float32
        B, Hq, Hkv, NB = batch, n_q_heads, n_kv_heads, max_blocks
        self.out = take("out", (B, Hq, head_dim), out_dtype)
        self.lse = take("lse", (B, Hq), f32)
        self.n_read = take("n_read", (B, Hkv), i32)
        self.order = take("order", (B, Hkv, NB), i32)
        self.ranked_loc = take("ranked_loc", (B, Hkv, NB), i32)  # the table in read order
        self.n_forced = take("n_forced", (B,), i32)
        self.n_waves = take("n_waves", (B, Hkv), i32)
        self.logits = take("logits", (B, Hq, NB), f32)
        if self.rule == "certified":  # the bound mass left after each read position,
            # and the key-code bounds' partial log-sum-exps (`_rank_codes`)
            self.ub_suffix = take("ub_suffix", (B, Hq, NB + 1), f32)
            self.code_partials = take("code_partials", (B, Hq, -(-NB // CODE_BLOCKS), 2), f32)
        self.partials = take("partials", (B, Hq, partial_chunks(NB, self.score_blocks), 2), f32)
        n = rank_scratch_numel(B, Hkv, NB, self.rank_chunk_blocks)
        self.rank_scratch = take("rank_scratch", (n,), torch.int64) if n else None
        if self.one_wave:  # a dense run reads every block in block order: no ranking
            self.identity = take("identity", (B, Hkv, NB), i32)
            self.identity.copy_(torch.arange(NB, dtype=i32, device=dev).expand(B, Hkv, NB))
            self.no_forced = take("no_forced", (B,), i32)  # zeroed once, never written
        return self

    def _descriptors(self, k_slots, v_slots, strides):
        """`(k, v, head rows, head columns)`: tensor descriptors of the K and V slots as
        2-D `[rows, tok_stride]` (a slot is `bs` consecutive rows; a KV head starts that
        many rows or columns further), or None where they do not apply: a GPU without a
        TMA (before sm_90), a layout of another shape, rows not 16-byte aligned. (A host
        tier's blocks are gathered beside them: `_block_ptrs`.)"""
        if not self.described:
            return None
        slot_stride, tok_stride, head_stride = strides
        if slot_stride != self.bs * tok_stride or (tok_stride * k_slots.element_size()) % 16:
            return None
        if head_stride % tok_stride == 0:  # head-major: a head is rows further
            head_rows, head_cols = head_stride // tok_stride, 0
        elif (self.Hkv - 1) * head_stride + self.D <= tok_stride:  # token-major: columns
            head_rows, head_cols = 0, head_stride
        else:
            return None
        descs = []
        for t in (k_slots, v_slots):
            if t.data_ptr() % 16 or not t.is_contiguous() or t.numel() % tok_stride:
                return None
            rows = t.numel() // tok_stride
            descs.append(
                TensorDescriptor(t, [rows, tok_stride], [tok_stride, 1], [self.bs, self.D])
            )
        return (*descs, head_rows, head_cols)

    def planned(self, *args, **kwargs) -> WaveAttention:
        """A copy of this (unplanned or planned) object, planned with these arguments."""
        other = copy.copy(self)
        return other.plan(*args, **kwargs)

    def _alloc_splits(
        self,
        splits: int,
        batch: int,
        n_q_heads: int,
        n_kv_heads: int,
        head_dim: int,
        dev: torch.device,
    ) -> None:
        self.splits = splits
        gp = max(triton.next_power_of_2(n_q_heads // n_kv_heads), 16)
        take, f32 = self._ws.take, torch.float32
        self.part = take("part", (2, batch, n_kv_heads, splits, 3, gp), f32)  # wave parity
        self.acc_part = take("acc_part", (batch, n_kv_heads, splits, gp, head_dim), f32)
        # The kept rows' launch has buffers of its own: it runs beside the waves launch.
        ks = self.kept_splits
        self.kept_part = take("kept_part", (batch, n_kv_heads, ks, 3, gp), f32)
        self.kept_acc_part = take("kept_acc_part", (batch, n_kv_heads, ks, gp, head_dim), f32)
        # The split barrier's arrival counters: zero between launches (each resets its own).
        self.counters = take("counters", (batch * n_kv_heads,), torch.int32)

    def rank(
        self,
        q,
        meta_mean,
        meta_min,
        meta_max,
        lengths,
        scale,
        meta_pages=None,
        loc=None,
        meta_scale=None,
        codes=None,
        kept=None,
    ):
        """Read order `[B, Hkv, NB]` (forced blocks first, then by criticality), forced
        counts `[B]` and, for the certified rule, suffix sums of the bound log-mass.
        With the block table `loc` (int32), `self.ranked_loc` receives it in read order.
        `codes` (planes, lo, hi; see `run`): blocks are ranked by their key-code bound,
        which is also the certified rule's bound (spec: `algo.attention.progressive_attention
        (code_bits=)`). `kept = (order, slot, fresh)` (see `run`): only fresh rows are
        scored and ranked, into their slot's row of `order` (no `loc`)."""
        B, Hq, _ = q.shape
        Hkv, bs = self.Hkv, self.bs
        if codes is not None:
            return self._rank_codes(q, codes, lengths, scale, loc, meta_pages)
        fused = self.NB <= self.fused_rank_max_blocks
        if kept is not None and not fused:
            raise ValueError(
                f"a kept selection needs the fused ranking (<= {self.fused_rank_max_blocks} blocks)"
            )
        fresh = None if kept is None else kept[2]
        logits, ub = block_scores(
            q,
            meta_mean,
            meta_min,
            meta_max,
            lengths,
            bs,
            scale,
            self.score,
            want_bound=self.rule == "certified",
            pages=meta_pages,
            normalize=False,
            partials=self.partials if fused else None,
            blocks_per_program=self.score_blocks,
            num_warps=self.score_warps,
            out=self.logits,
            meta_scale=meta_scale,
            skip_past_length=fused,  # the fused ranking reads only each request's blocks
            fresh=fresh,
        )
        if fused:  # group criticality, forced blocks first, stable descending chunked sort
            order, n_forced = rank_blocks(
                logits,
                lengths,
                bs,
                self.sink,
                self.recent,
                Hkv,
                self.order if kept is None else kept[0],
                self.n_forced,
                partials=self.partials,
                chunk_blocks=self.rank_chunk_blocks,
                loc=loc if kept is None else None,
                ranked_loc=self.ranked_loc if kept is None else None,
                scratch=self.rank_scratch,
                partial_blocks=max(self.score_blocks, 16),  # what block_scores launched
                skip_past_length=True,
                fresh=fresh,
                order_rows=None if kept is None else kept[1],
            )
        else:  # too many blocks for one program's registers: torch's sort, same result
            crit = criticality_from_logits(logits, Hkv)
            nblk = (lengths + bs - 1) // bs
            idx = torch.arange(self.NB, device=q.device)[None, :]
            forced = (idx < nblk[:, None]) & (
                (idx < self.sink) | (idx >= nblk[:, None] - self.recent)
            )
            key = torch.where(forced[:, None, :], torch.inf, crit)
            order = torch.sort(key, dim=-1, descending=True, stable=True).indices
            order = order.to(torch.int32)
            n_forced = forced.sum(-1).to(torch.int32)
            if loc is not None:
                torch.gather(loc, -1, order.long(), out=self.ranked_loc)
        if self.rule == "certified":
            ub_suffix = suffix_bounds(ub, order, lengths, bs, self.ub_suffix, double=False)
        else:
            ub_suffix = self.lse  # unused by the heuristic rule
        return order, n_forced, ub_suffix

    def _rank_codes(self, q, codes, lengths, scale, loc, pages=None):
        """`rank` on the key-code bound: `code_bounds` writes each block's bound log-mass
        per query head (in the plan's logits buffer), the ranking orders blocks by it, and
        its suffix sums (in float64; `run` leaves `CODE_LIMIT_MARGIN` for the float32 the
        rule compares them in) bound the unread mass. Planes kept per page (5-D) are
        read through the page table `pages`."""
        if self.rule != "certified":
            raise ValueError("key codes bound the unread mass of the certified rule only")
        planes, lo, hi = codes
        paged = planes.dim() == 5
        if paged and pages is None:
            raise ValueError("key codes kept per page need the page table (meta_pages)")
        ub = code_bounds(
            q, planes, lo, hi, lengths, scale, out=self.logits, pages=pages if paged else None,
            blocks_per_program=CODE_BLOCKS, partials=self.code_partials,
        )  # fmt: skip
        order, n_forced = rank_blocks(
            ub,
            lengths,
            self.bs,
            self.sink,
            self.recent,
            self.Hkv,
            self.order,
            self.n_forced,
            chunk_blocks=self.rank_chunk_blocks,
            loc=loc,
            ranked_loc=self.ranked_loc,
            scratch=self.rank_scratch,
            partials=self.code_partials,
        )
        return order, n_forced, suffix_bounds(ub, order, lengths, self.bs, self.ub_suffix)

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
        slot_strides: tuple[int, int, int] | None = None,
        meta_pages: torch.Tensor | None = None,
        host_strides: tuple[int, int, int] | None = None,
        stamps: torch.Tensor | None = None,
        step: torch.Tensor | None = None,
        stats: torch.Tensor | None = None,
        unit_slot: torch.Tensor | None = None,
        cache_pages: torch.Tensor | None = None,
        cache_shift: tuple[torch.Tensor, torch.Tensor] | None = None,
        row_host: torch.Tensor | None = None,
        meta_scale: torch.Tensor | None = None,
        code_planes: torch.Tensor | None = None,
        code_lo: torch.Tensor | None = None,
        code_hi: torch.Tensor | None = None,
        kept: tuple[torch.Tensor, ...] | None = None,
        new_keys: tuple[torch.Tensor | None, ...] | None = None,
        before_rank: Callable[[], None] | None = None,
    ) -> WaveResult:
        """q `[B, Hq, d]`; loc `[B, Hkv, NB]`; meta_* `[B, Hkv, NB, d]` float32; lengths `[B]`.

        `max_read_blocks` caps the blocks read per (request, KV head): with
        threshold 1 this is top-k attention over the same ranked order. The
        `max_read_fraction` of the plan caps them at that share of each request's blocks
        (spec: `sglang_psa.algo.attention.read_cap`).
        `slot_strides` (elements per slot, per token, per KV head) lets the slots be
        another layout: SGLang's `[tokens, Hkv, d]` KV buffer is read in place as
        slots = pages with `(bs * Hkv * d, Hkv * d, d)`. Default: `[num_slots, bs, d]`.
        With `meta_pages [B, NB]` (int32), meta_* are per page `[P, Hkv, d]` (no per-step
        gather). `host_strides` is the same for the host side (default: head-major
        `[units, bs, d]`, a unit per (head, block)); a host-resident SGLang pool is
        token-major like its pages.
        Bookkeeping, written by the kernel: with `stamps [Hkv, P]` (int32, needs
        `meta_pages`) every block read stamps its page with `step [1]` (int32); `stats [3]`
        (int64) gains the blocks read, the blocks available and those read from the host.
        With `unit_slot [Hkv, host blocks + 1]`, `cache_pages [C]` (int32) and
        `cache_shift` (int64 `[L]` for K and V: element offsets from `k_slots`/`v_slots`
        to each layer's buffer, multiples of `unit_cache.LAYER_ALIGN`), the unit cache's
        view from this layer, a cached host unit is read from its position (`unit_slot //
        L`'s page, layer `unit_slot % L`) instead.
        With a host tier, `row_host [B]` (int32) says which rows may have a block off HBM
        (on the host or in the unit cache; nonzero): the others read in a launch of their
        own, the HBM home's, with none of that logic (a zero on a row with such a block
        reads the wrong memory). None: every row may.
        int8 `meta_min`/`meta_max` are 8-bit codes with their scale `meta_scale`
        (`[B, Hkv, NB]`, or `[P, Hkv]` with `meta_pages`; see `block_scores`).
        Certified rule only: `code_planes [B, Hkv, NB, bits, bs, d / 8]` (uint8, every
        token's key as a cell of its block's range `code_lo/code_hi [B, Hkv, NB, d]`
        float32; `sgl_kernel_ext.code_bounds`), or per page `[P, Hkv, bits, bs, d / 8]`
        and `[P, Hkv, d]` read through `meta_pages`, replace the min/max bound, for the ranking
        and the stop rule alike; the rule then asks for `CODE_LIMIT_MARGIN` more in log
        space (the float32 mass the kernel sums may differ from the float64 one by
        rounding), so every query head covers at least ε of its true mass.
        `kept = (order, slot, fresh, nbr, budget)`: a selection kept across steps, the
        views of `SelectionCache` (`order[layer]`, `rows(B)`, `budget[layer]`): fresh rows
        rank into their slot and, under the stop rule, leave their ranked read count in
        `budget [slots, Hkv]`; the others read their slot's order, at that count.
        `new_keys = (k_buffer, locs, mean, kmin, kmax, kscale)`: the step's new keys, at
        slots `locs [B]` of SGLang's key buffer `[tokens, Hkv, d]`, whose pages' metadata
        (`[pages, Hkv, d]`; `kscale [pages, Hkv]` with 8-bit bounds, else None) this run
        writes (`page_meta_from_locs`): before the ranking, which reads it; with a kept
        selection read in a launch of its own, only the rows that rank there, the others'
        in that launch (NEWMETA), off the ranking's path. `before_rank()` issues other work
        the ranking needs and the kept rows' launch does not read (the certified rule's key
        codes): first in the fresh rows' branch (the `urgent` stream, or the current one),
        after the kept rows' launch forks off, so it is not on their path.
        """
        B, Hq, D = q.shape
        Hkv, NB, bs = self.Hkv, self.NB, self.bs
        assert (B, Hq, D) == (self.B, self.Hq, self.D) and loc.shape == (B, Hkv, NB), (
            "run() shapes differ from plan()"
        )
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        q = queries_in_place(q)  # once for scoring and the wave kernel
        loc = loc.to(torch.int32).contiguous()
        lengths = lengths.to(torch.int32).contiguous()
        if kept is not None and (code_planes is not None or self.rule != "heuristic"):
            raise ValueError("a kept selection serves the heuristic rule and top-k only")
        if self.one_wave and max_read_blocks is None:  # dense: every block, block order
            kept = None
        # The rows reading a kept selection run in a launch of their own (`split`); the stop
        # rule's rows keep their read count for the steps that reuse their order (`budget`;
        # top-k's rows read its fixed budget).
        split = kept is not None and (self.kept_split or not self.one_wave)
        budget = split and not self.one_wave
        limit = self.limit if code_planes is None else self.limit - CODE_LIMIT_MARGIN
        has_host = k_host is not None
        k_host = k_slots if k_host is None else k_host
        v_host = v_slots if v_host is None else v_host
        cached = unit_slot is not None
        if cached and (not has_host or cache_pages is None or cache_shift is None):
            raise ValueError("the unit cache needs the host tier, its cache pages and shifts")
        if stamps is not None and (meta_pages is None or step is None):
            raise ValueError("stamps need the page table (meta_pages) and the step counter")
        if new_keys is not None:
            nk_k, nk_locs, nk_mean, nk_min, nk_max, nk_scale = new_keys
            if nk_locs.shape != (B,) or nk_k.dim() != 3 or nk_k.shape[1:] != (Hkv, D):
                raise ValueError(
                    f"new_keys: locs [{B}] into a [tokens, {Hkv}, {D}] key buffer, got "
                    f"{tuple(nk_locs.shape)} and {tuple(nk_k.shape)}"
                )
        G = Hq // Hkv
        slot_strides = slot_strides or (bs * D, D, 0)
        descs = self._descriptors(k_slots, v_slots, slot_strides)
        tile = self.tile_tokens or (bs if descs else 64)

        # The launches of a row set: (reads the host tier, `HOST_ROWS`). With row flags the
        # rows split again, by whether a block is off HBM: those with none read in a launch
        # compiled without the host tier (the HBM home's code), the others in one with it;
        # each returns at once on the other's rows.
        if not has_host:
            sets = ((False, 0),)
        else:
            sets = ((True, 0),) if row_host is None else ((False, 1), (True, 2))

        def launch(S, one_wave, rows, descs, tile, warps, prefetch, stages, order, n_forced,
                   ub_suffix, rloc, part, acc_part, newmeta=False, which=slice(None)):  # fmt: skip
            nk = new_keys if newmeta else (None,) * 6
            for host, host_rows in sets[which]:
                cache = cached and host
                _wave_attention_kernel[(B, Hkv, S)](
                    q,
                    q.stride(0),
                    k_slots,
                    v_slots,
                    *(descs or (k_slots, v_slots, 0, 0)),
                    k_host if host else k_slots,
                    v_host if host else v_slots,
                    rloc,
                    order,
                    lengths,
                    n_forced,
                    self.wave_ends,
                    self.wave_row,
                    ub_suffix,
                    self.out,
                    self.lse,
                    self.n_read,
                    self.n_waves,
                    part,
                    acc_part,
                    self.counters,
                    meta_pages if stamps is not None else self.n_read,
                    stamps if stamps is not None else self.n_read,
                    step if stamps is not None else self.n_read,
                    stats if stats is not None else self.n_read,
                    unit_slot if cache else self.n_read,
                    cache_pages if cache else self.n_read,
                    cache_shift[0] if cache else self.n_read,
                    cache_shift[1] if cache else self.n_read,
                    row_host if row_host is not None else self.n_read,
                    kept[1] if kept is not None else self.n_read,
                    kept[3] if kept is not None else self.n_read,
                    kept[2] if split else self.n_read,
                    kept[4] if budget else self.n_read,
                    *(self.n_read if t is None else t for t in nk),
                    CODE_STEP,
                    self.sink,
                    self.recent,
                    stamps.stride(0) if stamps is not None else 0,
                    unit_slot.stride(0) if cache else 0,
                    cache_shift[0].shape[0] if cache else 1,
                    self.wave_ends.stride(0),
                    scale,
                    limit,
                    NB if max_read_blocks is None else max_read_blocks,
                    self.max_read_fraction,
                    Hkv,
                    NB,
                    *slot_strides,
                    *(host_strides or (bs * D, D, 0)),
                    G=G,
                    GP=max(triton.next_power_of_2(G), 16),  # tl.dot needs >= 16 rows
                    D=D,
                    BS=bs,
                    NBLK=max(1, tile // bs),
                    HAS_HOST=host,
                    CACHED=cache,
                    HOST_ROWS=host_rows,
                    num_warps=warps,
                    RULE=0 if self.rule == "heuristic" else 1,
                    PREC="ieee" if q.dtype == torch.float32 else "tf32",
                    S=S,
                    STAGES=stages,
                    STAMP=stamps is not None,
                    STATS=stats is not None,
                    ONE_WAVE=one_wave,
                    KEPT=kept is not None,
                    # descriptors: one block a tile (and the rows reading a host tier load
                    # no ids ahead: `_read_wave`'s caller)
                    PREFETCH=prefetch and not (descs and tile > bs),
                    TMA=descs is not None,
                    ONE_EXP=self.one_exp,
                    # The heuristic rule's smallest block log-mass, kept only where the rule is
                    # asked: a one-wave run reads to its end whatever the mass.
                    TRACK=self.rule == "heuristic" and not one_wave,
                    ROWS=rows,
                    BUDGET=budget,
                    NEWMETA=newmeta,
                    NK_MEAN=nk[2] is not None,
                    NK_BOUNDS=nk[3] is not None,
                    NK_CODES=nk[5] is not None,
                    NK_BSP=triton.next_power_of_2(bs),
                    launch_cooperative_grid=S > 1 and not one_wave,
                )

        side = self.side if split and q.is_cuda and self.kept_beside else None
        first = self.one_wave if self.fresh_first is None else self.fresh_first
        urgent = self.urgent if side is not None and first else None
        flagged = self.flagged if len(sets) > 1 and q.is_cuda else None
        here = torch.cuda.current_stream(q.device) if q.is_cuda else None
        if split:
            # The rows that read their kept selection know their blocks: one wave, programs
            # that never wait for each other. On the side stream (a branch of the captured
            # graph), beside the fresh rows' scoring, ranking and waves, which on most steps
            # have no row and end at once: they no longer add to the step. The two launches
            # write disjoint rows, each with buffers of its own.
            # With row flags, the kept rows with a block off HBM read with the fresh
            # flagged rows (below): off the kept rows' path, their programs returning at
            # once with none flagged.
            if side is not None:
                side.wait_stream(here)
            kd = descs if self.kept_tma else None  # tensor descriptors: one block a tile
            kept_launch = functools.partial(
                launch, self.kept_splits, True, 2, kd, bs if kd else self.kept_tile_tokens,
                self.kept_warps, self.kept_prefetch, self.kept_stages, kept[0], self.n_forced,
                self.lse, loc, self.kept_part, self.kept_acc_part, newmeta=new_keys is not None,
            )  # fmt: skip
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                kept_launch(which=slice(0, 1))
        if urgent is not None:
            urgent.wait_stream(here)
        with torch.cuda.stream(urgent) if urgent is not None else contextlib.nullcontext():
            if new_keys is not None:  # with a kept launch: the rows that rank (the others' there)
                page_meta_from_locs(nk_k, nk_locs, bs, nk_mean, nk_min, nk_max, nk_scale,
                                    gate=kept[2] if split else None)  # fmt: skip
            if before_rank is not None:
                before_rank()
            if self.one_wave and max_read_blocks is None:  # dense: every block, block order
                order, n_forced, ub_suffix, rloc = self.identity, self.no_forced, self.lse, loc
            elif kept is not None:
                order, n_forced, ub_suffix = self.rank(
                    q, meta_mean, meta_min, meta_max, lengths, scale, meta_pages, None, meta_scale,
                    kept=kept[:3],
                )  # fmt: skip
                rloc = loc
            else:
                codes = None if code_planes is None else (code_planes, code_lo, code_hi)
                order, n_forced, ub_suffix = self.rank(
                    q, meta_mean, meta_min, meta_max, lengths, scale, meta_pages, loc, meta_scale,
                    codes,
                )  # fmt: skip
                rloc = self.ranked_loc
            prefetch = not self.one_wave if self.prefetch is None else self.prefetch

            def fresh_launch(which):
                while True:
                    try:
                        launch(self.splits, self.one_wave, 1 if split else 0, descs, tile,
                               self.warps, prefetch, self.num_stages, order, n_forced,
                               ub_suffix, rloc, self.part, self.acc_part, which=which)  # fmt: skip
                        return
                    except RuntimeError as e:
                        # Too many programs for one cooperative launch (they must all be
                        # resident): halve the split and try again; the plan keeps it.
                        if self.splits == 1 or "cooperative" not in str(e):
                            raise
                        logger.warning(
                            "wave attention: %d programs a (request, KV head) do not fit one "
                            "cooperative launch at batch %d; this plan runs %d (slower reads)",
                            self.splits, B, self.splits // 2,
                        )  # fmt: skip
                        self._alloc_splits(self.splits // 2, B, Hq, Hkv, D, q.device)

            # The flagged rows' launches (none without row flags), together, on their own
            # stream, forked here (after the ranking they read), beside the unflagged rows'
            # launch; their programs return at once on steps with no row flagged.
            # The launches write disjoint rows (split barriers count per row and KV head).
            if flagged is not None:
                flagged.wait_stream(torch.cuda.current_stream(q.device))
            fresh_launch(slice(0, 1))
            with torch.cuda.stream(flagged) if flagged is not None else contextlib.nullcontext():
                fresh_launch(slice(1, None))
                if split:
                    kept_launch(which=slice(1, None))
        for branch in (side, urgent, flagged):  # the branches join before the output is read
            if branch is not None:
                here.wait_stream(branch)
        slot = kept[1] if kept is not None else None
        return WaveResult(self.out, self.lse, order, self.n_read, self.n_waves, slot)
