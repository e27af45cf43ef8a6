"""Example models of the other frameworks' towers: any timm ViT or Eva by its timm name, and
the image tower of any open_clip architecture as ``open_clip:NAME``, each with random
weights. Neither framework is imported unless such a name is asked for."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layergraph.bench.examples import ExampleModel
from layergraph.device_factories import MadeOnDevice

__all__ = ["OPEN_CLIP_NAMES", "TIMM_NAMES", "open_clip_example", "timm_example"]

TIMM_NAMES = ("vit_base_patch16_224", "vit_large_patch16_224", "eva02_base_patch14_224")
"""The timm models worth listing; any other timm name builds too."""

OPEN_CLIP_NAMES = tuple(
    f"open_clip:{name}" for name in ("ViT-B-32", "ViT-L-14", "ViT-SO400M-14-SigLIP")
)
"""The open_clip towers worth listing, where open_clip is installed."""


def timm_example(name: str) -> ExampleModel | None:
    """Any timm model by its timm name (``timm:`` in front is accepted), for the ``timm``
    adapter; ``None`` for a name timm does not know or without timm. Its hand-written graph
    is captured with the tensors the model makes without a device made on the device
    (:class:`~layergraph.device_factories.MadeOnDevice`), as a hand-writer would for SAM ViT's
    relative positions, which a capture otherwise refuses."""
    name = name.removeprefix("timm:")
    try:
        import timm
    except ImportError:
        return None
    if not timm.is_model(name):
        return None

    def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
        return timm.create_model(name, pretrained=False).to(device, dtype).eval()

    def inputs(
        batch: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        shape = timm.models.get_pretrained_cfg_value(name, "input_size") or (3, 224, 224)
        return (torch.randn(batch, *shape, dtype=dtype, device=device),), {}

    def capturable(model: nn.Module) -> MadeOnDevice:
        return MadeOnDevice(next(model.parameters()).device)

    return ExampleModel(
        name=name, adapter="timm", build=build, inputs=inputs, capturable=capturable
    )


def open_clip_example(name: str) -> ExampleModel | None:
    """The image tower of the open_clip architecture ``open_clip:NAME``
    (``open_clip.list_models()`` lists them), for the ``open_clip`` adapter; ``None`` for
    another name or without open_clip."""
    if not name.startswith("open_clip:"):
        return None
    try:
        import open_clip
    except ImportError:
        return None
    architecture = name.removeprefix("open_clip:")
    if architecture not in open_clip.list_models():
        return None

    def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
        model = open_clip.create_model(architecture, pretrained=None)
        return model.visual.to(device, dtype).eval()

    def inputs(
        batch: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        size = open_clip.get_model_config(architecture)["vision_cfg"].get("image_size", 224)
        height, width = (size, size) if isinstance(size, int) else size
        return (torch.randn(batch, 3, height, width, dtype=dtype, device=device),), {}

    return ExampleModel(name=name, adapter="open_clip", build=build, inputs=inputs)


def open_clip_names() -> list[str]:
    """:data:`OPEN_CLIP_NAMES` where open_clip is installed, else none."""
    try:
        import open_clip  # noqa: F401
    except ImportError:
        return []
    return list(OPEN_CLIP_NAMES)
