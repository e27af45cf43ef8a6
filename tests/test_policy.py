"""The measured shape policy (``batch_sizes="auto"``): routes, and a runner that follows them.

The runner's decisions are checked on the CPU with simulated graphs whose costs are functions
of the batch (``SimulatedGraphs(eager_ms=..., replay_ms=...)``), so each test decides which
way wins. Tolerance as in ``test_runner.py``: rows of a linear stack are computed
independently, so outputs agree to 1e-5 (absolute).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import layergraph
from layergraph.serving.policy import GRAPH_MARGIN, Costs, Route, cheapest_route
from layergraph.testing import SimulatedGraphs

ATOL = 1e-5


def wrap_costed(
    model: nn.Module,
    eager_ms: Callable[[int], float],
    replay_ms: Callable[[int], float],
    **options: object,
) -> layergraph.GraphedModule:
    backend = SimulatedGraphs(eager_ms=eager_ms, replay_ms=replay_ms)
    return layergraph.wrap(
        model, adapter=layergraph.SequentialAdapter(), backend=backend, **options
    )


def launch_bound_eager(batch: int) -> float:
    """An eager call that pays 3 ms of launches, and 0.5 ms per row of work."""
    return 3.0 + 0.5 * batch


def graph_replay(batch: int) -> float:
    """A replay that pays no launches and the same work."""
    return 0.1 + 0.5 * batch


# ---- routes over the graphs held ------------------------------------------------------------


def brute_force_cost(batch: int, graph_ms: dict[int, float]) -> float:
    """The cheapest sum of replays covering ``batch`` rows, at most one piece padded."""
    best = float("inf")
    sizes = sorted(graph_ms)
    for count in range(1, batch + 1):
        for pieces in itertools.combinations_with_replacement(sizes, count):
            if sum(pieces) >= batch and sum(pieces) - min(pieces) < batch:
                best = min(best, sum(graph_ms[size] for size in pieces))
    return best


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 9),
    graph_ms=st.dictionaries(
        st.integers(1, 6), st.floats(0.0, 10.0, allow_nan=False), min_size=1, max_size=4
    ),
)
def test_the_route_is_the_cheapest_and_covers_the_batch(
    batch: int, graph_ms: dict[int, float]
) -> None:
    route = cheapest_route(batch, graph_ms)
    assert route is not None
    assert route.cost_ms == pytest.approx(brute_force_cost(batch, graph_ms))
    assert route.cost_ms == pytest.approx(sum(graph_ms[size] for size in route.pieces))
    spans = route.chunks
    assert spans[0][0] == 0 and spans[-1][1] == batch
    assert all(start < stop <= start + size for start, stop, size in spans)  # none empty
    assert all(stop - start == size for start, stop, size in spans[:-1])  # only the last padded


def test_route_descriptions() -> None:
    assert cheapest_route(3, {}) is None
    assert str(cheapest_route(4, {4: 1.0})) == "graph"
    assert str(cheapest_route(13, {16: 4.0, 8: 2.2, 4: 1.5})) == "padded to 16"
    assert str(cheapest_route(13, {16: 9.0, 8: 2.2, 4: 1.5, 1: 0.4})) == "chunks 8+4+1"
    assert Route(5, (4, 1), 2.0).chunks == [(0, 4, 4), (4, 5, 1)]
    assert Costs(2.0, 1.5).graph_pays and not Costs(2.0, 2.5).graph_pays
    assert not Costs(2.0).graph_pays


def test_a_graph_within_the_margin_of_eager_does_not_pay() -> None:
    """Near parity eager serves: a replay must measure under GRAPH_MARGIN of eager's time."""
    assert not Costs(10.0, 10.0).graph_pays
    assert not Costs(10.0, 9.9).graph_pays  # 1 % faster: within what a few calls resolve
    assert Costs(10.0, 9.7).graph_pays
    assert Costs(10.0, 10.0 * GRAPH_MARGIN - 1e-9).graph_pays


# ---- the runner ------------------------------------------------------------------------------


def test_each_size_gets_its_own_graph_by_default(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_costed(mlp_stack, launch_bound_eager, graph_replay)
    with torch.no_grad():
        for batch in (3, 5, 3, 7):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert sorted(key.batch for key in graphed.keys) == [3, 5, 7]
    assert stats.padded_calls == 0 and stats.eager_total == 0
    assert stats.served == {(3, "graph"): 2, (5, "graph"): 1, (7, "graph"): 1}
    assert stats.costs[5] == Costs(launch_bound_eager(5), graph_replay(5))
    assert "batch 3: graph x2 (eager 4.500 ms, graph 1.600 ms)" in str(stats)
    assert stats.size_unit == "batch"


def test_a_graph_slower_than_eager_is_dropped_and_its_batch_runs_eagerly(
    mlp_stack: nn.Sequential,
) -> None:
    """Past 8 rows the replay is slower than eager (the ViTModel of the math path)."""
    graphed = wrap_costed(mlp_stack, launch_bound_eager, lambda b: 1.0 + (b > 8) * 100.0 * b)
    with torch.no_grad():
        for batch in (12, 12, 4):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert [key.batch for key in graphed.keys] == [4]
    assert stats.captures == 2 and stats.slower_graphs == 1
    assert stats.served[(12, "eager")] == 2
    assert stats.eager_calls == {"the graph of batch 12 was not measured faster than eager": 2}
    assert not stats.costs[12].graph_pays


def test_a_bucket_slower_than_eager_is_dropped_too(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_costed(mlp_stack, launch_bound_eager, lambda b: 1e3, batch_sizes=[4])
    with torch.no_grad():
        for batch in (3, 4):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert stats.graphs == 0 and stats.captures == 1 and stats.slower_graphs == 1
    assert stats.eager_calls == {"the graph of batch 4 was not measured faster than eager": 2}


def test_a_size_without_a_graph_is_padded_when_that_was_measured_faster(
    mlp_stack: nn.Sequential,
) -> None:
    """With two graphs allowed and held, a size seen once is measured eagerly on its first call,
    then padded up to the cheapest graph that covers it."""
    graphed = wrap_costed(mlp_stack, launch_bound_eager, graph_replay, max_graphs=2)
    with torch.no_grad():
        for batch in (8, 8, 4, 4, 4):
            graphed(torch.randn(batch, 16))
        for _ in range(2):
            x = torch.randn(5, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert sorted(key.batch for key in graphed.keys) == [4, 8]
    assert stats.served[(5, "eager")] == 1  # measured: 5.5 ms
    assert stats.served[(5, "padded to 8")] == 1  # 4.1 ms, against chunks 4+4 at 4.2 ms
    assert stats.costs[5] == Costs(launch_bound_eager(5))


def test_chunks_serve_a_size_larger_than_every_graph(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_costed(mlp_stack, launch_bound_eager, graph_replay, max_graphs=2)
    with torch.no_grad():
        for batch in (4, 4, 1, 1):
            graphed(torch.randn(batch, 16))
        for _ in range(2):
            x = torch.randn(9, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    assert graphed.stats.served[(9, "chunks 4+4+1")] == 1


def test_a_size_runs_eagerly_when_the_graphs_held_would_be_slower(
    mlp_stack: nn.Sequential,
) -> None:
    """Padding 1 row up to 32 costs more than the launches it saves."""
    graphed = wrap_costed(mlp_stack, launch_bound_eager, graph_replay, max_graphs=1)
    with torch.no_grad():
        for _ in range(4):  # used more often than batch 1 will be seen: it keeps its place
            graphed(torch.randn(32, 16))
        for _ in range(3):
            x = torch.randn(1, 16)
            torch.testing.assert_close(graphed(x), mlp_stack(x), atol=ATOL, rtol=0)
    stats = graphed.stats
    assert stats.served[(1, "eager")] == 3
    assert any("not measured faster than eager" in reason for reason in stats.eager_calls)


def test_rows_that_depend_on_each_other_are_never_padded(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_costed(mlp_stack, launch_bound_eager, graph_replay, max_graphs=1)
    graphed._plan.batch_independent = False
    with torch.no_grad():
        for batch in (8, 8, 8, 5, 5):
            graphed(torch.randn(batch, 16))
    assert graphed.stats.served[(5, "eager")] == 2 and graphed.stats.padded_calls == 0


def test_capture_ahead_of_time_keeps_only_graphs_that_pay(mlp_stack: nn.Sequential) -> None:
    graphed = wrap_costed(mlp_stack, launch_bound_eager, lambda b: 1.0 + (b > 8) * 100.0 * b)
    with torch.no_grad():
        keys = graphed.capture(torch.randn(1, 16), batch_sizes=[1, 4, 16], progress=False)
    assert [key.batch for key in keys] == [4, 1]
    assert graphed.stats.slower_graphs == 1


@settings(max_examples=25, deadline=None)
@given(
    stream=st.lists(st.integers(1, 12), min_size=1, max_size=30),
    max_graphs=st.integers(1, 4),
    launches=st.floats(0.0, 4.0),
    pad_penalty=st.floats(0.0, 1.0),
)
def test_no_call_is_served_a_way_measured_slower_than_eager(
    stream: list[int], max_graphs: int, launches: float, pad_penalty: float
) -> None:
    """Whatever the costs and the traffic: each way a batch was served is, by the
    measurements, no slower than eager (its first eager call aside), and answers are right."""
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16)).eval()

    def eager_ms(batch: int) -> float:
        return launches + 0.5 * batch

    def replay_ms(batch: int) -> float:
        return 0.2 + (0.5 + pad_penalty) * batch

    graphed = wrap_costed(model, eager_ms, replay_ms, max_graphs=max_graphs)
    with torch.no_grad():
        for batch in stream:
            x = torch.randn(batch, 16)
            torch.testing.assert_close(graphed(x), model(x), atol=ATOL, rtol=0)
    for (batch, way), _ in graphed.stats.served.items():
        if way == "eager":
            continue
        if way == "graph":
            assert replay_ms(batch) <= eager_ms(batch)
        elif way.startswith("padded to "):
            assert replay_ms(int(way.removeprefix("padded to "))) < eager_ms(batch)
        else:
            pieces = [int(size) for size in way.removeprefix("chunks ").split("+")]
            assert sum(map(replay_ms, pieces)) < eager_ms(batch)
