"""Plugin for CLIP vision towers from transformers.

Serves ``CLIPVisionModel``, ``CLIPVisionModelWithProjection`` (projection included), the vision
half of ``CLIPModel``, and the CLIP tower inside LLaVA and LLaVA-NeXT. The whole tower is
captured per (images, tokens per image): ViT-L/14 at 336x336 gives 577 tokens, class token
included. Inside a VLM the graphs follow its ``vision_feature_layer`` (LLaVA reads layer -2,
so the graph stops one layer early).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layergraph import hookimpl
from layergraph_adapters.hf_vision import VisionTowerAdapter

CLIP_CONFIGS: dict[str, dict[str, Any]] = {
    "clip-vit-l-336": dict(
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=24,
        num_attention_heads=16,
        image_size=336,
        patch_size=14,
        projection_dim=768,
    ),
}
"""``CLIPVisionConfig`` settings of well-known towers, for building them with random weights."""


class ClipAdapter(VisionTowerAdapter):
    """Graphs a CLIP vision tower, alone or inside a larger model."""

    name = "clip"
    tower_classes = ("CLIPVisionModel", "CLIPVisionModelWithProjection", "CLIPVisionTransformer")
    prefix_tokens = 1
    example_configs = CLIP_CONFIGS


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(ClipAdapter)
