"""The PSA paper's pipelined alternative to one-launch wave attention, for comparison.

Each wave is its own launch. A loader on the host copies the next wave's
host-resident blocks into spare HBM slots on a copy stream while the current
wave computes; the wave kernel merges its blocks into a state kept in global
memory, runs the verify step, and writes each (request, KV head)'s progress
into a flag in pinned host memory (zero-copy), so the host learns which heads
are done by reading memory, without synchronizing a stream. Heads that are done
cost an early exit in later waves. Blocks are read from HBM slots only: the
loader is what reaches the host pool (`WaveAttention` instead reads host blocks
in place through UVA, in one launch, with no host round trip).

Flag of a (request, KV head) after wave w: `2 * (w + 1) + done`.
"""

from __future__ import annotations

import contextlib
import math
import time

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.gather import BlockCopier
from sgl_kernel_ext.wave_attention import (
    WaveAttention,
    WaveResult,
    _group_query,
    _merge_tile,
    _stop,
    _tile_index,
)


@triton.jit
def _wave_step_kernel(
    q_ptr,
    k_slots,
    v_slots,
    loc_ptr,
    order_ptr,
    lengths_ptr,
    nforced_ptr,
    wave_ends_ptr,
    ub_suffix_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    small_ptr,
    pos_ptr,
    done_ptr,
    flag_ptr,
    nwaves_ptr,
    w,
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
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b * Hkv + h
    done = tl.load(done_ptr + bh)
    if done == 0:
        length = tl.load(lengths_ptr + b)
        nb = (length + BS - 1) // BS
        nf = tl.load(nforced_ptr + b)
        g = tl.arange(0, GP)
        gmask = g < G
        dd = tl.arange(0, D)
        hq = b * Hkv * G + h * G + g
        q = _group_query(q_ptr, hq, gmask, dd, D)
        m_i = tl.load(m_ptr + hq, mask=gmask, other=float("-inf"))
        l_i = tl.load(l_ptr + hq, mask=gmask, other=0.0)
        acc = tl.load(acc_ptr + hq[:, None] * D + dd[None, :], mask=gmask[:, None], other=0.0)
        smallest = tl.load(small_ptr + hq, mask=gmask, other=float("inf"))
        row = bh * NB
        pos = tl.load(pos_ptr + bh)
        end = tl.minimum(tl.minimum(nf + tl.load(wave_ends_ptr + w), nb), max_read)
        while pos < end:
            where, tok, valid, _ = _tile_index(
                order_ptr, loc_ptr, row, pos, end, length, BS, NBLK, False
            )
            offs = (where * (BS * D) + tok * D)[:, None] + dd[None, :]
            k = tl.load(k_slots + offs, mask=valid[:, None], other=0.0)
            v = tl.load(v_slots + offs, mask=valid[:, None], other=0.0)
            m_i, l_i, acc, smallest = _merge_tile(
                q, k, v, valid, pos, end, nf, scale, m_i, l_i, acc, smallest,
                GP, NBLK, BS, D, PREC, RULE == 0,
            )  # fmt: skip
            pos += NBLK
        pos = end
        covered = m_i + tl.log(l_i)
        done = _stop(
            covered, smallest, ub_suffix_ptr, hq, pos, nb, max_read, limit, gmask, NB, RULE
        )
        tl.store(m_ptr + hq, m_i, mask=gmask)
        tl.store(l_ptr + hq, l_i, mask=gmask)
        tl.store(acc_ptr + hq[:, None] * D + dd[None, :], acc, mask=gmask[:, None])
        tl.store(small_ptr + hq, smallest, mask=gmask)
        tl.store(pos_ptr + bh, pos)
        tl.store(done_ptr + bh, done)
        tl.store(nwaves_ptr + bh, w + 1)
    tl.store(flag_ptr + bh, 2 * (w + 1) + done)  # zero-copy: pinned host memory


class WavePipeline:
    """Pipelined waves over HBM slots plus a host pool. Plan as `WaveAttention`.

    `spare_slots` are HBM slots the loader may fill with host blocks during one
    step; the step raises if a step needs more of them than exist.
    """

    def __init__(self, wave: WaveAttention, spare_slots: torch.Tensor, poll_s: float = 20e-6):
        if wave.wave_fraction:
            raise ValueError("the wave pipeline plans one wave schedule: no wave fraction")
        if wave.max_read_fraction < 1:
            raise ValueError("the wave pipeline caps reads by max_read_blocks only")
        self.wave, self.spare, self.poll_s = wave, spare_slots.long(), poll_s

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
        """Arguments as `WaveAttention.run` (slots `[num_slots, bs, d]`; host blocks
        `loc < 0` are loaded into `spare_slots`)."""
        wa = self.wave
        B, Hq, D = q.shape
        Hkv, NB, bs = wa.Hkv, wa.NB, wa.bs
        G = Hq // Hkv
        dev = q.device
        cuda = dev.type == "cuda"
        cap = NB if max_read_blocks is None else max_read_blocks
        scale = 1.0 / math.sqrt(D) if scale is None else scale
        order, n_forced, ub_suffix = wa.rank(q, meta_mean, meta_min, meta_max, lengths, scale)
        # The loader needs the read order and the layout on the host: one copy per step.
        order_h, loc_h = order.cpu().long(), loc.cpu()
        nf_h, len_h = n_forced.cpu(), lengths.cpu()
        ends_h = wa.wave_ends[0].cpu()
        loc = loc.to(torch.int32).clone()
        state = dict(
            m=torch.full((B, Hq), -math.inf, device=dev),
            l=torch.zeros(B, Hq, device=dev),
            acc=torch.zeros(B, Hq, D, device=dev),
            small=torch.full((B, Hq), math.inf, device=dev),
            pos=torch.zeros(B, Hkv, dtype=torch.int32, device=dev),
            done=(lengths <= 0).to(torch.int32)[:, None].repeat(1, Hkv).contiguous(),
            waves=torch.zeros(B, Hkv, dtype=torch.int32, device=dev),
        )
        flags = torch.zeros(B, Hkv, dtype=torch.int32)
        if cuda:
            flags = flags.pin_memory()
        copier = BlockCopier(bs * D, k_slots.dtype, dev)
        copy_stream = torch.cuda.Stream(dev) if cuda else None
        spare_next = 0

        # Per request: block positions in read order where each wave starts (forced first).
        nb_h = torch.clamp((len_h + bs - 1) // bs, max=cap)
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), ends_h[:-1].long()])
        unit_in_order = loc_h.gather(-1, order_h)  # [B, Hkv, NB]: where each ranked block is
        posn = torch.arange(NB)

        def load(w: int, heads_done: torch.Tensor) -> torch.cuda.Event | None:
            """Copy wave w's host-resident blocks of the heads not known done into spares."""
            nonlocal spare_next
            lo = (
                torch.clamp(nf_h.long() + starts[w], max=nb_h)
                if w
                else torch.zeros(B, dtype=torch.int64)
            )
            hi = torch.clamp(nf_h.long() + ends_h[w].long(), max=nb_h)
            in_wave = (posn[None, :] >= lo[:, None]) & (posn[None, :] < hi[:, None])  # [B, NB]
            need = in_wave[:, None, :] & ~heads_done[:, :, None] & (unit_in_order < 0)
            b_i, h_i, p_i = need.nonzero(as_tuple=True)
            count = b_i.numel()
            if count == 0:
                return None
            if spare_next + count > len(self.spare):
                raise RuntimeError(f"{len(self.spare)} spare slots are too few for this step")
            dst = self.spare[spare_next : spare_next + count]
            spare_next += count
            ctx = torch.cuda.stream(copy_stream) if cuda else contextlib.nullcontext()
            with ctx:
                # Index lists go up on the copy stream itself (pinned, asynchronous), so
                # nothing here waits for the wave computing on the compute stream.
                up = (
                    (lambda t: t.pin_memory().to(dev, non_blocking=True))
                    if cuda
                    else (lambda t: t.to(dev))
                )  # noqa: E731
                src = up(-unit_in_order[b_i, h_i, p_i] - 1)
                blk = up(order_h[b_i, h_i, p_i])
                b_d, h_d = up(b_i), up(h_i)
                for host, slots in ((k_host, k_slots), (v_host, v_slots)):
                    copier.run(host.flatten(1), src, slots.flatten(1), dst)
                loc[b_d, h_d, blk] = dst.to(torch.int32)
                if cuda:
                    ev = torch.cuda.Event()
                    ev.record(copy_stream)
                    return ev
            return None

        def launch(w: int) -> None:
            _wave_step_kernel[(B, Hkv)](
                q.contiguous(), k_slots, v_slots, loc, order,
                lengths.to(torch.int32).contiguous(), n_forced, wa.wave_ends[0], ub_suffix,
                state["m"], state["l"], state["acc"], state["small"], state["pos"],
                state["done"], flags, state["waves"], w, scale, wa.limit, cap, Hkv, NB,
                G=G, GP=max(triton.next_power_of_2(G), 16), D=D, BS=bs,
                NBLK=max(1, wa.tile_tokens // bs), RULE=0 if wa.rule == "heuristic" else 1,
                PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=wa.warps,
            )  # fmt: skip

        n_waves = len(ends_h) - 1
        known_done = torch.zeros(B, Hkv, dtype=torch.bool)
        ev = load(0, known_done)
        for w in range(n_waves):
            if ev is not None:
                torch.cuda.current_stream().wait_event(ev)
            launch(w)
            # Overlap: the next wave's loads run while this wave computes (heads not yet
            # known to be done are loaded speculatively, as in the paper).
            ev = load(w + 1, known_done) if w + 1 < n_waves else None
            target = 2 * (w + 1)
            while int(flags.min()) < target:  # zero-copy flags: no stream sync
                time.sleep(self.poll_s)
            known_done = (flags & 1).bool()
            if bool(known_done.all()):
                break
        if ev is not None and cuda:
            torch.cuda.current_stream().wait_event(ev)
        out = state["acc"] / state["l"][..., None]
        lse = state["m"] + torch.log(state["l"])
        return WaveResult(out, lse, order, state["pos"], state["waves"])
