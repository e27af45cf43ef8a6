"""A packed model's warm start: a replica takes the token budgets another process learnt from
its traffic and the measurements of their graphs, so that its first call captures them and is
served from a graph, without observing calls eagerly or measuring the graphs again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import layergraph
from layergraph.serving.budgets import BudgetPlanner, best_budgets, top_budget
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")
from test_qwen2_vl_adapter import ENTRIES, TOLERANCE, call, qwen2_vl, tower

OBSERVED = 6
STREAM = [ENTRIES[i % len(ENTRIES)] for i in range(3 * OBSERVED)]


class CountingGraphs(SimulatedGraphs):
    """Simulated graphs whose eager calls (10 ms) and replays (1 ms) timed for a measurement
    are counted."""

    def __init__(self) -> None:
        self.timed = {"eager": 0, "replay": 0}
        super().__init__(eager_ms=self._eager_ms, replay_ms=self._replay_ms)

    def _eager_ms(self, tokens: int) -> float:
        self.timed["eager"] += 1
        return 10.0

    def _replay_ms(self, tokens: int) -> float:
        self.timed["replay"] += 1
        return 1.0


def wrapped(model: torch.nn.Module, backend: SimulatedGraphs, **options: Any) -> Any:
    return layergraph.wrap(
        model,
        adapter=qwen2_vl.Qwen2VLAdapter(budget_step=4, max_tokens=256),
        observe_calls=OBSERVED,
        backend=backend,
        **options,
    )


def serve(graphed: Any, model: torch.nn.Module, grids: list[tuple[int, int, int]]) -> None:
    pixels, grid = call(grids)
    with torch.inference_mode():
        got = graphed(pixels, grid_thw=grid).pooler_output
        with graphed.original():
            want = model(pixels, grid_thw=grid).pooler_output
    assert relative_error(got, want) <= TOLERANCE, grids


def test_a_replica_starts_from_the_learnt_budgets_and_their_measurements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    model = tower("qwen2_5_vl")
    first = wrapped(model, CountingGraphs())
    for entry in STREAM:
        serve(first, model, [entry, ENTRIES[0]])
    observed = {r: n for r, n in first.stats.eager_calls.items() if "observing" in r}
    assert sum(observed.values()) == OBSERVED
    budgets, costs = first.stats.budgets, first.stats.costs
    path = tmp_path / "packed.lgws"
    assert first.save_warm_start(path) > 0
    first.unwrap()

    backend = CountingGraphs()
    replica = wrapped(model, backend, warm_start=path)
    assert replica.stats.budgets == budgets  # the plan held at the end, before any call
    serve(replica, model, [ENTRIES[3], ENTRIES[0]])
    stats = replica.stats
    assert stats.eager_total == 0, stats.eager_calls
    assert stats.graphs >= 1 and stats.captures == stats.graphs
    for entry in STREAM:
        serve(replica, model, [entry, ENTRIES[0]])
    stats = replica.stats
    assert stats.eager_total == 0, stats.eager_calls
    assert stats.budgets == budgets and stats.captures == stats.graphs
    assert backend.timed == {"eager": 0, "replay": 0}, "graphs measured again"
    assert stats.costs == costs
    replica.unwrap()


def test_a_planner_started_from_totals_takes_the_plan_given_where_it_fits() -> None:
    planner = BudgetPlanner(step=4, largest=64, cap=3, observed=10)
    assert planner.observing
    planner.start_from({8: 5, 20: 3, 40: 2, 100: 7, 0: 1}, budgets=(40, 12, 24))
    assert not planner.observing
    assert dict(planner.totals) == {8: 5, 20: 3, 40: 2}  # 100 is above largest, 0 no call
    assert planner.budgets == (12, 24, 40)
    planner.start_from({12: 1}, budgets=(64,))  # a plan held stays; the calls count
    assert planner.budgets == (12, 24, 40) and planner.totals[12] == 1


@pytest.mark.parametrize(
    "budgets",
    [(), (10, 40), (8, 16, 24, 40), (8, 20), (8, 20, 80)],
    ids=["none", "off-step", "above-cap", "leaves-a-total-out", "above-largest"],
)
def test_a_planner_started_from_totals_plans_itself_where_the_plan_given_does_not_fit(
    budgets: tuple[int, ...],
) -> None:
    planner = BudgetPlanner(step=4, largest=64, cap=3)
    totals = {8: 5, 20: 3, 40: 2}
    planner.start_from(totals, budgets)
    assert planner.budgets == best_budgets(totals, 3, 4, top_budget(totals, 4, 64))[0]


def test_a_planner_started_from_no_total_it_can_serve_still_observes() -> None:
    planner = BudgetPlanner(step=4, largest=64, cap=3)
    planner.start_from({100: 3}, budgets=(64,))
    assert planner.observing and not planner.totals and not planner.budgets
