"""Plugin for SigLIP2 NaFlex vision towers from transformers, served per token budget.

Serves ``Siglip2VisionModel``, alone or inside a model that holds it: the vision half of
``Siglip2Model`` and ``Siglip2ForImageClassification`` (``vision_model``) and LFM2-VL's tower
(``Lfm2VlModel.vision_tower``, ``Lfm2VlForConditionalGeneration.model.vision_tower``). Wrapping
a larger model graphs the tower in place, so that its own methods (``get_image_features``,
``generate``, ``forward``) use the graphs; ``unwrap()`` restores it.

The tower takes every image at its own patch grid, padded into one batch: ``pixel_values``
``[images, max_patches, channels * patch * patch]``, ``pixel_attention_mask`` ``[images,
max_patches]`` (1 for an image's first ``height * width`` patches) and ``spatial_shapes``
``[images, 2]``. Its graphs hold no padding: on the host each call's grids give its images'
boundaries, and before every replay the real patches are gathered into one sequence in the
buffers of a token budget (:mod:`layergraph.packing`), with their position embeddings (the
tower's table resized to each grid by the tower's own function, kept per grid:
:mod:`layergraph_adapters.kit.grid_positions`) and the images' boundaries beside them, in the
attention metadata the ``attention_metadata`` hook built for the budget (a
:class:`~layergraph.attention.PackedLayout`); inside the graph attention runs per image through
a backend that reads the boundaries when it runs (``sdpa_varlen`` off the GPU, ``triton`` or
``fa3`` on it) or, with ``attention="auto"``, where a budget of at most 4096 tokens measured
it faster, over the whole budget under a block-diagonal mask built in the graph from the
boundaries (``sdpa_dense_masked``: the kernel the tower's own forward gets, cuDNN's on an
H200, where the varlen kernels pad SigLIP2's head dim of 72); the pooling head attends per image
(:mod:`layergraph_adapters.kit.naflex`). ``graphed.plan.attention_by_budget`` says which ran.
The outputs are scattered back into the tower's layout.

What the wrapped tower returns: ``last_hidden_state`` ``[images, max_patches, width]`` equal to
the tower's at every real patch and zero at every padding position (where the tower's own
values are its layers applied to whatever the caller padded with; no transformers model reads
them), and ``pooler_output`` equal to the tower's. Eager calls through the wrapper zero the
padding too, so every path returns the same. Calls that ask for attention weights or hidden
states, pass other arguments, or whose mask does not mark each image's first
``height * width`` patches run the tower eagerly, the reason counted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from layergraph import hookimpl
from layergraph.keys import UnsupportedCall
from layergraph.ledger import Change, ChangeLedger
from layergraph.packing import PackedCall
from layergraph_adapters.kit import naflex
from layergraph_adapters.kit.automatic import SpeedChoices
from layergraph_adapters.kit.budget_buffers import StagedField
from layergraph_adapters.kit.fused_norm import ENCODER_LAYER, fused_norms
from layergraph_adapters.kit.gelu_epilogue import gelu_epilogues
from layergraph_adapters.kit.grid_positions import GridPositions
from layergraph_adapters.kit.packed_tower import (
    PackedFamily,
    PackedTowerAdapter,
    PackedTowerPlan,
    host_boundaries,
    image_slots,
    read_inputs,
)
from layergraph_adapters.kit.tower_specs import TEXT_ONLY_ARGUMENTS, TOWER_PATHS
from layergraph_adapters.kit.versions import TRANSFORMER_TOWERS

FAMILY = PackedFamily(
    module="transformers.models.siglip2.modeling_siglip2",
    name="Siglip2VisionModel",
    holders={"*": TOWER_PATHS},
    layers="encoder.layers",
    attention="self_attn",
    support=TRANSFORMER_TOWERS,
    layer_form=ENCODER_LAYER,
)
"""SigLIP2's tower, held as ``vision_model`` or ``vision_tower`` by any model."""


@dataclass(eq=False)
class _Layout:
    """What a call's grids at its ``max_patches`` give, the same for every call of them: kept
    for the layouts used last (:data:`_LAYOUTS_KEPT`), so that a call of a layout seen before
    makes none of it again. Read only."""

    grids: tuple[tuple[int, int], ...]
    patches: int
    """The call's ``max_patches``."""
    counts: list[int] = field(init=False)
    tokens: int = field(init=False)
    slots: int = field(init=False)
    cu_seqlens: torch.Tensor = field(init=False)
    """The images' boundaries in the call's slots, on the host."""
    mask: torch.Tensor = field(init=False, repr=False)
    """The ``pixel_attention_mask`` the grids ask for, ``[images, max_patches]`` bool, host."""
    _index: dict[torch.device, torch.Tensor] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.counts = [height * width for height, width in self.grids]
        self.tokens = sum(self.counts)
        self.slots = image_slots(len(self.grids))
        self.cu_seqlens = host_boundaries(self.counts, self.slots)
        counts = torch.tensor(self.counts)
        self.mask = torch.arange(self.patches)[None, :] < counts[:, None]

    def index(self, device: torch.device) -> torch.Tensor:
        """Where each real patch sits among the call's ``images * max_patches`` rows (int64,
        packed order), on ``device``."""
        index = self._index.get(device)
        if index is None:
            index = self.mask.reshape(-1).nonzero().reshape(-1).to(device)
            self._index[device] = index
        return index


_LAYOUTS_KEPT = 64
"""How many call layouts (grids and ``max_patches``) a plan keeps."""


@dataclass(eq=False)
class _Images:
    """A call's images: its pixels and its :class:`_Layout`."""

    pixels: torch.Tensor
    """The call's ``pixel_values``, ``[images, max_patches, features]``."""
    layout: _Layout
    return_dict: bool
    options: dict[str, Any]
    """The call's arguments besides the inputs, for the pieces of a split call."""

    @property
    def grids(self) -> tuple[tuple[int, int], ...]:
        return self.layout.grids

    @property
    def counts(self) -> list[int]:
        return self.layout.counts

    @property
    def slots(self) -> int:
        return self.layout.slots

    def index(self, device: torch.device) -> torch.Tensor:
        """Where each real patch sits among the call's rows (:meth:`_Layout.index`)."""
        return self.layout.index(device)


class Siglip2Plan(PackedTowerPlan):
    """The tower per token budget (:mod:`layergraph_adapters.kit.naflex`); eager calls run the
    tower's own forward, its padding zeroed."""

    inputs = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
    options = frozenset({"output_attentions", "output_hidden_states", "return_dict"})
    dense = True
    casts_inputs = True  # the patch embedding casts the pixels to its weights' dtype
    staged_fields = (StagedField.boundaries(),)

    def __init__(
        self,
        tower: nn.Module,
        adapter: Siglip2Adapter,
        *args: Any,
        choices: SpeedChoices,
    ) -> None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        super().__init__(tower, adapter, *args)
        layers = list(tower.encoder.layers)
        norms = choices.take("fuse_norm", lambda on: fused_norms(layers, on, FAMILY.layer_form), [])
        mlps = [layer.mlp for layer in layers]
        self.rewrites: list[Change] = [
            *choices.take("fuse_gelu", lambda setting: gelu_epilogues(mlps, setting), []),
            *norms,
        ]
        """The ``fuse_gelu`` and ``fuse_norm`` rewrites of the encoder's layers; empty
        without them."""
        self._output_type = BaseModelOutputWithPooling
        self._positions = GridPositions(tower.embeddings, rows=adapter.max_tokens)
        config = tower.config
        self.features = config.num_channels * config.patch_size**2
        self._layouts: OrderedDict[tuple[Any, ...], _Layout] = OrderedDict()
        self._specs: dict[tuple[bool, bool], pytree.TreeSpec] = {}

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        super().change_model(changes, serve)
        for rewrite in self.rewrites:
            changes.apply(rewrite)

    def packed_forward(self, buffers: naflex.NaflexBuffers) -> tuple[torch.Tensor, Any]:
        return naflex.packed_forward(self.owner, buffers)

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """The tower's own forward, with ``last_hidden_state`` zero where the mask is."""
        out = self.own(*args, **kwargs)
        mask = kwargs.get("pixel_attention_mask", args[1] if len(args) > 1 else None)
        hidden = out[0]
        if not isinstance(mask, torch.Tensor) or hidden.shape[:2] != mask.shape:
            return out
        zeroed = hidden.masked_fill(mask[..., None] == 0, 0)
        if isinstance(out, tuple):
            return (zeroed, *out[1:])
        out.last_hidden_state = zeroed
        return out

    def attend_packed(
        self,
        module: nn.Module,
        buffers: Any,
        hidden_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        tokens = hidden_states.shape[0]
        q, k, v = (
            projection(hidden_states).view(tokens, module.num_heads, module.head_dim)
            for projection in (module.q_proj, module.k_proj, module.v_proj)
        )
        out = self.attend(buffers, q, k, v, module.scale)
        return module.out_proj(out.reshape(tokens, -1)), None

    # ---- packing -----------------------------------------------------------------------------

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        given, options = read_inputs(
            args, kwargs, self.inputs, self.options, ignored=TEXT_ONLY_ARGUMENTS
        )
        pixels, mask, shapes = (given.get(name) for name in self.inputs)
        if not all(isinstance(t, torch.Tensor) for t in (pixels, mask, shapes)):
            raise UnsupportedCall(
                "the graphs need pixel_values, pixel_attention_mask and spatial_shapes as tensors"
            )
        self._check_shapes(pixels, mask, shapes)
        grids, real = _read_grids(mask, shapes)
        layout = self._layout(grids, mask.shape[1])
        if not torch.equal(real, layout.mask):
            raise UnsupportedCall(
                "input pixel_attention_mask does not mark exactly the first height x width "
                "patches of each image (spatial_shapes) as real"
            )
        return_dict = options.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.owner.config, "return_dict", True)
        return self._call(args, kwargs, pixels, mask, layout, bool(return_dict), options)

    def _layout(self, grids: tuple[tuple[int, int], ...], patches: int) -> _Layout:
        """The layout of ``grids`` at ``patches``, kept or made (and kept)."""
        key = (grids, patches)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _Layout(grids, patches)
            if len(self._layouts) > _LAYOUTS_KEPT:
                self._layouts.popitem(last=False)
        else:
            self._layouts.move_to_end(key)
        return layout

    def _check_shapes(self, pixels: torch.Tensor, mask: torch.Tensor, shapes: torch.Tensor) -> None:
        """Raise :class:`~layergraph.keys.UnsupportedCall` unless the inputs are a padded batch
        of one or more images of this tower's patches."""
        if (
            pixels.dim() != 3
            or mask.shape != pixels.shape[:2]
            or shapes.shape != (pixels.shape[0], 2)
            or pixels.shape[2] != self.features
        ):
            raise UnsupportedCall(
                f"input pixel_values {tuple(pixels.shape)}, pixel_attention_mask "
                f"{tuple(mask.shape)} and spatial_shapes {tuple(shapes.shape)} are not "
                f"[images, patches, {self.features}], [images, patches] and [images, 2]"
            )
        if pixels.shape[0] == 0:
            raise UnsupportedCall("input pixel_values holds no image")

    def _call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        pixels: torch.Tensor,
        mask: torch.Tensor,
        layout: _Layout,
        return_dict: bool,
        options: dict[str, Any],
    ) -> PackedCall:
        images = _Images(pixels=pixels, layout=layout, return_dict=return_dict, options=options)
        return PackedCall(
            args=args,
            kwargs=kwargs,
            size=layout.tokens,
            signature=(pixels.dtype, layout.slots),
            tensors=(pixels, mask),
            parts=images,
        )

    def piece(self, call: PackedCall, images: range) -> PackedCall:
        parts: _Images = call.parts
        sliced = [
            call.argument(name, position)[images.start : images.stop]
            for position, name in enumerate(self.inputs)
        ]
        return self._call(
            (),
            {**parts.options, **dict(zip(self.inputs, sliced))},
            sliced[0],
            sliced[1],
            self._layout(parts.grids[images.start : images.stop], parts.layout.patches),
            parts.return_dict,
            parts.options,
        )

    def allocate(self, budget: int, call: PackedCall[_Images]) -> naflex.NaflexBuffers:
        device, table = call.parts.pixels.device, self.owner.embeddings.position_embedding.weight
        return self.new_buffers(
            naflex.NaflexBuffers,
            budget,
            call,
            self.features,
            call.parts.pixels.dtype,
            slots=call.parts.slots,
            positions=torch.zeros(budget, table.shape[-1], dtype=table.dtype, device=device),
            tokens=torch.arange(budget, dtype=torch.int32, device=device),
        )

    def host_metadata(self, call: PackedCall[_Images]) -> dict[str, torch.Tensor]:
        return {"cu_seqlens": call.parts.layout.cu_seqlens}

    def load(self, buffers: naflex.NaflexBuffers, call: PackedCall[_Images]) -> None:
        images = call.parts
        tokens = call.size
        flat = images.pixels.reshape(-1, self.features)
        torch.index_select(flat, 0, images.index(flat.device), out=buffers.pixels[:tokens])
        buffers.pixels[tokens:].zero_()
        torch.cat(self._positions(images.grids), out=buffers.positions[:tokens])
        buffers.positions[tokens:].zero_()
        buffers.load_staged(images.grids, lambda: self.host_metadata(call))

    def cut(self, output: Any, call: PackedCall, budget: int) -> Any:
        leaves, spec = self.cut_leaves(*pytree.tree_flatten(output), call, budget)
        return pytree.tree_unflatten(leaves, spec)

    def cut_leaves(
        self, leaves: Sequence[Any], spec: pytree.TreeSpec, call: PackedCall, budget: int
    ) -> tuple[list[Any], pytree.TreeSpec]:
        """The call's ``last_hidden_state`` scattered into its padded layout (a new tensor) and
        its images' ``pooler_output`` (a view), as the leaves of the tower's output, whose
        structure is made once per kind (:meth:`_output_spec`)."""
        hidden, *rest = leaves
        pooled = [leaf for leaf in rest if leaf is not None]
        images: _Images = call.parts
        batch, length = images.pixels.shape[:2]
        padded = hidden.new_zeros(batch * length, hidden.shape[-1])
        padded.index_copy_(0, images.index(hidden.device), hidden[: call.size])
        cut = [padded.view(batch, length, -1), *(leaf[:batch] for leaf in pooled)]
        return cut, self._output_spec(images.return_dict, bool(pooled))

    def _output_spec(self, return_dict: bool, pooled: bool) -> pytree.TreeSpec:
        """The pytree structure of the tower's output, as a model output or a tuple, with or
        without ``pooler_output``."""
        key = (return_dict, pooled)
        spec = self._specs.get(key)
        if spec is None:
            empty = torch.empty(0)
            result = self._output_type(
                last_hidden_state=empty, pooler_output=empty if pooled else None
            )
            spec = pytree.tree_flatten(result if return_dict else result.to_tuple())[1]
            self._specs[key] = spec
        return spec


class Siglip2Adapter(PackedTowerAdapter):
    """Graphs a SigLIP2 NaFlex vision tower, alone or inside a larger model, per token budget.

    ``attention``: ``sdpa_varlen``, ``triton``, ``fa3``, ``sdpa_dense_masked`` (a GPU), a
    registered backend that reads sequence boundaries at run time, or ``auto``.
    ``max_tokens``: the largest budget learnt (larger calls are split by images), and the most
    position-embedding rows kept for the grids seen last; ``budget_step``: learnt budgets are
    multiples of it. ``fuse_norm`` and ``fuse_gelu`` (off by default; ``"auto"``: on a CUDA
    device) work as for the fixed SigLIP towers: each layer's residual adds and norms through one
    Triton kernel (:mod:`~layergraph_adapters.kit.fused_norm`), and each MLP's up-projection
    and tanh GELU as one product with a GELU epilogue
    (:mod:`~layergraph_adapters.kit.gelu_epilogue`).
    """

    name = "siglip2"
    families = (FAMILY,)
    plan_class = Siglip2Plan
    family_modules = ("layergraph_adapters.kit.naflex",)
    speed_options = ("fuse_norm", "fuse_gelu")
    default_budget_step = 256

    def __init__(
        self,
        attention: str = "auto",
        max_tokens: int = 16384,
        budget_step: int | None = None,
        fuse_norm: bool | str = False,
        fuse_gelu: bool | str = False,
    ) -> None:
        super().__init__(attention, max_tokens, budget_step)
        self.fuse_norm = fuse_norm
        self.fuse_gelu = fuse_gelu


def _read_grids(
    mask: torch.Tensor, shapes: torch.Tensor
) -> tuple[tuple[tuple[int, int], ...], torch.Tensor]:
    """Each image's patch grid (height, width) from ``spatial_shapes``, and the
    ``pixel_attention_mask`` as a bool tensor, read on the host in one transfer; raises
    :class:`~layergraph.keys.UnsupportedCall` for grids the tower cannot take."""
    images, patches = mask.shape
    both = torch.cat([shapes.reshape(-1).to(mask.device, torch.int32), mask.reshape(-1) != 0])
    host = both.cpu()
    grids = tuple((int(h), int(w)) for h, w in host[: 2 * images].view(images, 2).tolist())
    for row, (height, width) in enumerate(grids):
        if height < 1 or width < 1 or height * width > patches:
            raise UnsupportedCall(
                f"input spatial_shapes row {row} ({height}x{width}): sides must be positive "
                f"and hold at most the {patches} patches of pixel_values"
            )
    return grids, host[2 * images :].view(images, patches).bool()


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(Siglip2Adapter)
