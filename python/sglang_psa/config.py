"""Every knob of sglang-psa in one dataclass, validated so a bad value names its field.

The CLI flags (`--sparse-mode`, `--psa-*`) are derived from these fields, so the
server, the CPU demo and the benchmarks share one definition and one set of
error messages.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

SPARSE_MODES = ("none", "psa", "topk")
STOP_RULES = ("heuristic", "certified")
SCORE_METHODS = ("mean", "bound")
KV_HOMES = ("hbm", "tiered")
WRITEBACKS = ("engine", "uva")

# Fields whose CLI flag is not simply `--psa-<field>`.
_FLAG_OVERRIDES = {"sparse_mode": "--sparse-mode"}


class PSAConfigError(ValueError):
    """A knob has an invalid value; `field` names it, `flag` is its CLI spelling."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.flag = flag_name(field_name)
        super().__init__(f"{self.flag} ({field_name}): {message}")


def flag_name(field_name: str) -> str:
    return _FLAG_OVERRIDES.get(field_name, "--psa-" + field_name.replace("_", "-"))


@dataclass(frozen=True)
class PSAConfig:
    """Configuration of sparse decode attention and the tiered KV store.

    Attention: blocks of `block_size` tokens are ranked by criticality (`score`);
    the `sink_blocks` first and `recent_blocks` last blocks are always attended;
    the rest are attended in waves (first `wave_blocks`, or with `wave_fraction` that
    fraction of the request's blocks between `wave_blocks` and `max_first_wave_blocks`;
    then from `later_wave_blocks` (0: the first wave's size), growing by `wave_growth` up
    to `max_wave_blocks`) until the covered softmax mass
    passes `threshold` under `stop_rule`. `topk` mode attends a fixed `topk_tokens` budget instead.
    """

    sparse_mode: str = "psa"
    # The default policy (ε 0.98, 8-bit key bounds, a first wave of 1/4 of the blocks up
    # to 128, a KV head reading at most half its request's blocks): the policy suite's
    # choice at dense's accuracy, against the smallest top-k budget of the same quality
    # and tighter caps (benchmark/results/adaptive_budget.json).
    threshold: float = 0.98
    stop_rule: str = "heuristic"
    # Quest's bound ranks long-context answers well where mean keys do not, and a first
    # wave of 16 blocks acts as a floor (benchmark/results/archive/defaults_cpu_{8k,16k}.json).
    score: str = "bound"
    block_size: int = 32
    sink_blocks: int = 1
    recent_blocks: int = 1
    wave_blocks: int = 16
    wave_growth: float = 1.25
    max_wave_blocks: int = 128
    # A first wave that grows with the context: this fraction of a request's blocks (0:
    # always `wave_blocks`), between `wave_blocks` and `max_first_wave_blocks`. A fixed
    # first wave is a large share of a 4K context but a small one of a 32K one, where heads
    # stop too early (benchmark/results/archive/adaptive_probe_long.json); a cap of 64
    # blocks left misses at 16K-32K that a 4096-token top-k did not have.
    wave_fraction: float = 0.25
    max_first_wave_blocks: int = 128
    # The waves after the first start at this many blocks (0: as large as the first wave).
    # The stop rule is checked after every wave, so smaller later waves read less past
    # the point where it holds.
    later_wave_blocks: int = 0
    # PSA, heuristic rule, ε < 1: a (request, KV head) reads at most this fraction of the
    # request's blocks (never fewer than the forced ones), whatever the rule says (1: no
    # cap; the certified rule is never capped, ε = 1 is dense). A diffuse head
    # never meets the rule and would read everything; its output is an average that half
    # of its best-ranked blocks already gives.
    max_read_fraction: float = 0.5
    topk_tokens: int = 2048
    # Decode ranks blocks every this many steps and reads in the kept order between
    # (blocks a request gained since are read with the forced ones): scoring and ranking
    # cost a step a fixed price per layer whatever it reads (LServe reuses a selection
    # across queries likewise). 1: rank every step. psa's stop rule runs on the ranking
    # steps only; the steps between read as many ranked blocks as it read then, per
    # layer and KV head, in one wave (the rule over a stale order read about twice the
    # blocks: psa_r8 in benchmark/results/serving_h100.json). The certified rule ranks
    # every step.
    rerank_interval: int = 8
    # Key bounds kept per block in 16 bits (the KV dtype) or as 8-bit codes with a scale
    # per block and KV head: half the metadata bytes decode reads for every block.
    bound_bits: int = 8
    # The certified rule's key codes: each key kept as a cell of its block's per-channel
    # range, this many bits a channel, beside the page (`mem_cache.page_codes`); the
    # ranking and the rule's bound on the unread mass come from them, far tighter than the
    # block's min/max bound (benchmark/results/adaptive_budget.json: certified policies).
    code_bits: int = 5
    # Tiered store.
    # HBM for working sets: an admission cap at hbm home.
    gpu_cache_gb: float | None = None
    host_pool_gb: float = 32.0  # the tiered home's host tier
    # Where the KV lives: hbm (SGLang's pool); tiered (that pool, and every full block
    # written back to a pinned host tier of host_pool_gb; cold blocks leave HBM).
    kv_home: str = "hbm"
    # Tiered home: how blocks reach the host tier (engine: D2H copy + copy-engine scatter;
    # uva: a kernel writes them through unified addressing).
    writeback: str = "uva"
    # Tiered home: full blocks are written back to the host tier once less than this
    # fraction of SGLang's KV pool is free (neither held by a request nor cached by its
    # tree), and from then on; until then the KV lives in HBM alone, as at the hbm home,
    # and the write-back costs nothing (1: from the first block; a prompt larger than
    # HBM starts it at once).
    writeback_start: float = 1.0
    # Tiered home, while blocks are evicted: a resident block that fewer than this
    # fraction of its (layer, KV head) units read lately also leaves HBM, its page
    # becoming unit-cache slots for the units decode does read (0: blocks leave HBM
    # only when SGLang needs pages).
    cold_fraction: float = 0.125
    # Tiered home: pages per set of the unit cache, each a position for every (layer, KV
    # head) (a host unit may live only in its set's positions; a set with more units read
    # than positions reads the rest from the host tier every step while they stay hot).
    unit_cache_ways: int = 8
    # Tiered home with SGLang's tree on (`--radix-cache-backend psa`): a matched prefix
    # that goes on in the host tier for at least this many tokens is read from there (a
    # staged prefill, then decode reads those blocks from the host tier); a shorter run is
    # computed again. At 512, on the H200 with the 0.5B model: computing 512 tokens takes
    # about 25 ms, staging an extend batch for one or two blocks 49 ms against 28.
    host_prefix_min_tokens: int = 512
    # Scheduler.
    ws_window: int = 12
    max_inject_tokens: int = 8192
    # Diagnosis: every decode step also scores every key of every request (a dense pass
    # per layer) and keeps the smallest share of a query head's true softmax mass that
    # the blocks it read held (server info `coverage_audit`): the stop rule's guarantee
    # checked in the server. Slow; the keys are read from SGLang's pool (hbm home only).
    audit_coverage: bool = False
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, msg: str) -> None:
            if not cond:
                raise PSAConfigError(name, f"{msg}, got {getattr(self, name)!r}")

        need(self.sparse_mode in SPARSE_MODES, "sparse_mode", f"must be one of {SPARSE_MODES}")
        need(self.stop_rule in STOP_RULES, "stop_rule", f"must be one of {STOP_RULES}")
        need(self.score in SCORE_METHODS, "score", f"must be one of {SCORE_METHODS}")
        need(self.kv_home in KV_HOMES, "kv_home", f"must be one of {KV_HOMES}")
        need(self.writeback in WRITEBACKS, "writeback", f"must be one of {WRITEBACKS}")
        need(isinstance(self.audit_coverage, bool), "audit_coverage", "must be true or false")
        need(
            not (self.audit_coverage and self.kv_home == "tiered"),
            "audit_coverage",
            "reads every key from SGLang's pool: --psa-kv-home hbm only",
        )
        need(
            isinstance(self.threshold, (int, float))
            and math.isfinite(self.threshold)
            and 0.0 < self.threshold <= 1.0,
            "threshold",
            "must be in (0, 1]",
        )
        for name in (
            "block_size",
            "wave_blocks",
            "max_wave_blocks",
            "max_first_wave_blocks",
            "topk_tokens",
            "ws_window",
            "max_inject_tokens",
            "rerank_interval",
        ):
            need(
                _is_int(getattr(self, name)) and getattr(self, name) >= 1,
                name,
                "must be a positive integer",
            )
        need(self.block_size & (self.block_size - 1) == 0, "block_size", "must be a power of two")
        need(self.bound_bits in (8, 16), "bound_bits", "must be 8 or 16")
        need(_is_int(self.code_bits) and 1 <= self.code_bits <= 8, "code_bits", "must be 1 to 8")
        for name in ("sink_blocks", "recent_blocks", "later_wave_blocks"):
            need(
                _is_int(getattr(self, name)) and getattr(self, name) >= 0,
                name,
                "must be a non-negative integer",
            )
        need(
            self.recent_blocks >= 1,
            "recent_blocks",
            "must be >= 1 (the tail block holds the newest tokens and is always attended)",
        )
        need(
            self.max_wave_blocks >= self.wave_blocks,
            "max_wave_blocks",
            f"must be >= wave_blocks ({self.wave_blocks})",
        )
        need(
            isinstance(self.wave_fraction, (int, float)) and 0.0 <= self.wave_fraction <= 1.0,
            "wave_fraction",
            "must be in [0, 1]",
        )
        need(
            not self.wave_fraction or self.max_first_wave_blocks >= self.wave_blocks,
            "max_first_wave_blocks",
            f"must be >= wave_blocks ({self.wave_blocks}) with a wave fraction",
        )
        need(
            isinstance(self.max_read_fraction, (int, float))
            and 0.0 < self.max_read_fraction <= 1.0,
            "max_read_fraction",
            "must be in (0, 1]",
        )
        need(
            isinstance(self.wave_growth, (int, float)) and self.wave_growth >= 1.0,
            "wave_growth",
            "must be >= 1.0",
        )
        need(
            self.gpu_cache_gb is None
            or (isinstance(self.gpu_cache_gb, (int, float)) and self.gpu_cache_gb > 0),
            "gpu_cache_gb",
            "must be positive (or unset to size from free memory)",
        )
        need(
            isinstance(self.cold_fraction, (int, float)) and 0.0 <= self.cold_fraction <= 1.0,
            "cold_fraction",
            "must be in [0, 1]",
        )
        need(
            isinstance(self.writeback_start, (int, float)) and 0.0 < self.writeback_start <= 1.0,
            "writeback_start",
            "must be in (0, 1]",
        )
        need(
            _is_int(self.unit_cache_ways) and 1 <= self.unit_cache_ways <= 64,
            "unit_cache_ways",
            "must be an integer in [1, 64]",
        )
        need(
            _is_int(self.host_prefix_min_tokens) and self.host_prefix_min_tokens >= 0,
            "host_prefix_min_tokens",
            "must be an integer >= 0",
        )
        need(
            isinstance(self.host_pool_gb, (int, float)) and self.host_pool_gb > 0,
            "host_pool_gb",
            "must be positive",
        )
        need(
            self.topk_tokens >= self.block_size * (self.sink_blocks + self.recent_blocks),
            "topk_tokens",
            f"must cover the always-attended sink+recent blocks "
            f"({(self.sink_blocks + self.recent_blocks) * self.block_size} tokens)",
        )

    @property
    def needs_key_bounds(self) -> bool:
        """Blocks keep per-channel key min/max (bound ranking or the certified rule)."""
        return self.stop_rule == "certified" or self.score == "bound"

    @property
    def needs_key_codes(self) -> bool:
        """Pages keep their keys' codes (`code_bits`): psa's certified rule below ε = 1."""
        return self.sparse_mode == "psa" and self.stop_rule == "certified" and self.threshold < 1

    @property
    def keeps_selection(self) -> bool:
        """Decode keeps its block selection across steps (`rerank_interval`): top-k, and
        psa under the heuristic rule with ε < 1 (the certified rule's guarantee needs a
        fresh ranking; ε = 1 reads every block in block order)."""
        if self.rerank_interval <= 1:
            return False
        return self.sparse_mode == "topk" or (
            self.stop_rule == "heuristic" and self.threshold < 1.0
        )

    @property
    def needs_key_mean(self) -> bool:
        """Blocks keep their mean key (only the mean score reads it)."""
        return self.score == "mean"

    def replace(self, **changes: Any) -> PSAConfig:
        return dataclasses.replace(self, **changes)

    def first_wave(self, context_blocks: int) -> int:
        """Blocks of the first wave of a request of `context_blocks` blocks."""
        if not self.wave_fraction:
            return self.wave_blocks
        grown = int(context_blocks * self.wave_fraction)
        return min(max(grown, self.wave_blocks), self.max_first_wave_blocks)

    def wave_sizes(self, n_blocks: int, first: int | None = None) -> list[int]:
        """Sizes of the successive waves over `n_blocks` ranked blocks, from a first wave
        of `first` blocks (default `wave_blocks`): `wave_schedule`."""
        first = self.wave_blocks if first is None else first
        return wave_schedule(
            n_blocks,
            first,
            self.later_wave_blocks,
            self.wave_growth,
            self.max_wave_blocks,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]


def wave_schedule(n_blocks: int, first: int, later: int, growth: float, cap: int) -> list[int]:
    """Wave sizes over `n_blocks` ranked blocks: `first`, then from `later` (0: `first`)
    each `growth` times the one before, up to `max(cap, first)` (a later wave starting at
    `first` is never smaller than it); the last wave takes what is left."""
    top = float(max(cap, first))
    sizes, size, left = [], float(first), n_blocks
    while left > 0:
        m = min(int(size), left)
        sizes.append(m)
        left -= m
        size = min(size * growth, top) if len(sizes) > 1 or not later else float(later)
    return sizes


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
