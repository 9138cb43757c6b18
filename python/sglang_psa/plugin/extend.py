"""Prefill (extend) passes through SGLang's dense prefill backend; afterwards the `psa`
decode backend computes the block metadata of the pages the extend wrote, per layer."""

from __future__ import annotations


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
