"""Plugin for transformers' Pixtral vision tower, served per token budget.

Serves ``PixtralVisionModel`` (Pixtral-12B, Mistral Small 3.1, Magistral, LightOnOCR), alone or
inside the VLMs that hold one: ``LlavaModel`` / ``LlavaForConditionalGeneration`` with a Pixtral
vision config, ``Mistral3Model`` / ``Mistral3ForConditionalGeneration`` and ``MistralLarge4Model``
/ ``MistralLarge4ForConditionalGeneration`` (``vision_tower``, ``model.vision_tower``), and
``LightOnOcrModel`` / ``LightOnOcrForConditionalGeneration`` (``vision_encoder``,
``model.vision_encoder``). Wrapping a VLM graphs its tower in place, so its
own ``get_image_features()`` and ``generate()`` use the graphs; ``unwrap()`` restores it.

The tower takes ``pixel_values`` ``[images, channels, height, width]`` (each image padded to the
largest) and ``image_sizes`` (each image's own height and width in pixels). It cuts each image
to its own patch grid, packs all patches into one sequence (``last_hidden_state`` is
``[1, patches, width]``), rotates q and k by 2-d rotary embeddings of each patch's (row,
column), and attends per image. Its graphs are captured per token budget
(:mod:`layergraph.packing`):

- on the host, ``image_sizes`` is read once per call (one transfer where it lives on the
  device) and gives the patch grids;
- before every replay, each image's real patches are copied into the budget's buffer (rows of
  ``channels * patch * patch`` pixels, in the order of the convolution's weight), and the
  patches' (row, column) positions and the images' boundaries (``cu_seqlens``) go, written on
  the host, to the device in one copy (the plan's staged fields, only when the call's grids
  differ from the last call's);
- in the graph: the patch convolution as one matrix product of those rows with its weight
  (equal up to rounding: every patch is one dot product per filter), ``ln_pre``, the rotary
  embeddings by the tower's own module, and the layers, whose attention modules hand q, k and v
  to a backend that reads the boundaries when it runs (``sdpa_varlen`` off the GPU, ``triton``
  or ``fa3`` on it), padding tokens belonging to no image;
- after it, the real rows are cut out, with the hidden states the call asked for.

VLMs ask their tower for the hidden state they read (``output_hidden_states`` set to the
index ``vision_feature_layer``, -1 for Pixtral-12B and Mistral 3; with transformers 5.17, which
selects no hidden state by index, ``True``): the graphs return the hidden states a call selects
(an index, a list of them, or ``True``), part of the graph's signature, at their indices of
``hidden_states`` as the tower does, in the output class the tower's forward returns. Where the
tower is wrapped inside a VLM whose configuration names the hidden states it reads
(``vision_feature_layer``), or is given them (``feature_layers``), and the transformers release
takes any true ``output_hidden_states`` for all of them (5.17), a call asking for all of them
gets a graph that keeps those alone: the others are computed on demand, by the tower's own
forward, the first time one is read (a graph keeping the tower's every hidden state would hold
and copy 25 of them per call, and each budget's in the shared pool). Calls
served eagerly (attention weights asked for, ``pixel_values`` as a list, other arguments, a list
of hidden states with transformers 5.17, above every budget, ...) run the tower's own forward
with its own attention.

What it checks: ``image_sizes`` must hold one size per image of ``pixel_values``, each at least
one patch and at most the padded image; otherwise a ``ValueError`` names what is wrong (the
tower itself would cut such images silently short).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils import _pytree as pytree

from layergraph import CapturePlan, PlanContext, hookimpl
from layergraph.keys import UnsupportedCall
from layergraph.packing import PackedCall
from layergraph_adapters.kit.budget_buffers import BudgetBuffers, StagedField
from layergraph_adapters.kit.feature_outputs import (
    computed_later,
    feature_indices,
    with_rest_on_demand,
)
from layergraph_adapters.kit.packed_tower import (
    PackedFamily,
    PackedTowerAdapter,
    PackedTowerPlan,
    host_boundaries,
    image_slots,
    read_inputs,
)
from layergraph_adapters.kit.tower_specs import TEXT_ONLY_ARGUMENTS
from layergraph_adapters.kit.versions import Support, require_transformers

_HOLDERS: dict[str, tuple[str, ...]] = {
    "transformers.models.llava.modeling_llava": ("vision_tower", "model.vision_tower"),
    "transformers.models.mistral3.modeling_mistral3": ("vision_tower", "model.vision_tower"),
    "transformers.models.mistral_large4.modeling_mistral_large4": (
        "vision_tower",
        "model.vision_tower",
    ),
    "transformers.models.lighton_ocr.modeling_lighton_ocr": (
        "vision_encoder",
        "model.vision_encoder",
    ),
}
"""The modeling modules of the VLMs checked with a Pixtral tower, and where they hold it."""


def tower_output_class(
    forward: Callable[..., Any], patch: int, channels: int, like: torch.Tensor
) -> type:
    """The output class a Pixtral tower's own ``forward`` returns with ``return_dict``, which
    the graphs' outputs are built as (``BaseModelOutput`` with transformers 5.17,
    ``BaseModelOutputWithPooling`` with 5.24): read from one call on a one-patch image of
    ``like``'s dtype and device."""
    pixels = like.new_zeros(1, channels, patch, patch)
    with torch.inference_mode():
        output = forward(pixels, image_sizes=[(patch, patch)], return_dict=True)
    return type(output)


def _kept_states(layers: int | list[int] | None, tower: nn.Module) -> tuple[int, ...] | None:
    """The indices of ``hidden_states`` a graph keeps for ``layers`` (an index or a list of
    them), the last always among them, or ``None`` for ``None``; a ``ValueError`` names an index
    the tower's hidden states do not have."""
    if layers is None:
        return None
    depth = len(tower.transformer.layers)
    return tuple(sorted({*feature_indices(layers, depth), depth}))


@dataclass(eq=False)
class PixtralBuffers(BudgetBuffers):
    """One budget's buffers; the patches' positions and the images' boundaries are staged
    (:attr:`PixtralPlan.staged_fields`). Image slots past a call's images are empty (their
    boundaries at its last token), and the tokens past it belong to no image."""

    hidden: tuple[int, ...]
    """The indices of ``hidden_states`` the graph returns besides the last hidden state."""


@dataclass(eq=False)
class _Images:
    """What :meth:`PixtralPlan.pack` reads from a call; its host metadata on demand."""

    pixels: torch.Tensor
    grids: list[tuple[int, int]]
    """Each image's patch grid (rows, columns)."""
    slots: int
    selected: tuple[int, ...] | None
    """The indices of ``hidden_states`` the call asks for, ``None``: no hidden states."""
    return_dict: bool
    options: dict[str, Any]
    """The call's arguments besides the inputs, for the pieces of a split call."""

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Each real patch's (row, column) in its image, ``[patches, 2]`` (int64, host)."""
        return torch.cat([_grid_positions(rows, columns) for rows, columns in self.grids])

    @property
    def counts(self) -> list[int]:
        """Each image's patches."""
        return [rows * columns for rows, columns in self.grids]

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """The images' boundaries in the call's slots (int32, host), the slots past the images
        empty."""
        return host_boundaries(self.counts, self.slots)


def _grid_positions(rows: int, columns: int) -> torch.Tensor:
    """The (row, column) of every patch of a ``rows`` x ``columns`` grid, row-major, as the
    tower's forward builds them."""
    row, column = torch.meshgrid(torch.arange(rows), torch.arange(columns), indexing="ij")
    return torch.stack([row.flatten(), column.flatten()], dim=-1)


class PixtralPlan(PackedTowerPlan):
    """The tower per token budget, with attention routed to a backend that reads the budget's
    boundaries. Eager calls run the tower's own forward."""

    inputs = ("pixel_values", "image_sizes")
    options = frozenset({"output_attentions", "output_hidden_states", "return_dict"})
    serves_hidden_states = True
    casts_inputs = True  # the patch embedding casts the pixels to its weights' dtype
    staged_fields = (StagedField.per_token("position_ids"), StagedField.boundaries())

    def __init__(
        self,
        tower: nn.Module,
        adapter: PixtralAdapter,
        context: PlanContext,
        family: PackedFamily,
        feature_layers: tuple[int, ...] | None = None,
    ) -> None:
        from transformers.utils import output_capturing

        super().__init__(tower, adapter, context, family)
        self._output_type: type | None = None
        """The tower's output class (:func:`tower_output_class`), read on the first cut."""
        self._whole_keys: dict[tuple[str, ...], tuple[str, ...]] = {}
        """The keys of the whole tower's outputs, learnt by feature outputs."""
        self._selects_by_index = hasattr(output_capturing, "selected_hidden_states")
        """Whether transformers selects hidden states by index (``output_hidden_states=-2``
        returns that one alone, 5.24) or takes any true value for all of them (5.17)."""
        self.feature_layers = feature_layers
        """The indices of the hidden states read (the adapter's ``feature_layers``, or the
        VLM's ``vision_feature_layer``, with the last), or ``None``: where transformers takes
        any true ``output_hidden_states`` for all of them, a call asking for them gets these
        alone from its graph, the others on demand."""
        self.depth = len(self.attentions)
        self.patch = tower.patch_size
        self.channels = tower.config.num_channels

    # ---- what the runner asks ----------------------------------------------------------------

    def packed_forward(
        self, buffers: PixtralBuffers
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The tower over the budget's packed patches: the last hidden state ``[budget,
        width]`` and the hidden states of :attr:`PixtralBuffers.hidden`, in that order."""
        tower = self.owner
        weight = tower.patch_conv.weight
        hidden = F.linear(buffers.pixels, weight.view(weight.shape[0], -1))
        hidden = tower.ln_pre(hidden)
        positions = buffers.staged.device["position_ids"]
        rotary = tower.patch_positional_embedding(hidden, positions)
        states = [hidden]
        for layer in self._layers:
            hidden = layer(hidden, None, position_embeddings=rotary)
            states.append(hidden)
        return hidden, tuple(states[index] for index in buffers.hidden)

    def eager_reason(self, call: PackedCall) -> str | None:
        if call.argument("output_attentions", default=self.owner.config.output_attentions):
            return "attention weights were asked for (output_attentions=True)"
        return None

    def tower_forward(self, serve: Callable[..., Any]) -> Callable[..., Any]:
        """The tower's forward while wrapped: ``serve``, and the hidden states a call's graph
        left out (:meth:`_reads_fewer`) computed on demand by the tower's own forward."""

        def forward(*args: Any, **kwargs: Any) -> Any:
            out = serve(*args, **kwargs)
            if not self._reads_fewer(kwargs):
                return out
            later = computed_later(self.own, args, kwargs, serve.count_eager)
            return with_rest_on_demand(out, later, self._whole_keys)

        return forward

    def _reads_fewer(self, options: dict[str, Any]) -> bool:
        """Whether a call of these keyword arguments asks for every hidden state where the VLM
        reads :attr:`feature_layers` alone (transformers takes any true ``output_hidden_states``
        for all of them), in an output that can compute the rest on demand (``return_dict``)."""
        if self.feature_layers is None or self._selects_by_index:
            return False
        config = self.owner.config
        if not options.get("output_hidden_states", config.output_hidden_states):
            return False
        return_dict = options.get("return_dict")
        return bool(getattr(config, "return_dict", True) if return_dict is None else return_dict)

    # ---- packing -----------------------------------------------------------------------------

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        given, options = read_inputs(
            args, kwargs, self.inputs, self.options, ignored=TEXT_ONLY_ARGUMENTS
        )
        pixels = given.get("pixel_values")
        if not isinstance(pixels, torch.Tensor):
            raise UnsupportedCall("the graphs need pixel_values as one tensor of padded images")
        if pixels.dim() != 4 or pixels.shape[1] != self.channels:
            raise UnsupportedCall(
                f"input pixel_values {tuple(pixels.shape)} is not [images, {self.channels}, "
                f"height, width]"
            )
        if pixels.shape[0] == 0:
            raise ValueError("pixel_values holds no image")
        grids = self._read_grids(pixels, given.get("image_sizes"))
        return self._call(args, kwargs, pixels, grids, options)

    def _read_grids(self, pixels: torch.Tensor, sizes: Any) -> list[tuple[int, int]]:
        """Each image's patch grid from ``image_sizes`` (read on the host in one transfer;
        ``None``: every image its padded size); a ``ValueError`` names a size the images of
        ``pixel_values`` cannot hold."""
        images, _, height, width = pixels.shape
        if sizes is None:
            return [(height // self.patch, width // self.patch)] * images
        try:
            host = sizes.cpu() if isinstance(sizes, torch.Tensor) else torch.as_tensor(sizes)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"image_sizes is not a list of (height, width): {error}") from None
        if host.shape != (images, 2):
            raise ValueError(
                f"image_sizes {tuple(host.shape)} does not give a (height, width) for each of "
                f"the {images} images of pixel_values {tuple(pixels.shape)}"
            )
        pairs = [(int(h), int(w)) for h, w in host.tolist()]
        for row, (h, w) in enumerate(pairs):
            if not (self.patch <= h <= height and self.patch <= w <= width):
                raise ValueError(
                    f"image_sizes row {row} ({h}x{w}) does not fit the images of pixel_values "
                    f"({height}x{width} pixels) with at least one {self.patch}x{self.patch} "
                    f"patch a side"
                )
        return [(h // self.patch, w // self.patch) for h, w in pairs]

    def _call(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        pixels: torch.Tensor,
        grids: list[tuple[int, int]],
        options: dict[str, Any],
    ) -> PackedCall:
        config = self.owner.config
        selected = self._selected(options.get("output_hidden_states", config.output_hidden_states))
        if self._reads_fewer(options):
            selected = self.feature_layers
        return_dict = options.get("return_dict")
        if return_dict is None:
            return_dict = getattr(config, "return_dict", True)
        slots = image_slots(len(grids))
        images = _Images(pixels, grids, slots, selected, bool(return_dict), options)
        return PackedCall(
            args=args,
            kwargs=kwargs,
            size=sum(rows * columns for rows, columns in grids),
            signature=(pixels.dtype, slots, selected),
            tensors=(pixels,),
            parts=images,
        )

    def _selected(self, asked: Any) -> tuple[int, ...] | None:
        """The indices of ``hidden_states`` ``output_hidden_states`` selects (``True``: all,
        an index or a list of them: those in range), or ``None`` where it is false (as for
        transformers, index 0 alone is, unlike ``[0]``).

        Where transformers does not select hidden states by index (5.17), an index asks for
        all of them, as any true value does, and a list of layers, which it collects by layer
        output without the embeddings, runs the tower itself (:class:`UnsupportedCall`)."""
        count = self.depth + 1
        if not asked:
            return None
        if asked is True or (not self._selects_by_index and isinstance(asked, int)):
            return tuple(range(count))
        if not self._selects_by_index:
            raise UnsupportedCall(
                "output_hidden_states as a list of layers, which this transformers collects "
                "by layer output without the embeddings"
            )
        indices = [asked] if isinstance(asked, int) else list(asked)
        return tuple(sorted({i % count for i in indices if -count <= i < count}))

    def piece(self, call: PackedCall, images: range) -> PackedCall:
        parts: _Images = call.parts
        grids = parts.grids[images.start : images.stop]
        pixels = parts.pixels[images.start : images.stop]
        sizes = torch.tensor([(rows * self.patch, columns * self.patch) for rows, columns in grids])
        kwargs = {**parts.options, "pixel_values": pixels, "image_sizes": sizes}
        return self._call((), kwargs, pixels, grids, parts.options)

    def allocate(self, budget: int, call: PackedCall[_Images]) -> PixtralBuffers:
        images = call.parts
        features, dtype = self.channels * self.patch**2, self.owner.patch_conv.weight.dtype
        hidden = tuple(i for i in images.selected or () if i != self.depth)
        return self.new_buffers(PixtralBuffers, budget, call, features, dtype, hidden=hidden)

    def host_metadata(self, call: PackedCall[_Images]) -> dict[str, torch.Tensor]:
        return {"position_ids": call.parts.positions, "cu_seqlens": call.parts.cu_seqlens}

    def load(self, buffers: PixtralBuffers, call: PackedCall[_Images]) -> None:
        buffers.load_staged(tuple(call.parts.grids), lambda: self.host_metadata(call))
        self._load_patches(buffers.pixels, call.parts)

    def _load_patches(self, rows: torch.Tensor, images: _Images) -> None:
        """Copy each image's real patches into ``rows`` (``[budget, channels * patch *
        patch]``), row-major per image, one copy per image; zeros past them."""
        patch, channels, start = self.patch, self.channels, 0
        for image, (height, width) in zip(images.pixels, images.grids):
            count = height * width
            cut = image[:, : height * patch, : width * patch]
            patches = cut.reshape(channels, height, patch, width, patch).permute(1, 3, 0, 2, 4)
            rows[start : start + count].view(height, width, channels, patch, patch).copy_(patches)
            start += count
        rows[start:].zero_()

    def cut(self, output: Any, call: PackedCall, budget: int) -> Any:
        last, kept = output
        images: _Images = call.parts
        tokens = call.size
        last = last[None, :tokens]
        hidden_states = None
        if images.selected is not None:
            states: list[torch.Tensor | None] = [None] * (self.depth + 1)
            inner = [i for i in images.selected if i != self.depth]
            for index, state in zip(inner, kept):
                states[index] = state[None, :tokens]
            if self.depth in images.selected:
                states[self.depth] = last
            hidden_states = tuple(states)
        if self._output_type is None:
            self._output_type = tower_output_class(self.own, self.patch, self.channels, last)
        result = self._output_type(last_hidden_state=last, hidden_states=hidden_states)
        return result if images.return_dict else result.to_tuple()

    def join(self, parts: Sequence[Any]) -> Any:
        """The outputs of consecutive pieces of a split call as one: the tower's sequences
        (``[1, patches, width]``) concatenated along the patches; a hidden state that a piece's
        graph left out (:attr:`PixtralPlan.feature_layers`) is left out of the whole, where an
        eager piece has it."""
        flat = [pytree.tree_flatten(part) for part in parts]
        columns = zip(*(leaves for leaves, _ in flat))
        return pytree.tree_unflatten([_joined(column) for column in columns], flat[0][1])

    def attend_packed(
        self,
        module: nn.Module,
        buffers: PixtralBuffers,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """``PixtralAttention`` over the packed patches: q and k rotated by the tower's module's
        own ``apply_rotary_pos_emb``, the backend reading the images' boundaries."""
        rotate = sys.modules[type(module).__module__].apply_rotary_pos_emb
        tokens = hidden_states.shape[0]
        q, k, v = (
            projection(hidden_states).view(tokens, module.num_heads, module.head_dim)
            for projection in (module.q_proj, module.k_proj, module.v_proj)
        )
        q, k = rotate(q, k, *position_embeddings, unsqueeze_dim=1)
        out = self.attend(buffers, q, k, v, module.scaling)
        return module.o_proj(out.reshape(tokens, -1)), None


def _joined(column: Sequence[Any]) -> Any:
    """One leaf of a split call's pieces joined: tensors concatenated along the patches,
    ``None`` where a piece has none (a hidden state its graph left out), else the first."""
    if all(isinstance(leaf, torch.Tensor) for leaf in column):
        return torch.cat(column, dim=1)
    return None if any(leaf is None for leaf in column) else column[0]


PIXTRAL_SUPPORT = Support(
    "pixtral",
    ">=5.17.0,<5.25",
    copies=(
        "layergraph_adapters.pixtral:PixtralPlan.packed_forward",
        "layergraph_adapters.pixtral:PixtralPlan.attend_packed",
    ),
    probes=(
        "the output class, from one call of the tower's forward on a one-patch image",
        "whether output_hidden_states selects by index "
        "(transformers.utils.output_capturing.selected_hidden_states)",
    ),
    tests=("tests/test_pixtral_adapter.py",),
)
"""5.17.0 to 5.24.x: both compute the rotary embeddings from each patch's (row, column) and
write ``PixtralAttention`` alike; they differ in the output class (read from a call) and in
what ``output_hidden_states`` selects (an index or indices with 5.24, all for any true value
but a list with 5.17, which the graphs leave to the tower)."""

FAMILY = PackedFamily(
    module="transformers.models.pixtral.modeling_pixtral",
    name="PixtralVisionModel",
    holders=_HOLDERS,
    layers="transformer.layers",
    attention="attention",
    support=PIXTRAL_SUPPORT,
)
"""Pixtral's tower, and the VLMs checked with it (:data:`_HOLDERS`)."""


class PixtralAdapter(PackedTowerAdapter):
    """Graphs a Pixtral vision tower, alone or inside its VLM, per token budget.

    ``attention``: ``sdpa_varlen``, ``triton``, ``fa3``, a registered backend that reads
    sequence boundaries at run time, or ``auto``. ``max_tokens``: the largest budget learnt
    (larger calls are split by images); ``budget_step``: learnt budgets are multiples of it.
    ``feature_layers`` (an index into ``hidden_states``, or a list of them): the hidden states
    read, which a call asking for every hidden state on a release that takes any true
    ``output_hidden_states`` for all of them (5.17) gets from its graph, the others computed on
    demand; inside a VLM it defaults to the VLM's ``vision_feature_layer``.
    """

    name = "pixtral"
    families = (FAMILY,)
    plan_class = PixtralPlan

    def __init__(
        self,
        attention: str = "auto",
        max_tokens: int = 16384,
        budget_step: int = 16,
        feature_layers: int | list[int] | None = None,
    ) -> None:
        super().__init__(attention, max_tokens, budget_step)
        self.feature_layers = feature_layers

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        require_transformers(self.name, PIXTRAL_SUPPORT.checked)
        tower, family = self.find(model)
        layers = self.feature_layers
        if layers is None and tower is not model:
            layers = getattr(getattr(model, "config", None), "vision_feature_layer", None)
        return PixtralPlan(tower, self, context, family, feature_layers=_kept_states(layers, tower))


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(PixtralAdapter)
