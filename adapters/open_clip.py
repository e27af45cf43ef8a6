"""Plugin for open_clip's image towers: its own ``VisionTransformer`` and its timm-backed
``TimmModel``, alone or inside a CLIP, CustomTextCLIP (SigLIP) or CoCa model.

A tower alone is graphed whole per image size (patch embedding, class token, positions,
blocks, attentional pooler where it has one, pooling and projection), the same for
``output_tokens`` towers, whose pooled and token outputs come back as eager's tuple. A whole
model's ``visual`` is routed to the graphs, so that ``model.encode_image``, ``model(image,
text)`` and CoCa's ``generate`` read its image features from them while the text tower runs
eagerly.

Speed options, as for the timm adapter: ``patch_matmul`` (the patch convolution as one matrix
product), ``fuse_norm`` (each block's residual adds and second norm through one Triton
kernel) and ``fuse_gelu`` (the MLP's GELU in its up-projection's epilogue) default to
``"auto"``, on where they fit on a GPU; ``fuse_gelu`` fits tanh-GELU towers (SigLIP's), and
takes the exact GELU of most CLIP towers only when given ``"approximate"``. A timm-backed
tower's trunk gets the timm adapter's rewrites. What this adapter does not do: graph the text
tower.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import nn

from layergraph import (
    Adapter,
    AdapterMismatch,
    CapturePlan,
    PlanContext,
    WholeForward,
    hookimpl,
)
from layergraph.adapter import own_forward
from layergraph.keys import CallInputs
from layergraph.ledger import Change, ChangeLedger
from layergraph_adapters.kit.automatic import SpeedChoices, build_with_automatic_options
from layergraph_adapters.kit.family_record import FrameworkFamily
from layergraph_adapters.kit.fused_norm import FusedAddNorm, LayerForm, fused_norms
from layergraph_adapters.kit.gelu_epilogue import gelu_epilogues
from layergraph_adapters.kit.layout import RowMajorOutput
from layergraph_adapters.kit.patch_embedding import patch_matmul_for
from layergraph_adapters.kit.tokens import ImageTokens, checked_images
from layergraph_adapters.timm_vit import TIMM_VIT


def _is_open_clip_block(layer: nn.Module) -> bool:
    """Whether ``layer`` is open_clip's self-attention ``ResidualAttentionBlock`` with layer
    scales that are ``LayerScale`` (a ``gamma`` vector) or ``Identity``."""
    if "open_clip" not in sys.modules:
        return False
    from open_clip.transformer import LayerScale, ResidualAttentionBlock

    if type(layer).forward is not ResidualAttentionBlock.forward or hasattr(layer, "ln_1_kv"):
        return False
    return all(type(s) in (nn.Identity, LayerScale) for s in (layer.ls_1, layer.ls_2))


def _open_clip_block(
    rewrite: FusedAddNorm,
    q_x: torch.Tensor,
    k_x: torch.Tensor | None = None,
    v_x: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    block = rewrite.module
    if k_x is not None or v_x is not None:
        return rewrite.own_forward(q_x, k_x, v_x, attn_mask)
    attention = block.attention(q_x=rewrite.first_norm(q_x), attn_mask=attn_mask)
    residual, normed = rewrite.add_norm(q_x, attention)
    return rewrite.add_scaled(residual, block.mlp(normed))


OPEN_CLIP_BLOCK = LayerForm(
    _open_clip_block, ("ln_1", "ln_2"), ("ls_1", "ls_2"), _is_open_clip_block
)
"""open_clip's self-attention ``ResidualAttentionBlock``."""


OPEN_CLIP = FrameworkFamily(name="open_clip", layer_form=OPEN_CLIP_BLOCK)
"""open_clip's own ViT towers; a ``TimmModel`` tower's ViT trunk has timm's blocks
(:data:`layergraph_adapters.timm_vit.TIMM_VIT`'s form)."""


def _tower_classes() -> tuple[type, ...]:
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    return (VisionTransformer, TimmModel)


def _is_tower(module: object) -> bool:
    return "open_clip" in sys.modules and isinstance(module, _tower_classes())


class OpenClipAdapter(Adapter):
    """Graphs an open_clip image tower, or the image tower of an open_clip model (the module's
    text says which and how, and what the speed options do)."""

    name = "open_clip"

    def __init__(
        self,
        patch_matmul: bool | str = "auto",
        fuse_gelu: bool | str = "auto",
        fuse_norm: bool | str = "auto",
    ) -> None:
        self.options = {
            "patch_matmul": patch_matmul,
            "fuse_gelu": fuse_gelu,
            "fuse_norm": fuse_norm,
        }

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
            build = functools.partial(_TowerPlan, model)
            return build_with_automatic_options(
                model, self.options, build, context, OPEN_CLIP.ruled_out()
            )
        visual = getattr(model, "visual", None)
        if isinstance(visual, classes):
            build = functools.partial(_RoutedTowerPlan, visual)
            return build_with_automatic_options(
                visual, self.options, build, context, OPEN_CLIP.ruled_out()
            )
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


def _rewrites(tower: nn.Module, choices: SpeedChoices) -> list[Change]:
    """The speed options' rewrites of ``tower``'s patch embedding and blocks; an option asked
    for where it does not fit (a timm trunk that is not a ViT, an MLP whose activation is not a
    GELU) is refused with a ``ValueError``."""
    trunk = getattr(tower, "trunk", None)
    if trunk is None:
        embedding, blocks, layout = tower.conv1, list(tower.transformer.resblocks), []
        form = OPEN_CLIP.layer_form
    else:
        blocks = list(getattr(trunk, "blocks", []))
        embedding = getattr(trunk, "patch_embed", None)
        if not blocks or embedding is None:

            def refuse(setting: object) -> list[Change]:
                raise ValueError(
                    f"the speed options rewrite a ViT's patch embedding and blocks; this tower's "
                    f"{type(trunk).__name__} trunk has none"
                )

            for name in ("patch_matmul", "fuse_norm", "fuse_gelu"):
                choices.take(name, refuse, [])
            return []
        form = TIMM_VIT.layer_form
        prefix = getattr(trunk, "num_prefix_tokens", 1)
        layout = [RowMajorOutput(embedding)] if prefix == 0 and hasattr(embedding, "proj") else []
    mlps = [block.mlp for block in blocks]
    patch = choices.take("patch_matmul", lambda on: patch_matmul_for(embedding, on), [])
    norms = choices.take("fuse_norm", lambda on: fused_norms(blocks, on, form), [])
    gelus = choices.take("fuse_gelu", lambda setting: gelu_epilogues(mlps, setting), [])
    return [*layout, *patch, *gelus, *norms]


class _TowerPlan(_TowerChecks, WholeForward):
    """An open_clip image tower wrapped alone: its whole forward is the region."""

    def __init__(self, tower: nn.Module, *, choices: SpeedChoices) -> None:
        super().__init__(tower)
        self._rewrites = _rewrites(tower, choices)

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        for rewrite in self._rewrites:
            changes.apply(rewrite)


class _RoutedTowerPlan(_TowerChecks, CapturePlan):
    """The image tower inside an open_clip model: its forward routed to the graphs."""

    def __init__(self, tower: nn.Module, *, choices: SpeedChoices) -> None:
        self.owner = tower
        self._forward = own_forward(tower)
        self._rewrites = _rewrites(tower, choices)

    def region(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    @property
    def capture_module(self) -> nn.Module:
        return self.owner

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        for rewrite in self._rewrites:
            changes.apply(rewrite)
        changes.set_forward(self.owner, serve, "forward routed to the graphs")


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(OpenClipAdapter)
