"""The adapter and plan of transformers' vision towers, for every family in the table.

A tower (``CLIPVisionModel``, ``SiglipVisionModel``, ``InternVLVisionModel``...) is found in the
model given to ``wrap`` (the model itself, or where its family's
:class:`~layergraph_adapters.kit.tower_specs.TowerSpec` says a larger model holds it: the
``vision_model`` of ``CLIPModel`` or Idefics, the ``vision_tower`` of LLaVA), and its whole
forward is captured per key (images, tokens per image), then installed as the tower's forward
so that every caller (``generate``, ``get_image_features``) reaches the graphs. ``unwrap()``
restores it. What differs between families (classes, where the layers live, prefix tokens,
image sizes, which speed options fit) is the spec's data; families with quirks subclass
:class:`VisionTowerPlan` in their own module.

Feature layers: a VLM that reads hidden states before the last layer (LLaVA reads layer -2)
does not need the layers after it. With ``feature_layers`` set, calls that ask for hidden
states run a graph that stops at the deepest layer needed and returns those hidden states at
their usual indices of ``hidden_states``. What the graph did not compute
(``last_hidden_state``, ``pooler_output``, the other hidden states) is computed eagerly, by the
tower's whole forward on the same inputs, the first time a caller reads it, so the output
holds what the model's would. Calls that say they need more run eagerly and say why.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, PlanContext
from layergraph.adapter import own_forward
from layergraph.keys import CallInputs
from layergraph.ledger import Change, ChangeLedger, ReplaceSubmodule
from layergraph_adapters.kit.automatic import SpeedChoices, build_with_automatic_options
from layergraph_adapters.kit.feature_outputs import (
    computed_later,
    feature_indices,
    with_rest_on_demand,
)
from layergraph_adapters.kit.fused_norm import fused_norms
from layergraph_adapters.kit.fused_qkv import FusedQKV
from layergraph_adapters.kit.gelu_epilogue import gelu_epilogues
from layergraph_adapters.kit.layout import RowMajorOutput
from layergraph_adapters.kit.patch_embedding import patch_matmul_for
from layergraph_adapters.kit.tokens import ImageTokens
from layergraph_adapters.kit.tower_specs import (
    TowerSpec,
    find_module,
    find_tower,
    layer_list,
    pair,
)
from layergraph_adapters.kit.versions import require_transformers

if TYPE_CHECKING:
    from layergraph.bench.example_model import ExampleModel


def vlm_feature_layers(model: nn.Module, spec: TowerSpec) -> int | list[int] | None:
    """The hidden states a larger model reads from its tower, as the first of
    ``spec.feature_settings`` its configuration has says (``vision_feature_layer``), or
    ``None``."""
    config = getattr(model, "config", None)
    for setting in spec.feature_settings:
        layers = getattr(config, setting, None)
        if layers is not None:
            return layers
    return None


class VisionTowerAdapter(Adapter):
    """An adapter for one family of transformers vision towers, described by :attr:`spec`.

    ``feature_layers`` (an index into ``hidden_states``, or a list of them) lets the graphs stop
    at the deepest layer needed; inside a VLM it defaults to the VLM's ``vision_feature_layer``.
    ``fuse_qkv=True`` computes each layer's q, k and v in one matrix product, whose weight the
    three projections' weights become views of (see :mod:`layergraph_adapters.kit.fused_qkv`).
    ``patch_matmul=True`` runs the patch embedding as one matrix product
    (:mod:`layergraph_adapters.kit.patch_embedding`); ``fuse_gelu=True`` applies each MLP's GELU
    in its up-projection's epilogue where the GELU is the tanh approximation, and
    ``fuse_gelu="approximate"`` for the exact GELU too, approximating it
    (:mod:`layergraph_adapters.kit.gelu_epilogue`); ``fuse_norm=True`` computes each layer's
    residual adds and second norm with one Triton kernel, on CUDA
    (:mod:`layergraph_adapters.kit.fused_norm`). All of them change values by rounding only
    (and ``"approximate"`` by the approximation) and default to ``"auto"``: on where they fit
    on a GPU (:mod:`layergraph_adapters.kit.automatic`; ``fuse_gelu`` for tanh GELUs only); a
    family whose layers do not fit one of them given ``True`` refuses it with the reason.
    """

    spec: ClassVar[TowerSpec]
    """The family this adapter serves."""

    def __init__(
        self,
        feature_layers: int | list[int] | None = None,
        fuse_qkv: bool | str = "auto",
        patch_matmul: bool | str = "auto",
        fuse_gelu: bool | str = "auto",
        fuse_norm: bool | str = "auto",
    ) -> None:
        self.feature_layers = feature_layers
        self.fuse_qkv = fuse_qkv
        self.patch_matmul = patch_matmul
        self.fuse_gelu = fuse_gelu
        self.fuse_norm = fuse_norm

    def recognizes(self, model: nn.Module) -> bool:
        if "transformers" not in sys.modules:
            return False
        return find_tower(model, self.spec) is not None

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        require_transformers(self.name)
        tower = find_tower(model, self.spec)
        if tower is None:
            raise AdapterMismatch(
                f"the {self.name} adapter serves transformers' {', '.join(self.spec.classes)} "
                f"and models holding one as {', '.join(self.spec.paths)}; got "
                f"{type(model).__module__}.{type(model).__name__}"
            )
        layers = self.feature_layers
        if layers is None and tower is not model:
            layers = vlm_feature_layers(model, self.spec)
        return self.make_plan(tower, layers, context)

    def make_plan(
        self, tower: nn.Module, feature_layers: int | list[int] | None, context: PlanContext
    ) -> VisionTowerPlan:
        """The plan for ``tower``: the family's own plan class, or the shared one."""
        plan_class = self.spec.plan or VisionTowerPlan
        return build_with_automatic_options(
            tower,
            self.rewrite_options(),
            functools.partial(plan_class, tower, self.spec, feature_layers=feature_layers),
            context,
            self.spec.ruled_out(),
        )

    def rewrite_options(self) -> dict[str, Any]:
        """The options that rewrite parts of the tower while wrapped, for the plan."""
        return {
            "fuse_qkv": self.fuse_qkv,
            "patch_matmul": self.patch_matmul,
            "fuse_gelu": self.fuse_gelu,
            "fuse_norm": self.fuse_norm,
        }

    def example_models(self) -> list[str]:
        """Deprecated with :attr:`TowerSpec.examples`."""
        return list(self.spec.examples)

    def example_model(self, name: str) -> ExampleModel | None:
        return self.spec.example_model(name)


def adapter_class(
    spec: TowerSpec, base: type[VisionTowerAdapter] = VisionTowerAdapter
) -> type[VisionTowerAdapter]:
    """The adapter class of the family ``spec`` describes, named after it, to register: a
    subclass of ``base`` (one that takes options of its own)."""
    title = "".join(part.title() for part in spec.adapter.replace("-", "_").split("_"))
    return type(
        f"{title}Adapter",
        (base,),
        {
            "name": spec.adapter,
            "spec": spec,
            "__module__": __name__,
            "__doc__": f"Graphs a {spec.family} vision tower, alone or inside a larger model.",
        },
    )


class VisionTowerPlan(CapturePlan):
    """A transformers vision tower's whole forward, keyed by (images, tokens per image).

    What it needs to know about the tower's family comes from a :class:`TowerSpec`.
    """

    attention_routing: ClassVar[str] = "q, k and v from the fused product (fuse_qkv)"
    """What the routed attention forward does, for ``GraphedModule.changes``."""
    routes_attention: ClassVar[bool] = False
    """Whether this plan routes the layers' attention itself (and fuses q, k and v there),
    whatever the spec's ``fused_attention`` says."""

    def __init__(
        self,
        tower: nn.Module,
        spec: TowerSpec,
        *,
        feature_layers: int | Sequence[int] | None = None,
        choices: SpeedChoices,
    ) -> None:
        config = tower.config
        self.owner = tower
        self.spec = spec
        self.casts_inputs = spec.casts_pixels
        self.read_geometry(config)
        self._forward = own_forward(tower)
        self._parent, self._layers_name, layers = layer_list(tower, spec)
        self.depth = len(layers)
        self.feature_layers = self._held_layers(feature_layers)
        self._whole_keys: dict[tuple[str, ...], tuple[str, ...]] = {}
        """The keys of the whole tower's outputs, learnt by feature outputs
        (:func:`~layergraph_adapters.kit.feature_outputs.with_rest_on_demand`)."""
        """Indices into ``hidden_states`` (0: embeddings, i: after layer i) the feature graphs
        return, or ``None`` when graphs run the whole tower."""
        self._truncation = threading.Lock()
        self._output_hooks_installed = False
        """Whether transformers' hidden-state hooks were installed on the whole tower before its
        layers were first cut (:func:`_install_output_hooks`)."""
        self._attentions = self.attention_modules()
        self.fusions = choices.take("fuse_qkv", self._fused_qkv, [])
        """One :class:`FusedQKV` per layer with ``fuse_qkv``; empty without."""
        self._changes: ChangeLedger | None = None
        found = find_module(tower, spec.embeddings)
        embeddings = found[1] if found is not None else None
        patch = choices.take("patch_matmul", lambda on: self._patch_matmul(embeddings, on), [])
        norms = choices.take(
            "fuse_norm", lambda on: fused_norms(self.layers(), on, spec.layer_form), []
        )
        self._rewrites: list[Change] = [
            *([RowMajorOutput(embeddings)] if embeddings is not None else []),
            *patch,
            *choices.take("fuse_gelu", self._gelu_epilogues, []),
            *norms,
        ]
        """What is rewritten while wrapped, each a change made through the ledger: the
        embeddings' output made row-major (SigLIP's comes out column-major,
        :mod:`layergraph_adapters.kit.layout`; CLIP's is row-major already), and the
        ``patch_matmul``, ``fuse_gelu`` and ``fuse_norm`` options."""

    def _fused_qkv(self, setting: object) -> list[FusedQKV]:
        tower, spec = self.owner, self.spec
        if not (self.routes_attention or spec.fused_attention):
            raise AdapterMismatch(
                f"fuse_qkv is not available for {spec.family} ({type(tower).__name__}): the "
                f"{spec.adapter} adapter has no attention forward that takes q, k and v from "
                f"one product for its layers"
            )
        if len(self._attentions) != self.depth:
            raise AdapterMismatch(
                f"fuse_qkv needs an attention module in every layer; {type(tower).__name__}'s "
                f"layers have no {spec.attention}"
            )
        return [FusedQKV(module) for module in self._attentions]

    def _patch_matmul(self, embeddings: nn.Module | None, setting: object) -> list[Change]:
        if embeddings is None:
            raise AdapterMismatch(
                f"patch_matmul is not available for {self.spec.family} "
                f"({type(self.owner).__name__}): its patch embedding is not a module the "
                f"{self.spec.adapter} adapter can rewrite"
            )
        return patch_matmul_for(embeddings, setting)

    def _gelu_epilogues(self, setting: object) -> list[Change]:
        name = self.spec.mlp
        mlps = [getattr(layer, name) for layer in self.layers() if hasattr(layer, name)]
        if len(mlps) != self.depth:
            raise AdapterMismatch(
                f"fuse_gelu needs an MLP in every layer; {type(self.owner).__name__}'s layers "
                f"have no {name}"
            )
        return gelu_epilogues(mlps, setting)

    def _held_layers(self, wanted: int | Sequence[int] | None) -> tuple[int, ...] | None:
        if wanted is None:
            return None
        held = feature_indices(wanted, self.depth)
        return None if held[-1] == self.depth else held

    def read_geometry(self, config: Any) -> None:
        """Read from the tower's configuration what its inputs are checked and keyed by: an
        image tower's channels, image and patch size, and tokens besides the patches. A tower
        of other inputs (an audio encoder's mel features) overrides it, with
        :meth:`sequence_of` and :meth:`check_inputs`."""
        self.prefix_tokens = self.spec.prefix_for(config)
        self.image_sizes = self.spec.sizes_for(config)
        self.patch_size = pair(config.patch_size)
        self.image_size = pair(config.image_size)
        self.channels: int = getattr(config, "num_channels", 3)  # BLIP's configurations lack it

    def attention_modules(self) -> list[nn.Module]:
        """The layers' attention modules, in order (the spec's ``attention`` of each layer)."""
        name = self.spec.attention
        return [getattr(layer, name) for layer in self.layers() if hasattr(layer, name)]

    def routed_attention(self, index: int, module: nn.Module) -> Callable[..., Any] | None:
        """The forward attention module ``index`` runs while wrapped; ``None``: its own."""
        if not self.fusions or self.spec.fused_attention is None:
            return None
        return self.spec.fused_attention(module, self.fusions[index])

    # ---- what the runner asks ----------------------------------------------------------------

    def region(self, *args: Any, **kwargs: Any) -> Any:
        for fusion in self.fusions:
            fusion.refresh()
        if self._features_serve(kwargs.get("output_hidden_states")):
            return self._feature_region(args, kwargs)
        return self._forward(*args, **kwargs)

    def _features_serve(self, asked: Any) -> bool:
        """Whether the feature layers hold every hidden state ``output_hidden_states=asked``
        asks for (``True``: those the graphs hold; an index or a list: those)."""
        if self.feature_layers is None or not asked:
            return False
        if asked is True:
            return True
        indices = [asked] if isinstance(asked, int) else list(asked)
        count = self.depth + 1
        return {i % count for i in indices} <= set(self.feature_layers)

    def sequence_of(self, call: CallInputs) -> Hashable:
        height, width = call.tensors[0].shape[-2:]
        return self.image_tokens(height, width)

    def image_tokens(self, height: int, width: int) -> ImageTokens:
        """The sequence of an image of ``height`` x ``width`` pixels."""
        patches = (height // self.patch_size[0]) * (width // self.patch_size[1])
        return ImageTokens(patches + self.prefix_tokens, height, width)

    def eager_reason(self, call: CallInputs) -> str | None:
        if call.argument("output_attentions"):
            return "attention weights were asked for (output_attentions=True)"
        if self.feature_layers is None:
            return None
        asked = call.argument("output_hidden_states")
        deepest = self.feature_layers[-1]
        if not asked:
            return (
                f"the graphs stop after layer {deepest} of {self.depth} "
                f"(feature_layers); this call needs the last hidden state"
            )
        if asked is True:
            return None
        indices = [asked] if isinstance(asked, int) else list(asked)
        count = self.depth + 1
        missing = sorted({i % count for i in indices} - set(self.feature_layers))
        if missing:
            wanted = sorted({i % count for i in indices} | set(self.feature_layers))
            return (
                f"hidden states {missing} (of {count}: embeddings and {self.depth} layers; "
                f"asked as {asked!r}) are not among the graphs' feature layers "
                f"{list(self.feature_layers)}; wrap with feature_layers={wanted} to serve them"
            )
        return None

    def check_inputs(self, call: CallInputs) -> None:
        pixels = call.tensors[0]
        if pixels.dim() != 4:
            raise ValueError(
                f"expected pixel_values of shape [images, channels, height, width], got "
                f"{tuple(pixels.shape)}"
            )
        _, channels, height, width = pixels.shape
        if channels != self.channels:
            raise ValueError(f"expected {self.channels} channels, got {channels}")
        self.check_image_size(height, width, call)

    def check_image_size(self, height: int, width: int, call: CallInputs) -> None:
        """Raise ``ValueError`` if the tower does not take images of ``height`` x ``width``
        pixels in this call (the spec's ``image_sizes``)."""
        if (height, width) == self.image_size or self.image_sizes == "any":
            return
        expected = f"{self.image_size[0]}x{self.image_size[1]}"
        if self.image_sizes == "fixed":
            raise ValueError(
                f"image size {height}x{width} differs from the model's {expected}, the only "
                f"size {type(self.owner).__name__} takes"
            )
        if not call.argument("interpolate_pos_encoding"):
            raise ValueError(
                f"image size {height}x{width} differs from the model's {expected}; pass "
                f"interpolate_pos_encoding=True to take other sizes"
            )

    def layers(self) -> list[nn.Module]:
        return list(getattr(self._parent, self._layers_name))

    @property
    def capture_module(self) -> nn.Module:
        return self.owner

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        self._changes = changes
        changes.set_forward(self.owner, self._tower_forward(serve), "forward routed to the graphs")
        for fusion in self.fusions:
            changes.apply(fusion)
        for index, module in enumerate(self._attentions):
            routed = self.routed_attention(index, module)
            if routed is not None:
                changes.set_forward(module, routed, self.attention_routing)
        for rewrite in self._rewrites:
            changes.apply(rewrite)

    def _tower_forward(self, serve: Callable[..., Any]) -> Callable[..., Any]:
        """The tower's forward while wrapped: ``serve``, and what feature graphs left out
        computed on demand."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = serve(*args, **kwargs)
            if not self._features_serve(kwargs.get("output_hidden_states")):
                return out
            later = computed_later(self._forward, args, kwargs, serve.count_eager)
            return with_rest_on_demand(out, later, self._whole_keys)

        return forward

    # ---- feature layers ----------------------------------------------------------------------

    def _feature_region(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        held = self.feature_layers
        with self._truncated(held[-1]):
            out = self._forward(*args, **{**kwargs, "output_hidden_states": True})
        hidden = [None] * (self.depth + 1)
        for index in held:
            hidden[index] = out.hidden_states[index]
        return type(out)(hidden_states=tuple(hidden))

    @contextlib.contextmanager
    def _truncated(self, depth: int) -> Iterator[None]:
        """The tower with only its first ``depth`` layers, for the duration of one call."""
        if self._changes is None:
            raise RuntimeError("feature layers are served only while the model is wrapped")
        with self._truncation:
            if not self._output_hooks_installed:
                _install_output_hooks(self.owner)
                self._output_hooks_installed = True
            layers = getattr(self._parent, self._layers_name)
            cut = ReplaceSubmodule(
                self._parent,
                self._layers_name,
                nn.ModuleList(list(layers)[:depth]),
                f"layers cut after layer {depth} for one call (feature_layers)",
            )
            with self._changes.temporarily(cut):
                yield


def _install_output_hooks(tower: nn.Module) -> None:
    """Install transformers' hidden-state hooks on the whole tower, if not yet done.

    transformers installs the hooks that collect ``hidden_states`` on a model's first call that
    asks for them, on the layers present at that moment, and never again. Were that first call
    a feature graph's, with the layers cut, every later call of the whole tower would miss the
    hidden states of the layers cut away.
    """
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:  # transformers without output-capturing hooks collects them inline
        return
    for module in tower.modules():
        if getattr(module, "_can_record_outputs", None):
            maybe_install_capturing_hooks(module)


def pixels_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The ``pixel_values`` of a tower call, positional or keyword."""
    pixels = kwargs.get("pixel_values", args[0] if args else None)
    if not isinstance(pixels, torch.Tensor):
        raise TypeError("the vision tower's forward needs pixel_values as a tensor")
    return pixels
