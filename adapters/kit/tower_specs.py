"""What layergraph knows about one family of transformers vision towers, as data.

A :class:`TowerSpec` says which transformers classes are a family's towers, where their layer
list lives, how many tokens besides the patches an image gives, which image sizes they take,
which speed options fit their layers, where a larger model (a VLM, a dual encoder) holds the
tower, which setting of that model names the hidden state it reads, and what it calls the
tower with. :mod:`layergraph_adapters.kit.hf_vision`'s adapter and plan read nothing else about a
family, so a family whose tower fits them is one entry of
:data:`layergraph_adapters.towers.TOWERS`. A family with quirks names a plan of its own
(``plan``), kept in its own module.

Classes are matched by name along the model's class hierarchy, among transformers' classes,
so recognising a model imports nothing and finds classes transformers does not export (the
Idefics2 tower).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from layergraph import AdapterMismatch
from layergraph_adapters.kit.family_record import FamilyRecord, Support
from layergraph_adapters.kit.versions import TRANSFORMER_TOWERS

if TYPE_CHECKING:
    from layergraph.bench.example_model import ExampleModel
    from layergraph_adapters.kit.fused_qkv import FusedQKV

__all__ = [
    "TEXT_ONLY_ARGUMENTS",
    "TOWER_PATHS",
    "ImageSizes",
    "TowerExample",
    "TowerSpec",
    "build_tower",
    "find_module",
    "find_tower",
    "images",
    "is_tower",
    "layer_list",
    "pair",
    "transformers_class",
]

TOWER_PATHS: tuple[str, ...] = (
    "vision_model",
    "vision_tower",
    "model.vision_tower",
    "model.vision_model",
)
"""Where the larger models of transformers hold their vision tower: ``CLIPModel`` and
``SiglipModel`` (``vision_model``), LLaVA and its kin (``model.vision_tower``), Idefics, Janus
and Mllama (``model.vision_model``), Llama 4 (``vision_model``)."""

ImageSizes = Literal["fixed", "interpolate", "any"]
"""Which image sizes a tower takes: only its configuration's (``"fixed"``), others when called
with ``interpolate_pos_encoding=True`` (``"interpolate"``), or any (``"any"``)."""

Inputs = Callable[[Any, int, tuple[int, int], torch.dtype, torch.device], dict[str, Any]]
"""``inputs(config, batch, (height, width), dtype, device)``: the keyword arguments of one
call of a tower on ``batch`` random images of that size."""


TEXT_ONLY_ARGUMENTS = frozenset({"use_cache", "logits_to_keep", "output_router_logits"})
"""Keyword arguments a VLM passes on to its vision tower with the rest of its own that no
tower's computation reads (``generate()`` passes ``use_cache`` and ``logits_to_keep``, a
mixture-of-experts VLM ``output_router_logits``): a packed adapter leaves them out of a call's
signature and its graph's arguments, so that ``generate()`` replays the graphs
``get_image_features()`` captured."""


def pair(value: int | Any) -> tuple[int, int]:
    """``(height, width)`` from a configuration's size, given as an int or a pair."""
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def images(
    config: Any, batch: int, size: tuple[int, int], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """``pixel_values``: ``batch`` random images of ``size``."""
    pixels = torch.randn(batch, config.num_channels, *size, dtype=dtype, device=device)
    return {"pixel_values": pixels}


@dataclass(frozen=True)
class TowerExample:
    """A well-known tower of a family, built from its configuration with random weights (an
    example model's recipe, :mod:`layergraph_adapters.example_models`)."""

    tower: str
    """The tower's class (see :func:`transformers_class`)."""
    settings: Mapping[str, Any]
    """Its configuration's settings."""
    image_size: int | None = None
    """The image size it is used at, where that is not its configuration's ``image_size``
    (DINOv2's configuration holds 518, its checkpoints are used at 224)."""


@dataclass(frozen=True)
class TowerSpec(FamilyRecord):
    """How one family of transformers vision towers is found, called and captured: a
    fixed-resolution family's record (its layer form and support are
    :class:`~layergraph_adapters.kit.family_record.FamilyRecord`'s; the support is
    :data:`~layergraph_adapters.kit.versions.TRANSFORMER_TOWERS` unless given)."""

    adapter: str
    """The adapter's name: ``wrap(model, adapter=...)``."""
    classes: tuple[str, ...]
    """Names of transformers' classes that are this family's towers."""
    family: str
    """The family as people call it, for messages and the docs (``"SigLIP"``)."""
    layers: tuple[str, ...] = ("encoder.layers",)
    """Where the tower's list of layers lives, as a dotted path the module's name inside the
    tower ends with; the first of these the tower has is taken (transformers moved ViT's
    ``encoder.layer`` to ``layers``). ``hidden_states`` index these layers."""
    embeddings: tuple[str, ...] = ("embeddings",)
    """Where the module that turns pixels into the token sequence lives (same form as
    :attr:`layers`), or nothing: the tower has none of its own that ``patch_matmul`` and the
    row-major layout can change."""
    attention: str = "self_attn"
    """Each layer's attention module."""
    mlp: str = "mlp"
    """Each layer's MLP, for ``fuse_gelu``."""
    prefix_tokens: int | Callable[[Any], int] = 0
    """Tokens per image besides the patches (class and register tokens), or a function of the
    tower's configuration giving them."""
    image_sizes: ImageSizes | Callable[[Any], ImageSizes] = "interpolate"
    """Which image sizes the tower takes, or a function of its configuration saying so."""
    fused_attention: Callable[[nn.Module, FusedQKV], Callable[..., Any]] | None = None
    """The attention forward ``fuse_qkv`` routes each layer's attention to (it takes q, k and v
    from one product); ``None``: the family's attention has no such forward, and ``fuse_qkv``
    is refused."""
    casts_pixels: bool = False
    """Whether the tower casts the pixels it is given to its weights' dtype before using them,
    as most transformers patch embeddings do: float32 pixels from a processor then reach the
    graphs of a bfloat16 tower (:attr:`~layergraph.adapter.CapturePlan.casts_inputs`) instead
    of running eagerly."""
    feature_settings: tuple[str, ...] = ("vision_feature_layer", "vision_feature_layers")
    """The settings of a larger model's configuration that may name the hidden states it reads
    from the tower (the first it has; VipLLaVA's was ``vision_feature_layers`` before
    transformers 5.24), which the graphs then stop at."""
    paths: tuple[str, ...] = TOWER_PATHS
    """Where a larger model holds the tower (the model itself is tried first)."""
    inputs: Inputs = images
    """What a larger model calls the tower with, for example models and benchmarks."""
    plan: type | None = None
    """The plan class of a family with quirks, a subclass of
    :class:`~layergraph_adapters.kit.hf_vision.VisionTowerPlan` in the family's own module;
    ``None``: the shared one."""
    examples: Mapping[str, TowerExample] = field(default_factory=dict)
    """Deprecated (goes in 0.3; example models come from a plugin's ``example_model`` hook,
    :mod:`layergraph.bench.examples`): well-known towers of the family by name."""

    support: Support | None = field(default=TRANSFORMER_TOWERS, compare=False, kw_only=True)

    @property
    def title(self) -> str:
        return self.family

    def ruled_out(self) -> dict[str, str]:
        """:meth:`FamilyRecord.ruled_out`, and ``fuse_qkv`` for a family whose record names no
        attention forward taking q, k and v from one product (nor a plan that routes attention
        itself), ``patch_matmul`` for one whose record names no embeddings."""
        found = super().ruled_out()
        if self.fused_attention is None and not getattr(self.plan, "routes_attention", False):
            found["fuse_qkv"] = (
                f"fuse_qkv is not available for {self.family}: the {self.adapter} adapter has "
                "no attention forward that takes q, k and v from one product for its layers"
            )
        if not self.embeddings:
            found["patch_matmul"] = (
                f"patch_matmul is not available for {self.family}: its patch embedding is not "
                f"a module the {self.adapter} adapter can rewrite"
            )
        return found

    def prefix_for(self, config: Any) -> int:
        """Tokens per image besides the patches, for a tower of ``config``."""
        return self.prefix_tokens(config) if callable(self.prefix_tokens) else self.prefix_tokens

    def sizes_for(self, config: Any) -> ImageSizes:
        """Which image sizes a tower of ``config`` takes."""
        return self.image_sizes(config) if callable(self.image_sizes) else self.image_sizes

    def example_model(self, name: str) -> ExampleModel | None:
        """Deprecated with :attr:`examples`: the example model ``name`` of this family, fed
        what a larger model feeds it."""
        from layergraph.bench.example_model import ExampleModel

        example = self.examples.get(name)
        if example is None:
            return None

        def build(dtype: torch.dtype, device: torch.device) -> nn.Module:
            return build_tower(example.tower, example.settings, dtype, device)

        def inputs(
            batch: int, dtype: torch.dtype, device: torch.device
        ) -> tuple[tuple[Any, ...], dict[str, Any]]:
            config = transformers_class(example.tower).config_class(**example.settings)
            size = pair(example.image_size or config.image_size)
            return (), self.inputs(config, batch, size, dtype, device)

        return ExampleModel(name=name, adapter=self.adapter, build=build, inputs=inputs)


def is_tower(module: Any, classes: tuple[str, ...]) -> bool:
    """Whether ``module`` is an instance of a transformers class named in ``classes``."""
    return any(
        cls.__name__ in classes and cls.__module__.startswith("transformers.")
        for cls in type(module).__mro__
    )


def find_tower(model: nn.Module, spec: TowerSpec) -> nn.Module | None:
    """The first of ``model`` and the modules at ``spec.paths`` that is one of its towers."""
    for path in ("", *spec.paths):
        candidate: Any = model
        for name in filter(None, path.split(".")):
            candidate = getattr(candidate, name, None)
        if is_tower(candidate, spec.classes):
            return candidate
    return None


def find_module(root: nn.Module, paths: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    """The first module inside ``root`` whose dotted name is, or ends with, one of ``paths``
    (tried in order), with its name; ``None`` if there is none."""
    modules = list(root.named_modules())
    for path in paths:
        for name, module in modules:
            if name == path or name.endswith(f".{path}"):
                return name, module
    return None


def transformers_class(name: str) -> type:
    """transformers' class ``name``: an exported one (``"SiglipVisionModel"``), or
    ``"module.Class"`` for one its package does not export
    (``"idefics2.Idefics2VisionTransformer"``, from ``transformers.models.idefics2``)."""
    import transformers

    if "." not in name:
        return getattr(transformers, name)
    module, _, class_name = name.rpartition(".")
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(modeling, class_name)


def build_tower(
    class_name: str, settings: Mapping[str, Any], dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """A transformers vision tower built from ``settings`` with random weights, in eval mode.

    The way benchmarks and tests make a full-size tower without downloading weights.
    ``class_name`` is read by :func:`transformers_class`. The tower is built with ``dtype`` as
    the default dtype, as ``from_pretrained(dtype=...)`` builds it, rather than converted
    afterwards: buffers a model makes in a dtype of its own keep it (Llama 4's complex rotary
    table would lose its imaginary part).
    """
    tower_class = transformers_class(class_name)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = tower_class(tower_class.config_class(**settings))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def layer_list(tower: nn.Module, spec: TowerSpec) -> tuple[nn.Module, str, nn.ModuleList]:
    """The tower's list of layers named by ``spec.layers``: its parent module, its attribute
    name there, and the list. Raises :class:`~layergraph.AdapterMismatch` if there is none."""
    found = find_module(tower, spec.layers)
    if found is None or not isinstance(found[1], nn.ModuleList):
        raise AdapterMismatch(
            f"{type(tower).__name__} has no layer list at {' or '.join(spec.layers)}; the "
            f"{spec.adapter} adapter follows transformers' {spec.family} code, which has one"
        )
    name, layers = found
    parent_name, _, leaf = name.rpartition(".")
    return tower.get_submodule(parent_name), leaf, layers
