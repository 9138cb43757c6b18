"""Every place sglang-psa touches SGLang, in one table, for each supported release.

Each hook names the SGLang target, the hook type, the parameters the target must
still have and the releases it applies to; `sglang_psa.releases.READS` names, per
release, where the SGLang attributes whose names moved between releases live.
`check_targets()` resolves every target and attribute of the installed release and
compares signatures, so a SGLang upgrade that moves or changes one fails loudly (at
plugin load and in `test/unit/plugin/test_sglang_plugin.py`) instead of SGLang's
hook registry logging the error and serving without PSA.

A release between or after the supported ones uses the table of the newest supported
release before it; the checks then name whatever it changed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass

from sglang_psa import releases

ALL = releases.SUPPORTED


def _built_for() -> str:
    v = releases.installed_version()
    r = releases.release(v)
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
        "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_extend",
        "after",
        "scheduling:after_prepare_for_extend",
        ("self",),
        "--psa-kv-home tiered: plan the write-back of the blocks an extend completes",
    ),
    Hook(
        "sglang.srt.mem_cache.allocation.alloc_for_decode",
        "around",
        "scheduling:around_alloc_for_decode",
        ("batch", "token_per_req"),
        "--sparse-mode: a decode step's paged KV slots in one launch (mem_cache.decode_alloc)",
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
        "sglang.srt.mem_cache.allocation._prefix_kv_indices",
        "around",
        "scheduling:around_prefix_kv_indices",
        ("batch", "req"),
        "tiered: a retracted request resumes with page 0 for its prefix kept in the host "
        "tier (0.5.23 reads a new row's prefix slots at allocation)",
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
        "around",
        "scheduling:around_abort_request",
        ("self", "recv_req"),
        "a request aborted while it waits is released: a retracted one leaves the "
        "admission controller; tiered: the host blocks a matched or parked one holds return",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler._abort_on_waiting_timeout",
        "around",
        "scheduling:around_abort_on_waiting_timeout",
        ("self",),
        "a request that timed out while it waits is released, as an aborted one (0.5.23 "
        "aborts it: `abort_request`)",
        releases=("0.5.17",),
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler._abort_on_queued_limit",
        "around",
        "scheduling:around_abort_on_queued_limit",
        ("self", "recv_req"),
        "a request refused or pushed out by a full waiting queue is released, as an aborted one",
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
        "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run",
        "around",
        "host_timing:around_get_next_batch_to_run",
        ("self", "running_batch", "last_batch"),
        "SGLANG_PSA_HOST_TIMING=1: the scheduler loop's iteration and its scheduling time",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        "around",
        "host_timing:around_run_batch",
        ("self", "batch"),
        "SGLANG_PSA_HOST_TIMING=1: a forward's host side (launch)",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.process_batch_result",
        "around",
        "host_timing:around_process_batch_result",
        ("self", "batch", "result"),
        "SGLANG_PSA_HOST_TIMING=1: waiting for a batch's results (the GPU) and processing "
        "them (the host)",
    ),
    Hook(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state",
        "after",
        "scheduling:after_get_internal_state",
        ("self", "recv_req"),
        "server info reports PSA's admission counters and KV pages held",
    ),
    Hook(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        "before",
        "validation:before_validate_one_request",
        ("self", "obj", "input_ids"),
        "a prompt of no tokens, or token ids outside the vocabulary, get HTTP 400, not a "
        "crashed scheduler",
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
    # the tiered home's decode check: the tree's unheld prefixes leave HBM first
    Call("sglang.srt.mem_cache.common.evict_from_tree_cache", ("tree_cache", "num_tokens")),
    Call(
        "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator.free_segment",
        ("self", "free_index", "start_pos"),
    ),
)


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


def _check_read(r: releases.Read) -> None:
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
        if releases.applies(hook.releases):
            _check_params(hook.target, _resolve(hook.target), hook.params)
    for call in CALLS:
        if releases.applies(call.releases):
            _check_params(call.target, _resolve(call.target), call.params)
    for r in releases.READS:
        if releases.applies(r.releases):
            _check_read(r)


def hook_function(hook: Hook) -> Callable:
    module, name = hook.fn.split(":")
    return getattr(importlib.import_module(f"sglang_psa.plugin.{module}"), name)


def register_all() -> None:
    """Register every hook with SGLang's HookRegistry (applied by `load_plugins()`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for hook in HOOKS:
        if releases.applies(hook.releases):
            HookRegistry.register(hook.target, hook_function(hook), HookType(hook.kind))
