"""Pixels in another dtype than the tower's: towers that cast their pixels themselves (most
transformers patch embeddings) are served from graphs when a processor hands them float32
pixels in front of bfloat16 weights, as sentence-transformers and pipelines do; towers that
do not cast run such a call eagerly, where the model's own error is explained.

Graphs are simulated on the CPU. The reference is the unwrapped bfloat16 tower on the same
float32 pixels; the graph captures the tower's own cast, and the rest runs the same
kernels, so the tolerance is bfloat16's (2e-2 relative, 1e-2 absolute)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs

transformers = pytest.importorskip("transformers")

RTOL, ATOL = 2e-2, 1e-2
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def tower(class_name: str, config_name: str, **settings: Any) -> nn.Module:
    config = getattr(transformers, config_name)(**SMALL, **settings)
    torch.manual_seed(0)
    return getattr(transformers, class_name)(config).eval().to(torch.bfloat16)


CASTING = {  # name: (build, image size)
    "clip": (lambda: tower("CLIPVisionModel", "CLIPVisionConfig", image_size=32, patch_size=8), 32),
    "siglip": (
        lambda: tower("SiglipVisionModel", "SiglipVisionConfig", image_size=32, patch_size=8),
        32,
    ),
    "dinov2": (lambda: tower("Dinov2Model", "Dinov2Config", image_size=32, patch_size=8), 32),
    "vit": (lambda: tower("ViTModel", "ViTConfig", image_size=32, patch_size=8), 32),
    "internvl": (
        lambda: tower(
            "InternVLVisionModel", "InternVLVisionConfig", image_size=[32, 32], patch_size=[16, 16]
        ),
        32,
    ),
}


def first(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


@pytest.mark.parametrize("name", list(CASTING))
def test_float32_pixels_reach_the_graphs_of_a_bfloat16_tower(name: str) -> None:
    build, size = CASTING[name]
    model = build()
    pixels = torch.randn(3, 3, size, size)
    with torch.inference_mode():
        want = first(model(pixels)).float()
        graphed = layergraph.wrap(model, backend=SimulatedGraphs())
        got = first(graphed(pixels)).float()
        again = first(graphed(pixels.to(torch.bfloat16))).float()
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(again, want, rtol=RTOL, atol=ATOL)
    stats = graphed.stats
    assert stats.eager_total == 0 and stats.replays == 2, stats.eager_calls
    graphed.unwrap()


def test_a_tower_that_does_not_cast_runs_such_calls_eagerly() -> None:
    """AIMv2's patch embedding takes the pixels as they come: float32 pixels in front of
    bfloat16 weights run eagerly, and the model's error names the dtypes first."""
    model = tower("Aimv2VisionModel", "Aimv2VisionConfig", image_size=32, patch_size=8)
    graphed = layergraph.wrap(model, backend=SimulatedGraphs())
    with torch.inference_mode(), pytest.raises(ValueError, match=r"input dtype torch\.float32"):
        graphed(torch.randn(2, 3, 32, 32))
    assert graphed.stats.replays == 0 and graphed.stats.graphs == 0
    graphed.unwrap()
