"""Layer-segmented prefill planning (SparseServe): which part of which prompt each batch runs.

A long prompt runs a segment of layers per batch, all its tokens together, so the GPU holds
one layer's KV of it at a time (each finished layer goes to the host pool) and its hidden
states carry over between batches. Prefill work is counted in token-layers; a batch may
spend `max_inject_tokens` × L of them (L = model layers), the work of `max_inject_tokens`
tokens through the whole model:

    Σ over items (token_end - token_begin) × (layer_end - layer_begin) ≤ max_inject_tokens × L

So a prompt of T ≤ max_inject_tokens tokens runs all L layers in one batch; a longer one
runs ⌊budget / T⌋ layers per batch; one that does not fit in what is left of the budget
(with T > max_inject_tokens × L, not even one layer fits a whole batch) runs one layer per
batch in token chunks, finishing a layer for all its tokens before starting the next.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from sglang_psa.config import PSAConfig


class PrefillItem(NamedTuple):
    """Run layers [layer_begin, layer_end) for prompt tokens [token_begin, token_end)."""

    rid: Hashable
    token_begin: int
    token_end: int
    layer_begin: int
    layer_end: int

    @property
    def token_layers(self) -> int:
        return (self.token_end - self.token_begin) * (self.layer_end - self.layer_begin)


class PrefillPlan(NamedTuple):
    items: list[PrefillItem]  # at most one per prompt, in FIFO order
    token_layers: int  # Σ item.token_layers
    budget: int  # max_inject_tokens × num_layers


@dataclass
class PromptProgress:
    """Tokens [begin, end) need KV (those before `begin` hit the prefix cache). All of them
    are done through layer `layer` - 1, and layer `layer` is done for [begin, token)."""

    rid: Hashable
    begin: int
    end: int
    layer: int
    token: int


class PrefillPlanner:
    """FIFO queue of prompts being prefilled and the per-batch plan over it.

    `plan()` is a pure function of the queue; `advance(plan)` records that it ran. A prompt
    gets at most one item per batch, so an item's inputs (hidden states after layer
    `layer_begin` - 1, the KV of earlier tokens at its layers) all come from earlier
    batches. A prompt that gets nothing stops the plan: later prompts wait (FIFO).

    Chunk ends (except the prompt's end) fall on multiples of `align` (the KV block size,
    so blocks are written whole). That is the one way a plan exceeds the budget: when the
    budget is smaller than the distance to the next boundary, the first prompt still runs
    one layer up to that boundary, so every batch makes progress.
    """

    def __init__(self, num_layers: int, max_inject_tokens: int, align: int = 1):
        for name, value in (
            ("num_layers", num_layers),
            ("max_inject_tokens", max_inject_tokens),
            ("align", align),
        ):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.align = align
        self.budget = max_inject_tokens * num_layers
        self.prompts: dict[Hashable, PromptProgress] = {}  # arrival order

    @classmethod
    def from_config(cls, config: PSAConfig, num_layers: int) -> PrefillPlanner:
        return cls(num_layers, config.max_inject_tokens, align=config.block_size)

    def add(self, rid: Hashable, end: int, begin: int = 0) -> None:
        """Queue prompt tokens [begin, end) for prefill (`begin` = prefix-cache hit length)."""
        if rid in self.prompts:
            raise ValueError(f"request {rid!r} is already being prefilled")
        if not 0 <= begin < end:
            raise ValueError(f"need 0 <= begin < end, got begin={begin}, end={end}")
        self.prompts[rid] = PromptProgress(rid, begin, end, layer=0, token=begin)

    def abort(self, rid: Hashable) -> None:
        del self.prompts[rid]

    def plan(self) -> PrefillPlan:
        items, left = [], self.budget
        for progress in self.prompts.values():
            item = self._next_item(progress, left, first=not items)
            if item is None:
                break
            items.append(item)
            left -= item.token_layers
        return PrefillPlan(items, self.budget - left, self.budget)

    def _next_item(self, p: PromptProgress, left: int, first: bool) -> PrefillItem | None:
        num_tokens = p.end - p.begin
        if p.token == p.begin and num_tokens <= left:  # whole prompt, as many layers as fit
            layers = min(self.num_layers - p.layer, left // num_tokens)
            return PrefillItem(p.rid, p.begin, p.end, p.layer, p.layer + layers)
        end = min(p.end, p.token + left)  # one layer, a chunk of tokens
        if end < p.end:
            end -= end % self.align
            if end <= p.token:
                if not first:
                    return None
                end = min(p.end, (p.token // self.align + 1) * self.align)
        return PrefillItem(p.rid, p.token, end, p.layer, p.layer + 1)

    def advance(self, plan: PrefillPlan) -> list[Hashable]:
        """Record that `plan` ran; returns the requests whose prefill is now complete.

        Raises ValueError if the plan is not the one `plan()` would give now (stale).
        """
        finished = []
        for item in plan.items:
            p = self.prompts.get(item.rid)
            if p is None or (item.layer_begin, item.token_begin) != (p.layer, p.token):
                raise ValueError(f"stale plan item {item}: progress is {p}")
            if item.token_end == p.end:
                p.layer, p.token = item.layer_end, p.begin
            else:
                p.token = item.token_end
            if p.layer == self.num_layers:
                del self.prompts[item.rid]
                finished.append(item.rid)
        return finished

    def check_integrity(self) -> None:
        for rid, p in self.prompts.items():
            assert rid == p.rid, f"{rid!r} filed under the wrong key"
            assert 0 <= p.begin <= p.token < p.end, f"{rid!r}: token cursor out of range"
            assert 0 <= p.layer < self.num_layers, f"{rid!r}: layer cursor out of range"
