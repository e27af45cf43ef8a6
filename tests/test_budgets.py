"""Token budgets chosen from the traffic (``layergraph.budgets``), checked against brute force.

The best budgets of a stream are found here by trying every set of at most ``cap`` of its
totals rounded up to the step; the planner must hold at most ``cap`` budgets that serve every
total seen, padding them by at most that best plus ``REPLAN_GAIN`` (3 %) of their tokens,
after every call.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layergraph.budgets import (
    GRAPH_WORTH,
    REPLAN_GAIN,
    BudgetPlanner,
    best_budgets,
    padding,
)

STEP = 16


def least_padding(totals: Counter[int], cap: int, step: int) -> int:
    """The least padding of ``totals`` with at most ``cap`` budgets, multiples of ``step``, by
    trying every set of the totals rounded up."""
    candidates = sorted({-(-total // step) * step for total in totals})
    best = None
    for count in range(1, min(cap, len(candidates)) + 1):
        for budgets in itertools.combinations(candidates, count):
            padded = padding(totals, budgets)
            if padded is not None and (best is None or padded < best):
                best = padded
    assert best is not None
    return best


totals_strategy = st.lists(st.integers(1, 400), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(sizes=totals_strategy, cap=st.integers(1, 5))
def test_the_best_budgets_pad_least_or_within_a_graphs_worth_with_fewer(
    sizes: list[int], cap: int
) -> None:
    totals = Counter(sizes)
    budgets, floor = best_budgets(totals, cap, STEP)
    least = least_padding(totals, cap, STEP)
    assert floor == least
    assert 1 <= len(budgets) <= cap and all(b % STEP == 0 for b in budgets)
    assert padding(totals, budgets) <= least + GRAPH_WORTH * sum(sizes)


@settings(max_examples=150, deadline=None)
@given(sizes=totals_strategy, cap=st.integers(1, 5))
def test_after_every_call_the_plan_serves_all_seen_within_the_bound_of_the_best(
    sizes: list[int], cap: int
) -> None:
    planner = BudgetPlanner(STEP, 512, cap)
    for index, size in enumerate(sizes):
        budget = planner.budget_for(size)
        assert budget in planner.budgets and budget >= size
        seen = Counter(sizes[: index + 1])
        assert len(planner.budgets) <= cap
        assert padding(seen, planner.budgets) <= least_padding(seen, cap, STEP) + REPLAN_GAIN * sum(
            seen.elements()
        )


def test_a_stream_of_mixed_image_sizes_gets_eight_budgets_near_the_best() -> None:
    """Requests of one to three images of five sizes (Qwen2.5-VL's tokens at 224 to 1344
    pixels), in a fixed order: many more distinct totals than budgets."""
    images = [256, 1024, 1536, 4096, 6912]
    stream = [
        images[a] + (images[b] if b >= 0 else 0) + (images[c] if c >= 0 else 0)
        for a, b, c in itertools.islice(
            itertools.cycle(itertools.product(range(5), range(-1, 5), range(-1, 2))), 100
        )
    ]
    planner = BudgetPlanner(64, 16384, 8)
    served = [planner.budget_for(size) for size in stream]
    totals, tokens = Counter(stream), sum(stream)
    _, least = best_budgets(totals, 8, 64)
    assert len(totals) > 3 * 8 and len(planner.budgets) == 8
    assert padding(totals, planner.budgets) <= least + REPLAN_GAIN * tokens
    assert sum(served) - tokens <= least + 2 * REPLAN_GAIN * tokens  # earlier plans' calls too
    assert planner.budget_for(16385) is None


def test_budgets_need_a_step_dividing_the_largest_and_a_cap() -> None:
    with pytest.raises(ValueError, match="largest a multiple of it"):
        BudgetPlanner(64, 1000, 8)
    with pytest.raises(ValueError, match="cap at least 1"):
        BudgetPlanner(64, 1024, 0)
    with pytest.raises(ValueError, match="no token totals"):
        best_budgets(Counter(), 8, 64)
