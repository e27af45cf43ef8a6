"""Token budgets chosen from the traffic (``layergraph.serving.budgets``), checked against brute
force.

The cheapest plans are found here by trying every set of at most ``cap`` budgets among the
totals rounded up to the step, the top among them. The planner observes its first calls, then
must hold at most ``cap`` budgets that serve every total seen, padding them by at most the
least padding under its top plus ``REPLAN_GAIN + GRAPH_WORTH`` of their tokens plus
``CAPTURE_COST`` times the tokens of that least plan's budgets, after every call; and a stream
of mixed image sizes must be served by one plan, under one top.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable, Collection, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layergraph.serving.budgets import (
    CAPTURE_COST,
    GRAPH_WORTH,
    OBSERVED_PER_BUDGET,
    REPLAN_GAIN,
    BudgetPlanner,
    best_budgets,
    padding,
    top_budget,
)

STEP = 16


def plans(totals: Counter[int], cap: int, step: int, top: int) -> Iterator[tuple[int, ...]]:
    """Every plan of at most ``cap`` budgets, ``top`` the largest, the others among the totals
    rounded up to ``step``."""
    candidates = sorted({-(-total // step) * step for total in totals} - {top})
    candidates = [value for value in candidates if value < top]
    for count in range(min(cap - 1, len(candidates)) + 1):
        for others in itertools.combinations(candidates, count):
            yield (*others, top)


def price(totals: Counter[int], budgets: tuple[int, ...], held: Collection[int] | None) -> float:
    """Padding plus the capture cost of every budget not held (none priced with ``None``)."""
    padded = padding(totals, budgets)
    assert padded is not None
    if held is None:
        return padded
    return padded + sum(CAPTURE_COST * b for b in budgets if b not in held)


def least_padding(totals: Counter[int], cap: int, step: int, top: int) -> tuple[int, ...]:
    """The plan under ``top`` with the least padding of ``totals``, by brute force."""
    return min(plans(totals, cap, step, top), key=lambda budgets: padding(totals, budgets))


totals_strategy = st.lists(st.integers(1, 400), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    sizes=totals_strategy,
    cap=st.integers(1, 5),
    room=st.integers(0, 8),
    held=st.none() | st.sets(st.integers(1, 30).map(lambda n: n * STEP), max_size=4),
)
def test_the_best_budgets_are_the_cheapest_or_within_a_graphs_worth_with_fewer(
    sizes: list[int], cap: int, room: int, held: set[int] | None
) -> None:
    totals = Counter(sizes)
    top = -(-max(sizes) // STEP) * STEP + room * STEP
    budgets, cost = best_budgets(totals, cap, STEP, top, held)
    every = list(plans(totals, cap, STEP, top))
    least = min(price(totals, plan, held) for plan in every)
    tokens = sum(sizes)
    assert 1 <= len(budgets) <= cap and budgets[-1] == top
    assert all(b % STEP == 0 for b in budgets)
    assert cost == pytest.approx(price(totals, budgets, held))
    assert least <= cost <= least + GRAPH_WORTH * tokens + 1e-9
    fewer = [plan for plan in every if len(plan) < len(budgets)]
    assert all(price(totals, plan, held) > least + GRAPH_WORTH * tokens for plan in fewer)


@settings(max_examples=150, deadline=None)
@given(sizes=st.lists(st.integers(1, 400), min_size=1, max_size=50), cap=st.integers(1, 5))
def test_after_every_call_the_plan_serves_all_seen_within_the_bound_of_the_least(
    sizes: list[int], cap: int
) -> None:
    planner = BudgetPlanner(STEP, 512, cap)
    for index, size in enumerate(sizes):
        seen = Counter(sizes[: index + 1])
        if planner.observing:
            planner.observe(size)
            assert index < OBSERVED_PER_BUDGET * cap and not planner.budgets
            continue
        budget = planner.budget_for(size)
        assert budget in planner.budgets and budget >= size
        assert len(planner.budgets) <= cap
        top = planner.budgets[-1]
        assert max(seen) <= top <= top_budget(seen, STEP, 512)
        least = least_padding(seen, cap, STEP, top)
        tokens = sum(seen.elements())
        bound = padding(seen, least) + (REPLAN_GAIN + GRAPH_WORTH) * tokens
        bound += CAPTURE_COST * sum(least)
        assert padding(seen, planner.budgets) <= bound


def test_a_stream_of_mixed_image_sizes_gets_eight_budgets_planned_once() -> None:
    """Requests of one to three images of five sizes (Qwen2.5-VL's tokens at 224 to 1344
    pixels), in a seeded random order: many more distinct totals than budgets. After observing
    32 calls the planner takes eight budgets and keeps them for the stream, one plan under one
    top: replacing some would save less padding over the calls seen than their captures cost.
    They pad the stream within 6 % of its tokens of the least eight budgets would."""
    images = [256, 1024, 1536, 4096, 6912]
    stream = [
        images[a] + (images[b] if b >= 0 else 0) + (images[c] if c >= 0 else 0)
        for a, b, c in itertools.islice(
            itertools.cycle(itertools.product(range(5), range(-1, 5), range(-1, 2))), 100
        )
    ]
    random.Random(0).shuffle(stream)
    planner = BudgetPlanner(64, 16384, 8)
    for size in stream:
        if planner.observing:
            planner.observe(size)
            continue
        planner.budget_for(size)
    totals, tokens = Counter(stream), sum(stream)
    least = padding(totals, least_plan(totals, planner.budgets[-1]))
    assert len(totals) > 3 * 8 and len(planner.budgets) == 8
    assert planner.generation == 1 and planner.pools == 1
    assert padding(totals, planner.budgets) <= least + 0.06 * tokens
    assert planner.budget_for(16385) is None


def least_plan(totals: Counter[int], top: int) -> tuple[int, ...]:
    """The least-padding eight budgets under ``top``, by the planner's own programme with
    captures not priced."""
    return best_budgets(totals, 8, 64, top)[0]


def test_a_call_above_the_top_starts_a_new_pool_with_room() -> None:
    planner = BudgetPlanner(16, 4096, 2, observed=4)
    for size in (100, 200, 300, 400):
        planner.observe(size)
    assert not planner.observing
    assert 150 <= planner.budget_for(150) < 512 and planner.top == 512 and planner.pools == 1
    assert planner.budget_for(500) == 512 and planner.pools == 1
    assert planner.budget_for(600) is not None and planner.top == 752 and planner.pools == 2
    assert planner.budget_for(4000) == 4096 and planner.top == 4096 and planner.pools == 3
    assert planner.budget_for(4097) is None


def test_budgets_need_a_step_dividing_the_largest_and_a_cap() -> None:
    with pytest.raises(ValueError, match="largest a multiple of it"):
        BudgetPlanner(64, 1000, 8)
    with pytest.raises(ValueError, match="cap at least 1"):
        BudgetPlanner(64, 1024, 0)
    with pytest.raises(ValueError, match="no token totals"):
        best_budgets(Counter(), 8, 64)
    with pytest.raises(ValueError, match="above every total"):
        best_budgets(Counter([100]), 8, 64, top=64)


def test_a_search_over_many_totals_prices_n_log_n_groups_not_n_squared(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long stream of mixed requests can see a thousand distinct totals (16384 tokens in
    16-token steps); a search runs in the call that triggers it, so it must stay cheap."""
    from layergraph import budgets

    evaluations: list[int] = []
    fill = budgets._fill_level

    def counted(
        previous: list[float],
        row: list[float],
        chosen: list[int],
        k: int,
        n: int,
        group: Callable[[int, int], float],
    ) -> None:
        def priced(first: int, last: int) -> float:
            evaluations.append(1)
            return group(first, last)

        fill(previous, row, chosen, k, n, priced)

    monkeypatch.setattr(budgets, "_fill_level", counted)
    rng = random.Random(0)
    totals = Counter({16 * rng.randrange(1, 1024): rng.randint(1, 4) for _ in range(2000)})
    values = len(totals)
    assert values > 800
    best_budgets(totals, 8, 16)
    assert len(evaluations) < 8 * values * 12  # the quadratic way: 8 * values**2 / 2
