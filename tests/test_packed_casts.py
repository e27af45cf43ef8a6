"""Packed towers given pixels of another dtype than their weights, as a processor hands them
(float32 in front of a bfloat16 tower): each family's patch embedding casts them, so graphs
serve such calls, capturing the cast, instead of running them eagerly.

On the CPU with simulated graphs, towers in float64 given float32 pixels: the graph's answer
equals the tower's own on the same float32 pixels (1e-10, float64 rounding), the attention and
its workspace run in the tower's dtype, and no call runs eagerly for its dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import relative_error

pytest.importorskip("transformers")
import test_pixtral_adapter as pixtral
import test_qwen2_vl_adapter as qwen
import test_siglip2_adapter as siglip2

TOLERANCE = 1e-10


def qwen_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    pixels, grid = qwen.call([(1, 4, 6), (2, 2, 2)])
    return (pixels,), {"grid_thw": grid}


def pixtral_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), pixtral.call([(56, 84), (28, 28)])


def siglip2_call() -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), siglip2.call([(3, 5), (2, 2)])


FAMILIES: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any], str]] = {
    "qwen2_vl": (qwen.tower, qwen_call, "pooler_output"),
    "pixtral": (pixtral.tower, pixtral_call, "last_hidden_state"),
    "siglip2": (siglip2.tower, siglip2_call, "pooler_output"),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_float32_pixels_in_front_of_a_float64_tower_are_served_by_graphs(
    family: str, layergraph_registry: Any
) -> None:
    if not layergraph_registry.plugin_manager.is_registered(siglip2.siglip2):
        layergraph_registry.add_plugin(siglip2.siglip2, "siglip2")
    build, make_call, read = FAMILIES[family]
    model = build().double()
    graphed = layergraph.wrap(
        model, adapter=family, observe_calls=0, backend=SimulatedGraphs(), budget_step=16
    )
    assert graphed.plan.casts_inputs
    for _ in range(2):
        args, kwargs = make_call()
        pixels = [t for t in (*args, *kwargs.values()) if t.is_floating_point()]
        assert [t.dtype for t in pixels] == [torch.float32]
        with torch.inference_mode():
            got = getattr(graphed(*args, **kwargs), read)
            with graphed.original():
                want = getattr(model(*args, **kwargs), read)
        assert got.dtype == want.dtype == torch.float64
        assert relative_error(got, want) <= TOLERANCE
    stats = graphed.stats
    assert stats.replays >= 1 and not stats.eager_calls, stats.eager_calls
    assert graphed.plan.computing(torch.device("cpu")).dtype == torch.float64


@pytest.mark.cuda
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("attention", ["auto", "triton"])
def test_float32_pixels_reach_a_bfloat16_towers_graphs_on_a_gpu(
    family: str, attention: str, layergraph_registry: Any
) -> None:
    """The attention backends (the Triton kernel writes a workspace) run in bfloat16 whatever
    the pixels' dtype; the answer is eager's within bfloat16 rounding."""
    if not layergraph_registry.plugin_manager.is_registered(siglip2.siglip2):
        layergraph_registry.add_plugin(siglip2.siglip2, "siglip2")
    build, make_call, read = FAMILIES[family]
    model = build().to("cuda", torch.bfloat16)
    graphed = layergraph.wrap(
        model, adapter=family, observe_calls=0, attention=attention, budget_step=16
    )
    for _ in range(3):
        args, kwargs = make_call()
        args = tuple(t.cuda() for t in args)
        kwargs = {name: t.cuda() for name, t in kwargs.items()}
        with torch.inference_mode():
            got = getattr(graphed(*args, **kwargs), read)
            with graphed.original():
                want = getattr(model(*args, **kwargs), read)
        assert got.dtype == want.dtype == torch.bfloat16
        assert relative_error(got.float(), want.float()) <= 2e-2
    assert graphed.stats.replays >= 1
    assert not any("dtype" in reason for reason in graphed.stats.eager_calls)
