"""Prefill over a prefix that left HBM: a prompt larger than HBM at the tiered home.

The tiered home prefills a prompt in SGLang's chunks. When HBM runs short, the
chunked request's own saved blocks give their pages back like a decoding request's
(`mem_cache.residency`), so a prompt larger than HBM holds only a few chunks there.
A later chunk still attends to its whole prefix, and SGLang's extend kernel reads
the prefix through one index list into one buffer (the layer's pool). So for an
extend batch with such a prefix, per layer:

1. `plan` (when the batch is set up, host lists only): which prefix tokens are on the
   host tier, and their rows there (host block times the block size plus offset);
2. `staged` (inside the layer's `forward_extend`, around SGLang's call): one kernel
   (`sgl_kernel_ext.prefix_stage`) copies the layer's prefix into a device staging,
   from the pool where a token is in HBM and from the host tier (UVA reads of pinned
   memory) where it is not; SGLang's kernel then runs unchanged with the staging as
   its buffer and `0..P-1` as its prefix indices. The new tokens' K/V still go into
   the pool (the swap covers the reads only).

Why chunks and not SparseServe's layer-segmented prefill: SGLang's forward runs every
layer of a batch before the next batch, and a layer-outer order (all of a prompt's
chunks through layer 0, then layer 1, ...) would replace its model forward. Chunks
keep SGLang's forward and kernels; the price is that each chunk reads its evicted
prefix across PCIe once per layer (a prompt of `n` chunks reads about `n/2` times its
evicted KV), the same bytes a layer-segmented prefill reads from HBM.

The staging holds one layer of the longest prefix staged so far (grown on demand,
never shrunk): for an 8B model (8 KV heads of 128) 4 KiB per token, 128 MiB at 32K.
Extend batches are not on the decode step: the plan's host lists and one small H2D
copy per batch are allowed here, and nothing waits for the GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from sgl_kernel_ext.prefix_stage import stage_prefix
from sglang_psa.mem_cache.writeback import to_device

_GROW = 4096  # staging rows are allocated in multiples of this


@dataclasses.dataclass
class _Plan:
    prefix_lens: tuple[int, ...]  # the batch's, in its order (the plan's identity)
    host_rows: torch.Tensor  # [P] int32: row in the host layer, -1 where in HBM
    indices: torch.Tensor  # [P] int64: 0..P-1, the staging rows


def reads_token_major(pool) -> bool:
    """Whether SGLang's KV pool is contiguous and token-major (`[tokens, Hkv, d]` a
    layer), the layout a staging stands in for and SGLang's Triton prefill reads per
    token at page size 1."""
    bufs = [*getattr(pool, "k_buffer", ()), *getattr(pool, "v_buffer", ())]
    return bool(bufs) and all(b.dim() == 3 and b.is_contiguous() for b in bufs)


class PrefillStage:
    def __init__(self, writeback, pool, block_size: int, first_layer: int = 0):
        """`pool`: SGLang's KV pool (its layers' `k_buffer`/`v_buffer`), `writeback`: the
        tiered home's (its host tier and each request's host blocks)."""
        self.wb, self.pool, self.block_size = writeback, pool, block_size
        self.first_layer = first_layer
        self.plan: _Plan | None = None
        self._k = self._v = None
        self.batches = 0  # extend batches that staged a prefix, ever
        self.host_tokens = 0  # prefix tokens read from the host tier per layer, summed

    @property
    def nbytes(self) -> int:
        return 0 if self._k is None else 2 * self._k.numel() * self._k.element_size()

    def report(self) -> dict[str, int]:
        """Extend batches whose prefix was staged from the host tier (a prompt larger than
        HBM), and the host tokens they staged (per layer)."""
        return {"staged_batches": self.batches, "staged_host_tokens": self.host_tokens}

    def plan_batch(self, reqs, prefix_lens) -> bool:
        """An extend batch is set up: plan its staging if a request's prefix has blocks
        off HBM (its record's `evicted`, `WriteBack.records`); returns whether it has."""
        self.plan = None
        bs = self.block_size
        recs = [self.wb.records.get(req.rid) for req in reqs]
        hits = [
            bool(n) and rec is not None and rec.evicted is not None
            and rec.evicted[: -(-n // bs)].any()
            for rec, n in zip(recs, prefix_lens)
        ]  # fmt: skip
        if not any(hits):
            return False  # the common case: every prefix is in HBM
        parts, on_host = [], 0
        for rec, n, hit in zip(recs, prefix_lens, hits):
            if not hit:
                parts.append(np.full(n, -1, dtype=np.int64))
                continue
            gone, nb = rec.evicted, -(-n // bs)
            host = np.asarray(rec.host[:nb], dtype=np.int64)
            pos = np.arange(n)
            block = pos // bs
            parts.append(np.where(gone[block], host[block] * bs + pos % bs, -1))
            on_host += int(gone[:nb].sum()) * bs
        rows = np.concatenate(parts)
        dev = self.pool.k_buffer[0].device
        self.plan = _Plan(
            tuple(int(n) for n in prefix_lens),
            to_device(rows, dev, torch.int32),
            torch.arange(rows.size, dtype=torch.int64, device=dev),
        )
        self.batches += 1
        self.host_tokens += on_host
        return True

    def _buffers(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._k is None or self._k.shape[0] < rows:
            k0 = self.pool.k_buffer[0]
            n = -(-rows // _GROW) * _GROW
            self._k = self._v = None  # the old staging goes before the new one is taken
            self._k = torch.empty((n, *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
            self._v = torch.empty_like(self._k)
        return self._k, self._v

    @contextlib.contextmanager
    def staged(self, backend, layer_id: int, forward_batch):
        """Inside SGLang's Triton `forward_extend` of `layer_id` for the planned batch:
        its prefix reads come from the staging (see the module docstring)."""
        plan = self.plan
        lens = tuple(int(n) for n in (forward_batch.extend_prefix_lens_cpu or ()))
        if lens != plan.prefix_lens:
            raise RuntimeError(
                f"sglang-psa: an extend batch with prefix lengths {lens} runs while the "
                f"staging was planned for {plan.prefix_lens}; SGLang's order of batch set-up "
                "and forward changed (built for sglang==0.5.17)"
            )
        if getattr(backend, "page_size", 1) != 1:
            raise RuntimeError(
                "sglang-psa: staged prefill needs the prefill backend at page size 1"
            )
        md = backend.forward_metadata
        P = plan.indices.numel()
        if md.kv_indices.numel() < P:
            raise RuntimeError(
                f"sglang-psa: the extend metadata lists {md.kv_indices.numel()} prefix tokens, "
                f"the staging plan {P}"
            )
        sk, sv = self._buffers(P)
        lid = layer_id - self.first_layer
        pool = self.pool
        stage_prefix(
            pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id),
            self.wb.host.k[lid], self.wb.host.v[lid], md.kv_indices[:P], plan.host_rows, sk, sv,
        )  # fmt: skip
        real = backend.token_to_kv_pool
        backend.forward_metadata = dataclasses.replace(md, kv_indices=plan.indices)
        backend.token_to_kv_pool = _StagedPool(real, layer_id, sk, sv)
        try:
            yield
        finally:
            backend.forward_metadata = md
            backend.token_to_kv_pool = real


class _StagedPool:
    """SGLang's pool as one layer's `forward_extend` sees it: that layer's buffers are
    the staging; everything else (the store of the new tokens) is the pool's."""

    def __init__(self, pool, layer_id: int, k: torch.Tensor, v: torch.Tensor):
        self._pool, self._layer, self._k, self._v = pool, layer_id, k, v

    def get_key_buffer(self, layer_id: int):
        return self._k if layer_id == self._layer else self._pool.get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int):
        return self._v if layer_id == self._layer else self._pool.get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def __getattr__(self, name):
        return getattr(self._pool, name)
