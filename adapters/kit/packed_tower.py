"""The kit for native-resolution towers: what every packed tower's plan shares.

A native-resolution tower (Qwen2-VL's, Pixtral's, SigLIP2 NaFlex's) packs the patches of many
images of different sizes into one sequence, and its graphs are captured per token budget
(:mod:`layergraph.packing`). Its adapter and plan share most of their work with every other
such tower; this module holds it once:

- :class:`PackedFamily`: a family's facts as data (where its modeling code lives, its tower
  class, where its VLMs hold the tower, where the layers and their attention modules are, the
  transformers releases it was checked with), and :func:`find_packed_tower`, the lookup;
- :class:`PackedTowerAdapter`: the adapter's options (``attention``, ``max_tokens``,
  ``budget_step``) and its recognition and plan through the family table;
- :class:`PackedTowerPlan`: a plan that is its own :class:`~layergraph.packing.Packing`, its
  budget's buffers bound through a context variable of its own (:meth:`~PackedTowerPlan.bound`,
  :meth:`~PackedTowerPlan.current`), its attention modules routed to the bound buffers' backend
  (:meth:`~PackedTowerPlan.attend`, the routed-attention template, eager calls running each
  module's own forward), a call's arguments read (:func:`read_inputs`), split by images
  (:meth:`~PackedTowerPlan.split` over :meth:`~PackedTowerPlan.piece`), its image slots rounded
  (:func:`image_slots`), its backend chosen and metadata built per budget
  (:meth:`~PackedTowerPlan.choose_attention`) with a workspace where the backend writes into
  one (:func:`workspace`), and a call's boundaries padded on the host
  (:func:`host_boundaries`) and copied into the metadata (:func:`copy_boundaries`).

What a family writes itself: how a call becomes a :class:`~layergraph.packing.PackedCall`
(``pack``), its buffers (``allocate``, ``load``, ``arguments``, ``cut``), its packed forward,
and the part of its attention that is its own (projections, rotary embeddings). The tutorial
"Writing an adapter" has a section that builds a toy family from this kit.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from layergraph import Adapter, AdapterMismatch, CapturePlan, PlanContext
from layergraph.adapter import own_forward
from layergraph.attention import (
    AttentionBackend,
    AttentionMetadata,
    PackedLayout,
    SequenceLayout,
    choose_packed_backend,
    packed_backends,
    packed_timer,
)
from layergraph.attention.opaque import opaque_attention, register_route
from layergraph.keys import UnsupportedCall
from layergraph.ledger import ChangeLedger
from layergraph.packing import PackedCall, Packing, split_ranges
from layergraph_adapters.kit.automatic import build_with_automatic_options
from layergraph_adapters.kit.budget_buffers import (
    BudgetBuffers,
    ImageParts,
    StagedField,
    StagedMetadata,
    copy_boundaries,
    host_boundaries,
    pad_boundaries,
    workspace,
)
from layergraph_adapters.kit.family_record import FamilyRecord
from layergraph_adapters.kit.packed_examples import EXAMPLE_IMAGE_SIZE, PackedExamples
from layergraph_adapters.kit.versions import require_transformers

__all__ = [
    "EXAMPLE_IMAGE_SIZE",
    "MIN_IMAGE_SLOTS",
    "PackedFamily",
    "PackedTowerAdapter",
    "PackedTowerPlan",
    "bound_buffers",
    "copy_boundaries",
    "find_packed_tower",
    "host_boundaries",
    "image_slots",
    "pad_boundaries",
    "read_inputs",
    "workspace",
]

BuffersT = TypeVar("BuffersT", bound=BudgetBuffers)

MIN_IMAGE_SLOTS = 8
"""Images (or frames) a graph holds at least; more round up to a power of two. Part of a
graph's signature: the varlen kernels' grids grow with it."""


@dataclass(frozen=True)
class PackedFamily(FamilyRecord):
    """One native-resolution tower class, as data: a packed family's record (its layer form
    and support are :class:`~layergraph_adapters.kit.family_record.FamilyRecord`'s; the
    release table and CI's floors are read from the support,
    :func:`~layergraph_adapters.kit.versions.support_table`)."""

    module: str
    """The modeling module that defines the tower class (never imported here: an instance
    cannot exist before it is)."""
    name: str
    """The tower class's name in :attr:`module`."""
    holders: dict[str, tuple[str, ...]]
    """Where models hold the tower, by the modeling module of the holding model's class:
    attribute paths (``"model.vision_tower"``); ``"*"``: models of any module. A model of
    another module is not recognised, since its VLM calls the tower its own way; its tower
    alone is served."""
    layers: str
    """The attribute path of the tower's layers (``"encoder.layers"``)."""
    attention: str
    """The attribute of each layer that is its attention module (``"self_attn"``)."""
    checked: str | None = None
    """The transformers releases the tower's forward was checked with (a requirement), or
    ``None`` for a tower that is not transformers'; :attr:`support`'s where it is given."""
    cls: type | None = field(default=None, compare=False)
    """The tower class itself, for one defined where :attr:`module` is not importable by name
    (a notebook, a test); ``None``: looked up by :attr:`module` and :attr:`name`."""

    def __post_init__(self) -> None:
        if self.checked is None and self.support is not None:
            object.__setattr__(self, "checked", self.support.checked)

    @property
    def title(self) -> str:
        return self.name

    def tower_class(self) -> type | None:
        """The tower class, if its modeling module is imported; never imports it."""
        if self.cls is not None:
            return self.cls
        modeling = sys.modules.get(self.module)
        return None if modeling is None else getattr(modeling, self.name, None)


def attribute(root: Any, path: str) -> Any:
    """``root``'s attribute at a dotted ``path`` (``""``: ``root``), ``None`` where absent."""
    for name in filter(None, path.split(".")):
        root = getattr(root, name, None)
    return root


def find_packed_tower(
    model: nn.Module, families: Iterable[PackedFamily]
) -> tuple[nn.Module, PackedFamily] | None:
    """``model`` if it is a tower of one of ``families``, or the tower a model of a holding
    module holds (:attr:`PackedFamily.holders`), with its family; ``None`` if neither."""
    for family in families:
        cls = family.tower_class()
        if cls is None:
            continue
        paths = family.holders.get(type(model).__module__, family.holders.get("*", ()))
        for path in ("", *paths):
            candidate = attribute(model, path)
            if isinstance(candidate, cls):
                return candidate, family
    return None


class PackedTowerAdapter(PackedExamples, Adapter):
    """An adapter for the towers of :attr:`families`, per token budget.

    ``attention``: ``sdpa_varlen``, ``triton``, ``fa3``, a registered backend that reads
    sequence boundaries at run time, or ``auto``. ``max_tokens``: the largest budget learnt
    (larger calls are split by images); ``budget_step``: learnt budgets are multiples of it.
    Subclasses set :attr:`name`, :attr:`families` and :attr:`plan_class` (a
    :class:`PackedTowerPlan` made from the tower, the adapter, the context and the family),
    and :attr:`speed_options` where the plan takes any.
    """

    families: ClassVar[tuple[PackedFamily, ...]] = ()
    plan_class: ClassVar[type[PackedTowerPlan]]
    inside_any_model = False  # a VLM not among a family's holders may call the tower its own way
    default_budget_step: ClassVar[int] = 16
    family_modules: ClassVar[tuple[str, ...]] = ()
    """The kit modules that hold the family's own code (no other family's), by name."""
    speed_options: ClassVar[tuple[str, ...]] = ()
    """The speed options the adapter keeps as attributes of the same names and hands to
    :attr:`plan_class` as keyword arguments, each ``"auto"`` resolved for the tower
    (:func:`~layergraph_adapters.kit.automatic.build_with_automatic_options`)."""

    def __init__(
        self, attention: str = "auto", max_tokens: int = 16384, budget_step: int | None = None
    ) -> None:
        budget_step = self.default_budget_step if budget_step is None else budget_step
        if budget_step < 1 or max_tokens % budget_step:
            raise ValueError(
                f"max_tokens {max_tokens} must be a multiple of budget_step {budget_step}"
            )
        self.attention = attention
        self.max_tokens = max_tokens
        self.budget_step = budget_step

    def recognizes(self, model: nn.Module) -> bool:
        return find_packed_tower(model, self.families) is not None

    def find(self, model: nn.Module) -> tuple[nn.Module, PackedFamily]:
        """The tower ``model`` is or holds, and its family; :class:`AdapterMismatch` names the
        classes served where there is none."""
        found = find_packed_tower(model, self.families)
        if found is None:
            served = ", ".join(family.name for family in self.families)
            raise AdapterMismatch(
                f"the {self.name} adapter serves transformers' {served} and the models that "
                f"hold one; got {type(model).__module__}.{type(model).__name__}"
            )
        return found

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        tower, family = self.find(model)
        if family.checked is not None:
            require_transformers(self.name, family.checked)
        build = functools.partial(self.plan_class, tower, self, context, family)
        if not self.speed_options:
            return build()
        options = {name: getattr(self, name) for name in self.speed_options}
        return build_with_automatic_options(tower, options, build, context, family.ruled_out())


class PackedTowerPlan(CapturePlan, Packing):
    """A packed tower's plan and packing (see the module's text).

    Eager calls run the tower's own forward (:attr:`own`). A family sets :attr:`inputs` (the
    forward's tensor inputs, in order), :attr:`options` (the keyword arguments a graph serves
    besides them), :attr:`dense` (whether its packed forward prepares its backend, so that
    the dense block-mask backend may serve it), :attr:`serves_hidden_states` (else a call
    asking for them runs eagerly) and :attr:`v_in_qkv`, and implements ``pack``, ``allocate``,
    ``load``, ``cut``, :meth:`piece` and :meth:`attend_packed`.
    """

    inputs: ClassVar[tuple[str, ...]] = ()
    options: ClassVar[frozenset[str]] = frozenset()
    dense: ClassVar[bool] = False
    dense_in_auto: ClassVar[bool] = True
    """Whether ``attention="auto"`` times the dense block-mask backend too (with
    :attr:`dense`); ``False``: it serves only where named."""
    serves_hidden_states: ClassVar[bool] = False
    v_in_qkv: ClassVar[bool] = False
    """Whether :meth:`attend` is given v as a view into one ``[tokens, 3, heads, head_dim]``
    product (a fused q/k/v projection) and q and k as tensors of their own, so that
    ``attention="auto"`` times the backends on that layout (:func:`packed_timer`)."""
    staged_fields: ClassVar[tuple[StagedField, ...]] = ()
    """The per-call host metadata the graphs read, declared (:meth:`host_metadata` computes a
    call's values): :meth:`new_buffers` allocates it, ``buffers.load_staged`` writes it."""

    def __init__(
        self,
        tower: nn.Module,
        adapter: PackedTowerAdapter,
        context: PlanContext,
        family: PackedFamily,
    ) -> None:
        """Reads the tower: its layers (:attr:`PackedFamily.layers`), their attention modules
        (:attr:`PackedFamily.attention`), whose ``num_heads`` and ``head_dim`` size the
        attention backends' workspaces."""
        self.owner = tower
        self.packing = self
        self.family = family
        self.budget_step = adapter.budget_step
        self.largest_budget = adapter.max_tokens
        self.own = own_forward(tower)
        """The tower's own forward: what eager calls run."""
        self._layers = list(attribute(tower, family.layers))
        self.attentions = [getattr(layer, family.attention) for layer in self._layers]
        self.heads = self.attentions[0].num_heads
        self.head_dim = self.attentions[0].head_dim
        self.attention = adapter.attention
        self._backends = packed_backends(
            context.registry.attention_backends(),
            adapter.attention,
            dense=self.dense,
            dense_in_auto=self.dense_in_auto,
        )
        self._registry = context.registry
        self.attention_by_budget: dict[int, str] = {}
        """Which backend serves each budget's attention."""
        self._chosen: dict[tuple[int, int, int], str] = {}
        """The backend :meth:`choose_attention` chose for each room (budget, sequences,
        longest sequence), by name: kept for a warm start (:meth:`measured_choices`)."""
        self._current: contextvars.ContextVar[Any] = contextvars.ContextVar(
            f"layergraph_{family.name}_buffers", default=None
        )

    # ---- what the runner asks ----------------------------------------------------------------

    def sequence_of(self, call: PackedCall) -> Any:
        return f"up to {call.parts.slots} images"

    def eager_reason(self, call: PackedCall) -> str | None:
        if call.argument("output_attentions"):
            return "attention weights were asked for (output_attentions=True)"
        if not self.serves_hidden_states and call.argument("output_hidden_states"):
            return "hidden states were asked for (output_hidden_states=True)"
        return None

    @contextlib.contextmanager
    def bound(self, state: Any) -> Iterator[None]:
        token, any_plans = self._current.set(state), _BOUND.set(state)
        try:
            yield
        finally:
            _BOUND.reset(any_plans)
            self._current.reset(token)

    def current(self) -> Any:
        """The buffers bound now (a graph's warm-up and capture), or ``None`` (eager calls)."""
        return self._current.get()

    def layers(self) -> list[nn.Module]:
        return list(self._layers)

    @property
    def capture_module(self) -> nn.Module:
        return self.owner

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        changes.set_forward(self.owner, self.tower_forward(serve), "forward routed to the graphs")
        for module in self.attentions:
            changes.set_forward(module, self.routed_attention(module), self.attention_routing)

    @property
    def attention_routing(self) -> str:
        """What the routed attention forward does, for ``GraphedModule.changes``."""
        return "q, k and v of the packed images handed to the attention backend"

    def tower_forward(self, serve: Callable[..., Any]) -> Callable[..., Any]:
        """The tower's forward while wrapped: ``serve`` (the runner) itself."""
        return serve

    def routed_attention(self, module: nn.Module) -> Callable[..., Any]:
        """A forward for one attention module: :meth:`attend_packed` while buffers are bound,
        the module's own forward otherwise (eager calls)."""
        original = type(module).forward.__get__(module)

        def forward(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            buffers = self._current.get()
            if buffers is None:
                return original(hidden_states, *args, **kwargs)
            return self.attend_packed(module, buffers, hidden_states, *args, **kwargs)

        return forward

    def attend_packed(
        self,
        module: nn.Module,
        buffers: Any,
        hidden_states: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """One attention module's forward over a budget's packed tokens, as the module's own
        forward returns it; :meth:`attend` runs the backend."""
        raise NotImplementedError

    @staticmethod
    def attend(
        buffers: BudgetBuffers,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        metadata: AttentionMetadata | None = None,
        backend: AttentionBackend | None = None,
    ) -> torch.Tensor:
        """Attention of ``[tokens, heads, head_dim]`` q, k and v through the bound buffers'
        backend and metadata, one operator to ``torch.compile`` (``opaque_attention``: the
        compiled layers serve every budget); or through ``backend`` with ``metadata`` where
        given, in Python."""
        if metadata is None and backend is None:
            return opaque_attention(q, k, v, _ROUTE, scale)
        backend = backend or buffers.backend
        if not backend.takes_strided_inputs:
            v = v.contiguous()
        return backend(
            q,
            k,
            v,
            layout=SequenceLayout((buffers.budget,)),
            metadata=buffers.metadata if metadata is None else metadata,
            workspace=buffers.workspace,
            scale=scale,
        )

    # ---- packing -----------------------------------------------------------------------------

    def region(self, *args: Any, **kwargs: Any) -> Any:
        """A graph's body (:meth:`packed_forward`, given one budget's buffers, as
        :meth:`arguments` hands them over) or an eager call (the tower's own forward)."""
        if len(args) == 1 and not kwargs and isinstance(args[0], BudgetBuffers):
            return self.packed_forward(args[0])
        return self.eager(*args, **kwargs)

    def packed_forward(self, buffers: Any) -> Any:
        """The tower over one budget's buffers, as its graph captures it."""
        raise NotImplementedError(f"{type(self).__name__} has no packed forward")

    def eager(self, *args: Any, **kwargs: Any) -> Any:
        """A call no graph serves: the tower's own forward."""
        return self.own(*args, **kwargs)

    def piece(self, call: PackedCall, images: range) -> PackedCall:
        """The call of ``call``'s images in ``images`` alone (a piece of a split call)."""
        raise NotImplementedError

    def image_tokens(self, call: PackedCall) -> Sequence[int]:
        """The tokens of each of the call's images (or frames), in order."""
        return call.parts.counts

    def split(self, call: PackedCall, budget: int) -> list[PackedCall]:
        return [
            self.piece(call, images) for images in split_ranges(self.image_tokens(call), budget)
        ]

    def arguments(self, buffers: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (buffers,), {}

    def host_metadata(self, call: PackedCall[Any]) -> Mapping[str, torch.Tensor]:
        """The call's values of :attr:`staged_fields`, on the host, by name."""
        raise NotImplementedError(f"{type(self).__name__} declares no staged fields")

    def new_buffers(
        self,
        kind: type[BuffersT],
        budget: int,
        call: PackedCall[ImageParts],
        features: int,
        dtype: torch.dtype,
        pixels: torch.Tensor | None = None,
        **fields: Any,
    ) -> BuffersT:
        """A budget's buffers of ``kind``: zero patches (``[budget, features]``, ``dtype``, on
        the call's device; ``pixels`` instead, for a family whose inputs are not one row per
        token), the backend chosen on the call's images and its metadata
        (:meth:`choose_attention`, recorded in :attr:`attention_by_budget`), the workspace,
        :attr:`staged_fields` (sized by the call's values) and the family's own ``fields``."""
        parts, device = call.parts, call.tensors[0].device
        computing = self.computing(device)
        backend, metadata = self.choose_attention(
            budget, parts.slots, budget, parts.counts, computing
        )
        self.attention_by_budget[budget] = backend.name
        staged = None
        if self.staged_fields:
            values = self.host_metadata(call)
            staged = StagedMetadata.allocate(
                self.staged_fields, budget, parts.slots, values, device
            )
        return kind(
            budget=budget,
            pixels=(
                torch.zeros(budget, features, dtype=dtype, device=device)
                if pixels is None
                else pixels
            ),
            metadata=metadata,
            backend=backend,
            workspace=workspace(budget, self.heads, self.head_dim, computing, backend),
            staged=staged,
            **fields,
        )

    def computing(self, device: torch.device) -> torch.Tensor:
        """An empty tensor of the dtype the tower computes in (its first floating parameter's)
        on ``device``: what attention runs in and its workspace holds, whichever dtype a
        call's pixels have (a tower that casts them, :attr:`casts_inputs`)."""
        dtype = next(
            (p.dtype for p in self.owner.parameters() if p.is_floating_point()),
            torch.get_default_dtype(),
        )
        return torch.empty(0, dtype=dtype, device=device)

    def choose_attention(
        self,
        budget: int,
        slots: int,
        longest: int,
        lengths: Sequence[int],
        like: torch.Tensor,
    ) -> tuple[AttentionBackend, AttentionMetadata]:
        """The backend for one kind of attention of a budget's graph, timed (on a GPU, with
        ``attention="auto"``) on ``lengths``, the sequences of the budget's first call, in
        the budget's room of ``slots`` sequences of at most ``longest`` tokens; and its
        metadata, from the ``attention_metadata`` hook. ``like``: a tensor of the call's
        device and dtype."""
        device, dtype = like.device, like.dtype
        layout = PackedLayout(budget, slots, longest)
        sequences = tuple(length for length in lengths if length > 0)
        room = (budget, slots, longest)
        backend = self._known_choice(room, device, dtype, layout, sequences)
        if backend is None:
            backend = choose_packed_backend(
                self.attention,
                device,
                dtype,
                self.head_dim,
                layout,
                sequences,
                backends=self._backends,
                timer=packed_timer(device, dtype, self.heads, self.head_dim, self.v_in_qkv),
            )
        self._chosen[room] = backend.name
        return backend, self._registry.attention_metadata(backend, layout, device)

    def _known_choice(
        self,
        room: tuple[int, int, int],
        device: torch.device,
        dtype: torch.dtype,
        layout: PackedLayout,
        sequences: tuple[int, ...],
    ) -> AttentionBackend | None:
        """The backend chosen for ``room`` before (here, or in the process a warm start came
        from), with ``attention="auto"``, if it is still offered and can run; else ``None``."""
        name = self._chosen.get(room)
        if self.attention != "auto" or name is None:
            return None
        try:
            return choose_packed_backend(
                name,
                device,
                dtype,
                self.head_dim,
                layout,
                sequences,
                backends=self._backends,
                timer=None,
            )
        except (ValueError, RuntimeError):  # no longer offered, or cannot run here
            return None

    def measured_choices(self) -> dict[tuple[int, int, int], str]:
        """The attention backend chosen for each room, by name."""
        return dict(self._chosen)

    def take_measured_choices(self, choices: Any) -> None:
        self._chosen.update(choices)


def read_inputs(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    inputs: tuple[str, ...],
    options: frozenset[str],
    ignored: Iterable[str] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A call's ``inputs`` by name (given by position or keyword) and its other keyword
    arguments, those in ``ignored`` left out; :class:`~layergraph.keys.UnsupportedCall` for an
    argument past the inputs by position, an input given both ways, or an argument the graphs
    do not take (not in ``options``)."""
    if len(args) > len(inputs):
        raise UnsupportedCall(f"arguments past {inputs[-1]} were passed by position")
    given = dict(zip(inputs, args))
    if set(given) & set(kwargs):
        raise UnsupportedCall("an input was passed both by position and by keyword")
    skipped = set(ignored)
    rest = {
        name: value for name, value in kwargs.items() if name not in inputs and name not in skipped
    }
    unknown = sorted(set(rest) - options)
    if unknown:
        raise UnsupportedCall(f"arguments the graphs do not take: {', '.join(unknown)}")
    given.update((name, kwargs[name]) for name in inputs if name in kwargs)
    return given, rest


def image_slots(images: int, minimum: int = MIN_IMAGE_SLOTS) -> int:
    """The slots a graph holds for a call of ``images`` images: at least ``minimum``, else the
    next power of two."""
    return max(minimum, 1 << (images - 1).bit_length())


_BOUND: contextvars.ContextVar[BudgetBuffers | None] = contextvars.ContextVar(
    "layergraph_packed_buffers", default=None
)
"""The buffers bound now, whichever packed plan bound them (:func:`bound_buffers`)."""

_ROUTE = "packed"
"""The packed plans' routed attention's name for ``opaque_attention``."""


def bound_buffers() -> BudgetBuffers:
    """The buffers bound now by any packed plan (what routed attention reads); raises if none."""
    buffers = _BOUND.get()
    if buffers is None:
        raise RuntimeError("a packed tower's routed attention ran with no buffers bound")
    return buffers


def _attend_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k and v through the bound buffers' backend and metadata (at run time, opaque)."""
    bound = bound_buffers()
    return PackedTowerPlan.attend(bound, q, k, v, scale, bound.metadata, bound.backend)


register_route(_ROUTE, _attend_bound)
