"""SGLang's prefill budget as plain arithmetic (`sched.prefill_budget`), by hand, no SGLang."""

import itertools

from sglang_psa.sched.prefill_budget import (
    Demand,
    budget_shortfall,
    held_tokens,
    room_needed,
    stored_tokens,
    strict_shortfall,
)


def test_held_tokens_charge_the_stored_prefill_and_the_clipped_output_to_come():
    # 100 prompt + 10 done - 20 prefix stored, 40 output to come
    assert held_tokens(100, 10, 20, 50, clip=4096) == 130
    assert held_tokens(100, 10, 20, 5000, clip=4096) == 90 + 4096  # the clip binds
    assert held_tokens(100, 60, 0, 50, clip=4096) == 160  # more done than asked: nothing to come
    assert stored_tokens(100, 10, 20) == 90 == held_tokens(100, 10, 20, 10, clip=4096)


def test_budget_shortfall_charges_the_whole_clipped_output():
    assert budget_shortfall(fill=1000, max_new=200, slack=64, rem_total=1000, clip=4096) == 264
    assert budget_shortfall(fill=1000, max_new=9000, slack=0, rem_total=6000, clip=4096) == -904


def test_strict_shortfall_plays_the_requests_forward_shortest_first():
    # new (50 to come, holds 100), A (20, 500), B (200, 300), C done (ignored); reserve 10.
    # Shortest first: A, new, B. Needs: 164 + 30*3 = 254 with nothing ended; 164 - 500 +
    # 60*2 = -216 once A freed 500; 164 - 600 + 210 = -226: 254 needed, 255 to admit.
    demands = [Demand(50, 100), Demand(20, 500), Demand(200, 300), Demand(0, 700)]
    for order in itertools.permutations(demands):
        assert strict_shortfall(100, 64, list(order), cur_rem=1000, reserve=10) == 255 - 1000
    assert strict_shortfall(100, 64, demands, cur_rem=200, reserve=10) == 55
    # A later request dominates when the earlier ones free nothing: 164 + 110 = 274.
    late = [Demand(10, 0), Demand(100, 0)]
    assert strict_shortfall(100, 64, late, cur_rem=274, reserve=10) == 1
    assert strict_shortfall(100, 64, late, cur_rem=275, reserve=10) == 0
    assert strict_shortfall(100, 64, late, cur_rem=300, reserve=10) == -25


def test_room_needed_splits_the_strict_reservation_from_the_prefill():
    assert room_needed(300, None) == (300, 0)  # not the strict path
    assert room_needed(300, 500) == (500, 200)  # 200 only feed the reservation
    assert room_needed(-50, 120) == (120, 120)  # the prefill itself fits
    assert room_needed(300, 100) == (300, 0)
