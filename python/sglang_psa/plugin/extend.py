"""Prefill (extend) passes through SGLang's dense prefill backend; afterwards the `psa`
decode backend computes the block metadata of the pages the extend wrote, per layer."""

from __future__ import annotations

import logging

from sglang_psa.sched.serving import current

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
    decode = getattr(backend, "decode_backend", None)
    if not isinstance(decode, PSAAttnBackend):
        return result
    pool = backend.token_to_kv_pool
    bufs = [*getattr(pool, "k_buffer", ()), *getattr(pool, "v_buffer", ())]
    token_major = bool(bufs) and all(b.dim() == 3 and b.is_contiguous() for b in bufs)
    if _is_triton(prefill) and token_major:
        if getattr(prefill, "page_size", 1) != 1:
            logger.info("sglang-psa: Triton prefill addresses the token-major pool per token")
            prefill.page_size = 1
        _enable_staging(decode, pool)
    elif getattr(decode, "residency", None) is not None:
        # The tiered home without staged prefill: a prefix off HBM cannot be read back by
        # the prefill, so SGLang's own limit (a prompt must fit its pool) stays (said once,
        # at startup).
        logger.warning(
            "sglang-psa: staged prefill is off (it needs SGLang's Triton prefill over a "
            "contiguous token-major pool; prefill is %s): prompts larger than HBM are "
            "refused by SGLang's own length check",
            type(prefill).__name__,
        )
    return result


def _enable_staging(decode, pool) -> None:
    """Tiered home: the Triton prefill backend, at page size 1, can read a prefix staged
    from HBM and the host tier (`mem_cache.prefill_stage`), so a prompt larger than HBM is
    served in chunks whose saved blocks leave HBM."""
    res = getattr(decode, "residency", None)
    if res is None:
        return
    from sglang_psa.mem_cache.prefill_stage import PrefillStage

    res.stage = PrefillStage(res.wb, pool, decode.cfg.block_size, decode.first_layer)


def around_triton_forward_extend(original, backend, q, k, v, layer, forward_batch,
                                 *args, **kwargs):  # fmt: skip
    """SGLang's Triton `forward_extend` of one layer: for a batch whose prefix has blocks
    off HBM (tiered home, a prompt larger than HBM), its prefix reads come from a staging
    filled from HBM and the host tier (`PrefillStage.staged`); otherwise untouched."""
    serving = current()
    res = None if serving is None else serving.residency
    stage = None if res is None else res.stage
    if stage is None or stage.plan is None or layer is None:
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    with stage.staged(backend, layer.layer_id, forward_batch):
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)


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
