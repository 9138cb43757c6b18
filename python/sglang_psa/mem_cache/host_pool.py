"""The host KV pool: every KV block of every request, in (layer, KV head)-major layout.

`k` and `v` are `[layers, kv_heads, num_blocks, block_size, head_dim]`, so one
block of one head is one contiguous run (8 KB for 32 x 128 bf16): the unit the
write-back and the unit cache's refresh move and the wave kernel reads through UVA.
Where CUDA exists the memory is page-locked in place (`cudaHostRegister`) so the
GPU reads it at PCIe speed: shared memory when the copy-engine process maps it,
else private memory. Never through torch's `pin_memory=True`: its caching host
allocator rounds every allocation up to a power of two, so an 82 GiB tier asked
for 128 GiB of pinned memory and failed on a 128 GiB host (and 11.75 GiB pinned 16).
A host block id (`host_blocks.HostBlocks`) names the same block in every layer and head.
"""

from __future__ import annotations

import torch


def register_host(t: torch.Tensor) -> None:
    """Page-lock `t`'s (shared) pages in place so the GPU reads and writes them through UVA."""
    nbytes = t.numel() * t.element_size()
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister failed ({err}) for {nbytes / 2**30:.2f} GiB of host memory"
        )


def unregister_host(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostKVPool:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        num_blocks: int,
        block_size: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        pin: bool | None = None,
        shared: bool = True,
    ):
        """`shared`: in shared memory another process (the copy engine) maps; else private
        memory, not zeroed (no block is read before its save completes) and with no
        `/dev/shm` limit on its size. Either is page-locked in place, exactly its size."""
        if num_blocks < 1:
            raise ValueError("the host pool needs at least one block (raise --psa-host-pool-gb)")
        self.layers, self.kv_heads, self.num_blocks = layers, kv_heads, num_blocks
        self.block_size, self.head_dim, self.dtype = block_size, head_dim, dtype
        shape = (layers, kv_heads, num_blocks, block_size, head_dim)
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = False
        if shared:
            self.k = torch.zeros(shape, dtype=dtype).share_memory_()
            self.v = torch.zeros(shape, dtype=dtype).share_memory_()
        else:
            self.k = torch.empty(shape, dtype=dtype)
            self.v = torch.empty(shape, dtype=dtype)
        if pin:
            self._register()

    def _register(self) -> None:
        register_host(self.k)
        try:
            register_host(self.v)
        except RuntimeError:
            unregister_host(self.k)
            raise
        self.pinned = True

    def close(self) -> None:
        if self.pinned:
            for t in (self.k, self.v):
                unregister_host(t)
            self.pinned = False

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
