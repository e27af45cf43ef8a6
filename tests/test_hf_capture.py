"""The transformers plugin's capture context: mask helpers answer under capture as eagerly.

On the CPU: which releases get the context, and what it changes. On a GPU (marked ``cuda``):
transformers' ViTModel, graphed whole through a plugin adapter, replays attention with the
kernel eager uses, so its graph is faster than eager and within bf16's tolerance of it.
"""

from __future__ import annotations

import sys

import pytest
import torch

import layergraph
from layergraph.plugins import get_registry
from layergraph.validation import DEFAULT_TOLERANCE, relative_error

transformers = pytest.importorskip("transformers")

from transformers import masking_utils  # noqa: E402

from layergraph_adapters import hf_capture  # noqa: E402


def tiny_vit() -> torch.nn.Module:
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=32,
        patch_size=8,
    )
    return transformers.ViTModel(config).eval()


@pytest.mark.parametrize(
    ("version", "applies"),
    [
        ("5.8.1", False),
        ("5.9.0", True),
        ("5.17.0", True),
        ("5.18.0", False),
        ("5.24.0", False),
    ],
)
def test_the_context_is_given_for_the_releases_that_build_masks_under_capture(
    monkeypatch: pytest.MonkeyPatch, version: str, applies: bool
) -> None:
    model = tiny_vit()  # transformers' lazy module may replace itself in sys.modules meanwhile
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    registry = get_registry()
    contexts = registry.capture_contexts(model)
    assert len(contexts) == (1 if applies else 0)


def test_within_the_context_capture_is_not_tracing_for_a_missing_mask(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    original = masking_utils.is_tracing
    proxy = torch.fx.Proxy(torch.fx.Graph().placeholder("mask"))
    with hf_capture.masks_as_eager():
        assert masking_utils.is_tracing() is False
        assert masking_utils.is_tracing(None) is False
        assert masking_utils.is_tracing(proxy) is original(proxy) is True
    assert masking_utils.is_tracing is original


class WholeViT(layergraph.Adapter):
    """The whole model in one graph, as a plugin written from the adapter tutorial would."""

    name = "test-whole-vit"

    def plan(
        self, model: torch.nn.Module, context: layergraph.PlanContext
    ) -> layergraph.WholeForward:
        return layergraph.WholeForward(model)


@pytest.mark.cuda
def test_vit_model_graph_runs_the_eager_attention_kernel() -> None:
    torch.manual_seed(0)
    model = transformers.ViTModel(transformers.ViTConfig(), add_pooling_layer=False)
    model = model.to("cuda", torch.bfloat16).eval()
    inputs = [torch.randn(32, 3, 224, 224, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    with torch.inference_mode():
        expected = [model(pixel_values=x).last_hidden_state for x in inputs]
        graphed = layergraph.wrap(model, adapter=WholeViT())
        got = [graphed(pixel_values=x).last_hidden_state for x in inputs]
    for answer, want in zip(got, expected):
        assert relative_error(answer, want) <= DEFAULT_TOLERANCE[torch.bfloat16]
    costs = graphed.stats.costs[32]
    assert costs.graph_pays, costs
    assert graphed.stats.served[(32, "graph")] == 2
