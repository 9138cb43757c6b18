"""Prefill at the tiered home on SGLang's fastest dense backend, with a staging path.

A prompt larger than HBM (or a prefix resumed from the host tier) is prefilled over a
prefix staged from HBM and the host tier (`mem_cache.prefill_stage`), which SGLang's
Triton extend kernel reads per token at page size 1. Every other extend batch has its
whole prefix in HBM and runs on the backend SGLang built for prefill (FA3 on a Hopper
GPU). `StagedPrefill` stands in SGLang's hybrid backend as its prefill backend and
sends each extend batch to one of the two: the staging one (Triton) when the batch's
staging was planned (`PrefillStage.plan`, set when the batch was set up), else the fast
one. Both read and write the same KV pool.

Contract: `init_forward_metadata*` chooses for the batch and the choice holds until the
next batch's; everything else SGLang asks of a prefill backend goes to the fast one.
Built by `plugin.extend.after_hybrid_init` once SGLang built its backends.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class StagedPrefill:
    """SGLang's prefill backend (`fast`), with `staging` (SGLang's Triton backend at page
    size 1) for the extend batches whose prefix is staged (`staged()` true when the
    batch's metadata is set up)."""

    def __init__(self, fast, staging, staged: Callable[[], bool]):
        self.fast, self.staging, self._staged = fast, staging, staged
        self.active = fast

    def _choose(self, forward_batch) -> Any:
        extend = forward_batch.forward_mode.is_extend()
        self.active = self.staging if extend and self._staged() else self.fast
        return self.active

    def init_forward_metadata(self, forward_batch) -> None:
        self._choose(forward_batch).init_forward_metadata(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        chosen = self._choose(forward_batch)
        chosen.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        self.active.init_forward_metadata_in_graph(forward_batch)  # after out_graph's choice

    def forward(self, *args, **kwargs):
        return self.active.forward(*args, **kwargs)

    def forward_extend(self, *args, **kwargs):
        return self.active.forward_extend(*args, **kwargs)

    def __getattr__(self, name: str):
        # Only reached for what this class does not define: SGLang's other questions to
        # its prefill backend (capabilities, CUDA-graph state) are the fast backend's.
        if name in ("fast", "staging", "_staged", "active"):
            raise AttributeError(name)
        return getattr(self.fast, name)
