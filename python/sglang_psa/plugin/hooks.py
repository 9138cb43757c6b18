"""Every place sglang-psa touches SGLang, in one table, for each supported release.

Each hook names the SGLang target, the hook type, the parameters the target must
still have and the releases it applies to; `READS` names, per release, where the
hooks find the SGLang attributes whose names moved between releases.
`check_targets()` resolves every target and attribute of the installed release and
compares signatures, so a SGLang upgrade that moves or changes one fails loudly (at
plugin load and in `test/unit/plugin/test_sglang_plugin.py`) instead of SGLang's
hook registry logging the error and serving without PSA.

A release between or after the supported ones uses the table of the newest supported
release before it; the checks then name whatever it changed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

# The SGLang releases sglang-psa is tested against (pyproject's `serve` extra admits these).
SUPPORTED = ("0.5.17", "0.5.23")
ALL = SUPPORTED


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


def _built_for() -> str:
    v = installed_version()
    r = release(v)
    return f"sglang {v}, checked against the table of sglang=={r}" if v != r else f"sglang=={r}"


class SGLangChanged(RuntimeError):
    """An SGLang internal the plugin relies on is missing or has a different signature."""


@dataclass(frozen=True)
class Hook:
    target: str
    kind: str  # "before" | "after" | "around" | "replace"
    fn: str  # "module:function" in sglang_psa.plugin
    params: tuple[str, ...]  # parameters the target must have, in order
    why: str
    releases: tuple[str, ...] = ALL  # the SGLang releases it applies to


HOOKS: tuple[Hook, ...] = (
    Hook(
        "sglang.srt.server_args.ServerArgs.add_cli_args",
        "after",
        "server_args:after_add_cli_args",
        ("parser",),
        "show and parse --sparse-mode / --psa-*",
    ),
    Hook(
        "sglang.srt.server_args.ServerArgs.from_cli_args",
        "around",
        "server_args:around_from_cli_args",
        ("args",),
        "turn the flags into a PSAConfig and set the SGLang fields PSA needs",
    ),
    Hook(
        "sglang.srt.server_args.ServerArgs.__init__",
        "around",
        "server_args:around_init",
        ("self", "model_path"),
        "sgl.Engine(sparse_mode='psa', psa_threshold=...) keyword arguments",
        releases=("0.5.17",),
    ),
    Hook(
        "sglang.srt.entrypoints.engine.Engine.__init__",
        "around",
        "server_args:around_engine_init",
        ("self", "kwargs"),
        "sgl.Engine(sparse_mode='psa', psa_threshold=...) keyword arguments (ServerArgs is "
        "a msgspec Struct from 0.5.23 on: no hook reaches its constructor)",
        releases=("0.5.23",),
    ),
    Hook(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req",
        "around",
        "scheduling:around_add_one_req",
        ("self", "req", "has_chunked_req", "truncation_align_size"),
        "admit new requests by HBM working set",
    ),
    Hook(
        "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req",
        "around",
        "scheduling:around_add_chunked_req",
        ("self", "req"),
        "tiered: the next chunk of a prompt larger than HBM gets room and fits the pages free",
    ),
    Hook(
        "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info",
        "after",
        "scheduling:after_get_worker_info",
        ("self",),
        "tiered: the longest prompt is bounded by the context and host tier, not HBM",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens",
        "around",
        "scheduling:around_init_req_max_new_tokens",
        ("self", "req"),
        "tiered: a request's output is capped by the host tier, not by the pool in HBM",
    ),
    Hook(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem",
        "around",
        "scheduling:around_check_decode_mem",
        ("self", "selected_indices"),
        "record working sets; retract when they outgrow the slot cache; tiered: give "
        "pages of saved blocks back before the step finds the allocator short",
    ),
    Hook(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator._release_page_ids",
        "around",
        "scheduling:around_release_page_ids",
        ("self", "page_ids"),
        "tiered: entries of given-back blocks point at page 0, which no free may return",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler._apply_war_barrier",
        "around",
        "scheduling:around_apply_war_barrier",
        ("self",),
        "tiered: table rewrites wait for the whole forward (the graph reads them in replay); "
        "from 0.5.23 on the backend declares it (`PSAAttnBackend.shared_read_ends`)",
        releases=("0.5.17",),
    ),
    Hook(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        "after",
        "scheduling:after_prepare_for_extend",
        ("self",),
        "--psa-kv-home tiered: plan the write-back of the blocks an extend completes",
    ),
    Hook(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode",
        "after",
        "scheduling:after_prepare_for_decode",
        ("self",),
        "--psa-kv-home tiered: plan the write-back of blocks decode steps completed",
    ),
    Hook(
        "sglang.srt.mem_cache.common.release_kv_cache",
        "around",
        "scheduling:around_release_kv_cache",
        ("req", "tree_cache", "is_insert"),
        "forget finished requests, pause retracted ones; tiered: a retracted request's "
        "saved blocks stay in the host tier",
        releases=("0.5.17",),
    ),
    Hook(
        "sglang.srt.mem_cache.common.release_kv_cache",
        "around",
        "scheduling:around_release_kv_cache",
        ("req", "tree_cache", "checkpoint"),
        "forget finished requests, pause retracted ones (`checkpoint`, keyword-only, is "
        "0.5.17's `is_insert`)",
        releases=("0.5.23",),
    ),
    Hook(
        "sglang.srt.managers.schedule_batch.Req.init_next_round_input",
        "after",
        "scheduling:after_init_next_round_input",
        ("self", "tree_cache", "cow_mamba"),
        "tiered: a retracted request resumes with its saved blocks as a prefix in the "
        "host tier, not prefilled again",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        "after",
        "scheduling:after_abort_request",
        ("self", "recv_req"),
        "a retracted request aborted while it waits leaves the admission controller",
    ),
    Hook(
        "sglang.srt.managers.utils.validate_input_length",
        "after",
        "scheduling:after_validate_input_length",
        ("req", "max_req_input_len", "allow_auto_truncate"),
        "refuse requests the host pool or slot cache cannot hold (HTTP 400)",
    ),
    Hook(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator._compute_cell_size",
        "after",
        "kv_pool:after_compute_cell_size",
        ("self", "kvc", "num_layers"),
        "count the per-page block metadata in SGLang's HBM budget",
    ),
    Hook(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.calculate_pool_sizes",
        "after",
        "kv_pool:after_calculate_pool_sizes",
        ("self", "available_bytes", "page_size"),
        "--psa-kv-home tiered: the token budget leaves HBM for the host blocks' metadata",
    ),
    Hook(
        "sglang.srt.layers.attention.hybrid_attn_backend.HybridAttnBackend.__init__",
        "after",
        "extend:after_hybrid_init",
        ("self", "model_runner", "prefill_backend", "decode_backend"),
        "the Triton prefill kernels' token addressing on SGLang's token-major pool",
    ),
    Hook(
        "sglang.srt.layers.attention.triton_backend.TritonAttnBackend.forward_extend",
        "around",
        "extend:around_triton_forward_extend",
        ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
        "tiered: a prefill chunk reads a prefix whose blocks left HBM from a staging",
    ),
    Hook(
        "sglang.srt.layers.attention.hybrid_attn_backend.HybridAttnBackend.forward",
        "after",
        "extend:after_hybrid_forward",
        ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache"),
        "block metadata of the pages each prefill extend wrote, per layer",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        "after",
        "scheduling:after_get_internal_state",
        ("self", "recv_req"),
        "server info reports PSA's admission counters and KV pages held",
    ),
)


@dataclass(frozen=True)
class Call:
    """A function the plugin calls (not a hook), with the parameters it must have."""

    target: str
    params: tuple[str, ...]
    releases: tuple[str, ...] = ALL


CALLS: tuple[Call, ...] = (
    # 0.5.17: a function of `choices`; 0.5.23: the choice list's own `extend`
    Call("sglang.srt.server_args.add_attention_backend_choices", ("choices",), ("0.5.17",)),
    Call("sglang.srt.server_args.add_attention_backend_choices", ("iterable",), ("0.5.23",)),
    Call("sglang.srt.layers.attention.attention_registry.register_attention_backend", ("name",)),
    Call(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_segment",
        ("self", "free_index", "start_pos"),
    ),
    # Overridden by `PSAAttnBackend` (0.5.23's write-after-read contract, which replaces
    # the `_apply_war_barrier` hook); the hybrid backend asks its decode backend.
    Call(
        "sglang.srt.layers.attention.base_attn_backend.AttentionBackend.shared_read_ends",
        ("self", "fm"),
        ("0.5.23",),
    ),
    Call(
        "sglang.srt.layers.attention.hybrid_attn_backend.HybridAttnBackend.shared_read_ends",
        ("self", "fm"),
        ("0.5.23",),
    ),
)


@dataclass(frozen=True)
class Read:
    """An SGLang attribute (or parameter) the hooks read or write whose name moved between
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
    # The scheduler's write-after-read fast path (0.5.17; 0.5.23 asks the backend).
    Read(
        "worker.war_runner",
        "sglang.srt.managers.tp_worker.TpModelWorker",
        "war_fastpath_runner",
        ("0.5.17",),
    ),
    Read(
        "runner.war_event",
        "sglang.srt.model_executor.model_runner.ModelRunner",
        "war_fastpath_read_done_event",
        ("0.5.17",),
    ),
    Read(
        "backend.post_replay",
        "sglang.srt.layers.attention.base_attn_backend.SharedReadEnds",
        "POST_REPLAY",
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
    # is kept in step with blocks that left HBM. From 0.5.23 on the row itself is the
    # prefix (`Req.prefix_len`); there a retracted request is prefilled again.
    "prefix_slots": ("0.5.17",),
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


def _paths(key: str) -> list[str]:
    """`key`'s locations, the installed release's first (test doubles may model another)."""
    own = path(key)
    return [own, *dict.fromkeys(r.path for r in READS if r.key == key and r.path != own)]


_MISSING = object()


def read(obj, key: str, default=None):
    """The attribute `key` of `READS` on an SGLang object (`default` where it has none)."""
    for p in _paths(key):
        value = obj
        for name in p.split("."):
            value = getattr(value, name, _MISSING)
            if value is _MISSING:
                break
        else:
            return value
    return default


def write(obj, key: str, value) -> None:
    """Set the attribute `key` of `READS`: where `obj` has it, the installed release's
    location first; else where the installed release keeps it."""
    for p in _paths(key):
        *head, last = p.split(".")
        target = obj
        for name in head:
            target = getattr(target, name, _MISSING)
            if target is _MISSING:
                break
        else:
            if hasattr(target, last) or p == path(key):
                setattr(target, last, value)
                return
    raise AttributeError(f"{type(obj).__name__} has no {path(key)} ({key})")


def _resolve(target: str):
    try:
        return pkgutil.resolve_name(target)
    except ImportError as e:
        if e.name and not e.name.startswith("sglang"):
            raise SGLangChanged(
                f"importing {target} failed: SGLang's dependency {e.name!r} is missing ({e})"
            ) from e
        raise SGLangChanged(
            f"sglang-psa needs {target}, which this SGLang does not have "
            f"(built for {_built_for()}): {e}"
        ) from e
    except (AttributeError, ValueError) as e:
        raise SGLangChanged(
            f"sglang-psa needs {target}, which this SGLang does not have "
            f"(built for {_built_for()}): {e}"
        ) from e


def _parameters(obj) -> list[str]:
    fn = inspect.unwrap(obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj)
    return list(inspect.signature(fn).parameters)


def _check_params(target: str, obj, params: tuple[str, ...]) -> None:
    have = _parameters(obj)
    missing = [p for p in params if p not in have]
    if missing or [p for p in have if p in params] != list(params):
        raise SGLangChanged(
            f"{target} has parameters {have}; sglang-psa expects {list(params)} "
            f"(built for {_built_for()})"
        )


def _defines(cls: type, name: str) -> bool:
    """Whether instances of `cls` have attribute `name`: a class attribute, property or
    field (dataclass, msgspec), or one its methods assign (`self.name = ...`)."""
    if any(name in vars(k) for k in cls.__mro__):
        return True
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        return True
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(:[^=\n]+)?=[^=]")
    for k in cls.__mro__:
        if k.__module__.startswith("sglang"):
            try:
                if assigned.search(inspect.getsource(k)):
                    return True
            except (OSError, TypeError):
                continue
    return False


def _check_read(r: Read) -> None:
    owner = _resolve(r.owner)
    name = r.path.rsplit(".", 1)[-1]
    if inspect.isclass(owner):
        ok, what = _defines(owner, name), f"an attribute {name!r} of {r.owner}"
    else:
        ok, what = name in _parameters(owner), f"a parameter {name!r} of {r.owner}"
    if not ok:
        raise SGLangChanged(
            f"sglang-psa reads {what} ({r.key}), which this SGLang does not have "
            f"(built for {_built_for()})"
        )


def check_targets() -> None:
    """Resolve every hook target, called function and moved attribute of the installed
    release; raise `SGLangChanged` naming the first mismatch."""
    for hook in HOOKS:
        if applies(hook.releases):
            _check_params(hook.target, _resolve(hook.target), hook.params)
    for call in CALLS:
        if applies(call.releases):
            _check_params(call.target, _resolve(call.target), call.params)
    for r in READS:
        if applies(r.releases):
            _check_read(r)


def hook_function(hook: Hook) -> Callable:
    module, name = hook.fn.split(":")
    return getattr(importlib.import_module(f"sglang_psa.plugin.{module}"), name)


def register_all() -> None:
    """Register every hook with SGLang's HookRegistry (applied by `load_plugins()`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        if applies(hook.releases):
            HookRegistry.register(hook.target, hook_function(hook), HookType(hook.kind))


def req_row(req) -> int | None:
    """A request's row in SGLang's request table (None: it holds none)."""
    return read(req, "req.row")


def req_prefix_len(req) -> int:
    """The length of a request's prefix (the tokens its next extend does not compute)."""
    prefix = read(req, "req.prefix", 0)
    return prefix if isinstance(prefix, int) else len(prefix)
