"""The slot-cache hit-rate simulator (benchmark/store/slot_hit_rate.py) on synthetic traces.

Each policy is checked against a brute-force expectation: unbounded caches miss
only compulsorily, LRU gets nothing from a cycle larger than the cache, Belady
matches an exhaustive search over admit/evict choices, and the window prefetch
matches a set-based recount. Also the trace format: what `PSARuntime.trace`
records and `record_traces.stack_trace` stores.
"""

import functools
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "store"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_store_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


sim = _load("slot_hit_rate")


def random_requests(seed: int, n_req: int, steps: int, p: float = 0.4, grow: bool = False):
    """Random read masks; with `grow`, a block fills every few steps (tail rollover)."""
    rng = np.random.default_rng(seed)
    reqs = []
    for r in range(n_req):
        L, H, nb0 = int(rng.integers(1, 3)), int(rng.integers(1, 3)), int(rng.integers(2, 6))
        n_blocks = nb0 + (np.arange(steps) // 3 if grow else np.zeros(steps, dtype=np.int64))
        n_steps = max(1, steps - (r if grow else 0))  # with `grow`, later ones finish earlier
        read = rng.random((n_steps, L, H, int(n_blocks.max()))) < p
        read &= np.arange(read.shape[-1]) < n_blocks[:n_steps, None, None, None]
        reqs.append(sim.RequestTrace(read, n_blocks[:n_steps]))
    return reqs


def test_build_steps_orders_layer_major_and_excludes_tails():
    a = np.zeros((2, 2, 1, 3), dtype=bool)
    a[:, :, 0, :] = True  # request 0 reads blocks 0, 1 and its tail 2 in both layers
    b = np.zeros((1, 2, 1, 3), dtype=bool)
    b[0, :, 0, 0] = True  # request 1 reads block 0 for one step, then finishes
    reqs = [sim.RequestTrace(a, np.array([3, 3])), sim.RequestTrace(b, np.array([3]))]
    steps, total = sim.build_steps(reqs)
    assert total == 2 * 2 + 2 * 2  # tails excluded
    unit = lambda r, layer, blk: ((r * 2 + layer) * 1 + 0) * 3 + blk
    assert steps[0].reads.tolist() == [
        unit(0, 0, 0),
        unit(0, 0, 1),
        unit(1, 0, 0),
        unit(0, 1, 0),
        unit(0, 1, 1),
        unit(1, 1, 0),
    ]
    assert sorted(steps[1].drops.tolist()) == sorted(
        unit(1, layer, k) for layer in (0, 1) for k in (0, 1)
    )
    assert steps[1].fills.size == 0


def test_tail_rollover_is_a_fill_that_hits():
    read = np.zeros((3, 1, 1, 3), dtype=bool)
    read[0, 0, 0, [0, 1]] = True  # tail = block 1
    read[1, 0, 0, [0, 1]] = True  # still the tail
    read[2, 0, 0, [0, 1, 2]] = True  # block 1 is full now, block 2 is the tail
    steps, total = sim.build_steps([sim.RequestTrace(read, np.array([2, 2, 3]))])
    assert total == 2 and steps[2].fills.tolist() == [1]
    assert [s.reads.tolist() for s in steps] == [[0], [0], [0, 1]]
    lru = sim.simulate_lru(steps, 4)
    assert lru.misses.tolist() == [1, 0, 0] and lru.hits.tolist() == [0, 1, 2]
    assert sim.simulate_opt(steps, 4).hits.tolist() == [0, 1, 2]
    assert sim.compulsory_misses(steps).misses.tolist() == [1, 0, 0]


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 8), st.booleans())
def test_unbounded_cache_misses_only_compulsorily(seed, n_req, steps, grow):
    trace, total = sim.build_steps(random_requests(seed, n_req, steps, grow=grow))
    bound = sim.compulsory_misses(trace)
    accesses = sum(len(s.reads) for s in trace)
    first = len(
        {k for s in trace for k in s.reads.tolist()} - {k for s in trace for k in s.fills.tolist()}
    )
    assert int(bound.misses.sum()) == first
    for policy in (sim.simulate_lru, sim.simulate_opt):
        c = policy(trace, max(total, 1))
        assert int(c.misses.sum()) == first and int(c.hits.sum()) == accesses - first
        assert c.hit_rate() == pytest.approx(1 - first / accesses if accesses else 0.0)


@pytest.mark.parametrize("n,slots", [(5, 1), (8, 3), (8, 7)])
def test_cycle_larger_than_cache(n, slots):
    cycles = 6
    read = np.ones((cycles, 1, 1, n + 1), dtype=bool)  # blocks 0..n-1 and the tail
    steps, total = sim.build_steps([sim.RequestTrace(read, np.full(cycles, n + 1))])
    assert total == n
    assert int(sim.simulate_lru(steps, slots).hits.sum()) == 0
    # Belady with bypass keeps the first `slots` units for good: they hit every later cycle.
    assert int(sim.simulate_opt(steps, slots).hits.sum()) == slots * (cycles - 1)
    # A window of one step holds the whole cycle.
    counts, sizes = sim.simulate_window(steps, 1)
    assert counts.hit_rate(warm=True) == 1.0 and sizes[1:].tolist() == [n] * (cycles - 1)


def brute_force_opt(events: list[tuple[int, bool]], slots: int) -> int:
    """Most hits over every admit/bypass/evict choice (exhaustive, tiny inputs only)."""

    @functools.cache
    def best(i: int, resident: frozenset) -> int:
        if i == len(events):
            return 0
        k, is_read = events[i]
        if k in resident:
            return int(is_read) + best(i + 1, resident)
        options = [best(i + 1, resident)]  # bypass
        if len(resident) < slots:
            options.append(best(i + 1, resident | {k}))
        else:
            options += [best(i + 1, (resident - {v}) | {k}) for v in resident]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=1, max_size=14),
    st.integers(1, 3),
)
def test_opt_matches_exhaustive_search(events, slots):
    # Fills come first in a step, and a unit is filled at most once and before any read.
    seen, steps = set(), []
    for k, is_fill in events:
        fill = is_fill and k not in seen
        seen.add(k)
        arr = np.array([k], dtype=np.int64)
        empty = np.zeros(0, dtype=np.int64)
        steps.append(sim.Step(empty, arr if fill else empty, empty if fill else arr))
    flat = [(int(s.fills[0]), False) if s.fills.size else (int(s.reads[0]), True) for s in steps]
    assert int(sim.simulate_opt(steps, slots).hits.sum()) == brute_force_opt(flat, slots)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(2, 10), st.booleans())
def test_opt_beats_lru_and_both_grow_with_the_cache(seed, n_req, steps, grow):
    trace, total = sim.build_steps(random_requests(seed, n_req, steps, grow=grow))
    bound = int(sim.compulsory_misses(trace).hits.sum())
    prev_lru = prev_opt = -1
    for slots in sorted({1, 2, max(1, total // 4), max(1, total // 2), max(1, total)}):
        lru = int(sim.simulate_lru(trace, slots).hits.sum())
        opt = int(sim.simulate_opt(trace, slots).hits.sum())
        assert lru <= opt <= bound
        assert lru >= prev_lru and opt >= prev_opt  # LRU is a stack algorithm; OPT too
        prev_lru, prev_opt = lru, opt


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 10), st.integers(1, 5))
def test_window_matches_set_recount(seed, n_req, steps, w):
    trace, _ = sim.build_steps(random_requests(seed, n_req, steps, grow=True))
    counts, sizes = sim.simulate_window(trace, w)
    for s, step in enumerate(trace):
        ws = set(step.fills.tolist())
        for p in trace[max(0, s - w) : s]:
            ws |= set(p.reads.tolist()) | set(p.fills.tolist())
        hits = sum(k in ws for k in step.reads.tolist())
        assert (counts.hits[s], counts.misses[s], sizes[s]) == (
            hits,
            len(step.reads) - hits,
            len(ws),
        )


def test_hit_rate_warm_skips_the_first_step():
    c = sim.StepCounts(np.array([0, 3, 1]), np.array([4, 1, 3]))
    assert c.hit_rate() == pytest.approx(4 / 12) and c.hit_rate(warm=True) == pytest.approx(4 / 8)
    assert sim.slots_for(10, 95) == 10 and sim.slots_for(1, 20) == 1


def test_runtime_trace_records_read_masks_and_stack_trace_stores_them():
    from sglang_psa.config import PSAConfig
    from sglang_psa.hf.attention import DecodePolicy, PSARuntime

    rec = _load("record_traces")
    rt = PSARuntime()
    torch.manual_seed(0)
    B, Hq, Hkv, d, T, L = 1, 4, 2, 16, 100, 2
    q = torch.randn(B, Hq, 1, d)
    k, v = torch.randn(B, Hkv, T, d), torch.randn(B, Hkv, T, d)
    layers = [torch.nn.Module() for _ in range(L)]
    for i, m in enumerate(layers):
        m.layer_idx = i
    with rt.use(DecodePolicy("psa", PSAConfig(threshold=0.9, block_size=16))):
        rt(layers[0], q, k, v, None)  # trace off: nothing recorded beyond counts
        assert rt.trace is None
        rt.trace = []
        for t in (T, T + 1):  # two steps; the second adds a token (still 7 blocks)
            for m in layers:
                rt(m, q, k[:, :, :t], v[:, :, :t], None)
    assert [e.layer for e in rt.trace] == [0, 1, 0, 1]
    assert all(e.read.dtype == torch.bool and e.read.shape[:2] == (B, Hkv) for e in rt.trace)
    assert [int(e.n_blocks[0]) for e in rt.trace] == [7] * 4
    rt.reset()
    assert len(rt.trace) == 4  # reset() leaves the caller's trace alone
    read, n_blocks = rec.stack_trace(rt.trace, L)
    assert read.shape == (2, L, Hkv, 7) and n_blocks.tolist() == [7, 7]
    assert (read[1, 1] == rt.trace[3].read[0, :, :7].numpy()).all()
    assert read[:, :, :, 0].all() and read[:, :, :, 6].all()  # sink and tail always read
    with pytest.raises(ValueError, match="whole steps"):
        rec.stack_trace(rt.trace[:3], L)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(2, 8), st.booleans())
def test_page_cache_replay_never_beats_opt(seed, n_req, steps, grow):
    """The serving path's direct-mapped PageCache replayed on the same steps gets no more
    hits than Belady's bound at the same size."""
    trace, total = sim.build_steps(random_requests(seed, n_req, steps, grow=grow))
    for slots in sorted({1, max(1, total // 3), max(1, total)}):
        page = int(sim.simulate_page_cache(trace, slots).hits.sum())
        assert page <= int(sim.simulate_opt(trace, slots).hits.sum())
