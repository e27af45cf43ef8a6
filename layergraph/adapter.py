"""Adapters and capture plans: the model knowledge the runner asks for.

An :class:`Adapter` is registered under a name and turns a model into a :class:`CapturePlan`.
A plan describes one region of that model: the computation graphs replace, the module whose
parameters and mode decide whether a graph may serve, what fixes a graph besides the batch
size, which inputs the model cannot take, and how calls reach the region. The runner knows
only plans, never models.

Making a plan reads the model and changes nothing; every change a plan needs while the model
is wrapped (calls routed to the graphs, rewritten forwards, fused weights) is made in
:meth:`CapturePlan.change_model`, through the wrapper's :class:`~layergraph.ledger.ChangeLedger`,
which undoes it all on ``unwrap()``.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
from torch import nn

from .keys import CallInputs, ShapeKey
from .ledger import ChangeLedger
from .packing import Packing
from .warn import LayergraphDeprecationWarning

if TYPE_CHECKING:
    from .attention.backends import AttentionBackend
    from .attention.layout import AttentionMetadata, PackedLayout, SequenceLayout
    from .bench.example_model import ExampleModel

__all__ = [
    "PLUGIN_API_VERSION",
    "Adapter",
    "AdapterMismatch",
    "AttentionRegistry",
    "CapturePlan",
    "PlanContext",
    "WholeForward",
    "own_forward",
]


PLUGIN_API_VERSION = 2
"""The version of the adapter interface plugins implement: 2 since layergraph 0.2, where
:meth:`Adapter.plan` takes ``(model, context)``; 1 was ``plan(model)``, which still works
with a ``LayergraphDeprecationWarning`` until 0.3 (:func:`plan_api_version`)."""


class AdapterMismatch(TypeError):
    """An adapter was given a model it does not serve."""


class CapturePlan:
    """One region of one model that CUDA graphs replace.

    Subclasses set :attr:`owner` and implement :meth:`region`; the other methods have defaults
    that suit a region whose inputs are plain batched tensors. A plan does not capture, pad or
    keep statistics: the runner does, through the plan's answers.
    """

    owner: nn.Module
    """The module whose parameters, ``training`` flag, device and dtype the runner checks."""

    serves_forward: ClassVar[bool] = False
    """True when the region *is* the wrapped model's forward: the wrapper then calls the runner
    directly. False when the region sits inside the model: the wrapper calls the model, and
    :meth:`change_model` has routed the region's calls to the runner."""

    batch_independent: ClassVar[bool] = True
    """Whether each row of the batch is computed independently of the others, so that a batch
    may be padded with zero rows or split into chunks. False: only exact batch sizes replay.
    (Outputs that are not one row per input, a loss averaged over the batch say, are found at
    capture and never padded or split, whatever this says.)"""

    packing: Packing | None = None
    """How calls pack into token budgets, for a region whose inputs are many images of
    different sizes in one sequence (:mod:`layergraph.packing`); ``None``: calls are batches.
    With a packing, keys are token budgets, the packing's buffers are the per-key state
    (:meth:`key_state` is not asked), and calls reach the other methods as
    :class:`~layergraph.packing.PackedCall` objects."""

    casts_inputs: bool = False
    """True when the region casts its floating-point inputs to the owner's dtype before using
    them (most transformers patch embeddings do): a call whose floating inputs have another
    dtype (float32 pixels from a processor in front of bfloat16 weights) is then served by
    graphs of that input dtype, which capture the cast. False: such a call runs eagerly, and
    the model's own error, if it raises one, is explained."""

    speed_options: Mapping[str, str] = MappingProxyType({})
    """What each speed option of the adapter that made this plan became: ``"on"``, ``"off"``,
    or ``"off: why"`` for one left to ``"auto"`` that does not fit here. Empty for adapters
    without speed options."""

    def region(self, *args: Any, **kwargs: Any) -> Any:
        """Compute the region eagerly. This is what is captured, and what eager calls run."""
        raise NotImplementedError

    def sequence_of(self, call: CallInputs) -> Hashable:
        """What fixes the graph besides the batch size; shown in keys and statistics.

        The default is the per-sample shape and dtype of every tensor argument.
        """
        specs = call.sample_specs
        return specs[0] if len(specs) == 1 else specs

    def eager_reason(self, call: CallInputs) -> str | None:
        """Why the model's own semantics need this call to run eagerly, or ``None``.

        Checked after the runner's own checks, on every call: keep it cheap.
        """
        return None

    def check_inputs(self, call: CallInputs) -> None:
        """Raise ``ValueError`` naming the problem if the model cannot take these inputs.

        Called before anything is captured, so a bad input leaves nothing behind.
        """

    def key_state(self, key: ShapeKey, call: CallInputs) -> Any:
        """Buffers a graph of ``key`` needs besides its inputs, built once before its capture.

        Attention metadata and workspaces go here. The runner keeps the returned object alive
        with the graph and binds it (:meth:`bound`) around the warm-up and capture runs, so its
        tensors keep the addresses the graph baked in. ``None`` (the default): nothing.
        """
        return None

    @contextlib.contextmanager
    def bound(self, state: Any) -> Iterator[None]:
        """Context in which :meth:`region` uses ``state`` from :meth:`key_state`.

        Outside it, the region builds whatever it needs for the call at hand (eager calls).
        """
        yield

    def layers(self) -> list[nn.Module]:
        """The repeated layers of the region, for ``compile_layers``; empty if not known."""
        return []

    @property
    def capture_module(self) -> nn.Module | None:
        """The module whose call drives ahead-of-time capture; ``None``: the wrapped model.

        A plan serving a vision tower inside a larger model names the tower, so that
        ``capture(pixel_values)`` works without the larger model's other inputs.
        """
        return None

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        """Make the changes to the model this plan needs while it is wrapped, through
        ``changes``: route the region's calls inside the model to ``serve`` (for a region
        inside the model), rewrite what it computes otherwise. An eager run the plan makes on
        its own (a field the graphs left out, computed when read) is counted with
        ``serve.count_eager(reason, size)``, so that ``stats`` shows it.

        Called once, when the model is wrapped; ``unwrap()`` undoes every change recorded in
        ``changes``, newest first, and ``GraphedModule.original()`` undoes and re-applies
        them. The default makes no change: a whole-forward plan is called by the wrapper.
        """

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        """Context the wrapper enters around each forward call; routing may depend on it."""
        yield

    def measured_choices(self) -> Any:
        """What this plan chose by timing on this GPU that a replica may take instead of
        timing again (which attention backend each token budget's room took, say), picklable,
        for a warm-start file (:meth:`GraphedModule.save_warm_start
        <layergraph.GraphedModule.save_warm_start>`); ``None`` (the default): nothing."""
        return None

    def take_measured_choices(self, choices: Any) -> None:
        """Take what :meth:`measured_choices` returned in another process for the same model,
        adapter and options on the same GPU and versions (a warm start), before any call. A
        choice that cannot serve here is made again, as if never given. The default takes
        nothing."""


def own_forward(module: nn.Module) -> Callable[..., Any]:
    """``module``'s forward as its class defines it, refusing a module already routed.

    A plan that routes a module in place installs an instance ``forward``; reading
    ``module.forward`` then would give that routing, not the computation.
    """
    if "forward" in module.__dict__:
        raise RuntimeError(
            f"this {type(module).__name__} is already routed to graphs by another wrapper; "
            f"unwrap() that one first"
        )
    return type(module).forward.__get__(module)


class WholeForward(CapturePlan):
    """The model's whole forward is the region: patch embedding, layers, norm and head.

    Suits models whose forward is static for a given input shape (no data-dependent control
    flow, no host synchronisation), such as timm's ViTs or an ``nn.Sequential``.
    """

    serves_forward = True

    def __init__(self, model: nn.Module) -> None:
        self.owner = model

    def region(self, *args: Any, **kwargs: Any) -> Any:
        return self.owner(*args, **kwargs)


class AttentionRegistry(Protocol):
    """What a plan may ask of the plugin registry it is made with: the attention backends
    plugins registered, and the metadata their hooks build. The registry
    (:class:`~layergraph.plugins.AdapterRegistry`) is one; a test may pass its own."""

    def attention_backend(self, name: str) -> AttentionBackend:
        """The backend registered as ``name``; a clear error if there is none."""
        ...

    def attention_backend_names(self) -> tuple[str, ...]:
        """The names of the registered backends, in the order they were registered."""
        ...

    def attention_backends(self) -> tuple[AttentionBackend, ...]:
        """The registered backends, in the order they were registered."""
        ...

    def attention_metadata(
        self,
        backend: str | AttentionBackend,
        layout: SequenceLayout | PackedLayout,
        device: torch.device,
    ) -> AttentionMetadata:
        """The metadata for ``backend`` and ``layout``: the first plugin's, else the
        backend's own."""
        ...


@dataclass(frozen=True)
class PlanContext:
    """What :meth:`Adapter.plan` is given besides the model."""

    registry: AttentionRegistry
    """The attention backends of the plugin registry the model is wrapped with
    (:meth:`~AttentionRegistry.attention_backend`) and their metadata
    (:meth:`~AttentionRegistry.attention_metadata`)."""

    compiled: bool = False
    """Whether the region or its layers will be compiled with ``torch.compile``
    (``compile_layers`` or ``compile_region``), which fuses elementwise work itself."""

    part_planner: Callable[[nn.Module, Mapping[str, Any]], tuple[Adapter, CapturePlan]] | None = (
        field(default=None, repr=False)
    )
    """What :meth:`plan_part` asks; set by :func:`layergraph.wrap`."""

    def plan_part(
        self, part: nn.Module, options: Mapping[str, Any] | None = None
    ) -> tuple[Adapter, CapturePlan]:
        """The adapter ``adapter="auto"`` chooses for ``part``, a module inside the model being
        planned, made with ``options``, and its plan for ``part``.

        For adapters of containers (a ``SentenceTransformer``, a pipeline object) whose
        graphable part another adapter serves: the container's plan can be the part's plan
        when that plan routes calls inside the part (``serves_forward`` false), since the
        container's own forward then reaches the graphs through the part. Raises
        :class:`~layergraph.plugins.UnknownAdapterError` when no adapter recognises ``part``.
        """
        if self.part_planner is None:
            raise RuntimeError("this PlanContext was made without a part planner (wrap() sets one)")
        return self.part_planner(part, dict(options or {}))


class Adapter:
    """Model knowledge for one family of models, registered under :attr:`name`.

    Subclass it and implement :meth:`plan`; register the class (or an instance) through the
    ``register_adapters`` hook, or pass an instance straight to :func:`layergraph.wrap`.
    Keyword options given to ``wrap`` that the runner does not take go to the adapter's
    constructor.
    """

    name: ClassVar[str] = ""
    """The name users pass as ``wrap(model, adapter=name)``."""

    generic: ClassVar[bool] = False
    """Whether this adapter serves models by their shape rather than their family; with
    ``adapter="auto"`` generic adapters are asked only after every dedicated one."""
    inside_any_model: ClassVar[bool] = True
    """Whether a part this adapter recognises may be served in place inside a model no adapter
    recognises, its forward routed to the graphs whatever calls it
    (:mod:`layergraph.multi_tower`); an adapter whose plans rely on how known models call the
    part says no."""

    def recognizes(self, model: nn.Module) -> bool:
        """Whether this adapter serves ``model`` (for ``adapter="auto"``).

        Called on an instance made with default options. Must not import frameworks the user
        did not import.
        """
        return False

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        """The region of ``model`` to capture; raise :class:`AdapterMismatch` for other models.

        Reads the model and changes nothing (changes go in :meth:`CapturePlan.change_model`).
        ``context`` holds what a plan may need from layergraph besides the model.
        """
        raise NotImplementedError

    def example_models(self) -> list[str]:
        """Deprecated (goes in 0.3): the names of the models :meth:`example_model` builds.
        Example models come from a plugin's ``example_model_names`` hook now."""
        return []

    def example_model(self, name: str) -> ExampleModel | None:
        """Deprecated (goes in 0.3): the example model called ``name``, or ``None``. Example
        models come from a plugin's ``example_model`` hook now
        (:mod:`layergraph.bench.examples`)."""
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} adapter {self.name!r}>"


def plan_api_version(adapter: Any) -> int:
    """The plugin API an adapter (class, instance or factory returning one) was written for:
    1 where its ``plan`` takes the model alone, else :data:`PLUGIN_API_VERSION`."""
    plan = getattr(adapter, "plan", None)
    if plan is None:
        return PLUGIN_API_VERSION
    try:
        parameters = list(inspect.signature(plan).parameters.values())
    except (TypeError, ValueError):
        return PLUGIN_API_VERSION
    if isinstance(adapter, type):  # the function as the class holds it: self comes first
        parameters = parameters[1:]
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters):
        return PLUGIN_API_VERSION
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return 1 if len(positional) == 1 else PLUGIN_API_VERSION


def make_plan(adapter: Adapter, model: nn.Module, context: PlanContext) -> CapturePlan:
    """``adapter.plan(model, context)``, or for an adapter written for plugin API 1
    (``plan(model)``) ``adapter.plan(model)`` with a ``LayergraphDeprecationWarning`` naming it."""
    if plan_api_version(adapter) == 1:
        warnings.warn(
            f"adapter {adapter.name!r} ({type(adapter).__module__}.{type(adapter).__qualname__}) "
            f"defines plan(model), the form of layergraph's plugin API 1; since layergraph 0.2 "
            f"plan takes (model, context) (PLUGIN_API_VERSION {PLUGIN_API_VERSION}). The old "
            f"form works until layergraph 0.3: add a context parameter to update it",
            LayergraphDeprecationWarning,
            stacklevel=3,
        )
        return adapter.plan(model)  # type: ignore[call-arg]
    return adapter.plan(model, context)


def __getattr__(name: str) -> Any:
    """``ExampleModel``, moved to :mod:`layergraph.bench.examples`, with a
    ``LayergraphDeprecationWarning`` (the old path goes in 0.3)."""
    if name == "ExampleModel":
        return moved_example_model(__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def moved_example_model(where: str) -> type:
    """:class:`~layergraph.bench.examples.ExampleModel`, asked for by its old path ``where``."""
    from .bench.example_model import ExampleModel

    warnings.warn(
        f"{where}.ExampleModel moved to layergraph.bench.examples.ExampleModel (the old path "
        f"goes in 0.3)",
        LayergraphDeprecationWarning,
        stacklevel=3,
    )
    return ExampleModel
