"""Pixtral-12B's vision tower for benchmarks: configuration, inputs, and the hand-written graph
layergraph is measured against.

The same functions as ``qwen_towers.py`` beside it, for ``PixtralVisionModel``: calls are a
padded batch of images (``pixel_values``) with each image's size (``image_sizes``), as
Pixtral's processor makes them, and what a VLM reads is the last hidden state. The hand-written
graph is what a user writes without layergraph: the tower's own forward for one exact set of
image sizes (given as a host list, so that its forward reads nothing from the device), inside
``torch.cuda.graph``. Used by ``benchmarks/packed_towers.py``; nothing here serves calls.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import transformers
from qwen_towers import Tower
from torch import nn

from layergraph_adapters.pixtral import PIXTRAL_SUPPORT

ADAPTER = "pixtral"
"""The layergraph adapter that serves these towers."""
WRAP_OPTIONS = {"feature_layers": -1}
"""The adapter's options: the hidden state Mistral 3 reads (its ``vision_feature_layer``), which
wrapping the VLM sets by itself."""


def towers(tiny: bool) -> list[Tower]:
    """Pixtral-12B's vision tower (``PixtralVisionConfig``'s defaults, which transformers
    documents as Pixtral-12B's: hidden 1024, 24 layers, 16 heads, patch 16, images up to 1024
    pixels a side, rope theta 10000), or a four-layer one like it."""
    settings: dict[str, Any] = {}
    if tiny:
        settings = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=2,
            patch_size=14,
            image_size=280,
        )
    return [
        Tower(
            "pixtral-12b" if not tiny else "pixtral-tiny",
            "transformers.models.pixtral.modeling_pixtral",
            "PixtralVisionModel",
            lambda: transformers.PixtralVisionConfig(**settings),
            kit="pixtral_towers",
            served_with=PIXTRAL_SUPPORT.checked,
        )
    ]


def grid_for(config: Any, width: int, height: int, frames: int = 1) -> tuple[int, int, int]:
    """The (1, rows, columns) patch grid of an image for a tower of ``config``: scaled down to
    fit ``image_size`` a side, its sides rounded up to whole patches, as Pixtral's processor
    resizes images. ``frames`` must be 1 (no videos)."""
    if frames != 1:
        raise ValueError("Pixtral's tower takes images, not videos")
    patch, largest = config.patch_size, config.image_size
    scale = min(1.0, largest / max(width, height))
    rows, columns = (max(1, -(-round(length * scale) // patch)) for length in (height, width))
    return (1, rows, columns)


def pixels_for(
    model: nn.Module, grids: list[tuple[int, int, int]], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random images of ``grids`` padded to the largest sides (random pixels in the padding),
    in the tower's dtype and device, and ``image_sizes`` on the device."""
    patch = model.config.patch_size
    height = max(rows for _, rows, _ in grids) * patch
    width = max(columns for _, _, columns in grids) * patch
    parameter = next(model.parameters())
    pixels = torch.randn(len(grids), 3, height, width, generator=generator).to(parameter)
    sizes = [(rows * patch, columns * patch) for _, rows, columns in grids]
    return pixels, torch.tensor(sizes, device=parameter.device)


def call(model: nn.Module, pixels: torch.Tensor, sizes: torch.Tensor) -> Any:
    """One call of the tower (or its wrapper), as Mistral 3 makes it: for the last hidden state
    (with transformers 5.17, which takes any true ``output_hidden_states`` for all of them, for
    every hidden state, as its Mistral 3 asks)."""
    return model(pixels, image_sizes=sizes, output_hidden_states=-1)


def features(output: Any) -> torch.Tensor:
    """What a VLM reads: the last hidden state (``vision_feature_layer`` -1)."""
    return output.last_hidden_state


def stream_requests(
    config: Any, count: int, sizes: tuple[tuple[int, int], ...], seed: int
) -> list[list[tuple[int, int, int]]]:
    """``count`` requests of 1 to 3 images of ``sizes`` for a tower of ``config``."""
    rng = random.Random(seed)
    return [
        [grid_for(config, *rng.choice(sizes)) for _ in range(rng.randint(1, 3))]
        for _ in range(count)
    ]


class HandGraph:
    """One exact set of image sizes captured by hand: the tower's forward inside
    ``torch.cuda.graph`` (on a CPU it runs eagerly). Calls copy new images into the static
    input and return the graph's static output."""

    def __init__(self, model: nn.Module, pixels: torch.Tensor, sizes: torch.Tensor) -> None:
        self.model, self.static = model, pixels.clone()
        self.sizes = [tuple(size) for size in sizes.tolist()]
        self.graph = None
        if pixels.is_cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._forward()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.output = self._forward()

    def _forward(self) -> Any:
        return self.model(self.static, image_sizes=self.sizes, output_hidden_states=-1)

    def __call__(self, pixels: torch.Tensor) -> Any:
        self.static.copy_(pixels)
        if self.graph is None:
            return self._forward()
        self.graph.replay()
        return self.output
