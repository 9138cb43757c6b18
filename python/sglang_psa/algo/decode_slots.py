"""Reference of a decode step's KV slots at a page size above one
(`sgl_kernel_ext.decode_slots`): what SGLang's paged decode allocation gives.

Request `i` of the batch has `lens[i]` tokens in row `rows[i]` of `req_to_token`. Its
next token goes into the slot after its last one (`req_to_token[row, lens - 1] + 1`),
unless `lens[i]` is a multiple of the page size: then it opens a page, the next of
`free_pages` in request order (the k-th request that opens one takes `free_pages[k]`),
at the page's first slot (`page * page_size`). The slot is returned and written to
`req_to_token[row, lens[i]]`; the pages taken are the first `count` of `free_pages`,
`count` being the number of requests that open one.
"""

from __future__ import annotations

import torch


def decode_slots_ref(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    lens: torch.Tensor,
    free_pages: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    rows, lens = rows.long(), lens.long()
    fresh = lens % page_size == 0
    rank = torch.cumsum(fresh.long(), 0) - fresh.long()
    last = req_to_token[rows, (lens - 1).clamp(min=0)].long()
    page = torch.zeros_like(rank)
    if len(free_pages):
        page = free_pages[rank.clamp(max=len(free_pages) - 1)].long()
    slots = torch.where(fresh, page * page_size, last + 1)
    req_to_token[rows, lens] = slots.to(req_to_token.dtype)
    return slots
