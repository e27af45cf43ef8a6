"""The simulated replay keeps a CUDA graph's contract: recorded operators, no Python.

:class:`layergraph.testing.SimulatedGraphs` records the operators a capture runs
(:mod:`layergraph.tape`) and a replay runs them again on the same storages. These tests show
what that means: Python side effects of the captured function happen at capture and never at
replay, values computed on the host stay baked in, inputs are read from the storages captured,
and a replay's arithmetic equals the function's. Tolerance: float32, the same operators, exact
unless said.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from layergraph.tape import Recorder
from layergraph.testing import SimulatedGraphs


def capture(fn: Any, strict: bool = True) -> tuple[SimulatedGraphs, Any, Any]:
    backend = SimulatedGraphs(strict=strict)
    graph, output = backend.capture(fn, backend.new_pool(), warmup_runs=0)
    return backend, graph, output


def test_a_python_side_effect_at_capture_is_not_repeated_at_replay() -> None:
    source = torch.randn(4)
    seen: list[torch.Tensor] = []
    calls = {"count": 0}

    def fn() -> torch.Tensor:
        calls["count"] += 1
        doubled = source * 2
        seen.append(doubled)
        return doubled + 1

    backend, graph, output = capture(fn)
    source.copy_(torch.randn(4))
    backend.replay(graph)
    assert calls["count"] == 1 and len(seen) == 1
    torch.testing.assert_close(output, source * 2 + 1, rtol=0, atol=0)
    # The tensor the hook kept is a storage the graph writes: it follows the replay too.
    torch.testing.assert_close(seen[0], source * 2, rtol=0, atol=0)


def test_a_value_computed_on_the_host_at_capture_stays_baked_in() -> None:
    source = torch.ones(3)
    scale = {"value": 2.0}

    def fn() -> torch.Tensor:
        return source * scale["value"] + float(len(str(scale["value"])))

    backend, graph, output = capture(fn)
    scale["value"] = 10.0
    backend.replay(graph)
    torch.testing.assert_close(output, torch.full((3,), 5.0), rtol=0, atol=0)


def test_a_host_read_is_baked_in_without_strict() -> None:
    source = torch.tensor([3.0])

    def fn() -> torch.Tensor:
        return torch.zeros(2) + source.item()

    backend, graph, output = capture(fn, strict=False)
    source.fill_(7.0)
    backend.replay(graph)
    torch.testing.assert_close(output, torch.full((2,), 3.0), rtol=0, atol=0)


def test_a_tensor_given_a_new_storage_after_capture_is_not_seen() -> None:
    weight = nn.Parameter(torch.ones(3), requires_grad=False)
    source = torch.ones(3)
    backend, graph, output = capture(lambda: source * weight)
    weight.data = torch.full((3,), 5.0)  # a GPU graph keeps reading the old address
    source.fill_(2.0)
    backend.replay(graph)
    torch.testing.assert_close(output, torch.full((3,), 2.0), rtol=0, atol=0)


def test_in_place_writes_views_and_outputs_that_alias_follow_the_replay() -> None:
    source = torch.randn(2, 6)
    static = torch.zeros(2, 6)

    def fn() -> tuple[torch.Tensor, torch.Tensor]:
        work = source.clone()
        work[:, :3].mul_(2)  # a view of a temporary, written in place
        static.copy_(work)
        return static[:, 1:].t(), work.view(12)

    backend, graph, (view, flat) = capture(fn)
    fresh = torch.randn(2, 6)
    source.copy_(fresh)
    backend.replay(graph)
    expected = fresh.clone()
    expected[:, :3] *= 2
    torch.testing.assert_close(static, expected, rtol=0, atol=0)
    torch.testing.assert_close(view, expected[:, 1:].t(), rtol=0, atol=0)
    torch.testing.assert_close(flat, expected.view(12), rtol=0, atol=0)


def test_a_replay_equals_the_model_on_fresh_inputs_and_keeps_temporaries_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8)).eval()
    static = torch.randn(4, 8)
    with torch.inference_mode():
        backend, graph, output = capture(lambda: model(static))
        for _ in range(3):
            x = torch.randn(4, 8)
            static.copy_(x)
            backend.replay(graph)
            torch.testing.assert_close(output, model(x), rtol=0, atol=0)
    assert graph.tape.operators >= 4
    assert graph.tape.kept == 1  # the output's storage; the layers' intermediates are temporaries


def test_the_recorder_sees_layergraph_kernels_as_one_operator() -> None:
    pytest.importorskip("triton")
    from layergraph.kernels.gated import silu_and_mul

    gate, up = torch.randn(3, 16), torch.randn(3, 16)
    with Recorder(None) as recorder:
        silu_and_mul(gate, up)
    names = [step.func._schema.name for step in recorder.tape()._steps]
    assert "layergraph::silu_and_mul" in names
