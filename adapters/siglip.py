"""Plugin for SigLIP vision towers from transformers.

Serves ``SiglipVisionModel`` (SigLIP2 checkpoints of fixed resolution load as this class too),
the vision half of ``SiglipModel``, and the SigLIP tower inside VLMs such as PaliGemma or
LLaVA variants built on SigLIP. The whole tower, attention-pooling head included, is captured
per (images, tokens per image); SigLIP has no class token, so a 384x384 image with 14-pixel
patches gives 729 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from layergraph import hookimpl
from layergraph_adapters.hf_vision import VisionTowerAdapter

SIGLIP_CONFIGS: dict[str, dict[str, Any]] = {
    "siglip-so400m-384": dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=384,
        patch_size=14,
    ),
}
"""``SiglipVisionConfig`` settings of well-known towers, for building them with random weights."""


class SiglipAdapter(VisionTowerAdapter):
    """Graphs a SigLIP vision tower, alone or inside a larger model."""

    name = "siglip"
    tower_classes = ("SiglipVisionModel", "SiglipVisionTransformer")
    prefix_tokens = 0
    example_configs = SIGLIP_CONFIGS


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(SiglipAdapter)
