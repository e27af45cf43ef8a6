"""Example models of the native-resolution towers (the ``qwen2_vl``, ``pixtral`` and
``siglip2`` plugins' families) and of a VLM holding one: random images of any sizes laid out
and resized as each family's processor does, and, for a VLM, prompts around them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layergraph.bench.examples import ExampleModel
from layergraph_adapters.kit.tower_specs import TowerExample, build_tower, transformers_class

__all__ = [
    "EXAMPLE_IMAGE_SIZE",
    "PACKED_EXAMPLES",
    "PROMPT_TEXT_TOKENS",
    "PackedExample",
    "packed_example",
    "packed_example_model",
    "pixtral_inputs",
    "qwen_inputs",
    "qwen_prompt",
    "siglip2_inputs",
]

EXAMPLE_IMAGE_SIZE = 448
"""The side, in pixels, of the square images an example tower's inputs hold unless asked for
others."""

PROMPT_TEXT_TOKENS = 32
"""Text tokens around the images of an example VLM's prompt."""

Sizes = Sequence[tuple[int, int]]
Call = tuple[tuple[Any, ...], dict[str, Any]]


def qwen_inputs(config: Any, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Call:
    """The patches of images of ``sizes`` as the Qwen and GLM towers take them (rows of
    ``in_channels * temporal_patch_size * patch_size**2`` values) and ``grid_thw``, each side
    rounded to the nearest multiple of patch times merge size, as the processors resize
    images."""
    factor = config.patch_size * config.spatial_merge_size
    grids = [
        [1, *(max(factor, round(side / factor) * factor) // config.patch_size for side in size)]
        for size in sizes
    ]
    features = config.in_channels * config.temporal_patch_size * config.patch_size**2
    tokens = sum(rows * columns for _, rows, columns in grids)
    pixels = torch.randn(tokens, features, dtype=dtype, device=device)
    return (pixels,), {"grid_thw": torch.tensor(grids, device=device)}


def qwen_prompt(
    config: Any, sizes: Sizes, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """:data:`PROMPT_TEXT_TOKENS` random text tokens with the images in their middle, each
    image one image token per merged patch between the vision start and end tokens, as the
    Qwen processors lay them out; ``pixel_values`` and ``image_grid_thw`` as
    :func:`qwen_inputs` makes them for the VLM's tower."""
    vision = config.vision_config
    (pixels,), tower_inputs = qwen_inputs(vision, sizes, dtype, device)
    grids = tower_inputs["grid_thw"]
    images = []
    for _, rows, columns in grids.tolist():
        merged = rows * columns // vision.spatial_merge_size**2
        images += [
            config.vision_start_token_id,
            *[config.image_token_id] * merged,
            config.vision_end_token_id,
        ]
    vocabulary = config.get_text_config().vocab_size
    text = torch.randint(
        min(1000, vocabulary // 2), min(100000, vocabulary), (PROMPT_TEXT_TOKENS,)
    ).tolist()
    half = PROMPT_TEXT_TOKENS // 2
    ids = [*text[:half], *images, *text[half:]]
    return {
        "input_ids": torch.tensor([ids], device=device),
        "pixel_values": pixels,
        "image_grid_thw": grids,
    }


def pixtral_inputs(config: Any, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Call:
    """Images of ``sizes`` scaled down to fit ``image_size`` a side and their sides rounded up
    to whole patches, as Pixtral's processor resizes them, padded to the largest into one
    batch of random pixels, and ``image_sizes``."""
    patch, largest = config.patch_size, config.image_size
    padded = []
    for height, width in sizes:
        scale = min(1.0, largest / max(height, width))
        padded.append(
            tuple(-(-max(1, round(side * scale)) // patch) * patch for side in (height, width))
        )
    rows = max(height for height, _ in padded)
    columns = max(width for _, width in padded)
    pixels = torch.randn(len(sizes), config.num_channels, rows, columns, dtype=dtype, device=device)
    return (pixels,), {"image_sizes": torch.tensor(padded, device=device)}


def siglip2_inputs(config: Any, sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Call:
    """A padded batch of images of ``sizes`` as SigLIP2's processor gives it with
    ``max_num_patches`` the configuration's ``num_patches``: each image resized to at most that
    many patches, keeping its aspect; random patches, ``pixel_attention_mask`` and
    ``spatial_shapes``."""
    from transformers.models.siglip2.image_processing_siglip2 import (
        get_image_size_for_max_num_patches,
    )

    patch, most = config.patch_size, config.num_patches
    grids = [
        tuple(side // patch for side in get_image_size_for_max_num_patches(h, w, patch, most))
        for h, w in sizes
    ]
    mask = torch.zeros(len(sizes), most, dtype=torch.int32, device=device)
    for row, (rows, columns) in enumerate(grids):
        mask[row, : rows * columns] = 1
    features = config.num_channels * patch * patch
    pixels = torch.randn(len(sizes), most, features, dtype=dtype, device=device)
    return (pixels * mask[..., None].to(dtype),), {
        "pixel_attention_mask": mask,
        "spatial_shapes": torch.tensor(grids, device=device),
    }


@dataclass(frozen=True)
class PackedExample:
    """A tower (or a VLM holding one) of a native-resolution family, as an example."""

    adapter: str
    example: TowerExample
    inputs: Callable[[Any, Sizes, torch.dtype, torch.device], Call]
    """A call of the tower of a configuration on images of given sizes."""
    prompt: Callable[[Any, Sizes, torch.dtype, torch.device], dict[str, Any]] | None = None
    """For a VLM: one prompt's keyword inputs around images of given sizes."""


_QWEN2_5_VL_TOWER = dict(
    depth=32,
    hidden_size=1280,
    num_heads=16,
    intermediate_size=3420,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    spatial_merge_size=2,
    patch_size=14,
    temporal_patch_size=2,
)
"""Qwen2.5-VL's tower (every size of the family has it), but for its output width."""

PACKED_EXAMPLES: dict[str, PackedExample] = {
    "qwen2.5-vl-7b": PackedExample(
        "qwen2_vl",
        TowerExample(
            "qwen2_5_vl.Qwen2_5_VisionTransformerPretrainedModel",
            {**_QWEN2_5_VL_TOWER, "out_hidden_size": 3584},
        ),
        qwen_inputs,
    ),
    "qwen3-vl-8b": PackedExample(
        "qwen2_vl",
        TowerExample(
            "qwen3_vl.Qwen3VLVisionModel",
            dict(
                depth=27,
                hidden_size=1152,
                num_heads=16,
                intermediate_size=4304,
                out_hidden_size=4096,
                num_position_embeddings=2304,
                deepstack_visual_indexes=[8, 16, 24],
                spatial_merge_size=2,
                patch_size=16,
                temporal_patch_size=2,
            ),
        ),
        qwen_inputs,
    ),
    "qwen3.5": PackedExample(
        "qwen2_vl", TowerExample("qwen3_5.Qwen3_5VisionModel", {}), qwen_inputs
    ),
    "glm-4.1v-9b": PackedExample(
        "qwen2_vl", TowerExample("glm4v.Glm4vVisionModel", {}), qwen_inputs
    ),
    "qwen2.5-vl-3b": PackedExample(
        "qwen2_vl",
        TowerExample(
            "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
            dict(
                vision_config={**_QWEN2_5_VL_TOWER, "out_hidden_size": 2048},
                text_config=dict(
                    hidden_size=2048,
                    intermediate_size=11008,
                    num_hidden_layers=36,
                    num_attention_heads=16,
                    num_key_value_heads=2,
                    vocab_size=151936,
                    max_position_embeddings=32768,
                    rope_parameters=dict(
                        rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24]
                    ),
                ),
                image_token_id=151655,
                video_token_id=151656,
                vision_start_token_id=151652,
                vision_end_token_id=151653,
            ),
        ),
        qwen_inputs,
        qwen_prompt,
    ),
    "pixtral-12b": PackedExample("pixtral", TowerExample("PixtralVisionModel", {}), pixtral_inputs),
    "siglip2-so400m-naflex": PackedExample(
        "siglip2",
        TowerExample(
            "Siglip2VisionModel",
            dict(
                hidden_size=1152,
                intermediate_size=4304,
                num_hidden_layers=27,
                num_attention_heads=16,
                patch_size=16,
                num_patches=256,
            ),
        ),
        siglip2_inputs,
    ),
}
"""Qwen2.5-VL-7B's, Qwen3-VL-8B's, Qwen3.5's and GLM-4.1V-9B's towers (the last two their
configurations' defaults), Qwen2.5-VL-3B (a 32-layer tower of 1280 and a 36-layer language
model of 2048, with prompts), Pixtral-12B's tower (its configuration's defaults) and SigLIP2
so400m/16 NaFlex's."""


def packed_example(name: str) -> ExampleModel | None:
    """The example ``name`` of :data:`PACKED_EXAMPLES`, or ``None``."""
    found = PACKED_EXAMPLES.get(name)
    return None if found is None else packed_example_model(name, found)


def packed_example_model(name: str, found: PackedExample) -> ExampleModel:
    """``found`` as the example model ``name``: its ``inputs`` hold images of
    :data:`EXAMPLE_IMAGE_SIZE` (or the example's ``image_size``) a side."""
    example, side = found.example, found.example.image_size or EXAMPLE_IMAGE_SIZE

    def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
        return build_tower(example.tower, example.settings, dtype, device)

    def config() -> Any:
        return transformers_class(example.tower).config_class(**example.settings)

    def vlm_prompt(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
        if found.prompt is None:
            raise ValueError(f"{name} is a tower, not a VLM with prompts")
        return found.prompt(config(), sizes, dtype, device)

    def sized_inputs(sizes: Sizes, dtype: torch.dtype, device: torch.device) -> Call:
        if found.prompt is not None:
            return (), vlm_prompt(sizes, dtype, device)
        return found.inputs(config(), sizes, dtype, device)

    return ExampleModel(
        name=name,
        adapter=found.adapter,
        build=build,
        inputs=lambda batch, dtype, device: sized_inputs([(side, side)] * batch, dtype, device),
        sized_inputs=sized_inputs,
        prompt=vlm_prompt if found.prompt is not None else None,
    )
