"""The `psa` attention backend: SGLang's decode attention, sparse.

`--sparse-mode` makes SGLang build a hybrid backend: prefill (extend) runs on
the dense `--prefill-attention-backend`, decode runs here. One SGLang page is
one PSA block (`--page-size` = `--psa-block-size`), so a request's block table
is its `req_to_token` row read every `block_size` tokens.

Two paths, the same semantics:
- the kernel path (on CUDA, or under TRITON_INTERPRET=1): scoring, ranking and
  the wave kernel read SGLang's KV buffers in place, slot = page, with block
  metadata kept per page (`PageMeta`), so a decode step touches only the
  blocks PSA attends;
- the reference path (CPU without the interpreter): gathers each request's
  keys and values and runs `sglang_psa.algo`, the spec the kernels are tested
  against. It reads the whole context.
With `--psa-kv-home host` SGLang's pool lives in pinned host memory (seen through
UVA, `kv_pool.py`) and a `PageCache` in HBM holds hot full pages: each block is
read from its cache slot or across PCIe from the host page, and pages read from
the host are admitted to the cache after the layer, for the next steps.
"""

from __future__ import annotations

import logging
import os

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_kernel_ext.wave_attention import WaveAttention
from sglang_psa.algo import progressive_attention, topk_attention
from sglang_psa.config import PSAConfig, PSAConfigError, flag_name
from sglang_psa.integration import kv_pool
from sglang_psa.integration.page_cache import PageCache
from sglang_psa.integration.page_meta import PageMeta
from sglang_psa.integration.scheduling import PSAServing, current, install
from sglang_psa.integration.server_args import config_of
from sglang_psa.integration.working_sets import WorkingSetStamps
from sglang_psa.store.host_pool import blocks_for_budget

logger = logging.getLogger(__name__)


def hbm_units(cfg: PSAConfig, pool, cache: PageCache | None = None) -> int:
    """Slot-cache capacity in (layer, KV head, block) units: the page cache's when the
    pool is on the host, else `--psa-gpu-cache-gb` when given, else SGLang's whole KV
    pool (everything resident: no extra constraint)."""
    if cache is not None:
        return cache.S * pool.head_num
    unit_bytes = 2 * cfg.block_size * pool.head_dim * pool.dtype.itemsize
    if cfg.gpu_cache_gb is not None:
        return max(1, int(cfg.gpu_cache_gb * (1 << 30)) // unit_bytes)
    return max(1, pool.size // cfg.block_size) * pool.layer_num * pool.head_num


class PSAAttnBackend(AttentionBackend):
    def __init__(self, model_runner, cfg: PSAConfig | None = None, use_kernel: bool | None = None):
        super().__init__()
        cfg = cfg or config_of(model_runner.server_args)
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
        self.layers = pool.layer_num
        # SGLang's pool rows are its tokens plus one padding page.
        num_pages = (pool.size + cfg.block_size) // cfg.block_size
        self.cache = self._page_cache(cfg, pool, num_pages)
        install(
            PSAServing(
                cfg,
                layers=pool.layer_num,
                kv_heads=pool.head_num,
                hbm_units=hbm_units(cfg, pool, self.cache),
                host_tokens=blocks_for_budget(
                    cfg.host_pool_gb,
                    pool.layer_num,
                    pool.head_num,
                    cfg.block_size,
                    pool.head_dim,
                    pool.dtype,
                )
                * cfg.block_size,
            )
        )
        # Per layer: KV blocks read and available so far (device counters: no sync per step).
        self._read: dict[int, torch.Tensor] = {}
        self._total: dict[int, torch.Tensor] = {}
        device = pool.k_buffer[0].device
        if use_kernel is None:
            use_kernel = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
        self.use_kernel = use_kernel
        self.first_layer = pool.start_layer
        self.last_layer = pool.start_layer + pool.layer_num - 1
        self.meta = PageMeta(
            pool.layer_num,
            num_pages,
            pool.head_num,
            pool.head_dim,
            cfg.block_size,
            mean=cfg.needs_key_mean,
            bounds=cfg.needs_key_bounds,
            key_dtype=kv_pool.metadata_dtype(pool.dtype),
            device=device,
        )
        current().page_meta = self.meta
        current().page_cache = self.cache
        self.stamps = WorkingSetStamps(
            pool.layer_num, pool.head_num, self.meta.valid.numel(), cfg.ws_window, device
        )
        current().measure = lambda: self.stamps.measure(cfg.block_size)
        current().read_fraction = self.read_fraction
        topk = cfg.sparse_mode == "topk"
        self._wave = WaveAttention.from_config(cfg.replace(threshold=1.0) if topk else cfg)
        self._max_read = cfg.topk_tokens // cfg.block_size if topk else None
        self._plan_key = None

    @staticmethod
    def _page_cache(cfg: PSAConfig, pool, num_pages: int) -> PageCache | None:
        """The HBM page cache over a host-resident pool, sized while SGLang sized its pool."""
        if getattr(pool, "_psa_host", None) is None:
            return None
        page_elems = cfg.block_size * pool.head_num * pool.head_dim
        slot_bytes = 2 * page_elems * pool.store_dtype.itemsize
        if cfg.gpu_cache_gb is not None:
            budget = int(cfg.gpu_cache_gb * 2**30)
        else:  # what SGLang's KV budget left after the block metadata
            budget = kv_pool.slot_cache_bytes()
        slots = (budget or 0) // slot_bytes
        if slots < 1:
            logger.warning(
                "sglang-psa: no HBM left for a page cache; every block is read from the "
                "host through UVA (raise --mem-fraction-static or %s)",
                flag_name("gpu_cache_gb"),
            )
            return None
        return PageCache(
            pool.layer_num,
            num_pages,
            page_elems,
            pool.store_dtype,
            slots,
            pool.k_buffer[0].device,
        )

    # SGLang calls this before every forward: the step's block tables, once for all layers.
    def init_forward_metadata(self, forward_batch) -> None:
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise RuntimeError(
                "the psa backend serves decode only; extend batches belong to the "
                "prefill backend (--sparse-mode builds a hybrid backend)"
            )
        if forward_batch.batch_size == 0:  # an idle batch (data-parallel attention)
            self._step = None
            return
        bs = self.cfg.block_size
        lengths = forward_batch.seq_lens.to(torch.int64)
        cpu = getattr(forward_batch, "seq_lens_cpu", None)
        T = int(cpu.max()) if cpu is not None and cpu.numel() else int(lengths.max())
        nb = -(-T // bs)
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), :T]
        pages = rows[:, ::bs].long() // bs  # [B, NB]: garbage past a request's end, never read
        valid_blk = (
            torch.arange(nb, device=pages.device)[None, :] < (lengths[:, None] + bs - 1) // bs
        )
        pages = torch.where(valid_blk, pages, 0)
        full = torch.arange(nb, device=pages.device)[None, :] < (lengths // bs)[:, None]
        self.stamps.begin_step(forward_batch.req_pool_indices, pages, lengths)
        if self.cache is not None:
            self.cache.next_step()
        pages32 = pages.to(torch.int32)
        self._step = {
            "full": full,
            "lengths": lengths,
            "T": T,
            "rows": rows,
            "pages": pages,
            "stale": self.meta.stale(pages, full) if self.use_kernel else None,
            # The kernels' int32 forms, once per step rather than once per layer.
            "lengths32": lengths.to(torch.int32),
            "pages32": pages32,
        }
        if self.cache is None:  # at HBM home a block's slot is its page, for every head
            self._step["page_loc"] = (
                pages32[:, None, :]
                .expand(pages.shape[0], self.token_to_kv_pool.head_num, pages.shape[1])
                .contiguous()
            )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        raise RuntimeError("the psa backend serves decode only; prefill is dense")

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if getattr(layer, "logit_cap", 0) and layer.logit_cap > 0:
            raise PSAConfigError(
                "sparse_mode", "models with attention logit capping are not supported"
            )
        pool = self.token_to_kv_pool
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(
                layer, forward_batch.out_cache_loc, k, v, layer.k_scale, layer.v_scale
            )
        step = self._step
        if step is None:
            return q.new_empty(0, layer.tp_q_head_num * layer.v_head_dim)
        B, Hq, Hkv, d = (
            forward_batch.batch_size,
            layer.tp_q_head_num,
            layer.tp_k_head_num,
            layer.head_dim,
        )
        qb = q.reshape(B, Hq, d)
        if self.use_kernel:
            out, read = self._decode_kernel(qb, layer, step)
        else:
            out, read = self._decode_reference(qb, layer, step)
        lid = layer.layer_id
        self.stamps.mark(lid - self.first_layer, step["pages"], read)
        self._read[lid] = self._read.get(lid, 0) + read.sum()
        nblk = (step["lengths"] + self.cfg.block_size - 1) // self.cfg.block_size
        self._total[lid] = self._total.get(lid, 0) + nblk.sum() * Hkv
        # A copy even when the dtype matches: the kernel's output buffer is reused.
        return out.to(q.dtype, copy=True).reshape(B, Hq * layer.v_head_dim)

    def _decode_kernel(self, q, layer, step):
        """Wave kernel over SGLang's pool in place: slots are pages, the head an offset."""
        lid = layer.layer_id
        kbuf = self.token_to_kv_pool.get_key_buffer(lid)
        vbuf = self.token_to_kv_pool.get_value_buffer(lid)
        lid -= self.first_layer  # index into this rank's layers (pipeline parallel)
        self.meta.refresh(lid, kbuf, step["stale"])
        if lid + self.first_layer == self.last_layer:
            self.meta.mark_valid(step["stale"])
        pages = step["pages"]
        B, NB = pages.shape
        Hkv, d, bs = kbuf.shape[1], kbuf.shape[2], self.cfg.block_size
        key = (B, q.shape[1], Hkv, d, NB)
        if self._plan_key != key:
            self._plan = self._wave.plan(B, q.shape[1], Hkv, d, NB, q.device)
            self._plan_key = key
        strides = (bs * Hkv * d, Hkv * d, d)
        if self.cache is None:  # slots are the pool's pages
            loc = step["page_loc"]
            slots_k, slots_v, host_k, host_v = kbuf, vbuf, None, None
        else:  # cached pages from HBM slots, the rest from the host pages through UVA
            page_loc = self.cache.locate(lid, pages, step["full"])
            loc = page_loc[:, None, :].expand(B, Hkv, NB)
            slots_k, slots_v, host_k, host_v = self.cache.k, self.cache.v, kbuf, vbuf
        mean, kmin, kmax = self.meta.layer(lid)  # per page; the kernel reads via `pages`
        res = self._plan.run(
            q,
            slots_k,
            slots_v,
            loc,
            step["lengths32"],
            mean,
            kmin,
            kmax,
            scale=layer.scaling,
            max_read_blocks=self._max_read,
            slot_strides=strides,
            meta_pages=step["pages32"],
            k_host=host_k,
            v_host=host_v,
            host_strides=strides,
        )
        read = res.read_mask()
        if self.cache is not None:
            self.cache.admit(lid, pages, read.any(1), step["full"], page_loc, kbuf, vbuf)
        return res.out, read

    def _decode_reference(self, q, layer, step):
        """`sglang_psa.algo` on the gathered keys: exact semantics, dense cost."""
        pool, lengths, T = self.token_to_kv_pool, step["lengths"], step["T"]
        valid = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
        slots = torch.where(valid, step["rows"].long(), 0)  # slot 0: SGLang's padding sink
        kc = pool.get_key_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)  # [B, Hkv, T, d]
        vc = pool.get_value_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)
        if self.cfg.sparse_mode == "topk":
            res = topk_attention(q, kc, vc, lengths, self.cfg, scale=layer.scaling)
        else:
            res = progressive_attention(q, kc, vc, lengths, self.cfg, scale=layer.scaling)
        return res.out, res.read

    @property
    def blocks_read(self) -> dict[int, int]:
        return {lid: int(n) for lid, n in self._read.items()}

    def read_fraction(self) -> float:
        """Fraction of KV blocks the decode steps read so far, over all layers (syncs)."""
        total = sum(int(n) for n in self._total.values())
        return sum(self.blocks_read.values()) / total if total else 0.0
