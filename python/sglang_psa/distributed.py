"""Agreement across tensor-parallel ranks: the plugin decides only from values every rank holds.

With `--tp N` SGLang runs one scheduler process per GPU. They receive the same
requests and run the same scheduling code in lockstep, so their batches (and their
page allocators) stay identical as long as every decision reads identical inputs;
ranks that decide differently run different batches and hang in the next collective.
The plugin's decisions read values that differ between ranks: each rank measures
working sets and block heat on its own KV heads, and its saves are acknowledged at
their own times. Before a decision reads such values they pass through
`RankAgreement.max_min`, an all-reduce over SGLang's TP CPU group (gloo), so that every
rank holds the same numbers: the largest working set, the hottest heat, and the
fewest acknowledged saves (what holds on every rank).

With one rank (the usual case) nothing is communicated: the arrays come back as given.
Contract for callers: every rank calls in the same order with arrays of the same
shapes (shapes derived from lockstep state: the batch, the requests' lengths), never
from state that is local to a rank.
"""

from __future__ import annotations

import sys

import numpy as np
import torch


class RankAgreement:
    """Element-wise max / min of host integer arrays over the ranks of one TP group."""

    def __init__(self, group=None, world_size: int = 1):
        if world_size > 1 and group is None:
            raise ValueError("several ranks need a process group to agree over")
        self.group, self.world_size = group, world_size

    @classmethod
    def from_sglang(cls, tp_size: int = 1) -> RankAgreement:
        """The agreement of this scheduler process: SGLang's TP group's CPU (gloo) group,
        or a single rank when there is no tensor parallelism (or no SGLang running in this
        process: one that runs has imported its runtime context and set up its groups).
        With `tp_size` > 1 (the server's `--tp`) a missing or smaller TP group raises:
        ranks that decided alone would run different batches and hang in the next
        collective."""
        tp = _parallel("tp_group")
        world = 1 if tp is None else tp.world_size
        if tp_size > 1 and world != tp_size:
            raise RuntimeError(
                f"sglang-psa: --tp {tp_size}, but SGLang's TP group "
                f"{'is not set up' if tp is None else f'has {world} ranks'} in this process: "
                "the ranks could not agree on scheduling decisions"
            )
        if world <= 1:
            return cls()
        return cls(tp.cpu_group, tp.world_size)

    def max(self, *arrays) -> list[np.ndarray]:
        """Each array's element-wise maximum over the ranks (int64), in one collective."""
        return self.max_min(arrays, ())[0]

    def max_min(self, maxes, mins) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Each of `maxes`' element-wise maximum and each of `mins`' minimum over the
        ranks (int64 arrays of the given shapes), in a single collective (a max of the
        mins negated)."""
        arrays = [np.asarray(a, dtype=np.int64) for a in maxes]
        arrays += [-np.asarray(a, dtype=np.int64) for a in mins]
        if self.world_size > 1 and arrays:
            flat = np.concatenate([a.ravel() for a in arrays])
            buf = torch.from_numpy(np.ascontiguousarray(flat))
            torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX, group=self.group)
            sizes = np.cumsum([a.size for a in arrays])[:-1]
            arrays = [p.reshape(a.shape) for p, a in zip(np.split(buf.numpy(), sizes), arrays)]
        n = len(maxes)
        return arrays[:n], [-a for a in arrays[n:]]

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable host data; for server info), by rank."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out


def kv_ranks() -> int:
    """Ranks SGLang shards the KV heads over in this server (its attention TP size; 1
    without tensor parallelism or outside a running SGLang): each holds `1 / kv_ranks()`
    of `--psa-host-pool-gb`, so that the server's host tier is the flag's size. Never
    imports SGLang: a running one has already imported its runtime context."""
    size = _parallel("attn_tp_size")
    return 1 if size is None else max(1, int(size))


def tp_rank() -> int:
    """This process's rank in SGLang's TP group (0 without tensor parallelism or outside
    a running SGLang). SGLang's `ModelRunner` has no `tp_rank` attribute in 0.5.17 or
    0.5.23: the group is the one record of it. Never imports SGLang."""
    tp = _parallel("tp_group")
    return 0 if tp is None else int(tp.rank_in_group)


def _parallel(name: str):
    """`name` of SGLang's parallel context in this process, or None where no SGLang runs
    here (a running one has imported its runtime context: never imported here) or its
    distributed state is not set up: one rank. (`parallel_state.get_tp_group()` is
    deprecated from 0.5.23 on.)"""
    runtime_context = sys.modules.get("sglang.srt.runtime_context")
    if runtime_context is None:
        return None
    try:
        return getattr(runtime_context.get_parallel(), name)
    # not set up: 0.5.17 asserts; 0.5.23 raises RuntimeError, or ValueError before any
    # parallel config is published
    except (AssertionError, RuntimeError, ValueError):
        return None
