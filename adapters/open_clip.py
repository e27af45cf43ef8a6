"""Plugin for open_clip's image towers: its own ``VisionTransformer`` and its timm-backed
``TimmModel``, alone or inside a CLIP, CustomTextCLIP (SigLIP) or CoCa model.

A tower alone is graphed whole per image size (patch embedding, class token, positions,
blocks, attentional pooler where it has one, pooling and projection), the same for
``output_tokens`` towers, whose pooled and token outputs come back as eager's tuple. A whole
model's ``visual`` is routed to the graphs, so that ``model.encode_image``, ``model(image,
text)`` and CoCa's ``generate`` read its image features from them while the text tower runs
eagerly. What this adapter does not do: graph the text tower, or rewrite the blocks for the
speed options.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable
from typing import Any

from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, PlanContext, WholeForward, hookimpl
from layergraph.adapter import own_forward
from layergraph.keys import CallInputs
from layergraph.ledger import ChangeLedger
from layergraph_adapters.kit.tokens import ImageTokens, checked_images


def _tower_classes() -> tuple[type, ...]:
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    return (VisionTransformer, TimmModel)


def _is_tower(module: object) -> bool:
    return "open_clip" in sys.modules and isinstance(module, _tower_classes())


class OpenClipAdapter(Adapter):
    """Graphs an open_clip image tower, or the image tower of an open_clip model (the module's
    text says which and how)."""

    name = "open_clip"

    def recognizes(self, model: nn.Module) -> bool:
        if "open_clip" not in sys.modules:
            return False
        return _is_tower(model) or _is_tower(getattr(model, "visual", None))

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        try:
            classes = _tower_classes()
        except ImportError as error:
            raise ImportError(
                "the open_clip adapter needs open_clip: pip install 'layergraph[open-clip]'"
            ) from error
        if isinstance(model, classes):
            return _TowerPlan(model)
        visual = getattr(model, "visual", None)
        if isinstance(visual, classes):
            return _RoutedTowerPlan(visual)
        raise AdapterMismatch(
            f"the open_clip adapter serves open_clip's VisionTransformer and TimmModel towers and "
            f"models whose `visual` is one (CLIP, CustomTextCLIP, CoCa); got "
            f"{type(model).__module__}.{type(model).__name__}"
        )


class _TowerChecks:
    """What both plans read of the tower: its layers, its input size and its tokens."""

    owner: nn.Module

    def layers(self) -> list[nn.Module]:
        tower = self.owner
        if hasattr(tower, "trunk"):
            return list(getattr(tower.trunk, "blocks", []))
        return list(tower.transformer.resblocks)

    def _geometry(self) -> tuple[int, tuple[int, int], tuple[int, int], bool]:
        """Channels, image size, patch size, and whether other image sizes are taken."""
        tower = self.owner
        if hasattr(tower, "trunk"):
            embed = tower.trunk.patch_embed
            dynamic = bool(getattr(tower.trunk, "dynamic_img_size", False))
            return embed.proj.in_channels, tuple(embed.img_size), tuple(embed.patch_size), dynamic
        size = tower.image_size
        patch = tower.patch_size
        return (
            tower.conv1.in_channels,
            (size, size) if isinstance(size, int) else tuple(size),
            (patch, patch) if isinstance(patch, int) else tuple(patch),
            False,
        )

    def sequence_of(self, call: CallInputs) -> Hashable:
        _, _, (patch_h, patch_w), _ = self._geometry()
        height, width = call.tensors[0].shape[-2:]
        prefix = getattr(getattr(self.owner, "trunk", None), "num_prefix_tokens", 1)
        return ImageTokens((height // patch_h) * (width // patch_w) + prefix, height, width)

    def check_inputs(self, call: CallInputs) -> None:
        channels, size, _, dynamic = self._geometry()
        images = checked_images(call, channels)
        if not dynamic and tuple(images.shape[-2:]) != size:
            raise ValueError(
                f"image size {images.shape[-2]}x{images.shape[-1]} differs from the tower's "
                f"{size[0]}x{size[1]}"
            )


class _TowerPlan(_TowerChecks, WholeForward):
    """An open_clip image tower wrapped alone: its whole forward is the region."""


class _RoutedTowerPlan(_TowerChecks, CapturePlan):
    """The image tower inside an open_clip model: its forward routed to the graphs."""

    def __init__(self, tower: nn.Module) -> None:
        self.owner = tower
        self._forward = own_forward(tower)

    def region(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    @property
    def capture_module(self) -> nn.Module:
        return self.owner

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        changes.set_forward(self.owner, serve, "forward routed to the graphs")


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(OpenClipAdapter)
