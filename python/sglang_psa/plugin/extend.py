"""Prefill (extend) passes through SGLang's dense prefill backend; afterwards the `psa`
decode backend computes the block metadata of the pages the extend wrote, per layer."""

from __future__ import annotations

import logging

from sglang_psa.sched.process import current

logger = logging.getLogger(__name__)


def after_hybrid_init(result, backend, model_runner=None, prefill_backend=None,
                      decode_backend=None, *args, **kwargs):  # fmt: skip
    """With our decode backend, SGLang runs at the PSA block size as its page size (32),
    and its Triton prefill backend specialises its kernels on that: the extend kernel
    then computes (page, offset) addresses, slower than at page size 1 (measured on
    workload e's 8B prefill). On SGLang's contiguous token-major pool `[tokens, Hkv, d]`
    both address the same slot, so that backend is given page size 1 (SGLang's own
    kernels at its own default).

    At the tiered home a Triton backend at page size 1 also reads a prefix staged from
    HBM and the host tier (`mem_cache.prefill_stage`), so a prompt larger than HBM is
    served in chunks whose saved blocks leave HBM. Where SGLang built another prefill
    backend (FA3 by default on a Hopper GPU), a Triton one is built beside it for the
    staged batches alone (`attention.prefill_switch.StagedPrefill`); every other batch
    prefills on SGLang's. The scheduler process was assembled with its prefill stage or
    without before SGLang built this prefill backend (`sched.process.assemble`,
    from the pool's layout); here that decision meets the backends SGLang built: a
    mismatch raises, staging off is said once."""
    from sglang_psa.attention.psa_backend import PSAAttnBackend
    from sglang_psa.mem_cache.prefill_stage import reads_token_major

    prefill = getattr(backend, "prefill_backend", None)
    decode = getattr(backend, "decode_backend", None)
    if not isinstance(decode, PSAAttnBackend):
        return result
    # SGLang's decode-graph runner calls `on_after_cuda_graph_warmup` on the hybrid, which
    # does not pass it on (0.5.17, 0.5.23): ours forgets the warmup's dummy steps there
    backend.on_after_cuda_graph_warmup = decode.on_after_cuda_graph_warmup
    pool = backend.token_to_kv_pool
    token_major = reads_token_major(pool)
    if _is_triton(prefill) and token_major and getattr(prefill, "page_size", 1) != 1:
        logger.info("sglang-psa: Triton prefill addresses the token-major pool per token")
        prefill.page_size = 1
    process = decode.process
    serving = getattr(process, "serving", None)
    names = {"prefill": type(prefill).__name__, "staged": None}
    if serving is not None:  # server info says which backends prefill
        serving.prefill_backends = names
    if process.residency is None:  # the KV in HBM only: nothing to stage
        return result
    if (process.stage is not None) != token_major:
        raise RuntimeError(
            f"sglang-psa: the scheduler process was assembled "
            f"{'with' if process.stage is not None else 'without'} staged prefill, but "
            f"SGLang's KV pool is {'' if token_major else 'not '}contiguous and token-major"
        )
    if process.stage is None:
        # The tiered home without staged prefill: a prefix off HBM cannot be read back by
        # the prefill, so SGLang's own limit (a prompt must fit its pool) stays (said once,
        # at startup).
        logger.warning(
            "sglang-psa: staged prefill is off (it needs a contiguous token-major KV pool, "
            "which %s is not): prompts larger than HBM are refused by SGLang's own length "
            "check",
            type(pool).__name__,
        )
    else:
        if not _is_triton(prefill):
            backend.prefill_backend = staged_prefill(prefill, model_runner or backend.model_runner,
                                                     process.stage)  # fmt: skip
        names["staged"] = "TritonAttnBackend"
    return result


def staged_prefill(fast, model_runner, stage):
    """`fast` (the prefill backend SGLang built) with SGLang's Triton backend at page size
    1 beside it for the extend batches whose prefix `stage` planned to stage."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    from sglang_psa.attention.prefill_switch import StagedPrefill

    staging = TritonAttnBackend(model_runner)
    staging.page_size = 1
    logger.info(
        "sglang-psa: prefill on %s; a prefix staged from the host tier on Triton",
        type(fast).__name__,
    )
    return StagedPrefill(fast, staging, lambda: stage.plan is not None)


def around_triton_forward_extend(original, backend, q, k, v, layer, forward_batch,
                                 *args, **kwargs):  # fmt: skip
    """SGLang's Triton `forward_extend` of one layer: for a batch whose prefix has blocks
    off HBM (tiered home, a prompt larger than HBM), its prefix reads come from a staging
    filled from HBM and the host tier (`PrefillStage.staged`); otherwise untouched."""
    process = current()
    stage = None if process is None else process.stage
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
