"""The `--sparse-mode` / `--psa-*` command-line flags, derived from `PSAConfig`.

Every field of `PSAConfig` becomes a flag with `PSAConfig`'s own spelling
(`flag_name`), default None so that only what the user typed overrides the
config defaults, and validation errors name the flag. Values reach
`config_from_namespace` as typed (argparse neither converts nor checks them, which
would print SGLang's whole usage before its error); it converts and checks them,
and refuses a flag that acts only together with another's value (`ONLY_WITH`).
The parsed config travels to SGLang's subprocesses in one environment variable,
set by the launching process before it spawns them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any

from sglang_psa.config import (
    KV_HOMES,
    SCORE_METHODS,
    SPARSE_MODES,
    STOP_RULES,
    WRITEBACKS,
    PSAConfig,
    PSAConfigError,
    flag_name,
)

ENV_VAR = "SGLANG_PSA_CONFIG"

_HELP = {
    "sparse_mode": "sparse decode attention over the tiered KV store: psa (progressive "
    "sparse attention), topk (fixed token budget, for comparison) or none (plain SGLang)",
    "threshold": "PSA: stop once this fraction of the softmax mass is covered",
    "stop_rule": "PSA: heuristic (the paper's estimate) or certified (key-bound guarantee)",
    "score": "block criticality: mean (cuboid-mean keys) or bound (Quest's min/max bound)",
    "block_size": "tokens per KV block (sets SGLang's --page-size)",
    "sink_blocks": "first blocks always attended",
    "recent_blocks": "newest blocks always attended (>= 1: the tail block)",
    "wave_blocks": "blocks attended by the first wave",
    "wave_growth": "growth factor of successive waves",
    "max_wave_blocks": "largest wave",
    "wave_fraction": "PSA: a first wave of this fraction of each request's blocks, between "
    "--psa-wave-blocks and --psa-max-first-wave-blocks (0: always --psa-wave-blocks)",
    "max_first_wave_blocks": "PSA: largest first wave under --psa-wave-fraction",
    "max_read_fraction": "PSA, heuristic rule: a KV head reads at most this fraction of a "
    "request's blocks whatever the rule says (1: no cap; the sink and recent blocks are "
    "always read; the certified rule and --psa-threshold 1 are never capped)",
    "later_wave_blocks": "PSA: the waves after the first start at this many blocks and grow "
    "by --psa-wave-growth up to --psa-max-wave-blocks (0: as large as the first wave); the "
    "stop rule is checked after each wave",
    "topk_tokens": "topk mode: tokens attended per step",
    "rerank_interval": "decode scores and ranks the blocks every this many steps and reads "
    "in the kept order between them (blocks a request gained since are always read); psa "
    "runs its stop rule on the ranking steps and reads as many ranked blocks between "
    "them; 1: every step (the certified rule and --psa-threshold 1 rank every step)",
    "bound_bits": "bits per channel of the per-block key bounds: 16 (the KV dtype) or 8 "
    "(codes with a float32 scale per block and KV head, rounded outward so they still "
    "bound every key: half the metadata bytes read per step)",
    "code_bits": "with --psa-stop-rule certified: bits a channel of the key codes kept per "
    "page (each key as a cell of its block's range), from which the rule ranks blocks and "
    "bounds the unread mass (HBM: code_bits / 16 of the keys' bytes, and the ranges)",
    "gpu_cache_gb": "GiB of HBM for working sets: a cap on the working sets admitted "
    "together, at either --psa-kv-home (default: SGLang's whole KV pool)",
    "host_pool_gb": "pinned host memory in GiB for the host tier of --psa-kv-home tiered "
    "(a request needing more is refused; default: 40%% of the memory the host has "
    "available at startup, at most 32; at most 80%% of it)",
    "kv_home": "where the KV lives: hbm (SGLang's pool in GPU memory); tiered (GPU "
    "memory, and every full block is also written back "
    "to a host tier of --psa-host-pool-gb (see --psa-writeback); saved blocks leave HBM "
    "when it runs short; prefix caching on SGLang's tree over the tiered store, "
    "--radix-cache-backend psa, unless --disable-radix-cache)",
    "writeback": "with --psa-kv-home tiered, how full blocks reach the host tier: uva "
    "(default: a prefill chunk's blocks gathered into device staging and copied by DMA, a "
    "decode step's by one kernel on a few SMs through unified addressing; no helper "
    "process) or engine (a GPU gather and one D2H copy per layer into a pinned ring, "
    "scattered by the copy-engine process; measured slower on the H100)",
    "writeback_start": "with --psa-kv-home tiered: full blocks are written back to the host "
    "tier once less than this fraction of SGLang's KV pool is free (neither held nor cached), "
    "and from then on; until then the KV lives in HBM alone and nothing leaves it "
    "(default 1: from the first block; a prompt larger than HBM starts it at once)",
    "cold_fraction": "with --psa-kv-home tiered, while blocks are evicted: a resident block "
    "read lately by fewer than this fraction of its (layer, KV head) units leaves HBM too, "
    "its page holding single hot units of evicted blocks instead (0: only when SGLang "
    "needs pages)",
    "unit_cache_ways": "with --psa-kv-home tiered: pages per set of the unit cache, each "
    "a position for every (layer, KV head) (a host block's units, of any layer, may live "
    "only in its set's positions; more ways hold more of what decode reads, at a longer "
    "refresh)",
    "host_prefix_min_tokens": "with --psa-kv-home tiered (and its prefix cache): a "
    "matched prefix going on in the host tier for at least this many tokens is read from "
    "there (staged prefill; decode reads those blocks from the host tier), a shorter run is "
    "computed again (0: always read; a length above any prompt's: always computed)",
    "ws_window": "decode steps whose union of used blocks is a request's working set",
    "audit_coverage": "diagnosis (slow): every decode step also scores every key (a dense "
    "pass per layer) and server info's coverage_audit keeps the smallest share of a query "
    "head's true softmax mass the blocks it read held (1/0; --psa-kv-home hbm only)",
    "max_inject_tokens": "prefill tokens per batch: long prompts are chunked at this size "
    "(sets --chunked-prefill-size unless given; layer-segmented prefill is not implemented)",
}

_CHOICES = {
    "sparse_mode": SPARSE_MODES,
    "stop_rule": STOP_RULES,
    "score": SCORE_METHODS,
    "kv_home": KV_HOMES,
    "writeback": WRITEBACKS,
}


# Flags that act only when another flag has a given value: field -> (that field, value).
# Given alone they would be silently ignored, so they are refused naming both flags.
ONLY_WITH = {
    "writeback": ("kv_home", "tiered"),
    "writeback_start": ("kv_home", "tiered"),
    "host_pool_gb": ("kv_home", "tiered"),
    "cold_fraction": ("kv_home", "tiered"),
    "unit_cache_ways": ("kv_home", "tiered"),
    "host_prefix_min_tokens": ("kv_home", "tiered"),
    "topk_tokens": ("sparse_mode", "topk"),
    "code_bits": ("stop_rule", "certified"),
}


def _field_type(f: dataclasses.Field) -> type:
    hints = typing.get_type_hints(PSAConfig)
    t = hints[f.name]
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args else t


def add_psa_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags to `parser` (idempotent), in their own help group."""
    if any("--sparse-mode" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group("sglang-psa (sparse decode over a tiered KV store)")
    defaults = PSAConfig()
    for f in dataclasses.fields(PSAConfig):
        if f.name == "extra":
            continue
        default = getattr(defaults, f.name)
        shown = "none" if f.name == "sparse_mode" else default
        help_text = _HELP.get(f.name, f.name)
        if shown is not None and "default:" not in help_text:  # else the text says it
            help_text += f" (default: {shown})"
        choices = _CHOICES.get(f.name)
        group.add_argument(
            flag_name(f.name),
            dest=f"psa_{f.name}" if f.name != "sparse_mode" else "sparse_mode",
            metavar="{" + ",".join(choices) + "}" if choices else _field_type(f).__name__.upper(),
            default=None,
            help=help_text,
        )


def _convert(name: str, value: Any) -> Any:
    """A flag's value as its field's type; a string that is not one names the flag."""
    f = next(f for f in dataclasses.fields(PSAConfig) if f.name == name)
    kind = _field_type(f)
    if not isinstance(value, str) or kind is str:
        return value
    if kind is bool:
        word = value.strip().lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise PSAConfigError(name, f"must be 1/true or 0/false, got {value!r}")
    try:
        return kind(value)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise PSAConfigError(name, f"must be {what}, got {value!r}") from None


def config_from_namespace(ns: argparse.Namespace | object) -> PSAConfig | None:
    """The `PSAConfig` the flags ask for, or None for `--sparse-mode none` / no flag.

    A `--psa-*` flag without `--sparse-mode` is an error, not silently ignored.
    """
    mode = getattr(ns, "sparse_mode", None)
    given = {
        f.name: _convert(f.name, getattr(ns, f"psa_{f.name}"))
        for f in dataclasses.fields(PSAConfig)
        if f.name not in ("extra", "sparse_mode") and getattr(ns, f"psa_{f.name}", None) is not None
    }
    if mode in (None, "none"):
        if given:
            flags = ", ".join(flag_name(k) for k in given)
            raise PSAConfigError(
                "sparse_mode", f"{flags} given without --sparse-mode psa|topk; got {mode!r}"
            )
        return None
    cfg = PSAConfig(sparse_mode=mode, **given)
    for name in given:
        if name in ONLY_WITH:
            other, value = ONLY_WITH[name]
            if getattr(cfg, other) != value:
                raise PSAConfigError(
                    name,
                    f"acts only with {flag_name(other)} {value}; "
                    f"got {flag_name(other)} {getattr(cfg, other)}",
                )
    if cfg.kv_home == "tiered":
        cfg = sized_host_pool(cfg, given="host_pool_gb" in given)
    if given.get("rerank_interval", 1) > 1 and not cfg.keeps_selection:
        raise PSAConfigError(
            "rerank_interval",
            "keeps a selection for topk and for psa's heuristic rule with "
            f"{flag_name('threshold')} < 1 only; got {flag_name('stop_rule')} "
            f"{cfg.stop_rule}, {flag_name('threshold')} {cfg.threshold}",
        )
    return cfg


# The tiered home's host tier is pinned memory, which the kernel never swaps out. Unless
# --psa-host-pool-gb is given it takes this share of the memory the host has available
# at startup (at most PSAConfig's default); a given size may take at most the second.
HOST_POOL_DEFAULT_SHARE = 0.4
HOST_POOL_MAX_SHARE = 0.8


def host_memory_available_gib() -> float | None:
    """The memory this host has available now (Linux `MemAvailable`), GiB; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def sized_host_pool(cfg: PSAConfig, given: bool) -> PSAConfig:
    """The tiered home's host tier sized for this host (resolved once, at startup, in the
    launching process: every scheduler process gets the same size). Not given: the
    smaller of the default and `HOST_POOL_DEFAULT_SHARE` of the available memory, in
    steps of 0.5 GiB. Given: refused naming the flag beyond `HOST_POOL_MAX_SHARE` of it."""
    avail = host_memory_available_gib()
    if avail is None:
        return cfg
    if not given:
        share = int(HOST_POOL_DEFAULT_SHARE * avail * 2) / 2
        return cfg.replace(host_pool_gb=max(0.5, min(cfg.host_pool_gb, share)))
    if cfg.host_pool_gb > HOST_POOL_MAX_SHARE * avail:
        raise PSAConfigError(
            "host_pool_gb",
            f"asks for {cfg.host_pool_gb:g} GiB of pinned host memory, which is never "
            f"swapped out; this host has {avail:.1f} GiB available: give at most "
            f"{HOST_POOL_MAX_SHARE * avail:.1f} (or leave the flag out: "
            f"{HOST_POOL_DEFAULT_SHARE:.0%} of it, at most {PSAConfig().host_pool_gb:g})",
        )
    return cfg


def export(cfg: PSAConfig | None) -> None:
    """Hand the config to child processes (scheduler, detokenizer) through the environment."""
    if cfg is None:
        os.environ.pop(ENV_VAR, None)
        return
    d = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "extra"}
    os.environ[ENV_VAR] = json.dumps(d)


def imported() -> PSAConfig | None:
    """The config the launching process exported, if any."""
    raw = os.environ.get(ENV_VAR)
    return PSAConfig(**json.loads(raw)) if raw else None
