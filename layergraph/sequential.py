"""The generic adapter: any stack of layers applied in sequence that the user points at.

Three shapes of model are served, with no model knowledge at all:

- the model is an ``nn.Sequential``: its whole forward is captured;
- ``stack="path.to.seq"`` names an ``nn.Sequential`` inside the model: during a forward
  through the wrapper, that module's forward is served by the graphs and the rest of the model
  runs eagerly around it;
- ``stack="path.to.list"`` names an ``nn.ModuleList`` that the model's forward iterates as
  ``for layer in self.layers: x = layer(x, *shared_args, **shared_kwargs)``. During a forward
  through the wrapper, iterating the list yields one step that runs the whole stack (from a
  graph) followed by steps that pass ``x`` through unchanged; indexing, ``len`` and iteration
  anywhere else see the real layers. Each layer must return a tensor.

That last promise is checked, not assumed: the first forward through the wrapper runs the real
layers and watches them (:class:`_LayerCallCheck`). Every layer must be called with the
previous layer's output and with the same other arguments as the first layer, every layer
must be called, and nothing but the next layer may read a layer's output (no hidden states
kept, no side outputs between layers). A model that does otherwise (windowed and full
attention in alternate layers, deep-stack features taken between layers) gets
:class:`~layergraph.AdapterMismatch` naming the layer, on that call and every later one.

Routing applies inside the wrapper's forward and the model's methods called through the
wrapper (``graphed.generate(...)``): the model called directly runs as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .adapter import (
    Adapter,
    AdapterMismatch,
    CapturePlan,
    PlanContext,
    WholeForward,
    own_forward,
)
from .ledger import ChangeLedger

__all__ = ["SequentialAdapter"]


class SequentialAdapter(Adapter):
    """Graphs an ``nn.Sequential`` model, or the stack of layers named by ``stack``."""

    name = "sequential"
    generic = True

    def __init__(self, stack: str | None = None) -> None:
        self.stack = stack

    def recognizes(self, model: nn.Module) -> bool:
        return isinstance(model, nn.Sequential)

    def plan(self, model: nn.Module, context: PlanContext) -> CapturePlan:
        if self.stack is None:
            if not isinstance(model, nn.Sequential):
                raise AdapterMismatch(
                    f"the sequential adapter needs an nn.Sequential model or stack='path' naming "
                    f"one inside it; got {type(model).__name__} and no stack"
                )
            return _WholeSequential(model)
        try:
            target = model.get_submodule(self.stack)
        except AttributeError as error:
            raise AdapterMismatch(f"stack={self.stack!r}: {error}") from None
        if isinstance(target, nn.Sequential):
            return _SequentialStack(model, target)
        if isinstance(target, nn.ModuleList):
            return _LayerList(model, target)
        raise AdapterMismatch(
            f"stack={self.stack!r} is a {type(target).__name__}; it must be an nn.Sequential "
            f"or an nn.ModuleList"
        )


CHECKING_REASON = "the first wrapped call runs the layers eagerly to check how they are called"
"""The reason ``stats.eager_calls`` counts the checking call of a stack of layers under."""

_inside_wrapper: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "layergraph_inside_wrapper", default=False
)


class _ScopedRouting(CapturePlan):
    """Routes the region to the graphs only while a forward through the wrapper runs."""

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        token = _inside_wrapper.set(True)
        try:
            yield
        finally:
            _inside_wrapper.reset(token)


class _WholeSequential(WholeForward):
    """An ``nn.Sequential`` model: its whole forward, its children as the layers."""

    def layers(self) -> list[nn.Module]:
        return list(self.owner)


class _SequentialStack(_ScopedRouting):
    """Routes an inner ``nn.Sequential``'s forward to the graphs (an instance ``forward``)."""

    def __init__(self, model: nn.Module, stack: nn.Sequential) -> None:
        self.owner = model
        self._stack = stack
        self._forward = own_forward(stack)

    def region(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def layers(self) -> list[nn.Module]:
        return list(self._stack)

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        own = self._forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if _inside_wrapper.get():
                return serve(*args, **kwargs)
            return own(*args, **kwargs)

        changes.set_forward(self._stack, forward, "forward routed to the graphs in wrapped calls")


class _GraphedLayerList(nn.ModuleList):
    """An ``nn.ModuleList`` whose iteration, during a wrapped forward, runs the stack at once.

    Installed by changing the class of the user's list in place (a change in the wrapper's
    ledger, undone on unwrap), so parameters, ``state_dict`` keys and identity stay the same.
    """

    _layergraph_plan: _LayerList

    def __iter__(self) -> Iterator[Any]:
        if not _inside_wrapper.get():
            return super().__iter__()
        return iter(self._layergraph_plan.steps())

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)


def _pass_through(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


class _LayerList(_ScopedRouting):
    """Captures ``for layer in layers: x = layer(x, *shared)`` over a user's ``nn.ModuleList``.

    Until one wrapped forward has shown that the model iterates its layers that way
    (:class:`_LayerCallCheck`), iterating the list runs the real layers, watched.
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        if len(layers) == 0:
            raise AdapterMismatch("the named nn.ModuleList is empty")
        self.owner = model
        self._layers = layers
        self._serve: Callable[..., Any] | None = None
        self._check = _LayerCallCheck(len(layers))

    def region(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for index, layer in enumerate(self.layers()):
            x = layer(x, *args, **kwargs)
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"layer {index} ({type(layer).__name__}) returned {type(x).__name__}; the "
                    f"sequential adapter needs layers that return a tensor"
                )
        return x

    def layers(self) -> list[nn.Module]:
        return list(nn.ModuleList.__iter__(self._layers))

    def change_model(self, changes: ChangeLedger, serve: Callable[..., Any]) -> None:
        self._serve = serve
        changes.swap_class(
            self._layers, _GraphedLayerList, "iterated as one graphed step in wrapped calls"
        )
        changes.set_attribute(self._layers, "_layergraph_plan", self, "the plan it asks")

    def steps(self) -> list[Callable[..., Any]]:
        """What iterating the list yields in a wrapped call: the graphed stack then
        pass-throughs, or the real layers watched until the check has passed."""
        if self._check.passed:
            return [self._serve, *[_pass_through] * (len(self._layers) - 1)]
        steps = self._check.watch(self.layers())
        count = getattr(self._serve, "count_eager", None)
        if count is not None:
            count(CHECKING_REASON)
        return steps

    @contextlib.contextmanager
    def forward_scope(self) -> Iterator[None]:
        with super().forward_scope():
            yield
            self._check.finish()


class _WatchedOutput(torch.Tensor):
    """A layer's output on its way to the next layer; any other read of it is noted."""

    _layergraph_reads: list[str]

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        name = torch.overrides.resolve_name(func) or getattr(func, "__name__", str(func))
        if name not in _METADATA_READS:
            for arg in (*args, *(kwargs or {}).values()):
                if isinstance(arg, _WatchedOutput):
                    arg._layergraph_reads.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


_METADATA_READS = frozenset(
    f"torch.Tensor.{name}"
    for name in ("shape.__get__", "dtype.__get__", "device.__get__", "ndim.__get__", "size", "dim")
)
"""Reads of a layer's output that do not use its values, allowed between layers."""


class _LayerCallCheck:
    """Checks, over one wrapped forward, that the layers are called as one stack.

    :meth:`watch` gives the steps one iteration of the list runs: the real layers, each
    checking its call against the first layer's, and handing on its output as a
    :class:`_WatchedOutput`. :meth:`finish`, at the end of the wrapped forward, checks that
    every layer ran and that no output but the last was read by anything but the next layer
    or is still held. A failed check raises :class:`AdapterMismatch` then and on every later
    call; a forward that fails for another reason leaves the check to the next one.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.passed = False
        self._refusal: str | None = None
        self._iterations: list[_Iteration] = []

    def watch(self, layers: list[nn.Module]) -> list[Callable[..., Any]]:
        if self._refusal is not None:
            raise AdapterMismatch(self._refusal)
        iteration = _Iteration(self)
        self._iterations.append(iteration)
        return [iteration.step(index, layer) for index, layer in enumerate(layers)]

    def refuse(self, reason: str) -> AdapterMismatch:
        self._refusal = (
            f"the sequential adapter replays the whole stack for the first layer's call and "
            f"passes the other layers through, which this model does not allow: {reason}"
        )
        self._iterations = []
        return AdapterMismatch(self._refusal)

    def finish(self) -> None:
        iterations, self._iterations = self._iterations, []
        if self._refusal is not None:
            raise AdapterMismatch(self._refusal)
        for iteration in iterations:
            iteration.finish()
        if iterations:
            self.passed = True


class _Iteration:
    """One iteration of the layer list in a checked forward."""

    def __init__(self, check: _LayerCallCheck) -> None:
        self._check = check
        self._first: tuple[tuple[Any, ...], dict[str, Any]] | None = None
        self._handed_on: weakref.ref[_WatchedOutput] | None = None
        self._outputs: list[tuple[weakref.ref[_WatchedOutput], list[str]]] = []
        """Each output handed on, and the reads of it noted (kept past the output's life)."""
        self.calls = 0

    def step(self, index: int, layer: nn.Module) -> Callable[..., Any]:
        def run(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            x = self._arrive(index, x, args, kwargs)
            out = layer(x, *args, **kwargs)
            if not isinstance(out, torch.Tensor):
                raise self._check.refuse(
                    f"layer {index} ({type(layer).__name__}) returned {type(out).__name__}, "
                    f"not a tensor"
                )
            self.calls += 1
            if index == self._check.depth - 1:
                return out
            watched = out.as_subclass(_WatchedOutput)
            watched._layergraph_reads = []
            self._handed_on = weakref.ref(watched)
            self._outputs.append((weakref.ref(watched), watched._layergraph_reads))
            return watched

        return run

    def _arrive(
        self, index: int, x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """Check layer ``index``'s call; returns its input as a plain tensor."""
        if index != self.calls:
            raise self._check.refuse(f"layer {index} was called after {self.calls} layers")
        if index == 0:
            self._first = (args, kwargs)
            return x
        handed_on = self._handed_on() if self._handed_on is not None else None
        if x is not handed_on:
            raise self._check.refuse(
                f"layer {index} was not called with layer {index - 1}'s output"
            )
        difference = _difference(self._first, (args, kwargs))
        if difference is not None:
            raise self._check.refuse(
                f"layer {index} was called with another {difference} than layer 0"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)

    def finish(self) -> None:
        if self.calls != self._check.depth:
            raise self._check.refuse(
                f"the forward called {self.calls} of the {self._check.depth} layers"
            )
        for index, (output, reads) in enumerate(self._outputs):
            if reads:
                named = ", ".join(sorted(set(reads)))
                raise self._check.refuse(f"the model reads layer {index}'s output itself ({named})")
            if output() is not None:
                raise self._check.refuse(f"the model keeps layer {index}'s output (hidden states)")


def _difference(
    first: tuple[tuple[Any, ...], dict[str, Any]] | None,
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> str | None:
    """Which argument of ``call`` differs from ``first``'s, or ``None`` if none does.

    Positional arguments are counted from the layer's input, argument 1."""
    assert first is not None
    (first_args, first_kwargs), (args, kwargs) = first, call
    if len(args) != len(first_args) or set(kwargs) != set(first_kwargs):
        return "set of arguments"
    pairs = [(f"argument {i + 2}", a, b) for i, (a, b) in enumerate(zip(first_args, args))]
    pairs += [(f"argument {name!r}", first_kwargs[name], kwargs[name]) for name in kwargs]
    for label, a, b in pairs:
        if not _alike(a, b):
            return label
    return None


def _alike(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # values that cannot be compared are not alike
        return False
