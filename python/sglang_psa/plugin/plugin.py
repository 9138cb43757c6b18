"""The `sglang.srt.plugins` entry point: SGLang calls `register()` in every process.

It runs in the launching process before arguments are parsed and again in
each scheduler process, so it must be cheap, idempotent and free of CUDA. It
only registers: the flags and hooks (`hooks.HOOKS`), the `psa` attention
backend and, where the release has it (`releases.FEATURES["psa_radix_cache"]`), the
`psa` radix cache backend. Without
`--sparse-mode` every hook passes straight through, so SGLang behaves as if the
package were absent.
"""

from __future__ import annotations

import logging

from sglang_psa import releases
from sglang_psa.plugin import hooks

logger = logging.getLogger("sglang_psa")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    hooks.check_targets()  # a changed SGLang stops here with a clear message
    from sglang.srt.layers.attention.attention_registry import register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    from sglang_psa.plugin.server_args import BACKEND

    if BACKEND not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND])
    register_attention_backend(BACKEND)(_create_backend)
    if releases.has("psa_radix_cache"):  # --radix-cache-backend psa (the tiered home)
        from sglang_psa.mem_cache import psa_radix_cache

        psa_radix_cache.register()
    hooks.register_all()
    _registered = True
    logger.debug("sglang-psa plugin registered")


def _create_backend(model_runner):
    """SGLang builds the decode backend in its scheduler process: the backend assembles
    what that process owns (`sched.process.assemble`), which the scheduler hooks use from
    now on."""
    from sglang_psa.attention.psa_backend import PSAAttnBackend
    from sglang_psa.plugin.server_args import config_of
    from sglang_psa.sched import process

    backend = PSAAttnBackend(model_runner, cfg=config_of(model_runner.server_args))
    process.register(backend.process)
    return backend
