"""A transformers attention function that runs decode steps through `sglang_psa.algo`.

It is registered in transformers' own attention registry (`AttentionInterface`)
under the name `psa`, so any causal LM that dispatches through that registry
uses it without a line of model code changing. Prefill (more than one query
token) is dense, via transformers' registered `sdpa`; a single-token decode
step runs the reference dense, PSA or top-k attention chosen by the active
`DecodePolicy`, and records which KV blocks each layer read: counts always,
the full per-block read masks only when `runtime().trace` is a list (opt-in).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from sglang_psa.algo import (
    BlockMetaCache,
    num_blocks,
    oracle_attention,
    progressive_attention,
    topk_attention,
)
from sglang_psa.config import PSAConfig

ATTN_NAME = "psa"


@dataclass(frozen=True)
class DecodePolicy:
    """Which decode attention to run: `dense`, `psa` (cfg.threshold / stop_rule), `topk`, or
    `oracle` (blocks by true mass: the analysis lower bound, not deployable)."""

    kind: str = "dense"
    cfg: PSAConfig = field(default_factory=PSAConfig)
    budget_tokens: int | None = None  # top-k only; default cfg.topk_tokens

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "psa", "topk", "oracle"):
            raise ValueError(f"unknown decode policy {self.kind!r} (dense|psa|topk|oracle)")

    @property
    def label(self) -> str:
        if self.kind == "psa":
            return f"psa-{self.cfg.stop_rule}-{self.cfg.threshold:g}"
        if self.kind == "oracle":
            return f"oracle-{self.cfg.threshold:g}"
        if self.kind == "topk":
            return f"topk-{self.cfg.score}-{self.budget_tokens or self.cfg.topk_tokens}"
        return "dense"


@dataclass
class LayerReads:
    """Per decode step and (request, KV head): blocks read and blocks available."""

    read: list[torch.Tensor] = field(default_factory=list)
    total: list[torch.Tensor] = field(default_factory=list)

    def fractions(self) -> torch.Tensor:
        if not self.read:
            return torch.zeros(0)
        return torch.cat(self.read).float() / torch.cat(self.total).float()


class BlockTrace(NamedTuple):
    """One sparse decode call of one layer: which blocks were read."""

    layer: int
    read: torch.Tensor  # [B, Hkv, NB] bool (CPU); NB may exceed n_blocks (metadata capacity)
    n_blocks: torch.Tensor  # [B] int64 (CPU): blocks holding tokens; the last is the tail


class PSARuntime:
    """State of the `psa` attention function: active policy, metadata caches, read stats.

    `trace` is opt-in: None (the default) records nothing beyond the read counts;
    a list receives one `BlockTrace` per psa/topk/oracle decode call, in call order
    (layer 0..L-1 of step 0, then of step 1, ...). `reset()` leaves it alone: the
    caller owns the list and sets `trace = None` to stop.
    """

    def __init__(self) -> None:
        self.policy = DecodePolicy()
        self.meta: dict[int, BlockMetaCache] = {}
        self.reads: dict[int, LayerReads] = defaultdict(LayerReads)
        self.trace: list[BlockTrace] | None = None

    def reset(self) -> None:
        """Forget metadata and stats (not `trace`); call before a new or rewound sequence."""
        self.meta.clear()
        self.reads.clear()

    @contextlib.contextmanager
    def use(self, policy: DecodePolicy) -> Iterator[PSARuntime]:
        old, self.policy = self.policy, policy
        try:
            yield self
        finally:
            self.policy = old

    def layer_fractions(self) -> dict[int, torch.Tensor]:
        return {layer: r.fractions() for layer, r in sorted(self.reads.items())}

    def _meta_for(self, layer: int, key: torch.Tensor, block_size: int) -> BlockMetaCache:
        B, H, T, d = key.shape
        cache = self.meta.get(layer)
        stale = (
            cache is None
            or cache.block_size != block_size
            or cache.ksum.shape[0] != B
            or int(cache.lengths.max()) > T
        )
        if stale:
            capacity = -(-T // block_size)
            cache = BlockMetaCache.empty(B, H, d, block_size, capacity, device=key.device)
            self.meta[layer] = cache
        start = int(cache.lengths.max())
        if start < T:
            n = torch.full((B,), T - start, dtype=torch.int64, device=key.device)
            cache.append(key[:, :, start:], n)
        return cache

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs,
    ):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        policy = self.policy
        if query.shape[2] != 1 or policy.kind == "dense":
            if query.shape[2] == 1:
                self._record_dense(module, key)
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                scaling=scaling,
                dropout=dropout,
                **kwargs,
            )
        _check_unpadded(attention_mask)
        if getattr(module, "sliding_window", None):
            raise NotImplementedError("PSA decode does not support sliding-window layers yet")
        B, Hq, _, d = query.shape
        q = query[:, :, 0]
        lengths = torch.full((B,), key.shape[2], dtype=torch.int64, device=key.device)
        cfg = policy.cfg
        meta = self._meta_for(module.layer_idx, key, cfg.block_size).meta()
        if policy.kind == "psa":
            res = progressive_attention(q, key, value, lengths, cfg, meta=meta, scale=scaling)
        elif policy.kind == "oracle":
            res = oracle_attention(q, key, value, lengths, cfg, scale=scaling)
        else:
            res = topk_attention(
                q, key, value, lengths, cfg, policy.budget_tokens, meta=meta, scale=scaling
            )
        nblk = num_blocks(lengths, cfg.block_size)
        self._record(
            module.layer_idx, res.read.sum(-1).flatten(), nblk.repeat_interleave(res.read.shape[1])
        )
        if self.trace is not None:
            self.trace.append(BlockTrace(module.layer_idx, res.read.cpu(), nblk.cpu()))
        return res.out.unsqueeze(1).contiguous(), None

    def _record(self, layer: int, read: torch.Tensor, total: torch.Tensor) -> None:
        r = self.reads[layer]
        r.read.append(read.cpu())
        r.total.append(total.cpu())

    def _record_dense(self, module: torch.nn.Module, key: torch.Tensor) -> None:
        B, H, T, _ = key.shape
        nb = num_blocks(torch.tensor(T), self.policy.cfg.block_size)
        n = torch.full((B * H,), int(nb))
        self._record(module.layer_idx, n, n)


def _check_unpadded(mask: torch.Tensor | None) -> None:
    if mask is None:
        return
    visible = mask if mask.dtype == torch.bool else mask == 0
    if not bool(visible.all()):
        raise NotImplementedError(
            "PSA decode in the transformers hook supports unpadded sequences only "
            "(batch of 1, or equal lengths with no attention-mask padding)"
        )


_RUNTIME: PSARuntime | None = None


def runtime() -> PSARuntime:
    """The process-wide runtime behind the registered `psa` attention function."""
    install()
    assert _RUNTIME is not None
    return _RUNTIME


def install() -> None:
    """Register `psa` in transformers' attention and attention-mask registries (idempotent)."""
    global _RUNTIME
    if _RUNTIME is not None:
        return
    from transformers import AttentionInterface, AttentionMaskInterface

    _RUNTIME = PSARuntime()
    AttentionInterface.register(ATTN_NAME, _RUNTIME)
    # Same mask as sdpa: prefill runs through sdpa, decode only checks "no padding".
    AttentionMaskInterface.register(ATTN_NAME, AttentionMaskInterface._global_mapping["sdpa"])
