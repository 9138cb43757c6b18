"""Prefill (extend) passes through SGLang's dense prefill backend; afterwards the `psa`
decode backend computes the block metadata of the pages the extend wrote, per layer."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def after_hybrid_init(result, backend, model_runner=None, prefill_backend=None,
                      decode_backend=None, *args, **kwargs):  # fmt: skip
    """With our decode backend, SGLang runs at the PSA block size as its page size (32),
    and its Triton prefill backend specialises its kernels on that: the extend kernel
    then computes (page, offset) addresses, 5% slower on the H100 (workload e's 8B
    prefill, 477 against 454 ms a 8K-token chunk) than at page size 1. On SGLang's
    contiguous token-major pool `[tokens, Hkv, d]` both address the same slot, so that
    backend is given page size 1 (SGLang's own kernels at its own default)."""
    from sglang_psa.attention.psa_backend import PSAAttnBackend

    prefill = getattr(backend, "prefill_backend", None)
    if not isinstance(getattr(backend, "decode_backend", None), PSAAttnBackend):
        return result
    if getattr(prefill, "page_size", 1) == 1 or not _is_triton(prefill):
        return result
    pool = backend.token_to_kv_pool
    bufs = [*getattr(pool, "k_buffer", ()), *getattr(pool, "v_buffer", ())]
    if bufs and all(b.dim() == 3 and b.is_contiguous() for b in bufs):
        logger.info("sglang-psa: Triton prefill addresses the token-major pool per token")
        prefill.page_size = 1
    return result


def _is_triton(prefill) -> bool:
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    return isinstance(prefill, TritonAttnBackend)


def after_hybrid_forward(result, backend, q=None, k=None, v=None, layer=None,
                         forward_batch=None, *args, **kwargs):  # fmt: skip
    """After `HybridAttnBackend.forward` ran a layer: for an extend batch whose decode
    backend is ours, hand it the layer (its K/V are in SGLang's pool by now)."""
    on_extend = getattr(getattr(backend, "decode_backend", None), "on_extend", None)
    if on_extend is None or forward_batch is None or layer is None:
        return result
    if forward_batch.forward_mode.is_extend():
        on_extend(layer, forward_batch)
    return result
