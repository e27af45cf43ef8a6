"""Llama 3.2 Vision's tower (``MllamaVisionModel``): tiles of images, two encoders.

A call takes ``pixel_values`` of shape ``[batch, images, tiles, channels, height, width]``
(each image cut into the configuration's ``max_num_tiles`` tiles, padded with empty ones),
``aspect_ratio_ids`` ``[batch, images]`` and ``aspect_ratio_mask`` ``[batch, images, tiles]``.
The tower embeds each tile, adds position embeddings chosen by the aspect ratio, runs a local
encoder over each image's tiles, then a gated global encoder, and joins the local encoder's
intermediate states to the result. Everything runs on the GPU from those three tensors (the
aspect-ratio mask becomes an additive attention mask by tensor arithmetic, with no host
decision), so the whole forward is one graph per (batch, images, tiles) whose inputs are all
three; padded calls get zero rows, whose masks exclude nothing real. Rows of the batch never
attend to each other.

The local encoder's layers are the ones ``hidden_states`` would index; feature layers are not
offered, since the tower's output joins several of them itself.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

from layergraph.keys import CallInputs
from layergraph_adapters.kit.automatic import SpeedChoices
from layergraph_adapters.kit.hf_vision import VisionTowerPlan
from layergraph_adapters.kit.tokens import TileTokens
from layergraph_adapters.kit.tower_specs import TowerSpec, find_module

__all__ = ["MllamaVisionPlan", "tiles_of_images"]

GLOBAL_LAYERS = ("global_transformer.layers",)
"""Where the global encoder's layers live."""


def tiles_of_images(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """What ``MllamaModel`` passes its tower for ``batch`` prompts of one image each, every
    image cut into all ``max_num_tiles`` tiles (the aspect ratio that uses them all)."""
    tiles = config.max_num_tiles
    ratios = [tuple(ratio) for ratio in config.supported_aspect_ratios]
    ratio_id = 1 + next(i for i, (h, w) in enumerate(ratios) if h * w == tiles)
    pixels = torch.randn(batch, 1, tiles, config.num_channels, *size, dtype=dtype, device=device)
    return {
        "pixel_values": pixels,
        "aspect_ratio_ids": torch.full((batch, 1), ratio_id, device=device),
        "aspect_ratio_mask": torch.ones(batch, 1, tiles, dtype=torch.long, device=device),
    }


class MllamaVisionPlan(VisionTowerPlan):
    """``MllamaVisionModel``'s whole forward, keyed by (batch, images x tiles x tokens)."""

    def __init__(
        self,
        tower: nn.Module,
        spec: TowerSpec,
        *,
        feature_layers: int | list[int] | None = None,
        choices: SpeedChoices,
    ) -> None:
        if feature_layers is not None:
            raise ValueError(
                "feature_layers is not available for Mllama's tower: its output already joins "
                "the local encoder's intermediate states (intermediate_layers_indices)"
            )
        found = find_module(tower, GLOBAL_LAYERS)
        self._global_layers = found[1] if found is not None else nn.ModuleList()
        self.max_tiles: int = tower.config.max_num_tiles
        super().__init__(tower, spec, choices=choices)

    def layers(self) -> list[nn.Module]:
        return [*super().layers(), *self._global_layers]

    def sequence_of(self, call: CallInputs) -> Hashable:
        _, images, tiles, _, height, width = call.argument("pixel_values", 0).shape
        return TileTokens(images, tiles, self.image_tokens(height, width).tokens, height, width)

    def check_inputs(self, call: CallInputs) -> None:
        pixels = call.argument("pixel_values", 0)
        if not isinstance(pixels, torch.Tensor) or pixels.dim() != 6:
            shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else None
            raise ValueError(
                f"expected pixel_values of shape [batch, images, tiles, channels, height, "
                f"width], got {shape}"
            )
        batch, images, tiles, channels, height, width = pixels.shape
        if channels != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {channels}")
        if tiles != self.max_tiles:
            raise ValueError(
                f"expected {self.max_tiles} tiles per image (max_num_tiles, empty tiles "
                f"included), got {tiles}"
            )
        self.check_image_size(height, width, call)
        expected = {
            "aspect_ratio_ids": (batch, images),
            "aspect_ratio_mask": (batch, images, tiles),
        }
        for position, (name, shape) in enumerate(expected.items(), start=1):
            value = call.argument(name, position)
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                got = tuple(value.shape) if isinstance(value, torch.Tensor) else value
                raise ValueError(f"expected {name} of shape {shape}, got {got}")
