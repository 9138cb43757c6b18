"""The `psa` attention backend: SGLang's decode attention, sparse, inside its CUDA graphs.

`--sparse-mode` makes SGLang build a hybrid backend: prefill (extend) runs on
the dense `--prefill-attention-backend`, decode runs here. One SGLang page is
one PSA block (`--page-size` = `--psa-block-size`), so a request's block table
is its `req_to_token` row read every `block_size` tokens.

A decode step (the kernel path: CUDA, or TRITON_INTERPRET=1 on CPU), with fixed
shapes and no host sync, so SGLang captures it in its decode graphs (one per
batch size; graph state comes from `init_cuda_graph_state`):
- once per step (`init_forward_metadata_in_graph`): the page table `[B, NB]`
  (NB = blocks of the longest context SGLang allows) gathered from SGLang's
  request table, the lengths, the working-set measurement of the batch
  (`mem_cache.read_stamps`), the step counter;
- per layer (`forward_decode`): SGLang stores the new K/V; the page of each new
  token gets its metadata (`mem_cache.page_meta`); scoring, ranking and the wave
  kernel read SGLang's KV buffers in place (slot = page), writing the output in
  the model's dtype, last-use stamps and read counters as they go. Work beyond a
  request's own blocks exits early, so a short request pays for its length.
Pages written by prefill get their metadata after the extend's last layer, every
layer in one launch (`on_extend`, called for each layer by the hook on SGLang's hybrid
backend).

The reference path (CPU without the interpreter) gathers each request's keys
and runs `sglang_psa.algo`, the spec the kernels are tested against, eagerly.
With `--psa-kv-home tiered` every full block is also written back to a host tier
(`mem_cache.writeback`) and blocks whose HBM page was given back
(`mem_cache.residency`) are read from there through UVA, in the same graphs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_kernel_ext.selection import SelectionCache
from sgl_kernel_ext.step_tables import tiered_step_tables
from sgl_kernel_ext.wave_attention import WaveAttention, Workspace
from sglang_psa.algo import progressive_attention, topk_attention
from sglang_psa.attention.coverage_audit import audit
from sglang_psa.config import PSAConfig, PSAConfigError
from sglang_psa.distributed import tp_rank
from sglang_psa.sched.host_timing import timed
from sglang_psa.sched.process import assemble

logger = logging.getLogger(__name__)


def _logit_cap(model_runner) -> float:
    """The largest attention logit cap of the loaded model's layers (0: none). SGLang
    loads the model before it builds attention backends, so this refuses at startup."""
    model = getattr(model_runner, "model", None)
    modules = getattr(model, "modules", None)
    if modules is None:
        return 0.0
    return max((float(getattr(m, "logit_cap", 0) or 0) for m in modules()), default=0.0)


@dataclass
class _Batch:
    """Per batch size: the step's page table and lengths (views of the graph-static
    buffers up to the largest captured batch), and the wave plan (shared workspace)."""

    pages: torch.Tensor  # [B, NB] int32
    lengths: torch.Tensor  # [B] int32
    loc: torch.Tensor  # [B, Hkv, NB] int32: a block's slot is its page (or host block)
    row_host: torch.Tensor | None = None  # [B] int32, tiered home: a block off HBM (nonzero)
    plan: WaveAttention | None = None
    kept: bool = False  # reads a selection kept across steps (`--psa-rerank-interval`)


class PSAAttnBackend(AttentionBackend):
    def __init__(self, model_runner, cfg: PSAConfig | None = None, use_kernel: bool | None = None):
        super().__init__()
        cfg = cfg or getattr(model_runner.server_args, "_psa_config", None)
        if cfg is None:
            raise PSAConfigError(
                "sparse_mode",
                "the psa attention backend was selected without --sparse-mode psa|topk",
            )
        if getattr(model_runner, "use_mla_backend", False):
            raise PSAConfigError(
                "sparse_mode", "this model uses MLA attention, which PSA does not support yet"
            )
        window = getattr(model_runner, "sliding_window_size", None)
        if window not in (None, -1, 0):
            raise PSAConfigError(
                "sparse_mode",
                f"this model has sliding-window attention ({window} tokens), "
                "which PSA does not support yet",
            )
        cap = _logit_cap(model_runner)
        if cap:
            raise PSAConfigError(
                "sparse_mode",
                f"this model caps its attention logits (logit_cap {cap:g}), which PSA "
                "does not support yet",
            )
        self.cfg = cfg
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.page_size = model_runner.page_size
        if self.page_size != cfg.block_size:
            raise PSAConfigError(
                "block_size",
                f"SGLang's page size is {self.page_size}, not the PSA block size {cfg.block_size}",
            )
        pool = self.token_to_kv_pool
        bs = cfg.block_size
        device = pool.k_buffer[0].device
        if use_kernel is None:
            use_kernel = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        self.use_kernel = use_kernel
        # The kernel path needs no host copy of the lengths; the reference path gathers
        # up to the longest request.
        self.needs_cpu_seq_lens = not use_kernel
        self.first_layer = pool.start_layer
        self.last_layer = pool.start_layer + len(pool.k_buffer) - 1
        req_to_token = self.req_to_token_pool.req_to_token
        # Every `block_size`-th token slot of each request row: its pages, times bs.
        self._page_cols = req_to_token[:, ::bs]
        self.max_blocks = self._page_cols.shape[1]  # the longest context SGLang allows
        # Everything this scheduler process owns under --sparse-mode, built once
        # (`sched.process`; the plugin registers it for the scheduler hooks). The decode
        # step reads its block metadata, stamps, counters and, at the tiered home, the
        # host tier, the location table, the unit cache and the prefill staging.
        model_config = getattr(model_runner, "model_config", None)
        self.process = process = assemble(
            cfg, pool, req_to_token, getattr(model_runner, "token_to_kv_pool_allocator", None),
            server_args=model_runner.server_args,
            context_len=int(getattr(model_config, "context_len", 0) or 0),
            # the configured --tp (the agreement checks SGLang's TP group against it)
            tp_size=int(getattr(model_runner.server_args, "tp_size", 1) or 1),
            tp_rank=tp_rank(),
            hbm_bytes=self.hbm_bytes,
        )  # fmt: skip
        self.meta, self.ws, self.counters = process.meta, process.stamps, process.counters
        self.stats = self.counters.stats  # [layers, 3]: what the wave kernel adds to
        self.writeback, self.residency = process.writeback, process.residency
        self.stage = process.stage
        topk = cfg.sparse_mode == "topk"
        self._wave = WaveAttention.from_config(cfg.replace(threshold=1.0) if topk else cfg)
        self._max_read = cfg.topk_tokens // bs if topk else None
        self._workspace = Workspace(device)
        self._device = device
        self._graph_bs = 0
        self._graph_tables: tuple | None = None  # (`_tables` for the largest captured batch)
        self._selection: SelectionCache | None = None  # by init_cuda_graph_state
        self._batches: dict[int, _Batch] = {}
        self._step: _Batch | None = None

    def hbm_bytes(self) -> dict[str, int]:
        """GPU bytes this backend holds, by purpose (server info reports them): block
        metadata (inside SGLang's KV budget), working-set stamps and counters, the
        graph-static step tables and the wave kernels' shared workspace (both allocated
        while SGLang captures its graphs, in the memory `--mem-fraction-static` leaves)."""
        size = lambda *ts: sum(t.numel() * t.element_size() for t in ts if t is not None)
        return {
            "block_metadata": self.meta.bytes,
            "working_sets": self.ws.bytes + self.counters.bytes,
            "unit_cache_tables": self.residency.cache.bytes if self.residency else 0,
            "step_tables": size(*(self._graph_tables or ())),
            "workspace": self._workspace.nbytes,
            "selection_cache": self._selection.nbytes if self._selection else 0,
            "writeback_staging": self.writeback.device_bytes if self.writeback else 0,
            "prefill_staging": self.stage.nbytes if self.stage is not None else 0,
        }

    # -- graph state and per-step metadata ------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static page table and lengths for every batch SGLang captures (decode graphs).
        Called again for no larger a batch, it keeps the buffers the captured graphs
        read."""
        if self._graph_tables is not None and max_bs <= self._graph_bs:
            return
        self._graph_bs = max_bs
        self._graph_tables = self._tables(max_bs)
        self._batches.clear()
        cfg, pool = self.cfg, self.token_to_kv_pool
        if cfg.keeps_selection and self.use_kernel:  # read orders kept across steps
            self._selection = SelectionCache(
                pool.layer_num, max_bs, pool.head_num, self.max_blocks, cfg.rerank_interval,
                cfg.block_size, cfg.sink_blocks + cfg.recent_blocks, self._device,
            )  # fmt: skip

    def _tables(self, n: int) -> tuple:
        """A step's tables for `n` requests (`_Batch`'s order): page table, lengths (1:
        SGLang's padding value), every head's block table and, at the tiered home, which
        rows have a block off HBM."""
        kw = dict(dtype=torch.int32, device=self._device)
        Hkv = self.token_to_kv_pool.head_num
        loc = torch.zeros(n, Hkv, self.max_blocks, **kw)
        tiered = self.writeback is not None
        row_host = torch.zeros(n, **kw) if tiered else None
        return torch.zeros(n, self.max_blocks, **kw), torch.ones(n, **kw), loc, row_host

    def _batch(self, B: int) -> _Batch:
        got = self._batches.get(B)
        if got is None:
            if B <= self._graph_bs:  # views of the tables the captured graphs read
                got = _Batch(*(None if t is None else t[:B] for t in self._graph_tables))
            else:  # eager only (larger than any captured batch, or graphs off)
                got = _Batch(*self._tables(B))
                if self.cfg.rerank_interval > 1:
                    logger.warning(
                        "sglang-psa: decode batch %d runs outside the decode CUDA graphs "
                        "(largest captured: %d); --psa-rerank-interval keeps selections "
                        "for captured batches only, so this one ranks every step",
                        B, self._graph_bs,
                    )  # fmt: skip
            self._batches[B] = got
        return got

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        mode = forward_batch.forward_mode
        if not mode.is_decode_or_idle():
            raise RuntimeError(
                "the psa backend serves decode only; extend batches belong to the "
                "prefill backend (--sparse-mode builds a hybrid backend)"
            )
        B = forward_batch.batch_size
        self._step = self._batch(B) if B > 0 else None  # B = 0: an idle batch (DP attention)
        if self.writeback is not None and not in_capture:  # host side, before the replay
            pool = self.token_to_kv_pool
            dev = pool.k_buffer[0].device  # the step reads the tables until it ends
            self.writeback.fence.arm(torch.cuda.current_stream(dev) if dev.type == "cuda" else None)
            self.writeback.before_forward()
            self.writeback.issue_decode(
                pool.k_buffer, pool.v_buffer, self.req_to_token_pool.req_to_token
            )

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Recorded into the decode graph: the step's page table, lengths, working sets."""
        st = self._step
        if st is None:
            return
        rows = forward_batch.req_pool_indices
        torch.index_select(self._page_cols, 0, rows, out=st.pages)
        st.pages.floor_divide_(self.cfg.block_size)
        st.lengths.copy_(forward_batch.seq_lens)
        if self.writeback is not None:  # tiered: evicted blocks are read from the host tier
            # Each head's block locations, the metadata rows (an evicted block's: its host
            # block's row) and the rows with a block off HBM (the others read as at the
            # HBM home), in one launch.
            tiered_step_tables(st.pages, self.writeback.host_loc, rows, self.meta.page_rows,
                               st.loc, st.row_host)  # fmt: skip
        else:  # the block table of every head, once per step
            st.loc.copy_(st.pages[:, None, :].expand_as(st.loc))
        self.ws.begin_step(rows, st.pages, st.lengths)
        # Graph batches keep their selection between steps; a larger (eager) batch ranks.
        sel = self._selection
        st.kept = sel is not None and st.lengths.shape[0] <= sel.max_batch
        if st.kept:
            sel.assign(rows, st.lengths, self.ws.step, counts=self.counters.ranks)

    def on_after_cuda_graph_warmup(self) -> None:
        """Warmup ran decode steps on dummy batches: forget their stamps, counts and kept
        selections."""
        self.ws.reset()
        self.counters.reset()
        if self._selection is not None:
            self._selection.reset()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # -- prefill: metadata of the pages an extend wrote -------------------------------
    @timed("extend_layer")
    def on_extend(self, layer, forward_batch) -> None:
        """After the dense prefill backend ran `layer` of an extend batch (its K/V are in
        SGLang's pool): after the last layer, the metadata of every page the extend wrote,
        every layer in one launch, and at the tiered home the save of the blocks it
        completed (host side: each launch a layer would cost the extend's host time)."""
        if not self.use_kernel:
            return  # the reference path computes metadata from the keys it gathers
        B = forward_batch.batch_size
        lid = layer.layer_id
        if lid == self.first_layer:
            # A prefilled request (new, resumed, or in a reused row) ranks at its next step.
            if self._selection is not None:
                self._selection.invalidate(forward_batch.req_pool_indices[:B])
            if self.writeback is not None:
                self.writeback.before_forward()
        if lid != self.last_layer:
            return
        n_tokens = getattr(forward_batch, "extend_num_tokens", None)
        if n_tokens is None:
            n_tokens = forward_batch.input_ids.shape[0]
        max_pages = -(-int(n_tokens) // self.cfg.block_size) + 1
        pool, req_to_token = self.token_to_kv_pool, self.req_to_token_pool.req_to_token
        self.meta.on_extend(
            pool.k_buffer,
            req_to_token,
            forward_batch.req_pool_indices[:B],
            forward_batch.extend_prefix_lens[:B],
            forward_batch.seq_lens[:B],
            max_pages,
        )
        if self.writeback is not None:  # the batch's completed blocks to the host tier
            self.writeback.issue_extend(pool.k_buffer, pool.v_buffer, req_to_token)

    # -- decode -----------------------------------------------------------------------
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise RuntimeError("the psa backend serves decode only; prefill is dense")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(
                layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale
            )
        step = self._step
        if step is None:
            return q.new_empty(0, layer.tp_q_head_num * layer.v_head_dim)
        B, Hq, d = forward_batch.batch_size, layer.tp_q_head_num, layer.head_dim
        qb = q.reshape(B, Hq, d)
        if self.use_kernel:
            out = self._decode_kernel(qb, layer, forward_batch, step)
        else:
            out = self._decode_reference(qb, layer, forward_batch).to(q.dtype)
        return out.reshape(B, Hq * layer.v_head_dim)

    def _plan(self, step: _Batch, q: torch.Tensor, layer) -> WaveAttention:
        if step.plan is None:  # first use of this batch size (eager: before any capture)
            step.plan = self._wave.planned(
                q.shape[0], q.shape[1], layer.tp_k_head_num, layer.head_dim, self.max_blocks,
                q.device, out_dtype=q.dtype, workspace=self._workspace, read_blocks=self._max_read,
            )  # fmt: skip
        return step.plan

    def _decode_kernel(self, q, layer, forward_batch, step: _Batch) -> torch.Tensor:
        """Wave kernel over SGLang's pool in place: slots are pages, the head an offset."""
        lid = layer.layer_id
        kbuf = self.token_to_kv_pool.get_key_buffer(lid)
        vbuf = self.token_to_kv_pool.get_value_buffer(lid)
        lid -= self.first_layer  # index into this rank's layers (pipeline parallel)
        plan = self._plan(step, q, layer)
        Hkv, d, bs = kbuf.shape[1], kbuf.shape[2], self.cfg.block_size
        strides = (bs * Hkv * d, Hkv * d, d)
        host_k = host_v = unit_slot = cache_pages = cache_shift = None  # slots: pool pages
        host_strides = strides
        if self.writeback is not None:  # ... or host-tier blocks through UVA, or the unit
            host_k, host_v = self.writeback.host.k[lid], self.writeback.host.v[lid]
            host_strides = self.writeback.host_strides()
            unit_slot, cache_pages, cache_shift = self.residency.cache.layer(lid)
        mean, kmin, kmax, kscale = self.meta.layer(lid)  # per page, read via the table
        kept = None
        if step.kept:
            kept = self._selection.kept(lid, q.shape[0])
        codes = self.meta.codes(lid) or (None, None, None)  # the certified rule's key codes
        locs = forward_batch.out_cache_loc  # the step's new keys
        res = plan.run(
            q,
            kbuf,
            vbuf,
            step.loc,
            step.lengths,
            mean,
            kmin,
            kmax,
            scale=layer.scaling,
            max_read_blocks=self._max_read,
            slot_strides=strides,
            meta_pages=step.pages,
            k_host=host_k,
            v_host=host_v,
            host_strides=host_strides,
            stamps=self.ws.layer_stamps(lid),
            step=self.ws.step,
            stats=self.stats[lid],
            unit_slot=unit_slot,
            cache_pages=cache_pages,
            cache_shift=cache_shift,
            row_host=step.row_host,
            meta_scale=kscale,
            code_planes=codes[0],
            code_lo=codes[1],
            code_hi=codes[2],
            kept=kept,
            # the new keys' page metadata: the ranking reads it, the kept rows' read not
            new_keys=self.meta.new_keys(lid, kbuf, locs),
            before_rank=(lambda: self.meta.encode_new_keys(lid, kbuf, locs))
            if codes[0] is not None
            else None,
        )
        if self.counters.coverage is not None:  # --psa-audit-coverage
            audit(self.counters.coverage, q, kbuf, step.pages, step.lengths, res.read_mask(),
                  layer.scaling, bs)  # fmt: skip
        return res.out

    def _decode_reference(self, q, layer, forward_batch):
        """`sglang_psa.algo` on the gathered keys: exact semantics, dense cost (eager). It
        ranks every step (`--psa-rerank-interval` is the kernel path's)."""
        pool, bs = self.token_to_kv_pool, self.cfg.block_size
        lengths = forward_batch.seq_lens.long()
        T = int(lengths.max())
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), :T]
        valid = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
        slots = torch.where(valid, rows.long(), 0)  # slot 0: SGLang's padding sink
        kc = pool.get_key_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)  # [B, Hkv, T, d]
        vc = pool.get_value_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)
        if self.cfg.sparse_mode == "topk":
            res = topk_attention(q, kc, vc, lengths, self.cfg, scale=layer.scaling)
        else:
            code_bits = self.cfg.code_bits if self.cfg.needs_key_codes else 0
            res = progressive_attention(
                q, kc, vc, lengths, self.cfg, scale=layer.scaling, code_bits=code_bits
            )
        lid = layer.layer_id - self.first_layer
        nb = -(-T // bs)
        pages = torch.where(
            torch.arange(nb, device=lengths.device)[None, :] < (lengths[:, None] + bs - 1) // bs,
            rows[:, ::bs].long() // bs,
            0,
        )
        read = res.read[..., :nb]
        self.ws.mark(lid, pages, read)
        if self.counters.coverage is not None:  # --psa-audit-coverage
            kbuf = pool.get_key_buffer(layer.layer_id)
            audit(self.counters.coverage, q, kbuf, pages, lengths, read, layer.scaling, bs)
        own = ((lengths + bs - 1) // bs).sum() * read.shape[1]
        self.stats[lid, :2] += torch.stack([read.sum(), own]).to(self.stats.device)
        return res.out

    @property
    def blocks_read(self) -> dict[int, int]:
        return {self.first_layer + i: int(n) for i, n in enumerate(self.stats[:, 0].tolist())}

    def read_fraction(self) -> float:
        """Fraction of KV blocks the decode steps read so far, over all layers (syncs)."""
        return self.counters.read_fraction()
