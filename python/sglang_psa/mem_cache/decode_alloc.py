"""A decode batch's KV slots under `--sparse-mode` (a page is a PSA block, 32 tokens by
default): SGLang's paged allocation, in one kernel launch.

At a page size above one SGLang's decode allocation gathers each request's last slot,
launches its allocation kernel, counts the new pages with CPU tensor ops and writes the
request-to-token table with an index write: ~10 host-side tensor operations per step on
the scheduler's host loop, which at batch 32 and a 1.6 ms step sets the step
(docs/limits.md). `allocate` gives the same slots, pages and table (`algo.decode_slots`)
from one launch (`sgl_kernel_ext.decode_slots`), the new pages counted on the host from
`seq_lens_cpu` with numpy, then each request's KV lengths advanced as the release's
own function does (`releases.FEATURES["decode_alloc_commits"]`). It takes only the
plain paged case (SGLang's `PagedTokenToKVPoolAllocator`, one token per request, no
encoder, no auxiliary per-request cache); anything else, and a pool without the free
pages the step needs, is SGLang's own path (`None`), which also reports the
out-of-memory error as SGLang does. A test drives both on the same batches, against
every supported release. It imports SGLang: the scheduler's hook imports it, lazily.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.common import evict_from_tree_cache

from sgl_kernel_ext.decode_slots import decode_slots
from sglang_psa import releases


@functools.cache
def _commits() -> bool:
    return releases.has("decode_alloc_commits")


def handles(batch, token_per_req: int) -> bool:
    """Whether `allocate` serves this batch's decode allocation."""
    alloc = batch.token_to_kv_pool_allocator
    return (
        token_per_req == 1
        and getattr(batch, "seq_lens_cpu", None) is not None
        and type(alloc) is PagedTokenToKVPoolAllocator
        and alloc.page_size > 1
        and batch.tree_cache.page_size == alloc.page_size
        and not batch.model_config.is_encoder_decoder
        and getattr(batch, "hisparse_coordinator", None) is None
        and getattr(batch.req_to_token_pool, "_aux_cache", None) is None
    )


def allocate(batch) -> torch.Tensor | None:
    """The batch's next-token slots (int64 [bs]), written into its request-to-token rows
    and taken from the allocator's free pages; None (nothing changed) where the free
    pages, after the tree cache's eviction, cannot hold the step's new pages."""
    batch.maybe_evict_swa()
    alloc = batch.token_to_kv_pool_allocator
    page = alloc.page_size
    lens = batch.seq_lens_cpu.numpy()
    bs = len(lens)
    evict_from_tree_cache(batch.tree_cache, bs * page)  # as SGLang: a page per request
    if alloc.need_sort and bs > len(alloc.free_pages):
        alloc.merge_and_sort_free()
    new_pages = int(np.count_nonzero(lens % page == 0))
    if new_pages > len(alloc.free_pages):
        return None
    out = torch.empty(bs, dtype=torch.int64, device=batch.seq_lens.device)
    decode_slots(
        batch.req_to_token_pool.req_to_token,
        batch.req_pool_indices,
        batch.seq_lens,
        alloc.free_pages,
        page,
        out,
    )
    alloc.free_pages = alloc.free_pages[new_pages:]
    commits = _commits()
    for req in batch.reqs:
        req.kv.kv_allocated_len += 1
        if commits:
            req.kv.kv_committed_len += 1
    return out
