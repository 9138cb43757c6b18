"""The `psa` attention backend: SGLang's decode attention, sparse.

`--sparse-mode` makes SGLang build a hybrid backend: prefill (extend) runs on
the dense `--prefill-attention-backend`, decode runs here. One SGLang page is
one PSA block (`--page-size` = `--psa-block-size`), so a request's block table
is its `req_to_token` row read every `block_size` tokens.

This is the reference path: per layer it gathers the batch's keys and values
from SGLang's KV pool and runs `sglang_psa.algo` (PSA or top-k, the exact
semantics the kernels are tested against), so its outputs are the ones the
end-to-end tests compare with plain SGLang. It reads the whole context, so it
is not faster than dense attention; the wave-kernel path over the tiered store
replaces the gather and the reference math (issue 6 notes).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_psa.algo import progressive_attention, topk_attention
from sglang_psa.algo.metadata import num_blocks
from sglang_psa.config import PSAConfig, PSAConfigError
from sglang_psa.integration.scheduling import PSAServing, current, install
from sglang_psa.integration.server_args import config_of
from sglang_psa.store.host_pool import blocks_for_budget


def hbm_units(cfg: PSAConfig, pool) -> int:
    """Slot-cache capacity in (layer, KV head, block) units: `--psa-gpu-cache-gb` when
    given, else SGLang's whole KV pool (everything resident: no extra constraint)."""
    unit_bytes = 2 * cfg.block_size * pool.head_dim * pool.dtype.itemsize
    if cfg.gpu_cache_gb is not None:
        return max(1, int(cfg.gpu_cache_gb * (1 << 30)) // unit_bytes)
    return max(1, pool.size // cfg.block_size) * pool.layer_num * pool.head_num


class PSAAttnBackend(AttentionBackend):
    def __init__(self, model_runner, cfg: PSAConfig | None = None):
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
        install(
            PSAServing(
                cfg,
                layers=pool.layer_num,
                kv_heads=pool.head_num,
                hbm_units=hbm_units(cfg, pool),
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
        # Per layer: KV blocks read and available in the decode steps so far.
        self.blocks_read: dict[int, int] = {}
        self.blocks_total: dict[int, int] = {}

    # SGLang calls this before every forward; decode needs nothing precomputed here.
    def init_forward_metadata(self, forward_batch) -> None:
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise RuntimeError(
                "the psa backend serves decode only; extend batches belong to the "
                "prefill backend (--sparse-mode builds a hybrid backend)"
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
        Hq, Hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        B = forward_batch.batch_size
        lengths = forward_batch.seq_lens.to(torch.int64)
        T = int(lengths.max())
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices.long(), :T]
        valid = torch.arange(T, device=rows.device)[None, :] < lengths[:, None]
        slots = torch.where(valid, rows.long(), 0)  # slot 0 is SGLang's padding sink
        kc = pool.get_key_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)  # [B, Hkv, T, d]
        vc = pool.get_value_buffer(layer.layer_id)[slots].permute(0, 2, 1, 3)
        qb = q.reshape(B, Hq, d)
        if self.cfg.sparse_mode == "topk":
            res = topk_attention(qb, kc, vc, lengths, self.cfg, scale=layer.scaling)
        else:
            res = progressive_attention(qb, kc, vc, lengths, self.cfg, scale=layer.scaling)
        lid = layer.layer_id
        serving = current()
        if serving is not None:  # working sets: (head, page) of every block read
            pages = rows[:, :: self.cfg.block_size].long() // self.cfg.block_size
            b, h, j = res.read.nonzero(as_tuple=True)
            reads = zip(b.tolist(), zip(h.tolist(), pages[b, j].tolist()))
            serving.note_reads(lid, forward_batch.req_pool_indices.tolist(), reads)
        self.blocks_read[lid] = self.blocks_read.get(lid, 0) + int(res.read.sum())
        total = int(num_blocks(lengths, self.cfg.block_size).sum()) * Hkv
        self.blocks_total[lid] = self.blocks_total.get(lid, 0) + total
        return res.out.to(q.dtype).reshape(B, Hq * layer.v_head_dim)

    def read_fraction(self) -> float:
        """Fraction of KV blocks the decode steps read so far, over all layers."""
        total = sum(self.blocks_total.values())
        return sum(self.blocks_read.values()) / total if total else 0.0
