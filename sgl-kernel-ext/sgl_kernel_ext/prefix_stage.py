"""One layer of a prefill prefix into a device staging, from HBM pages or the host tier.

The tiered home prefills a prompt larger than HBM in chunks whose saved blocks leave
HBM; SGLang's extend kernel, which reads one buffer through one index list, then reads
the prefix from a staging that this kernel fills per layer: row `j` from SGLang's pool
at slot `slots[j]`, or, where `host_rows[j] >= 0`, from the host tier's layer at that
row (UVA reads of page-locked memory, one (token tile, KV head) per program). Spec:
`sglang_psa.algo.prefix_stage.stage_prefix_ref`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sgl_kernel_ext.runtime import triton_enabled

TOKENS = 32  # staging rows per program


@triton.jit
def _stage_kernel(
    pool_k,
    pool_v,
    host_k,
    host_v,
    slots_ptr,
    rows_ptr,
    out_k,
    out_v,
    P,
    pool_tok_stride,
    pool_head_stride,
    host_head_stride,
    out_tok_stride,
    out_head_stride,
    T: tl.constexpr,
    D: tl.constexpr,
):
    tile = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    j = tile.to(tl.int64) * T + tl.arange(0, T)
    live = j < P
    slot = tl.load(slots_ptr + j, mask=live, other=0).to(tl.int64)
    row = tl.load(rows_ptr + j, mask=live, other=-1).to(tl.int64)
    on_host = live & (row >= 0)
    in_pool = live & (row < 0)
    dim = tl.arange(0, D)
    src = (slot * pool_tok_stride + h * pool_head_stride)[:, None] + dim[None, :]
    hsrc = (h * host_head_stride + tl.maximum(row, 0) * D)[:, None] + dim[None, :]
    dst = (j * out_tok_stride + h * out_head_stride)[:, None] + dim[None, :]
    x = tl.load(pool_k + src, mask=in_pool[:, None], other=0.0)
    y = tl.load(host_k + hsrc, mask=on_host[:, None], other=0.0)
    tl.store(out_k + dst, tl.where(on_host[:, None], y, x), mask=live[:, None])
    x = tl.load(pool_v + src, mask=in_pool[:, None], other=0.0)
    y = tl.load(host_v + hsrc, mask=on_host[:, None], other=0.0)
    tl.store(out_v + dst, tl.where(on_host[:, None], y, x), mask=live[:, None])


def stage_prefix(
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    slots: torch.Tensor,
    host_rows: torch.Tensor,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
) -> None:
    """Fill `out_k/v[:P]` (`[>= P, Hkv, d]`, token rows contiguous in d) with the prefix
    (see the module docstring): `pool_k/v [tokens, Hkv, d]`, `host_k/v [Hkv, HB, bs, d]`
    contiguous (pinned host memory on CUDA), `slots`/`host_rows [P]` integer on the
    pool's device. One launch, no sync; on CUDA or under Triton's interpreter."""
    P = slots.numel()
    heads, d = pool_k.shape[1], pool_k.shape[2]
    if host_rows.numel() != P or out_k.shape[0] < P or out_k.shape[1:] != (heads, d):
        raise ValueError(
            f"{P} slots need {P} host rows and a [>= {P}, {heads}, {d}] staging; got "
            f"{host_rows.numel()} and {tuple(out_k.shape)}"
        )
    if host_k.shape[0] != heads or host_k.shape[-1] != d or not host_k.is_contiguous():
        raise ValueError(f"the host layer must be a contiguous [{heads}, HB, bs, {d}]")
    if (
        pool_k.stride(2) != 1
        or pool_k.stride() != pool_v.stride()
        or out_k.stride(2) != 1
        or out_k.stride() != out_v.stride()
        or host_v.shape != host_k.shape
        or not host_v.is_contiguous()
    ):
        raise ValueError("pool, host and staging rows must be contiguous in d, K and V alike")
    if P == 0:
        return
    if not triton_enabled(pool_k.device):
        raise RuntimeError("prefill staging runs on CUDA (or under TRITON_INTERPRET=1)")
    _stage_kernel[(triton.cdiv(P, TOKENS), heads)](
        pool_k, pool_v, host_k, host_v, slots, host_rows, out_k, out_v, P,
        pool_k.stride(0), pool_k.stride(1), host_k.stride(0),
        out_k.stride(0), out_k.stride(1), T=TOKENS, D=d,
    )  # fmt: skip
