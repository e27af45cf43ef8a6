"""Example models of the fixed-size transformers towers (the ``towers`` and ``internvl``
plugins' families): each built from its configuration with random weights and fed what a
larger model feeds it (:attr:`~layergraph_adapters.kit.tower_specs.TowerSpec.inputs`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from layergraph.bench.examples import ExampleModel
from layergraph.ledger import Change
from layergraph_adapters import audio, towers
from layergraph_adapters.internvl import INTERNVIT_CONFIGS, INTERNVL
from layergraph_adapters.kit.beit import BeitPlan, device_position_indices
from layergraph_adapters.kit.idefics import CapturablePositions, IdeficsPlan
from layergraph_adapters.kit.tower_specs import (
    TowerExample,
    TowerSpec,
    build_tower,
    find_module,
    pair,
    transformers_class,
)

__all__ = [
    "SO400M",
    "TOWER_EXAMPLES",
    "WHISPER_LARGE_ENCODER",
    "capture_changes",
    "tower_example",
    "tower_example_model",
]

WHISPER_LARGE_ENCODER = dict(
    d_model=1280,
    encoder_layers=32,
    encoder_attention_heads=20,
    encoder_ffn_dim=5120,
    num_mel_bins=128,
    max_source_positions=1500,
)
"""Whisper large-v3's encoder, which distil-whisper large-v3 and Qwen2-Audio keep."""

SO400M = dict(
    hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16
)
"""SigLIP so400m's layers, which Idefics2, Idefics3 and SmolVLM start from."""

TOWER_EXAMPLES: dict[str, tuple[TowerSpec, TowerExample]] = {
    "siglip-so400m-384": (
        towers.SIGLIP,
        TowerExample("SiglipVisionModel", dict(SO400M, image_size=384, patch_size=14)),
    ),
    "clip-vit-l-336": (
        towers.CLIP,
        TowerExample(
            "CLIPVisionModel",
            dict(
                hidden_size=1024,
                intermediate_size=4096,
                num_hidden_layers=24,
                num_attention_heads=16,
                image_size=336,
                patch_size=14,
                projection_dim=768,
            ),
        ),
    ),
    "idefics2-8b-980": (
        towers.IDEFICS,
        TowerExample(
            "idefics2.Idefics2VisionTransformer", dict(SO400M, image_size=980, patch_size=14)
        ),
    ),
    "idefics3-8b-364": (
        towers.IDEFICS,
        TowerExample("Idefics3VisionTransformer", dict(SO400M, image_size=364, patch_size=14)),
    ),
    "smolvlm2-2.2b-384": (
        towers.IDEFICS,
        TowerExample("SmolVLMVisionTransformer", dict(SO400M, image_size=384, patch_size=14)),
    ),
    "janus-pro-384": (
        towers.JANUS,
        TowerExample(
            "JanusVisionModel",
            dict(
                hidden_size=1024,
                num_hidden_layers=24,
                num_attention_heads=16,
                image_size=384,
                patch_size=16,
            ),
        ),
    ),
    "aimv2-large-224": (
        towers.AIMV2,
        TowerExample(
            "Aimv2VisionModel",
            dict(
                hidden_size=1024,
                intermediate_size=2816,
                num_hidden_layers=24,
                num_attention_heads=8,
                image_size=224,
                patch_size=14,
            ),
        ),
    ),
    "dinov2-large-224": (
        towers.DINOV2,
        TowerExample(
            "Dinov2Model",
            dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, image_size=518),
            image_size=224,
        ),
    ),
    "dinov2-reg-large-224": (
        towers.DINOV2,
        TowerExample(
            "Dinov2WithRegistersModel",
            dict(
                hidden_size=1024,
                num_hidden_layers=24,
                num_attention_heads=16,
                image_size=518,
                patch_size=14,
            ),
            image_size=224,
        ),
    ),
    "vit-base-224": (towers.VIT, TowerExample("ViTModel", {})),
    "llama4-scout-336": (
        towers.LLAMA4,
        TowerExample(
            "Llama4VisionModel",
            dict(
                hidden_size=1408,
                intermediate_size=5632,
                num_hidden_layers=34,
                num_attention_heads=16,
                image_size=336,
                patch_size=14,
                vision_output_dim=4096,
            ),
        ),
    ),
    "mllama-11b-560": (
        towers.MLLAMA,
        TowerExample(
            "MllamaVisionModel",
            dict(
                hidden_size=1280,
                intermediate_size=5120,
                num_hidden_layers=32,
                num_global_layers=8,
                attention_heads=16,
                image_size=560,
                patch_size=14,
            ),
        ),
    ),
    **{
        name: (INTERNVL, TowerExample("InternVLVisionModel", settings))
        for name, settings in INTERNVIT_CONFIGS.items()
    },
    "whisper-large-v3-encoder": (
        audio.WHISPER,
        TowerExample("whisper.WhisperEncoder", WHISPER_LARGE_ENCODER),
    ),
    "whisper-base-encoder": (
        audio.WHISPER,
        TowerExample(
            "whisper.WhisperEncoder",
            dict(
                d_model=512,
                encoder_layers=6,
                encoder_attention_heads=8,
                encoder_ffn_dim=2048,
                num_mel_bins=80,
                max_source_positions=1500,
            ),
        ),
    ),
    "qwen2-audio-encoder": (
        audio.QWEN2_AUDIO,
        TowerExample("qwen2_audio.Qwen2AudioEncoder", WHISPER_LARGE_ENCODER),
    ),
}
"""Well-known towers by name: SigLIP so400m, CLIP ViT-L/14-336, the Idefics2, Idefics3 and
SmolVLM2 towers, Janus-Pro's, AIMv2-L, DINOv2-L (with and without registers) at 224, ViT-B,
Llama 4 Scout's, Llama 3.2 Vision 11B's, InternViT-300M and InternViT-6B."""


def tower_example(name: str) -> ExampleModel | None:
    """The example tower ``name`` of :data:`TOWER_EXAMPLES`, or ``None``."""
    if name not in TOWER_EXAMPLES:
        return None
    return tower_example_model(name, *TOWER_EXAMPLES[name])


def tower_example_model(name: str, spec: TowerSpec, example: TowerExample) -> ExampleModel:
    """``example``, a tower of ``spec``'s family, as the example model ``name``."""

    def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
        return build_tower(example.tower, example.settings, dtype, device)

    def inputs(
        batch: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        config = transformers_class(example.tower).config_class(**example.settings)
        size = pair(example.image_size or getattr(config, "image_size", 0))  # audio: none
        return (), spec.inputs(config, batch, size, dtype, device)

    @contextlib.contextmanager
    def capturable(model: nn.Module) -> Iterator[None]:
        applied: list[Change] = []
        try:
            for change in capture_changes(model, spec):
                change.apply()
                applied.append(change)
            yield
        finally:
            for change in reversed(applied):
                change.undo()

    return ExampleModel(
        name=name, adapter=spec.adapter, build=build, inputs=inputs, capturable=capturable
    )


def capture_changes(model: nn.Module, spec: TowerSpec) -> list[Change]:
    """The changes layergraph makes so that a CUDA stream can capture a tower of ``spec``'s
    family at all (none of its speed options), for a hand-written graph of its own forward:
    Idefics' position ids computed without boolean-mask indexing, BEiT's relative position
    indices kept on the device; none for the others."""
    if spec.plan is not None and issubclass(spec.plan, BeitPlan):
        return device_position_indices(model)
    if spec.plan is not None and issubclass(spec.plan, IdeficsPlan):
        found = find_module(model, spec.embeddings)
        if found is not None:
            return [CapturablePositions(found[1])]
    return []
