"""Plugin for timm's models: every model timm builds, its ViTs with speed options.

The whole forward is captured per (batch, image size). VisionTransformer (vit_*, deit_*,
register tokens, no class token, SigLIP-in-timm, the hybrid ViTs whose patch embedding runs a
CNN first) and Eva (eva_*, eva02_*, rotary position embeddings) are keyed by their tokens and
take the speed options below; any other timm model (convnets, Swin, MaxViT, Hiera, LeViT...) is
captured whole, keyed by its image size, and a model whose forward a CUDA graph cannot capture
(it reads a value on the host) runs eagerly with the operation named in ``graphed.stats``. A
``features_only=True`` model (timm's feature wrappers) is captured the same way: its forward,
the feature maps asked for. A ViT's images are checked against the channels of its first
convolution (a hybrid's stem), never an inner layer's.

``forward``, ``forward_features`` and ``forward_head`` called through the wrapper are each
served from graphs of their own, keyed by the method, and counted in ``graphed.stats``:
``graphed.forward_features(x)`` replays a graph of the features, ``graphed(x)`` one of the
whole forward. The model called directly runs eagerly.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from typing import Any, NamedTuple

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
from layergraph.keys import CallInputs
from layergraph.ledger import Change, ChangeLedger
from layergraph_adapters.kit.automatic import (
    SpeedChoices,
    build_with_automatic_options,
)
from layergraph_adapters.kit.family_record import FrameworkFamily
from layergraph_adapters.kit.fused_norm import FusedAddNorm, LayerForm, fused_norms
from layergraph_adapters.kit.gelu_epilogue import gelu_epilogues, gelu_kind, mlp_parts
from layergraph_adapters.kit.layout import RowMajorOutput
from layergraph_adapters.kit.methods import RoutedMethods
from layergraph_adapters.kit.patch_embedding import (
    PatchMatmul,
    is_patch_convolution,
    patch_matmul_for,
)
from layergraph_adapters.kit.tokens import ImageSize, ImageTokens, check_floating, checked_images


def _vit_classes() -> tuple[type, ...]:
    from timm.models.eva import Eva
    from timm.models.vision_transformer import VisionTransformer

    return (VisionTransformer, Eva)


def _vit_of(model: nn.Module) -> nn.Module | None:
    """The ViT or Eva that ``model`` is, or that a ``features_only`` model
    (``FeatureGetterNet``) wraps; ``None`` for other models."""
    classes = _vit_classes()
    if isinstance(model, classes):
        return model
    from timm.models._features import FeatureGetterNet

    if isinstance(model, FeatureGetterNet) and isinstance(getattr(model, "model", None), classes):
        return model.model
    return None


def _timm_model(model: nn.Module) -> bool:
    """Whether ``model`` is a model timm builds (it has a ``pretrained_cfg``), or one of
    timm's ``features_only`` wrappers."""
    module = type(model).__module__
    if not module.startswith("timm.models"):
        return False
    return hasattr(model, "pretrained_cfg") or module == "timm.models._features"


def image_channels(model: nn.Module) -> int | None:
    """The channels of the images ``model`` takes: its first convolution's input channels
    (a ViT's patch projection, a hybrid ViT's or a convnet's stem); ``None`` for a model
    without convolutions."""
    first = next((m for m in model.modules() if isinstance(m, nn.Conv2d)), None)
    return None if first is None else first.in_channels


def _timm_classes() -> tuple[type, type] | None:
    """timm's ``Block`` and ``LayerScale``, if timm is imported (a timm block exists only
    then)."""
    if "timm" not in sys.modules:
        return None
    from timm.layers import LayerScale
    from timm.models.vision_transformer import Block

    return Block, LayerScale


def _timm_block(
    rewrite: FusedAddNorm,
    x: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    block = rewrite.module
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask
    residual, normed = rewrite.add_norm(x, block.attn(rewrite.first_norm(x), **kwargs))
    return rewrite.add_scaled(residual, block.mlp(normed))


def _is_timm_block(layer: nn.Module) -> bool:
    """Whether ``layer`` is timm's ``Block`` (its forward) with layer scales that are
    ``LayerScale`` or ``Identity``."""
    classes = _timm_classes()
    if classes is None or type(layer).forward is not classes[0].forward:
        return False
    return all(isinstance(s, nn.Identity) or type(s) is classes[1] for s in (layer.ls1, layer.ls2))


TIMM_BLOCK = LayerForm(_timm_block, ("norm1", "norm2"), ("ls1", "ls2"), _is_timm_block)
"""timm's ``Block`` (the blocks of ``VisionTransformer``)."""
TIMM_VIT = FrameworkFamily(name="timm ViT", layer_form=TIMM_BLOCK)
"""timm's VisionTransformer and Eva towers (Eva's blocks are not of :data:`TIMM_BLOCK`'s form,
so ``fuse_norm`` stays off for them)."""


class TimmVisionTransformerAdapter(Adapter):
    """Graphs the whole forward of a timm ``VisionTransformer`` or ``Eva``.

    ``patch_matmul=True`` runs the patch embedding as one matrix product
    (:mod:`layergraph_adapters.kit.patch_embedding`); ``fuse_gelu`` applies each block's MLP GELU
    in its up-projection's epilogue (:mod:`layergraph_adapters.kit.gelu_epilogue`): ``True`` where
    the GELU is the tanh approximation, ``"approximate"`` for the exact GELU of most timm ViTs
    too; ``fuse_norm=True`` computes each ``Block``'s residual adds and second norm with one
    Triton kernel, on CUDA (:mod:`layergraph_adapters.kit.fused_norm`; not Eva's blocks). All
    default to ``"auto"``, on where they fit on a GPU (``fuse_gelu`` for tanh GELUs only).
    """

    name = "timm"
    inside_any_model = False
    """A timm model inside a model timm does not build (transformers' ``TimmWrapperModel``) is
    called its own way (``forward_features``, ``forward_intermediates``), not by ``forward``."""

    def __init__(
        self,
        patch_matmul: bool | str = "auto",
        fuse_gelu: bool | str = "auto",
        fuse_norm: bool | str = "auto",
    ) -> None:
        self.patch_matmul = patch_matmul
        self.fuse_gelu = fuse_gelu
        self.fuse_norm = fuse_norm

    def recognizes(self, model: nn.Module) -> bool:
        if "timm" not in sys.modules:
            return False
        return _timm_model(model)

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        if not _timm_model(model):
            raise AdapterMismatch(
                f"the timm adapter serves models timm builds (timm.create_model) and their "
                f"features_only form; got {type(model).__module__}.{type(model).__name__}"
            )
        options = {
            "patch_matmul": self.patch_matmul,
            "fuse_gelu": self.fuse_gelu,
            "fuse_norm": self.fuse_norm,
        }
        vit = _vit_of(model)
        if vit is None:
            return build_with_automatic_options(
                model,
                options,
                functools.partial(TimmNaFlexPlan if _is_naflex(model) else TimmModelPlan, model),
                context,
                ruled_out={
                    "fuse_norm": f"fuse_norm serves timm's VisionTransformer blocks; the blocks of "
                    f"{type(model).__name__} are of another form"
                },
            )
        return build_with_automatic_options(
            vit,
            options,
            functools.partial(_TimmViTPlan, model, vit),
            context,
            ruled_out=TIMM_VIT.ruled_out(),
        )


TIMM_METHODS = ("forward_features", "forward_head", "forward_intermediates")
"""The methods of a timm model served from graphs besides ``forward``, each keyed by its name
and its other arguments (``forward_intermediates``' layers, say); a ``features_only`` wrapper
has ``forward`` only."""


class MethodSequence(NamedTuple):
    """The sequence of a call of a method other than ``forward``: the method, and the
    sequence it is keyed by."""

    method: str
    sequence: Hashable

    def __str__(self) -> str:
        return f"{self.method}: {self.sequence}"


class _TimmPlan(WholeForward):
    """The whole forward of a timm model and its :data:`TIMM_METHODS` called through the
    wrapper, each captured whole per batch and image size (``forward_head`` per batch and
    feature shape)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.methods = RoutedMethods(model, TIMM_METHODS)

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        self.methods.route(changes, serve)

    def forward_scope(self) -> AbstractContextManager[None]:
        return self.methods.through_wrapper()

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], str):
            return self.methods.run(*args, **kwargs)
        with self.methods.running():
            return self.owner(*args, **kwargs)

    def sequence_of(self, call: CallInputs) -> Hashable:
        method = RoutedMethods.method_of(call)
        if method == "forward_head":
            features = "x".join(str(size) for size in call.tensors[0].shape[1:])
            return MethodSequence(method, f"features of {features}")
        sequence = self.image_sequence(call)
        return sequence if method == "forward" else MethodSequence(method, sequence)

    def check_inputs(self, call: CallInputs) -> None:
        if RoutedMethods.method_of(call) == "forward_head":
            check_floating(call.tensors[0], "features")
        else:
            self.check_images(call)

    def image_sequence(self, call: CallInputs) -> Hashable:
        """What fixes a graph of images besides the batch size."""
        raise NotImplementedError

    def check_images(self, call: CallInputs) -> None:
        """``ValueError`` naming what is wrong with a call's images."""
        raise NotImplementedError


class _TimmViTPlan(_TimmPlan):
    """The methods of ``model``: ``vit`` itself, or a ``features_only`` model around it
    (its intermediate feature maps, computed by ``vit.forward_intermediates``)."""

    def __init__(
        self,
        model: nn.Module,
        vit: nn.Module,
        *,
        choices: SpeedChoices,
    ) -> None:
        super().__init__(model)
        self.vit = vit
        mlps = [getattr(block, "mlp", block) for block in vit.blocks]
        patch = choices.take("patch_matmul", lambda on: patch_matmul_for(vit.patch_embed, on), [])
        norms = choices.take(
            "fuse_norm", lambda on: fused_norms(list(vit.blocks), on, TIMM_VIT.layer_form), []
        )
        self._rewrites: list[Change] = [
            *([RowMajorOutput(vit.patch_embed)] if vit.num_prefix_tokens == 0 else []),
            *patch,
            *choices.take("fuse_gelu", lambda setting: gelu_epilogues(mlps, setting), []),
            *norms,
        ]
        """What is rewritten while wrapped, each a change made through the ledger. Without
        class or register tokens the position embedding is added to the transposed patch
        grid, so the patch embedding's output is made row-major
        (:mod:`layergraph_adapters.kit.layout`); a concatenated token makes the sequence
        row-major already. Then the ``patch_matmul``, ``fuse_gelu`` and ``fuse_norm``
        options."""

        self.channels = image_channels(vit)
        if self.channels is None:
            raise AdapterMismatch(f"{type(vit).__name__} has no convolution to take images")

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for rewrite in self._rewrites:
            changes.apply(rewrite)

    def layers(self) -> list[nn.Module]:
        return list(self.vit.blocks)

    def image_sequence(self, call: CallInputs) -> Hashable:
        _, height, width = call.tensors[0].shape[1:]
        grid_h, grid_w = self.vit.patch_embed.dynamic_feat_size((height, width))
        return ImageTokens(grid_h * grid_w + self.vit.num_prefix_tokens, height, width)

    def check_images(self, call: CallInputs) -> None:
        patch_embed = self.vit.patch_embed
        images = checked_images(call, self.channels)
        height, width = images.shape[-2:]
        fixed = patch_embed.img_size
        if fixed is not None and not self.vit.dynamic_img_size and (height, width) != fixed:
            raise ValueError(
                f"image size {height}x{width} differs from the model's {fixed[0]}x{fixed[1]}; "
                f"build the model with dynamic_img_size=True to take other sizes"
            )
        patch_h, patch_w = patch_embed.patch_size
        if not patch_embed.dynamic_img_pad and (height % patch_h or width % patch_w):
            raise ValueError(
                f"image size {height}x{width} is not a multiple of the patch size "
                f"{patch_h}x{patch_w}"
            )


class TimmModelPlan(_TimmPlan):
    """The methods of any timm model, keyed by (batch, image size): a convnet, a model
    of stages, a ``features_only`` wrapper around one. Its repeated layers, for
    ``compile_layers``, are its ``blocks`` or ``stages`` where it has them. Images of another
    channel count than the model takes are the model's to refuse (a stem that rearranges
    pixels first, as TResNet's, takes other channels than its first convolution's): its own
    error, raised by the eager call a failed capture falls back to.

    Speed options where the model's layout allows: ``patch_matmul`` for a ``patch_embed``
    whose first convolution cuts patches, ``fuse_gelu`` for every MLP of the form
    ``fc2(gelu(fc1(x)))`` (Swin, BEiT, CaiT, SAM ViT, Hiera, XCiT...). ``fuse_norm`` is
    refused: its kernel knows the residual form of timm's ViT ``Block`` only."""

    def __init__(self, model: nn.Module, *, choices: SpeedChoices) -> None:
        super().__init__(model)
        inner = getattr(model, "model", model)  # a features_only wrapper's model
        patch = choices.take("patch_matmul", lambda on: _patch_matmul(inner, on), [])
        mlps = [m for m in model.modules() if (parts := mlp_parts(m)) and gelu_kind(parts[1])]
        gelu = choices.take("fuse_gelu", lambda setting: _gelu_epilogues(model, mlps, setting), [])
        choices.take("fuse_norm", lambda on: [], [])  # ruled out: refused with the reason
        self._rewrites: list[Change] = [*patch, *gelu]

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for rewrite in self._rewrites:
            changes.apply(rewrite)

    def layers(self) -> list[nn.Module]:
        inner = getattr(self.owner, "model", self.owner)  # a features_only wrapper's model
        for name in ("blocks", "stages", "layers"):
            found = getattr(inner, name, None)
            if isinstance(found, (nn.ModuleList, nn.Sequential)) and len(found):
                return list(found)
        return []

    def image_sequence(self, call: CallInputs) -> Hashable:
        height, width = call.tensors[0].shape[-2:]
        return ImageSize(height, width)

    def check_images(self, call: CallInputs) -> None:
        check_floating(call.tensors[0])


def _is_naflex(model: nn.Module) -> bool:
    naflexvit = sys.modules.get("timm.models.naflexvit")
    return naflexvit is not None and isinstance(model, naflexvit.NaFlexVit)


class TimmNaFlexPlan(TimmModelPlan):
    """timm's ``NaFlexVit``: images captured whole per image size, as any timm model; a NaFlex
    call (patches with their coordinates and validity, as timm's NaFlex collator pads them;
    a dict of them, or ``patch_coord=`` and ``patch_valid=``) runs the patch and position
    embeddings eagerly (they read each image's patch grid on the host), then replays a graph
    of the blocks, norm and head keyed by (batch, patches per row), whatever sizes the
    images in it are. Rotary embeddings made per call come in as more tensors of the call: one
    the blocks share, or, for a model whose rotary embeddings differ per layer
    (``rope_type="mixed"``), one per block."""

    serves_forward = False

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        changes.set_attribute(
            self.owner,
            "forward",
            types.MethodType(functools.partial(self._forward, serve=serve), self.owner),
            "forward routed: NaFlex calls' embeddings eagerly, their blocks and head to graphs",
        )

    def _forward(
        self,
        owner: nn.Module,
        x: Any,
        patch_coord: torch.Tensor | None = None,
        patch_valid: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        *,
        serve: Callable[..., Any],
    ) -> Any:
        original = functools.partial(type(owner).forward, owner)
        if not self.methods.routing():
            return original(x, patch_coord, patch_valid, attn_mask)
        if not isinstance(x, dict) and patch_coord is None:
            return serve(x)  # the image path, where timm ignores patch_valid and attn_mask
        patches = x
        if isinstance(x, dict):
            patches = x["patches"]
            patch_coord = x.get("patch_coord", patch_coord)
            patch_valid = x.get("patch_valid", patch_valid)
            attn_mask = x.get("attn_mask", attn_mask)
        if patch_coord is None or patch_valid is None:  # the model's answer: timm refuses it
            return original(x, patch_coord, patch_valid, attn_mask)
        with self.methods.running():
            embeds = type(owner)._forward_embeds(
                owner, patches, patch_coord, patch_valid, attn_mask
            )
        rope = embeds.get("rope_embeds")
        ropes = [] if rope is None else [rope] if isinstance(rope, torch.Tensor) else list(rope)
        tokens, mask, valid = embeds["patches"], embeds["attn_mask"], embeds["patch_valid"]
        return serve("naflex", tokens, mask, valid, *ropes)

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if not (args and args[0] == "naflex"):
            return super().region(*args, **kwargs)
        _, x, attn_mask, patch_valid, *ropes = args
        owner = self.owner
        for index, block in enumerate(owner.blocks):
            layer_rope = {"rope": ropes[index if len(ropes) > 1 else 0]} if ropes else {}
            x = block(x, attn_mask=attn_mask, **layer_rope)
        with self.methods.running():
            return type(owner).forward_head(owner, owner.norm(x), patch_valid=patch_valid)

    def sequence_of(self, call: CallInputs) -> Hashable:
        if RoutedMethods.method_of(call) == "naflex":
            patches = call.tensors[0].shape[1] - self.owner.num_prefix_tokens
            return MethodSequence("naflex", f"{patches} patches a row")
        return super().sequence_of(call)

    def check_inputs(self, call: CallInputs) -> None:
        if RoutedMethods.method_of(call) != "naflex":  # else the model's embeddings made them
            super().check_inputs(call)


def _patch_matmul(model: nn.Module, setting: bool) -> list[PatchMatmul]:
    convolution = next(
        (m for m in getattr(model, "patch_embed", nn.Identity()).modules() if type(m) is nn.Conv2d),
        None,
    )
    if setting and (convolution is None or not is_patch_convolution(convolution)):
        raise ValueError(
            f"patch_matmul needs a patch embedding whose first convolution cuts patches (kernel "
            f"equal to stride); {type(model).__name__} has none"
        )
    return patch_matmul_for(convolution, setting)


def _gelu_epilogues(model: nn.Module, mlps: list[nn.Module], setting: bool | str) -> list[Any]:
    if setting is not False and not mlps:
        raise ValueError(
            f"fuse_gelu needs MLPs of the form fc2(gelu(fc1(x))); {type(model).__name__} has none"
        )
    return gelu_epilogues(mlps, setting)


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(TimmVisionTransformerAdapter)
