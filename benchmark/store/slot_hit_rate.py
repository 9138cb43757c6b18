"""Slot-cache hit rate vs cache size, replaying PSA block-read traces of the real model.

    python benchmark/store/slot_hit_rate.py [--traces FILE.npz]

The traces (from `record_traces.py`) say which KV blocks each decode step read,
per layer and KV head. Their tasks are replayed as concurrent requests that
decode in lockstep; within a step the accesses go layer by layer (each layer
of every request, then the next layer), as a batched decode step runs. A unit
is one (request, layer, KV head, block): one slot of the HBM slot cache.

- The tail block of each (request, layer, head) is always resident in HBM
  (DESIGN.md, "Data flow"), so its reads are not slot-cache accesses; when it
  fills, it enters the slot cache without a miss (its GPU copy stays cached).
- Every other block starts in the host pool (prefill KV goes there), so the
  first read of each unit is a compulsory miss.
- A missed block is read from host memory and then promoted into the cache
  (evicting when full); no slots are pinned (the bookkeeping only).

Policies, each at cache sizes of 1..100 % of all units:
- `lru`: `sglang_psa.store.SlotCache`, the cache the engine uses;
- `opt`: Belady's MIN with bypass (evict, or do not admit, the unit whose next
  read is furthest away): the upper bound of any replacement policy;
- `window`: a perfect working-set prefetch (the scheduler's w = 12 steps):
  before each step, every unit read in the last w steps is resident. Its hit
  rate does not depend on the cache size; its x position is the mean size of
  that working set.

Writes `benchmark/results/slot_hit_rate_cpu.json` and `.png`.
"""

from __future__ import annotations

import argparse
import heapq
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from sglang_psa.store import SlotCache

RESULTS = Path(__file__).resolve().parents[1] / "results"
PERCENTS = (1, 2, 5, 10, 20, 50, 75, 100)
WINDOW = 12


class RequestTrace(NamedTuple):
    """Blocks one request read: `read [steps, layers, H_kv, NB]` bool, `n_blocks [steps]`."""

    read: np.ndarray
    n_blocks: np.ndarray


class Step(NamedTuple):
    """Slot-cache events of one decode step of all running requests, in order.

    `drops`: units of requests that finished before this step (their slots are freed);
    `fills`: units that became full blocks before this step (cached, not an access);
    `reads`: the step's block reads (each unit at most once per step).
    """

    drops: np.ndarray
    fills: np.ndarray
    reads: np.ndarray


class StepCounts(NamedTuple):
    hits: np.ndarray  # [steps] int
    misses: np.ndarray  # [steps] int

    def hit_rate(self, warm: bool = False) -> float:
        """Hits / accesses over all steps, or over steps 1.. (`warm`: the first step excluded)."""
        start = 1 if warm else 0
        h, m = int(self.hits[start:].sum()), int(self.misses[start:].sum())
        return h / (h + m) if h + m else 0.0


def build_steps(
    requests: Sequence[RequestTrace], exclude_tail: bool = True
) -> tuple[list[Step], int]:
    """Interleave the requests' traces into steps; also returns the number of units.

    Unit ids are ints, one per (request, layer, head, block). All requests start
    at step 0; a request with a shorter trace finishes early and its units are
    dropped. With `exclude_tail`, each step's last block (the tail) is never an
    access, and a tail that became full is a fill at the next step. The unit
    count covers every block that can be accessed: all blocks at a request's
    last step, less its tail.
    """
    if not requests or any(r.read.shape[0] == 0 for r in requests):
        raise ValueError("every request needs at least one step")
    L = max(r.read.shape[1] for r in requests)
    H = max(r.read.shape[2] for r in requests)
    NB = max(r.read.shape[3] for r in requests)
    n_steps = max(r.read.shape[0] for r in requests)
    tail = 1 if exclude_tail else 0

    def unit(req: int, layer: np.ndarray, head: np.ndarray, block: np.ndarray) -> np.ndarray:
        return ((req * L + layer) * H + head) * NB + block

    def all_units(req: int, blocks: np.ndarray) -> np.ndarray:
        shape = requests[req].read.shape
        ly, h, b = np.meshgrid(np.arange(shape[1]), np.arange(shape[2]), blocks, indexing="ij")
        return unit(req, ly, h, b).ravel()

    steps = []
    for s in range(n_steps):
        drops, fills, layers, ids = [], [], [], []
        for r, tr in enumerate(requests):
            if tr.read.shape[0] == s:
                drops.append(all_units(r, np.arange(tr.n_blocks[-1] - tail)))
            if s >= tr.read.shape[0]:
                continue
            nb = int(tr.n_blocks[s])
            if exclude_tail and s > 0 and nb > tr.n_blocks[s - 1]:
                fills.append(all_units(r, np.arange(tr.n_blocks[s - 1] - 1, nb - 1)))
            mask = tr.read[s, :, :, : nb - tail]
            ly, h, b = np.nonzero(mask)
            layers.append(ly)
            ids.append(unit(r, ly, h, b))
        cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)
        layer, reads = cat(layers), cat(ids)
        # Layer-major; within a layer, by request (the order the lists were built in).
        order = np.argsort(layer, kind="stable")
        steps.append(Step(cat(drops), cat(fills), reads[order]))
    total = sum(r.read.shape[1] * r.read.shape[2] * (int(r.n_blocks[-1]) - tail) for r in requests)
    return steps, total


def simulate_lru(steps: Sequence[Step], num_slots: int) -> StepCounts:
    """Replay through `SlotCache` (LRU): a miss inserts the unit, evicting the oldest."""
    cache = SlotCache(num_slots)
    hits = np.zeros(len(steps), dtype=np.int64)
    misses = np.zeros(len(steps), dtype=np.int64)
    for s, st in enumerate(steps):
        cache.drop(st.drops.tolist())
        for k in st.fills.tolist():
            cache.insert(k)
        h0, m0 = cache.stats.hits, cache.stats.misses
        for k in st.reads.tolist():
            if cache.lookup(k) is None:
                cache.insert(k)
        hits[s], misses[s] = cache.stats.hits - h0, cache.stats.misses - m0
    return StepCounts(hits, misses)


def simulate_table(
    steps: Sequence[Step], num_slots: int, policy: str, bypass: bool, chunks: int = 24
) -> StepCounts:
    """Replay through the store's own `DeviceSlotTable` (CPU tensors): each step's reads in
    `chunks` acquire calls (about one per layer, as the decode path issues them), scores
    aged once per step. With `bypass`, declined units are misses read from the host."""
    import torch

    from sglang_psa.store.slot_table import DeviceSlotTable

    top = max((int(st.reads.max()) for st in steps if len(st.reads)), default=0)
    top = max([top] + [int(st.fills.max()) for st in steps if len(st.fills)])
    table = DeviceSlotTable(top + 1, num_slots, "cpu", policy=policy)
    hits = np.zeros(len(steps), dtype=np.int64)
    misses = np.zeros(len(steps), dtype=np.int64)
    for s, st in enumerate(steps):
        if len(st.drops):
            table.drop_units(torch.from_numpy(st.drops))
        for part in np.array_split(st.fills, max(1, -(-len(st.fills) // num_slots))):
            if len(part):
                table.acquire(torch.from_numpy(part))  # a filled tail is already in HBM
        before = table.counters.clone()
        n_chunks = max(chunks, -(-len(st.reads) // num_slots))
        for part in np.array_split(st.reads, n_chunks):
            if len(part):
                table.acquire(torch.from_numpy(part), bypass=bypass)
        d = (table.counters - before).tolist()
        hits[s], misses[s] = d[0], d[1]
        table.next_step()
    return StepCounts(hits, misses)


def simulate_page_cache(steps: Sequence[Step], num_slots: int, chunks: int = 24) -> StepCounts:
    """Replay through the serving path's `PageCache` (direct-mapped, frequency admission
    after each read, CPU tensors; one placeholder element per unit). Its units are a KV
    head's block here, as for the other policies (serving caches whole pages). The KV
    lives on the host, so a tail that fills is not cached until it is read."""
    import torch

    from sglang_psa.integration.page_cache import PageCache

    top = max((int(x.max()) for st in steps for x in (st.reads, st.drops) if len(x)), default=0)
    cache = PageCache(1, top + 1, 1, torch.float32, num_slots, "cpu")
    pool = torch.zeros(top + 1, 1)
    hits = np.zeros(len(steps), dtype=np.int64)
    misses = np.zeros(len(steps), dtype=np.int64)
    for s, st in enumerate(steps):
        if len(st.drops):
            cache.invalidate(torch.from_numpy(st.drops))
        for part in np.array_split(st.reads, chunks):
            if not len(part):
                continue
            units = torch.from_numpy(part)[None, :]
            yes = torch.ones_like(units, dtype=torch.bool)
            loc = cache.locate(0, units, yes)
            hits[s] += int((loc >= 0).sum())
            misses[s] += int((loc < 0).sum())
            cache.admit(0, units, yes, yes, loc, pool, pool)
        cache.next_step()
    return StepCounts(hits, misses)


def simulate_opt(steps: Sequence[Step], num_slots: int) -> StepCounts:
    """Belady's MIN with bypass: the most hits any policy can get with `num_slots` slots.

    On a miss (or a fill) the unit is admitted only if some resident unit is read
    later than it next is (or never again); that unit is evicted. Dropped units
    are never read again, so they are the first evicted: no explicit drop needed.
    """
    keys = [k for st in steps for k in (*st.fills.tolist(), *st.reads.tolist())]
    is_read = [x for st in steps for x in (*[False] * len(st.fills), *[True] * len(st.reads))]
    step_of = np.repeat(np.arange(len(steps)), [len(st.fills) + len(st.reads) for st in steps])
    never = len(keys) + 1
    next_read = [never] * len(keys)
    last: dict[int, int] = {}
    for i in range(len(keys) - 1, -1, -1):
        next_read[i] = last.get(keys[i], never)
        if is_read[i]:
            last[keys[i]] = i
    resident: dict[int, int] = {}  # unit -> index of its next read
    heap: list[tuple[int, int]] = []  # (-next read, unit); stale entries skipped lazily
    hit = np.zeros(len(keys), dtype=bool)
    for i, k in enumerate(keys):
        nxt = next_read[i]
        if k in resident:
            hit[i] = is_read[i]
            resident[k] = nxt
            heapq.heappush(heap, (-nxt, k))
            continue
        if nxt == never:
            continue  # never read again: bypass
        if len(resident) >= num_slots:
            while resident.get(heap[0][1]) != -heap[0][0]:
                heapq.heappop(heap)
            if -heap[0][0] <= nxt:
                continue  # every resident unit is needed sooner: bypass
            del resident[heapq.heappop(heap)[1]]
        resident[k] = nxt
        heapq.heappush(heap, (-nxt, k))
    reads = np.array(is_read, dtype=bool)
    n = len(steps)
    hits = np.bincount(step_of[hit], minlength=n)
    misses = np.bincount(step_of[reads & ~hit], minlength=n)
    return StepCounts(hits, misses)


def simulate_window(steps: Sequence[Step], window: int = WINDOW) -> tuple[StepCounts, np.ndarray]:
    """A perfect prefetch of the working set: reads inside the last `window` steps' union.

    Before step s, resident = units read or filled in steps s-window .. s-1, plus
    the fills of step s. Returns the counts and the resident-set size per step.
    """
    hits = np.zeros(len(steps), dtype=np.int64)
    misses = np.zeros(len(steps), dtype=np.int64)
    sizes = np.zeros(len(steps), dtype=np.int64)
    for s, st in enumerate(steps):
        past = [np.concatenate([p.fills, p.reads]) for p in steps[max(0, s - window) : s]]
        ws = np.unique(np.concatenate([*past, st.fills]))
        hit = np.isin(st.reads, ws)
        hits[s], misses[s], sizes[s] = int(hit.sum()), int((~hit).sum()), ws.size
    return StepCounts(hits, misses), sizes


def compulsory_misses(steps: Sequence[Step]) -> StepCounts:
    """Misses no cache can avoid (a unit's first read, unless it was a fill); the rest as hits."""
    seen: set[int] = set()
    hits = np.zeros(len(steps), dtype=np.int64)
    misses = np.zeros(len(steps), dtype=np.int64)
    for s, st in enumerate(steps):
        seen.update(st.fills.tolist())
        reads = st.reads.tolist()
        new = {k for k in reads if k not in seen}
        misses[s], hits[s] = len(new), len(reads) - len(new)
        seen |= new
    return StepCounts(hits, misses)


def slots_for(percent: float, total_units: int) -> int:
    return max(1, round(percent / 100 * total_units))


def load_traces(path: Path) -> tuple[list[RequestTrace], dict]:
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    reqs = [RequestTrace(z[f"read_{i}"], z[f"n_blocks_{i}"]) for i in range(len(meta["tasks"]))]
    return reqs, meta


def mean_fraction_read(requests: Sequence[RequestTrace], steps: slice = slice(None)) -> float:
    """Mean over (request, step, layer, head) of blocks read / blocks present (tail included)."""
    fr = [(r.read[steps].sum(-1) / r.n_blocks[steps, None, None]).ravel() for r in requests]
    cat = np.concatenate(fr)
    return float(cat.mean()) if cat.size else float("nan")


def _policy_rates(counts: StepCounts) -> dict:
    return {
        "hit_rate": counts.hit_rate(),
        "hit_rate_warm": counts.hit_rate(warm=True),
        "hits": int(counts.hits.sum()),
        "misses": int(counts.misses.sum()),
    }


def _window_row(steps: Sequence[Step], w: int, total: int) -> dict:
    counts, sizes = simulate_window(steps, w)
    return {
        "w": w,
        "hit_rate_warm": counts.hit_rate(warm=True),
        "mean_ws_percent": float(100 * sizes[1:].mean() / total),
    }


def analyse(requests: Sequence[RequestTrace], percents: Sequence[float] = PERCENTS) -> dict:
    """Every policy at every cache size, for the requests replayed concurrently."""
    steps, total = build_steps(requests)
    accesses = np.array([len(st.reads) for st in steps])
    window, ws_sizes = simulate_window(steps)
    sizes = []
    for p in percents:
        n = slots_for(p, total)
        sizes.append(
            {
                "percent": p,
                "slots": n,
                "lru": _policy_rates(simulate_lru(steps, n)),
                "opt": _policy_rates(simulate_opt(steps, n)),
                "table_frequency": _policy_rates(simulate_table(steps, n, "frequency", True)),
                "table_lru": _policy_rates(simulate_table(steps, n, "lru", False)),
                "page_cache": _policy_rates(simulate_page_cache(steps, n)),
            }
        )
    return {
        "total_units": total,
        "accesses": int(accesses.sum()),
        "mean_accesses_per_step_percent": float(100 * accesses.mean() / total),
        "compulsory_bound": _policy_rates(compulsory_misses(steps)),
        "window": {
            "w": WINDOW,
            **_policy_rates(window),
            "mean_ws_percent": float(100 * ws_sizes[1:].mean() / total),
            "max_ws_percent": float(100 * ws_sizes.max() / total),
        },
        "window_by_w": [_window_row(steps, w, total) for w in (1, 2, 4, 8, WINDOW)],
        "cache_sizes": sizes,
    }


def plot(result: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    pct = [c["percent"] for c in result["cache_sizes"]]
    for name, color in (("lru", "C0"), ("opt", "C1"), ("table_frequency", "C3")):
        warm = [c[name]["hit_rate_warm"] for c in result["cache_sizes"]]
        cold = [c[name]["hit_rate"] for c in result["cache_sizes"]]
        label = {
            "lru": "LRU (SlotCache)",
            "opt": "OPT (Belady, bypass)",
            "table_frequency": "store table, frequency + bypass",
        }[name]
        ax.plot(pct, warm, "o-", color=color, label=f"{label}, warm")
        ax.plot(pct, cold, "--", color=color, alpha=0.6, label=f"{label}, incl. step 0")
    ws = result["window_by_w"]
    ax.plot(
        [r["mean_ws_percent"] for r in ws],
        [r["hit_rate_warm"] for r in ws],
        "s:",
        color="C2",
        label="working-set prefetch, w = " + ", ".join(str(r["w"]) for r in ws) + " steps, warm",
    )
    ax.axhline(
        result["compulsory_bound"]["hit_rate_warm"],
        color="gray",
        lw=0.8,
        ls=":",
        label="compulsory misses only (any size), warm",
    )
    ax.axvline(result["mean_accesses_per_step_percent"], color="gray", lw=0.8, ls="-.")
    ax.text(
        result["mean_accesses_per_step_percent"],
        0.02,
        " one step's reads",
        color="gray",
        fontsize=8,
    )
    ax.set_xscale("log")
    ax.set_xticks(pct, [f"{p}%" if p != 75 else "" for p in pct])
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("slot cache size (% of all KV units of the running requests)")
    ax.set_ylabel("hit rate (block reads)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _latest_trace() -> Path:
    from sglang_psa.models import cache_dir

    found = sorted((cache_dir() / "traces").glob("*.npz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no traces: run benchmark/store/record_traces.py first")
    return found[-1]


def main() -> None:
    from sglang_psa.eval.results import write_result

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", type=Path, default=None, help="default: the newest recorded")
    ap.add_argument("--out", type=Path, default=RESULTS / "slot_hit_rate_cpu.json")
    args = ap.parse_args()
    path = args.traces or _latest_trace()
    requests, meta = load_traces(path)
    print(f"replaying {path} ({len(requests)} requests)")
    result = analyse(requests)
    per_task = []
    for req, task in zip(requests, meta["tasks"]):
        r = analyse([req], percents=(10,))
        per_task.append(
            {
                "kind": task["kind"],
                "total_units": r["total_units"],
                "lru_hit_rate_warm_at_10pct": r["cache_sizes"][0]["lru"]["hit_rate_warm"],
                "opt_hit_rate_warm_at_10pct": r["cache_sizes"][0]["opt"]["hit_rate_warm"],
                "window_hit_rate_warm": r["window"]["hit_rate_warm"],
                "mean_ws_percent": r["window"]["mean_ws_percent"],
                "stop_step": task["stop_step"],
                "fraction_read_before_stop": mean_fraction_read([req], slice(task["stop_step"])),
                "fraction_read_after_stop": mean_fraction_read(
                    [req], slice(task["stop_step"] or req.read.shape[0], None)
                ),
            }
        )
    at10 = next(c for c in result["cache_sizes"] if c["percent"] == 10)
    summary = {
        "slot_hit_rate_at_10pct_cache": at10["table_frequency"]["hit_rate_warm"],
        "slot_hit_rate_at_10pct_cache_incl_first_step": at10["table_frequency"]["hit_rate"],
        "lru_hit_rate_at_10pct_cache": at10["lru"]["hit_rate_warm"],
        "table_lru_hit_rate_at_10pct_cache": at10["table_lru"]["hit_rate_warm"],
        "opt_hit_rate_at_10pct_cache": at10["opt"]["hit_rate_warm"],
        "page_cache_hit_rate_at_10pct_cache": at10["page_cache"]["hit_rate_warm"],
        "ws_prefetch_hit_rate": result["window"]["hit_rate_warm"],
        "ws_prefetch_mean_ws_percent": result["window"]["mean_ws_percent"],
        "mean_fraction_of_blocks_read": mean_fraction_read(requests),
        "mean_accesses_per_step_percent": result["mean_accesses_per_step_percent"],
        "model": meta["model"],
        "context_tokens": meta["context_tokens"],
        "steps": meta["steps"],
        "n_requests": len(requests),
    }
    notes = [
        f"Finding: one decode step reads {result['mean_accesses_per_step_percent']:.0f}% of all "
        f"units and {result['window_by_w'][0]['hit_rate_warm']:.0%} of a step's reads were "
        "also read in the step before, so a unit's reuse distance is about one step's reads. An "
        "LRU cache smaller than that evicts every unit before its reuse and gets almost no hits "
        "(it thrashes); OPT shows what a scan-resistant policy could keep at the same size, and "
        "window_by_w how stable the read set is across steps.",
        "Traces: each task decodes exactly `steps` steps, also after the model's own end of "
        "sequence (per_task.stop_step), so all requests stay busy for the whole replay. PSA "
        "reads fewer blocks in those later steps (per_task.fraction_read_before/after_stop); "
        "mean_fraction_of_blocks_read covers all steps.",
        "Headline slot_hit_rate_at_10pct_cache = the store's DeviceSlotTable with its default "
        "policy (frequency scores aged 0.8 per step, misses admitted only when hotter than the "
        "victim, declined ones read from the host) replayed on CPU tensors, cache at 10% of all "
        "units; lru = exact per-access LRU (SlotCache), table_lru = the table's LRU policy. Warm: hits / block reads over decode steps 1.., excluding step 0. Step 0 "
        "starts from an empty cache (prefill KV goes to the host pool), so every read in it is "
        "a compulsory miss; a served request decodes hundreds of steps, not the recorded few, "
        "so that one-time cost would weigh far less than its 1/steps share here. The *_incl_"
        "first_step numbers (hit_rate in data) count it.",
        "Later compulsory misses (a unit first read at step >= 1) are still counted in the warm "
        "rate; compulsory_bound is the best any cache could do.",
        "Unit = one (request, layer, KV head, block) of block_size tokens; an access = one block "
        "read by PSA in one step. Tail blocks are always resident in HBM and are not accesses; "
        "a tail that fills enters the cache without a miss.",
        "Requests = the recorded tasks decoding concurrently in lockstep, accesses ordered layer "
        "by layer across requests; cache size in % of all units of those requests.",
        "page_cache = the serving path's PageCache (--psa-kv-home host): direct-mapped slots, "
        "a unit read from the host replaces the slot's occupant when its decayed read count "
        "is higher; fills are not admitted (the KV lives on the host).",
        "opt = Belady's MIN with bypass (upper bound for any replacement policy at that size); "
        "window = perfect prefetch of the union of the last w steps' reads (size-independent, "
        "needs a cache of mean_ws_percent).",
        "mean_fraction_of_blocks_read = blocks read / blocks present per (request, step, layer, "
        "KV head), tail and sink included (as kv_fraction in sparsity_cpu.json).",
    ]
    data = {
        "traces": {"file": path.name, **{k: v for k, v in meta.items() if k != "tasks"}},
        "tasks": meta["tasks"],
        **result,
        "per_task": per_task,
        "notes": notes,
    }
    out = write_result(args.out, summary, data, model=meta["model_name"])
    title = (
        f"{meta['model']}, {len(requests)} requests x {meta['context_tokens']} tok, "
        f"{meta['steps']} steps, {meta['policy']}"
    )
    plot(result, title, out.with_suffix(".png"))
    for c in result["cache_sizes"]:
        print(
            f"{c['percent']:4g}%  {c['slots']:7d} slots  LRU {c['lru']['hit_rate_warm']:.3f} "
            f"({c['lru']['hit_rate']:.3f})  OPT {c['opt']['hit_rate_warm']:.3f} "
            f"({c['opt']['hit_rate']:.3f})   [warm (incl. step 0)]"
        )
    w = result["window"]
    print(f"window w={w['w']}: {w['hit_rate_warm']:.3f} at {w['mean_ws_percent']:.1f}% of units")
    print("summary:", summary)
    print("wrote", out, "and", out.with_suffix(".png"))


if __name__ == "__main__":
    main()
