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
:mod:`layergraph_adapters.grid_positions`) and the images' boundaries beside them, in the
attention metadata the ``attention_metadata`` hook built for the budget (a
:class:`~layergraph.attention.PackedLayout`); inside the graph attention runs per image through
a backend that reads the boundaries when it runs (``sdpa_varlen`` off the GPU, ``triton`` or
``fa3`` on it) or, with ``attention="auto"``, where a budget of at most 4096 tokens measured
it faster, over the whole budget under a block-diagonal mask built in the graph from the
boundaries (``sdpa_dense_masked``: the kernel the tower's own forward gets, cuDNN's on an
H200, where the varlen kernels pad SigLIP2's head dim of 72); the pooling head attends per image
(:mod:`layergraph_adapters.naflex`). ``graphed.plan.attention_by_budget`` says which ran.
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

import contextlib
import sys
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, PlanContext, hookimpl
from layergraph.adapter import own_forward
from layergraph.attention import (
    PackedLayout,
    choose_packed_backend,
    packed_backends,
    packed_timer,
)
from layergraph.keys import UnsupportedCall
from layergraph.ledger import ChangeLedger
from layergraph.packing import PackedCall, Packing, split_ranges
from layergraph_adapters import naflex
from layergraph_adapters.grid_positions import GridPositions
from layergraph_adapters.tower_specs import TEXT_ONLY_ARGUMENTS, TOWER_PATHS
from layergraph_adapters.versions import require_transformers

_MODELING = "transformers.models.siglip2.modeling_siglip2"
_INPUTS = ("pixel_values", "pixel_attention_mask", "spatial_shapes")
_OPTIONS = frozenset({"output_attentions", "output_hidden_states", "return_dict"})
"""Keyword arguments a graph serves besides the inputs (the first two when not asked for)."""
_MIN_IMAGE_SLOTS = 8
"""Images a graph holds at least; more round up to a power of two. Part of a graph's
signature: the Triton kernel's grid and the pooling head grow with it."""


def tower_class() -> type | None:
    """``Siglip2VisionModel``, if its modeling module is imported (an instance cannot exist
    otherwise); never imports it."""
    modeling = sys.modules.get(_MODELING)
    return None if modeling is None else modeling.Siglip2VisionModel


def find_siglip2_tower(model: nn.Module) -> nn.Module | None:
    """``model`` or its ``vision_model`` / ``vision_tower`` / ``model.vision_tower``, if a
    ``Siglip2VisionModel``."""
    cls = tower_class()
    if cls is None:
        return None
    for path in ("", *TOWER_PATHS):
        candidate: Any = model
        for name in filter(None, path.split(".")):
            candidate = getattr(candidate, name, None)
        if isinstance(candidate, cls):
            return candidate
    return None


class Siglip2Adapter(Adapter):
    """Graphs a SigLIP2 NaFlex vision tower, alone or inside a larger model, per token budget.

    ``attention``: ``sdpa_varlen``, ``triton``, ``fa3``, a registered backend that reads
    sequence boundaries at run time, or ``auto``. ``max_tokens``: the largest budget learnt
    (larger calls are split by images), and the most position-embedding rows kept for the grids
    seen last; ``budget_step``: learnt budgets are multiples of it.
    """

    name = "siglip2"

    def __init__(
        self, attention: str = "auto", max_tokens: int = 16384, budget_step: int = 256
    ) -> None:
        if budget_step < 1 or max_tokens % budget_step:
            raise ValueError(
                f"max_tokens {max_tokens} must be a multiple of budget_step {budget_step}"
            )
        self.attention = attention
        self.max_tokens = max_tokens
        self.budget_step = budget_step

    def recognizes(self, model: nn.Module) -> bool:
        return "transformers" in sys.modules and find_siglip2_tower(model) is not None

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        require_transformers(self.name)
        tower = find_siglip2_tower(model)
        if tower is None:
            raise AdapterMismatch(
                f"the siglip2 adapter serves transformers' Siglip2VisionModel and models "
                f"holding one as vision_model or vision_tower; got "
                f"{type(model).__module__}.{type(model).__name__}"
            )
        return Siglip2Plan(tower, self, context)


@dataclass(eq=False)
class _Images:
    """What a call's grids give on the host; the gather index is made on the device once."""

    pixels: torch.Tensor
    """The call's ``pixel_values``, ``[images, max_patches, features]``."""
    grids: list[tuple[int, int]]
    counts: list[int]
    slots: int
    cu_seqlens: torch.Tensor
    """The images' boundaries in the call's slots, on the host."""
    return_dict: bool
    _index: torch.Tensor | None = field(default=None, repr=False)

    def index(self, device: torch.device) -> torch.Tensor:
        """Where each real patch sits among the call's ``images * max_patches`` rows (int64,
        packed order), on ``device``."""
        if self._index is None:
            counts = torch.tensor(self.counts)
            image = torch.repeat_interleave(torch.arange(len(self.counts)), counts)
            starts = counts.cumsum(0) - counts
            rows = torch.arange(int(counts.sum())) - starts[image] + image * self.pixels.shape[1]
            self._index = rows.to(device)
        return self._index


class Siglip2Plan(CapturePlan, Packing):
    """The tower per token budget (:mod:`layergraph_adapters.naflex`), the plan being its own
    :class:`~layergraph.packing.Packing`; eager calls run the tower's own forward."""

    def __init__(self, tower: nn.Module, adapter: Siglip2Adapter, context: PlanContext) -> None:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        self.owner = tower
        self.packing = self
        self.budget_step = adapter.budget_step
        self.largest_budget = adapter.max_tokens
        self._output_type = BaseModelOutputWithPooling
        self._forward = own_forward(tower)
        self._positions = GridPositions(tower.embeddings, rows=adapter.max_tokens)
        self._attentions = [layer.self_attn for layer in tower.encoder.layers]
        self.heads = self._attentions[0].num_heads
        self.head_dim = self._attentions[0].head_dim
        config = tower.config
        self.features = config.num_channels * config.patch_size**2
        self._backends = packed_backends(
            context.registry.attention_backends(), adapter.attention, dense=True
        )
        self.attention = adapter.attention
        self.attention_by_budget: dict[int, str] = {}
        """Which backend serves each budget's attention (``sdpa_dense_masked``: the whole
        budget at once under a block-diagonal mask, where measured faster)."""
        self._registry = context.registry

    # ---- what the runner asks ----------------------------------------------------------------

    def region(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], naflex.NaflexBuffers):
            return naflex.packed_forward(self.owner, args[0])
        return self._eager(args, kwargs)

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The tower's own forward, with ``last_hidden_state`` zero where the mask is."""
        out = self._forward(*args, **kwargs)
        mask = kwargs.get("pixel_attention_mask", args[1] if len(args) > 1 else None)
        hidden = out[0]
        if not isinstance(mask, torch.Tensor) or hidden.shape[:2] != mask.shape:
            return out
        zeroed = hidden.masked_fill(mask[..., None] == 0, 0)
        if isinstance(out, tuple):
            return (zeroed, *out[1:])
        out.last_hidden_state = zeroed
        return out

    def sequence_of(self, call: PackedCall) -> Hashable:
        return f"up to {call.parts.slots} images"

    def eager_reason(self, call: PackedCall) -> str | None:
        if call.argument("output_attentions"):
            return "attention weights were asked for (output_attentions=True)"
        if call.argument("output_hidden_states"):
            return "hidden states were asked for (output_hidden_states=True)"
        return None

    @contextlib.contextmanager
    def bound(self, state: naflex.NaflexBuffers | None) -> Iterator[None]:
        with naflex.bound(state):
            yield

    def layers(self) -> list[nn.Module]:
        return list(self.owner.encoder.layers)

    @property
    def capture_module(self) -> nn.Module:
        return self.owner

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        changes.set_forward(self.owner, serve, "forward routed to the graphs")
        for module in self._attentions:
            changes.set_forward(
                module,
                naflex.routed_attention(module),
                "q, k and v of the packed images handed to the attention backend",
            )

    # ---- packing -----------------------------------------------------------------------------

    def pack(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PackedCall:
        if len(args) > len(_INPUTS):
            raise UnsupportedCall("arguments past spatial_shapes were passed by position")
        given = dict(zip(_INPUTS, args))
        options = {
            name: value
            for name, value in kwargs.items()
            if name not in _INPUTS and name not in TEXT_ONLY_ARGUMENTS
        }
        if set(given) & set(kwargs):
            raise UnsupportedCall("an input was passed both by position and by keyword")
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise UnsupportedCall(f"arguments the graphs do not take: {', '.join(unknown)}")
        given.update((name, kwargs[name]) for name in _INPUTS if name in kwargs)
        pixels, mask, shapes = (given.get(name) for name in _INPUTS)
        if not all(isinstance(t, torch.Tensor) for t in (pixels, mask, shapes)):
            raise UnsupportedCall(
                "the graphs need pixel_values, pixel_attention_mask and spatial_shapes as tensors"
            )
        self._check_shapes(pixels, mask, shapes)
        grids = _read_grids(mask, shapes)
        return_dict = options.get("return_dict")
        if return_dict is None:
            return_dict = getattr(self.owner.config, "return_dict", True)
        return self._call(args, kwargs, pixels, mask, grids, bool(return_dict))

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
        grids: list[tuple[int, int]],
        return_dict: bool,
    ) -> PackedCall:
        counts = [height * width for height, width in grids]
        slots = max(_MIN_IMAGE_SLOTS, 1 << (len(grids) - 1).bit_length())
        images = _Images(
            pixels=pixels,
            grids=grids,
            counts=counts,
            slots=slots,
            cu_seqlens=naflex.host_boundaries(counts, slots),
            return_dict=return_dict,
        )
        return PackedCall(
            args=args,
            kwargs=kwargs,
            size=sum(counts),
            signature=(pixels.dtype, slots),
            tensors=(pixels, mask),
            parts=images,
        )

    def split(self, call: PackedCall, budget: int) -> list[PackedCall]:
        images: _Images = call.parts
        options = {name: value for name, value in call.kwargs.items() if name not in _INPUTS}
        inputs = [call.argument(name, position) for position, name in enumerate(_INPUTS)]
        pieces = []
        for piece in split_ranges(images.counts, budget):
            sliced = [tensor[piece.start : piece.stop] for tensor in inputs]
            pieces.append(
                self._call(
                    (),
                    {**options, **dict(zip(_INPUTS, sliced))},
                    sliced[0],
                    sliced[1],
                    images.grids[piece.start : piece.stop],
                    images.return_dict,
                )
            )
        return pieces

    def allocate(self, budget: int, call: PackedCall) -> naflex.NaflexBuffers:
        images: _Images = call.parts
        pixels = images.pixels
        layout = PackedLayout(budget, images.slots, budget)
        backend = choose_packed_backend(
            self.attention,
            pixels.device,
            pixels.dtype,
            self.head_dim,
            layout,
            tuple(images.counts),
            backends=self._backends,
            timer=packed_timer(pixels.device, pixels.dtype, self.heads, self.head_dim),
        )
        self.attention_by_budget[budget] = backend.name
        return naflex.allocate(
            budget,
            images.slots,
            pixels,
            self.owner.embeddings.position_embedding.weight,
            backend,
            self._registry.attention_metadata(backend, layout, pixels.device),
            self.heads,
            self.head_dim,
        )

    def load(self, buffers: naflex.NaflexBuffers, call: PackedCall) -> None:
        images: _Images = call.parts
        tokens = call.size
        flat = images.pixels.reshape(-1, self.features)
        torch.index_select(flat, 0, images.index(flat.device), out=buffers.pixels[:tokens])
        buffers.pixels[tokens:].zero_()
        torch.cat(self._positions(images.grids), out=buffers.positions[:tokens])
        buffers.positions[tokens:].zero_()
        naflex.load_boundaries(buffers, images.cu_seqlens)

    def arguments(self, buffers: naflex.NaflexBuffers) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (buffers,), {}

    def cut(self, output: Any, call: PackedCall, budget: int) -> Any:
        hidden, pooled = output
        images: _Images = call.parts
        batch, length = images.pixels.shape[:2]
        padded = hidden.new_zeros(batch * length, hidden.shape[-1])
        padded.index_copy_(0, images.index(hidden.device), hidden[: call.size])
        result = self._output_type(
            last_hidden_state=padded.view(batch, length, -1),
            pooler_output=None if pooled is None else pooled[:batch],
        )
        return result if images.return_dict else result.to_tuple()


def _read_grids(mask: torch.Tensor, shapes: torch.Tensor) -> list[tuple[int, int]]:
    """Each image's patch grid (height, width) from ``spatial_shapes``, read on the host with
    ``pixel_attention_mask`` in one transfer; raises :class:`~layergraph.keys.UnsupportedCall`
    for grids the tower cannot take, or a mask that does not mark exactly each image's first
    ``height * width`` patches."""
    images, patches = mask.shape
    both = torch.cat([shapes.reshape(-1).to(mask.device, torch.int32), mask.reshape(-1) != 0])
    host = both.cpu()
    grids = [(int(h), int(w)) for h, w in host[: 2 * images].view(images, 2).tolist()]
    for row, (height, width) in enumerate(grids):
        if height < 1 or width < 1 or height * width > patches:
            raise UnsupportedCall(
                f"input spatial_shapes row {row} ({height}x{width}): sides must be positive "
                f"and hold at most the {patches} patches of pixel_values"
            )
    counts = torch.tensor([height * width for height, width in grids])
    expected = torch.arange(patches)[None, :] < counts[:, None]
    if not torch.equal(host[2 * images :].view(images, patches).bool(), expected):
        raise UnsupportedCall(
            "input pixel_attention_mask does not mark exactly the first height x width "
            "patches of each image (spatial_shapes) as real"
        )
    return grids


@hookimpl
def register_adapters(register: Callable[[Any], Any]) -> None:
    register(Siglip2Adapter)
