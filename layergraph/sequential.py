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

Routing applies only inside the wrapper's forward: the model called directly runs as before.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .adapter import Adapter, AdapterMismatch, CapturePlan, WholeForward, own_forward

__all__ = ["SequentialAdapter"]


class SequentialAdapter(Adapter):
    """Graphs an ``nn.Sequential`` model, or the stack of layers named by ``stack``."""

    name = "sequential"
    generic = True

    def __init__(self, stack: str | None = None) -> None:
        self.stack = stack

    def recognizes(self, model: nn.Module) -> bool:
        return isinstance(model, nn.Sequential)

    def plan(self, model: nn.Module) -> CapturePlan:
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
    """Routes an inner ``nn.Sequential``'s forward to the graphs (an instance attribute)."""

    def __init__(self, model: nn.Module, stack: nn.Sequential) -> None:
        self.owner = model
        self._stack = stack
        self._forward = own_forward(stack)

    def region(self, *args: Any, **kwargs: Any) -> Any:
        return self._forward(*args, **kwargs)

    def layers(self) -> list[nn.Module]:
        return list(self._stack)

    def attach(self, serve: Callable[..., Any]) -> None:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if _inside_wrapper.get():
                return serve(*args, **kwargs)
            return self._forward(*args, **kwargs)

        self._stack.forward = forward

    def detach(self) -> None:
        self._stack.__dict__.pop("forward", None)


class _GraphedLayerList(nn.ModuleList):
    """An ``nn.ModuleList`` whose iteration, during a wrapped forward, runs the stack at once.

    Installed by changing the class of the user's list in place (and changed back on detach),
    so parameters, ``state_dict`` keys and identity stay the same.
    """

    _layergraph_serve: Callable[..., Any]

    def __iter__(self) -> Iterator[Any]:
        if not _inside_wrapper.get():
            return super().__iter__()
        passthrough = [_pass_through] * (len(self) - 1)
        return iter([self._layergraph_serve, *passthrough])

    def __getitem__(self, idx: int | slice) -> Any:
        if isinstance(idx, slice):
            return nn.ModuleList(list(self._modules.values())[idx])
        return super().__getitem__(idx)


def _pass_through(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x


class _LayerList(_ScopedRouting):
    """Captures ``for layer in layers: x = layer(x, *shared)`` over a user's ``nn.ModuleList``."""

    def __init__(self, model: nn.Module, layers: nn.ModuleList) -> None:
        if len(layers) == 0:
            raise AdapterMismatch("the named nn.ModuleList is empty")
        self.owner = model
        self._layers = layers
        self._layers_class = type(layers)

    def region(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        for index, layer in enumerate(nn.ModuleList.__iter__(self._layers)):
            x = layer(x, *args, **kwargs)
            if not isinstance(x, torch.Tensor):
                raise TypeError(
                    f"layer {index} ({type(layer).__name__}) returned {type(x).__name__}; the "
                    f"sequential adapter needs layers that return a tensor"
                )
        return x

    def layers(self) -> list[nn.Module]:
        return list(nn.ModuleList.__iter__(self._layers))

    def attach(self, serve: Callable[..., Any]) -> None:
        self._layers.__class__ = _GraphedLayerList
        self._layers._layergraph_serve = serve

    def detach(self) -> None:
        self._layers.__class__ = self._layers_class
        self._layers.__dict__.pop("_layergraph_serve", None)
