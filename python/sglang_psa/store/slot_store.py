"""HBM slots holding copies of host-pool units, and the location tables the wave kernel reads.

One `k_slots/v_slots [num_slots, block_size, head_dim]` pair serves all
layers. `DeviceSlotTable` decides which units are resident; `promote` brings
the missing ones in with one gather launch per K and V, sized for the number
of units asked for and limited on the GPU to the actual misses, so it never
waits for the host. `location_table` gives, per layer,
`[B, kv_heads, max_blocks]` int32: the slot of a resident unit, else
`-(host unit + 1)` so the kernel reads that block from the host pool through
UVA. Both are a handful of tensor ops on the device.
"""

from __future__ import annotations

import torch

from sgl_kernel_ext.gather import BlockCopier
from sglang_psa.store.host_pool import HostKVPool
from sglang_psa.store.slot_table import Acquired, DeviceSlotTable


def slots_for_budget(
    pool: HostKVPool,
    gpu_cache_gb: float | None,
    free_bytes: int,
    free_fraction: float = 0.5,
) -> int:
    """Number of slots (one K and one V unit each) for `--psa-gpu-cache-gb`, or for
    `free_fraction` of the free GPU memory when it is unset. Asking for more than is
    free is an error naming the flag, not an out-of-memory crash later."""
    unit = 2 * pool.block_size * pool.head_dim * torch.empty((), dtype=pool.dtype).element_size()
    if gpu_cache_gb is not None:
        want = int(gpu_cache_gb * (1 << 30))
        if want > free_bytes:
            raise ValueError(
                f"--psa-gpu-cache-gb {gpu_cache_gb} asks for {want / 2**30:.1f} GiB but only "
                f"{free_bytes / 2**30:.1f} GiB of GPU memory is free"
            )
    else:
        want = int(free_bytes * free_fraction)
    slots = want // unit
    if slots < 1:
        raise ValueError(
            f"the HBM slot cache gets {want} bytes, less than one {unit}-byte slot "
            "(raise --psa-gpu-cache-gb or free GPU memory)"
        )
    return slots


class SlotStore:
    def __init__(self, pool: HostKVPool, num_slots: int, device: torch.device | str):
        self.pool, self.device = pool, torch.device(device)
        shape = (num_slots, pool.block_size, pool.head_dim)
        self.k_slots = torch.zeros(shape, dtype=pool.dtype, device=self.device)
        self.v_slots = torch.zeros_like(self.k_slots)
        self.units_per_layer = pool.kv_heads * pool.num_blocks
        self.table = DeviceSlotTable(pool.layers * self.units_per_layer, num_slots, self.device)
        unit = pool.block_size * pool.head_dim
        self.copier = BlockCopier(unit, pool.dtype, self.device)
        flat = (pool.layers * self.units_per_layer, unit)
        self._host_k, self._host_v = pool.k.view(flat), pool.v.view(flat)

    @classmethod
    def from_budget(
        cls,
        pool: HostKVPool,
        device: torch.device | str,
        gpu_cache_gb: float | None = None,
        free_fraction: float = 0.5,
    ) -> SlotStore:
        """Size the slot cache at startup from the flag or from free memory on `device`."""
        device = torch.device(device)
        if device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(device)
        else:
            free_bytes = int(gpu_cache_gb * (1 << 30)) if gpu_cache_gb else 1 << 30
        return cls(pool, slots_for_budget(pool, gpu_cache_gb, free_bytes, free_fraction), device)

    @property
    def num_slots(self) -> int:
        return self.table.num_slots

    def units(self, layer: int | torch.Tensor, head, block) -> torch.Tensor:
        """Global unit ids (int64 on the device) of (layer, head, block), broadcast."""
        as_t = lambda x: torch.as_tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        N = self.pool.num_blocks
        return (as_t(layer) * self.pool.kv_heads + as_t(head)) * N + as_t(block)

    def promote(
        self, layer: int, head_blocks: list[tuple[int, int]] | torch.Tensor, pin: bool = False
    ) -> torch.Tensor:
        """Slots for the (head, block) pairs of `layer`, gathering the missing units at once."""
        hb = torch.as_tensor(head_blocks, dtype=torch.int64, device=self.device).reshape(-1, 2)
        return self.promote_units(self.units(layer, hb[:, 0], hb[:, 1]), pin).slots

    def promote_units(
        self, units: torch.Tensor, pin: bool = False, bypass: bool = False
    ) -> Acquired:
        """Make distinct global `units` resident (any layers): one gather each for K and V.

        With `bypass`, units the cache policy declines keep slot -1 and are read from
        the host pool through UVA (`location_table` says so). Runs on the current
        stream; the `Loader` calls it on its own stream.
        """
        got = self.table.acquire(units, pin=pin, bypass=bypass)
        if units.numel():
            for host, slots in ((self._host_k, self.k_slots), (self._host_v, self.v_slots)):
                self.copier.run(host, got.miss_units, slots.flatten(1), got.miss_slots, got.n_miss)
        return got

    def next_step(self) -> None:
        """A decode step ended: age the cache policy's access scores."""
        self.table.next_step()

    def location_table(
        self,
        layer: int,
        block_tables: list[list[int]] | torch.Tensor,
        max_blocks: int | None = None,
    ) -> torch.Tensor:
        """`[B, kv_heads, max_blocks]` int32: slot if resident, else -(host unit + 1).

        `block_tables` is `[B, max_blocks]` block ids (a tensor, or lists padded
        here); entries past a request's last block may hold anything, the
        kernel never reads them.
        """
        if not torch.is_tensor(block_tables):
            width = max_blocks or max(len(t) for t in block_tables)
            padded = torch.zeros(len(block_tables), width, dtype=torch.int64)
            for b, t in enumerate(block_tables):
                padded[b, : len(t)] = torch.tensor(t, dtype=torch.int64)
            block_tables = padded
        bt = block_tables.to(self.device, torch.int64)[:, None, :]
        heads = torch.arange(self.pool.kv_heads, device=self.device)[None, :, None]
        local = heads * self.pool.num_blocks + bt
        slot = self.table.slot_of[layer * self.units_per_layer + local]
        return torch.where(slot >= 0, slot, -(local + 1)).to(torch.int32)

    def drop_blocks(self, blocks: list[int] | torch.Tensor) -> None:
        """Free the slots of `blocks` in every layer and head (their host blocks were freed)."""
        b = torch.as_tensor(blocks, dtype=torch.int64, device=self.device).reshape(1, 1, -1)
        L, H = self.pool.layers, self.pool.kv_heads
        layers = torch.arange(L, device=self.device).reshape(L, 1, 1)
        heads = torch.arange(H, device=self.device).reshape(1, H, 1)
        self.table.drop_units(self.units(layers, heads, b).flatten())
