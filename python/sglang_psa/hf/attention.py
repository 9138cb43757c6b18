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
    BlockMeta,
    BlockMetaCache,
    bound_codes,
    num_blocks,
    oracle_attention,
    progressive_attention,
    topk_attention,
)
from sglang_psa.config import PSAConfig

ATTN_NAME = "psa"
# Labels name a growing first wave's cap when it is not this one (the first such policies'),
# so that stored results keep their labels when the default changes.
LABEL_FIRST_WAVE_CAP = 64


@dataclass(frozen=True)
class DecodePolicy:
    """Which decode attention to run: `dense`, `psa` (cfg.threshold / stop_rule), `topk`, or
    `oracle` (blocks by true mass: the analysis lower bound, not deployable)."""

    kind: str = "dense"
    cfg: PSAConfig = field(default_factory=PSAConfig)
    budget_tokens: int | None = None  # top-k only; default cfg.topk_tokens
    cap_tokens: int | None = None  # psa only: read at most this many tokens' blocks
    tag: str = ""  # appended to the label: what else differs from the defaults
    # psa, certified rule: bound the unread mass from per-token key codes of this many
    # bits (`progressive_attention(code_bits=)`; kernel rows: `WaveAttention.run(
    # code_planes=)`).
    code_bits: int = 0
    # The server's selection kept across steps (`cfg.rerank_interval`, `cfg.keeps_selection`):
    # blocks are ranked every `rerank_interval` decode calls of a layer and read in the
    # kept order between, psa at the ranked read count its rule took then. Off: every
    # step ranks (what the suites measured). One policy at a time (`Session.decode`).
    keep_selection: bool = False

    def __post_init__(self) -> None:
        if self.kind not in ("dense", "psa", "topk", "oracle"):
            raise ValueError(f"unknown decode policy {self.kind!r} (dense|psa|topk|oracle)")
        if self.cap_tokens is not None and self.kind != "psa":
            raise ValueError("cap_tokens applies to psa policies only")
        if self.code_bits and (self.kind != "psa" or self.cfg.stop_rule != "certified"):
            raise ValueError("code_bits apply to psa policies with the certified rule only")
        if not 0 <= self.code_bits <= 8:
            raise ValueError(f"code_bits must be in [0, 8], got {self.code_bits}")
        if self.keep_selection and not (self.kind in ("psa", "topk") and self.cfg.keeps_selection):
            raise ValueError(
                "keep_selection applies to top-k and psa's heuristic rule with ε < 1 and a "
                f"rerank interval above 1 (kind {self.kind!r}, interval {self.cfg.rerank_interval})"
            )

    @property
    def label(self) -> str:
        suffix = f"-cap{self.cap_tokens}" if self.cap_tokens else ""
        suffix += "-q8" if self.cfg.bound_bits == 8 else ""
        if self.kind == "psa" and self.cfg.wave_fraction:
            suffix += f"-wf{1 / self.cfg.wave_fraction:g}"
            if self.cfg.max_first_wave_blocks != LABEL_FIRST_WAVE_CAP:
                suffix += f"-fw{self.cfg.max_first_wave_blocks}"
        if self.kind == "psa" and self.cfg.later_wave_blocks:
            suffix += f"-lw{self.cfg.later_wave_blocks}"
        capped = self.cfg.stop_rule == "heuristic" and self.cfg.max_read_fraction < 1
        if self.kind == "psa" and capped:  # the only rule the cap applies to
            suffix += f"-mr{self.cfg.max_read_fraction:g}"
        if self.code_bits:
            suffix += f"-c{self.code_bits}"
        if self.keep_selection:
            suffix += f"-kept{self.cfg.rerank_interval}"
        suffix += self.tag
        if self.kind == "psa":
            return f"psa-{self.cfg.stop_rule}-{self.cfg.threshold:g}{suffix}"
        if self.kind == "oracle":
            return f"oracle-{self.cfg.threshold:g}{suffix}"
        if self.kind == "topk":
            return f"topk-{self.cfg.score}-{self.budget_tokens or self.cfg.topk_tokens}{suffix}"
        return "dense" + suffix

    @property
    def group(self) -> tuple:
        """Policies with equal groups run as one batched call with per-row ε, cap or
        budget (`PSARuntime.use_rows`)."""
        if self.kind == "psa":
            return ("psa", self.cfg.replace(threshold=1.0), self.code_bits)
        if self.kind == "topk":
            return ("topk", self.cfg.replace(topk_tokens=self.cfg.block_size * 64))
        if self.kind == "oracle":
            return ("oracle", self.cfg)
        return ("dense",)


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
        # Block summaries per (layer, block size) and the tokens they cover.
        self.meta: dict[tuple[int, int], BlockMetaCache] = {}
        self.meta_tokens: dict[tuple[int, int], int] = {}
        self.reads: dict[int, LayerReads] = defaultdict(LayerReads)
        self.trace: list[BlockTrace] | None = None
        self.rows: list[RowGroup] | None = None  # `use_rows`: a policy per batch row
        self.kernel_rows: KernelRows | None = None
        self.row_fraction_sum: torch.Tensor | None = None  # [B]: Σ over calls
        self.row_calls = 0
        # A selection kept across decode steps (`cfg.keeps_selection`), per layer: the
        # decode calls so far and the last ranking's (order, blocks then, psa's budget).
        self.kept_calls: dict[int, int] = defaultdict(int)
        self.kept: dict[int, tuple] = {}

    def reset(self) -> None:
        """Forget metadata, kept selections and stats (not `trace`); call before a new or
        rewound sequence."""
        self.meta.clear()
        self.meta_tokens.clear()
        self.reads.clear()
        self.kept_calls.clear()
        self.kept.clear()
        self.row_fraction_sum, self.row_calls = None, 0

    def _prior(self, layer: int, cfg: PSAConfig, nb: int, B: int):
        """The kept selection a decode call of `layer` reads, or None where it ranks: as
        the server's `SelectionCache` decides (every `rerank_interval` calls, the first
        included, or when the blocks shrank or grew by more than `MAX_NEW_BLOCKS`)."""
        from sglang_psa.algo.selection import MAX_NEW_BLOCKS

        n = self.kept_calls[layer]
        self.kept_calls[layer] = n + 1
        kept = self.kept.get(layer)
        if kept is None or n % cfg.rerank_interval == 0 or kept[0].shape[0] != B:
            return None
        blocks = int(kept[1][0])
        if nb < blocks or nb - blocks > MAX_NEW_BLOCKS:
            return None
        order = kept[0]
        if order.shape[-1] < nb:  # as wide as this call's summaries (the rest is unread)
            more = torch.arange(order.shape[-1], nb, device=order.device, dtype=order.dtype)
            order = torch.cat([order, more.expand(*order.shape[:-1], -1)], -1)
        return (order, *kept[1:])

    def _rank(self, layer, q, meta, lengths, cfg, scale) -> torch.Tensor:
        """A ranking call of a kept selection: its order kept for the calls to come."""
        from sglang_psa.algo import as_kept
        from sglang_psa.algo.attention import _default_scale, read_order

        order, n_forced = read_order(q, as_kept(meta, cfg), lengths, cfg, _default_scale(q, scale))
        self.kept[layer] = (order, num_blocks(lengths, cfg.block_size))
        return n_forced

    @contextlib.contextmanager
    def use(self, policy: DecodePolicy) -> Iterator[PSARuntime]:
        old, self.policy = self.policy, policy
        try:
            yield self
        finally:
            self.policy = old

    @contextlib.contextmanager
    def use_rows(self, policies: list[DecodePolicy], kernels: bool = False) -> Iterator[PSARuntime]:
        """Batch row `i` decodes under `policies[i]`: every row must hold the same number
        of tokens (one context, repeated). Consecutive policies of one `group` run as one
        call per layer, which is what makes a suite of policies affordable. With
        `kernels` (CUDA) the sparse rows run the server's Triton kernels instead of the
        PyTorch reference (`KernelRows`)."""
        if any(p.keep_selection for p in policies):
            raise ValueError("use_rows: a kept selection (keep_selection) decodes alone")
        old = self.rows, self.kernel_rows
        self.rows = _row_groups(policies)
        self.kernel_rows = KernelRows() if kernels else None
        try:
            yield self
        finally:
            self.rows, self.kernel_rows = old

    def row_fractions(self) -> list[float]:
        """Per row of `use_rows`: mean fraction of KV blocks read over layers, steps and KV
        heads since `reset`."""
        if self.row_fraction_sum is None:
            return []
        return (self.row_fraction_sum / self.row_calls).tolist()

    def layer_fractions(self) -> dict[int, torch.Tensor]:
        return {layer: r.fractions() for layer, r in sorted(self.reads.items())}

    def _meta_for(self, layer: int, key: torch.Tensor, block_size: int) -> BlockMetaCache:
        """The layer's block summaries at `block_size`, brought up to `key`'s length
        (every row holds the same tokens: the hook refuses padding). Policies of several
        block sizes in one batch keep one cache each."""
        B, H, T, d = key.shape
        at = (layer, block_size)
        cache = self.meta.get(at)
        if cache is None or cache.ksum.shape[0] != B or self.meta_tokens[at] > T:
            capacity = -(-T // block_size)
            cache = BlockMetaCache.empty(B, H, d, block_size, capacity, device=key.device)
            self.meta[at], self.meta_tokens[at] = cache, 0
        done = self.meta_tokens[at]
        if done < T:
            cache.append_uniform(key[:, :, done:], done)
            self.meta_tokens[at] = T
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
        if query.shape[2] != 1 or (self.rows is None and policy.kind == "dense"):
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
        if self.rows is not None:
            return self._call_rows(module, query, key, value, attention_mask, scaling, kwargs)
        B, Hq, _, d = query.shape
        q = query[:, :, 0]
        lengths = torch.full((B,), key.shape[2], dtype=torch.int64, device=key.device)
        nb = -(-key.shape[2] // policy.cfg.block_size)
        cfg = policy.cfg
        meta = self._meta_for(module.layer_idx, key, cfg.block_size).meta(nb)
        layer = module.layer_idx
        keeps = policy.keep_selection
        prior = self._prior(layer, cfg, nb, B) if keeps else None
        n_forced = None
        if keeps and prior is None:  # ranks now: the order is kept for the calls between
            n_forced = self._rank(layer, q, meta, lengths, cfg, scaling)
            prior = self.kept[layer]  # read as kept it is the fresh order: not ranked twice
        if policy.kind == "psa":
            cap = None
            if policy.cap_tokens:
                cap = torch.full((B,), policy.cap_tokens, dtype=torch.int64, device=key.device)
            res = progressive_attention(
                q,
                key,
                value,
                lengths,
                cfg,
                meta=meta,
                scale=scaling,
                cap_tokens=cap,
                code_bits=policy.code_bits,
                prior=prior,
            )
            if n_forced is not None:  # the ranked blocks the rule read: the steps between's
                order, blocks = self.kept[layer]
                budget = res.read.sum(-1) - n_forced[:, None]
                self.kept[layer] = (order, blocks, budget)
        elif policy.kind == "oracle":
            res = oracle_attention(q, key, value, lengths, cfg, scale=scaling)
        else:
            res = topk_attention(
                q, key, value, lengths, cfg, policy.budget_tokens, meta=meta, scale=scaling,
                prior=None if prior is None else prior[:2],
            )  # fmt: skip
        nblk = num_blocks(lengths, cfg.block_size)
        self._record(
            module.layer_idx, res.read.sum(-1).flatten(), nblk.repeat_interleave(res.read.shape[1])
        )
        if self.trace is not None:
            self.trace.append(BlockTrace(module.layer_idx, res.read.cpu(), nblk.cpu()))
        return res.out.unsqueeze(1).contiguous(), None

    def _call_rows(self, module, query, key, value, attention_mask, scaling, kwargs):
        """One decode step where each row group runs its own policy (see `use_rows`)."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        B, Hq, _, d = query.shape
        if self.rows[-1].stop != B:
            raise ValueError(f"use_rows: {self.rows[-1].stop} policies for a batch of {B}")
        T = key.shape[2]
        out = query.new_empty(B, 1, Hq, d)
        fraction = torch.ones(B, device=query.device)
        metas: dict[int, BlockMeta] = {}  # by block size, made once per layer call
        codes: dict[int, BlockMeta] = {}  # the same with 8-bit bounds (kernel rows)
        for g in self.rows:
            rows = slice(g.start, g.stop)
            p = g.policies[0]
            cfg = p.cfg
            if p.kind == "dense":
                mask = attention_mask[rows] if attention_mask is not None else None
                out[rows] = sdpa_attention_forward(
                    module, query[rows], key[rows], value[rows], mask, scaling=scaling, **kwargs
                )[0]
                continue
            bs = cfg.block_size
            if bs not in metas:
                metas[bs] = self._meta_for(module.layer_idx, key, bs).meta(-(-T // bs))
            meta, nblk = metas[bs], -(-T // bs)
            if self.kernel_rows is not None and p.kind in ("psa", "topk"):
                kscale = key_codes = None
                if p.code_bits:  # every row of a group shares its policy's code bits
                    group_meta = BlockMeta(*(t[rows] for t in meta))
                    key_codes = KernelRows.key_codes(key[rows], group_meta, cfg, p.code_bits)
                if cfg.bound_bits == 8:
                    if bs not in codes:
                        codes[bs] = KernelRows.codes(meta)
                    meta, kscale = codes[bs]
                for i, policy in enumerate(g.policies, g.start):
                    one = slice(i, i + 1)
                    res, n_read = self.kernel_rows.run(
                        i,
                        policy,
                        query[one, :, 0],
                        key[one],
                        value[one],
                        BlockMeta(*(t[one] for t in meta)),
                        scaling,
                        None if kscale is None else kscale[one],
                        None
                        if key_codes is None
                        else tuple(t[i - g.start : i - g.start + 1] for t in key_codes),
                    )
                    out[one, 0] = res
                    fraction[one] = n_read.float().mean(-1) / nblk
                continue
            n = g.stop - g.start
            lengths = torch.full((n,), T, dtype=torch.int64, device=key.device)
            m = BlockMeta(*(t[rows] for t in meta))  # 8-bit bounds: read back by algo
            q = query[rows, :, 0]
            k, v = key[rows], value[rows]
            if p.kind == "psa":
                res = progressive_attention(
                    q,
                    k,
                    v,
                    lengths,
                    cfg,
                    meta=m,
                    scale=scaling,
                    threshold=g.on(q.device, "threshold"),
                    cap_tokens=g.on(q.device, "cap"),
                    code_bits=p.code_bits,
                )
            elif p.kind == "topk":
                res = topk_attention(
                    q, k, v, lengths, cfg, g.on(q.device, "budget"), meta=m, scale=scaling
                )
            else:
                res = oracle_attention(q, k, v, lengths, cfg, scale=scaling)
            out[rows] = res.out.unsqueeze(1).to(out.dtype)
            fraction[rows] = res.read.sum(-1).float().mean(-1) / nblk
        if self.row_fraction_sum is None:
            self.row_fraction_sum = torch.zeros(B, device=query.device)
        self.row_fraction_sum += fraction
        self.row_calls += 1
        return out, None

    def _record(self, layer: int, read: torch.Tensor, total: torch.Tensor) -> None:
        r = self.reads[layer]
        r.read.append(read.cpu())
        r.total.append(total.cpu())

    def _record_dense(self, module: torch.nn.Module, key: torch.Tensor) -> None:
        B, H, T, _ = key.shape
        nb = num_blocks(torch.tensor(T), self.policy.cfg.block_size)
        n = torch.full((B * H,), int(nb))
        self._record(module.layer_idx, n, n)


class KernelRows:
    """Sparse decode rows through the server's Triton kernels (`sgl_kernel_ext.
    wave_attention`) instead of the PyTorch reference: a few launches per policy and
    layer instead of hundreds of small ops, which is what makes a suite of policies
    affordable on a GPU (and measures what the server runs). One plan per row (batch 1),
    made again when the context grows a block and shared by every layer; a row's KV is
    read in place from the transformers cache (`[Hkv, T, d]`, slots = blocks)."""

    def __init__(self) -> None:
        self.plans: dict[int, tuple[int, object]] = {}
        self.locs: dict[tuple[int, int, str], torch.Tensor] = {}

    @staticmethod
    def max_read(policy: DecodePolicy) -> int | None:
        """Blocks read at most: top-k's budget, or psa's cap (never below the forced)."""
        cfg = policy.cfg
        if policy.kind == "topk":
            tokens = policy.budget_tokens or cfg.topk_tokens
        else:
            tokens = policy.cap_tokens
        if not tokens:
            return None
        return max(tokens // cfg.block_size, cfg.sink_blocks + cfg.recent_blocks, 1)

    @staticmethod
    def codes(meta: BlockMeta) -> tuple[BlockMeta, torch.Tensor]:
        """Exact summaries with the bounds as the server keeps them at `bound_bits` 8:
        int8 codes, and their scale `[B, Hkv, NB]`."""
        kmin, kmax, kscale = bound_codes(meta.kmin, meta.kmax)
        return meta._replace(kmin=kmin.to(torch.int8), kmax=kmax.to(torch.int8)), kscale

    @staticmethod
    def key_codes(k, meta: BlockMeta, cfg: PSAConfig, bits: int):
        """`(planes, lo, hi)` of keys `k [B, Hkv, T, d]` for `WaveAttention.run(code_planes=)`:
        each key a `bits`-bit cell of its block's own range (the exact `meta`, float32),
        written by `sgl_kernel_ext.code_bounds.encode_planes` (a partial last block is
        padded with its lower bound: code 0, never read)."""
        from sgl_kernel_ext.code_bounds import encode_planes

        lo, hi = meta.kmin.float().contiguous(), meta.kmax.float().contiguous()
        bs, T = cfg.block_size, k.shape[2]
        pad = -T % bs
        if pad:
            k = torch.cat([k, lo[:, :, -1:].to(k.dtype).expand(-1, -1, pad, -1)], dim=2)
        return encode_planes(k, lo, hi, bits, bs), lo, hi

    def run(
        self, i: int, policy: DecodePolicy, q, k, v, meta: BlockMeta, scale, kscale=None,
        key_codes=None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Row `i`: q `[1, Hq, d]`, k and v `[1, Hkv, T, d]`, its block summaries: exact, or
        for `cfg.bound_bits` 8 with the bounds as `codes` gives them and their scale
        `kscale` (the kernel reads the codes, as the server does); `key_codes` (`key_codes`'
        tuple) for a policy with `code_bits`. Returns the output `[1, Hq, d]` and the blocks
        read per KV head `[1, Hkv]`."""
        from sgl_kernel_ext.wave_attention import WaveAttention

        bs = policy.cfg.block_size
        _, Hkv, T, d = k.shape
        nb = -(-T // bs)
        cfg = policy.cfg
        cap = self.max_read(policy)
        plan = self.plans.get(i)
        if plan is None or plan[0] != nb:
            run_cfg = cfg.replace(threshold=1.0) if policy.kind == "topk" else cfg
            wa = WaveAttention.from_config(run_cfg).plan(
                1, q.shape[1], Hkv, d, nb, q.device, out_dtype=q.dtype, read_blocks=cap
            )
            self.plans[i] = plan = (nb, wa)
        key = (nb, Hkv, str(q.device))
        if key not in self.locs:
            self.locs[key] = (
                torch.arange(nb, dtype=torch.int32, device=q.device).expand(1, Hkv, nb).contiguous()
            )
        kr, vr = k[0], v[0]
        if kr.stride() != vr.stride() or kr.stride(-1) != 1:
            raise ValueError(f"K and V rows need one layout with unit stride: {kr.stride()}")
        if (cfg.bound_bits == 8) != (kscale is not None):
            raise ValueError("8-bit bounds come as KernelRows.codes: int8 codes and kscale")
        res = plan[1].run(
            q.contiguous(),
            kr,
            vr,
            self.locs[key],
            torch.full((1,), T, dtype=torch.int32, device=q.device),
            *(t.contiguous() for t in meta[:3]),
            meta_scale=None if kscale is None else kscale.contiguous(),
            scale=scale,
            max_read_blocks=cap,
            slot_strides=(bs * kr.stride(1), kr.stride(1), kr.stride(0)),
            **dict(zip(("code_planes", "code_lo", "code_hi"), key_codes or ())),
        )
        return res.out, res.n_read


@dataclass
class RowGroup:
    """Consecutive batch rows `[start, stop)` whose policies share a `group`, with their
    per-row ε and cap (psa) or budget (top-k)."""

    start: int
    stop: int
    policies: tuple[DecodePolicy, ...]
    threshold: torch.Tensor  # [n] float64
    cap: torch.Tensor  # [n] int64, 0 = none
    budget: torch.Tensor  # [n] int64
    _device: dict = field(default_factory=dict, repr=False)

    def on(self, device: torch.device, name: str) -> torch.Tensor:
        """`name`'s tensor on `device`, copied there once."""
        key = (str(device), name)
        if key not in self._device:
            self._device[key] = getattr(self, name).to(device)
        return self._device[key]


def _row_groups(policies: list[DecodePolicy]) -> list[RowGroup]:
    groups: list[RowGroup] = []
    start = 0
    for i in range(1, len(policies) + 1):
        if i < len(policies) and policies[i].group == policies[start].group:
            continue
        ps = tuple(policies[start:i])
        groups.append(
            RowGroup(
                start,
                i,
                ps,
                torch.tensor([p.cfg.threshold for p in ps], dtype=torch.float64),
                torch.tensor([p.cap_tokens or 0 for p in ps], dtype=torch.int64),
                torch.tensor([p.budget_tokens or p.cfg.topk_tokens for p in ps]),
            )
        )
        start = i
    if not groups:
        raise ValueError("use_rows: no policies")
    return groups


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
