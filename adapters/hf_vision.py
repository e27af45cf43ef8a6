"""What transformers' vision towers have in common, for the InternVL, SigLIP and CLIP adapters.

A tower (``CLIPVisionModel``, ``SiglipVisionModel``, ``InternVLVisionModel``...) is found in the
model given to ``wrap`` (the model itself, or its ``vision_model`` / ``vision_tower``, as in
``CLIPModel``, ``SiglipModel``, LLaVA, LLaVA-NeXT, PaliGemma and InternVL), and its whole forward
is captured per key (images, tokens per image), then installed as the tower's forward so that
every caller (``generate``, ``get_image_features``) reaches the graphs. ``unwrap()`` restores it.

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
import sys
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, ExampleModel, PlanContext
from layergraph.adapter import own_forward
from layergraph.keys import CallInputs
from layergraph.ledger import Change, ChangeLedger, ReplaceSubmodule
from layergraph_adapters.feature_outputs import with_rest_on_demand
from layergraph_adapters.fused_norm import fused_norms
from layergraph_adapters.fused_qkv import FusedQKV, fused_attention_forward
from layergraph_adapters.gelu_epilogue import gelu_epilogues
from layergraph_adapters.layout import RowMajorOutput
from layergraph_adapters.patch_embedding import patch_matmul_for
from layergraph_adapters.tokens import ImageTokens
from layergraph_adapters.versions import require_transformers

_TOWER_PATHS = ("vision_model", "vision_tower", "model.vision_tower", "model.vision_model")


def build_tower(
    class_name: str, settings: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> nn.Module:
    """A transformers vision tower built from ``settings`` with random weights, in eval mode.

    The way benchmarks and tests make a full-size tower without downloading weights.
    """
    import transformers

    tower_class = getattr(transformers, class_name)
    config_class = tower_class.config_class
    with torch.device(device):
        model = tower_class(config_class(**settings))
    return model.to(dtype).eval()


def tower_example(
    name: str, adapter: str, class_name: str, settings: dict[str, Any]
) -> ExampleModel:
    """An :class:`ExampleModel` for a tower built by :func:`build_tower`, fed square images."""
    size = _pair(settings["image_size"])

    def inputs(
        batch: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        pixels = torch.randn(
            batch, settings.get("num_channels", 3), *size, dtype=dtype, device=device
        )
        return (), {"pixel_values": pixels}

    return ExampleModel(
        name=name,
        adapter=adapter,
        build=lambda dtype, device: build_tower(class_name, settings, dtype, device),
        inputs=inputs,
    )


def find_tower(model: nn.Module, classes: tuple[type, ...]) -> nn.Module | None:
    """The first of ``model`` and its usual tower attributes that is one of ``classes``."""
    for path in ("", *_TOWER_PATHS):
        candidate: Any = model
        for name in filter(None, path.split(".")):
            candidate = getattr(candidate, name, None)
        if isinstance(candidate, classes):
            return candidate
    return None


def transformers_classes(*names: str) -> tuple[type, ...]:
    """The classes of those ``names`` that this version of transformers has."""
    import transformers

    return tuple(cls for name in names if (cls := getattr(transformers, name, None)) is not None)


def vlm_feature_layers(model: nn.Module) -> int | list[int] | None:
    """The VLM's own ``vision_feature_layer`` setting, or ``None`` for a tower on its own."""
    return getattr(getattr(model, "config", None), "vision_feature_layer", None)


class VisionTowerAdapter(Adapter):
    """An adapter for one family of transformers vision towers; subclasses name the family.

    ``feature_layers`` (an index into ``hidden_states``, or a list of them) lets the graphs stop
    at the deepest layer needed; inside a VLM it defaults to the VLM's ``vision_feature_layer``.
    ``fuse_qkv=True`` computes each layer's q, k and v in one matrix product, whose weight the
    three projections' weights become views of (see :mod:`layergraph_adapters.fused_qkv`).
    ``patch_matmul=True`` runs the patch embedding as one matrix product
    (:mod:`layergraph_adapters.patch_embedding`); ``fuse_gelu=True`` applies each MLP's GELU
    in its up-projection's epilogue where the GELU is the tanh approximation, and
    ``fuse_gelu="approximate"`` for the exact GELU too, approximating it
    (:mod:`layergraph_adapters.gelu_epilogue`); ``fuse_norm=True`` computes each layer's
    residual adds and second norm with one Triton kernel, on CUDA
    (:mod:`layergraph_adapters.fused_norm`). All of them change values by rounding only
    (and ``"approximate"`` by the approximation), and are off by default.
    """

    tower_classes: ClassVar[tuple[str, ...]] = ()
    """Names of the transformers classes that are this family's towers."""
    prefix_tokens: ClassVar[int] = 0
    """Tokens per image besides the patches (a class token)."""
    example_configs: ClassVar[dict[str, dict[str, Any]]] = {}
    """Configurations of well-known towers of the family, by name, for example models."""

    def __init__(
        self,
        feature_layers: int | list[int] | None = None,
        fuse_qkv: bool = False,
        patch_matmul: bool = False,
        fuse_gelu: bool | str = False,
        fuse_norm: bool = False,
    ) -> None:
        self.feature_layers = feature_layers
        self.fuse_qkv = fuse_qkv
        self.patch_matmul = patch_matmul
        self.fuse_gelu = fuse_gelu
        self.fuse_norm = fuse_norm

    def recognizes(self, model: nn.Module) -> bool:
        if "transformers" not in sys.modules:
            return False
        return find_tower(model, transformers_classes(*self.tower_classes)) is not None

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        require_transformers(self.name)
        try:
            classes = transformers_classes(*self.tower_classes)
        except ImportError as error:
            raise ImportError(
                f"the {self.name} adapter needs transformers: "
                f"pip install 'layergraph[transformers]'"
            ) from error
        tower = find_tower(model, classes)
        if tower is None:
            raise AdapterMismatch(
                f"the {self.name} adapter serves transformers' {', '.join(self.tower_classes)} "
                f"and models holding one as vision_model or vision_tower; got "
                f"{type(model).__module__}.{type(model).__name__}"
            )
        layers = self.feature_layers
        if layers is None and tower is not model:
            layers = vlm_feature_layers(model)
        return self.make_plan(tower, layers, context)

    def make_plan(
        self, tower: nn.Module, feature_layers: int | list[int] | None, context: PlanContext
    ) -> VisionTowerPlan:
        """The plan for ``tower``; subclasses return a richer one (routed attention, say)."""
        return VisionTowerPlan(
            tower,
            prefix_tokens=self.prefix_tokens,
            feature_layers=feature_layers,
            **self.rewrite_options(),
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
        return list(self.example_configs)

    def example_model(self, name: str) -> ExampleModel | None:
        settings = self.example_configs.get(name)
        if settings is None:
            return None
        return tower_example(name, self.name, self.tower_classes[0], settings)


class VisionTowerPlan(CapturePlan):
    """A transformers vision tower's whole forward, keyed by (images, tokens per image)."""

    attention_routing: ClassVar[str] = "q, k and v from the fused product (fuse_qkv)"
    """What the routed attention forward does, for ``GraphedModule.changes``."""

    def __init__(
        self,
        tower: nn.Module,
        *,
        prefix_tokens: int,
        feature_layers: int | Sequence[int] | None = None,
        fuse_qkv: bool = False,
        patch_matmul: bool = False,
        fuse_gelu: bool | str = False,
        fuse_norm: bool = False,
    ) -> None:
        config = tower.config
        self.owner = tower
        self.prefix_tokens = prefix_tokens
        self.patch_size = _pair(config.patch_size)
        self.image_size = _pair(config.image_size)
        self.channels: int = config.num_channels
        self._forward = own_forward(tower)
        self._parent, self._layers_name, layers = _layer_list(tower)
        self.depth = len(layers)
        self.feature_layers = self._held_layers(feature_layers)
        """Indices into ``hidden_states`` (0: embeddings, i: after layer i) the feature graphs
        return, or ``None`` when graphs run the whole tower."""
        self._truncation = threading.Lock()
        self._output_hooks_installed = False
        """Whether transformers' hidden-state hooks were installed on the whole tower before its
        layers were first cut (:func:`_install_output_hooks`)."""
        self._attentions = self.attention_modules()
        if fuse_qkv and len(self._attentions) != self.depth:
            raise AdapterMismatch(
                f"fuse_qkv needs an attention module in every layer; {type(tower).__name__}'s "
                f"layers have no self_attn"
            )
        self.fusions = [FusedQKV(module) for module in self._attentions] if fuse_qkv else []
        """One :class:`FusedQKV` per layer with ``fuse_qkv``; empty without."""
        self._changes: ChangeLedger | None = None
        embeddings = _embeddings(tower)
        mlps = [layer.mlp for layer in self.layers() if hasattr(layer, "mlp")]
        if fuse_gelu and len(mlps) != self.depth:
            raise AdapterMismatch(
                f"fuse_gelu needs an MLP in every layer; {type(tower).__name__}'s layers have "
                f"no mlp"
            )
        self._rewrites: list[Change] = [
            *([RowMajorOutput(embeddings)] if embeddings is not None else []),
            *patch_matmul_for(embeddings, patch_matmul),
            *gelu_epilogues(mlps, fuse_gelu),
            *fused_norms(self.layers(), fuse_norm),
        ]
        """What is rewritten while wrapped, each a change made through the ledger: the
        embeddings' output made row-major (SigLIP's comes out column-major,
        :mod:`layergraph_adapters.layout`; CLIP's is row-major already), and the
        ``patch_matmul``, ``fuse_gelu`` and ``fuse_norm`` options."""

    def _held_layers(self, wanted: int | Sequence[int] | None) -> tuple[int, ...] | None:
        if wanted is None:
            return None
        indices = [wanted] if isinstance(wanted, int) else list(wanted)
        count = self.depth + 1
        bad = [i for i in indices if not -count <= i < count]
        if bad or not indices:
            raise ValueError(
                f"feature_layers {wanted!r}: hidden_states has {count} entries (embeddings and "
                f"{self.depth} layers), so indices must lie in [{-count}, {count - 1}]"
            )
        held = tuple(sorted({i % count for i in indices}))
        return None if held[-1] == self.depth else held

    def attention_modules(self) -> list[nn.Module]:
        """The layers' attention modules, in order (``self_attn`` of CLIP-style layers)."""
        return [layer.self_attn for layer in self.layers() if hasattr(layer, "self_attn")]

    def routed_attention(self, index: int, module: nn.Module) -> Callable[..., Any] | None:
        """The forward attention module ``index`` runs while wrapped; ``None``: its own."""
        if not self.fusions:
            return None
        return fused_attention_forward(module, self.fusions[index])

    # ---- what the runner asks ----------------------------------------------------------------

    def region(self, *args: Any, **kwargs: Any) -> Any:
        for fusion in self.fusions:
            fusion.refresh()
        if self.feature_layers is not None and kwargs.get("output_hidden_states"):
            return self._feature_region(args, kwargs)
        return self._forward(*args, **kwargs)

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
        missing = sorted({i % (self.depth + 1) for i in indices} - set(self.feature_layers))
        if missing:
            return f"hidden states {missing} are not among the graphs' feature layers"
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
        if (height, width) != self.image_size and not self._resizes(call):
            raise ValueError(
                f"image size {height}x{width} differs from the model's "
                f"{self.image_size[0]}x{self.image_size[1]}; pass interpolate_pos_encoding=True "
                f"to take other sizes"
            )

    def _resizes(self, call: CallInputs) -> bool:
        """Whether the tower takes images of other sizes in this call."""
        return bool(call.argument("interpolate_pos_encoding"))

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
            if self.feature_layers is None or not kwargs.get("output_hidden_states"):
                return out
            return with_rest_on_demand(out, lambda: self._forward(*args, **kwargs))

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


def _embeddings(tower: nn.Module) -> nn.Module | None:
    """The tower's patch-and-position embedding module (``embeddings``), if it has one."""
    for name, module in tower.named_modules():
        if name.rsplit(".", 1)[-1] == "embeddings":
            return module
    return None


def _pair(value: int | Sequence[int]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _layer_list(tower: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The encoder's list of layers: its parent module, attribute name, and the list."""
    for name, module in tower.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and leaf in ("layers", "layer") and "encoder" in name:
            parent = tower.get_submodule(name.rsplit(".", 1)[0]) if "." in name else tower
            return parent, leaf, module
    raise AdapterMismatch(f"{type(tower).__name__} has no encoder layer list")


def pixels_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The ``pixel_values`` of a tower call, positional or keyword."""
    pixels = kwargs.get("pixel_values", args[0] if args else None)
    if not isinstance(pixels, torch.Tensor):
        raise TypeError("the vision tower's forward needs pixel_values as a tensor")
    return pixels
