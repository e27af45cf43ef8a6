"""FLOPs per graph key (``stats.flops``, ``GraphInfo.flops``) and the rate each replay ran at."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layergraph
from layergraph.flops import _varlen_attention_flops, count_flops, tflops
from layergraph.testing import SimulatedGraphs


def mlp_flops(rows: int) -> int:
    """Two matrix products of ``rows`` rows, 16 by 32 and 32 by 16: 2 * rows * 16 * 32 each."""
    return 2 * (2 * rows * 16 * 32)


@pytest.mark.quick
def test_each_keys_flops_are_its_graphs_padding_included(mlp_stack: nn.Sequential) -> None:
    graphed = layergraph.wrap(
        mlp_stack,
        adapter=layergraph.SequentialAdapter(),
        backend=SimulatedGraphs(),
        batch_sizes=[1, 4],
    )
    with torch.inference_mode():
        for batch in (1, 3, 4):
            graphed(torch.randn(batch, 16))
    stats = graphed.stats
    assert stats.flops == {1: mlp_flops(1), 4: mlp_flops(4)}  # 3 rows replay the graph of 4
    assert {info.key.batch: info.flops for info in graphed.graphs} == stats.flops
    assert stats.achieved_tflops == {}  # the simulated replays take no time
    assert "8.19e-06 GFLOP" in str(stats) and "TFLOP/s" not in str(stats)


def test_a_measured_replay_has_its_rate(mlp_stack: nn.Sequential) -> None:
    graphed = layergraph.wrap(
        mlp_stack,
        adapter=layergraph.SequentialAdapter(),
        backend=SimulatedGraphs(eager_ms=lambda rows: 2.0, replay_ms=lambda rows: 0.5),
    )
    with torch.inference_mode():
        graphed(torch.randn(2, 16))
    stats = graphed.stats
    graph_ms = stats.costs[2].graph_ms
    assert graph_ms is not None and stats.graphs == 1
    assert stats.achieved_tflops == {2: pytest.approx(mlp_flops(2) / 0.5 / 1e9)}
    assert "GFLOP at" in str(stats) and "TFLOP/s" in str(stats)


def test_flops_are_forgotten_with_the_model_and_counted_again(mlp_stack: nn.Sequential) -> None:
    graphed = layergraph.wrap(
        mlp_stack, adapter=layergraph.SequentialAdapter(), backend=SimulatedGraphs()
    )
    with torch.inference_mode():
        graphed(torch.randn(2, 16))
        assert graphed.stats.flops == {2: mlp_flops(2)}
        mlp_stack[0] = nn.Linear(16, 32)  # a swapped layer: every graph and count dropped
        graphed(torch.randn(2, 16))
        graphed(torch.randn(2, 16))
    assert graphed.stats.invalidations == 1
    assert graphed.stats.flops == {2: mlp_flops(2)}


def test_count_flops_counts_what_runs() -> None:
    layer = nn.Linear(8, 4)
    assert count_flops(lambda: layer(torch.randn(3, 8))) == 2 * 3 * 8 * 4
    assert count_flops(lambda: torch.randn(3, 8).relu()) == 0  # no formula: a floor
    assert tflops(2 * 10**12, 1000.0) == pytest.approx(2.0)


def test_varlen_attention_counts_each_sequence_on_its_own() -> None:
    heads, head_dim = 2, 8
    q = torch.randn(8, heads, head_dim)
    seq_lens = torch.tensor([3, 5], dtype=torch.int32)
    cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32)
    flops = _varlen_attention_flops(q, q, q, q, cu_seqlens, seq_lens, 5, 1.0)
    assert flops == 4 * heads * head_dim * (3 * 3 + 5 * 5)  # not 8 * 8: no cross-sequence work
