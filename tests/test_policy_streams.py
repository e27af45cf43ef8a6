"""Streams of mixed batch sizes through every first-party adapter, with the measured policy.

Tiny SigLIP, CLIP (with feature layers), InternViT and timm towers on the CPU, graphs simulated
with costs that make every way win somewhere: eager pays ``launches`` ms per call, a replay
a fraction of that, and both pay per row. With few graphs allowed, batch sizes are served by
their own graph, padded up, split into chunks or run eagerly, with fresh or static outputs and
with or without validation, and every answer must equal the unwrapped model's within
float32's tolerance (1e-4 relative: padded rows and chunks change which rows a matrix product
sees, not what each row computes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import layergraph
from layergraph.testing import SimulatedGraphs
from layergraph.validation import first_tensor, relative_error

transformers = pytest.importorskip("transformers")
timm = pytest.importorskip("timm")

from test_internvl_adapter import tiny_vlm, vision_config  # noqa: E402
from test_siglip_clip_adapters import IMAGE, clip_config, siglip_config, tiny_llava  # noqa: E402


def towers() -> dict[str, tuple[Callable[[], nn.Module], dict[str, Any]]]:
    """Each tower's builder (the adapters' tests' tiny configurations, 32x32 images) and the
    ``wrap`` options it is streamed with."""
    return {
        "siglip": (
            lambda: transformers.SiglipVisionModel(siglip_config()),
            {"fuse_qkv": True, "patch_matmul": True, "fuse_gelu": True},
        ),
        "clip-features": (
            lambda: transformers.CLIPVisionModel(clip_config()),
            {"feature_layers": -2},
        ),
        "internvl": (
            lambda: transformers.InternVLVisionModel(vision_config(image_size=[IMAGE, IMAGE])),
            {"attention": "sdpa", "fuse_qkv": True, "fuse_gelu": "approximate"},
        ),
        "timm": (
            lambda: timm.create_model(
                "vit_tiny_patch16_224", img_size=IMAGE, num_classes=4, depth=2
            ),
            {},
        ),
    }


def answer(name: str, model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """What a caller of ``name`` reads: the logits, the last hidden state, or (for the feature
    layers' graphs) the second-to-last layer's hidden states."""
    if name == "timm":
        return model(pixels)
    if name == "clip-features":
        return model(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
    return first_tensor(model(pixel_values=pixels))


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    name=st.sampled_from(sorted(towers())),
    stream=st.lists(st.integers(1, 9), min_size=4, max_size=14),
    max_graphs=st.integers(1, 3),
    launches=st.sampled_from([0.0, 2.0, 8.0]),
    static_output=st.booleans(),
    validate=st.booleans(),
)
def test_a_stream_of_mixed_sizes_is_answered_as_eager_would(
    name: str,
    stream: list[int],
    max_graphs: int,
    launches: float,
    static_output: bool,
    validate: bool,
) -> None:
    build, options = towers()[name]
    torch.manual_seed(0)
    model = build().eval()
    backend = SimulatedGraphs(
        eager_ms=lambda rows: launches + 0.5 * rows, replay_ms=lambda rows: 0.1 + 0.5 * rows
    )
    graphed = layergraph.wrap(
        model,
        backend=backend,
        max_graphs=max_graphs,
        static_output=static_output,
        validate=validate,
        **options,
    )
    with torch.inference_mode():
        for batch in stream:
            pixels = torch.randn(batch, 3, IMAGE, IMAGE)
            got = answer(name, graphed, pixels).clone()  # static outputs: the next replay's
            with graphed.original() as original:
                want = answer(name, original, pixels)
            assert got.shape == want.shape
            assert relative_error(got, want) <= 1e-4, (batch, name)
    stats = graphed.stats
    assert stats.graphs <= max_graphs
    assert sum(stats.served.values()) == len(stream)
    assert sum(n for (_, way), n in stats.served.items() if way == "eager") == stats.eager_total


def image_features(model: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    features = model.get_image_features(pixel_values=pixels)
    if not isinstance(features, (torch.Tensor, list, tuple)):
        features = features.pooler_output
    return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features


VLMS: dict[str, tuple[Callable[[], nn.Module], int, int]] = {
    "llava": (lambda: tiny_llava("clip"), IMAGE, 17),
    "internvl": (tiny_vlm, 64, 4),
}
"""Each VLM's builder, its image (or tile) size and its image tokens per image: LLaVA with
CLIP's feature layer, InternVL's tiles."""


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(VLMS)),
    stream=st.lists(st.integers(1, 7), min_size=4, max_size=10),
    max_graphs=st.integers(1, 2),
)
def test_a_vlm_serves_a_stream_of_image_counts_through_its_own_methods(
    name: str, stream: list[int], max_graphs: int
) -> None:
    """A VLM's ``get_image_features`` and forward, its tower graphed in place, on image (or
    tile) counts that the few graphs allowed serve padded, in chunks or eagerly."""
    build, size, tokens = VLMS[name]
    model = build()
    backend = SimulatedGraphs(eager_ms=lambda rows: 4 + rows, replay_ms=lambda rows: rows)
    graphed = layergraph.wrap(model, backend=backend, max_graphs=max_graphs)
    with torch.inference_mode():
        for count in stream:
            pixels = torch.randn(count, 3, size, size)
            got = image_features(graphed, pixels)
            with graphed.original() as original:
                want = image_features(original, pixels)
            assert relative_error(got, want) <= 1e-4, count
            prompt = torch.tensor([[1, 2, *[299] * tokens * count, 3]])
            logits = graphed(input_ids=prompt, pixel_values=pixels).logits
            with graphed.original() as original:
                expected = original(input_ids=prompt, pixel_values=pixels).logits
            assert relative_error(logits, expected) <= 1e-4, count
    assert sum(graphed.stats.served.values()) == 2 * len(stream)
