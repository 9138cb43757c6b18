"""The SGLang releases sglang-psa supports, and what differs between them for code that
reads SGLang's objects.

`READS` names, per release, where the attributes whose names moved between releases
live; `FEATURES` names behaviour only some releases allow. `read`/`write` and the
request accessors (`req_row`, `req_prefix_len`) go through them, so every layer of the
package (mem_cache, sched and the SGLang glue in `plugin`) reads an SGLang request the
same way without importing the glue. Nothing here imports SGLang: the installed
release is read from the package metadata. `plugin.hooks.check_targets` checks every
entry against the installed SGLang at plugin load.

A release between or after the supported ones uses the table of the newest supported
release before it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from dataclasses import dataclass

# The SGLang releases sglang-psa is tested against (pyproject's `serve` extra admits these).
SUPPORTED = ("0.5.17", "0.5.23")


@functools.cache  # read on every hook call: parsed once a version
def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


@functools.lru_cache(maxsize=1)
def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def release(version: str | None = None) -> str:
    """The supported release whose table applies to `version` (default: the installed
    SGLang): that release, else the newest supported one before it (else the oldest)."""
    version = version or installed_version()
    if version is None:
        return SUPPORTED[-1]
    older = [r for r in SUPPORTED if _key(r) <= _key(version)]
    return older[-1] if older else SUPPORTED[0]


@dataclass(frozen=True)
class Read:
    """An SGLang attribute (or parameter) the plugin reads or writes whose name moved between
    releases: on an object of class `owner` (a function: its parameter), at `path`."""

    key: str
    owner: str
    path: str
    releases: tuple[str, ...]


READS: tuple[Read, ...] = (
    # A request's row in the request table: a Req field, then its KV record's.
    Read("req.row", "sglang.srt.managers.schedule_batch.Req", "req_pool_idx", ("0.5.17",)),
    Read("req.kv", "sglang.srt.managers.schedule_batch.Req", "kv", ("0.5.23",)),
    Read("req.row", "sglang.srt.managers.schedule_batch.ReqKvInfo", "kv.req_pool_idx", ("0.5.23",)),
    # A request's prefix: the list of its slots SGLang writes into its row; from 0.5.23 on
    # the prefix's length, whose slots are already in the row.
    Read("req.prefix", "sglang.srt.managers.schedule_batch.Req", "prefix_indices", ("0.5.17",)),
    Read("req.prefix", "sglang.srt.managers.schedule_batch.Req", "prefix_len", ("0.5.23",)),
    # The length of a request's row the prefix cache owns (matched or inserted): a Req
    # field, then its KV record's.
    Read(
        "req.protected",
        "sglang.srt.managers.schedule_batch.Req",
        "cache_protected_len",
        ("0.5.17",),
    ),
    Read(
        "req.protected",
        "sglang.srt.managers.schedule_batch.ReqKvInfo",
        "kv.cache_protected_len",
        ("0.5.23",),
    ),
    # A request's cache salt, which namespaces the prefix tree apart from `extra_key`
    # (0.5.23; 0.5.17 folds a salt into `extra_key`).
    Read("req.salt", "sglang.srt.managers.schedule_batch.Req", "cache_salt", ("0.5.23",)),
    # A request's output token ids (the same in every release; read, so the check at
    # plugin load notices a rename).
    Read("req.output", "sglang.srt.managers.schedule_batch.Req", "output_ids", SUPPORTED),
    # PrefillAdder's token budget offsets: its own, then its PrefillBudget's.
    Read(
        "adder.total_offset",
        "sglang.srt.managers.schedule_policy.PrefillAdder",
        "rem_total_token_offset",
        ("0.5.17",),
    ),
    Read(
        "adder.budget",
        "sglang.srt.managers.schedule_policy.PrefillAdder",
        "memory_budget",
        ("0.5.23",),
    ),
    Read(
        "adder.total_offset",
        "sglang.srt.mem_cache.prefill_budget.PrefillBudget",
        "memory_budget.total_offset",
        ("0.5.23",),
    ),
    Read(
        "adder.current_offset",
        "sglang.srt.managers.schedule_policy.PrefillAdder",
        "cur_rem_token_offset",
        ("0.5.17",),
    ),
    Read(
        "adder.current_offset",
        "sglang.srt.mem_cache.prefill_budget.PrefillBudget",
        "memory_budget.current_offset",
        ("0.5.23",),
    ),
    # What `sgl.Engine(**kwargs)` builds its ServerArgs with (the kwargs hook of 0.5.23).
    Read(
        "engine.server_args_class",
        "sglang.srt.entrypoints.engine.Engine",
        "server_args_class",
        ("0.5.23",),
    ),
    # release_kv_cache's flag: insert into the prefix cache (False: a retraction).
    Read(
        "release.insert", "sglang.srt.mem_cache.common.release_kv_cache", "is_insert", ("0.5.17",)
    ),
    Read(
        "release.insert", "sglang.srt.mem_cache.common.release_kv_cache", "checkpoint", ("0.5.23",)
    ),
)

# Behaviour that only some releases allow, by name: the releases that have it.
FEATURES: dict[str, tuple[str, ...]] = {
    # A request's prefix is a list of KV slots that SGLang writes into its new row
    # (`Req.prefix_indices`): a retracted request at the tiered home resumes with its
    # saved blocks as that prefix (page-0 entries), and a chunked prompt's copy of its row
    # is kept in step with blocks that left HBM. From 0.5.23 on the prefix is a length
    # (`Req.prefix_len`), a later chunk's prefix is its row, and a new row's prefix slots
    # are read at allocation (`mem_cache.allocation._prefix_kv_indices`, which the plugin
    # answers for a resuming request: `plugin.scheduling.around_prefix_kv_indices`).
    "prefix_slots": ("0.5.17",),
    # The `psa` radix cache (`mem_cache.psa_radix_cache`) subclasses this release's
    # `RadixCache` and overrides its calls as they are there (tested against it): SGLang's
    # registry then offers it as `--radix-cache-backend psa`.
    "psa_radix_cache": ("0.5.17", "0.5.23"),
    # SGLang caches a request in its tree through `checkpoint(req, up_to=...)` (each chunk
    # and at release), frees the request's row outside the tree (`free_kv_row`), ends
    # with `on_release`, and reads a matched prefix's slots at allocation
    # (`prefix_device_indices`); a match is a length (`MatchResult.device_prefix_len`).
    # 0.5.17: `cache_unfinished_req` / `cache_finished_req`, a match is its slots.
    "tree_checkpoint": ("0.5.23",),
    # `alloc_for_decode` advances a request's committed KV length with its allocated one
    # (0.5.17: `prepare_for_decode` advances `Req.kv_committed_len` after it);
    # `mem_cache.decode_alloc` does as the release does.
    "decode_alloc_commits": ("0.5.23",),
}


def applies(releases: tuple[str, ...]) -> bool:
    return release() in releases


def has(feature: str) -> bool:
    """Whether the installed SGLang's release has `feature` (see `FEATURES`)."""
    return applies(FEATURES[feature])


@functools.cache
def path(key: str) -> str:
    """Where the installed release keeps the attribute `key` of `READS`."""
    for r in READS:
        if r.key == key and applies(r.releases):
            return r.path
    raise KeyError(f"no READS entry {key!r} for sglang=={release()}")


@functools.cache
def _paths(key: str) -> tuple[tuple[str, ...], ...]:
    """`key`'s locations as attribute chains, the installed release's first (test doubles
    may model another). Cached like `path` (the scheduler reads a request's row every
    step); `forget()` clears both."""
    own = path(key)
    others = dict.fromkeys(r.path for r in READS if r.key == key and r.path != own)
    return tuple(tuple(p.split(".")) for p in (own, *others))


def forget() -> None:
    """Drop the cached locations (after a test changes the release or the tables)."""
    path.cache_clear()
    _paths.cache_clear()


_MISSING = object()


def read(obj, key: str, default=None):
    """The attribute `key` of `READS` on an SGLang object (`default` where it has none)."""
    for names in _paths(key):
        value = obj
        for name in names:
            value = getattr(value, name, _MISSING)
            if value is _MISSING:
                break
        else:
            return value
    return default


def write(obj, key: str, value) -> None:
    """Set the attribute `key` of `READS`: where `obj` has it, the installed release's
    location first; else where the installed release keeps it."""
    for i, names in enumerate(_paths(key)):  # the installed release's location first
        *head, last = names
        target = obj
        for name in head:
            target = getattr(target, name, _MISSING)
            if target is _MISSING:
                break
        else:
            if hasattr(target, last) or i == 0:
                setattr(target, last, value)
                return
    raise AttributeError(f"{type(obj).__name__} has no {path(key)} ({key})")


def req_row(req) -> int | None:
    """A request's row in SGLang's request table (None: it holds none)."""
    return read(req, "req.row")


def req_protected_len(req) -> int:
    """The length of a request's row the prefix cache owns (its match, then its inserts)."""
    return read(req, "req.protected", 0)


def req_salt(req) -> str | None:
    """A request's cache salt where the release keeps it apart from `extra_key` (None:
    no salt, or a release that folds it into `extra_key`)."""
    if not any(r.key == "req.salt" and applies(r.releases) for r in READS):
        return None
    return read(req, "req.salt") or None


def req_prefix_len(req) -> int:
    """The length of a request's prefix (the tokens its next extend does not compute)."""
    prefix = read(req, "req.prefix", 0)
    return prefix if isinstance(prefix, int) else len(prefix)


def set_req_prefix(req, slots) -> None:
    """Make `slots` (its request-table entries) a request's prefix: the slots themselves
    where the release keeps a prefix so (`prefix_slots`), else their number (the slots
    are then read when its row is allocated)."""
    write(req, "req.prefix", slots if has("prefix_slots") else len(slots))
