"""`--sparse-mode` in SGLang's `ServerArgs`: parse, check against other flags, adjust.

Both ways a server starts pass through here: the CLI (`add_cli_args` gains the
flags, `from_cli_args` reads them) and `sgl.Engine(sparse_mode="psa", ...)`
(`ServerArgs.__init__` takes the keyword arguments). The SGLang fields PSA
depends on are set *before* SGLang resolves its defaults:

- decode attention runs on the `psa` backend, prefill on `--prefill-attention-backend`
  (or `--attention-backend`; by default SGLang's fastest dense backend here, as SGLang
  picks it for plain serving: FA3 on a Hopper GPU with SGLang's FA3 kernels,
  else FlashInfer, else triton; `default_prefill_backend`);
- `--page-size` equals `--psa-block-size` (one SGLang page = one PSA block);
- CUDA graphs stay SGLang's: the sparse decode step has fixed shapes and no host
  sync, so it runs inside SGLang's decode graphs at every KV home; prefill is dense;
- `--psa-kv-home tiered` keeps prefix caching with the `psa` radix cache backend
  (`--radix-cache-backend psa`, set unless `--disable-radix-cache`: SGLang's tree over
  the tiered store, which knows every holder of a shared page);
- prompts are prefilled in chunks of `--psa-max-inject-tokens` unless
  `--chunked-prefill-size` says otherwise.

Flags PSA cannot serve fail here, naming both flags: on the command line as
argparse fails (one error line, exit status 2, nothing started), in
`sgl.Engine(...)` as a `PSAConfigError`. The resolved `PSAConfig`
rides on the `ServerArgs` object as `_psa_config` (pickled into every
scheduler process) and in the environment for processes that do not get it.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import logging
import os
import sys
from typing import Any

from sglang_psa import releases
from sglang_psa.config import PSAConfig, PSAConfigError
from sglang_psa.plugin import flags

logger = logging.getLogger(__name__)

BACKEND = "psa"


def _has_fa3() -> bool:
    """SGLang's FA3 kernels are installed (sgl_kernel's `flash_ops` library; a slim
    sgl-kernel without them would fail at the first prefill)."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(glob.glob(os.path.join(d, "flash_ops*.so")) for d in spec.submodule_search_locations)


def default_prefill_backend(cfg: PSAConfig) -> tuple[str, str]:
    """(backend, why): the dense prefill backend when none is given. SGLang's fastest on
    this machine for a dense GQA model, as SGLang itself defaults: FA3 on a Hopper GPU
    (compute capability 9.x) with SGLang's FA3 kernels, else FlashInfer where installed,
    else triton. At the tiered home too: its staged prefill (a prompt larger than HBM,
    resumption from the host tier) runs those batches on a Triton backend built beside
    it (`attention.prefill_switch`)."""
    try:
        import torch

        cuda = torch.cuda.is_available()
        major = torch.cuda.get_device_capability()[0] if cuda else 0
    except Exception:  # noqa: BLE001 - no usable CUDA: SGLang's CPU default
        cuda, major = False, 0
    if not cuda:
        return "triton", "no CUDA device"
    if major == 9 and _has_fa3():
        return "fa3", "Hopper GPU with SGLang's FA3 kernels"
    if importlib.util.find_spec("flashinfer") is not None:
        why = "FA3 kernels not installed" if major == 9 else f"compute capability {major}.x"
        return "flashinfer", why
    return "triton", "neither FA3 (Hopper) nor FlashInfer available"


# SGLang options PSA cannot serve: (field, its flag, why).
_INCOMPATIBLE = (
    (
        "speculative_algorithm",
        "--speculative-algorithm",
        "speculative verification runs SGLang's extend path, which PSA does not cover",
    ),
    (
        "enable_mixed_chunk",
        "--enable-mixed-chunk",
        "mixed batches send decode tokens through the extend path",
    ),
    (
        "enable_hisparse",
        "--enable-hisparse",
        "HiSparse is SGLang's own sparse KV tier for DeepSeek models",
    ),
    (
        "enable_dp_attention",
        "--enable-dp-attention",
        "the plugin agrees its scheduling over the tensor-parallel group that shards the "
        "KV heads; attention data parallelism splits that group (use --tp, or several "
        "servers behind sglang-router)",
    ),
    (
        "enable_hierarchical_cache",
        "--enable-hierarchical-cache",
        "the tiered store already keeps every KV block in host memory",
    ),
)


def _check_psa_radix_cache(cfg: PSAConfig, fields: dict[str, Any]) -> None:
    """`--radix-cache-backend psa`: prefix caching at the tiered home (SGLang's tree over
    the tiered store, `mem_cache.psa_radix_cache`). It reads prefixes the host tier alone
    holds through the staged prefill (a Triton backend for those batches, whatever the
    prefill backend: `attention.prefill_switch`)."""
    why = None
    if not releases.has("psa_radix_cache"):
        why = (
            f"needs SGLang {' or '.join(releases.FEATURES['psa_radix_cache'])} (installed: "
            f"{releases.release()}, whose prefix match the psa radix cache does not follow)"
        )
    elif cfg.kv_home != "tiered":
        why = "needs --psa-kv-home tiered (the hbm home keeps SGLang's own radix cache)"
    elif fields.get("disable_radix_cache"):
        why = "contradicts --disable-radix-cache"
    if why is not None:
        raise PSAConfigError("kv_home", f"--radix-cache-backend psa {why}")


def _tiered_prefix_cache(cfg: PSAConfig, fields: dict[str, Any]) -> None:
    """The prefix cache's backend. At the tiered home a request's blocks give their HBM
    pages back when HBM runs short, and a page the prefix tree shares may leave HBM only
    with the `psa` radix cache, which knows every holder: it is the tiered home's
    backend unless `--disable-radix-cache` (then no prefix caching there). Another
    backend there, or `psa` elsewhere, fails naming the flag."""
    backend = fields.get("radix_cache_backend")
    if cfg.kv_home == "tiered" and not fields.get("disable_radix_cache"):
        if backend not in (None, "psa"):
            raise PSAConfigError(
                "kv_home",
                "tiered keeps prefixes with --radix-cache-backend psa (the default there); "
                f"--radix-cache-backend {backend} conflicts (leave it unset, or pass "
                "--disable-radix-cache for no prefix caching)",
            )
        if backend is None:
            logger.info(
                "sglang-psa: the tiered home keeps prefix caching on --radix-cache-backend "
                "psa (--disable-radix-cache turns it off)"
            )
        fields["radix_cache_backend"] = backend = "psa"
    if backend == "psa":
        _check_psa_radix_cache(cfg, fields)


def _env_on(name: str) -> bool:
    """An SGLang boolean environment switch is on (its `EnvBool`'s spellings of true)."""
    return os.environ.get(name, "").lower() in ("1", "true", "yes", "y")


def apply(cfg: PSAConfig, fields: dict[str, Any]) -> None:
    """Check `fields` (SGLang's ServerArgs values, as given) and set what PSA needs."""
    for name, flag, why in _INCOMPATIBLE:
        if fields.get(name):
            raise PSAConfigError("sparse_mode", f"cannot be combined with {flag}: {why}")
    if _env_on("SGLANG_ENABLE_METADATA_GLUE_GRAPH"):
        # SGLang 0.5.23 can capture a backend's out-of-graph metadata step in a CUDA graph
        # of its own; ours picks the step's buffers there and, at the tiered home, issues
        # the write-back and host-tier copies, which a replay would skip (never tried at
        # the hbm home: refused at both)
        raise PSAConfigError(
            "sparse_mode",
            "cannot run with SGLANG_ENABLE_METADATA_GLUE_GRAPH=1: the psa decode backend's "
            "metadata step runs on the host every step (the tiered home's write-back and "
            "host-tier copies), which SGLang's metadata glue graph would skip; unset it",
        )
    if (fields.get("attn_dp_size") or 1) > 1:  # 0.5.23's spelling of DP attention
        raise PSAConfigError(
            "sparse_mode",
            "cannot be combined with --attn-dp-size above 1: the plugin agrees its scheduling "
            "over the tensor-parallel group that shards the KV heads; attention data "
            "parallelism splits that group (use --tp, or several servers behind sglang-router)",
        )
    if (fields.get("pp_size") or 1) > 1:
        raise PSAConfigError(
            "sparse_mode",
            "cannot be combined with --pp-size above 1: each pipeline stage would keep "
            "its own working sets and host tier for a share of the layers (use --tp)",
        )
    page = fields.get("page_size")
    if page not in (None, cfg.block_size):
        raise PSAConfigError(
            "block_size",
            f"--page-size {page} differs from the PSA block size {cfg.block_size}; "
            "leave --page-size unset or make them equal",
        )
    decode = fields.get("decode_attention_backend")
    if decode not in (None, BACKEND):
        raise PSAConfigError(
            "sparse_mode",
            f"sets the decode attention backend to {BACKEND!r}; "
            f"--decode-attention-backend {decode} conflicts",
        )
    _tiered_prefix_cache(cfg, fields)
    prefill = fields.get("prefill_attention_backend") or fields.get("attention_backend")
    if not prefill:
        prefill, why = default_prefill_backend(cfg)
        logger.info("sglang-psa: prefill attention on %s (%s)", prefill, why)
    if prefill == BACKEND:
        raise PSAConfigError(
            "sparse_mode", "prefill is dense: choose a dense --prefill-attention-backend"
        )
    if cfg.kv_home == "tiered" and _env_on("SGLANG_USE_HND_KVCACHE"):
        raise PSAConfigError(
            "kv_home", "tiered copies SGLang's token-major KV pages; unset SGLANG_USE_HND_KVCACHE"
        )
    if fields.get("chunked_prefill_size") is None:
        # Bound each prefill batch by chunking long prompts at --psa-max-inject-tokens.
        fields["chunked_prefill_size"] = cfg.max_inject_tokens
    fields.update(
        page_size=cfg.block_size,
        decode_attention_backend=BACKEND,
        prefill_attention_backend=prefill,
        attention_backend=prefill,
    )


def _pop_psa_kwargs(kwargs: dict[str, Any]) -> PSAConfig | None:
    ns = argparse.Namespace(sparse_mode=kwargs.pop("sparse_mode", None))
    for key in [k for k in kwargs if k.startswith("psa_")]:
        setattr(ns, key, kwargs.pop(key))
    return flags.config_from_namespace(ns)


# --- the hooks (registered in `plugin.hooks`) ---------------------------------


def after_add_cli_args(result, parser: argparse.ArgumentParser):
    flags.add_psa_args(parser)
    return result


def _cli_error(err: PSAConfigError):
    """On the command line a bad flag ends the process as argparse does: one line naming
    the flag on stderr, exit status 2, nothing started (no traceback)."""
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "sglang"
    sys.stderr.write(f"{prog}: error: {err}\n")
    raise SystemExit(2)


def around_from_cli_args(original, cls, args: argparse.Namespace):
    try:
        cfg = flags.config_from_namespace(args)
        if cfg is not None:
            apply(cfg, vars(args))
    except PSAConfigError as err:
        _cli_error(err)
    if cfg is None:
        flags.export(None)
        return original(cls, args)
    server_args = original(cls, args)
    _attach(server_args, cfg)
    flags.export(cfg)
    return server_args


def _attach(server_args, cfg: PSAConfig) -> None:
    """`server_args._psa_config = cfg`, past SGLang's write guard: 0.5.17's dataclass
    takes it through `object.__setattr__`; 0.5.23's msgspec Struct keeps underscore names
    that are not fields as bookkeeping, pickled with it into every process."""
    try:
        object.__setattr__(server_args, "_psa_config", cfg)
    except TypeError:  # "can't apply this __setattr__": not a plain object
        server_args._psa_config = cfg


def around_init(original, self, *args, **kwargs):
    """`ServerArgs(**kwargs)` as `sgl.Engine` builds it: accept `sparse_mode=`/`psa_*=`."""
    cfg = _pop_psa_kwargs(kwargs)
    if cfg is not None:
        if args:
            raise TypeError("ServerArgs takes keyword arguments only with sparse_mode")
        apply(cfg, kwargs)
    result = original(self, *args, **kwargs)
    if cfg is not None:
        _attach(self, cfg)
        flags.export(cfg)
    return result


def around_engine_init(original, engine, *args, **kwargs):
    """`sgl.Engine(sparse_mode="psa", ...)` from SGLang 0.5.23 on, whose `ServerArgs` is a
    msgspec Struct (no hook reaches its constructor): the PSA keyword arguments leave
    before SGLang builds its `ServerArgs` from the rest, adjusted as `apply` says, and
    the config rides on it (`Engine.server_args_class` builds it) into every process."""
    cfg = _pop_psa_kwargs(kwargs)
    if cfg is None:
        return original(engine, *args, **kwargs)
    if args or "server_args" in kwargs:
        raise TypeError("Engine takes keyword arguments only, not server_args, with sparse_mode")
    apply(cfg, kwargs)
    flags.export(cfg)
    build = engine.server_args_class

    def build_with_config(**fields):
        server_args = build(**fields)
        _attach(server_args, cfg)
        return server_args

    engine.server_args_class = build_with_config  # this engine's only
    try:
        return original(engine, *args, **kwargs)
    finally:
        del engine.server_args_class


def config_of(server_args) -> PSAConfig | None:
    """The PSA config a (possibly unpickled) ServerArgs carries, else the environment's."""
    cfg = getattr(server_args, "_psa_config", None)
    return cfg if cfg is not None else flags.imported()
