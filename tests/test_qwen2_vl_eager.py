"""Calls of a packed tower served eagerly run the tower's own forward, and a graph must beat it.

On the CPU through simulated graphs whose costs the tests set. A call served eagerly (its
budget's graph measured slower, above every budget, training mode) must give exactly the
unwrapped tower's answer (``torch.equal``: the same computation, not an approximation of it),
hand nothing to the adapter's attention backend and compute none of the host metadata a graph
needs. A graph's measured cost must include the host work a call of its grids pays: reading
the call and loading its metadata, computed once per grids and kept. A call holding an image
above every budget is split around it: that image runs eagerly, the rest from graphs, and the
joined answer equals the tower's within 1e-4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import layergraph
from layergraph.attention import SdpaMaskedAttention
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")
from test_qwen2_vl_adapter import TOLERANCE, call, check, qwen2_vl
from test_qwen2_vl_streams import answer, model

BUDGET = 128
SMALL = [(1, 4, 6), (2, 2, 2)]
OTHERS = ([(1, 8, 8), (1, 6, 4)], [(1, 6, 10), (1, 2, 2)])
"""Calls that fit the budget of 128 tokens, with other grids than :data:`SMALL`."""
BIG = [(1, 16, 12)]
"""One image of 192 tokens, above the budget."""


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each computation of host metadata (boundaries, positions, windows, position table
    rows), by the number of grid entries it is given (one: a call's is joined from its
    entries')."""
    reads: list[int] = []
    compute = qwen2_vl.Qwen2VLPlan._compute_host_call

    def counted(plan: Any, grid: torch.Tensor) -> Any:
        reads.append(grid.shape[0])
        return compute(plan, grid)

    monkeypatch.setattr(qwen2_vl.Qwen2VLPlan, "_compute_host_call", counted)
    return reads


@pytest.fixture
def routed_runs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each run of the adapter's attention backend (``sdpa_varlen``), by its tokens."""
    runs: list[int] = []
    attend = SdpaMaskedAttention.__call__

    def counted(backend: Any, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        runs.append(q.shape[0])
        return attend(backend, q, *args, **kwargs)

    monkeypatch.setattr(SdpaMaskedAttention, "__call__", counted)
    return runs


def towers_answer(graphed: Any, tower: nn.Module, grids: list[tuple[int, int, int]]) -> None:
    """Assert that ``graphed`` answers a fresh call exactly as the unwrapped tower does."""
    pixels, grid = call(grids)
    with torch.inference_mode():
        got = answer(graphed(pixels, grid_thw=grid))
        with graphed.original():
            want = answer(tower(pixels, grid_thw=grid))
    assert len(got) == len(want)
    for part, expected in zip(got, want):
        assert torch.equal(part, expected), grids


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_calls_served_eagerly_run_the_towers_own_forward_and_read_nothing_for_graphs(
    kind: str, host_reads: list[int], routed_runs: list[int]
) -> None:
    tower = model(kind)
    backend = SimulatedGraphs(eager_ms=lambda tokens: 1.0, replay_ms=lambda tokens: 2.0)
    graphed = layergraph.wrap(
        tower,
        observe_calls=0,
        adapter="qwen2_vl",
        backend=backend,
        batch_sizes=[BUDGET],
        validate=False,
    )
    try:
        pixels, grid = call(SMALL)
        with torch.inference_mode():
            graphed(pixels, grid_thw=grid)  # captured, measured, dropped
        assert graphed.stats.slower_graphs == 1 and graphed.stats.graphs == 0
        host_reads.clear()
        routed_runs.clear()
        for grids in (*OTHERS, BIG):
            towers_answer(graphed, tower, grids)
        tower.train()
        towers_answer(graphed, tower, SMALL)
        tower.eval()
        assert host_reads == [] and routed_runs == []
        assert graphed.stats.eager_calls == {
            "the graph of batch 128 was not measured faster than eager": 3,
            "an image of this call is above the largest token budget (128)": 1,
            "model is in training mode": 1,
        }
    finally:
        graphed.unwrap()


class HostPricedGraphs(SimulatedGraphs):
    """Simulated graphs whose measured replays cost 1 ms, plus 20 ms for each time the call's
    host metadata is computed during them (the count read from ``reads``); eager calls 10 ms."""

    def __init__(self, reads: list[int]) -> None:
        super().__init__(eager_ms=lambda tokens: 10.0)
        self.reads = reads

    def time_replay(self, fn: Any, rows: int) -> float:
        before = len(self.reads)
        fn()
        return 1.0 + 20.0 * (len(self.reads) - before)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen3_vl"])
def test_a_graph_is_measured_with_the_host_work_a_call_of_its_grids_pays(
    kind: str, host_reads: list[int]
) -> None:
    tower = model(kind)
    graphed = layergraph.wrap(
        tower,
        observe_calls=0,
        adapter="qwen2_vl",
        backend=HostPricedGraphs(host_reads),
        batch_sizes=[BUDGET],
    )
    try:
        check(graphed, tower, SMALL)
        # The metadata computed for the capture is kept for the call's grids: the measured
        # replays read the call again and load it, but compute none, as a later call of the
        # same sizes does not.
        assert host_reads == [1] * len(SMALL)
        costs = graphed.stats.costs[BUDGET]
        assert costs.graph_ms == 1.0 and costs.eager_ms == 10.0
        assert graphed.stats.slower_graphs == 0 and graphed.stats.graphs == 1
        check(graphed, tower, OTHERS[0])
        assert host_reads == [1] * (len(SMALL) + len(OTHERS[0]))
    finally:
        graphed.unwrap()


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("budgets", ["auto", [64, 128]])
def test_a_call_is_split_around_an_image_above_every_budget(kind: str, budgets: Any) -> None:
    tower = model(kind)
    graphed = layergraph.wrap(
        tower,
        observe_calls=0,
        adapter=qwen2_vl.Qwen2VLAdapter(budget_step=32, max_tokens=BUDGET),
        backend=SimulatedGraphs(),
        batch_sizes=budgets,
    )
    grids = [(1, 4, 6), *BIG, (1, 8, 8), (2, 2, 2)]  # 24 | 192 | 64 + 8 tokens
    try:
        pixels, grid = call(grids)
        with torch.inference_mode():
            got = answer(graphed(pixels, grid_thw=grid))
            with graphed.original():
                want = answer(tower(pixels, grid_thw=grid))
        assert [t.shape for t in got] == [t.shape for t in want]
        for part, expected in zip(got, want):
            assert relative_error(part, expected) <= TOLERANCE
        stats = graphed.stats
        assert stats.split_calls == 1 and stats.replays == 2
        assert stats.served[(288, "split into 3 calls, 1 eager")] == 1
        assert stats.eager_calls == {
            "an image of this call is above the largest token budget (128): it ran eagerly, "
            "the rest from graphs": 1
        }
    finally:
        graphed.unwrap()


def test_an_eager_call_moves_a_grid_on_the_host_beside_the_pixels() -> None:
    """The tower computes positions from ``grid_thw`` beside the pixels, so an eager call
    hands it a grid on the pixels' device; a grid already there is passed as it is."""
    pixels, grid = torch.zeros(4, 2, device="meta"), torch.tensor([[1, 2, 2]])
    for args, kwargs in (((pixels, grid), {}), ((pixels,), {"grid_thw": grid})):
        moved_args, moved_kwargs = qwen2_vl._grid_beside_pixels(args, kwargs)
        moved = moved_kwargs.get("grid_thw", moved_args[-1])
        assert moved.device == pixels.device and moved_args[0] is pixels
    on_device = torch.tensor([[1, 2, 2]], device="meta")
    assert qwen2_vl._grid_beside_pixels((pixels, on_device), {})[0][1] is on_device
