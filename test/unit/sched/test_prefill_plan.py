"""Layer-segmented prefill: every (token, layer) cell exactly once, in dependency order, in budget."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_psa.config import PSAConfig
from sglang_psa.sched import PrefillItem, PrefillPlanner


def run_all(planner: PrefillPlanner) -> list[list[PrefillItem]]:
    batches = []
    while planner.prompts:
        plan = planner.plan()
        planner.advance(plan)
        batches.append(plan.items)
    return batches


def test_short_prompt_runs_all_layers_in_one_batch():
    planner = PrefillPlanner(num_layers=4, max_inject_tokens=100)
    planner.add("a", 100)
    assert run_all(planner) == [[PrefillItem("a", 0, 100, 0, 4)]]


def test_longer_prompt_runs_layer_segments():
    planner = PrefillPlanner(num_layers=4, max_inject_tokens=100)  # 400 token-layers
    planner.add("a", 150)
    assert run_all(planner) == [
        [PrefillItem("a", 0, 150, 0, 2)],
        [PrefillItem("a", 0, 150, 2, 4)],
    ]


def test_prompt_longer_than_one_layer_budget_is_chunked_layer_by_layer():
    planner = PrefillPlanner(num_layers=2, max_inject_tokens=100, align=32)  # 200 token-layers
    planner.add("a", 450, begin=50)  # 400 tokens after a 50-token prefix hit
    assert run_all(planner) == [
        [PrefillItem("a", 50, 224, 0, 1)],  # chunk ends on a block boundary
        [PrefillItem("a", 224, 416, 0, 1)],
        [PrefillItem("a", 416, 450, 0, 1)],  # the prompt's end need not be aligned
        [PrefillItem("a", 50, 224, 1, 2)],
        [PrefillItem("a", 224, 416, 1, 2)],
        [PrefillItem("a", 416, 450, 1, 2)],
    ]


def test_leftover_budget_goes_to_the_next_prompt_and_fifo_stops_at_first_miss():
    planner = PrefillPlanner(num_layers=4, max_inject_tokens=100, align=8)
    planner.add("a", 90)
    planner.add("b", 300)
    planner.add("c", 10)
    plan = planner.plan()
    # a: 360 token-layers; b: 40 left, one layer of 40 tokens; c: nothing left.
    assert plan.items == [PrefillItem("a", 0, 90, 0, 4), PrefillItem("b", 0, 40, 0, 1)]
    assert plan.token_layers == plan.budget == 400
    assert planner.advance(plan) == ["a"]
    assert planner.plan().items == [PrefillItem("b", 40, 300, 0, 1), PrefillItem("c", 0, 10, 0, 4)]


def test_progress_when_budget_is_below_one_aligned_chunk():
    planner = PrefillPlanner(num_layers=1, max_inject_tokens=5, align=32)
    planner.add("a", 100)
    planner.add("b", 3)
    plan = planner.plan()
    assert plan.items == [PrefillItem("a", 0, 32, 0, 1)]  # over budget, but progress
    assert plan.token_layers == 32 > plan.budget


def test_stale_plan_abort_and_from_config():
    planner = PrefillPlanner.from_config(PSAConfig(max_inject_tokens=64, block_size=16), 2)
    assert (planner.budget, planner.align) == (128, 16)
    planner.add("a", 200)
    planner.add("b", 10)
    plan = planner.plan()
    planner.advance(plan)
    with pytest.raises(ValueError, match="stale"):
        planner.advance(plan)
    with pytest.raises(ValueError, match="already"):
        planner.add("a", 5)
    with pytest.raises(ValueError):
        planner.add("c", 5, begin=5)
    planner.abort("a")
    assert planner.plan().items == [PrefillItem("b", 0, 10, 0, 2)]
    planner.check_integrity()


prompts = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 120), st.integers(0, 40)),  # arrival, length, hit
    min_size=1,
    max_size=5,
)


@settings(max_examples=300, deadline=None)
@given(
    num_layers=st.integers(1, 6),
    max_inject=st.integers(1, 80),
    align=st.sampled_from([1, 2, 8, 32]),
    prompts=prompts,
)
def test_plans_cover_every_cell_once_in_dependency_order_within_budget(
    num_layers, max_inject, align, prompts
):
    planner = PrefillPlanner(num_layers, max_inject, align)
    spans = {rid: (min(hit, length - 1), length) for rid, (_, length, hit) in enumerate(prompts)}
    done_at: dict[tuple[int, int, int], tuple[int, int]] = {}  # (rid, token, layer) -> time
    finished_at: dict[int, int] = {}
    batch = 0
    while planner.prompts or len(done_at) < sum((e - b) * num_layers for b, e in spans.values()):
        for rid, (arrival, _, _) in enumerate(prompts):
            if arrival == batch:
                planner.add(rid, spans[rid][1], begin=spans[rid][0])
        plan = planner.plan()
        assert plan == planner.plan(), "plan() must be deterministic and pure"
        items = plan.items
        if planner.prompts:
            assert items, "a batch with pending prompts must make progress"
        assert [i.rid for i in items] == list(planner.prompts)[: len(items)], "FIFO prefix"
        assert plan.token_layers == sum(i.token_layers for i in items)
        if plan.token_layers > plan.budget:  # only the documented progress case
            (item,) = items
            assert item.layer_end - item.layer_begin == 1
            assert item.token_end == min(
                spans[item.rid][1], (item.token_begin // align + 1) * align
            )
        for item in items:
            begin, end = spans[item.rid]
            assert begin <= item.token_begin < item.token_end <= end
            assert 0 <= item.layer_begin < item.layer_end <= num_layers
            assert item.token_end == end or item.token_end % align == 0
            for layer in range(item.layer_begin, item.layer_end):
                for token in range(item.token_begin, item.token_end):
                    cell = (item.rid, token, layer)
                    assert cell not in done_at, f"{cell} covered twice"
                    done_at[cell] = (batch, layer)  # an item runs its layers in order
        for rid in planner.advance(plan):
            finished_at[rid] = batch
        planner.check_integrity()
        batch += 1
        assert batch < 10_000

    assert finished_at.keys() == spans.keys()
    for rid, (begin, end) in spans.items():
        for layer in range(num_layers):
            times = [done_at[(rid, t, layer)] for t in range(begin, end)]  # KeyError: a gap
            # Token t at `layer` needs tokens <= t at `layer` - 1 strictly earlier, and
            # tokens < t at `layer` earlier or in the same item (same batch).
            assert times == sorted(times)
            if layer:
                below = [done_at[(rid, t, layer - 1)] for t in range(begin, end)]
                assert all(max(below[: i + 1]) < times[i] for i in range(len(times)))
        assert (
            finished_at[rid] == max(done_at[(rid, t, num_layers - 1)] for t in range(begin, end))[0]
        )
